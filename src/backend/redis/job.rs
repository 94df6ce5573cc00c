//! [`Job`]: one operation of the Redis store as a value (what it does, its
//! key, its token and arguments), how it is written on the wire (alone, as
//! its own script call: `EVALSHA`, `EVAL` when the server lacks the script;
//! or as its entry in the batch script), and how its answer is read
//! ([`Reply`]).
//!
//! This is the one place that turns an operation into a command and a
//! command's answer into the store's: as a script here, as native commands
//! (`DELIFEQ`, `SET … IFEQ`, where the server has them) in `job/native.rs`.
//! The hubs (`lock.rs`, `records.rs`), the dispatch and the delivery only
//! ever hold jobs and replies.
//!
//! | operation | keys | script |
//! |---|---|---|
//! | lease acquire | lease (+ `lease:wait` when marked) | `ACQUIRE_LUA` (`ACQUIRE_WAIT_LUA`); batchable unmarked |
//! | fenced acquire | lease, `lease:fence` (+ `lease:wait`) | `ACQUIRE_FENCED_LUA` |
//! | release | lease (+ `lease:wait` to notify) | `RELEASE_LUA` (`RELEASE_NOTIFY_LUA`); batchable without notify |
//! | extend | lease | `EXTEND_LUA`; batchable |
//! | claim, complete, extend claim, abandon | entry, scope quota, scope bytes | `CLAIM_LUA`, `COMPLETE_LUA`, `EXTEND_CLAIM_LUA`, `ABANDON_LUA` |

use std::time::Duration;

use bytes::Bytes;
use fred::clients::Client;
use fred::error::Error as FredError;
use fred::interfaces::ClientLike;
use fred::types::config::Options;
use fred::types::{Key, Value};

use super::scripts::{self, as_int, bytes_of, flag, map_err, protocol, Script};
use crate::backend::{Acquire, BackendError, BackendErrorKind, Claim, ClaimTerms, EntryKey};

/// Suffix of the fencing counter's key.
const FENCE_SUFFIX: &[u8] = b":fence";
/// Suffix of the mark of a key that requests wait for (`lease:wait`).
const WAIT_SUFFIX: &[u8] = b":wait";

/// One operation on Redis: its key (which also picks its connection), the
/// token it acts for, and what it does. Cheap to clone (keys and arguments
/// are reference-counted): a delivery retries the same value. The token
/// comes as it is stored in Redis, 32 hex characters
/// ([`Token::to_hex`](crate::backend::contract::Token::to_hex)).
#[derive(Clone, Debug)]
pub(crate) struct Job {
    /// The lease, or the idempotency entry: its connection is this key's.
    pub(super) key: Key,
    /// The token as 32 hex characters, as stored in Redis.
    token: [u8; 32],
    op: Op,
}

#[derive(Clone, Debug)]
enum Op {
    /// Take a lease; `mark`: also mark it as waited for if held.
    Acquire {
        ttl_ms: i64,
        mark: bool,
    },
    /// Take a lease with its fencing token (`fence_life`: the counter's
    /// life in ms).
    AcquireFenced {
        ttl_ms: i64,
        fence_life: i64,
        mark: bool,
    },
    /// Compare-and-delete; `notify`: publish if the key is marked.
    Release {
        notify: bool,
    },
    /// Compare-and-expire.
    Extend {
        ttl_ms: i64,
    },
    Claim {
        scope: Scope,
        fingerprint: Bytes,
        lease_ms: i64,
        max_entries: i64,
        max_bytes: i64,
    },
    Complete {
        scope: Scope,
        fingerprint: Bytes,
        record: Bytes,
        retention_ms: i64,
    },
    ExtendClaim {
        scope: Scope,
        lease_ms: i64,
    },
    Abandon {
        scope: Scope,
        lease_ms: i64,
    },
}

