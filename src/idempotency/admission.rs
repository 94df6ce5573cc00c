//! What happens before the handler: the request's scope and
//! `Idempotency-Key`, its body and fingerprint, and so its entry key; a
//! join of the same request in flight; the claim (one round trip, or a few
//! while joining); and the store's answer turned into a response, or into a
//! claim won.
//!
//! From the first claim sent until the store has answered, the claim is a
//! [`PendingClaim`]: dropping it (client gone, deadline, store error,
//! shutdown) takes the claim back, as `PendingAcquire` does for a lease.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use tokio::time::Instant;

use super::answer::{
    answer_record, over_quota, rejected, transaction_ended_response, unavailable, untrusted_record,
};
use super::config::Config;
use super::flight::Flight;
use super::header::IdempotencyKey;
use super::joining::{join_here, Joiner};
use super::record::Record;
use super::seal::open;
use crate::backend::{BackendError, Claim, ClaimTerms, EntryKey, IdempotencyBackend, Token};
use crate::key::{KeyWriter, LockKey};
use crate::stats::IdempotencyOutcome;
use crate::Rejection;

/// The error type of a request body, boxed.
pub(super) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the layer does before the handler: either a ready answer or a claim.
pub(super) enum Admission<B> {
    /// Answered before the handler (a replay, a rejection, a join).
    Answered(Response<Bytes>),
    /// The claim is won: run the handler.
    Run(Request<B>, Box<Won>),
}

/// A claim won by a request: what its run needs to renew it and
/// to record the outcome in its place.
pub(super) struct Won {
    /// Where the entry lives.
    pub(super) key: EntryKey,
    /// The request's digest (scope and key), for logs.
    pub(super) digest: LockKey,
    /// Our claim's token.
    pub(super) token: Token,
    /// The request's fingerprint, to which its record is bound.
    pub(super) fingerprint: Bytes,
    /// When the claim that won was sent: it holds a TTL from then.
    pub(super) sent: Instant,
    /// Where duplicates on this instance wait for the outcome, if joining.
    pub(super) flight: Option<Flight>,
}

/// Who a request is to the store.
struct Entry {
    /// Where its entry lives.
    key: EntryKey,
    /// Its fingerprint, to which its record is bound.
    fingerprint: Bytes,
    /// The request's digest (scope and key), for logs.
    digest: LockKey,
    /// Its scope's digest, for logs.
    scope: LockKey,
}

/// The store's last answer to our claim, once no more waiting is due.
enum Looked {
    /// A joining duplicate got the original's record from the feed.
    Published(Record),
    /// The store's answer (or its failure), when the claim was sent, and
    /// whether we waited for a request in flight.
    Answered {
        reply: Result<Claim, BackendError>,
        sent: Instant,
        waited: bool,
    },
}

