//! The lease a request holds: what the handler may see ([`Lease`]), a
//! lease the store granted ([`Taken`]), and the drop guard that gives it
//! back ([`LeaseGuard`]: it makes the release call).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::runtime::Handle;
use tokio::time::Instant;

use super::config::Config;
use super::renew::{LeaseState, RenewTarget, Watchdog};
use crate::backend::{BackendError, BackendFuture, Token};
use crate::key::LockKey;
use crate::stats::{Counters, LockOutcome};

/// The request's lease, as the handler sees it (a request extension; with the
/// `axum` feature also an extractor).
///
/// How the request was admitted, from [`is_locked`](Self::is_locked) and
/// [`key`](Self::key):
///
/// | `is_locked()` | `key()` | the request |
/// |---|---|---|
/// | `true` | `Some` | holds the lease: no other request with this key runs now |
/// | `false` | `Some` | runs unlocked: the backend failed and the layer is [`fail_open`](crate::RedisLockLayer::fail_open) |
/// | `false` | `None` | runs unlocked: a key part was missing and the layer [skips locking](crate::RedisLockLayer::skip_missing_part) then |
#[derive(Debug, Clone)]
pub struct Lease {
    key: Option<LockKey>,
    locked: bool,
    acquired_at: Instant,
    ttl: Duration,
    // Less than `ttl` when the backend said so (Redlock's validity).
    validity: Option<Duration>,
    // What the store keeps back of each renewed TTL (Redlock's drift
    // allowance).
    margin: Duration,
    fence: Option<u64>,
    // Only with renewal: what the watchdog found.
    state: Option<Arc<LeaseState>>,
}

impl Lease {
    /// A lease on `key` (`None`: locking skipped), held when `locked`.
    pub(crate) fn new(
        key: Option<LockKey>,
        locked: bool,
        ttl: Duration,
        fence: Option<u64>,
        acquired_at: Instant,
    ) -> Self {
        Self {
            key,
            locked,
            acquired_at,
            ttl,
            validity: None,
            margin: Duration::ZERO,
            fence,
            state: None,
        }
    }

    /// The lease is safe to rely on for `validity` from now (less than the
    /// TTL: Redlock), `None` for the whole TTL.
    pub(crate) fn with_validity(mut self, validity: Option<Duration>) -> Self {
        self.validity = validity.map(|v| v.min(self.ttl));
        self
    }

    /// The state a renewal watchdog reports into (created on first use).
    pub(crate) fn watch(&mut self) -> Arc<LeaseState> {
        self.state.get_or_insert_with(Arc::default).clone()
    }

    /// The key digest (absent when a key part was missing and locking skipped).
    pub fn key(&self) -> Option<&LockKey> {
        self.key.as_ref()
    }

    /// `true` when this request holds the lease; `false` when it runs
    /// unlocked (fail-open, or locking skipped: see the table above).
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// The lease's time to live as configured.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Time left before the lease expires on its own (zero when not locked or
    /// lost).
    ///
    /// Measured from when the acquire answered (or the last renewal was
    /// sent), so it is a slight over-estimate by the network delay of that
    /// answer. Over Redlock, the first lease counts its validity (the TTL
    /// minus the time the quorum took and the clock-drift allowance), not
    /// the whole TTL, and each renewal the TTL minus that allowance.
    pub fn remaining(&self) -> Duration {
        if !self.is_locked() || self.is_lost() {
            return Duration::ZERO;
        }
        let renewed = self
            .state
            .as_ref()
            .and_then(|s| *s.renewed_at.lock().unwrap_or_else(|p| p.into_inner()));
        match renewed {
            Some(since) => self
                .ttl
                .saturating_sub(self.margin)
                .saturating_sub(since.elapsed()),
            None => self
                .validity
                .unwrap_or(self.ttl)
                .saturating_sub(self.acquired_at.elapsed()),
        }
    }

    /// Fencing token: a number per key that strictly increases (from one
    /// holder to the next; a large number with gaps, below 2^53), issued
    /// with the lease when [`RedisLockLayer::fencing`](crate::RedisLockLayer::fencing)
    /// is on (`None` otherwise, and when running unlocked). Pass it to the
    /// system you write to and have it refuse writes with an older (`<`)
    /// fence.
    pub fn fence(&self) -> Option<u64> {
        self.fence
    }