/// The scope of an idempotency entry: its quota keys (same hash slot as the
/// entry) and the entry's name in it.
#[derive(Clone, Debug)]
struct Scope {
    quota: Key,
    bytes: Key,
    member: Bytes,
}

impl Scope {
    fn of(key: &EntryKey) -> Self {
        Self {
            quota: scope_key(key, ":idem-quota"),
            bytes: scope_key(key, ":idem-bytes"),
            member: key.member.clone(),
        }
    }
}

/// A per-scope key of `key`'s scope: the scope prefix with `suffix` (same
/// hash slot: the scope is the hash tag).
fn scope_key(key: &EntryKey, suffix: &str) -> Key {
    let mut out = Vec::with_capacity(key.scope.len() + suffix.len());
    out.extend_from_slice(&key.scope);
    out.extend_from_slice(suffix.as_bytes());
    Key::from(Bytes::from(out))
}

/// A TTL in whole milliseconds, rounded up (the lease in Redis never ends
/// before the one this process counts from the same TTL), at least 1
/// (`PX 0` is an error in Redis) and at most ten years (Redis refuses an
/// expiry that overflows its clock: `invalid expire time`).
pub(crate) fn ttl_millis(ttl: Duration) -> i64 {
    crate::settings::at_most_max(ttl)
        .as_nanos()
        .div_ceil(1_000_000)
        .clamp(1, i64::MAX as u128) as i64
}

/// A count as a script argument (Lua reads numbers as doubles; anything
/// larger than `i64::MAX` is "no limit" anyway).
fn count(n: u64) -> i64 {
    n.min(i64::MAX as u64) as i64
}

impl Job {
    fn lease(key: &Bytes, token: [u8; 32], op: Op) -> Self {
        Self {
            key: Key::from(key.clone()),
            token,
            op,
        }
    }

    fn entry(key: &EntryKey, token: [u8; 32], op: Op) -> Self {
        Self {
            key: Key::from(key.entry.clone()),
            token,
            op,
        }
    }

    /// Take the lease on `key` for `ttl`; `mark` it as waited for when it
    /// is held (this process waits for it).
    pub(crate) fn acquire(key: &Bytes, token: [u8; 32], ttl: Duration, mark: bool) -> Self {
        let ttl_ms = ttl_millis(ttl);
        Self::lease(key, token, Op::Acquire { ttl_ms, mark })
    }

    /// Take the lease with a fencing token; its counter lives `fence_life`.
    pub(crate) fn acquire_fenced(
        key: &Bytes,
        token: [u8; 32],
        ttl: Duration,
        fence_life: Duration,
        mark: bool,
    ) -> Self {
        let op = Op::AcquireFenced {
            ttl_ms: ttl_millis(ttl),
            // Bounded well below what Redis accepts as an expiry (now + ms
            // in an i64).
            fence_life: ttl_millis(fence_life).min(i64::MAX / 4),
            mark,
        };
        Self::lease(key, token, op)
    }

    /// Delete the lease if it is ours; `notify` waiters if it is marked.
    pub(crate) fn release(key: &Bytes, token: [u8; 32], notify: bool) -> Self {
        Self::lease(key, token, Op::Release { notify })
    }

    /// Reset the lease's expiry to `ttl` if it is ours.
    pub(crate) fn extend(key: &Bytes, token: [u8; 32], ttl: Duration) -> Self {
        let ttl_ms = ttl_millis(ttl);
        Self::lease(key, token, Op::Extend { ttl_ms })
    }

    /// Claim an idempotency entry (see `CLAIM_LUA`).
    pub(crate) fn claim(
        key: &EntryKey,
        token: [u8; 32],
        fingerprint: &[u8],
        terms: &ClaimTerms,
    ) -> Self {
        let op = Op::Claim {
            scope: Scope::of(key),
            fingerprint: Bytes::copy_from_slice(fingerprint),
            lease_ms: ttl_millis(terms.lease),
            max_entries: count(terms.max_entries),
            max_bytes: count(terms.max_bytes),
        };
        Self::entry(key, token, op)
    }

