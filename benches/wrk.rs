//! Load bench with the load generator in its own process: `wrk`, against
//! the quickstart binary and its baselines, each target in a process of
//! its own over a fresh server of its own.
//!
//! ```text
//! WRK_SERVER=both cargo bench --bench wrk   # the figures: about 3 min of load per server
//! WRK_SERVER=both WRK_SECS=1 WRK_ROUNDS=1 WRK_WARMUP=0 WRK_PACED_SECS=1 cargo bench --bench wrk  # smoke run
//! ```
//!
//! The targets (`WRK_TARGETS`, default
//! `bare,peer,peer-fred,quickstart,idempotency,memory`; also `pool`), all
//! with the quickstart's handler (`POST
//! /pay?delay_ms=0`: count, no sleep, a JSON answer) and routes:
//!
//! - `quickstart`: the quickstart binary as it is (`examples/quickstart.rs`,
//!   built here with `cargo build --profile bench --example quickstart`, or
//!   the binary `WRK_QUICKSTART` names), `REDIS_URL` set to its server:
//!   `RedisBackend::connect` defaults, its lock key (method, route,
//!   `x-user-id`, body digest);
//! - `peer`: a hand-written axum `from_fn` middleware over redis-rs'
//!   `ConnectionManager` (`benches/peer/`): `SET key token NX PX`, the
//!   handler, then `EVALSHA` of a compare-and-delete script, every reply
//!   read; keyed on method, path and `x-user-id`;
//! - `bare`: the handler alone;
//! - `idempotency`: `IdempotencyLayer` over `RedisBackend::connect`
//!   (`examples/payments.rs`' settings), every request a first one;
//! - `memory`, `pool`: the quickstart's lock layer over `MemoryBackend`
//!   and over `RedisBackend::connect_pool(url, 4)`.
//!
//! Every target but the quickstart is this binary started again with
//! `--serve <target> <url>`. Each target gets its own fresh server
//! (`WRK_SERVER`: `redis` = `redis-server` on `PATH`, the default;
//! `valkey` = what `scripts/valkey.sh | tail -1` prints; `both`: the
//! whole run once per server), started on a free port and killed after.
//! `WRK_WORKERS` Tokio workers per target (default 2).
//! `WRK_BASELINES_READ_BODY=1`: the baselines (`bare`, `peer`,
//! `peer-fred`) read each request's body whole and hash it before their
//! lock and handler, as the quickstart's layer does (it buffers the body
//! and digests it into its key), so that cost is on both sides; the
//! report's head says so.
//!
//! `wrk -t1 -c<conns> -d<WRK_SECS>s` (default 2 s) drives each target at
//! 1, 10, 50 and 200 connections (`WRK_CONNS`), every request a unique key
//! (`x-user-id` and `Idempotency-Key`), after a `WRK_WARMUP` s warm-up
//! (default 1; 0 for none); `WRK_ROUNDS` rounds (default 3), interleaved
//! (round, then connection count, then target, the targets' order rotated
//! by one each round); each cell is the median of its rounds, figure by
//! figure. Per run, read around it: the target's and its server's
//! `utime + stime` (`/proc/<pid>/stat`) and the server's `INFO
//! commandstats`, each divided by the requests wrk completed: server CPU
//! µs per request, commands, script calls (`eval*`, `evalsha*`, `fcall*`)
//! and command µs (the sum of `usec`) per request; allocations per
//! request in the targets this binary serves. Then each target at a fixed
//! offered load, half the bare target's best req/s, for `WRK_PACED_SECS`
//! (default 4; 0 for none), from the paced client (`--paced-client`).
//! Every load is bounded by its duration and by `timeout`.
//!
//! Output, per server: the targets table (`goals.rs`: each target with its
//! ratio, PASS or FAIL) on stdout and in `<target dir>/wrk/targets-<server>.md`;
//! the whole report in `report-<server>.md`; req/s and p99 against
//! connections in `load-<server>.svg` (`WRK_SVG_COPY=<path>` also writes
//! the first server's there). `BENCHMARKS.md` describes every column.
//!
//! `--serve <target> [<url>]` serves one target alone, over that server or
//! a redis-server of its own, and prints its address: for a profiler under
//! a load you run yourself (stdin closed stops it).

#[path = "peer/alloc.rs"]
mod alloc;
// `peer::serve` sets TCP_NODELAY; the targets here are served as the
// quickstart serves (`targets.rs`), so it is unused.
#[allow(dead_code)]
#[path = "peer/mod.rs"]
mod peer;

