//! The `maxmemory-policy` check of [`RedisBackend`] against real
//! `redis-server`s: what the crate-private `check_eviction_policy` returns
//! (`EvictionPolicy`) and that it warns once per backend. The log side of
//! the same check, seen from outside the crate, is in `tests/it/faults.rs`.
//!
//! Each test starts its own server (`test_server`) on a free port.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::redis::EvictionPolicy;
use super::test_server::RedisServer as Server;
use super::{Acquire, LockBackend, RedisBackend, Token};

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
        let server = Server::start_with(&["--maxmemory-policy", "allkeys-lru"]);
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
        let server = Server::start_with(&["--maxmemory-policy", "allkeys-lru"]);
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
        let server = Server::start();
        let backend = connect(&server.url()).await;
        assert_eq!(
            backend.check_eviction_policy().await,
            EvictionPolicy::NoEviction
        );
        assert_eq!(logs.lines_with(&["WARN", "maxmemory_policy"]), 0);
    });
}
