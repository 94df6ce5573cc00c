//! A `redis-server` (or a Valkey ≥ 9 `valkey-server`) owned by one test, on
//! a free loopback port.
//!
//! A server is killed (and its directory removed) on drop; a test can kill,
//! restart (same port), pause (`SIGSTOP`) and resume it without touching
//! anyone else's. A missing `redis-server` or `redis-cli`, or a missing
//! Valkey build, is a loud failure with the install hint, never a skip.
//! [`spawn_guarded`] starts the servers of fixtures that live as long as the
//! process ([`crate::scale`]).

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What a test says when `redis-server` is missing: how to install it.
pub const INSTALL_HINT: &str = "redis-server was not found on PATH. The tests need a real \
     Redis: install it (Debian/Ubuntu: `apt-get install redis-server`, macOS: `brew install \
     redis`) and run the tests again.";

/// The environment variable that names the Valkey ≥ 9 `valkey-server` the
/// tests start ([`RedisServer::start_valkey`]); `scripts/valkey.sh` prints
/// one (building it when needed) and `scripts/test.sh` sets it.
pub const VALKEY_SERVER_ENV: &str = "TRL_VALKEY_SERVER";

/// What a test says when no Valkey server is configured: how to get one.
pub const VALKEY_HINT: &str = "The Valkey tests need a valkey-server >= 9.0 (native DELIFEQ) at \
     the path in TRL_VALKEY_SERVER. Run the tests with `scripts/test.sh`, which sets it, or \
     set it yourself: `export TRL_VALKEY_SERVER=$(scripts/valkey.sh)` (finds or builds \
     Valkey 9 and caches the build under ~/.cache/tower-redis-lock/).";

/// The `valkey-server` named by `TRL_VALKEY_SERVER` ([`VALKEY_SERVER_ENV`]).
///
/// # Panics
/// With [`VALKEY_HINT`] when the variable is unset or empty, or names no
/// file: a test that needs Valkey never skips.
pub fn valkey_server() -> PathBuf {
    valkey_server_from(std::env::var_os(VALKEY_SERVER_ENV)).unwrap_or_else(|why| panic!("{why}"))
}

/// [`valkey_server`] on the variable's value, for its tests.
fn valkey_server_from(value: Option<OsString>) -> Result<PathBuf, String> {
    let path = match value {
        Some(value) if !value.is_empty() => PathBuf::from(value),
        _ => return Err(format!("{VALKEY_SERVER_ENV} is not set. {VALKEY_HINT}")),
    };
    if !path.is_file() {
        return Err(format!(
            "{VALKEY_SERVER_ENV}={} is not a file. {VALKEY_HINT}",
            path.display()
        ));
    }
    Ok(path)
}

/// The environment variable that picks the server [`RedisServer::start`]
/// runs: `valkey` for the `valkey-server` of [`VALKEY_SERVER_ENV`] (native
/// `DELIFEQ`), anything else or unset for `redis-server` (Lua scripts).
pub const TEST_SERVER_ENV: &str = "TRL_TEST_SERVER";

/// The program [`RedisServer::start`] runs ([`TEST_SERVER_ENV`]).
fn default_program() -> Program {
    match std::env::var(TEST_SERVER_ENV).as_deref() {
        Ok("valkey") => Program::Valkey(valkey_server()),
        _ => Program::Redis,
    }
}

/// The server program a [`RedisServer`] runs.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Program {
    /// `redis-server` from `PATH`.
    Redis,
    /// The `valkey-server` at this path ([`valkey_server`]).
    Valkey(PathBuf),
}

impl Program {
    fn command(&self) -> Command {
        match self {
            Program::Redis => Command::new("redis-server"),
            Program::Valkey(path) => Command::new(path),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Program::Redis => "redis-server",
            Program::Valkey(_) => "valkey-server",
        }
    }

    fn hint(&self) -> &'static str {
        match self {
            Program::Redis => INSTALL_HINT,
            Program::Valkey(_) => VALKEY_HINT,
        }
    }
}