    /// Our claim becomes `record`, kept for `retention`.
    pub(crate) fn complete(
        key: &EntryKey,
        token: [u8; 32],
        fingerprint: &[u8],
        record: &Bytes,
        retention: Duration,
    ) -> Self {
        let op = Op::Complete {
            scope: Scope::of(key),
            fingerprint: Bytes::copy_from_slice(fingerprint),
            record: record.clone(),
            retention_ms: ttl_millis(retention),
        };
        Self::entry(key, token, op)
    }

    /// Push our claim's expiry out to `lease`.
    pub(crate) fn extend_claim(key: &EntryKey, token: [u8; 32], lease: Duration) -> Self {
        let op = Op::ExtendClaim {
            scope: Scope::of(key),
            lease_ms: ttl_millis(lease),
        };
        Self::entry(key, token, op)
    }

    /// Free our claim, or leave a tombstone for one still on its way.
    pub(crate) fn abandon(key: &EntryKey, token: [u8; 32], lease: Duration) -> Self {
        let op = Op::Abandon {
            scope: Scope::of(key),
            lease_ms: ttl_millis(lease),
        };
        Self::entry(key, token, op)
    }

    /// What the job is, for messages (`"release"`, `"abandon"`, …).
    pub(crate) fn what(&self) -> &'static str {
        match self.op {
            Op::Acquire { .. } | Op::AcquireFenced { .. } => "acquire",
            Op::Release { .. } => "release",
            Op::Extend { .. } => "extend",
            Op::Claim { .. } => "claim",
            Op::Complete { .. } => "complete",
            Op::ExtendClaim { .. } => "extend claim",
            Op::Abandon { .. } => "abandon",
        }
    }

    /// Whether the job may share a batch script with others: one key, and
    /// one of the operations the batch script runs.
    pub(crate) fn batchable(&self) -> bool {
        matches!(
            self.op,
            Op::Acquire { mark: false, .. } | Op::Release { notify: false } | Op::Extend { .. }
        )
    }

    /// Whether the job is a plain release (the one a batch on the native
    /// road sends as `DELIFEQ`).
    pub(crate) fn is_release(&self) -> bool {
        matches!(self.op, Op::Release { notify: false })
    }

    /// Whether the job must keep its place in its lane's queue: a lease's
    /// steps (a release never overtakes its acquire, and batching needs
    /// the queue). An idempotency step goes out at once on the lane's
    /// connection instead, pipelined by fred with the other requests'
    /// steps: the layer awaits each step of an entry before the next, and
    /// a claim that an abandon overtakes finds the abandon's tombstone
    /// (`ABANDON_LUA`), so its order holds without waiting for the lane's
    /// batch in flight.
    pub(crate) fn keeps_lane(&self) -> bool {
        matches!(
            self.op,
            Op::Acquire { .. } | Op::AcquireFenced { .. } | Op::Release { .. } | Op::Extend { .. }
        )
    }

    /// Whether a job still queued may be left unsent once its caller
    /// stopped waiting: an acquire, a claim or an extend that nobody waits
    /// for needs no command. A release, an abandon or a completion is
    /// always sent: a lease or a claim must not outlive its request, and a
    /// handler that ran keeps its record.
    pub(crate) fn skippable(&self) -> bool {
        matches!(
            self.op,
            Op::Acquire { .. }
                | Op::AcquireFenced { .. }
                | Op::Extend { .. }
                | Op::Claim { .. }
                | Op::ExtendClaim { .. }
        )
    }

    /// Append this job to the batch script's one argument: letter, token,
    /// TTL, `;` (a batchable job only).
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        let (letter, ttl_ms) = match self.op {
            Op::Acquire { ttl_ms, .. } => (b'a', Some(ttl_ms)),
            Op::Release { .. } => (b'r', None),
            Op::Extend { ttl_ms } => (b'e', Some(ttl_ms)),
            // Never batched (see `batchable`); a letter the script
            // answers with an error.
            _ => (b'?', None),
        };
        out.push(letter);
        out.extend_from_slice(&self.token);
        if let Some(ms) = ttl_ms {
            push_decimal(out, ms.max(0) as u64);
        }
        out.push(b';');
    }

    /// Send this job alone on `client`: `EVALSHA` of its own script, and
    /// `EVAL` if the server does not have the script (`NOSCRIPT`: after a
    /// restart, a failover or `SCRIPT FLUSH`).
    pub(crate) async fn send<C: ClientLike>(&self, client: &C) -> Result<Value, FredError> {
        self.send_unless(client, || false).await
    }

    /// [`send`](Self::send) with fred's own timer: `within` for the whole
    /// call, the `EVAL` that follows a `NOSCRIPT` getting what is left of
    /// it (nothing left: that `NOSCRIPT` is the answer). A command fred's
    /// timer ends is marked, and never sent later (fred skips it after a
    /// reconnect); one whose future another timer dropped stays queued,
    /// and is.
    pub(crate) async fn send_within(
        &self,
        client: &Client,
        within: Duration,
    ) -> Result<Value, FredError> {
        let started = std::time::Instant::now();
        let timed = |left: Duration| {
            client.with_options(&Options {
                timeout: Some(left.max(Duration::from_millis(1))),
                ..Options::default()
            })
        };
        let script = self.script();
        match script
            .evalsha(&timed(within), self.keys(), self.args())
            .await
        {
            Err(e) if scripts::is_noscript(&e) => {
                let left = within.saturating_sub(started.elapsed());
                if left.is_zero() {
                    return Err(e);
                }
                script.eval(&timed(left), self.keys(), self.args()).await
            }
            other => other,
        }
    }

    /// [`send`](Self::send), but once `gone()` says the caller stopped
    /// waiting, the `EVAL` that would follow a `NOSCRIPT` is not sent for a
    /// job that may be left unsent ([`skippable`](Self::skippable)): the
    /// answer is that `NOSCRIPT`. An acquire's caller that gave up has its
    /// cleanup release on its way already; an `EVAL` sent after that reply
    /// could land behind the release and take the lease for nobody.
    pub(crate) async fn send_unless<C: ClientLike>(
        &self,
        client: &C,
        gone: impl Fn() -> bool,
    ) -> Result<Value, FredError> {
        let script = self.script();
        match script.evalsha(client, self.keys(), self.args()).await {
            Err(e) if scripts::is_noscript(&e) && !(self.skippable() && gone()) => {
                script.eval(client, self.keys(), self.args()).await
            }
            other => other,
        }
    }

    /// Read `reply`, the answer to this job's command (sent alone, or its
    /// entry of a batch).
    pub(crate) fn read(&self, reply: Result<Value, FredError>) -> Result<Reply, BackendError> {
        match self.op {
            Op::Acquire { .. } => {
                parse_acquire(&reply.map_err(acquire_err)?, false).map(Reply::Acquire)
            }
            Op::AcquireFenced { .. } => {
                parse_acquire(&reply.map_err(map_err)?, true).map(Reply::Acquire)
            }
            Op::Claim { .. } => parse_claim(&reply.map_err(map_err)?).map(Reply::Claim),
            _ => flag(&reply.map_err(map_err)?, self.what()).map(Reply::Done),
        }
    }

    /// The job's own script.
    fn script(&self) -> &'static Script {
        match self.op {
            Op::Acquire { mark: false, .. } => &scripts::ACQUIRE,
            Op::Acquire { mark: true, .. } => &scripts::ACQUIRE_WAIT,
            Op::AcquireFenced { .. } => &scripts::ACQUIRE_FENCED,
            Op::Release { notify: false } => &scripts::RELEASE,
            Op::Release { notify: true } => &scripts::RELEASE_NOTIFY,
            Op::Extend { .. } => &scripts::EXTEND,
            Op::Claim { .. } => &scripts::CLAIM,
            Op::Complete { .. } => &scripts::COMPLETE,
            Op::ExtendClaim { .. } => &scripts::EXTEND_CLAIM,
            Op::Abandon { .. } => &scripts::ABANDON,
        }
    }

    /// The key with `suffix`, same hash slot.
    fn derived_key(&self, suffix: &[u8]) -> Key {
        let mut key = Vec::with_capacity(self.key.as_bytes().len() + suffix.len());
        key.extend_from_slice(self.key.as_bytes());
        key.extend_from_slice(suffix);
        Key::from(Bytes::from(key))
    }

    /// The keys of its own script.
    fn keys(&self) -> Vec<Key> {
        let mut keys = Vec::with_capacity(3);
        keys.push(self.key.clone());
        match &self.op {
            Op::Acquire { mark, .. } => {
                if *mark {
                    keys.push(self.derived_key(WAIT_SUFFIX));
                }
            }
            Op::AcquireFenced { mark, .. } => {
                keys.push(self.derived_key(FENCE_SUFFIX));
                if *mark {
                    keys.push(self.derived_key(WAIT_SUFFIX));
                }
            }
            Op::Release { notify } => {
                if *notify {
                    keys.push(self.derived_key(WAIT_SUFFIX));
                }
            }
            Op::Extend { .. } => {}
            Op::Claim { scope, .. }
            | Op::Complete { scope, .. }
            | Op::ExtendClaim { scope, .. }
            | Op::Abandon { scope, .. } => {
                keys.push(scope.quota.clone());
                keys.push(scope.bytes.clone());
            }
        }
        keys
    }

    /// The arguments of its own script (the order each script documents).
    fn args(&self) -> Vec<Value> {
        let token = Value::Bytes(Bytes::copy_from_slice(&self.token));
        match &self.op {
            Op::Acquire { ttl_ms, .. } | Op::Extend { ttl_ms } => {
                vec![token, Value::Integer(*ttl_ms)]
            }
            Op::AcquireFenced {
                ttl_ms, fence_life, ..
            } => vec![token, Value::Integer(*ttl_ms), Value::Integer(*fence_life)],
            Op::Release { .. } => vec![token],
            Op::Claim {
                scope,
                fingerprint,
                lease_ms,
                max_entries,
                max_bytes,
            } => vec![
                token,
                Value::Bytes(fingerprint.clone()),
                Value::Integer(*lease_ms),
                Value::Bytes(scope.member.clone()),
                Value::Integer(*max_entries),
                Value::Integer(*max_bytes),
            ],
            Op::Complete {
                scope,
                fingerprint,
                record,
                retention_ms,
            } => vec![
                token,
                Value::Bytes(record.clone()),
                Value::Integer(*retention_ms),
                Value::Bytes(scope.member.clone()),
                Value::Bytes(fingerprint.clone()),
            ],
            Op::ExtendClaim { scope, lease_ms } => vec![
                token,
                Value::Integer(*lease_ms),
                Value::Bytes(scope.member.clone()),
            ],
            Op::Abandon { scope, lease_ms } => vec![
                token,
                Value::Bytes(scope.member.clone()),
                Value::Integer(*lease_ms),
            ],
        }
    }
}

