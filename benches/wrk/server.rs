//! The server a run measures against (`WRK_SERVER`): Redis 7 from `PATH` or
//! the Valkey 9 that `scripts/valkey.sh` finds or builds; one fresh server
//! per target; and what is read off it: its CPU from `/proc`, its
//! `INFO commandstats`.

use std::path::Path;
use std::process::Command;
use std::sync::LazyLock;

use tower_redis_lock_test_support::RedisServer;

/// Which server program every target of one part of a run gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `redis-server` from `PATH` (Redis 7.0 on these machines).
    Redis,
    /// The `valkey-server` that `scripts/valkey.sh | tail -1` names.
    Valkey,
}

impl Kind {
    /// `redis` or `valkey`: in file names and `WRK_SERVER`.
    pub fn key(self) -> &'static str {
        match self {
            Kind::Redis => "redis",
            Kind::Valkey => "valkey",
        }
    }

    /// `WRK_SERVER`: `redis` (the default), `valkey` or `both`.
    pub fn from_env() -> Vec<Kind> {
        match std::env::var("WRK_SERVER").as_deref().map(str::trim) {
            Err(_) | Ok("") | Ok("redis") => vec![Kind::Redis],
            Ok("valkey") => vec![Kind::Valkey],
            Ok("both") => vec![Kind::Redis, Kind::Valkey],
            Ok(other) => panic!("WRK_SERVER={other:?}: one of redis, valkey, both"),
        }
    }

    /// A fresh server of this kind on a free loopback port, nothing kept on
    /// disk; killed when dropped.
    pub fn start(self) -> RedisServer {
        match self {
            Kind::Redis => RedisServer::start(),
            Kind::Valkey => RedisServer::start_valkey(),
        }
    }
}

/// Finds (or builds, about 4 minutes the first time) Valkey 9 with
/// `scripts/valkey.sh`, the same script the tests use, and names it in
/// `TRL_VALKEY_SERVER` for [`Kind::start`]. Call before any thread starts.
pub fn find_valkey() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/valkey.sh");
    eprintln!("finding Valkey 9: {}", script.display());
    let out = Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run scripts/valkey.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let path = stdout.lines().last().unwrap_or_default().trim().to_owned();
    assert!(
        out.status.success() && !path.is_empty(),
        "scripts/valkey.sh found no Valkey 9 (WRK_SERVER=redis measures Redis only)"
    );
    // Single-threaded here: nothing else reads the environment meanwhile.
    std::env::set_var(tower_redis_lock_test_support::VALKEY_SERVER_ENV, &path);
}

/// `Valkey 9.1.2` or `Redis 7.0.15`, from `INFO server`.
pub fn version(server: &RedisServer) -> String {
    let info = server.cli(&["INFO", "server"]);
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
    };
    match field("valkey_version:") {
        Some(v) => format!("Valkey {v}"),
        None => format!("Redis {}", field("redis_version:").unwrap_or_default()),
    }
}

/// A process's `utime + stime` so far, in seconds (`/proc/<pid>/stat`).
pub fn proc_cpu(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime: fields 14 and 15 (1-based), 11 and 12 after the name.
    (ticks(11) + ticks(12)) / *CLOCK_TICKS
}

/// `getconf CLK_TCK`: the unit of `/proc/<pid>/stat`'s times.
static CLOCK_TICKS: LazyLock<f64> = LazyLock::new(|| {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
});

/// One command's line of `INFO commandstats`.
#[derive(Clone, Debug)]
pub struct CommandStat {
    /// The name after `cmdstat_` (`evalsha`, `set`, `client|setname`).
    pub name: String,
    pub calls: u64,
    /// Time inside the command, without reading, parsing and replying; a
    /// script's includes the commands it runs.
    pub usec: u64,
}

impl CommandStat {
    /// `EVAL*`, `EVALSHA*` and `FCALL*`: a Lua script or function.
    pub fn is_script(&self) -> bool {
        self.name.starts_with("eval") || self.name.starts_with("fcall")
    }
}

/// The server's `INFO commandstats`.
pub fn commandstats(server: &RedisServer) -> Vec<CommandStat> {
    server
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |k: &str| {
                rest.split(',')
                    .find_map(|f| f.strip_prefix(k))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            Some(CommandStat {
                name: name.to_owned(),
                calls: field("calls="),
                usec: field("usec="),
            })
        })
        .collect()
}

/// What the server ran between two [`commandstats`] readings, the commands
/// that ran, without the bench's own `INFO`.
pub fn delta(before: &[CommandStat], after: &[CommandStat]) -> Vec<CommandStat> {
    after
        .iter()
        .filter(|s| s.name != "info")
        .map(|s| {
            let (calls, usec) = before
                .iter()
                .find(|b| b.name == s.name)
                .map_or((0, 0), |b| (b.calls, b.usec));
            CommandStat {
                name: s.name.clone(),
                calls: s.calls - calls,
                usec: s.usec - usec,
            }
        })
        .filter(|s| s.calls > 0)
        .collect()
}

/// This process's CPU so far with that of its children it has waited for
/// (`utime + stime + cutime + cstime`): wrk, the paced client, redis-cli.
pub fn own_cpu_with_children() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12) + ticks(13) + ticks(14)) / *CLOCK_TICKS
}

/// The whole machine's busy CPU so far, in seconds (`/proc/stat`: user,
/// nice, system, irq, softirq, steal).
pub fn machine_busy() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let line = stat.lines().find(|l| l.starts_with("cpu ")).unwrap_or("");
    let f: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0.0);
    (at(0) + at(1) + at(2) + at(5) + at(6) + at(7)) / *CLOCK_TICKS
}
