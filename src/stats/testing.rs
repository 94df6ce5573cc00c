//! What the tests of both layers check of their outcome enums.

use super::*;

/// Each outcome counts in its own field of its snapshot, and nowhere else:
/// every outcome once and the first one again (it reads 2, every other
/// 1); then on fresh counters outcome `i` of `ALL` `i + 1` times (each
/// field holds its own count). Two round trips (300 and 100 µs, one
/// timed out) are measured.
pub(crate) fn outcomes_map_to_their_fields<O: Outcomes>() {
    let first = O::ALL[0];
    let counters = Counters::<O>::new("test");
    assert_eq!(counters.label(), "test");
    for &o in O::ALL {
        counters.record(o);
    }
    counters.record(first);
    counters.round_trip(Duration::from_micros(300), false);
    counters.round_trip(Duration::from_micros(100), true);
    let mut n = counters.snapshot();
    assert_eq!(*first.field(&mut n), 2);
    for &o in &O::ALL[1..] {
        assert_eq!(*o.field(&mut n), 1, "{}", o.as_str());
    }
    let [round_trips, timeouts, us_sum] = n.round_trips();
    assert_eq!((*round_trips, *timeouts, *us_sum), (2, 1, 400));

    let counters = Counters::<O>::new("test");
    for (i, &o) in O::ALL.iter().enumerate() {
        assert_eq!(o.index(), i, "{} out of place in ALL", o.as_str());
        for _ in 0..=i {
            counters.record(o);
        }
    }
    let mut expected = O::Snapshot::default();
    for (i, &o) in O::ALL.iter().enumerate() {
        let field = o.field(&mut expected);
        assert_eq!(*field, 0, "two outcomes share the field of {}", o.as_str());
        *field = i as u64 + 1;
    }
    assert_eq!(counters.snapshot(), expected);
    let names: std::collections::HashSet<_> = O::ALL.iter().map(|o| o.as_str()).collect();
    assert_eq!(names.len(), O::ALL.len(), "two outcomes share a name");
}

/// A `metrics` recorder that keeps every counter's total and every
/// histogram's number of samples by `name{label=value,..}`, and what
/// was described with which unit.
#[cfg(feature = "metrics")]
pub(crate) mod recorder {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use metrics::{
        Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
        SharedString, Unit,
    };

    /// What the recorder saw.
    #[derive(Default)]
    pub(crate) struct Seen {
        pub(crate) values: Mutex<HashMap<String, f64>>,
        pub(crate) described: Mutex<Vec<(String, Option<Unit>)>>,
        /// Each described metric's help text.
        pub(crate) help: Mutex<HashMap<String, String>>,
    }

    impl Seen {
        /// Whether `name` was described with `unit`.
        pub(crate) fn described_as(&self, name: &str, unit: Unit) -> bool {
            let described = self.described.lock().unwrap();
            described.iter().any(|(n, u)| n == name && *u == Some(unit))
        }

        /// A counter's total or a histogram's samples, 0 if never seen.
        pub(crate) fn value(&self, series: &str) -> f64 {
            self.values
                .lock()
                .unwrap()
                .get(series)
                .copied()
                .unwrap_or(0.0)
        }
    }

    struct Handle(Arc<Seen>, String);
    impl Handle {
        fn add(&self, v: f64) {
            *self
                .0
                .values
                .lock()
                .unwrap()
                .entry(self.1.clone())
                .or_default() += v;
        }
    }
    impl CounterFn for Handle {
        fn increment(&self, v: u64) {
            self.add(v as f64);
        }
        fn absolute(&self, _: u64) {}
    }
    impl HistogramFn for Handle {
        fn record(&self, _: f64) {
            self.add(1.0);
        }
    }

    /// The recorder (install it with `metrics::with_local_recorder`).
    pub(crate) struct Rec(pub(crate) Arc<Seen>);
    fn name(key: &Key) -> String {
        let labels: Vec<_> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        format!("{}{{{}}}", key.name(), labels.join(","))
    }
    impl Rec {
        fn describe(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
            let name = key.as_str().to_owned();
            self.0
                .help
                .lock()
                .unwrap()
                .insert(name.clone(), help.into_owned());
            self.0.described.lock().unwrap().push((name, unit));
        }
    }
    impl Recorder for Rec {
        fn describe_counter(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
            self.describe(key, unit, help);
        }
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
            self.describe(key, unit, help);
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
}
