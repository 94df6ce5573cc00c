//! [`Stats`]: the outcome counters both layers report
//! ([`RedisLockLayer::stats`](crate::RedisLockLayer::stats),
//! [`IdempotencyLayer::stats`](crate::IdempotencyLayer::stats)), readable
//! without a metrics stack.

use std::time::Duration;

/// A layer's outcome counters at one moment (each one only grows): a copy,
/// so call `stats()` again for newer values.
///
/// Both layers report in this one type, in the same words where they mean
/// the same thing: `conflict` is a 409 for a key in use, `backend_error` a
/// 503 for a backend that failed or missed its deadline, and the
/// `round_trip*` fields measure the one round trip that admits a request
/// (the lock layer's acquire, the idempotency layer's claim). The other
/// fields belong to one layer and stay 0 in the other's snapshot, so one
/// exporter serves an application that runs both.
///
/// ```
/// use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend, RedisLockLayer};
/// let lock = RedisLockLayer::new(MemoryBackend::new(), Route);
/// let replay = IdempotencyLayer::new(MemoryBackend::new(), Route);
/// // ... serve ...
/// for (name, now) in [("lock", lock.stats()), ("replay", replay.stats())] {
///     println!("{name}: {} conflicts, mean {:?}", now.conflict, now.mean_round_trip());
/// }
/// let now = lock.stats();
/// println!("{} acquired, {} released", now.acquired, now.released);
/// let now = replay.stats();
/// println!("{} claimed, {} replayed", now.claimed, now.replayed);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    // Both layers.
    /// Requests answered 409 because their key was in use: the lock was
    /// held, or the idempotency key's first request was still running (and
    /// the wait for its answer, if any, ran out).
    pub conflict: u64,
    /// Backend failures answered 503 (the lock layer when fail-closed; the
    /// idempotency layer at the claim).
    pub backend_error: u64,
    /// Admitting round trips measured (acquires, claims).
    pub round_trips: u64,
    /// Round trips that missed the deadline (counted in `backend_error`,
    /// or in `fail_open`).
    pub round_trip_timeouts: u64,
    /// Sum of the round trips' latencies in microseconds (with
    /// `round_trips`, the mean: [`mean_round_trip`](Self::mean_round_trip)).
    pub round_trip_us_sum: u64,

    // The lock layer.
    /// Leases taken.
    pub acquired: u64,
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

    // The idempotency layer: every request that reaches the store counts
    // once in `claimed`, `replayed`, `joined`, `mismatch`, `conflict`,
    // `not_stored` or `backend_error`; a claimed one later once in
    // `recorded` or `record_failed`, unless its outcome is not kept.
    /// Idempotency keys claimed: the handler ran.
    pub claimed: u64,
    /// Stored responses replayed (`Idempotent-Replayed: true`).
    pub replayed: u64,
    /// Duplicates that waited for the request in flight and got its answer.
    pub joined: u64,
    /// Idempotency keys reused with another payload: 422.
    pub mismatch: u64,
    /// Requests answered `Rejection::NotStored`: the first one finished,
    /// but its response was not kept.
    pub not_stored: u64,
    /// Outcomes of claimed requests written to the store.
    pub recorded: u64,
    /// Outcomes that could not be written (the store failed or timed out,
    /// or the claim had expired): the claim expires after its TTL.
    pub record_failed: u64,
    /// Requests answered 429 because their scope held its whole share of
    /// the store (`IdempotencyLayer::scope_quota`).
    pub over_quota: u64,
}

impl Stats {
    /// Mean latency of the admitting round trip (acquire or claim), if any
    /// was measured.
    pub fn mean_round_trip(&self) -> Option<Duration> {
        self.round_trip_us_sum
            .checked_div(self.round_trips)
            .map(Duration::from_micros)
    }
}

#[cfg(test)]
mod tests {
    use super::Stats;
    use crate::lock::stats::LockOutcome;
    use crate::replay::stats::ReplayOutcome;
    use crate::shared::stats::{testing, Outcomes};

    /// Each layer's outcomes count in their own fields; together they count
    /// every outcome field, `conflict` and `backend_error` for both layers
    /// and each other one for one layer only.
    #[test]
    fn every_outcome_field_is_counted_by_one_layer() {
        testing::outcomes_map_to_their_fields::<LockOutcome>();
        testing::outcomes_map_to_their_fields::<ReplayOutcome>();
        assert_eq!(LockOutcome::BackendError.as_str(), "backend_error");
        assert_eq!(ReplayOutcome::RecordFailed.as_str(), "record_failed");
        assert_eq!(ReplayOutcome::of_record(false), ReplayOutcome::RecordFailed);
        assert_eq!(ReplayOutcome::of_record(true), ReplayOutcome::Recorded);

        let mut s = Stats::default();
        for &o in LockOutcome::ALL {
            *o.field(&mut s) += 1;
        }
        for &o in ReplayOutcome::ALL {
            *o.field(&mut s) += 1;
        }
        // Every field by name (no `..`): a new one breaks the build here
        // until it is placed.
        let expected = Stats {
            conflict: 2,
            backend_error: 2,
            round_trips: 0,
            round_trip_timeouts: 0,
            round_trip_us_sum: 0,
            acquired: 1,
            fail_open: 1,
            skipped: 1,
            released: 1,
            release_failed: 1,
            lease_lost: 1,
            renewed: 1,
            renew_failed: 1,
            claimed: 1,
            replayed: 1,
            joined: 1,
            mismatch: 1,
            not_stored: 1,
            recorded: 1,
            record_failed: 1,
            over_quota: 1,
        };
        assert_eq!(s, expected);
    }
    /// Both layers answer in one `Stats` type, so one exporter serves an
    /// application that runs both.
    #[test]
    fn both_layers_count_in_one_stats_type() {
        use crate::key::Route;
        use crate::{IdempotencyLayer, MemoryBackend, RedisLockLayer};
        let lock = RedisLockLayer::new(MemoryBackend::new(), Route);
        let replay = IdempotencyLayer::new(MemoryBackend::new(), Route);
        let both: [crate::Stats; 2] = [lock.stats(), replay.stats()];
        assert_eq!(both, [crate::Stats::default(); 2]);
    }
}