/// `n` in decimal digits.
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// What Redis answered to a job, read ([`Job::read`]).
#[derive(Debug)]
pub(crate) enum Reply {
    /// An acquire's (fenced or not).
    Acquire(Acquire),
    /// A compare-and-act's (release, extend, complete, extend claim,
    /// abandon): done, or not ours.
    Done(bool),
    /// A claim's.
    Claim(Claim),
}

impl Reply {
    /// An acquire's answer (an error for any other reply: never sent).
    pub(crate) fn into_acquire(self) -> Result<Acquire, BackendError> {
        match self {
            Reply::Acquire(answer) => Ok(answer),
            other => Err(other.unexpected("acquire")),
        }
    }

    /// A compare-and-act's answer.
    pub(crate) fn into_done(self) -> Result<bool, BackendError> {
        match self {
            Reply::Done(done) => Ok(done),
            other => Err(other.unexpected("compare-and-act")),
        }
    }

    /// A claim's answer.
    pub(crate) fn into_claim(self) -> Result<Claim, BackendError> {
        match self {
            Reply::Claim(answer) => Ok(answer),
            other => Err(other.unexpected("claim")),
        }
    }

    fn unexpected(self, what: &str) -> BackendError {
        BackendError::with_kind(
            BackendErrorKind::Protocol,
            format!("unexpected answer to {what}: {self:?}"),
        )
    }
}