// A bench's root looks for its modules beside it, in `benches/`.
#[path = "wrk/goals.rs"]
mod goals;
#[path = "wrk/load.rs"]
mod load;
#[path = "wrk/paced.rs"]
mod paced;
#[path = "wrk/peer_fred.rs"]
mod peer_fred;
#[path = "wrk/report.rs"]
mod report;
#[path = "wrk/server.rs"]
mod server;
#[path = "wrk/svg.rs"]
mod svg;
#[path = "wrk/targets.rs"]
mod targets;

/// Every allocation of a process this binary serves is counted.
#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use load::Sample;
use peer::{env_or, loadavg};
use server::Kind;
use targets::{Id, Running};
use tower_redis_lock_test_support::RedisServer;

fn main() {
    // Under `cargo test --benches` (or criterion-style flags), do nothing.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("--paced-client") => paced::client(&args[2..]),
        Some("--serve") => targets::serve_main(&args[2..]),
        _ => run(),
    }
}

/// Settings of one run, from the environment.
struct Settings {
    secs: u64,
    warmup: u64,
    rounds: usize,
    paced_secs: f64,
    conns: Vec<u32>,
    workers: usize,
}

impl Settings {
    fn from_env() -> Settings {
        Settings {
            secs: env_or("WRK_SECS", 2u64).max(1),
            warmup: env_or("WRK_WARMUP", 1),
            rounds: env_or("WRK_ROUNDS", 3usize).clamp(1, 99),
            paced_secs: env_or("WRK_PACED_SECS", 4.0f64).clamp(0.0, 600.0),
            conns: std::env::var("WRK_CONNS")
                .unwrap_or_else(|_| "1,10,50,200".into())
                .split(',')
                .filter_map(|c| c.trim().parse().ok())
                .collect(),
            workers: env_or("WRK_WORKERS", 2),
        }
    }
}

/// Other work on the machine during the load, in cores on average, above
/// which a run is not quiet.
const OTHER_WORK_LIMIT: f64 = 0.1;

/// What a whole run shares.
struct Run {
    settings: Settings,
    ids: Vec<Id>,
    script: PathBuf,
    quickstart: Option<PathBuf>,
    out_dir: PathBuf,
}

fn run() {
    load::ensure_wrk();
    let settings = Settings::from_env();
    let kinds = Kind::from_env();
    let ids = Id::from_env();
    assert!(!ids.is_empty(), "WRK_TARGETS names no target");
    // <target dir>/release/deps/wrk-<hash>: the target dir is three up.
    let exe = std::env::current_exe().expect("own path");
    let target_dir = exe
        .ancestors()
        .nth(3)
        .map_or_else(|| PathBuf::from("target"), Path::to_path_buf);
    let out_dir = target_dir.join("wrk");
    std::fs::create_dir_all(&out_dir).expect("output dir");
    if kinds.contains(&Kind::Valkey) {
        server::find_valkey();
    }
    let quickstart = ids
        .contains(&Id::Quickstart)
        .then(|| targets::quickstart_binary(&target_dir));
    let script = out_dir.join("unique.lua");
    std::fs::write(&script, load::lua()).expect("write lua");
    let run = Run {
        settings,
        ids,
        script,
        quickstart,
        out_dir,
    };
    let mut summary = String::new();
    for (k, kind) in kinds.into_iter().enumerate() {
        let (passed, judged) = measure(&run, kind, k == 0);
        let _ = writeln!(summary, "{}: {passed} of {judged} targets PASS", kind.key());
    }
    eprint!("{summary}");
    eprintln!("wrote {}", run.out_dir.display());
}

