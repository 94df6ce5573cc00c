//! What each layer counts, readable without a metrics stack:
//! [`LockStats`] ([`RedisLockLayer::stats`](crate::RedisLockLayer::stats))
//! and [`IdempotencyStats`]
//! ([`IdempotencyLayer::stats`](crate::IdempotencyLayer::stats)). With the
//! `metrics` feature the same counts also go to the
//! [`metrics`](https://docs.rs/metrics) facade (see the crate docs).
//!
//! The two snapshots use the same words where they mean the same thing:
//! `conflict` is a 409 for a key in use, `backend_error` a 503 for a
//! backend that failed or missed its deadline, and the `round_trip*` fields
//! measure the one round trip that admits a request (the lock layer's
//! acquire, the idempotency layer's claim).
//!
//! ```
//! use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend, RedisLockLayer};
//! let lock = RedisLockLayer::new(MemoryBackend::new(), Route);
//! let replay = IdempotencyLayer::new(MemoryBackend::new(), Route);
//! // ... serve ...
//! let now = lock.stats();
//! println!("{} acquired, {} conflicts, mean {:?}", now.acquired, now.conflict, now.mean_round_trip());
//! let now = replay.stats();
//! println!("{} claimed, {} replayed", now.claimed, now.replayed);
//! ```

use std::time::Duration;

pub(crate) mod counters;

use counters::outcomes;

