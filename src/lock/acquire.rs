//! The acquire engine, free functions over a layer's [`Config`]: take the
//! lease on a key in one backend round trip within the deadline
//! ([`start`]; or, when the layer waits and the key is held, wait in the
//! key's queue, `wait.rs`, for a turn to take it), clean up after an
//! acquire that lands too late, and say what a request whose key could not
//! be derived gets ([`missing_part`]).
//!
//! A store that answers in the call (in-process: the answer comes back
//! through [`BackendFuture::into_ready`]) admits the request at once: no
//! boxed future, no deadline timer. Any other store's answer is awaited
//! within the deadline in a boxed future. The engine answers with an
//! [`Admission`], which the caller (the response future, a `Locker`) acts
//! on: a lease granted ([`Taken`]) becomes its guard in `lease.rs`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::config::{Config, ReleaseMode};
use super::lease::{Lease, Taken};
use super::wait::{Bounds, Next, Ticket};
use crate::backend::{Acquire, BackendError, BackendFuture, LockBackend, Token};
use crate::key::{LockKey, MissingPart};
use crate::rejection::Rejection;
use crate::settings::at_most_max;
use crate::stats::{Counters, LockOutcome};

/// A boxed acquire, on its way.
type Boxed = Pin<Box<dyn Future<Output = Admission> + Send + 'static>>;

/// Result of trying to admit a request.
pub(crate) enum Admission {
    /// The store granted the lease: the caller makes its guard
    /// ([`Taken::hold`]).
    Locked(Taken),
    /// Run without a lease (fail-open or skipped).
    Unlocked(Lease),
    /// Answer with this instead.
    Rejected(Rejection),
}

/// An acquire on its way: answered in the call by an in-process store,
/// else a boxed future.
// The ready variant is the point: boxing it would cost the allocation this
// type saves.
#[allow(clippy::large_enum_variant)]
pub(crate) enum AcquireFuture {
    /// Answered (taken by the first poll).
    Ready(Option<Admission>),
    /// Waiting for the backend.
    Pending(Boxed),
}

impl Future for AcquireFuture {
    type Output = Admission;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Admission> {
        match self.get_mut() {
            AcquireFuture::Ready(admission) => Poll::Ready(
                admission
                    .take()
                    .expect("tower-redis-lock: acquire polled after it completed"),
            ),
            AcquireFuture::Pending(fut) => fut.as_mut().poll(cx),
        }
    }
}

/// A request that goes on without a lease.
pub(crate) enum NoLease {
    /// Answer with this.
    Reject(Rejection),
    /// Run the handler unlocked.
    Unlocked(Lease),
}

/// What a request whose key part is `missing` gets: rejected with the
/// part's status, or run unlocked when the layer skips locking then.
pub(crate) fn missing_part(config: &Config, missing: MissingPart) -> NoLease {
    // A part that is there but refused (a repeated header) is never run
    // unlocked: the client would choose to skip the lock.
    match config.skip_missing && !missing.is_malformed() {
        false => {
            tracing::debug!(
                part = missing.part(),
                outcome = "missing_part",
                "rejected: {missing}"
            );
            NoLease::Reject(Rejection::MissingPart(missing))
        }
        true => {
            config.stats.record(LockOutcome::Skipped);
            tracing::debug!(part = missing.part(), outcome = "skipped");
            let ttl = config.settings.ttl;
            NoLease::Unlocked(Lease::new(None, false, ttl, None, Instant::now()))
        }
    }
}

/// Take the lease on `key` (stored at `storage`), in a `lock` span that
/// names the key digest and the layer's label: one backend round trip
/// within the deadline (a store that answers in the call admits at once,
/// unless the key is held and the layer waits), or, when the layer waits
/// and requests wait for `key` here already, a place in the key's queue
/// behind them.
///
/// `held`: the request-body bytes the request holds while it waits (the
/// buffered body), counted against the layer's `max_waiting_bytes`.
pub(crate) fn start(
    config: &Arc<Config>,
    key: LockKey,
    storage: Bytes,
    held: usize,
) -> AcquireFuture {
    let span = tracing::debug_span!("lock", key = %key, layer = config.stats.label());
    if queued_behind(config, &storage) {
        let wait = wait_turn(config.clone(), key, storage, None, held);
        return boxed(wait, span);
    }
    let token = Token::generate();
    let entered = span.enter();
    let started = Instant::now();
    let call = send(config, &storage, &token);
    let call = match call.into_ready() {
        Ok(answer) => {
            if let (Ok(Acquire::Held { retry_after }), Some(_)) = (&answer, config.wait) {
                config.stats.round_trip(started.elapsed(), false);
                let wait = wait_turn(config.clone(), key, storage, *retry_after, held);
                drop(entered);
                return boxed(wait, span);
            }
            let admission = admit(config, key, storage, token, started, Some(answer));
            return AcquireFuture::Ready(Some(admission));
        }
        Err(call) => call,
    };
    drop(entered);
    let cleanup = PendingAcquire::new(config, &storage, key, token);
    boxed(
        receive(
            config.clone(),
            key,
            storage,
            token,
            (started, call),
            cleanup,
            held,
        ),
        span,
    )
}

