//! What the idempotency layer counts: [`ReplayOutcome`], over the shared
//! counters (`shared/stats.rs`), reported in [`Stats`](crate::Stats).

use crate::shared::stats::outcomes;

outcomes! {
    /// What happened to a request at the idempotency layer: the label of the
    /// `metrics` counter.
    enum ReplayOutcome {
        /// The key was claimed: the handler runs.
        Claimed => claimed,
        /// A stored response was replayed.
        Replayed => replayed,
        /// A duplicate in flight waited for the original and got its answer.
        Joined => joined,
        /// The key was reused with another payload: 422.
        Mismatch => mismatch,
        /// The key is claimed by a request still running: 409.
        Conflict => conflict,
        /// The first request finished but its answer was not kept: answered
        /// with `Rejection::NotStored`.
        NotStored => not_stored,
        /// The outcome of a claimed request was written to the store.
        Recorded => recorded,
        /// Writing it failed, timed out, or found the claim gone.
        RecordFailed => record_failed,
        /// The store failed or missed its deadline at the claim: 503.
        BackendError => backend_error,
        /// The scope held its whole share of the store: 429.
        OverQuota => over_quota,
    }
    metrics {
        outcomes_total: "tower_redis_lock_replay_outcomes_total",
        outcomes_help: "Idempotency outcomes",
        round_trip_seconds: "tower_redis_lock_claim_seconds",
        round_trip_help: "Time of one claim round trip to the idempotency store, by layer label",
    }
}

impl ReplayOutcome {
    /// The end of a claimed request's recording: `written` or not.
    pub(crate) fn of_record(written: bool) -> Self {
        if written {
            Self::Recorded
        } else {
            Self::RecordFailed
        }
    }
}

/// With the `metrics` feature (the counts themselves are tested with
/// [`Stats`](crate::Stats)).
#[cfg(all(test, feature = "metrics"))]
mod tests {
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
        use crate::shared::stats::testing::recorder::{Rec, Seen};
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
        assert!(seen.described_as("tower_redis_lock_replay_outcomes_total", Unit::Count));
        assert!(seen.described_as("tower_redis_lock_claim_seconds", Unit::Seconds));
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
        assert_eq!(stats.round_trips, 3);
    }
}