/// Measures every target over fresh servers of `kind`, prints the targets
/// table and writes the files; (passed, judged) targets.
fn measure(run: &Run, kind: Kind, first: bool) -> (usize, usize) {
    let Settings {
        secs,
        warmup,
        rounds,
        paced_secs,
        ref conns,
        workers,
    } = run.settings;
    let ids = &run.ids;
    let started = Instant::now();
    let load_at_start = loadavg();
    let mut running: Vec<Running> = ids
        .iter()
        .map(|&id| Running::start(id, kind, run.quickstart.as_deref(), workers))
        .collect();
    let version = running
        .iter()
        .find_map(|r| r.server.as_ref())
        .map_or_else(|| format!("{kind:?} (no target uses it)"), server::version);
    eprintln!(
        "{version}: {} targets, load average {load_at_start}",
        ids.len()
    );
    // Other work on the machine meanwhile: its busy CPU minus this bench's
    // (its targets, their servers, and what it waited for: wrk, redis-cli).
    let ours = |running: &[Running]| {
        let cpu = |pid: Option<u32>| pid.map_or(0.0, server::proc_cpu);
        running
            .iter()
            .map(|r| cpu(Some(r.pid)) + cpu(r.server.as_ref().and_then(RedisServer::pid)))
            .sum::<f64>()
            + server::own_cpu_with_children()
    };
    let (busy0, ours0, wall0) = (server::machine_busy(), ours(&running), Instant::now());

    // samples[target][conn] = one per round
    let n = ids.len();
    let mut samples: Vec<Vec<Vec<Sample>>> = vec![vec![Vec::new(); conns.len()]; n];
    for round in 0..rounds {
        for (ci, &c) in conns.iter().enumerate() {
            for k in 0..n {
                let ti = (k + round) % n;
                let target = &mut running[ti];
                let tag = format!("{}{round}c{c}t{ti}", kind.key());
                if warmup > 0 {
                    let _ = load::run(&run.script, target.addr, c, warmup, &format!("w{tag}"));
                }
                let s = one(target, |addr| load::run(&run.script, addr, c, secs, &tag));
                eprintln!(
                    "  round {round} c={c:<3} {:<20} {:>7.0} req/s p50 {:.2} p99 {:.2} ms, server {:.2} µs/req, {:.2} scripts/req, {:.2} cmd µs/req, errors {}",
                    target.id.name(),
                    s.rps(),
                    s.p50_ms,
                    s.p99_ms,
                    s.cpu_redis_us,
                    s.script_calls,
                    s.command_us,
                    s.errors()
                );
                samples[ti][ci].push(s);
            }
        }
    }
    let grid: Vec<Vec<Sample>> = samples
        .iter()
        .map(|per_conn| per_conn.iter().map(|r| Sample::median(r)).collect())
        .collect();

    // Paced: half the bare target's best req/s.
    let bare = ids.iter().position(|id| *id == Id::Bare);
    let paced = match (bare, paced_secs > 0.0) {
        (Some(b), true) => {
            let best = grid[b].iter().map(Sample::rps).fold(0.0, f64::max);
            let rate = (best / 2.0).max(100.0);
            let mut paced = Vec::new();
            for (ti, target) in running.iter_mut().enumerate() {
                let tag = format!("{}p{ti}", kind.key());
                let s = one(target, |addr| paced::run(addr, rate, paced_secs, &tag));
                eprintln!(
                    "  paced {:<20} {:>7.0} req/s p50 {:.2} p99 {:.2} ms",
                    target.id.name(),
                    s.rps(),
                    s.p50_ms,
                    s.p99_ms
                );
                paced.push(s);
            }
            Some((rate, best, paced))
        }
        _ => None,
    };
    let other_cores = ((server::machine_busy() - busy0) - (ours(&running) - ours0)).max(0.0)
        / wall0.elapsed().as_secs_f64().max(1e-9);
    // Every target and its server killed before the report is written.
    drop(running);

    // ------------------------------------------------------------ report
    let load_at_end = loadavg();
    let load1 = load_at_start
        .split_whitespace()
        .next()
        .and_then(|l| l.parse::<f64>().ok())
        .unwrap_or(f64::NAN);
    let quiet = load1 < 1.0 && other_cores < OTHER_WORK_LIMIT;
    let mut head = String::new();
    let _ = writeln!(
        head,
        "{version}, {}, commit {}; `wrk -t1`, {rounds} x {secs} s per cell (median) after {warmup} s warm-up; \
         each target in its own process ({workers} Tokio workers) over its own fresh server; \
         load average {load_at_start} at start, {load_at_end} at end; other work on the machine \
         during the load {other_cores:.2} cores on average; {} cores ({})\n",
        utc_now(),
        commit(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model(),
    );
    if targets::baselines_read_body() {
        let _ = writeln!(
            head,
            "`WRK_BASELINES_READ_BODY=1`: bare, peer and peer fred read each request's body \
             whole and hash it (BLAKE3) before their lock and handler, as the layer does.\n"
        );
    }
    if !quiet {
        let _ = writeln!(
            head,
            "**The machine was not quiet** (1-minute load average {load1:.2} at start, \
             {other_cores:.2} cores of other work during the load; quiet is below 1.0 and \
             {OTHER_WORK_LIMIT}): latency and throughput figures are not meaningful.\n"
        );
    }
    let (goals, passed, judged) = goals::table(kind, ids, conns, &grid);
    let targets_md = format!("## Targets on {version}\n\n{head}{goals}");
    println!("{targets_md}");
    std::fs::write(
        run.out_dir.join(format!("targets-{}.md", kind.key())),
        &targets_md,
    )
    .expect("write targets");

    let mut r = format!("# wrk on {version}\n\n{head}## Targets\n\n{goals}\n");
    let _ = writeln!(
        r,
        "## Closed loop: unique key per request, median of {rounds} x {secs} s\n\n{}",
        report::cells(ids, conns, &grid)
    );
    let _ = writeln!(
        r,
        "## `INFO commandstats` per request\n\n\
         A script's µs include the commands it runs, which are also counted on their own.\n\n{}",
        report::commands(ids, conns, &grid)
    );
    if let Some((rate, best, paced)) = &paced {
        let _ = writeln!(
            r,
            "## Fixed offered load: {rate:.0} req/s (half the bare target's best, {best:.0}), {} connections, open loop, {paced_secs} s\n\n{}",
            paced::CONNS,
            report::paced(ids, paced)
        );
    }
    let _ = writeln!(r, "run took {:.0} s", started.elapsed().as_secs_f64());
    std::fs::write(run.out_dir.join(format!("report-{}.md", kind.key())), &r)
        .expect("write report");
    let names: Vec<&str> = ids.iter().map(|id| id.name()).collect();
    let picture = svg::svg(
        &names,
        conns,
        &grid,
        &format!("wrk -t1, unique key per request, {version}: req/s and p99 against connections"),
    );
    std::fs::write(
        run.out_dir.join(format!("load-{}.svg", kind.key())),
        &picture,
    )
    .expect("write svg");
    if let (true, Ok(copy)) = (first, std::env::var("WRK_SVG_COPY")) {
        std::fs::write(&copy, &picture).expect("write svg copy");
    }
    (passed, judged)
}

/// One measured load on `target`: `load` drives it; around it, the
/// target's and its server's CPU, the server's `INFO commandstats` and the
/// target's allocations are read and put per request.
fn one(target: &mut Running, load: impl FnOnce(SocketAddr) -> Sample) -> Sample {
    let a0 = target.allocations();
    let s0 = target.server.as_ref().map(server::commandstats);
    let server_pid = target.server.as_ref().and_then(RedisServer::pid);
    let cpu = |pid: Option<u32>| pid.map_or(0.0, server::proc_cpu);
    let (c0, r0) = (cpu(Some(target.pid)), cpu(server_pid));
    let mut s = load(target.addr);
    let (c1, r1) = (cpu(Some(target.pid)), cpu(server_pid));
    let s1 = target.server.as_ref().map(server::commandstats);
    let a1 = target.allocations();
    let n = s.requests.max(1) as f64;
    s.cpu_target_us = (c1 - c0) * 1e6 / n;
    s.cpu_redis_us = (r1 - r0) * 1e6 / n;
    s.allocs = match (a0, a1) {
        (Some(a0), Some(a1)) => (a1 - a0) as f64 / n,
        _ => f64::NAN,
    };
    if let (Some(s0), Some(s1)) = (s0, s1) {
        let d = server::delta(&s0, &s1);
        let per = |f: &dyn Fn(&server::CommandStat) -> u64| d.iter().map(f).sum::<u64>() as f64 / n;
        s.commands = per(&|c| c.calls);
        s.script_calls = per(&|c| if c.is_script() { c.calls } else { 0 });
        s.command_us = per(&|c| c.usec);
        s.breakdown = d
            .iter()
            .map(|c| {
                format!(
                    "{} {:.3} ({:.2} µs)",
                    c.name,
                    c.calls as f64 / n,
                    c.usec as f64 / c.calls.max(1) as f64
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
    }
    s
}

/// `2026-12-03 07:30 UTC`.
fn utc_now() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The checked-out commit, `+ changes` when the tree differs from it.
fn commit() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let head = git(&["rev-parse", "--short", "HEAD"]);
    match git(&["status", "--porcelain", "--untracked-files=no"]).is_empty() {
        true => format!("`{head}`"),
        false => format!("`{head}` + changes"),
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}