    /// `true` once the renewal watchdog
    /// ([`RedisLockLayer::renew`](crate::RedisLockLayer::renew)) found the
    /// lease gone, or could not renew it before it expired: another request
    /// with the same key may now run. Always `false` without renewal (nothing
    /// watches the lease then).
    pub fn is_lost(&self) -> bool {
        self.state
            .as_ref()
            .is_some_and(|s| s.lost.load(Ordering::SeqCst))
    }

    /// Resolves when the lease is lost (see [`is_lost`](Self::is_lost));
    /// pending forever otherwise. For `tokio::select!` around long work:
    ///
    /// ```
    /// # async fn work() {}
    /// # async fn demo(lease: tower_redis_lock::Lease) -> Result<(), &'static str> {
    /// tokio::select! {
    ///     () = work() => Ok(()),
    ///     () = lease.lost() => Err("lease lost; stopping before a duplicate overlaps"),
    /// }
    /// # }
    /// ```
    pub async fn lost(&self) {
        let Some(state) = &self.state else {
            return std::future::pending().await;
        };
        loop {
            let notified = state.notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.is_lost() {
                return;
            }
            notified.await;
        }
    }

    /// How many times the watchdog renewed this lease so far.
    pub fn renewals(&self) -> u32 {
        self.state
            .as_ref()
            .map_or(0, |s| s.renewals.load(Ordering::Relaxed))
    }
}

pin_project_lite::pin_project! {
    /// A release on its way: already done when the store answered in the
    /// call (in-process: no future, no deadline timer), or the store's
    /// future, waited for at most the deadline (the timer is inline and
    /// armed only if the answer is not there at the first poll).
    pub(crate) struct ReleaseFuture {
        #[pin]
        timer: Option<tokio::time::Sleep>,
        state: Option<ReleaseState>,
    }
}

enum ReleaseState {
    Done(bool),
    Pending(PendingRelease),
}

/// A release asked of the backend, and what its outcome is counted with.
struct PendingRelease {
    call: BackendFuture<bool>,
    digest: LockKey,
    deadline: Duration,
    started: Instant,
    stats: Counters<LockOutcome>,
    /// The watchdog counted the lease lost already.
    known_lost: bool,
}

impl ReleaseFuture {
    fn done(released: bool) -> Self {
        Self {
            timer: None,
            state: Some(ReleaseState::Done(released)),
        }
    }

    /// `true` when the release already happened (nothing to wait for).
    pub(crate) fn is_done(&self) -> bool {
        matches!(self.state, Some(ReleaseState::Done(_)))
    }
}

impl Future for ReleaseFuture {
    type Output = bool;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<bool> {
        use std::task::Poll;
        let mut this = self.project();
        let pending = match this.state {
            Some(ReleaseState::Done(released)) => {
                let released = *released;
                *this.state = None;
                return Poll::Ready(released);
            }
            Some(ReleaseState::Pending(pending)) => pending,
            None => panic!("tower-redis-lock: release polled after it completed"),
        };
        let answer = match Pin::new(&mut pending.call).poll(cx) {
            Poll::Ready(result) => Some(result),
            Poll::Pending => {
                if this.timer.is_none() {
                    let at = pending.started + pending.deadline;
                    this.timer.set(Some(tokio::time::sleep_until(at)));
                }
                match this.timer.as_mut().as_pin_mut().map(|t| t.poll(cx)) {
                    Some(Poll::Ready(())) => None,
                    _ => return Poll::Pending,
                }
            }
        };
        let latency_us = pending.started.elapsed().as_micros() as u64;
        let released = released_as(
            answer,
            pending.digest,
            latency_us,
            pending.deadline,
            Some(&pending.stats),
            pending.known_lost,
        );
        *this.state = None;
        Poll::Ready(released)
    }
}

/// A lease the store granted (the acquire engine's answer): the caller
/// holds it with [`hold`](Self::hold).
#[derive(Debug)]
pub(crate) struct Taken {
    pub(crate) key: LockKey,
    /// Its backend key.
    pub(crate) storage: Bytes,
    pub(crate) token: Token,
    pub(crate) fence: Option<u64>,
    /// Less than the TTL when the backend said so (Redlock).
    pub(crate) validity: Option<Duration>,
    /// When the acquire was sent: the lease's expiry counts from there.
    pub(crate) started: Instant,
    /// Until when the lease is safe to rely on.
    pub(crate) valid_until: Instant,
    /// When the store's answer was read.
    pub(crate) at: Instant,
}

