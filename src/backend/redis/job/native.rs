//! The native form of a lease's jobs, for a server that has the commands
//! (Valkey ≥ 9: `DELIFEQ`, and `SET … IFEQ` since 8.1; found by the probe in
//! `probe.rs`), and of a plain acquire on every server (below). The same key holds the same value as on the script path (the
//! token's 32 hex characters, with an expiry in ms), so instances on either
//! path exclude each other: a fleet that mixes them keeps mutual exclusion.
//!
//! | job | native commands | reply |
//! |---|---|---|
//! | acquire | `SET key token NX PX ttl GET` (one round trip) | nil: acquired; our own token (a re-sent command): acquired, its expiry pushed out as an extend does (a second round trip; nothing more once the caller stopped waiting); another token: held, its time left estimated from the issue time the holder's token carries and this instance's TTL (`contract/issued.rs`; unknown for a value of another format or a holder renewed past its first TTL; short for a holder renewed within it, or one whose TTL is longer than ours: a retry then comes early and gets 409 again, never wrongly in) |
//! | release | `DELIFEQ key token` | 1 released, 0 not ours |
//! | extend | `SET key token PX ttl IFEQ token` (`PX` given: `IFEQ` alone would drop the expiry) | `OK` extended, nil not ours |
//!
//! The acquire goes this way on the script road too (Redis 7, older Valkey,
//! a native road not found yet) when the dispatch sends it alone from its
//! caller's task (batching on: one server or a pool; not in a batch, and
//! not on a cluster, whose script road sends every job as its script): every
//! supported server has `SET … NX PX … GET` (Redis ≥ 7.0,
//! Valkey ≥ 7.2), and they cost the server less than the acquire script.
//! There, an acquire that finds its own token goes again as its script (no
//! `SET … IFEQ` to push the expiry out with), and a server that refuses the
//! commands gets scripts until its next probe (`probe.rs`).
//!
//! Every other job keeps its script, because what it does must be atomic
//! across keys or across a read and a write that no native command joins:
//! a fenced acquire (the lease, its fence counter and the server clock in
//! one step), an acquire of a key this process waits for (the wait mark is
//! set only when the lease is found held), a notifying release (publishes
//! only if the mark exists, after its own delete), and every idempotency
//! step (entry, scope quota and bytes together).
//!
//! A server that lacks a native command or refuses it to this client
//! (`unknown command`, `NOPERM`, a syntax error), or refuses a `SET … IFEQ`
//! under `maxmemory` (`OOM`: the script's `PEXPIRE` is not refused), is
//! [`Native::Refused`]: the dispatch sends the same job as its script.

use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use fred::clients::{Client, WithOptions};
use fred::error::Error as FredError;
use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::{ClusterHash, CustomCommand, Expiration, SetOptions, Value};

use super::{acquire_err, Job, Op, Reply};
use crate::backend::contract::issued;
use crate::backend::redis::scripts::{map_err, protocol};
use crate::backend::{Acquire, BackendError};

/// The connection's client as the native road sends on it: fred's
/// per-command timer off (the dispatch's flight bounds each call).
pub(crate) type Untimed = WithOptions<Client>;

/// What a native attempt came to.
#[derive(Debug)]
pub(crate) enum Native {
    /// The server answered (or the call failed in a way the script would
    /// fail too: a lost connection, a timeout, `OOM` on an acquire).
    Answered(Result<Reply, BackendError>),
    /// The server has no such command for this client, or refused it where
    /// the script would not: send the job's script instead.
    Refused(FredError),
    /// The job needs what only its script does on this server (an acquire
    /// that found its own token, on the script road: no `SET … IFEQ` to
    /// push its expiry out with): send the script; nothing was refused.
    Script,
}

/// Whether `job` has a native form (see the module's table).
pub(crate) fn has_form(job: &Job) -> bool {
    matches!(
        job.op,
        Op::Acquire { mark: false, .. } | Op::Release { notify: false } | Op::Extend { .. }
    )
}

