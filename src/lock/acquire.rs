//! The acquire engine: derive the key from the request head, take the lease
//! in one backend round trip within the deadline (or, when the layer waits
//! and the key is held, wait in the key's queue, `wait.rs`, for a turn to
//! take it), and clean up after an acquire that lands too late.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::config::Config;
use super::lease::{Lease, LeaseGuard};
use super::renew::{RenewTarget, Watchdog};
use super::wait::{Next, Ticket};
use crate::backend::{Acquire, BackendError, LockBackend, Token};
use crate::key::{KeyWriter, LockKey};
use crate::rejection::Rejection;
use crate::stats::LockOutcome;

/// Result of trying to admit a request.
pub(crate) enum Admission {
    /// Lease held (guard releases it).
    Locked(LeaseGuard, Lease),
    /// Run without a lease (fail-open or skipped).
    Unlocked(Lease),
    /// Answer with this instead.
    Rejected(Rejection),
}

/// An acquire on its way: answered in the call by an in-process backend,
/// else a boxed future.
// The ready variant is the point: boxing it would cost the allocation this
// type saves.
#[allow(clippy::large_enum_variant)]
pub(crate) enum AcquireFuture {
    /// Answered (taken by the first poll).
    Ready(Option<Admission>),
    /// Waiting for the backend.
    Pending(Pin<Box<dyn Future<Output = Admission> + Send + 'static>>),
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

impl Config {
    /// Derive the key from the request head; `Err` says how to go on without
    /// a lease.
    pub(crate) fn derive(&self, parts: &http::request::Parts) -> Result<KeyWriter, NoLease> {
        let mut writer = self.key_space.writer();
        match self.key.write(parts, &mut writer) {
            Ok(()) => Ok(writer),
            Err(missing) => Err(match self.skip_missing {
                false => {
                    tracing::debug!(
                        part = missing.part(),
                        outcome = "missing_part",
                        "rejected: {missing}"
                    );
                    NoLease::Reject(Rejection::MissingPart(missing))
                }
                true => {
                    self.stats.record(LockOutcome::Skipped);
                    tracing::debug!(part = missing.part(), outcome = "skipped");
                    NoLease::Unlocked(Lease::new(None, false, self.ttl, None, Instant::now()))
                }
            }),
        }
    }

    /// Take the lease on `key`: at once from an in-process backend (unless
    /// the key is held and the layer waits), else
    /// [`acquire`](Self::acquire) in a boxed future.
    pub(crate) fn start_acquire(self: &Arc<Self>, key: LockKey) -> AcquireFuture {
        if let Some(storage) = self.queued_behind(&key) {
            let span = tracing::debug_span!("lock", key = %key, layer = self.stats.label());
            let wait = self
                .clone()
                .wait_turn(key, storage, Token::generate(), None);
            return AcquireFuture::Pending(Box::pin(tracing::Instrument::instrument(wait, span)));
        }
        if self.in_process {
            return self.acquire_in_process(key);
        }
        AcquireFuture::Pending(Box::pin(self.clone().acquire(key)))
    }

    /// An acquire from a store that keeps its keys in this process: taken
    /// in the call when the store answers in it
    /// ([`BackendFuture::into_ready`](crate::backend::contract::BackendFuture::into_ready)),
    /// with the same outcome, counters and logs as [`acquire`](Self::acquire),
    /// without a deadline (nothing to wait for) and nothing that can land
    /// late; when the key is held and the layer waits, it waits for it. A
    /// store that answers later after all is awaited like any other.
    fn acquire_in_process(self: &Arc<Self>, key: LockKey) -> AcquireFuture {
        let span = tracing::debug_span!("lock", key = %key, layer = self.stats.label());
        let entered = span.enter();
        let storage = self.key_space.storage_key(&key);
        let token = Token::generate();
        let started = Instant::now();
        let call = if self.fencing {
            self.backend.acquire_fenced(&storage, &token, self.ttl)
        } else {
            self.backend.acquire(&storage, &token, self.ttl)
        };
        let answer = match call.into_ready() {
            Ok(answer) => answer,
            Err(call) => {
                drop(entered);
                let this = self.clone();
                let later = async move {
                    let result = this.await_acquire(call, key, &storage, &token).await;
                    this.settle(key, storage, token, started, result).await
                };
                return AcquireFuture::Pending(Box::pin(tracing::Instrument::instrument(
                    later, span,
                )));
            }
        };
        if let (Ok(Acquire::Held { retry_after }), Some(_)) = (&answer, self.wait) {
            self.stats.round_trip(started.elapsed(), false);
            let retry_after = *retry_after;
            drop(entered);
            let wait = self.clone().wait_turn(key, storage, token, retry_after);
            return AcquireFuture::Pending(Box::pin(tracing::Instrument::instrument(wait, span)));
        }
        AcquireFuture::Ready(Some(self.admit(key, storage, token, started, Some(answer))))
    }

    /// One backend round trip (with deadline) to take the lease on `key`, in
    /// a `lock` span that names the key digest and the layer's label.
    pub(crate) async fn acquire(self: Arc<Self>, key: LockKey) -> Admission {
        let span = tracing::debug_span!("lock", key = %key, layer = self.stats.label());
        tracing::Instrument::instrument(self.acquire_in_span(key), span).await
    }

    /// The storage key of `key` if the layer waits and requests wait for
    /// `key` here already: a newcomer queues behind them at once.
    fn queued_behind(&self, key: &LockKey) -> Option<Bytes> {
        self.wait?;
        let storage = self.key_space.storage_key(key);
        self.queue.is_waiting(&storage).then_some(storage)
    }

    async fn acquire_in_span(self: Arc<Self>, key: LockKey) -> Admission {
        if let Some(storage) = self.queued_behind(&key) {
            return self.wait_turn(key, storage, Token::generate(), None).await;
        }
        let storage = self.key_space.storage_key(&key);
        let token = Token::generate();
        let (started, result) = self.ask(key, &storage, &token).await;
        self.settle(key, storage, token, started, result).await
    }

    /// What an acquire's answer means: admitted, rejected, or (the key
    /// held, and the layer waits) a wait for the key.
    async fn settle(
        self: Arc<Self>,
        key: LockKey,
        storage: Bytes,
        token: Token,
        started: Instant,
        result: Option<Result<Acquire, BackendError>>,
    ) -> Admission {
        if let (Some(Ok(Acquire::Held { retry_after })), Some(_)) = (&result, self.wait) {
            self.stats.round_trip(started.elapsed(), false);
            return self.wait_turn(key, storage, token, *retry_after).await;
        }
        self.admit(key, storage, token, started, result)
    }

    /// One acquire of `storage` with `token`, within the deadline: when it
    /// was sent, and the answer (`None`: none in time). If this future is
    /// dropped (client gone) or gives up before the answer, the command may
    /// still land: it is cleaned up after.
    async fn ask(
        &self,
        key: LockKey,
        storage: &Bytes,
        token: &Token,
    ) -> (Instant, Option<Result<Acquire, BackendError>>) {
        let started = Instant::now();
        let call = if self.fencing {
            self.backend.acquire_fenced(storage, token, self.ttl)
        } else {
            self.backend.acquire(storage, token, self.ttl)
        };
        (started, self.await_acquire(call, key, storage, token).await)
    }

    /// Wait, within the deadline, for the answer to an acquire already
    /// asked (`call`); cleaned up after if it may still land.
    async fn await_acquire(
        &self,
        call: crate::backend::BackendFuture<Acquire>,
        key: LockKey,
        storage: &Bytes,
        token: &Token,
    ) -> Option<Result<Acquire, BackendError>> {
        let mut pending = PendingAcquire {
            backend: self.backend.clone(),
            notify: self.wait.is_some(),
            storage: storage.clone(),
            key,
            token: *token,
            // Until a late lease would expire on its own.
            wait: self.ttl.max(self.deadline),
            armed: true,
        };
        let result = tokio::time::timeout(self.deadline, call).await;
        if matches!(result, Ok(Ok(_))) {
            pending.armed = false;
        }
        drop(pending);
        result.ok()
    }

    /// Wait, in the key's queue, for the lease on `storage` (held, its
    /// lease ending in `held`), at most the layer's wait bound: looking
    /// only as the head, when the key is released or its lease expires
    /// (see `wait.rs`). The lease, a 409 at the bound or when the queue is
    /// full, or the backend failure's answer.
    async fn wait_turn(
        self: Arc<Self>,
        key: LockKey,
        storage: Bytes,
        token: Token,
        held: Option<Duration>,
    ) -> Admission {
        let began = Instant::now();
        let bound = self.wait.unwrap_or_default();
        let until = began + bound;
        let (per_key, total) = self.max_waiters;
        let expires = began + held.unwrap_or(self.ttl);
        let ticket = match self.queue.enter(&storage, expires, per_key, total) {
            Ok(ticket) => ticket,
            Err(full) => {
                self.stats.record(LockOutcome::WaitFull);
                self.stats.record(LockOutcome::Conflict);
                tracing::debug!(key = %key, outcome = "wait_full", queue = ?full, "rejected: too many waiters");
                return Admission::Rejected(self.conflict(key, held));
            }
        };
        self.stats.record(LockOutcome::Waited);
        tracing::debug!(key = %key, outcome = "waited", bound_ms = bound.as_millis() as u64);
        loop {
            if tokio::time::timeout_at(until, ticket.head()).await.is_err() {
                return self.gave_up(key, &ticket, began);
            }
            let now = Instant::now();
            if now >= until {
                return self.gave_up(key, &ticket, began);
            }
            match ticket.next(now) {
                Next::Watch => {
                    let watch = match self.backend.watch(&storage) {
                        None => None,
                        Some(call) => {
                            let at = until.min(now + self.deadline);
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
            let (started, result) = self.ask(key, &storage, &token).await;
            match result {
                Some(Ok(Acquire::Held { retry_after })) => {
                    let now = Instant::now();
                    self.stats.round_trip(now - started, false);
                    ticket.found_held(now + retry_after.unwrap_or(self.ttl));
                }
                Some(Ok(Acquire::Acquired { .. })) => {
                    ticket.took(started + self.ttl);
                    self.waited(began);
                    // Leaves the queue once the lease is ours: the next
                    // waiter waits for its release.
                    let admission = self.admit(key, storage, token, started, result);
                    drop(ticket);
                    return admission;
                }
                failed => {
                    self.waited(began);
                    drop(ticket);
                    return self.admit(key, storage, token, started, failed);
                }
            }
        }
    }

    /// Count the time waited since `began`.
    fn waited(&self, began: Instant) {
        let waited = began.elapsed();
        self.stats
            .add(LockOutcome::WaitMicros, waited.as_micros() as u64);
        #[cfg(feature = "metrics")]
        metrics::histogram!(crate::stats::WAIT_SECONDS, "layer" => self.stats.label())
            .record(waited.as_secs_f64());
    }

    /// The wait bound ran out: 409, with when the holder is expected to
    /// finish.
    fn gave_up(&self, key: LockKey, ticket: &Ticket, began: Instant) -> Admission {
        self.waited(began);
        self.stats.record(LockOutcome::WaitedConflict);
        self.stats.record(LockOutcome::Conflict);
        let left = ticket.expires().saturating_duration_since(Instant::now());
        tracing::debug!(key = %key, outcome = "waited_conflict", waited_ms = began.elapsed().as_millis() as u64);
        Admission::Rejected(self.conflict(key, Some(left)))
    }

    /// A 409 for `key`, whose holder's lease has `left` (if known).
    fn conflict(&self, key: LockKey, left: Option<Duration>) -> Rejection {
        Rejection::Conflict {
            key,
            retry_after: self.holds.retry_after(left, self.ttl, self.retry_after_cap),
        }
    }

    /// What the backend's answer (`None`: none within the deadline) to the
    /// acquire of `key` sent at `started` means for the request.
    fn admit(
        self: &Arc<Self>,
        key: LockKey,
        storage: Bytes,
        token: Token,
        started: Instant,
        result: Option<Result<Acquire, BackendError>>,
    ) -> Admission {
        // One clock read for the latency, the lease's start and its guard's.
        let now = Instant::now();
        let latency = now.saturating_duration_since(started);
        let latency_us = latency.as_micros() as u64;
        self.stats.round_trip(latency, result.is_none());
        match result {
            Some(Ok(Acquire::Acquired { fence, validity })) => {
                self.stats.record(LockOutcome::Acquired);
                tracing::debug!(key = %key, outcome = "acquired", latency_us, fence);
                // Until when the lease is safe to rely on: the backend's
                // validity from now (Redlock), else the TTL from the send.
                let valid_until = match validity {
                    Some(validity) => now + validity.min(self.ttl),
                    None => started + self.ttl,
                };
                let mut lease =
                    Lease::new(Some(key), true, self.ttl, fence, now).with_validity(validity);
                let watchdog = self.renewal.and_then(|renewal| {
                    Watchdog::spawn(
                        renewal,
                        RenewTarget {
                            backend: self.backend.clone(),
                            key: storage.clone(),
                            digest: key,
                            token,
                            ttl: self.ttl,
                            deadline: self.deadline,
                            stats: self.stats.clone(),
                            state: lease.watch(),
                            since: started,
                            valid_until,
                        },
                    )
                });
                let guard = LeaseGuard::new(self.clone(), storage, key, token, watchdog, now);
                Admission::Locked(guard, lease)
            }
            Some(Ok(Acquire::Held { retry_after })) => {
                self.stats.record(LockOutcome::Conflict);
                tracing::debug!(key = %key, outcome = "conflict", latency_us);
                Admission::Rejected(self.conflict(key, retry_after))
            }
            Some(Err(error)) => self.backend_failed(key, error, latency_us),
            None => self.backend_failed(key, BackendError::timeout(self.deadline), latency_us),
        }
    }

    fn backend_failed(&self, key: LockKey, error: BackendError, latency_us: u64) -> Admission {
        match self.fail_open {
            false => {
                self.stats.record(LockOutcome::BackendError);
                tracing::warn!(key = %key, outcome = "backend_error", latency_us, error = %error, "lock backend failed; answering 503 (fail-closed)");
                Admission::Rejected(Rejection::Unavailable {
                    retry_after: Duration::from_secs(1),
                })
            }
            true => {
                self.stats.record(LockOutcome::FailOpen);
                tracing::warn!(key = %key, outcome = "fail_open", latency_us, error = %error, "lock backend failed; running unlocked (fail-open)");
                Admission::Unlocked(Lease::new(Some(key), false, self.ttl, None, Instant::now()))
            }
        }
    }
}

/// An acquire in flight. Dropped while armed (it failed, missed its
/// deadline, or its future was dropped because the client went away), it
/// sends a best-effort compare-and-delete with our token in the background:
/// if the command still lands, the late lease blocks no one for a whole TTL
/// (a single fred client keeps the order, so the release follows it).
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

async fn cleanup_late_acquire(
    call: crate::backend::BackendFuture<bool>,
    key: LockKey,
    deadline: Duration,
) {
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
