//! Lease renewal (watchdog) for handlers that may outlive the TTL: opt in
//! with [`RedisLockLayer::renew`](crate::RedisLockLayer::renew).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::runtime::Handle;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::lease::LeaseState;
use crate::backend::{LockBackend, Token};
use crate::key::LockKey;
use crate::stats::{LockStats, Outcome};

/// Default number of renewals before the watchdog gives up.
pub(crate) const DEFAULT_MAX_RENEWALS: u32 = 20;

/// How a held lease is renewed while the request runs.
///
/// Every `interval` (default a third of the TTL) the watchdog resets the
/// lease's expiry to the full TTL with a compare-and-expire
/// ([`LockBackend::extend`]). It stops the moment the request ends (before
/// the release is sent: no renewal ever follows a release), and after
/// [`max_renewals`](Self::max_renewals) renewals or
/// [`max_total`](Self::max_total) time, whichever comes first; the lease then
/// expires a TTL after its last renewal.
///
/// When a renewal finds the lease gone (it expired, was evicted, or another
/// holder took the key), or no renewal succeeded before the lease's expiry,
/// the handler sees it through [`Lease::is_lost`](crate::Lease::is_lost) /
/// [`Lease::lost`](crate::Lease::lost), and a `lease_lost` event is logged.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_lock::{key::Route, lock::Renewal, MemoryBackend, RedisLockLayer};
///
/// let layer = RedisLockLayer::new(MemoryBackend::new(), Route)
///     .ttl(Duration::from_secs(5))
///     .renew(Renewal::new().max_total(Duration::from_secs(60)));
/// # let _ = layer;
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Renewal {
    interval: Option<Duration>,
    fraction: f64,
    max_renewals: u32,
    max_total: Option<Duration>,
}

impl Default for Renewal {
    fn default() -> Self {
        Self::new()
    }
}

impl Renewal {
    /// Renew every third of the TTL, at most 20 times.
    pub fn new() -> Self {
        Self {
            interval: None,
            fraction: 1.0 / 3.0,
            max_renewals: DEFAULT_MAX_RENEWALS,
            max_total: None,
        }
    }

    /// Renew at this fraction of the TTL (clamped to 0.05 ..= 0.9).
    ///
    /// ```
    /// # use tower_redis_lock::lock::Renewal;
    /// let r = Renewal::new().at_fraction(0.5);
    /// # let _ = r;
    /// ```
    pub fn at_fraction(mut self, fraction: f64) -> Self {
        self.fraction = if fraction.is_finite() {
            fraction.clamp(0.05, 0.9)
        } else {
            1.0 / 3.0
        };
        self.interval = None;
        self
    }

    /// Renew at a fixed interval (capped at 90% of the TTL, at least 1 ms).
    ///
    /// ```
    /// # use tower_redis_lock::lock::Renewal;
    /// let r = Renewal::new().every(std::time::Duration::from_secs(2));
    /// # let _ = r;
    /// ```
    pub fn every(mut self, interval: Duration) -> Self {
        self.interval = Some(interval.max(Duration::from_millis(1)));
        self
    }

    /// Stop after `n` renewals (default 20).
    ///
    /// ```
    /// # use tower_redis_lock::lock::Renewal;
    /// let r = Renewal::new().max_renewals(5);
    /// # let _ = r;
    /// ```
    pub fn max_renewals(mut self, n: u32) -> Self {
        self.max_renewals = n;
        self
    }

    /// Stop renewing once this much time passed since the lease was taken.
    ///
    /// ```
    /// # use tower_redis_lock::lock::Renewal;
    /// let r = Renewal::new().max_total(std::time::Duration::from_secs(120));
    /// # let _ = r;
    /// ```
    pub fn max_total(mut self, total: Duration) -> Self {
        self.max_total = Some(total);
        self
    }