impl Taken {
    /// The guard that gives this lease back through the layer of `config`
    /// (renewed by a watchdog when the layer renews), and the [`Lease`] the
    /// handler sees.
    pub(crate) fn hold(self, config: &Arc<Config>) -> (LeaseGuard, Lease) {
        let ttl = config.settings.ttl;
        let mut lease =
            Lease::new(Some(self.key), true, ttl, self.fence, self.at).with_validity(self.validity);
        // What the store's validity kept back of the TTL (Redlock: its
        // drift allowance and the quorum's time): kept back of every
        // renewal too, whatever this layer's own overhead around the call.
        lease.margin = self
            .validity
            .map_or(Duration::ZERO, |v| ttl.saturating_sub(v));
        let watchdog = config.renewal.and_then(|renewal| {
            Watchdog::spawn(
                renewal,
                RenewTarget {
                    backend: config.backend.clone(),
                    key: self.storage.clone(),
                    digest: self.key,
                    token: self.token,
                    ttl,
                    deadline: config.settings.deadline,
                    stats: config.stats.clone(),
                    state: lease.watch(),
                    since: self.started,
                    valid_until: self.valid_until,
                    margin: lease.margin,
                },
            )
        });
        let guard = LeaseGuard::new(
            config.clone(),
            self.storage,
            self.key,
            self.token,
            watchdog,
            self.at,
        );
        (guard, lease)
    }
}

/// Owns a held lease; gives it back on [`release`](Self::release) or, if
/// still armed, when dropped (on a spawned task: `Drop` never blocks).
pub(crate) struct LeaseGuard {
    /// The layer's store, deadline, counters and hold times: one reference
    /// for all of them.
    config: Arc<Config>,
    key: Bytes,
    digest: LockKey,
    token: Token,
    handle: Option<Handle>,
    armed: bool,
    watchdog: Option<Watchdog>,
    /// The watchdog found the lease lost (and counted it): the release's
    /// "not ours" is not counted again.
    known_lost: bool,
    since: Instant,
}

impl std::fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("key", &self.digest)
            .field("armed", &self.armed)
            .finish_non_exhaustive()
    }
}

impl LeaseGuard {
    /// The guard of a lease taken with `token` on `key` at `since` through
    /// the layer of `config`: released through its backend within its
    /// deadline, counted in its counters, the hold's duration recorded in
    /// its hold times; renewed by `watchdog`, if any, which is stopped
    /// before any release.
    pub(crate) fn new(
        config: Arc<Config>,
        key: Bytes,
        digest: LockKey,
        token: Token,
        watchdog: Option<Watchdog>,
        since: Instant,
    ) -> Self {
        Self {
            config,
            key,
            digest,
            token,
            handle: Handle::try_current().ok(),
            armed: true,
            watchdog,
            known_lost: false,
            since,
        }
    }

    /// Called once, by release or drop, whichever comes first (a lease
    /// kept until its TTL is not a hold that tells when holders finish).
    fn record_hold(&self) {
        self.config.holds.record(self.since.elapsed());
    }