/// Declares a snapshot type: the fields every layer has (conflict,
/// backend error, the admitting round trips), then the layer's own.
macro_rules! snapshot {
    (
        $(#[$meta:meta])*
        struct $name:ident {
            $( $(#[$doc:meta])* $field:ident, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct $name {
            /// Requests answered 409 because their key was in use.
            pub conflict: u64,
            /// Backend failures answered 503 (or, for the lock layer when
            /// fail-open, counted in `fail_open` instead).
            pub backend_error: u64,
            /// Admitting round trips measured (acquires, claims).
            pub round_trips: u64,
            /// Round trips that missed the deadline.
            pub round_trip_timeouts: u64,
            /// Sum of the round trips' latencies in microseconds (with
            /// `round_trips`, the mean: [`mean_round_trip`](Self::mean_round_trip)).
            pub round_trip_us_sum: u64,
            $( $(#[$doc])* pub $field: u64, )*
        }

        impl $name {
            /// Mean latency of the admitting round trip, if any was measured.
            pub fn mean_round_trip(&self) -> Option<Duration> {
                self.round_trip_us_sum
                    .checked_div(self.round_trips)
                    .map(Duration::from_micros)
            }
        }

        impl counters::Snapshot for $name {
            fn round_trips(&mut self) -> [&mut u64; 3] {
                [
                    &mut self.round_trips,
                    &mut self.round_trip_timeouts,
                    &mut self.round_trip_us_sum,
                ]
            }
        }
    };
}

snapshot! {
    /// The lock layer's counters at one moment (each one only grows): a
    /// copy, so call [`stats()`](crate::RedisLockLayer::stats) again for
    /// newer values.
    struct LockStats {
        /// Leases taken.
        acquired,
        /// Backend failures that ran the handler unlocked (fail-open).
        fail_open,
        /// Requests run unlocked because a key part was missing.
        skipped,
        /// Leases given back.
        released,
        /// Releases that failed or timed out (the TTL frees the key).
        release_failed,
        /// Leases found gone at release or renewal.
        lease_lost,
        /// Successful renewals.
        renewed,
        /// Renewals that failed or timed out.
        renew_failed,
        /// Requests that found their key held and waited for it
        /// ([`RedisLockLayer::wait`](crate::RedisLockLayer::wait)); each
        /// then counts once more, in `acquired` (its turn came),
        /// `waited_conflict` (its bound ran out), `backend_error` or
        /// `fail_open`, unless its client went away first.
        waited,
        /// Requests that waited until their bound and were answered 409
        /// (also counted in `conflict`).
        waited_conflict,
        /// Requests answered 409 at once because their key's queue, or this
        /// instance's, was full (`max_waiters`; also counted in `conflict`).
        wait_full,
        /// The time waited by every request that waited, in microseconds
        /// (with `waited`, the mean wait: [`mean_wait`](Self::mean_wait)).
        wait_us_sum,
    }
}

impl LockStats {
    /// Mean time a waiting request waited, if any waited.
    pub fn mean_wait(&self) -> Option<Duration> {
        self.wait_us_sum
            .checked_div(self.waited)
            .map(Duration::from_micros)
    }
}

snapshot! {
    /// The idempotency layer's counters at one moment (each one only
    /// grows): a copy, so call [`stats()`](crate::IdempotencyLayer::stats)
    /// again for newer values.
    ///
    /// Every request that reaches the store counts once in `claimed`,
    /// `replayed`, `joined`, `mismatch`, `conflict`, `not_stored`,
    /// `over_quota` or `backend_error`; a claimed one later once in
    /// `recorded` or `record_failed`, unless its outcome is not kept.
    struct IdempotencyStats {
        /// Idempotency keys claimed: the handler ran.
        claimed,
        /// Stored responses replayed (`Idempotent-Replayed: true`).
        replayed,
        /// Duplicates that waited for the request in flight and got its answer.
        joined,
        /// Idempotency keys reused with another payload: 422.
        mismatch,
        /// Requests answered `Rejection::NotStored`: the first one finished,
        /// but its response was not kept.
        not_stored,
        /// Outcomes of claimed requests written to the store.
        recorded,
        /// Outcomes that could not be written (the store failed or timed out,
        /// or the claim had expired): the claim expires after its TTL.
        record_failed,
        /// Requests answered 429 because their scope held its whole share of
        /// the store (`IdempotencyLayer::scope_quota`).
        over_quota,
    }
}

/// The lock layer's histogram of the time a request waited for its key.
#[cfg(feature = "metrics")]
pub(crate) const WAIT_SECONDS: &str = "tower_redis_lock_wait_seconds";

outcomes! {
    /// What happened to a lease: the label of the `metrics` counter, and the
    /// same word as the `outcome` field of the lock's log events (but
    /// `wait_us_sum`, a sum that is neither).
    enum LockOutcome in LockStats {
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
        /// The key was held and the request waited for it.
        Waited => waited,
        /// The request waited until its bound: 409.
        WaitedConflict => waited_conflict,
        /// The wait queue was full: 409 at once.
        WaitFull => wait_full,
        /// Microseconds waited (added with `Counters::add`, not a count of
        /// events: no `outcome` series in metrics, where waiting has
        /// `tower_redis_lock_wait_seconds`).
        WaitMicros => wait_us_sum,
    }
    metrics {
        outcomes_total: "tower_redis_lock_outcomes_total",
        outcomes_help: "Lease outcomes",
        round_trip_seconds: "tower_redis_lock_acquire_seconds",
        round_trip_help: "Time of one acquire round trip to the lock backend, by layer label",
        wait: Some((
            WAIT_SECONDS,
            "Time a request waited for its key (`RedisLockLayer::wait`), by layer label"
        )),
    }
}

outcomes! {
    /// What happened to a request at the idempotency layer: the label of the
    /// `metrics` counter.
    enum IdempotencyOutcome in IdempotencyStats {
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
        outcomes_total: "tower_redis_lock_idempotency_outcomes_total",
        outcomes_help: "Idempotency outcomes",
        round_trip_seconds: "tower_redis_lock_idempotency_claim_seconds",
        round_trip_help: "Time of one claim round trip to the idempotency store, by layer label",
        wait: None,
    }
}

impl IdempotencyOutcome {
    /// The end of a claimed request's recording: `written` or not.
    pub(crate) fn of_record(written: bool) -> Self {
        if written {
            Self::Recorded
        } else {
            Self::RecordFailed
        }
    }
}

#[cfg(test)]
mod tests;
