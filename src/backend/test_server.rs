//! A `redis-server` owned by one unit test, on a free port, killed (and its
//! directory removed) on drop, for the unit tests that need crate-private
//! detail against a real server (`redis_tests`, `redlock_tests`). A missing
//! `redis-server` or `redis-cli` is a loud failure with the install hint.
//! The integration tests have their own, richer harness in `tests/common`.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const INSTALL_HINT: &str = "redis-server was not found on PATH. The tests need a real Redis: \
     install it (Debian/Ubuntu: `apt-get install redis-server`, macOS: `brew install redis`) \
     and run the tests again.";

/// A `redis-server` owned by one test, killed (and its directory removed)
/// on drop.
pub(crate) struct Server {
    child: Option<Child>,
    pub(crate) port: u16,
    dir: PathBuf,
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr").port()
}

impl Server {
    /// Start on a free port with extra arguments (`--maxmemory-policy ...`).
    pub(crate) fn start(args: &[&str]) -> Self {
        for _ in 0..10 {
            let port = free_port();
            let dir = std::env::temp_dir().join(format!("trl-unit-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("create temp dir");
            let child = match Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&dir)
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
            {
                Ok(child) => child,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL_HINT}"),
                Err(e) => panic!("cannot start redis-server: {e}"),
            };
            let mut server = Self {
                child: Some(child),
                port,
                dir,
            };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                let exited = server
                    .child
                    .as_mut()
                    .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
                if exited {
                    break; // port taken meanwhile: try another
                }
                if server.cli(&["PING"]) == "PONG" {
                    return server;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            drop(server);
        }
        panic!("could not start redis-server on a free port after 10 attempts");
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis-cli -p port args...`, trimmed stdout.
    pub(crate) fn cli(&self, args: &[&str]) -> String {
        let out = match Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .output()
        {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                panic!(
                    "redis-cli was not found on PATH (it comes with redis-server). {INSTALL_HINT}"
                )
            }
            Err(e) => panic!("cannot run redis-cli: {e}"),
        };
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    pub(crate) fn dbsize(&self) -> usize {
        self.cli(&["DBSIZE"]).parse().unwrap_or(0)
    }

    /// `kill -9` and wait for the process to be gone.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGSTOP: the server stops answering but keeps its sockets.
    pub(crate) fn pause(&self) {
        assert!(self.signal("-STOP"), "kill -STOP failed");
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub(crate) fn resume(&self) {
        assert!(self.signal("-CONT"), "kill -CONT failed");
    }

    fn signal(&self, sig: &str) -> bool {
        let Some(child) = &self.child else {
            return false;
        };
        Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // A paused server must be resumed to die cleanly.
        let _ = self.signal("-CONT");
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