/// `fut` boxed, in `span`.
fn boxed(
    fut: impl Future<Output = Admission> + Send + 'static,
    span: tracing::Span,
) -> AcquireFuture {
    AcquireFuture::Pending(Box::pin(tracing::Instrument::instrument(fut, span)))
}

/// `true` if the layer waits and requests wait for the key stored at
/// `storage` here already: a newcomer queues behind them at once.
fn queued_behind(config: &Config, storage: &Bytes) -> bool {
    config.wait.is_some() && config.queue.is_waiting(storage)
}

/// Ask the store for the lease on `storage` with `token` (fenced when the
/// layer issues fences).
fn send(config: &Config, storage: &Bytes, token: &Token) -> BackendFuture<Acquire> {
    let ttl = config.settings.ttl;
    match config.fencing {
        // Through the `dyn`, not the `Arc`'s forwarding impl.
        true => config.backend.as_ref().acquire_fenced(storage, token, ttl),
        false => config.backend.as_ref().acquire(storage, token, ttl),
    }
}

/// The store's answer to the acquire sent at `started`, awaited until the
/// deadline (from the send); then the lease, a turn in the key's queue
/// when it is held and the layer waits, or the answer without a lease.
async fn receive(
    config: Arc<Config>,
    key: LockKey,
    storage: Bytes,
    token: Token,
    (started, call): (Instant, BackendFuture<Acquire>),
    cleanup: PendingAcquire,
    held: usize,
) -> Admission {
    let result = answer_within(&config, started, call, cleanup).await;
    if let (Some(Ok(Acquire::Held { retry_after })), Some(_)) = (&result, config.wait) {
        config.stats.round_trip(started.elapsed(), false);
        return wait_turn(config, key, storage, *retry_after, held).await;
    }
    admit(&config, key, storage, token, started, result)
}

/// `call`'s answer if it comes before the deadline counted from `started`
/// (`None` otherwise). Unless the answer is a success, `cleanup` releases
/// whatever the acquire may still do on the server; if this future is
/// dropped (client gone) before the answer, so does `cleanup`.
async fn answer_within(
    config: &Config,
    started: Instant,
    call: BackendFuture<Acquire>,
    mut cleanup: PendingAcquire,
) -> Option<Result<Acquire, BackendError>> {
    let deadline = started + config.settings.deadline;
    let result = tokio::time::timeout_at(deadline, call).await;
    if matches!(result, Ok(Ok(_))) {
        cleanup.armed = false;
    }
    drop(cleanup);
    result.ok()
}

/// One acquire of `storage` with `token` (a waiter's look at the store),
/// within the deadline: when it was sent, and the answer (`None`: none in
/// time). If this future is dropped or gives up before the answer, the
/// command may still land: it is cleaned up after.
async fn ask(
    config: &Config,
    key: LockKey,
    storage: &Bytes,
    token: &Token,
) -> (Instant, Option<Result<Acquire, BackendError>>) {
    let started = Instant::now();
    let call = send(config, storage, token);
    let cleanup = PendingAcquire::new(config, storage, key, *token);
    (started, answer_within(config, started, call, cleanup).await)
}

