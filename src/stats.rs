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
//! The live counters behind them (`Counters`, one type for both layers,
//! generic over the layer's outcome enum) are in this file too: every call
//! a request makes to count something lands here.
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

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The lock layer's counters at one moment (each one only grows): a
/// copy, so call [`stats()`](crate::RedisLockLayer::stats) again for
/// newer values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockStats {
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
    /// Requests that found their key held and waited for it
    /// ([`RedisLockLayer::wait`](crate::RedisLockLayer::wait)); each
    /// then counts once more, in `acquired` (its turn came),
    /// `waited_conflict` (its bound ran out), `backend_error` or
    /// `fail_open`, unless its client went away first.
    pub waited: u64,
    /// Requests that waited until their bound and were answered 409
    /// (also counted in `conflict`).
    pub waited_conflict: u64,
    /// Requests answered 409 at once because their key's queue, or this
    /// instance's, was full (`max_waiters`, `max_waiting_bytes`; also
    /// counted in `conflict`).
    pub wait_full: u64,
    /// The time waited by every request that waited, in microseconds
    /// (with `waited`, the mean wait: [`mean_wait`](Self::mean_wait)).
    pub wait_us_sum: u64,
    /// `Some(calls)` while the store sends lease calls as native server
    /// commands (`RedisBackend` on a server with `DELIFEQ`): how many it
    /// has had answered so far, this layer's and any other sharing the
    /// store; `None` while it sends Lua scripts, or for a store without
    /// native commands. Calls that a busy connection sends together in a
    /// batch script are not counted, not even a release that runs as
    /// `DELIFEQ` inside it: the server's `INFO commandstats` counts those.
    pub native_calls: Option<u64>,
}

impl LockStats {
    /// Mean latency of the admitting round trip, if any was measured.
    pub fn mean_round_trip(&self) -> Option<Duration> {
        self.round_trip_us_sum
            .checked_div(self.round_trips)
            .map(Duration::from_micros)
    }

    /// Mean time a waiting request waited, if any waited.
    pub fn mean_wait(&self) -> Option<Duration> {
        self.wait_us_sum
            .checked_div(self.waited)
            .map(Duration::from_micros)
    }
}

impl Snapshot for LockStats {
    fn round_trips(&mut self) -> [&mut u64; 3] {
        [
            &mut self.round_trips,
            &mut self.round_trip_timeouts,
            &mut self.round_trip_us_sum,
        ]
    }
}

/// The idempotency layer's counters at one moment (each one only
/// grows): a copy, so call [`stats()`](crate::IdempotencyLayer::stats)
/// again for newer values.
///
/// Every request that reaches the store counts once in `claimed`,
/// `replayed`, `joined`, `mismatch`, `conflict`, `not_stored`,
/// `over_quota` or `backend_error`; a claimed one later once in
/// `recorded` or `record_failed`, unless its outcome is not kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdempotencyStats {
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
    /// Requests answered `transaction-ended` (500): their handler, or the
    /// first request with their key, ended the request's database
    /// transaction itself and something of it committed; the key is final.
    pub transaction_ended: u64,
    /// Requests answered 503 `outcome-unknown`: their transaction's commit
    /// was not confirmed within the store's commit timeout.
    pub outcome_unknown: u64,
}

impl IdempotencyStats {
    /// Mean latency of the admitting round trip, if any was measured.
    pub fn mean_round_trip(&self) -> Option<Duration> {
        self.round_trip_us_sum
            .checked_div(self.round_trips)
            .map(Duration::from_micros)
    }
}

impl Snapshot for IdempotencyStats {
    fn round_trips(&mut self) -> [&mut u64; 3] {
        [
            &mut self.round_trips,
            &mut self.round_trip_timeouts,
            &mut self.round_trip_us_sum,
        ]
    }
}

// ---------------------------------------------------------------------------
// The live counters: one type for both layers, generic over the layer's
// outcome enum: a count per outcome, the admitting round trip (the lock's
// acquire, the idempotency layer's claim: calls, timeouts, latency), the
// layer's snapshot, and, with the `metrics` feature, the same through the
// `metrics` facade under the layer's own metric names, labelled `layer`
// (and `outcome`).

/// A layer's snapshot type: its outcome fields and the round-trip fields
/// every layer has.
pub(crate) trait Snapshot: Default {
    /// `round_trips`, `round_trip_timeouts`, `round_trip_us_sum`.
    fn round_trips(&mut self) -> [&mut u64; 3];
}

