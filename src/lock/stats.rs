//! What the lock layer counts: [`LockOutcome`], over the shared counters
//! (`shared/stats.rs`), reported in [`Stats`](crate::Stats).

use crate::shared::stats::outcomes;

outcomes! {
    /// What happened to a lease: the label of the `metrics` counter, and the
    /// same word as the `outcome` field of the lock's log events.
    enum LockOutcome {
        /// The lease was taken.
        Acquired => acquired,
        /// Someone else held the key: 409.
        Conflict => conflict,
        /// The backend failed or missed its deadline and the layer is fail-closed: 503.
        BackendError => backend_error,
        /// The backend failed and the layer is fail-open: the handler ran unlocked.
        FailOpen => fail_open,
        /// A key part was missing and the layer skips locking then.
        Skipped => skipped,
        /// The lease was given back.
        Released => released,
        /// The release could not reach the backend in time; the TTL will free the key.
        ReleaseFailed => release_failed,
        /// The lease was gone when we released or renewed it (expired, evicted,
        /// taken over).
        LeaseLost => lease_lost,
        /// A renewal (watchdog) extended the lease.
        Renewed => renewed,
        /// A renewal could not reach the backend in time (the lease may still be ours).
        RenewFailed => renew_failed,
    }
    metrics {
        outcomes_total: "tower_redis_lock_outcomes_total",
        outcomes_help: "Lease outcomes",
        round_trip_seconds: "tower_redis_lock_acquire_seconds",
        round_trip_help: "Time of one acquire round trip to the lock backend, by layer label",
    }
}

/// With the `metrics` feature (the counts themselves are tested with
/// [`Stats`](crate::Stats)).
#[cfg(all(test, feature = "metrics"))]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::shared::stats::Counters;

    /// With the `metrics` feature, outcomes and latencies reach the recorder.
    #[test]
    fn metrics_facade_sees_outcomes() {
        use std::sync::Arc;

        use metrics::Unit;

        use crate::shared::stats::testing::recorder::{Rec, Seen};

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
}