/// Wait, in the key's queue, for the lease on `storage` (held, its
/// lease ending in `held`), at most the layer's wait bound: looking
/// only as the head, when the key is released or its lease expires
/// (see `wait.rs`). The lease, a 409 at the bound or when the queue is
/// full, or the backend failure's answer.
///
/// Each look sends a token of its own, made as it is sent: a token carries
/// the time it was issued, from which a refused acquire elsewhere reads how
/// long the lease has left (`Token::generate`), so the lease a waiter takes
/// must not look as old as its wait. (Each look's cleanup releases its own
/// token, should its acquire land after the look gave up on it.)
async fn wait_turn(
    config: Arc<Config>,
    key: LockKey,
    storage: Bytes,
    held: Option<Duration>,
    bytes: usize,
) -> Admission {
    let (ttl, deadline) = (config.settings.ttl, config.settings.deadline);
    let began = Instant::now();
    let bound = config.wait.unwrap_or_default();
    let until = began + bound;
    let (per_key, total) = config.max_waiters;
    let bounds = Bounds {
        per_key,
        total,
        bytes: config.max_waiting_bytes,
    };
    // A store's word (a custom store may say `Duration::MAX`), kept to
    // what an `Instant` can take.
    let expires = began + held.map_or(ttl, at_most_max);
    let ticket = match config.queue.enter(&storage, expires, bounds, bytes) {
        Ok(ticket) => ticket,
        Err(full) => {
            config.stats.record(LockOutcome::WaitFull);
            config.stats.record(LockOutcome::Conflict);
            tracing::debug!(key = %key, outcome = "wait_full", queue = ?full, "rejected: too many waiters, or too many bytes held by them");
            // A newcomer queued behind others asked nothing: its waiters
            // know when the lease expires.
            let left = held.or_else(|| {
                let expires = config.queue.holder_expires(&storage)?;
                Some(expires.saturating_duration_since(Instant::now()))
            });
            return Admission::Rejected(conflict(&config, key, left));
        }
    };
    config.stats.record(LockOutcome::Waited);
    let _time = WaitTime {
        stats: &config.stats,
        began,
    };
    tracing::debug!(key = %key, outcome = "waited", bound_ms = bound.as_millis() as u64);
    loop {
        if tokio::time::timeout_at(until, ticket.head()).await.is_err() {
            return gave_up(&config, key, &ticket, began);
        }
        let now = Instant::now();
        if now >= until {
            return gave_up(&config, key, &ticket, began);
        }
        match ticket.next(now) {
            Next::Watch => {
                let watch = match config.backend.watch(&storage) {
                    None => None,
                    Some(call) => {
                        let at = until.min(now + deadline);
                        match tokio::time::timeout_at(at, call).await {
                            Ok(Ok(watch)) => Some(watch),
                            Ok(Err(error)) => {
                                tracing::debug!(key = %key, error = %error, "cannot hear releases; looking with a back-off");
                                None
                            }
                            Err(_) => None,
                        }
                    }
                };
                ticket.watched(watch);
                continue;
            }
            Next::Sleep { watch, seen, at } => {
                let at = at.min(until);
                match watch {
                    Some(watch) => {
                        let _ = tokio::time::timeout_at(at, watch.changed_from(seen)).await;
                    }
                    None => tokio::time::sleep_until(at).await,
                }
                continue;
            }
            Next::Look => {}
        }
        ticket.looking(now);
        let token = Token::generate();
        let (started, result) = ask(&config, key, &storage, &token).await;
        match result {
            Some(Ok(Acquire::Held { retry_after })) => {
                let now = Instant::now();
                config.stats.round_trip(now - started, false);
                ticket.found_held(now + retry_after.map_or(ttl, at_most_max));
            }
            Some(Ok(Acquire::Acquired { .. })) => {
                ticket.took(started + ttl);
                // Leaves the queue once the lease is ours: the next
                // waiter waits for its release.
                let admission = admit(&config, key, storage, token, started, result);
                drop(ticket);
                return admission;
            }
            failed => {
                drop(ticket);
                return admit(&config, key, storage, token, started, failed);
            }
        }
    }
}

/// Adds a waiter's time to `LockStats::wait_us_sum` (and the wait
/// histogram) once, however its wait ends: the lease taken, the bound run
/// out, the store failed, or the request dropped (its client gone, an
/// outer timeout), so that `mean_wait` divides by waiters that all added
/// their time.
struct WaitTime<'a> {
    stats: &'a Counters<LockOutcome>,
    began: Instant,
}

impl Drop for WaitTime<'_> {
    fn drop(&mut self) {
        self.stats.waited(self.began.elapsed());
    }
}

/// The wait bound ran out: 409, with when the holder is expected to
/// finish.
fn gave_up(config: &Config, key: LockKey, ticket: &Ticket, began: Instant) -> Admission {
    config.stats.record(LockOutcome::WaitedConflict);
    config.stats.record(LockOutcome::Conflict);
    let left = ticket.expires().saturating_duration_since(Instant::now());
    tracing::debug!(key = %key, outcome = "waited_conflict", waited_ms = began.elapsed().as_millis() as u64);
    Admission::Rejected(conflict(config, key, Some(left)))
}

/// A 409 for `key`, whose holder's lease has `left` (if known). A
/// debounce layer keeps every lease its whole TTL: the key is free when
/// the lease expires, so that is the answer; otherwise it is a guess at
/// when the holder finishes (`HoldTimes::retry_after`).
fn conflict(config: &Config, key: LockKey, left: Option<Duration>) -> Rejection {
    let ttl = config.settings.ttl;
    let cap = config.retry_after_cap;
    let retry_after = match left {
        Some(left) if config.release == ReleaseMode::HoldUntilTtl => {
            left.min(cap.unwrap_or(left)).max(Duration::from_secs(1))
        }
        _ => config.holds.retry_after(left, ttl, cap),
    };
    Rejection::Conflict { key, retry_after }
}

