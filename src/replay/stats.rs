//! Outcome counters of the idempotency layer ([`Stats`], from
//! [`IdempotencyLayer::stats`](super::IdempotencyLayer::stats)), and, with
//! the `metrics` feature, the same outcomes through the
//! [`metrics`](https://docs.rs/metrics) facade, labelled with the layer's
//! [`label`](super::IdempotencyLayer::label); the replay side of
//! `src/stats.rs`, in the same words.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::layer::Config;

/// What happened to a request at the idempotency layer; the `outcome` of
/// its log events and the label of the `metrics` counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Outcome {
    /// The key was claimed: the handler runs.
    Claimed,
    /// A stored response was replayed.
    Replayed,
    /// A duplicate in flight waited for the original and got its answer.
    Joined,
    /// The key was reused with another payload: 422.
    Mismatch,
    /// The key is claimed by a request still running: 409.
    Conflict,
    /// The first request finished but its answer was not kept: answered
    /// with `Rejection::NotStored`.
    NotStored,
    /// The outcome of a claimed request was written to the store.
    Recorded,
    /// Writing it failed, timed out, or found the claim gone.
    RecordFailed,
    /// The store failed or missed its deadline at the claim: 503.
    BackendError,
    /// The scope held its whole share of the store: 429.
    OverQuota,
}

const OUTCOMES: usize = 10;

impl Outcome {
    /// The snake_case name used in logs and metrics.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Claimed => "claimed",
            Outcome::Replayed => "replayed",
            Outcome::Joined => "joined",
            Outcome::Mismatch => "mismatch",
            Outcome::Conflict => "conflict",
            Outcome::NotStored => "not_stored",
            Outcome::Recorded => "recorded",
            Outcome::RecordFailed => "record_failed",
            Outcome::BackendError => "backend_error",
            Outcome::OverQuota => "over_quota",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Default)]
struct Counters {
    outcomes: [AtomicU64; OUTCOMES],
    claim_timeouts: AtomicU64,
    claim_latency_us_sum: AtomicU64,
    claim_calls: AtomicU64,
}

/// Live counters of one layer, shared by its clones, its services and the
/// layers derived from it by further builder calls.
#[derive(Clone, Default)]
pub(crate) struct ReplayStats {
    inner: Arc<Counters>,
}

impl fmt::Debug for ReplayStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.snapshot(), f)
    }
}

/// An [`IdempotencyLayer`](super::IdempotencyLayer)'s outcome counters at
/// one moment (each one only grows), from
/// [`IdempotencyLayer::stats`](super::IdempotencyLayer::stats): a copy, so
/// call it again for newer values. Every request that reaches the store
/// counts once in `claimed`, `replayed`, `joined`, `mismatch`, `conflict`,
/// `not_stored` or `backend_error`; a claimed request later counts once in
/// `recorded` or `record_failed`, unless its outcome is not kept (the key
/// is freed then).
///
/// ```
/// use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
/// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route);
/// // ... serve ...
/// let now = layer.stats();
/// println!("{} claimed, {} replayed, {} conflicts", now.claimed, now.replayed, now.conflict);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Keys claimed: the handler ran.
    pub claimed: u64,
    /// Stored responses replayed (`Idempotent-Replayed: true`).
    pub replayed: u64,
    /// Duplicates that waited for the request in flight and got its
    /// answer.
    pub joined: u64,
    /// Keys reused with another payload: 422.
    pub mismatch: u64,
    /// Requests answered 409 because their key's first request was still
    /// running.
    pub conflict: u64,
    /// Requests answered `Rejection::NotStored`: the first one finished,
    /// but its response was not kept.
    pub not_stored: u64,
    /// Outcomes of claimed requests written to the store.
    pub recorded: u64,
    /// Outcomes that could not be written (the store failed or timed out,
    /// or the claim had expired): the claim expires after its TTL.
    pub record_failed: u64,
    /// Store failures at the claim, answered 503.
    pub backend_error: u64,
    /// Requests answered 429 because their scope held its whole share of
    /// the store (`IdempotencyLayer::scope_quota`).
    pub over_quota: u64,
    /// Claims that missed the deadline (part of `backend_error`).
    pub claim_timeouts: u64,
    /// Sum of claim round-trip latencies in microseconds (with
    /// `claim_calls`, the mean).
    pub claim_latency_us_sum: u64,
    /// Claim round trips measured.
    pub claim_calls: u64,
}