/// Whether `job` goes natively on the script road too: a lone plain
/// acquire, whose `SET … NX PX … GET` every supported server has
/// (Redis ≥ 7.0, Valkey ≥ 7.2). It costs the server less than its script
/// (no Lua call, no script lookup) and leaves in one write with the
/// connection's other typed commands.
pub(crate) fn on_every_server(job: &Job) -> bool {
    matches!(job.op, Op::Acquire { mark: false, .. })
}

/// Whether `e` means the server lacks the command, or refuses it to this
/// client (not a failure of the call itself).
pub(crate) fn lacks_command(e: &FredError) -> bool {
    let details = e.details();
    details.contains("unknown command")
        || details.starts_with("NOPERM")
        || details.contains("syntax error")
}

/// Whether `message`, the error a batch script's `DELIFEQ` got, means the
/// server lacks the command or refuses it to this client (inside a script
/// the server words it its own way: Redis 7 `Unknown Redis command called
/// from script`, Valkey 9 `Unknown command called from script` and `ACL
/// failure in script: … no permissions to run the 'delifeq' command`).
pub(crate) fn refused_in_script(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    message.contains("command called from script")
        || message.contains("acl failure in script")
        || message.contains("noperm")
}

/// Send `job` (one with [`has_form`]) as native commands on `client`;
/// `road`: the server has every native command (`probe.rs`), else only
/// an acquire ([`on_every_server`]) is sent natively. `gone` is set once
/// the caller stopped waiting (see [`gave_up`]).
pub(crate) async fn send(job: &Job, client: &Untimed, road: bool, gone: &AtomicBool) -> Native {
    match job.op {
        Op::Acquire { ttl_ms, .. } => acquire(job, client, ttl_ms, road, gone).await,
        Op::Release { .. } => {
            let args = vec![key(job), token(job)];
            match Box::pin(client.custom::<Value, _>(command("DELIFEQ"), args)).await {
                Ok(reply) => Native::Answered(flag(&reply, "release")),
                Err(e) if lacks_command(&e) => Native::Refused(e),
                Err(e) => Native::Answered(Err(map_err(e))),
            }
        }
        Op::Extend { ttl_ms } => match extend(job, client, ttl_ms).await {
            Ok(extended) => Native::Answered(Ok(Reply::Done(extended))),
            Err(e) if lacks_command(&e) || is_oom(&e) => Native::Refused(e),
            Err(e) => Native::Answered(Err(map_err(e))),
        },
        _ => Native::Answered(Err(BackendError::new(
            "a job without a native form was sent as one",
        ))),
    }
}

