//! `wrk` as the load generator: finding it, its Lua script (a unique key
//! per request), one bounded run, and what one run measured ([`Sample`]).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

/// Finds `wrk`, or runs `benches/install-wrk.sh` once.
pub fn ensure_wrk() {
    let found = || {
        Command::new("wrk")
            .arg("--version")
            .output()
            .map(|o| !o.stdout.is_empty() || !o.stderr.is_empty())
            .unwrap_or(false)
    };
    if found() {
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/install-wrk.sh");
    eprintln!("wrk not found; running {}", script.display());
    let _ = Command::new("sh").arg(&script).status();
    assert!(
        found(),
        "wrk is needed: install it (Debian/Ubuntu: `apt-get install -y wrk`, macOS: `brew install wrk`)"
    );
}

/// The body of every request: the quickstart's own example.
pub const BODY: &str = r#"{"amount":5}"#;

/// The Lua script: `POST /pay?delay_ms=0` with the quickstart's example body
/// and a unique `x-user-id` (the lock key's identity part) and
/// `Idempotency-Key` per request, so every request takes a key no other
/// request holds.
pub fn lua() -> String {
    format!(
        r#"-- written by benches/wrk.rs
local counter = 0
local prefix = ""
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("id", threads)
end
function init(args)
  -- wrk's threads each have their own Lua state: seed each one, or all
  -- draw the same numbers.
  math.randomseed(os.time() * 1000 + (id or 0))
  prefix = (args[1] or "r") .. "-" .. math.random(1, 2147483646) .. "-"
end
function request()
  counter = counter + 1
  local key = prefix .. counter
  return wrk.format("POST", "/pay?delay_ms=0",
    {{["content-type"] = "application/json", ["x-user-id"] = key, ["Idempotency-Key"] = key}},
    '{BODY}')
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("WRKRESULT %d %d %d %d %d %d %d %d %d %d\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.max))
end
"#
    )
}

/// What one run of one target at one connection count measured.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    pub requests: u64,
    pub secs: f64,
    /// Answers >= 400 (wrk's `errors.status`; the handler never answers 3xx).
    pub status_errors: u64,
    /// connect + read + write + timeout.
    pub socket_errors: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Paced client only: p99 from the scheduled send time.
    pub sched_p99_ms: f64,
    /// CPU µs per request of the target's process.
    pub cpu_target_us: f64,
    /// CPU µs per request of the target's redis-server (or valkey-server).
    pub cpu_redis_us: f64,
    /// Allocations per request in the target's process (NaN where not
    /// counted: the quickstart binary has no counting allocator).
    pub allocs: f64,
    /// Commands per request (`INFO commandstats` calls; the commands a
    /// script runs count too, beside the script's own call).
    pub commands: f64,
    /// `EVAL*`, `EVALSHA*`, `FCALL*` calls per request.
    pub script_calls: f64,
    /// The sum of `usec` over `INFO commandstats`, per request.
    pub command_us: f64,
    /// Per command: calls per request (µs per call).
    pub breakdown: String,
}

impl Sample {
    pub fn rps(&self) -> f64 {
        self.requests as f64 / self.secs.max(1e-9)
    }

    pub fn errors(&self) -> u64 {
        self.status_errors + self.socket_errors
    }

    /// The median of each figure over `rounds` on its own (errors are
    /// summed; the breakdown is the median round's by req/s).
    pub fn median(rounds: &[Sample]) -> Sample {
        assert!(!rounds.is_empty(), "a cell without a round");
        let med = |f: fn(&Sample) -> f64| {
            let mut v: Vec<f64> = rounds.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let mut by_rps = rounds.to_vec();
        by_rps.sort_by(|a, b| a.rps().total_cmp(&b.rps()));
        let mid = &by_rps[by_rps.len() / 2];
        // req/s is carried as requests over 1 s.
        Sample {
            requests: med(Sample::rps).round() as u64,
            secs: 1.0,
            status_errors: rounds.iter().map(|s| s.status_errors).sum(),
            socket_errors: rounds.iter().map(|s| s.socket_errors).sum(),
            p50_ms: med(|s| s.p50_ms),
            p99_ms: med(|s| s.p99_ms),
            max_ms: med(|s| s.max_ms),
            sched_p99_ms: med(|s| s.sched_p99_ms),
            cpu_target_us: med(|s| s.cpu_target_us),
            cpu_redis_us: med(|s| s.cpu_redis_us),
            allocs: med(|s| s.allocs),
            commands: med(|s| s.commands),
            script_calls: med(|s| s.script_calls),
            command_us: med(|s| s.command_us),
            breakdown: mid.breakdown.clone(),
        }
    }
}

/// Runs `wrk -t1 -c<conns> -d<secs>` against `addr` with `script` and
/// returns what wrk measured. Bounded twice: wrk's own `-d` (and a 5 s
/// per-request timeout), and `timeout` killing it 30 s past that.
pub fn run(script: &Path, addr: SocketAddr, conns: u32, secs: u64, tag: &str) -> Sample {
    let secs = secs.max(1);
    let out = Command::new("timeout")
        .args(["-k", "5", &(secs + 30).to_string(), "wrk", "-t1"])
        .args([format!("-c{conns}"), format!("-d{secs}s")])
        .args(["--timeout", "5s", "-s"])
        .arg(script)
        .arg(format!("http://{addr}/"))
        .args(["--", tag])
        .output()
        .expect("run wrk (under timeout)");
    parse(&out, "WRKRESULT ")
}

/// Parses the result line of wrk's `done()` or of the paced client:
/// requests, µs, connect/read/write/status/timeout errors, p50, p99, max
/// (µs), and the paced client's p99 from schedule.
pub fn parse(out: &std::process::Output, prefix: &str) -> Sample {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| {
            panic!(
                "no {prefix}line ({}): {stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let v: Vec<f64> = line
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
    Sample {
        requests: at(0) as u64,
        secs: at(1) / 1e6,
        socket_errors: (at(2) + at(3) + at(4) + at(6)) as u64,
        status_errors: at(5) as u64,
        p50_ms: at(7) / 1000.0,
        p99_ms: at(8) / 1000.0,
        max_ms: at(9) / 1000.0,
        sched_p99_ms: v.get(10).map_or(f64::NAN, |x| x / 1000.0),
        allocs: f64::NAN,
        ..Sample::default()
    }
}
