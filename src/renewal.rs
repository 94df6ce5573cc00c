//! Renewing a lease (lock layer) or a claim (idempotency layer) while its
//! request runs: one schedule for both. The layer says what to extend
//! ([`Extend`]) and what to do with each answer; the schedule says when,
//! how often at most, and until when the lease or claim is known to hold.

use std::time::Duration;

use tokio::time::Instant;

use crate::backend::BackendFuture;

/// Default number of renewals before the watchdog gives up.
pub(crate) const DEFAULT_MAX_RENEWALS: u32 = 20;

/// How a held lease is renewed while the request runs.
///
/// Every `interval` (default a third of the TTL) the watchdog resets the
/// lease's expiry to the full TTL with a compare-and-expire
/// ([`LockBackend::extend`](crate::backend::LockBackend::extend)). It stops the moment the request ends (before
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
        self.interval = Some(crate::settings::at_least_1ms(interval));
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
        self.max_total = Some(crate::settings::at_most_max(total));
        self
    }

    pub(crate) fn max_renewals_or_default(&self) -> u32 {
        self.max_renewals
    }

    pub(crate) fn max_total_or_none(&self) -> Option<Duration> {
        self.max_total
    }

    pub(crate) fn interval(&self, ttl: Duration) -> Duration {
        let cap = ttl.mul_f64(0.9);
        self.interval
            .unwrap_or_else(|| ttl.mul_f64(self.fraction))
            .min(cap)
            .max(Duration::from_millis(1))
    }
}

/// What a schedule renews: a lease or a claim, with its own key and token.
pub(crate) trait Extend {
    /// Push the expiry out to `ttl` from now (`Ok(false)`: not ours any
    /// more). `None`: the request ended, so no call is started.
    fn extend(&self, ttl: Duration) -> Option<BackendFuture<bool>>;
}

/// What one renewal found.
#[derive(Debug)]
pub(crate) enum Renewed {
    /// Extended: it holds a TTL from when the call was sent.
    Extended,
    /// Not ours any more (expired, evicted, taken over, done).
    Gone,
    /// The backend failed or missed the deadline: tried again sooner.
    Failed(String),
    /// The request ended before the call was started.
    Stopped,
}

/// When to renew next, and what is known of the expiry.
#[derive(Debug)]
pub(crate) struct Schedule {
    interval: Duration,
    retry: Duration,
    max_renewals: u32,
    max_total: Option<Duration>,
    ttl: Duration,
    /// What the store keeps back of each TTL (Redlock: what its validity
    /// kept back, the drift allowance and the quorum's time).
    margin: Duration,
    deadline: Duration,
    started: Instant,
    next: Instant,
    /// Until when the lease or claim is known to hold (a TTL from the last
    /// call that extended it).
    pub(crate) valid_until: Instant,
    /// Renewals that extended it.
    pub(crate) renewals: u32,
    /// The last renewal failed at or after `valid_until`: the next try is
    /// `retry` after it, not the (past) expiry.
    past_expiry: bool,
}

impl Schedule {
    /// A schedule by `policy` for something taken at `since` with `ttl`,
    /// known to hold until `valid_until`; after a failed renewal the next
    /// try comes `retry` later (at most the interval).
    pub(crate) fn new(
        policy: &Renewal,
        ttl: Duration,
        deadline: Duration,
        since: Instant,
        valid_until: Instant,
        retry: Duration,
    ) -> Self {
        let interval = policy.interval(ttl);
        Self {
            interval,
            retry: retry.min(interval),
            max_renewals: policy.max_renewals_or_default(),
            max_total: policy.max_total_or_none(),
            ttl,
            margin: Duration::ZERO,
            deadline,
            started: since,
            next: since + interval,
            valid_until,
            renewals: 0,
            past_expiry: false,
        }
    }

    /// Keep `margin` back of every renewed TTL (what the store's first
    /// answer kept back of it: Redlock's validity).
    pub(crate) fn keeping_back(mut self, margin: Duration) -> Self {
        self.margin = margin.min(self.ttl);
        self
    }

    /// When to renew next (never after the known expiry, unless a renewal
    /// already failed past it: then a retry later); `None` once the
    /// renewal cap (count or total time) is reached.
    pub(crate) fn next(&self) -> Option<Instant> {
        let capped = self.renewals >= self.max_renewals
            || self
                .max_total
                .is_some_and(|total| self.next.duration_since(self.started) > total);
        let at = match self.past_expiry {
            true => self.next,
            false => self.next.min(self.valid_until),
        };
        (!capped).then_some(at)
    }

    /// No renewal follows (what was renewed is gone).
    pub(crate) fn stop(&mut self) {
        self.max_renewals = 0;
    }

    /// Renew now, within the deadline.
    pub(crate) async fn renew(&mut self, target: &impl Extend) -> Renewed {
        let sent = Instant::now();
        let Some(call) = target.extend(self.ttl) else {
            return Renewed::Stopped;
        };
        match tokio::time::timeout(self.deadline, call).await {
            Ok(Ok(true)) => {
                self.renewals += 1;
                self.valid_until = sent + self.ttl.saturating_sub(self.margin);
                self.next = sent + self.interval;
                self.past_expiry = false;
                Renewed::Extended
            }
            Ok(Ok(false)) => Renewed::Gone,
            Ok(Err(error)) => {
                self.next = sent + self.retry;
                self.past_expiry = sent >= self.valid_until;
                Renewed::Failed(error.to_string())
            }
            Err(_) => {
                self.next = sent + self.retry;
                self.past_expiry = sent >= self.valid_until;
                Renewed::Failed(format!(
                    "no answer within the {} ms deadline",
                    self.deadline.as_millis()
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests;