/// `SET key token NX PX ttl GET` on the key's connection (fred feeds typed
/// commands queued together into one write): what the key held before. A
/// key another holder has answers with the holder's token, whose issue time
/// tells its time left (`contract/issued.rs`) without a `PTTL`: one command,
/// one round trip. It is handed to fred at this future's first poll, before
/// anything here can wait (fred's queue takes a command without waiting),
/// so a release asked after this acquire cannot overtake it. (A fred
/// `Pipeline` would not do: its buffered commands answer through channels
/// that may make the first poll wait.) Without `ifeq`
/// (the script road: the server may lack `SET … IFEQ`), an acquire that
/// finds its own token is left to the script ([`Native::Script`]).
///
/// A command sent after a reply came back (the extend, the acquire asked
/// again, the script) is sent only while the caller still waits: once it
/// gave up, its cleanup release may already be on its way behind this
/// acquire, and a command sent now would land after that release and take
/// the lease again, for nobody ([`gave_up`]).
async fn acquire(
    job: &Job,
    client: &Untimed,
    ttl_ms: i64,
    ifeq: bool,
    gone: &AtomicBool,
) -> Native {
    // fred's own `set`, not `custom`: fred flushes its socket after every
    // custom command (and every script); a typed command queued before
    // another is fed, and they leave in one write (with other requests'
    // commands queued meanwhile).
    // Boxed: a fred command's future is several KiB, and a lease call on
    // its way (a thousand of them while Redis hangs) should hold no more.
    let set = Box::pin(client.set::<Value, _, _>(
        job.key.clone(),
        token(job),
        Some(Expiration::PX(ttl_ms)),
        Some(SetOptions::NX),
        true,
    ));
    let previous = match set.await {
        Ok(previous) => previous,
        Err(e) if lacks_command(&e) => return Native::Refused(e),
        Err(e) => return Native::Answered(Err(acquire_err(e))),
    };
    let acquired = Acquire::Acquired {
        fence: None,
        validity: None,
    };
    let holder = match &previous {
        Value::Bytes(b) => Some(&b[..]),
        Value::String(s) => Some(s.as_bytes()),
        _ => None,
    };
    match holder {
        None if matches!(previous, Value::Null) => Native::Answered(Ok(Reply::Acquire(acquired))),
        // Our own command, re-sent after a lost reply, where the server may
        // lack `SET … IFEQ`: the script pushes the expiry out (a `PEXPIRE`
        // sent from here could land after the key expired and was taken by
        // another holder).
        Some(holder) if holder == &job.token[..] && gone.load(Ordering::SeqCst) => {
            Native::Answered(Err(gave_up()))
        }
        Some(holder) if holder == &job.token[..] && !ifeq => Native::Script,
        Some(holder) if holder == &job.token[..] => {
            // Our own command, re-sent after a lost reply: the key is ours;
            // push its expiry out as the script's `PEXPIRE` does.
            match extend(job, client, ttl_ms).await {
                Ok(true) => Native::Answered(Ok(Reply::Acquire(acquired))),
                // Gone (expired) between the two: ask again, as the script.
                Ok(false) if gone.load(Ordering::SeqCst) => Native::Answered(Err(gave_up())),
                Ok(false) => Box::pin(acquire(job, client, ttl_ms, ifeq, gone)).await,
                Err(e) if lacks_command(&e) || is_oom(&e) => Native::Refused(e),
                Err(e) => Native::Answered(Err(map_err(e))),
            }
        }
        Some(holder) => {
            // The holder's time left, from the issue time its token carries
            // (`contract/issued.rs`): no `PTTL` to send.
            let ttl = u64::try_from(ttl_ms).unwrap_or(0);
            let held = issued::time_left(holder, ttl, issued::now_ms())
                .map(std::time::Duration::from_millis);
            Native::Answered(Ok(Reply::Acquire(Acquire::Held { retry_after: held })))
        }
        None => Native::Answered(Err(protocol("acquire", &previous))),
    }
}

/// `SET key token PX ttl IFEQ token`: whether the key held our token (and
/// now expires in `ttl_ms`).
async fn extend(job: &Job, client: &Untimed, ttl_ms: i64) -> Result<bool, FredError> {
    let args = vec![
        key(job),
        token(job),
        Value::from_static_str("PX"),
        Value::Integer(ttl_ms),
        Value::from_static_str("IFEQ"),
        token(job),
    ];
    let reply = Box::pin(client.custom::<Value, _>(command("SET"), args)).await?;
    Ok(!matches!(reply, Value::Null))
}

/// A command routed by its first argument, the key.
fn command(name: &'static str) -> CustomCommand {
    CustomCommand::new_static(name, ClusterHash::FirstKey, false)
}

fn key(job: &Job) -> Value {
    Value::from(job.key.clone())
}

fn token(job: &Job) -> Value {
    Value::Bytes(Bytes::copy_from_slice(&job.token))
}

/// The answer to an acquire whose caller stopped waiting before a command
/// that would follow a reply (the caller's cleanup release may be queued
/// behind the acquire already, and must not be overtaken).
pub(crate) fn gave_up() -> BackendError {
    BackendError::new("the acquire's caller stopped waiting; nothing more sent for it")
}

/// `OOM command not allowed when used memory > 'maxmemory'`.
fn is_oom(e: &FredError) -> bool {
    e.details().starts_with("OOM")
}

/// `DELIFEQ`'s 1 or 0.
fn flag(reply: &Value, what: &str) -> Result<Reply, BackendError> {
    crate::backend::redis::scripts::flag(reply, what).map(Reply::Done)
}
