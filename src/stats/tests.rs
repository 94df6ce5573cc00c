//! Each outcome counts in its own field, and, with the `metrics` feature,
//! reaches the recorder under the layer's metric names.

use super::{testing, Outcomes};
use super::{IdempotencyOutcome, LockOutcome};

/// Each layer's outcomes count in their own fields, each field once.
#[test]
fn every_outcome_field_is_counted_once() {
    testing::outcomes_map_to_their_fields::<LockOutcome>();
    testing::outcomes_map_to_their_fields::<IdempotencyOutcome>();
    assert_eq!(LockOutcome::BackendError.as_str(), "backend_error");
    assert_eq!(IdempotencyOutcome::RecordFailed.as_str(), "record_failed");
    assert_eq!(
        IdempotencyOutcome::of_record(false),
        IdempotencyOutcome::RecordFailed
    );
    assert_eq!(
        IdempotencyOutcome::of_record(true),
        IdempotencyOutcome::Recorded
    );
}

#[cfg(feature = "metrics")]
mod metrics_facade {
    use std::time::Duration;

    use super::*;
    use crate::stats::Counters;

    /// With the `metrics` feature, outcomes and latencies reach the recorder.
    #[test]
    fn metrics_facade_sees_outcomes() {
        use std::sync::Arc;

        use metrics::Unit;

        use crate::stats::testing::recorder::{Rec, Seen};

        let seen = Arc::new(Seen::default());
        metrics::with_local_recorder(&Rec(seen.clone()), || {
            let mut s = Counters::<LockOutcome>::new("lock");
            s.set_label("checkout");
            s.record(LockOutcome::Acquired);
            s.record(LockOutcome::Acquired);
            s.record(LockOutcome::LeaseLost);
            s.round_trip(Duration::from_millis(1), false);
            let other = Counters::<LockOutcome>::new("refund");
            other.record(LockOutcome::Acquired);
        });
        assert!(seen.described_as("tower_redis_lock_outcomes_total", Unit::Count));
        assert!(seen.described_as("tower_redis_lock_acquire_seconds", Unit::Seconds));
        assert!(seen.described_as("tower_redis_lock_wait_seconds", Unit::Seconds));
        let help = seen.help.lock().unwrap()["tower_redis_lock_outcomes_total"].clone();
        // Outcomes are listed; a sum is not one.
        assert!(help.contains("waited_conflict"), "{help}");
        assert!(!help.contains("wait_us_sum"), "{help}");
        assert_eq!(
            seen.value("tower_redis_lock_outcomes_total{layer=checkout,outcome=acquired}"),
            2.0
        );
        assert_eq!(
            seen.value("tower_redis_lock_outcomes_total{layer=refund,outcome=acquired}"),
            1.0
        );
        assert_eq!(
            seen.value("tower_redis_lock_outcomes_total{layer=checkout,outcome=lease_lost}"),
            1.0
        );
        assert_eq!(
            seen.value("tower_redis_lock_acquire_seconds{layer=checkout}"),
            1.0
        );
    }

    /// With the `metrics` feature, a layer's outcomes reach the recorder,
    /// labelled with the layer's label and the outcome, and the metrics are
    /// described with their units.
    #[test]
    fn metrics_facade_sees_outcomes_with_the_label() {
        use std::convert::Infallible;
        use std::sync::Arc;

        use bytes::Bytes;
        use http::{Request, Response};
        use http_body_util::Full;
        use metrics::Unit;
        use tower::ServiceExt;
        use tower_layer::Layer;

        use crate::key::Route;
        use crate::stats::testing::recorder::{Rec, Seen};
        use crate::{IdempotencyLayer, MemoryBackend};

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
        assert!(seen.described_as("tower_redis_lock_idempotency_outcomes_total", Unit::Count));
        assert!(seen.described_as("tower_redis_lock_idempotency_claim_seconds", Unit::Seconds));
        let values = seen.values.lock().unwrap();
        let at = |outcome: &str| {
            values
                .get(&format!(
                    "tower_redis_lock_idempotency_outcomes_total{{layer=payments,outcome={outcome}}}"
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
            values["tower_redis_lock_idempotency_claim_seconds{layer=payments}"],
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
        assert_eq!(stats.round_trips, 3);
    }
}