/// An acquire's reply: [`ACQUIRED`](scripts::ACQUIRED) or the holder's
/// `PTTL` ([`ACQUIRE_LUA`](scripts::ACQUIRE_LUA), the batch script); with
/// `fenced`, `{1, fence}` acquired or `{0, pttl}` held
/// ([`ACQUIRE_FENCED_LUA`](scripts::ACQUIRE_FENCED_LUA)).
fn parse_acquire(reply: &Value, fenced: bool) -> Result<Acquire, BackendError> {
    let held = |pttl: i64| Acquire::Held {
        retry_after: (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
    };
    if !fenced {
        return match as_int(reply) {
            Some(scripts::ACQUIRED) => Ok(Acquire::Acquired {
                fence: None,
                validity: None,
            }),
            Some(pttl) if pttl >= -1 => Ok(held(pttl)),
            _ => Err(protocol("acquire", reply)),
        };
    }
    let Value::Array(items) = reply else {
        return Err(protocol("acquire", reply));
    };
    match (
        items.first().and_then(as_int),
        items.get(1).and_then(as_int),
    ) {
        (Some(1), Some(fence)) if fence >= 0 => Ok(Acquire::Acquired {
            fence: Some(fence as u64),
            validity: None,
        }),
        (Some(0), Some(pttl)) => Ok(held(pttl)),
        _ => Err(protocol("acquire", reply)),
    }
}

/// [`map_err`] for an acquire: a server older than Redis 7.0 refuses `SET`
/// with both `NX` and `GET` as a syntax error; say what to upgrade.
fn acquire_err(e: FredError) -> BackendError {
    if e.details().contains("syntax error") {
        let message = format!(
            "Redis refused `SET key token NX PX ttl GET` ({}): the lock needs Redis >= 7.0 or Valkey >= 7.2",
            e.details()
        );
        return BackendError::with_kind(BackendErrorKind::Other, message).with_source(e);
    }
    map_err(e)
}

/// A claim's reply (see `CLAIM_LUA`).
fn parse_claim(reply: &Value) -> Result<Claim, BackendError> {
    let Value::Array(items) = reply else {
        return Err(protocol("claim", reply));
    };
    let millis = |i: usize| {
        items
            .get(i)
            .and_then(as_int)
            .filter(|ms| *ms >= 0)
            .map(|ms| Duration::from_millis(ms as u64))
    };
    match items.first().and_then(as_int) {
        Some(1) => Ok(Claim::Claimed),
        Some(2) => Ok(Claim::InFlight {
            retry_after: millis(1),
        }),
        Some(3) => Ok(Claim::Mismatch),
        Some(4) => items
            .get(1)
            .and_then(bytes_of)
            .map(Claim::Done)
            .ok_or_else(|| protocol("claim", reply)),
        Some(5) => Ok(Claim::OverQuota {
            retry_after: millis(1).unwrap_or(Duration::from_secs(1)),
        }),
        // Our own request gave up on this claim (a re-sent command landing
        // late): nothing was claimed, and nobody waits for this answer.
        Some(6) => Err(BackendError::new(
            "the claim landed after its request gave up on it",
        )),
        _ => Err(protocol("claim", reply)),
    }
}

pub(crate) mod native;
#[cfg(test)]
mod tests;