/// Admission `req` (a gRPC request if `grpc`): answer it here, or win its
/// claim.
pub(super) async fn admit<B>(config: &Arc<Config>, req: Request<B>, grpc: bool) -> Admission<B>
where
    B: Body + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = req.into_parts();
    // 1. The scope (who, which route: 401 first) and the Idempotency-Key.
    let (scope, key) = match scope_and_key(config, &parts) {
        Ok(found) => found,
        Err(r) => return reject(config, r),
    };
    // 2. The body, buffered for the fingerprint.
    let mut body_hash = blake3::Hasher::new();
    let bytes = match crate::wire::body::receive(
        body,
        &parts.headers,
        grpc,
        config.settings.body_limit,
        config.settings.body_timeout,
        Some(&mut body_hash),
    )
    .await
    {
        Ok(bytes) => bytes,
        Err(r) => return reject(config, r),
    };
    let entry = entry_of(config, &parts, &body_hash.finalize(), scope, key.as_ref());
    let joining = !config.join_timeout.is_zero();
    let join_until = Instant::now() + config.join_timeout;
    // 3. A duplicate of a request in flight on this instance waits for its
    //    outcome here, without a round trip.
    if joining {
        let here = join_here(
            config,
            &entry.key,
            &entry.fingerprint,
            &entry.digest,
            join_until,
        );
        if let Some(answer) = here.await {
            return Admission::Answered(answer);
        }
    }
    // 4. One round trip: claim, or learn what is there. A duplicate of a
    //    request in flight elsewhere waits for what the store publishes
    //    (listening before it asks, so nothing is missed), or, without a
    //    feed, looks again with growing pauses, until the join bound.
    let joiner = match joining {
        true => Some(Joiner::new(config, &entry.key.entry, join_until).await),
        false => None,
    };
    let token = Token::generate();
    // From the first claim sent until the store has answered it, dropping
    // this future (client gone) or giving up (deadline) takes the claim back.
    let pending = PendingClaim::new(config, entry.key.clone(), token, entry.digest);
    let (reply, sent, waited) = match claim(config, &entry, &token, joiner).await {
        Looked::Published(record) => {
            // Answered by the original: nothing of ours was written.
            pending.settle();
            return Admission::Answered(answer_record(config, &entry.digest, record, true));
        }
        Looked::Answered {
            reply,
            sent,
            waited,
        } => (reply, sent, waited),
    };
    match verdict(config, &entry, reply, waited, grpc) {
        Verdict::Ours => {}
        Verdict::Settled(answer) => {
            pending.settle();
            return Admission::Answered(answer);
        }
        // The claim may still land on the server (fred re-sends commands
        // after a reconnect): dropping `pending`, after this answer is
        // made, takes it back, delivered until Redis answers.
        Verdict::Failed(answer) => return Admission::Answered(answer),
    }
    // 5. The claim is ours: the handler runs.
    let storage = pending.keep();
    config.stats.record(IdempotencyOutcome::Claimed);
    if let Some(key) = key {
        // The provider's idempotency key: derived from the scoped key.
        let mut downstream = config.settings.key_space.writer();
        downstream.push("downstream", entry.digest.as_bytes());
        let downstream = format!("trl-{}", downstream.finish().to_hex());
        parts.extensions.insert(key.with_downstream(downstream));
    }
    // What the handler needs from the store (the PostgreSQL store's open
    // transaction).
    config
        .store
        .as_ref()
        .claimed(&storage, &token, &mut parts.extensions);
    let flight = joining.then(|| {
        config
            .flights
            .begin(storage.entry.clone(), entry.fingerprint.clone())
    });
    let won = Won {
        key: storage,
        digest: entry.digest,
        token,
        fingerprint: entry.fingerprint,
        sent,
        flight,
    };
    Admission::Run(Request::from_parts(parts, B::from(bytes)), Box::new(won))
}

fn reject<B>(config: &Config, r: Rejection) -> Admission<B> {
    Admission::Answered(rejected(config, r))
}

/// The request's scope (its key parts) and its `Idempotency-Key`.
fn scope_and_key(
    config: &Config,
    parts: &Parts,
) -> Result<(KeyWriter, Option<IdempotencyKey>), Rejection> {
    let mut scope = config.settings.key_space.writer();
    scope.push("replay", b"v1");
    // Through the `dyn` itself: the part's own `write`, nothing between.
    (*config.settings.key)
        .write(parts, &mut scope)
        .map_err(Rejection::MissingPart)?;
    let key = match IdempotencyKey::from_headers(&parts.headers) {
        Ok(Some(key)) => Some(key),
        Ok(None) if config.require_key => return Err(Rejection::MissingIdempotencyKey),
        Ok(None) => None,
        Err(e) => {
            return Err(Rejection::InvalidIdempotencyKey {
                reason: e.to_string(),
            })
        }
    };
    Ok((scope, key))
}

