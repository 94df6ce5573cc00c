//! The targets of the native-commands work, checked against one run: each
//! a ratio of the quickstart to a baseline measured in the same run (the
//! peer; for the idempotency layer the quickstart; for the lock layer over
//! `MemoryBackend` bare axum), or an absolute figure, with PASS or FAIL.

use std::fmt::Write as _;

use crate::load::Sample;
use crate::server::Kind;
use crate::targets::Id;

/// Which way a figure must go.
#[derive(Clone, Copy)]
enum Limit {
    AtMost(f64),
    AtLeast(f64),
}

impl Limit {
    fn holds(self, v: f64) -> bool {
        match self {
            Limit::AtMost(l) => v <= l,
            Limit::AtLeast(l) => v >= l,
        }
    }

    fn show(self, unit: &str) -> String {
        match self {
            Limit::AtMost(l) => format!("≤ {l:.2}{unit}"),
            Limit::AtLeast(l) => format!("≥ {l:.2}{unit}"),
        }
    }
}

/// One figure compared: a ratio against a baseline, or (no baseline) an
/// absolute figure.
struct Goal {
    what: &'static str,
    /// The target whose figure is judged, and its baseline.
    target: Id,
    baseline: Option<Id>,
    conns: u32,
    figure: fn(&Sample) -> f64,
    limit: Limit,
}

/// The goals for `kind` at the connection counts this run measured.
fn goals(kind: Kind, conns: &[u32]) -> Vec<Goal> {
    let q = Id::Quickstart;
    let peer = Some(Id::Peer);
    let mut g = Vec::new();
    let mut add = |what, target, baseline, c, figure: fn(&Sample) -> f64, limit| {
        if conns.contains(&c) {
            g.push(Goal {
                what,
                target,
                baseline,
                conns: c,
                figure,
                limit,
            });
        }
    };
    let cpu: fn(&Sample) -> f64 = |s| s.cpu_redis_us;
    for c in [1, 10] {
        add("server CPU µs/req", q, peer, c, cpu, Limit::AtMost(1.0));
    }
    let busy_cpu = match kind {
        Kind::Valkey => 0.75,
        Kind::Redis => 0.8,
    };
    for c in [50, 200] {
        add(
            "server CPU µs/req",
            q,
            peer,
            c,
            cpu,
            Limit::AtMost(busy_cpu),
        );
        if kind == Kind::Valkey {
            add(
                "script calls/req",
                q,
                None,
                c,
                |s| s.script_calls,
                Limit::AtMost(0.05),
            );
            add(
                "command µs/req",
                q,
                peer,
                c,
                |s| s.command_us,
                Limit::AtMost(0.4),
            );
        }
    }
    add("p50 ms", q, peer, 1, |s| s.p50_ms, Limit::AtMost(1.05));
    add("p99 ms", q, peer, 1, |s| s.p99_ms, Limit::AtMost(1.10));
    add("req/s", q, peer, 10, Sample::rps, Limit::AtLeast(1.0));
    for c in [50, 200] {
        add("req/s", q, peer, c, Sample::rps, Limit::AtLeast(1.05));
    }
    for c in [10, 50, 200] {
        add("p99 ms", q, peer, c, |s| s.p99_ms, Limit::AtMost(1.0));
    }
    for c in [1, 10, 50, 200] {
        add(
            "req/s",
            Id::Memory,
            Some(Id::Bare),
            c,
            Sample::rps,
            Limit::AtLeast(0.95),
        );
    }
    let idem = Id::Idempotency;
    add(
        "p50 ms",
        idem,
        Some(q),
        1,
        |s| s.p50_ms,
        Limit::AtMost(1.05),
    );
    g
}

/// The targets table for one server: one row per goal, PASS or FAIL; a
/// goal whose figures were not measured (a target left out) says so, and
/// a cell with non-2xx answers or socket errors fails whatever its ratio.
/// Returns the table and (passed, judged).
pub fn table(
    kind: Kind,
    ids: &[Id],
    conns: &[u32],
    grid: &[Vec<Sample>],
) -> (String, usize, usize) {
    let cell = |id: Id, c: u32| {
        let t = ids.iter().position(|x| *x == id)?;
        let ci = conns.iter().position(|x| *x == c)?;
        Some(&grid[t][ci])
    };
    let fig = |what: &str, v: f64| match what {
        "req/s" => format!("{v:.0}"),
        _ => format!("{v:.3}"),
    };
    let mut r = String::new();
    let _ = writeln!(
        r,
        "| target | conns | figure | value | baseline | ratio | limit | result |"
    );
    let _ = writeln!(r, "|---|---:|---|---:|---:|---:|---|---|");
    let (mut passed, mut judged) = (0, 0);
    for goal in goals(kind, conns) {
        let name = goal.target.name();
        let base_name = goal.baseline.map_or("", Id::name);
        let (Some(s), base) = (
            cell(goal.target, goal.conns),
            goal.baseline.map(|b| cell(b, goal.conns)),
        ) else {
            let _ = writeln!(
                r,
                "| {name} | {} | {} | - | - | - | - | not measured |",
                goal.conns, goal.what
            );
            continue;
        };
        let (value, base_text, ratio, errors) = match base {
            None => ((goal.figure)(s), "-".to_owned(), None, s.errors()),
            Some(None) => {
                let _ = writeln!(
                    r,
                    "| {name} | {} | {} | - | {base_name}: not measured | - | - | not measured |",
                    goal.conns, goal.what
                );
                continue;
            }
            Some(Some(b)) => {
                let (v, bv) = ((goal.figure)(s), (goal.figure)(b));
                (
                    v,
                    format!("{} ({base_name})", fig(goal.what, bv)),
                    Some(v / bv),
                    s.errors() + b.errors(),
                )
            }
        };
        let judged_figure = ratio.unwrap_or(value);
        let ok = goal.limit.holds(judged_figure) && errors == 0 && judged_figure.is_finite();
        judged += 1;
        passed += usize::from(ok);
        let result = match (ok, errors) {
            (true, _) => "PASS".to_owned(),
            (false, 0) => "**FAIL**".to_owned(),
            (false, n) => format!("**FAIL** ({n} non-2xx or socket errors)"),
        };
        let _ = writeln!(
            r,
            "| {name} | {} | {} | {} | {base_text} | {} | {} | {result} |",
            goal.conns,
            goal.what,
            fig(goal.what, value),
            ratio.map_or("-".to_owned(), |x| format!("{x:.3}×")),
            goal.limit.show(if ratio.is_some() { "×" } else { "" }),
        );
    }
    let _ = writeln!(r, "\n{passed} of {judged} targets PASS.");
    (r, passed, judged)
}