/// A layer's outcome enum: what its counters count.
pub(crate) trait Outcomes: Copy + 'static {
    /// The layer's snapshot type.
    type Snapshot: Snapshot + Copy + PartialEq + fmt::Debug;
    /// Every variant, each at the position [`index`](Self::index) gives it.
    const ALL: &'static [Self];
    /// The layer's metric names and help texts.
    #[cfg(feature = "metrics")]
    const METRICS: Metrics;
    /// The position of this outcome in [`ALL`](Self::ALL).
    fn index(self) -> usize;
    /// The snake_case name used in logs and metrics (`"conflict"`, ...).
    fn as_str(self) -> &'static str;
    /// The field of the snapshot that counts this outcome.
    fn field(self, stats: &mut Self::Snapshot) -> &mut u64;
}

/// Declare a layer's outcome enum: each variant with the snapshot field
/// that counts it, whose name is also the outcome's name in logs and
/// metrics; and the layer's metric names. Writes the enum and its
/// [`Outcomes`] impl, so the list is written once.
macro_rules! outcomes {
    (
        $(#[$meta:meta])*
        enum $name:ident in $snapshot:ident {
            $( $(#[$doc:meta])* $variant:ident => $field:ident, )*
        }
        metrics {
            outcomes_total: $total:literal,
            outcomes_help: $help:literal,
            round_trip_seconds: $seconds:literal,
            round_trip_help: $seconds_help:literal,
            wait: $wait:expr $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) enum $name {
            $( $(#[$doc])* $variant, )*
        }

        impl $crate::stats::Outcomes for $name {
            type Snapshot = $snapshot;
            const ALL: &'static [Self] = &[$(Self::$variant),*];
            #[cfg(feature = "metrics")]
            const METRICS: $crate::stats::Metrics = $crate::stats::Metrics {
                outcomes_total: $total,
                outcomes_help: $help,
                round_trip_seconds: $seconds,
                round_trip_help: $seconds_help,
                wait: $wait,
            };

            fn index(self) -> usize {
                self as usize
            }

            fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => stringify!($field),)*
                }
            }

            fn field(self, stats: &mut $snapshot) -> &mut u64 {
                match self {
                    $(Self::$variant => &mut stats.$field,)*
                }
            }
        }
    };
}

/// A layer's metric names (kept as they are: dashboards use them).
#[cfg(feature = "metrics")]
pub(crate) struct Metrics {
    /// Counter of every outcome, labelled `layer` and `outcome`.
    pub(crate) outcomes_total: &'static str,
    /// What the counter counts; the outcome names are appended.
    pub(crate) outcomes_help: &'static str,
    /// Histogram of the admitting round trips, labelled `layer`.
    pub(crate) round_trip_seconds: &'static str,
    /// What the histogram measures.
    pub(crate) round_trip_help: &'static str,
    /// Histogram of the time waited for a key, and its help (the lock
    /// layer's `wait`).
    pub(crate) wait: Option<(&'static str, &'static str)>,
}

struct Inner {
    outcomes: Box<[AtomicU64]>,
    round_trips: AtomicU64,
    round_trip_timeouts: AtomicU64,
    round_trip_us_sum: AtomicU64,
}

/// Live counters of one layer (shared by its clones, its services, the
/// guards and tasks it hands out, and layers derived from it by further
/// builder calls), and the label its metrics carry.
pub(crate) struct Counters<O> {
    inner: Arc<Inner>,
    label: &'static str,
    outcome: PhantomData<fn(O)>,
}

impl<O> Clone for Counters<O> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            label: self.label,
            outcome: PhantomData,
        }
    }
}

impl<O: Outcomes> fmt::Debug for Counters<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Counters");
        d.field("label", &self.label);
        for &o in O::ALL {
            d.field(o.as_str(), &self.get(o));
        }
        d.field(
            "round_trips",
            &self.inner.round_trips.load(Ordering::Relaxed),
        )
        .finish_non_exhaustive()
    }
}