/// The request's fingerprint (method, path, query, fingerprinted headers,
/// body) and its entry: the scope plus the `Idempotency-Key`, or plus the
/// fingerprint when the key is optional and absent.
fn entry_of(
    config: &Config,
    parts: &Parts,
    body_hash: &blake3::Hash,
    mut scope: KeyWriter,
    key: Option<&IdempotencyKey>,
) -> Entry {
    let mut fp = config.settings.key_space.writer();
    fp.push("method", parts.method.as_str().as_bytes());
    // Percent-decoded, as the key parts read it: a retry that spells the
    // path another way is the same request, not a reuse of its key.
    crate::key::push_path(&mut fp, "path", parts.uri.path());
    fp.push("query", parts.uri.query().unwrap_or("").as_bytes());
    for name in &config.fingerprint_headers {
        fp.push("header", name.as_str().as_bytes());
        if name == http::header::HOST && !parts.headers.contains_key(name) {
            // HTTP/2: the host is the URI's authority (as the key parts read it).
            if let Some(authority) = parts.uri.authority() {
                fp.push("value", authority.as_str().as_bytes());
            }
            continue;
        }
        if name == http::header::COOKIE {
            // One value however many fields carry it (HTTP/2 splits it).
            if parts.headers.contains_key(name) {
                fp.push("value", &crate::key::joined_cookies(&parts.headers));
            }
            continue;
        }
        for value in parts.headers.get_all(name) {
            fp.push("value", value.as_bytes());
        }
    }
    fp.push("body", body_hash.as_bytes());
    let fingerprint = fp.finish();
    let scope_digest = scope.finish();
    match key {
        Some(key) => scope.push("idempotency-key", key.as_str().as_bytes()),
        None => scope.push("fingerprint", fingerprint.as_bytes()),
    }
    let digest = scope.finish();
    Entry {
        key: EntryKey::new(&config.settings.key_space, &scope_digest, &digest),
        fingerprint: Bytes::copy_from_slice(fingerprint.as_bytes()),
        digest,
        scope: scope_digest,
    }
}

/// Send our claim; while the store says a request with this key is in
/// flight and `joiner` (a joining layer) is within its bound, wait for its
/// outcome and look again.
async fn claim(
    config: &Config,
    entry: &Entry,
    token: &Token,
    mut joiner: Option<Joiner>,
) -> Looked {
    let (entries, bytes) = (config.quota.entries, config.quota.bytes);
    // A store whose claims queue behind running handlers (SQLite) bounds
    // the wait itself and may ask for longer than the deadline.
    let bound = config
        .store
        .as_ref()
        .claim_timeout(config.settings.deadline);
    let terms = ClaimTerms::new(config.settings.ttl, entries, bytes)
        .timeout(config.settings.deadline)
        .retention(config.retention);
    let mut waited = false;
    loop {
        let started = Instant::now();
        let call = config
            .store
            .as_ref()
            .claim(&entry.key, token, &entry.fingerprint, &terms);
        let claimed = tokio::time::timeout(bound, call).await;
        // Missed the deadline: by the layer's timer, or by the store's own
        // (Redis: fred's, at the deadline, which fires first).
        let missed = match &claimed {
            Err(_) => true,
            Ok(Err(e)) => e.is_timeout(),
            Ok(Ok(_)) => false,
        };
        config.stats.round_trip(started.elapsed(), missed);
        let latency_us = started.elapsed().as_micros() as u64;
        let reply = claimed.unwrap_or_else(|_| Err(BackendError::timeout(bound)));
        if let (Ok(Claim::InFlight { .. }), Some(joiner)) = (&reply, joiner.as_mut()) {
            let now = Instant::now();
            if joiner.is_open(now) {
                if !waited {
                    tracing::debug!(key = %entry.digest, outcome = "joining", latency_us, "waiting for the request in flight elsewhere");
                    waited = true;
                }
                let published = joiner
                    .wait(config, &entry.key, &entry.fingerprint, now)
                    .await;
                if let Some(record) = published {
                    return Looked::Published(record);
                }
                continue;
            }
        }
        match (&reply, &joiner) {
            (Ok(Claim::Claimed), _) => {
                tracing::debug!(key = %entry.digest, outcome = "claimed", latency_us)
            }
            (Ok(Claim::Done(_)), Some(joiner)) => joiner.found_done(config),
            _ => {}
        }
        return Looked::Answered {
            reply,
            sent: started,
            waited,
        };
    }
}

