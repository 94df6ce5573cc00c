//! Outcome counters a service can read without a metrics stack
//! ([`Stats`], from [`RedisLockLayer::stats`](crate::RedisLockLayer::stats)),
//! and, with the `metrics` feature, the same outcomes through the
//! [`metrics`](https://docs.rs/metrics) facade, labelled with the layer's
//! [`label`](crate::RedisLockLayer::label).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What happened to a lease; the `outcome` field of every tracing event the
/// crate emits, and the label of the `metrics` counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Outcome {
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
    pub(crate) fn as_str(self) -> &'static str {
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
/// [`Locker`](crate::lock::Locker)s, and layers derived from it by further
/// builder calls), and the label its metrics carry.
#[derive(Clone)]
pub(crate) struct LockStats {
    inner: Arc<Counters>,
    label: &'static str,
}

impl fmt::Debug for LockStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.snapshot(), f)
    }
}

/// A layer's outcome counters at one moment (each one only grows), from
/// [`RedisLockLayer::stats`](crate::RedisLockLayer::stats).
///
/// ```
/// use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
/// let layer = RedisLockLayer::new(MemoryBackend::new(), Route);
/// // ... serve ...
/// let now = layer.stats();
/// println!("{} acquired, {} conflicts, {} backend errors", now.acquired, now.conflict, now.backend_error);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
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

impl Stats {
    /// Mean acquire latency, if any acquire was measured.
    pub fn mean_acquire_latency(&self) -> Option<Duration> {
        self.acquire_latency_us_sum
            .checked_div(self.acquire_calls)
            .map(Duration::from_micros)
    }
}

impl LockStats {
    /// Fresh counters, all zero, labelled `label` in metrics.
    pub(crate) fn new(label: &'static str) -> Self {
        #[cfg(feature = "metrics")]
        describe_metrics();
        Self {
            inner: Arc::default(),
            label,
        }
    }

    /// The label of this layer's metrics and log spans.
    pub(crate) fn label(&self) -> &'static str {
        self.label
    }

    /// Relabel (the counters stay shared with earlier clones).
    pub(crate) fn set_label(&mut self, label: &'static str) {
        self.label = label;
    }

    /// The current values.
    pub(crate) fn snapshot(&self) -> Stats {
        let c = &self.inner;
        let get = |o: Outcome| c.outcomes[o as usize].load(Ordering::Relaxed);
        Stats {
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
        metrics::counter!(
            OUTCOMES_TOTAL,
            "layer" => self.label,
            "outcome" => outcome.as_str()
        )
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
        metrics::histogram!(ACQUIRE_SECONDS, "layer" => self.label).record(latency.as_secs_f64());
    }
}

/// Counter of every outcome, labelled `layer` and `outcome`.
#[cfg(feature = "metrics")]
const OUTCOMES_TOTAL: &str = "tower_redis_lock_outcomes_total";
/// Histogram of acquire round trips, labelled `layer`.
#[cfg(feature = "metrics")]
const ACQUIRE_SECONDS: &str = "tower_redis_lock_acquire_seconds";

/// Describe the crate's metrics (unit and help text) to the recorder
/// installed now; each new layer does it again, so a recorder installed
/// after the first layer still gets the descriptions.
#[cfg(feature = "metrics")]
fn describe_metrics() {
    metrics::describe_counter!(
        OUTCOMES_TOTAL,
        metrics::Unit::Count,
        "Lease outcomes by layer label and outcome (acquired, conflict, backend_error, \
         fail_open, skipped, released, release_failed, lease_lost, renewed, renew_failed)"
    );
    metrics::describe_histogram!(
        ACQUIRE_SECONDS,
        metrics::Unit::Seconds,
        "Time of one acquire round trip to the lock backend, by layer label"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_map_to_their_fields() {
        let s = LockStats::new("lock");
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
        assert_eq!(s.label(), "lock");
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
        struct Seen(
            Mutex<HashMap<String, f64>>,
            Mutex<Vec<(String, Option<Unit>)>>,
        );
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
            fn describe_counter(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
                self.0
                     .1
                    .lock()
                    .unwrap()
                    .push((key.as_str().to_owned(), unit));
            }
            fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
                self.0
                     .1
                    .lock()
                    .unwrap()
                    .push((key.as_str().to_owned(), unit));
            }
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
            let mut s = LockStats::new("lock");
            s.set_label("checkout");
            s.record(Outcome::Acquired);
            s.record(Outcome::Acquired);
            s.record(Outcome::LeaseLost);
            s.acquire_latency(Duration::from_millis(1), false);
            let other = LockStats::new("refund");
            other.record(Outcome::Acquired);
        });
        let described = seen.1.lock().unwrap().clone();
        assert!(described.contains(&(
            "tower_redis_lock_outcomes_total".to_owned(),
            Some(Unit::Count)
        )));
        assert!(described.contains(&(
            "tower_redis_lock_acquire_seconds".to_owned(),
            Some(Unit::Seconds)
        )));
        let seen = seen.0.lock().unwrap();
        assert_eq!(
            seen["tower_redis_lock_outcomes_total{layer=checkout,outcome=acquired}"],
            2.0
        );
        assert_eq!(
            seen["tower_redis_lock_outcomes_total{layer=refund,outcome=acquired}"],
            1.0
        );
        assert_eq!(
            seen["tower_redis_lock_outcomes_total{layer=checkout,outcome=lease_lost}"],
            1.0
        );
        assert_eq!(
            seen["tower_redis_lock_acquire_seconds{layer=checkout}"],
            1.0
        );
    }
}