impl<O: Outcomes> Counters<O> {
    /// Fresh counters, all zero, labelled `label` in metrics (and the
    /// metrics described to the recorder installed now: each new layer does
    /// it again, so a recorder installed after the first layer still gets
    /// the descriptions).
    pub(crate) fn new(label: &'static str) -> Self {
        #[cfg(feature = "metrics")]
        describe::<O>();
        Self {
            inner: Arc::new(Inner {
                outcomes: O::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
                round_trips: AtomicU64::new(0),
                round_trip_timeouts: AtomicU64::new(0),
                round_trip_us_sum: AtomicU64::new(0),
            }),
            label,
            outcome: PhantomData,
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

    fn get(&self, outcome: O) -> u64 {
        self.inner.outcomes[outcome.index()].load(Ordering::Relaxed)
    }

    /// The current values.
    pub(crate) fn snapshot(&self) -> O::Snapshot {
        let c = &self.inner;
        let mut stats = O::Snapshot::default();
        let [round_trips, timeouts, us_sum] = stats.round_trips();
        *round_trips = c.round_trips.load(Ordering::Relaxed);
        *timeouts = c.round_trip_timeouts.load(Ordering::Relaxed);
        *us_sum = c.round_trip_us_sum.load(Ordering::Relaxed);
        for &o in O::ALL {
            *o.field(&mut stats) = self.get(o);
        }
        stats
    }

    /// Count one outcome (and emit it through `metrics` with that feature).
    pub(crate) fn record(&self, outcome: O) {
        self.inner.outcomes[outcome.index()].fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!(
            O::METRICS.outcomes_total,
            "layer" => self.label,
            "outcome" => outcome.as_str()
        )
        .increment(1);
    }

    /// Add `n` to an outcome's count without emitting it through
    /// `metrics` (a sum such as time waited, not a count of events).
    pub(crate) fn add(&self, outcome: O, n: u64) {
        self.inner.outcomes[outcome.index()].fetch_add(n, Ordering::Relaxed);
    }

    /// Record one admitting round trip's latency (`timed_out`: it missed
    /// the deadline).
    pub(crate) fn round_trip(&self, latency: Duration, timed_out: bool) {
        let c = &self.inner;
        c.round_trips.fetch_add(1, Ordering::Relaxed);
        c.round_trip_us_sum
            .fetch_add(latency.as_micros() as u64, Ordering::Relaxed);
        if timed_out {
            c.round_trip_timeouts.fetch_add(1, Ordering::Relaxed);
        }
        #[cfg(feature = "metrics")]
        metrics::histogram!(O::METRICS.round_trip_seconds, "layer" => self.label)
            .record(latency.as_secs_f64());
    }
}

/// Describe a layer's metrics (unit and help text) to the recorder
/// installed now; the counter's help lists the outcomes, so it cannot go
/// stale.
#[cfg(feature = "metrics")]
fn describe<O: Outcomes>() {
    let m = &O::METRICS;
    // A sum (`wait_us_sum`) is added to its snapshot field, never emitted
    // as an outcome: not in the list.
    let names: Vec<_> = O::ALL
        .iter()
        .map(|o| o.as_str())
        .filter(|name| !name.ends_with("_sum"))
        .collect();
    metrics::describe_counter!(
        m.outcomes_total,
        metrics::Unit::Count,
        format!(
            "{} by layer label and outcome ({})",
            m.outcomes_help,
            names.join(", ")
        )
    );
    metrics::describe_histogram!(
        m.round_trip_seconds,
        metrics::Unit::Seconds,
        m.round_trip_help
    );
    if let Some((name, help)) = m.wait {
        metrics::describe_histogram!(name, metrics::Unit::Seconds, help);
    }
}

/// The lock layer's histogram of the time a request waited for its key.
#[cfg(feature = "metrics")]
const WAIT_SECONDS: &str = "tower_redis_lock_wait_seconds";

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
        /// The handler ended the request's transaction itself and something
        /// of it committed (a transactional store): the key is final,
        /// answered `transaction-ended`.
        TransactionEnded => transaction_ended,
        /// A transactional store's commit was not confirmed in time:
        /// answered 503 `outcome-unknown`, the key still claimed.
        OutcomeUnknown => outcome_unknown,
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

impl Counters<LockOutcome> {
    /// Count the time one request waited for its key
    /// ([`RedisLockLayer::wait`](crate::RedisLockLayer::wait)): added to
    /// `wait_us_sum`, and with the `metrics` feature recorded in
    /// `tower_redis_lock_wait_seconds`.
    pub(crate) fn waited(&self, waited: Duration) {
        self.add(LockOutcome::WaitMicros, waited.as_micros() as u64);
        #[cfg(feature = "metrics")]
        metrics::histogram!(WAIT_SECONDS, "layer" => self.label).record(waited.as_secs_f64());
    }
}

/// What the tests of both layers check of their outcome enums.
#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests;