/// What the store's answer to our claim means for the request.
enum Verdict {
    /// The key is ours: the handler runs.
    Ours,
    /// The store wrote nothing of ours: this answer.
    Settled(Response<Bytes>),
    /// The store failed or was late: this answer, and our claim is taken
    /// back.
    Failed(Response<Bytes>),
}

fn verdict(
    config: &Config,
    entry: &Entry,
    reply: Result<Claim, BackendError>,
    waited: bool,
    grpc: bool,
) -> Verdict {
    let digest = &entry.digest;
    Verdict::Settled(match reply {
        Ok(Claim::Claimed) => return Verdict::Ours,
        Err(e) => return Verdict::Failed(unavailable(config, digest, e)),
        Ok(Claim::Done(sealed)) => {
            match open(
                &config.seal_key,
                &entry.key.entry,
                &entry.fingerprint,
                sealed,
            ) {
                Ok(record) => answer_record(config, digest, record, waited),
                Err(e) => untrusted_record(config, digest, e),
            }
        }
        Ok(Claim::InFlight { retry_after }) => {
            config.stats.record(IdempotencyOutcome::Conflict);
            let retry_after = config
                .holds
                .retry_after(retry_after, config.settings.ttl, None);
            rejected(config, Rejection::InFlight { retry_after })
        }
        // Final: the first request's handler ended its transaction itself
        // (and its process died before the layer could record it).
        Ok(Claim::Ended) => {
            config.stats.record(IdempotencyOutcome::TransactionEnded);
            tracing::debug!(key = %digest, outcome = "transaction_ended", "the key is final: its first request's handler ended its transaction itself");
            transaction_ended_response(grpc)
        }
        Ok(Claim::Mismatch) => {
            config.stats.record(IdempotencyOutcome::Mismatch);
            rejected(config, Rejection::Mismatch)
        }
        Ok(Claim::OverQuota { retry_after }) => {
            over_quota(config, digest, &entry.scope);
            config.stats.record(IdempotencyOutcome::OverQuota);
            rejected(config, Rejection::OverQuota { retry_after })
        }
    })
}

/// A claim sent for a request whose handler has not begun. Until
/// [`keep`](Self::keep) (the claim is ours and the handler starts) or
/// [`settle`](Self::settle) (the store answered that nothing of ours was
/// written), dropping it abandons the claim: deadline passed, store error,
/// client gone while the claim was on its way, shutdown. The abandon is
/// delivered like a release, and removes a claim of ours that lands later.
struct PendingClaim {
    store: Arc<dyn IdempotencyBackend>,
    key: Option<EntryKey>,
    token: Token,
    lease: Duration,
    digest: LockKey,
}

impl PendingClaim {
    fn new(config: &Config, key: EntryKey, token: Token, digest: LockKey) -> Self {
        Self {
            store: config.store.clone(),
            key: Some(key),
            token,
            lease: config.settings.ttl,
            digest,
        }
    }

    /// The claim is ours: the handler runs, and the claim is recorded or
    /// freed by its run, never abandoned from here.
    fn keep(mut self) -> EntryKey {
        self.key.take().expect("kept once")
    }

    /// The store wrote nothing of ours (in flight, done, mismatch, over
    /// quota): nothing to abandon.
    fn settle(mut self) {
        self.key = None;
    }
}

impl Drop for PendingClaim {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            tracing::debug!(key = %self.digest, outcome = "abandoning", "the request ended before its handler began; its claim is taken back");
            // Takes effect even unpolled (see `IdempotencyBackend::abandon`).
            drop(self.store.as_ref().abandon(&key, &self.token, self.lease));
        }
    }
}
