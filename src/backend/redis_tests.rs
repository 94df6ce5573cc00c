//! The `maxmemory-policy` check of [`RedisBackend`] against real
//! `redis-server`s: what the crate-private `check_eviction_policy` returns
//! (`EvictionPolicy`) and that it warns once per backend. The log side of
//! the same check, seen from outside the crate, is in `tests/faults.rs`.
//!
//! Each test starts its own server on a free port and kills it on drop; a
//! missing `redis-server` (or `redis-cli`) is a loud failure with the install
//! hint.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::redis::EvictionPolicy;
use super::{Acquire, LockBackend, RedisBackend, Token};

const INSTALL_HINT: &str = "redis-server was not found on PATH. The tests need a real Redis: \
     install it (Debian/Ubuntu: `apt-get install redis-server`, macOS: `brew install redis`) \
     and run the tests again.";

/// A `redis-server` owned by one test, killed (and its directory removed)
/// on drop.
struct Server {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr").port()
}

impl Server {
    /// Start on a free port with extra arguments (`--maxmemory-policy ...`).
    fn start(args: &[&str]) -> Self {
        for _ in 0..10 {
            let port = free_port();
            let dir = std::env::temp_dir()
                .join(format!("trl-unit-eviction-{}-{port}", std::process::id()));
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

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Run a command through `redis-cli`, trimmed output.
    fn cli(&self, args: &[&str]) -> String {
        let out = match Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
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
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Log lines of this thread's `tower_redis_lock` events (debug and up).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn lines_with(&self, needles: &[&str]) -> usize {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        text.lines()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .count()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Run `f` on a current-thread runtime with this thread's events in `Logs`
/// (no global subscriber: other tests do not see them).
fn run_logged<F, Fut>(f: F)
where
    F: FnOnce(Logs) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("tower_redis_lock=debug"))
        .with_ansi(false)
        .with_writer(logs.clone())
        .finish();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    tracing::subscriber::with_default(subscriber, || rt.block_on(f(logs)));
}

async fn connect(url: &str) -> RedisBackend {
    RedisBackend::connect(url)
        .await
        .expect("connect to the test redis-server")
}

/// A policy that evicts is reported with its name and warned about once per
/// backend (the check at connect warned; asking again does not).
#[test]
fn evicting_policy_is_reported_and_warned_once() {
    run_logged(|logs| async move {
        let server = Server::start(&["--maxmemory-policy", "allkeys-lru"]);
        let backend = connect(&server.url()).await;
        assert_eq!(
            backend.check_eviction_policy().await,
            EvictionPolicy::Evicts("allkeys-lru".into())
        );
        assert_eq!(
            backend.clone().check_eviction_policy().await,
            EvictionPolicy::Evicts("allkeys-lru".into()),
            "a clone shares the check"
        );
        assert_eq!(
            logs.lines_with(&["WARN", "maxmemory_policy=allkeys-lru"]),
            1,
            "warned once"
        );
    });
}

/// An ACL user without `CONFIG` gets `Unknown`, no warning, and the
/// backend still works.
#[test]
fn config_denied_by_acl_is_unknown_without_warning() {
    run_logged(|logs| async move {
        let server = Server::start(&["--maxmemory-policy", "allkeys-lru"]);
        assert_eq!(
            server.cli(&["ACL", "SETUSER", "app", "on", ">s3cret", "~*", "+@all", "-config"]),
            "OK"
        );
        let limited = connect(&format!("redis://app:s3cret@127.0.0.1:{}", server.port)).await;
        assert_eq!(
            limited.check_eviction_policy().await,
            EvictionPolicy::Unknown
        );
        assert_eq!(logs.lines_with(&["WARN", "maxmemory_policy"]), 0);

        let key = bytes::Bytes::from_static(b"trl:{eviction-acl}");
        let token = Token::generate();
        assert_eq!(
            limited
                .acquire(&key, &token, Duration::from_secs(5))
                .await
                .expect("acquire as the limited user"),
            Acquire::acquired(None)
        );
        assert!(limited.release(&key, &token).await.expect("release"));
    });
}

/// `noeviction` is reported as such, without a warning.
#[test]
fn noeviction_is_reported_without_warning() {
    run_logged(|logs| async move {
        let server = Server::start(&[]);
        let backend = connect(&server.url()).await;
        assert_eq!(
            backend.check_eviction_policy().await,
            EvictionPolicy::NoEviction
        );
        assert_eq!(logs.lines_with(&["WARN", "maxmemory_policy"]), 0);
    });
}
