//! The report's tables of figures: every cell, the commands per request,
//! the paced runs. (The targets table is `goals.rs`.)

use std::fmt::Write as _;

use crate::load::Sample;
use crate::targets::Id;

/// `v / base`, as `1.23×`, or `-` without a base.
fn vs(v: f64, base: Option<f64>) -> String {
    base.map_or("-".to_owned(), |b| format!("{:.2}×", v / b))
}

/// `v` with `decimals`, or `-` for NaN (not measured).
fn or_dash(v: f64, decimals: usize) -> String {
    match v.is_nan() {
        true => "-".to_owned(),
        false => format!("{v:.decimals$}"),
    }
}

/// The closed-loop table: one row per target and connection count, the
/// medians of the rounds (errors summed over them).
pub fn cells(ids: &[Id], conns: &[u32], grid: &[Vec<Sample>]) -> String {
    let peer = ids.iter().position(|id| *id == Id::Peer);
    let mut r = String::new();
    let _ = writeln!(
        r,
        "| target | conns | req/s | p50 ms | p99 ms | errors | target CPU µs/req | server CPU µs/req | allocs/req | commands/req | script calls/req | command µs/req | req/s vs peer | p99 vs peer | server CPU vs peer |"
    );
    let _ = writeln!(
        r,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (ci, &c) in conns.iter().enumerate() {
        for (ti, id) in ids.iter().enumerate() {
            let s = &grid[ti][ci];
            let p = peer.map(|p| &grid[p][ci]);
            let redis = |v: f64, d: usize| match s.cpu_redis_us == 0.0 && s.commands == 0.0 {
                true => "-".to_owned(),
                false => or_dash(v, d),
            };
            let _ = writeln!(
                r,
                "| {} | {c} | {:.0} | {:.2} | {:.2} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} |",
                id.name(),
                s.rps(),
                s.p50_ms,
                s.p99_ms,
                s.errors(),
                s.cpu_target_us,
                redis(s.cpu_redis_us, 2),
                or_dash(s.allocs, 1),
                redis(s.commands, 2),
                redis(s.script_calls, 3),
                redis(s.command_us, 2),
                vs(s.rps(), p.map(Sample::rps)),
                vs(s.p99_ms, p.map(|p| p.p99_ms)),
                match s.cpu_redis_us == 0.0 {
                    true => "-".to_owned(),
                    false => vs(s.cpu_redis_us, p.map(|p| p.cpu_redis_us)),
                },
            );
        }
    }
    r
}

/// Per target and connection count, `INFO commandstats` per request: calls
/// per request (µs per call), from the median round by req/s.
pub fn commands(ids: &[Id], conns: &[u32], grid: &[Vec<Sample>]) -> String {
    let mut r = String::new();
    let _ = writeln!(r, "| target | conns | commands: calls/req (µs/call) |");
    let _ = writeln!(r, "|---|---:|---|");
    for (ci, &c) in conns.iter().enumerate() {
        for (ti, id) in ids.iter().enumerate() {
            let s = &grid[ti][ci];
            if !s.breakdown.is_empty() {
                let _ = writeln!(r, "| {} | {c} | {} |", id.name(), s.breakdown);
            }
        }
    }
    r
}

/// The paced runs: one row per target at the same offered load.
pub fn paced(ids: &[Id], paced: &[Sample]) -> String {
    let bare = ids.iter().position(|id| *id == Id::Bare);
    let mut r = String::new();
    let _ = writeln!(r, "| target | achieved req/s | p50 ms | p99 ms | p99 from schedule ms | max ms | added p50 over bare ms | added p99 over bare ms | errors | target CPU µs/req | server CPU µs/req |");
    let _ = writeln!(r, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (ti, id) in ids.iter().enumerate() {
        let s = &paced[ti];
        let b = bare.map(|b| paced[b].clone()).unwrap_or_default();
        let _ = writeln!(
            r,
            "| {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:+.2} | {:+.2} | {} | {:.1} | {:.2} |",
            id.name(),
            s.rps(),
            s.p50_ms,
            s.p99_ms,
            s.sched_p99_ms,
            s.max_ms,
            s.p50_ms - b.p50_ms,
            s.p99_ms - b.p99_ms,
            s.errors(),
            s.cpu_target_us,
            s.cpu_redis_us,
        );
    }
    r
}
