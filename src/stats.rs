//! Outcome counters a service can read without a metrics stack
//! ([`LockStats`], from [`RedisLockLayer::stats`](crate::RedisLockLayer::stats)),
//! and, with the `metrics` feature, the same outcomes through the
//! [`metrics`](https://docs.rs/metrics) facade.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What happened to a lease; the `outcome` field of every tracing event the
/// crate emits, and the label of the `metrics` counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The lease was taken.
    Acquired,
    /// Someone else held the key: 409.
    Conflict,
    /// The backend failed or missed its deadline and the layer is fail-closed: 503.
    BackendError,
    /// The backend failed and the layer is fail-open: the handler ran unlocked.
    FailOpen,
    /// A key part was missing and the layer skips locking then.
    Skipped,
    /// The lease was given back.
    Released,
    /// The release could not reach the backend in time; the TTL will free the key.
    ReleaseFailed,
    /// The lease was gone when we released or renewed it (expired, evicted,
    /// taken over).
    LeaseLost,
    /// A renewal (watchdog) extended the lease.
    Renewed,
    /// A renewal could not reach the backend in time (the lease may still be ours).
    RenewFailed,
}

impl Outcome {
    /// The snake_case name used in logs and metrics (`"acquired"`, `"conflict"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Acquired => "acquired",
            Outcome::Conflict => "conflict",
            Outcome::BackendError => "backend_error",
            Outcome::FailOpen => "fail_open",
            Outcome::Skipped => "skipped",
            Outcome::Released => "released",
            Outcome::ReleaseFailed => "release_failed",
            Outcome::LeaseLost => "lease_lost",
            Outcome::Renewed => "renewed",
            Outcome::RenewFailed => "renew_failed",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

const OUTCOMES: usize = 10;

#[derive(Default)]
struct Counters {
    outcomes: [AtomicU64; OUTCOMES],
    acquire_timeouts: AtomicU64,
    acquire_latency_us_sum: AtomicU64,
    acquire_calls: AtomicU64,
}

/// Live counters of one layer (shared by its clones, its services, its
/// [`Locker`](crate::Locker), and layers derived from it by further builder
/// calls). Cheap to clone; read with [`snapshot`](Self::snapshot).
///
/// ```
/// use tower_redis_lock::{MemoryBackend, RedisLockLayer};
/// let layer = RedisLockLayer::new(MemoryBackend::new());
/// let stats = layer.stats();
/// // ... serve ...
/// let now = stats.snapshot();
/// println!("{} acquired, {} conflicts, {} backend errors", now.acquired, now.conflict, now.backend_error);
/// ```
#[derive(Clone, Default)]
pub struct LockStats {
    inner: Arc<Counters>,
}

impl fmt::Debug for LockStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.snapshot(), f)
    }
}

/// Counter values at one moment (each one only grows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Leases taken.
    pub acquired: u64,
    /// Requests answered 409 because the key was held.
    pub conflict: u64,
    /// Backend failures answered 503 (fail-closed).
    pub backend_error: u64,
    /// Backend failures that ran the handler unlocked (fail-open).
    pub fail_open: u64,
    /// Requests run unlocked because a key part was missing.
    pub skipped: u64,
    /// Leases given back.
    pub released: u64,
    /// Releases that failed or timed out (the TTL frees the key).
    pub release_failed: u64,
    /// Leases found gone at release or renewal.
    pub lease_lost: u64,
    /// Successful renewals.
    pub renewed: u64,
    /// Renewals that failed or timed out.
    pub renew_failed: u64,
    /// Acquires that missed the deadline (part of `backend_error`/`fail_open`).
    pub acquire_timeouts: u64,
    /// Sum of acquire latencies in microseconds (with `acquire_calls`, the mean).
    pub acquire_latency_us_sum: u64,
    /// Acquire round trips measured.
    pub acquire_calls: u64,
}

impl StatsSnapshot {
    /// Mean acquire latency, if any acquire was measured.
    pub fn mean_acquire_latency(&self) -> Option<Duration> {
        self.acquire_latency_us_sum
            .checked_div(self.acquire_calls)
            .map(Duration::from_micros)
    }
}

impl LockStats {
    /// Fresh counters, all zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// The current values.
    pub fn snapshot(&self) -> StatsSnapshot {
        let c = &self.inner;
        let get = |o: Outcome| c.outcomes[o as usize].load(Ordering::Relaxed);
        StatsSnapshot {
            acquired: get(Outcome::Acquired),
            conflict: get(Outcome::Conflict),
            backend_error: get(Outcome::BackendError),
            fail_open: get(Outcome::FailOpen),
            skipped: get(Outcome::Skipped),
            released: get(Outcome::Released),
            release_failed: get(Outcome::ReleaseFailed),
            lease_lost: get(Outcome::LeaseLost),
            renewed: get(Outcome::Renewed),
            renew_failed: get(Outcome::RenewFailed),
            acquire_timeouts: c.acquire_timeouts.load(Ordering::Relaxed),
            acquire_latency_us_sum: c.acquire_latency_us_sum.load(Ordering::Relaxed),
            acquire_calls: c.acquire_calls.load(Ordering::Relaxed),
        }
    }