    fn stop_renewal(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            self.known_lost = w.stop();
        }
    }

    /// Release `token`'s lease on `key`: telling the waiters of every
    /// instance when this layer's requests wait
    /// ([`release_notify`](crate::backend::LockBackend::release_notify)), a
    /// plain release otherwise.
    fn release_call(&self) -> BackendFuture<bool> {
        let backend = &self.config.backend;
        match self.config.wait {
            Some(_) => backend.release_notify(&self.key, &self.token),
            None => backend.release(&self.key, &self.token),
        }
    }

    /// Count and log the answer a store gave in the call (in-process: no
    /// future, no timer), asked at `started`.
    fn released_in_call(&self, answer: Result<bool, BackendError>, started: Instant) -> bool {
        let latency_us = started.elapsed().as_micros() as u64;
        let deadline = self.config.settings.deadline;
        let stats = Some(&self.config.stats);
        released_as(
            Some(answer),
            self.digest,
            latency_us,
            deadline,
            stats,
            self.known_lost,
        )
    }

    /// Release now; the future resolves when the backend answered (or the
    /// deadline passed) with whether our lease was still there.
    pub(crate) fn release(mut self) -> ReleaseFuture {
        self.stop_renewal();
        self.record_hold();
        self.armed = false;
        let started = Instant::now();
        let call = match self.release_call().into_ready() {
            Ok(answer) => return ReleaseFuture::done(self.released_in_call(answer, started)),
            Err(call) => call,
        };
        ReleaseFuture {
            timer: None,
            state: Some(ReleaseState::Pending(PendingRelease {
                call,
                digest: self.digest,
                deadline: self.config.settings.deadline,
                started,
                stats: self.config.stats.clone(),
                known_lost: self.known_lost,
            })),
        }
    }

    /// Keep the lease until its TTL (debounce mode): nothing is released,
    /// nothing renewed.
    pub(crate) fn keep_until_ttl(mut self) {
        self.stop_renewal();
        self.armed = false;
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.stop_renewal();
        if !self.armed {
            return;
        }
        self.armed = false;
        self.record_hold();
        let Some(handle) = &self.handle else {
            // No runtime to send a release on: only a store that answers
            // in the call (in-process) can still release.
            if self.config.backend.is_in_process() {
                let started = Instant::now();
                if let Ok(answer) = self.release_call().into_ready() {
                    self.released_in_call(answer, started);
                    return;
                }
            }
            tracing::warn!(
                key = %self.digest,
                "lease dropped outside a Tokio runtime; it will expire after its TTL"
            );
            return;
        };
        // Ask the backend now, not on the spawned task: a backend that
        // delivers releases on tasks of its own (Redis) counts this one at
        // once, so `LockBackend::drain` waits for it even if the spawned
        // task below has not run yet. A store that answers in the call
        // (in-process: a map operation under a short lock, never a wait)
        // has released already.
        let _entered = handle.enter();
        let started = Instant::now();
        match self.release_call().into_ready() {
            Ok(answer) => {
                self.released_in_call(answer, started);
            }
            Err(call) => {
                let deadline = self.config.settings.deadline;
                let stats = Some(self.config.stats.clone());
                let task = finish_release(call, self.digest, deadline, stats, self.known_lost);
                drop(handle.spawn(task));
            }
        }
    }
}

/// Wait (at most `deadline`) for a release already asked of the backend, and
/// count and log its outcome.
async fn finish_release(
    call: BackendFuture<bool>,
    digest: LockKey,
    deadline: Duration,
    stats: Option<Counters<LockOutcome>>,
    known_lost: bool,
) -> bool {
    let started = Instant::now();
    let result = tokio::time::timeout(deadline, call).await;
    let latency_us = started.elapsed().as_micros() as u64;
    released_as(
        result.ok(),
        digest,
        latency_us,
        deadline,
        stats.as_ref(),
        known_lost,
    )
}

/// Count and log how a release ended (`None`: no answer within `deadline`);
/// `true` when our lease was still there and is now gone. A lease the
/// renewal watchdog found lost (`known_lost`) was counted and logged then:
/// its release's "not ours" is not counted again.
fn released_as(
    result: Option<Result<bool, BackendError>>,
    digest: LockKey,
    latency_us: u64,
    deadline: Duration,
    stats: Option<&Counters<LockOutcome>>,
    known_lost: bool,
) -> bool {
    let record = |outcome| {
        if let Some(stats) = stats {
            stats.record(outcome);
        }
    };
    match result {
        Some(Ok(true)) => {
            record(LockOutcome::Released);
            tracing::debug!(key = %digest, outcome = "released", latency_us);
            true
        }
        Some(Ok(false)) if known_lost => {
            tracing::debug!(key = %digest, outcome = "lease_lost", latency_us, "released a lease found lost before");
            false
        }
        Some(Ok(false)) => {
            record(LockOutcome::LeaseLost);
            tracing::warn!(
                key = %digest,
                outcome = "lease_lost",
                latency_us,
                "lease had already expired or was taken over before release; consider a longer TTL or renewal"
            );
            false
        }
        Some(Err(e)) => {
            record(LockOutcome::ReleaseFailed);
            tracing::warn!(key = %digest, outcome = "release_failed", latency_us, error = %e, "release failed; the lease expires after its TTL");
            false
        }
        None => {
            record(LockOutcome::ReleaseFailed);
            tracing::warn!(key = %digest, outcome = "release_failed", latency_us, deadline_ms = deadline.as_millis() as u64, "no answer to the release within the deadline; it is still being delivered (the TTL is the safety net)");
            false
        }
    }
}