impl Stats {
    /// Mean claim round-trip latency, if any claim was measured.
    pub fn mean_claim_latency(&self) -> Option<Duration> {
        self.claim_latency_us_sum
            .checked_div(self.claim_calls)
            .map(Duration::from_micros)
    }
}

impl ReplayStats {
    /// Fresh counters, all zero (and the metrics described to the recorder
    /// installed now).
    pub(crate) fn new() -> Self {
        #[cfg(feature = "metrics")]
        describe_metrics();
        Self::default()
    }

    /// The current values.
    pub(crate) fn snapshot(&self) -> Stats {
        let c = &self.inner;
        let get = |o: Outcome| c.outcomes[o as usize].load(Ordering::Relaxed);
        Stats {
            claimed: get(Outcome::Claimed),
            replayed: get(Outcome::Replayed),
            joined: get(Outcome::Joined),
            mismatch: get(Outcome::Mismatch),
            conflict: get(Outcome::Conflict),
            not_stored: get(Outcome::NotStored),
            recorded: get(Outcome::Recorded),
            record_failed: get(Outcome::RecordFailed),
            backend_error: get(Outcome::BackendError),
            over_quota: get(Outcome::OverQuota),
            claim_timeouts: c.claim_timeouts.load(Ordering::Relaxed),
            claim_latency_us_sum: c.claim_latency_us_sum.load(Ordering::Relaxed),
            claim_calls: c.claim_calls.load(Ordering::Relaxed),
        }
    }

    fn record(&self, label: &'static str, outcome: Outcome) {
        self.inner.outcomes[outcome as usize].fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!(
            OUTCOMES_TOTAL,
            "layer" => label,
            "outcome" => outcome.as_str()
        )
        .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = label;
    }

    fn claim_latency(&self, label: &'static str, latency: Duration, timed_out: bool) {
        let c = &self.inner;
        c.claim_calls.fetch_add(1, Ordering::Relaxed);
        c.claim_latency_us_sum
            .fetch_add(latency.as_micros() as u64, Ordering::Relaxed);
        if timed_out {
            c.claim_timeouts.fetch_add(1, Ordering::Relaxed);
        }
        #[cfg(feature = "metrics")]
        metrics::histogram!(CLAIM_SECONDS, "layer" => label).record(latency.as_secs_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = label;
    }
}

impl Config {
    /// Count one outcome under this layer's label.
    pub(crate) fn count(&self, outcome: Outcome) {
        self.stats.record(self.label, outcome);
    }

    /// Count the end of a claimed request's recording: `true` if written.
    pub(crate) fn count_record(&self, recorded: bool) {
        self.count(if recorded {
            Outcome::Recorded
        } else {
            Outcome::RecordFailed
        });
    }