    /// Count one outcome (and emit it through `metrics` with that feature).
    pub(crate) fn record(&self, outcome: Outcome) {
        self.inner.outcomes[outcome as usize].fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!("tower_redis_lock_outcomes_total", "outcome" => outcome.as_str())
            .increment(1);
    }

    /// Record one acquire round trip's latency (`timed_out`: it missed the deadline).
    pub(crate) fn acquire_latency(&self, latency: Duration, timed_out: bool) {
        let c = &self.inner;
        c.acquire_calls.fetch_add(1, Ordering::Relaxed);
        c.acquire_latency_us_sum
            .fetch_add(latency.as_micros() as u64, Ordering::Relaxed);
        if timed_out {
            c.acquire_timeouts.fetch_add(1, Ordering::Relaxed);
        }
        #[cfg(feature = "metrics")]
        metrics::histogram!("tower_redis_lock_acquire_seconds").record(latency.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_map_to_their_fields() {
        let s = LockStats::new();
        for o in [
            Outcome::Acquired,
            Outcome::Conflict,
            Outcome::BackendError,
            Outcome::FailOpen,
            Outcome::Skipped,
            Outcome::Released,
            Outcome::ReleaseFailed,
            Outcome::LeaseLost,
            Outcome::Renewed,
            Outcome::RenewFailed,
        ] {
            s.record(o);
        }
        s.record(Outcome::Acquired);
        s.acquire_latency(Duration::from_micros(300), false);
        s.acquire_latency(Duration::from_micros(100), true);
        let n = s.snapshot();
        assert_eq!(n.acquired, 2);
        for v in [
            n.conflict,
            n.backend_error,
            n.fail_open,
            n.skipped,
            n.released,
            n.release_failed,
            n.lease_lost,
            n.renewed,
            n.renew_failed,
            n.acquire_timeouts,
        ] {
            assert_eq!(v, 1);
        }
        assert_eq!(n.mean_acquire_latency(), Some(Duration::from_micros(200)));
        assert_eq!(Outcome::BackendError.to_string(), "backend_error");
    }

    /// With the `metrics` feature, outcomes and latencies reach the recorder.
    #[cfg(feature = "metrics")]
    #[test]
    fn metrics_facade_sees_outcomes() {
        use std::collections::HashMap;
        use std::sync::Mutex;

        use metrics::{
            Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
            SharedString, Unit,
        };

        #[derive(Default)]
        struct Seen(Mutex<HashMap<String, f64>>);
        struct Handle(Arc<Seen>, String);
        impl CounterFn for Handle {
            fn increment(&self, v: u64) {
                *self.0 .0.lock().unwrap().entry(self.1.clone()).or_default() += v as f64;
            }
            fn absolute(&self, _: u64) {}
        }
        impl HistogramFn for Handle {
            fn record(&self, _: f64) {
                *self.0 .0.lock().unwrap().entry(self.1.clone()).or_default() += 1.0;
            }
        }
        struct Rec(Arc<Seen>);
        fn name(key: &Key) -> String {
            let labels: Vec<_> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            format!("{}{{{}}}", key.name(), labels.join(","))
        }
        impl Recorder for Rec {
            fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
                Counter::from_arc(Arc::new(Handle(self.0.clone(), name(key))))
            }
            fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
                Gauge::noop()
            }
            fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
                Histogram::from_arc(Arc::new(Handle(self.0.clone(), name(key))))
            }
        }

        let seen = Arc::new(Seen::default());
        metrics::with_local_recorder(&Rec(seen.clone()), || {
            let s = LockStats::new();
            s.record(Outcome::Acquired);
            s.record(Outcome::Acquired);
            s.record(Outcome::LeaseLost);
            s.acquire_latency(Duration::from_millis(1), false);
        });
        let seen = seen.0.lock().unwrap();
        assert_eq!(
            seen["tower_redis_lock_outcomes_total{outcome=acquired}"],
            2.0
        );
        assert_eq!(
            seen["tower_redis_lock_outcomes_total{outcome=lease_lost}"],
            1.0
        );
        assert_eq!(seen["tower_redis_lock_acquire_seconds{}"], 1.0);
    }
}