/// What the backend's answer (`None`: none within the deadline) to the
/// acquire of `key` sent at `started` means for the request.
fn admit(
    config: &Config,
    key: LockKey,
    storage: Bytes,
    token: Token,
    started: Instant,
    result: Option<Result<Acquire, BackendError>>,
) -> Admission {
    let (ttl, deadline) = (config.settings.ttl, config.settings.deadline);
    // One clock read for the latency, the lease's start and its guard's.
    let now = Instant::now();
    let latency = now.saturating_duration_since(started);
    let latency_us = latency.as_micros() as u64;
    config.stats.round_trip(latency, result.is_none());
    match result {
        Some(Ok(Acquire::Acquired { fence, validity })) => {
            config.stats.record(LockOutcome::Acquired);
            tracing::debug!(key = %key, outcome = "acquired", latency_us, fence);
            // Until when the lease is safe to rely on: the backend's
            // validity from now (Redlock), else the TTL from the send.
            let valid_until = match validity {
                Some(validity) => now + validity.min(ttl),
                None => started + ttl,
            };
            Admission::Locked(Taken {
                key,
                storage,
                token,
                fence,
                validity,
                started,
                valid_until,
                at: now,
            })
        }
        Some(Ok(Acquire::Held { retry_after })) => {
            config.stats.record(LockOutcome::Conflict);
            tracing::debug!(key = %key, outcome = "conflict", latency_us);
            Admission::Rejected(conflict(config, key, retry_after))
        }
        Some(Err(error)) => backend_failed(config, key, error, latency_us),
        None => backend_failed(config, key, BackendError::timeout(deadline), latency_us),
    }
}

fn backend_failed(
    config: &Config,
    key: LockKey,
    error: BackendError,
    latency_us: u64,
) -> Admission {
    match config.fail_open {
        false => {
            config.stats.record(LockOutcome::BackendError);
            tracing::warn!(key = %key, outcome = "backend_error", latency_us, error = %error, "lock backend failed; answering 503 (fail-closed)");
            Admission::Rejected(Rejection::Unavailable {
                retry_after: Duration::from_secs(1),
            })
        }
        true => {
            config.stats.record(LockOutcome::FailOpen);
            tracing::warn!(key = %key, outcome = "fail_open", latency_us, error = %error, "lock backend failed; running unlocked (fail-open)");
            let ttl = config.settings.ttl;
            Admission::Unlocked(Lease::new(Some(key), false, ttl, None, Instant::now()))
        }
    }
}

/// An acquire in flight. Dropped while armed (it failed, missed its
/// deadline, or its future was dropped because the client went away), it
/// sends a best-effort compare-and-delete with our token in the background:
/// if the command still lands, the late lease blocks no one for a whole TTL
/// (a single fred connection keeps the order, so the release follows it).
/// One case it cannot undo: an acquire whose bytes were still in the
/// network when its connection was given up and replaced (a black-holed
/// link that heals later) can reach Redis after the cleanup sent on the
/// new connection; that lease then blocks its key for one TTL, as a crashed
/// holder's would. It never lets two holders in.
struct PendingAcquire {
    backend: Arc<dyn LockBackend>,
    /// The layer waits: the cleanup tells waiters ([`LockBackend::release_notify`]).
    notify: bool,
    storage: Bytes,
    key: LockKey,
    token: Token,
    wait: Duration,
    armed: bool,
}

impl PendingAcquire {
    /// Armed: the acquire of `storage` with `token` was just sent through
    /// the layer of `config`.
    fn new(config: &Config, storage: &Bytes, key: LockKey, token: Token) -> Self {
        Self {
            backend: config.backend.clone(),
            notify: config.wait.is_some(),
            storage: storage.clone(),
            key,
            token,
            // Until a late lease would expire on its own.
            wait: config.settings.ttl.max(config.settings.deadline),
            armed: true,
        }
    }
}

impl Drop for PendingAcquire {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            // Asked now (a delivering backend counts it for `drain` at once).
            let call = match self.notify {
                true => self.backend.release_notify(&self.storage, &self.token),
                false => self.backend.release(&self.storage, &self.token),
            };
            handle.spawn(cleanup_late_acquire(call, self.key, self.wait));
        }
    }
}

async fn cleanup_late_acquire(call: BackendFuture<bool>, key: LockKey, deadline: Duration) {
    match tokio::time::timeout(deadline, call).await {
        Ok(Ok(true)) => {
            tracing::debug!(key = %key, outcome = "late_acquire_cleaned", "an acquire that landed after its deadline was released")
        }
        Ok(Ok(false)) => {}
        Ok(Err(_)) | Err(_) => {
            tracing::debug!(key = %key, "cleanup after a timed-out acquire failed; a late acquire expires after its TTL")
        }
    }
}
