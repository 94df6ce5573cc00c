//! One counters type for both layers, generic over the layer's outcome
//! enum: a count per outcome, the admitting round trip (the lock's
//! acquire, the idempotency layer's claim: calls, timeouts, latency), the
//! layer's snapshot (`LockStats`, `IdempotencyStats`), and, with the `metrics` feature, the same through
//! the [`metrics`](https://docs.rs/metrics) facade under the layer's own
//! metric names, labelled `layer` (and `outcome`).

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

        impl $crate::stats::counters::Outcomes for $name {
            type Snapshot = $snapshot;
            const ALL: &'static [Self] = &[$(Self::$variant),*];
            #[cfg(feature = "metrics")]
            const METRICS: $crate::stats::counters::Metrics = $crate::stats::counters::Metrics {
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
pub(crate) use outcomes;

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

/// What the tests of both layers check of their outcome enums.
#[cfg(test)]
pub(crate) mod testing;