    /// Record one claim round trip (`timed_out`: it missed the deadline).
    pub(crate) fn count_claim_latency(&self, latency: Duration, timed_out: bool) {
        self.stats.claim_latency(self.label, latency, timed_out);
    }
}

/// Counter of every outcome, labelled `layer` and `outcome`.
#[cfg(feature = "metrics")]
const OUTCOMES_TOTAL: &str = "tower_redis_lock_replay_outcomes_total";
/// Histogram of claim round trips, labelled `layer`.
#[cfg(feature = "metrics")]
const CLAIM_SECONDS: &str = "tower_redis_lock_claim_seconds";

/// Describe the replay metrics (unit and help text) to the recorder
/// installed now; each new layer does it again, as the lock's do.
#[cfg(feature = "metrics")]
fn describe_metrics() {
    metrics::describe_counter!(
        OUTCOMES_TOTAL,
        metrics::Unit::Count,
        "Idempotency outcomes by layer label and outcome (claimed, replayed, joined, \
         mismatch, conflict, not_stored, recorded, record_failed, backend_error)"
    );
    metrics::describe_histogram!(
        CLAIM_SECONDS,
        metrics::Unit::Seconds,
        "Time of one claim round trip to the idempotency store, by layer label"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_map_to_their_fields() {
        let s = ReplayStats::new();
        let all = [
            Outcome::Claimed,
            Outcome::Replayed,
            Outcome::Joined,
            Outcome::Mismatch,
            Outcome::Conflict,
            Outcome::NotStored,
            Outcome::Recorded,
            Outcome::RecordFailed,
            Outcome::BackendError,
            Outcome::OverQuota,
        ];
        assert_eq!(all.len(), OUTCOMES);
        for o in all {
            s.record("replay", o);
        }
        s.record("replay", Outcome::Claimed);
        s.claim_latency("replay", Duration::from_micros(300), false);
        s.claim_latency("replay", Duration::from_micros(100), true);
        let n = s.snapshot();
        assert_eq!(n.claimed, 2);
        for v in [
            n.replayed,
            n.joined,
            n.mismatch,
            n.conflict,
            n.not_stored,
            n.recorded,
            n.record_failed,
            n.backend_error,
            n.claim_timeouts,
        ] {
            assert_eq!(v, 1);
        }
        assert_eq!(n.claim_calls, 2);
        assert_eq!(n.mean_claim_latency(), Some(Duration::from_micros(200)));
        assert_eq!(Outcome::RecordFailed.to_string(), "record_failed");
    }

    /// With the `metrics` feature, a layer's outcomes reach the recorder,
    /// labelled with the layer's label and the outcome, and the metrics are
    /// described with their units.
    #[cfg(feature = "metrics")]
    #[test]
    fn metrics_facade_sees_outcomes_with_the_label() {
        use std::collections::HashMap;
        use std::convert::Infallible;
        use std::sync::Mutex;

        use bytes::Bytes;
        use http::{Request, Response};
        use http_body_util::Full;
        use metrics::{
            Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
            SharedString, Unit,
        };
        use tower::ServiceExt;
        use tower_layer::Layer;

        use crate::key::Route;
        use crate::{IdempotencyLayer, MemoryBackend};

        #[derive(Default)]
        struct Seen {
            values: Mutex<HashMap<String, f64>>,
            described: Mutex<Vec<(String, Option<Unit>)>>,
        }
        struct Handle(Arc<Seen>, String);
        impl CounterFn for Handle {
            fn increment(&self, v: u64) {
                *self
                    .0
                    .values
                    .lock()
                    .unwrap()
                    .entry(self.1.clone())
                    .or_default() += v as f64;
            }
            fn absolute(&self, _: u64) {}
        }
        impl HistogramFn for Handle {
            fn record(&self, _: f64) {
                *self
                    .0
                    .values
                    .lock()
                    .unwrap()
                    .entry(self.1.clone())
                    .or_default() += 1.0;
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
        impl Rec {
            fn describe(&self, key: KeyName, unit: Option<Unit>) {
                let name = key.as_str().to_owned();
                self.0.described.lock().unwrap().push((name, unit));
            }
        }
        impl Recorder for Rec {
            fn describe_counter(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
                self.describe(key, unit);
            }
            fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
                self.describe(key, unit);
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

        let pay = |body: &'static str| {
            Request::post("/payments")
                .header("idempotency-key", "k")
                .body(Full::new(Bytes::from_static(body.as_bytes())))
                .unwrap()
        };
        let seen = Arc::new(Seen::default());
        let stats = metrics::with_local_recorder(&Rec(seen.clone()), || {
            let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).label("payments");
            let svc = layer.layer(tower::service_fn(|_: Request<Full<Bytes>>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"paid"))))
            }));
            // On this thread, so the local recorder sees every count.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                for (body, status) in [("{}", 200), ("{}", 200), ("{\"x\":1}", 422)] {
                    let res = svc.clone().oneshot(pay(body)).await.unwrap();
                    assert_eq!(res.status(), status);
                }
            });
            layer.stats()
        });
        let described = seen.described.lock().unwrap().clone();
        assert!(described.contains(&(
            "tower_redis_lock_replay_outcomes_total".to_owned(),
            Some(Unit::Count)
        )));
        assert!(described.contains(&(
            "tower_redis_lock_claim_seconds".to_owned(),
            Some(Unit::Seconds)
        )));
        let values = seen.values.lock().unwrap();
        let at = |outcome: &str| {
            values
                .get(&format!(
                    "tower_redis_lock_replay_outcomes_total{{layer=payments,outcome={outcome}}}"
                ))
                .copied()
                .unwrap_or(0.0)
        };
        assert_eq!(
            [
                at("claimed"),
                at("recorded"),
                at("replayed"),
                at("mismatch")
            ],
            [1.0, 1.0, 1.0, 1.0],
            "{values:?}"
        );
        assert_eq!(
            at("conflict") + at("backend_error") + at("record_failed"),
            0.0
        );
        assert_eq!(
            values["tower_redis_lock_claim_seconds{layer=payments}"],
            3.0
        );
        // The same counts as the snapshot.
        assert_eq!(
            (
                stats.claimed,
                stats.recorded,
                stats.replayed,
                stats.mismatch
            ),
            (1, 1, 1, 1)
        );
        assert_eq!(stats.claim_calls, 3);
    }
}