    pub(crate) fn interval(&self, ttl: Duration) -> Duration {
        let cap = ttl.mul_f64(0.9);
        self.interval
            .unwrap_or_else(|| ttl.mul_f64(self.fraction))
            .min(cap)
            .max(Duration::from_millis(1))
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
    pub(crate) stats: LockStats,
    pub(crate) state: Arc<LeaseState>,
    /// When the acquire was sent: the lease's expiry counts from there.
    pub(crate) since: std::time::Instant,
    /// Until when the first lease is safe to rely on: `since + ttl`, or
    /// less when the backend said so (Redlock's validity).
    pub(crate) valid_until: std::time::Instant,
}

/// Handle on a running watchdog; stops it when told or dropped.
pub(crate) struct Watchdog {
    stopped: Arc<Mutex<bool>>,
    task: Option<AbortHandle>,
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
        let task = handle.spawn(run(renewal, target, stopped.clone()));
        Some(Self {
            stopped,
            task: Some(task.abort_handle()),
        })
    }

    /// Stop for good. Once this returns, no new `extend` call is started.
    pub(crate) fn stop(&mut self) {
        *self.stopped.lock().unwrap_or_else(|p| p.into_inner()) = true;
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn run(renewal: Renewal, t: RenewTarget, stopped: Arc<Mutex<bool>>) {
    let started = Instant::from_std(t.since);
    let interval = renewal.interval(t.ttl);
    let mut valid_until = Instant::from_std(t.valid_until);
    let mut last = started;
    let mut count = 0u32;
    loop {
        let capped = count >= renewal.max_renewals
            || renewal
                .max_total
                .is_some_and(|total| (last + interval).duration_since(started) > total);
        if capped {
            tracing::debug!(key = %t.digest, outcome = "renew_capped", renewals = count, "renewal cap reached; the lease expires after its TTL");
            tokio::time::sleep_until(valid_until).await;
            lost(&t, &stopped, "expired after the renewal cap");
            return;
        }
        tokio::time::sleep_until((last + interval).min(valid_until)).await;
        let sent = Instant::now();
        if sent >= valid_until {
            lost(
                &t,
                &stopped,
                "no renewal succeeded before the lease expired",
            );
            return;
        }
        last = sent;
        let call = {
            let stopped = stopped.lock().unwrap_or_else(|p| p.into_inner());
            if *stopped {
                return;
            }
            t.backend.extend(&t.key, &t.token, t.ttl)
        };
        match tokio::time::timeout(t.deadline, call).await {
            Ok(Ok(true)) => {
                count += 1;
                valid_until = sent + t.ttl;
                t.state.renewed(sent);
                t.stats.record(Outcome::Renewed);
                tracing::debug!(
                    key = %t.digest,
                    outcome = "renewed",
                    latency_us = sent.elapsed().as_micros() as u64,
                    renewals = count
                );
            }
            Ok(Ok(false)) => {
                lost(
                    &t,
                    &stopped,
                    "a renewal found the lease gone (expired, evicted or taken over)",
                );
                return;
            }
            Ok(Err(error)) => {
                t.stats.record(Outcome::RenewFailed);
                tracing::warn!(key = %t.digest, outcome = "renew_failed", error = %error, "lease renewal failed; retrying at the next interval");
            }
            Err(_) => {
                t.stats.record(Outcome::RenewFailed);
                tracing::warn!(key = %t.digest, outcome = "renew_failed", deadline_ms = t.deadline.as_millis() as u64, "lease renewal timed out; retrying at the next interval");
            }
        }
    }
}

fn lost(t: &RenewTarget, stopped: &Mutex<bool>, why: &str) {
    if *stopped.lock().unwrap_or_else(|p| p.into_inner()) {
        return; // the request already ended
    }
    t.state.mark_lost();
    t.stats.record(Outcome::LeaseLost);
    tracing::warn!(key = %t.digest, outcome = "lease_lost", "{why}; the handler is no longer protected");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_is_a_fraction_of_the_ttl_and_capped() {
        let ttl = Duration::from_secs(3);
        assert_eq!(Renewal::new().interval(ttl), Duration::from_secs(1));
        assert_eq!(
            Renewal::new().at_fraction(0.5).interval(ttl),
            Duration::from_millis(1500)
        );
        assert_eq!(
            Renewal::new().every(Duration::from_secs(10)).interval(ttl),
            Duration::from_millis(2700)
        );
        assert_eq!(
            Renewal::new().at_fraction(f64::NAN).interval(ttl),
            Duration::from_secs(1)
        );
    }
}
