//! Wrong Redis credentials are a clear, fast error, and no password shows
//! in the error, its `Debug`, its sources or anything logged (fred's `log`
//! records, the crate's `tracing` events), nor in a backend's or layer's
//! `Debug`. Its own test binary: it installs the process-wide `log` logger
//! and `tracing` subscriber, which would capture every other test's lines.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tower_redis_lock::key::{KeySpace, RequestMethod, Route};
use tower_redis_lock::{RedisBackend, RedisLockLayer};
use tower_redis_lock_test_support::RedisServer;

/// A server that requires `password` (set after start: the harness checks
/// readiness with an unauthenticated PING).
fn server_with_password(password: &str) -> RedisServer {
    let server = RedisServer::start();
    assert_eq!(
        server.cli(&["CONFIG", "SET", "requirepass", password]),
        "OK"
    );
    server
}

/// Captures `log` records (fred logs through `log`) and `tracing` events.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<String>>);

impl log::Log for Captured {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        let line = format!("{} {} {}\n", record.level(), record.target(), record.args());
        self.0.lock().unwrap().push_str(&line);
    }
    fn flush(&self) {}
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap()
            .push_str(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_a_clear_error_without_the_secret() {
    let logs = Captured::default();
    log::set_logger(Box::leak(Box::new(logs.clone()))).expect("first logger");
    log::set_max_level(log::LevelFilter::Trace);
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("first subscriber");

    let server = server_with_password("the-right-one");
    for (user, secret) in [("", "Wr0ng-Pa55"), ("lock", "Wr0ng-@cl-Pa55")] {
        let url = format!("redis://{user}:{secret}@127.0.0.1:{}", server.port());
        let started = Instant::now();
        let err = match RedisBackend::connect(&url).await {
            Ok(_) => panic!("connected with a wrong password"),
            Err(e) => e,
        };
        let took = started.elapsed();
        let display = err.to_string();
        let debug = format!("{err:?}");
        let mut chain = display.clone();
        let mut source = std::error::Error::source(&err);
        while let Some(s) = source {
            chain.push_str(&format!(" / {s} / {s:?}"));
            source = s.source();
        }
        println!("wrong password ({took:?}): {display}");
        assert!(
            display.contains("refused the credentials") && display.contains("WRONGPASS"),
            "says what is wrong: {display}"
        );
        assert!(
            display.contains(":***@127.0.0.1"),
            "names the server: {display}"
        );
        for text in [&display, &debug, &chain] {
            assert!(!text.contains(secret), "secret leaked: {text}");
        }
        assert!(took < Duration::from_secs(5), "fails fast: {took:?}");
    }
    // Nothing logged anywhere (fred's `log` records, our `tracing` events)
    // carries a password.
    let logged = logs.0.lock().unwrap().clone();
    for secret in ["Wr0ng-Pa55", "Wr0ng-@cl-Pa55", "the-right-one"] {
        assert!(!logged.contains(secret), "secret in logs:\n{logged}");
    }

    // A working backend's Debug shows no configuration at all, and neither
    // does the layer's.
    let url = format!("redis://:the-right-one@127.0.0.1:{}", server.port());
    let backend = RedisBackend::connect(&url).await.unwrap();
    let layer = RedisLockLayer::new(backend.clone(), (RequestMethod, Route))
        .key_space(KeySpace::default().secret(b"digest-secret --"));
    for text in [format!("{backend:?}"), format!("{layer:?}")] {
        assert!(!text.contains("the-right-one"), "{text}");
        assert!(!text.contains("digest-secret"), "{text}");
        assert!(!text.contains("127.0.0.1"), "no config in Debug: {text}");
    }
}