/// A `redis-server` (or `valkey-server`, [`start_valkey`](Self::start_valkey))
/// owned by one test.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    program: Program,
    /// The loopback port it listens on (kept across [`restart`](Self::restart)).
    pub port: u16,
    dir: PathBuf,
    args: Vec<String>,
    /// TLS only (`--port 0 --tls-port <port>`), with `ca.crt`, `server.crt`
    /// and `server.key` from this directory.
    tls: Option<PathBuf>,
    /// The port, bound and never listening, while the server is killed
    /// (see [`hold_port`]).
    held: Option<tokio::net::TcpSocket>,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// `127.0.0.1:port` (0: a free one) bound and never listening: while the
/// socket lives, a connection to the port is refused (as to no server at
/// all) and no other test's server or listener is handed the port. A
/// killed server's port is held so until [`RedisServer::restart`]; a test
/// holds one to name an unreachable node. `SO_REUSEADDR`, as
/// `redis-server` binds: a dead server's connections linger in
/// `TIME_WAIT`, and the restarted server binds beside a socket that does
/// not listen. `None` if the port cannot be bound.
pub fn hold_port(port: u16) -> Option<tokio::net::TcpSocket> {
    let socket = tokio::net::TcpSocket::new_v4().ok()?;
    socket.set_reuseaddr(true).ok()?;
    socket
        .bind(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
        .ok()?;
    Some(socket)
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr").port()
}

impl RedisServer {
    /// Start a fresh server on a free port.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Start with extra `redis-server` arguments (`--maxmemory-policy ...`,
    /// `--enable-debug-command local`).
    ///
    /// With `TRL_TEST_SERVER=valkey` ([`TEST_SERVER_ENV`]) this starts the
    /// Valkey of [`start_valkey`](Self::start_valkey) instead, so that a
    /// suite written for Redis runs on Valkey's native commands too.
    pub fn start_with(args: &[&str]) -> Self {
        Self::start_inner(args, None, default_program())
    }

    /// Start `redis-server` (never Valkey, whatever [`TEST_SERVER_ENV`]
    /// says): for tests that need Redis 7's behaviour (no native
    /// `DELIFEQ`).
    pub fn start_redis() -> Self {
        Self::start_inner(&[], None, Program::Redis)
    }

    /// Start listening only for TLS (`rediss://`), with the `ca.crt`,
    /// `server.crt` and `server.key` in `certs`; `cli` talks TLS to it.
    pub fn start_tls(certs: &Path) -> Self {
        Self::start_inner(&[], Some(certs.to_owned()), Program::Redis)
    }

    /// Start a Valkey ≥ 9 server (native `DELIFEQ`, `SET .. IFEQ`) on a free
    /// port: the `valkey-server` named by `TRL_VALKEY_SERVER`. Everything
    /// else works as for `redis-server` (`cli` goes through `redis-cli`).
    ///
    /// # Panics
    /// With [`VALKEY_HINT`] when `TRL_VALKEY_SERVER` is unset or names no
    /// file.
    pub fn start_valkey() -> Self {
        Self::start_valkey_with(&[])
    }

    /// [`start_valkey`](Self::start_valkey) with extra `valkey-server`
    /// arguments.
    pub fn start_valkey_with(args: &[&str]) -> Self {
        Self::start_inner(args, None, Program::Valkey(valkey_server()))
    }

    /// Whether this is a Valkey server ([`start_valkey`](Self::start_valkey)).
    pub fn is_valkey(&self) -> bool {
        matches!(self.program, Program::Valkey(_))
    }

    fn start_inner(args: &[&str], tls: Option<PathBuf>, program: Program) -> Self {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("trl-test-{}-{n}", std::process::id()));
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        for _ in 0..10 {
            let mut server = Self {
                child: None,
                program: program.clone(),
                port: free_port(),
                dir: dir.clone(),
                args: args.clone(),
                tls: tls.clone(),
                held: None,
            };
            if server.spawn().is_ok() {
                return server;
            }
            // Port taken meanwhile: try another (the drop removes the directory).
        }
        if tls.is_some() {
            panic!(
                "could not start `redis-server --tls-port`: this redis-server may be built \
                 without TLS (BUILD_TLS=yes); Debian's redis-server package has it"
            );
        }
        panic!(
            "could not start {} on a free port after 10 attempts",
            program.name()
        );
    }

    fn spawn(&mut self) -> Result<(), String> {
        self.held = None;
        std::fs::create_dir_all(&self.dir).expect("create temp dir");
        let port = self.port.to_string();
        let mut cmd = self.program.command();
        match &self.tls {
            None => cmd.args(["--port", &port]),
            Some(certs) => cmd
                .args([
                    "--port",
                    "0",
                    "--tls-port",
                    &port,
                    "--tls-auth-clients",
                    "no",
                ])
                .arg("--tls-cert-file")
                .arg(certs.join("server.crt"))
                .arg("--tls-key-file")
                .arg(certs.join("server.key"))
                .arg("--tls-ca-cert-file")
                .arg(certs.join("ca.crt")),
        };
        let child = match cmd
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{}", self.program.hint()),
            Err(e) => panic!("cannot start {}: {e}", self.program.name()),
        };
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(format!("{} exited: {status}", self.program.name()));
            }
            let up = match self.tls {
                None => ping(self.port),
                Some(_) => self.cli(&["PING"]) == "PONG",
            };
            if up {
                // Something answers on the port: this server, or another
                // process that took the port first (ours then fails to bind).
                let ours = self.pid().map(|pid| format!("process_id:{pid}"));
                let info = self.cli(&["INFO", "server"]);
                if ours.is_some_and(|ours| info.lines().any(|l| l.trim() == ours)) {
                    return Ok(());
                }
                self.kill();
                return Err(format!(
                    "port {} answers, but not as the {} started here",
                    self.port,
                    self.program.name()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
        Err(format!(
            "{} did not answer PING within 5 s",
            self.program.name()
        ))
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>` (`rediss://` for TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// `kill -9` and wait for the process to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            self.held = hold_port(self.port);
        }
    }

    /// Start again on the same port (and directory, and arguments).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => panic!("restart failed: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// SIGSTOP: the server stops answering but keeps its sockets.
    pub fn pause(&self) {
        assert!(self.signal("-STOP"), "kill -STOP failed");
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        assert!(self.signal("-CONT"), "kill -CONT failed");
    }

    fn signal(&self, sig: &str) -> bool {
        let Some(pid) = self.pid() else {
            return false;
        };
        Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// `redis-cli -p <port> args...` (over TLS for a TLS server), trimmed
    /// stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        match &self.tls {
            None => cli(self.port, args),
            Some(certs) => {
                let ca = certs.join("ca.crt");
                let ca = ca.to_str().expect("UTF-8 temp dir");
                let mut all = vec!["--tls", "--cacert", ca];
                all.extend_from_slice(args);
                cli(self.port, &all)
            }
        }
    }

    /// Start a `DEBUG SLEEP secs` on a thread (needs `--enable-debug-command
    /// local`); the thread ends when the server wakes up.
    pub fn debug_sleep(&self, secs: f64) -> std::thread::JoinHandle<String> {
        let port = self.port;
        std::thread::spawn(move || cli(port, &["DEBUG", "SLEEP", &secs.to_string()]))
    }

    /// Calls of one command since start (`INFO commandstats`), e.g. "evalsha".
    pub fn command_calls(&self, command: &str) -> u64 {
        let info = self.cli(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// Number of keys in db 0.
    pub fn dbsize(&self) -> usize {
        self.cli(&["DBSIZE"]).parse().unwrap_or(0)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A paused server must be resumed to die cleanly.
        let _ = self.signal("-CONT");
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ---- servers that outlive every owner ------------------------------------------

/// The watchdogs of [`spawn_guarded`], reaped as they finish.
static WATCHDOGS: Mutex<Vec<std::process::Child>> = Mutex::new(Vec::new());

/// Whether every one of `servers` holds `key` within `within`; the key is
/// then deleted from each. Proof that a client which connects in the
/// background (Redlock's `connect` returns once a quorum is up) reached
/// every server: take a probe lease through it, then ask this.
pub async fn reached_every(servers: &[RedisServer], key: &str, within: Duration) -> bool {
    let all = crate::wait::eventually(within, || {
        servers
            .iter()
            .all(|s| s.cli(&["EXISTS", key]).trim() == "1")
    })
    .await;
    for s in servers {
        s.cli(&["DEL", key]);
    }
    all
}

/// Start `redis-server args...` (in `dir`) under a `sh` watchdog tied to this
/// process, for a static fixture (a cluster, a sentinel group) that is never
/// dropped: the watchdog kills the server, and removes the fixture's
/// directory, as soon as the test process is gone, however it ends.
///
/// Returns once the server it started (its pid, not merely some server on
/// `port`) answers `INFO`. `Err` says why it did not: `port` was taken between
/// [`free_port`] and the bind (another test's server, or an outgoing
/// connection's source port), or the server exited; the caller picks new
/// ports and tries again. Panics with the install hint if `redis-server` is
/// missing.
pub fn spawn_guarded(dir: &Path, port: u16, args: &[String]) -> Result<(), String> {
    // `valkey-server` with `TRL_TEST_SERVER=valkey` (cluster and sentinel
    // fixtures on Valkey too).
    let program = match default_program() {
        Program::Redis => PathBuf::from("redis-server"),
        Program::Valkey(path) => path,
    };
    assert!(
        Command::new(&program)
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok(),
        "{INSTALL_HINT}"
    );
    // $PPID is this test process. The loop ends when it or the server is gone;
    // once the test process is gone, its whole fixture directory goes too (a
    // node killed by a test leaves its directory for a restart until then).
    // The server's pid goes to `$TRL_DIR/pid`, so the caller can tell its own
    // server from another one that took the port first.
    const WATCHDOG: &str = r#""$TRL_SERVER" "$@" >/dev/null 2>&1 &
c=$!
echo "$c" > "$TRL_DIR/pid.tmp" && mv "$TRL_DIR/pid.tmp" "$TRL_DIR/pid"
p=$PPID
while kill -0 "$p" 2>/dev/null && kill -0 "$c" 2>/dev/null; do sleep 0.2; done
kill -9 "$c" 2>/dev/null
wait "$c" 2>/dev/null
if ! kill -0 "$p" 2>/dev/null; then rm -rf "$(dirname "$TRL_DIR")"; fi"#;
    let _ = std::fs::remove_file(dir.join("pid"));
    let child = Command::new("sh")
        .arg("-c")
        .arg(WATCHDOG)
        .arg("watchdog")
        .args(args)
        .env("TRL_DIR", dir)
        .env("TRL_SERVER", &program)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn sh for redis-server");
    // Keep the handle so finished watchdogs are reaped, not left as zombies.
    let mut children = WATCHDOGS.lock().unwrap_or_else(|e| e.into_inner());
    children.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
    children.push(child);
    drop(children);
    let log = dir.join("log");
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Some(ours) = guarded_pid(dir) {
            if !is_running(ours) {
                return Err(format!(
                    "redis-server for port {port} exited at start (port taken?); log: {}",
                    log.display()
                ));
            }
            match server_pid(port) {
                Some(pid) if pid == ours => return Ok(()),
                // Another process's server holds the port; ours will fail
                // to bind and exit.
                Some(_) => {
                    kill_quietly(ours);
                    return Err(format!("port {port} is held by another redis-server"));
                }
                None => {}
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!(
        "redis-server on port {port} did not answer within 10 s (log: {})",
        log.display()
    ))
}

/// The pid [`spawn_guarded`]'s watchdog wrote for the server it started in
/// `dir`.
fn guarded_pid(dir: &Path) -> Option<u32> {
    std::fs::read_to_string(dir.join("pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// `pid` runs (exists and is no zombie waiting for its watchdog's `wait`).
fn is_running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(state != 'Z' && state != 'X')
        })
        .unwrap_or(false)
}

/// The pid of the server answering on `port` (its `INFO server`), if one does.
pub fn server_pid(port: u16) -> Option<u32> {
    cli(port, &["INFO", "server"])
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .and_then(|p| p.trim().parse().ok())
}

/// `kill -9 pid`, whatever its outcome (the process may be gone already).
fn kill_quietly(pid: u32) {
    let _ = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// Kill the server [`spawn_guarded`] started in `dir`, if it still runs
/// (its watchdog then ends). For a fixture whose start failed half-way.
pub fn kill_guarded(dir: &Path) {
    if let Some(pid) = guarded_pid(dir) {
        kill_quietly(pid);
    }
}

/// `redis-cli -h 127.0.0.1 -p <port> args...`, trimmed stdout.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = match Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!("redis-cli was not found on PATH (it comes with redis-server). {INSTALL_HINT}")
        }
        Err(e) => panic!("cannot run redis-cli: {e}"),
    };
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `PING` over a raw socket (cheaper than a `redis-cli` process per try).
fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    matches!(s.read(&mut buf), Ok(n) if n >= 5 && &buf[..5] == b"+PONG")
}

#[cfg(test)]
mod tests;
