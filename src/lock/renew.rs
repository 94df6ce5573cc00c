//! Lease renewal (watchdog) for handlers that may outlive the TTL: opt in
//! with [`RedisLockLayer::renew`](crate::RedisLockLayer::renew).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::backend::{BackendFuture, LockBackend, Token};
use crate::key::LockKey;
pub use crate::renewal::Renewal;
use crate::renewal::{Extend, Renewed, Schedule};
use crate::stats::Counters;
use crate::stats::LockOutcome;

/// What the renewal watchdog tells the handler (shared by clones of a lease).
#[derive(Debug, Default)]
pub(crate) struct LeaseState {
    pub(super) lost: AtomicBool,
    pub(super) renewals: AtomicU32,
    // When the last renewal was sent (its expiry counts from then).
    pub(super) renewed_at: Mutex<Option<Instant>>,
    pub(super) notify: Notify,
}

impl LeaseState {
    pub(crate) fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    pub(crate) fn renewed(&self, sent: Instant) {
        *self.renewed_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(sent);
        self.renewals.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the watchdog needs to renew one lease.
pub(crate) struct RenewTarget {
    pub(crate) backend: Arc<dyn LockBackend>,
    pub(crate) key: Bytes,
    pub(crate) digest: LockKey,
    pub(crate) token: Token,
    pub(crate) ttl: Duration,
    pub(crate) deadline: Duration,
    pub(crate) stats: Counters<LockOutcome>,
    pub(crate) state: Arc<LeaseState>,
    /// When the acquire was sent: the lease's expiry counts from there.
    pub(crate) since: Instant,
    /// Until when the first lease is safe to rely on: `since + ttl`, or
    /// less when the backend said so (Redlock's validity).
    pub(crate) valid_until: Instant,
    /// What to keep back of every renewed TTL ([`Schedule::keeping_back`]).
    pub(crate) margin: Duration,
}

/// Handle on a running watchdog; stops it when told or dropped.
pub(crate) struct Watchdog {
    stopped: Arc<Mutex<bool>>,
    task: Option<AbortHandle>,
    state: Arc<LeaseState>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog").finish_non_exhaustive()
    }
}

impl Watchdog {
    /// Start renewing `target` on the current runtime (none: no watchdog).
    pub(crate) fn spawn(renewal: Renewal, target: RenewTarget) -> Option<Self> {
        let handle = Handle::try_current().ok()?;
        let stopped = Arc::new(Mutex::new(false));
        let state = target.state.clone();
        let task = handle.spawn(run(renewal, target, stopped.clone()));
        Some(Self {
            stopped,
            task: Some(task.abort_handle()),
            state,
        })
    }

    /// Stop for good. Once this returns, no new `extend` call is started.
    /// `true` when the watchdog found the lease lost (and counted it).
    pub(crate) fn stop(&mut self) -> bool {
        let mut stopped = self.stopped.lock().unwrap_or_else(|p| p.into_inner());
        *stopped = true;
        let lost = self.state.lost.load(Ordering::SeqCst);
        drop(stopped);
        if let Some(task) = self.task.take() {
            task.abort();
        }
        lost
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// The lease as the schedule extends it: no call starts once stopped.
struct Target<'a> {
    t: &'a RenewTarget,
    stopped: &'a Mutex<bool>,
}

impl Extend for Target<'_> {
    fn extend(&self, ttl: Duration) -> Option<BackendFuture<bool>> {
        let stopped = self.stopped.lock().unwrap_or_else(|p| p.into_inner());
        (!*stopped).then(|| self.t.backend.extend(&self.t.key, &self.t.token, ttl))
    }
}

async fn run(renewal: Renewal, t: RenewTarget, stopped: Arc<Mutex<bool>>) {
    let since = t.since;
    let valid_until = t.valid_until;
    let interval = renewal.interval(t.ttl);
    // A failed renewal is tried again at the next interval.
    let mut schedule = Schedule::new(&renewal, t.ttl, t.deadline, since, valid_until, interval)
        .keeping_back(t.margin);
    let target = Target {
        t: &t,
        stopped: &stopped,
    };
    loop {
        let Some(at) = schedule.next() else {
            tracing::debug!(key = %t.digest, outcome = "renew_capped", renewals = schedule.renewals, "renewal cap reached; the lease expires after its TTL");
            tokio::time::sleep_until(schedule.valid_until).await;
            lost(&t, &stopped, "expired after the renewal cap");
            return;
        };
        tokio::time::sleep_until(at).await;
        let sent = Instant::now();
        if sent >= schedule.valid_until {
            lost(
                &t,
                &stopped,
                "no renewal succeeded before the lease expired",
            );
            return;
        }
        // A renewal still unanswered at the known expiry loses the lease
        // then: another request may hold the key from that moment, whatever
        // the renewal answers later.
        let expiry = schedule.valid_until;
        let Ok(renewed) = tokio::time::timeout_at(expiry, schedule.renew(&target)).await else {
            lost(
                &t,
                &stopped,
                "a renewal was not answered before the lease expired",
            );
            return;
        };
        match renewed {
            Renewed::Extended => {
                t.state.renewed(sent);
                t.stats.record(LockOutcome::Renewed);
                tracing::debug!(
                    key = %t.digest,
                    outcome = "renewed",
                    latency_us = sent.elapsed().as_micros() as u64,
                    renewals = schedule.renewals
                );
            }
            Renewed::Gone => {
                lost(
                    &t,
                    &stopped,
                    "a renewal found the lease gone (expired, evicted or taken over)",
                );
                return;
            }
            Renewed::Failed(error) => {
                t.stats.record(LockOutcome::RenewFailed);
                tracing::warn!(key = %t.digest, outcome = "renew_failed", error = %error, "lease renewal failed; retrying at the next interval");
            }
            Renewed::Stopped => return,
        }
    }
}

fn lost(t: &RenewTarget, stopped: &Mutex<bool>, why: &str) {
    let stopped = stopped.lock().unwrap_or_else(|p| p.into_inner());
    if *stopped {
        return; // the request already ended
    }
    // Marked under the lock: a `stop` after this sees it, and the release
    // does not count the same loss again.
    t.state.mark_lost();
    drop(stopped);
    t.stats.record(LockOutcome::LeaseLost);
    tracing::warn!(key = %t.digest, outcome = "lease_lost", "{why}; the handler is no longer protected");
}
