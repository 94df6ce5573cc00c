use super::*;
use crate::RedisBackend;

#[test]
fn redacts_passwords() {
    assert_eq!(
        redact_url("redis://user:hunter2@localhost:6379"),
        "redis://user:***@localhost:6379"
    );
    assert_eq!(
        redact_url("redis://localhost:6379"),
        "redis://localhost:6379"
    );
    // Unescaped `@` and `:` inside the password.
    let url = "rediss://lock:p@ss:w@rd@redis.internal:6380/0";
    assert_eq!(redact_url(url), "rediss://lock:***@redis.internal:6380/0");
    // Password-only userinfo, as in `redis://:pw@host`.
    assert_eq!(redact_url("redis://:hunter2@h"), "redis://:***@h");
    // Sentinel passwords travel in the query.
    let url =
        "redis-sentinel://u:pw1@h:26379/0?sentinelServiceName=m&sentinelPassword=pw2&node=h2:26379";
    let redacted = redact_url(url);
    assert_eq!(
        redacted,
        "redis-sentinel://u:***@h:26379/0?sentinelServiceName=m&sentinelPassword=***&node=h2:26379"
    );
    assert!(!redacted.contains("pw1") && !redacted.contains("pw2"));
}

#[test]
fn redacts_an_at_in_the_password_sentinel_and_database_urls() {
    // An `@` inside the password: the userinfo ends at the last `@`.
    let redacted = redact_url("redis://leak:s3cr@t-Pa55@127.0.0.1:16391");
    assert_eq!(redacted, "redis://leak:***@127.0.0.1:16391");
    // A sentinel URL: the sentinel password travels in the query.
    let url = "redis-sentinel://127.0.0.1:26379?sentinelServiceName=m\
               &sentinelUsername=sen&sentinelPassword=sentinel-s3cret";
    let redacted = redact_url(url);
    assert!(redacted.contains("sentinelPassword=***"), "{redacted}");
    assert!(redacted.contains("sentinelUsername=sen"), "{redacted}");
    // DATABASE_URL, as tokio-postgres and libpq take it.
    for (url, secret) in [
        ("postgres://user:pass@host/db", "pass"),
        (
            "postgresql://ledger:pg@s3cret@127.0.0.1:5432/ledger",
            "s3cret",
        ),
        (
            "postgres://u@host/db?password=qs-s3cret&sslmode=require",
            "s3cret",
        ),
        (
            "host=127.0.0.1 user=u password=kv-s3cret dbname=db",
            "s3cret",
        ),
    ] {
        let redacted = redact_url(url);
        assert!(!redacted.contains(secret), "{url} -> {redacted}");
    }
    assert_eq!(
        redact_url("postgres://user:pass@host/db"),
        "postgres://user:***@host/db"
    );
}

#[test]
fn redacts_passwords_the_way_url_parsers_read_them() {
    // `?`, `#` and `/` end the authority for every URL parser: the part
    // after them is no longer "the password", so it must not survive.
    for url in [
        "redis://u:p?ss@host",
        "redis://u:p#ss@host:6379",
        "redis://u:p/ss@host",
        "rediss://u:pa?ss=w@host/0",
    ] {
        let redacted = redact_url(url);
        let (_, rest) = redacted.split_once("://").unwrap();
        assert!(!rest.contains("ss"), "{url} -> {redacted}");
        assert!(
            redacted.starts_with(url.split("://").next().unwrap()),
            "{redacted}"
        );
    }
    // Only the scheme of what does not parse at all.
    assert_eq!(redact_url("redis://u:p?ss@host"), "redis://***");
    assert_eq!(redact_url("http//u:secret@nope"), "***");
    // A user name alone may be the password (`redis://pw@host`).
    assert_eq!(redact_url("redis://hunter2@h:6379"), "redis://***@h:6379");
    // Percent-encoded passwords go too.
    let redacted = redact_url("redis://u:hun%3Fter2@h");
    assert_eq!(redacted, "redis://u:***@h");
}

/// A probe without an answer is asked again after 1, 2, 4 … 64 s (seven
/// times, about two minutes), then left to the next reconnection; an
/// answer, or a reconnection's probe, starts over.
#[test]
fn an_unanswered_probe_is_asked_again_with_a_doubling_wait() {
    let none = Probed { answered: false };
    let mut waits = Vec::new();
    let mut last = probe_again(none, None);
    while let Some(wait) = last {
        waits.push(wait.as_secs());
        assert!(waits.len() <= 16, "the retries end: {waits:?}");
        last = probe_again(none, last);
    }
    assert_eq!(waits, [1, 2, 4, 8, 16, 32, 64]);
    let answered = Probed { answered: true };
    assert_eq!(probe_again(answered, Some(Duration::from_secs(8))), None);
    assert_eq!(probe_again(answered, None), None);
    assert_eq!(First::after(answered), First::Later);
    assert_eq!(First::after(none), First::ProbeAgain);
}

#[test]
fn connections_have_nodelay_and_keepalive() {
    let builder = RedisBackend::builder("redis://127.0.0.1:6379").unwrap();
    let tcp = &builder.get_connection_config().tcp;
    assert_eq!(tcp.nodelay, Some(true), "TCP_NODELAY on");
    assert!(tcp.keepalive.is_some(), "TCP keepalive on");
}

#[test]
fn reconnect_delays_are_jittered() {
    let base = Duration::from_millis(400);
    let delays: Vec<Duration> = [0u32, 1, u32::MAX / 3, u32::MAX / 2, u32::MAX]
        .into_iter()
        .map(|r| jittered(base, r))
        .collect();
    for d in &delays {
        assert!(*d >= base / 2 && *d <= base, "{d:?} outside [base/2, base]");
    }
    assert_ne!(delays[0], delays[4], "the random draw moves the delay");
    // Different draws from the OS: a fleet does not reconnect in lockstep.
    let drawn: std::collections::HashSet<_> =
        (0..16).map(|_| jittered(base, random_u32())).collect();
    assert!(drawn.len() > 1, "{drawn:?}");
}

#[test]
fn config_errors_do_not_echo_the_password() {
    let err = RedisBackend::builder("redis://u:hunter2@/nohost").unwrap_err();
    assert!(!err.to_string().contains("hunter2"), "{err}");
    assert!(!format!("{err:?}").contains("hunter2"), "{err:?}");
}

#[test]
fn bad_url_is_a_clear_error() {
    let err = RedisBackend::builder("http//nope").unwrap_err();
    assert!(err.to_string().contains("cannot parse Redis URL"), "{err}");
}

#[test]
fn tls_urls_are_refused_without_tls() {
    for url in [
        "rediss://user:hunter2@127.0.0.1:6380",
        "REDISS://127.0.0.1",
        "valkeys://127.0.0.1:6380/1",
        "rediss-cluster://127.0.0.1:30001?node=127.0.0.1:30002",
        "valkeys-cluster://127.0.0.1:30001",
        "rediss-sentinel://127.0.0.1:26379?sentinelServiceName=m",
        "valkeys-sentinel://127.0.0.1:26379?sentinelServiceName=m",
    ] {
        let err = refuse_tls_without_feature(url, false).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("`tls-rustls`"), "{url}: {msg}");
        assert!(!msg.contains("hunter2"), "{msg}");
        assert!(refuse_tls_without_feature(url, true).is_ok(), "{url}");
    }
    for url in [
        "redis://user:pw@127.0.0.1:6379",
        "valkey://127.0.0.1",
        "redis-cluster://127.0.0.1:30001",
        "redis-sentinel://127.0.0.1:26379?sentinelServiceName=m",
        "redis://[::1]:6379",
    ] {
        assert!(refuse_tls_without_feature(url, false).is_ok(), "{url}");
        assert!(refuse_tls_without_feature(url, true).is_ok(), "{url}");
    }
}

/// The builder applies the check with fred's own answer: refused without
/// the feature, accepted with it.
#[test]
fn the_builder_refuses_tls_only_without_the_feature() {
    let got = RedisBackend::builder("rediss://u:hunter2@127.0.0.1:6380");
    if cfg!(feature = "tls-rustls") {
        assert!(got.is_ok());
    } else {
        let msg = got.unwrap_err().to_string();
        assert!(
            msg.contains("`tls-rustls`") && !msg.contains("hunter2"),
            "{msg}"
        );
    }
}

/// The `maxmemory-policy` check of [`RedisBackend`] against real
/// `redis-server`s: what the crate-private `check_eviction_policy` returns
/// (`EvictionPolicy`), that it warns once per policy found, and that it
/// runs again on every reconnection. The log side of
/// the same check, seen from outside the crate, is in `tests/it/faults.rs`.
///
/// Each test starts its own server (`tower_redis_lock_test_support`) on a
/// free port.
pub(crate) mod eviction {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::super::EvictionPolicy;
    use crate::backend::{Acquire, LockBackend, RedisBackend, Token};
    use fred::interfaces::ClientLike;
    use tower_redis_lock_test_support::{eventually, RedisServer as Server};

    /// Log lines of this thread's `tower_redis_lock` events (debug and up).
    #[derive(Clone, Default)]
    pub(crate) struct Logs(Arc<Mutex<Vec<u8>>>);

    impl Logs {
        pub(crate) fn lines_with(&self, needles: &[&str]) -> usize {
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
    pub(crate) fn run_logged<F, Fut>(f: F)
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

    /// The check runs at connect and again on every reconnection (fred's
    /// reconnect notification), never on a request's path: a policy changed
    /// to `allkeys-lru` while connected is found, and warned about, after a
    /// reconnect, without a request; acquires and releases send no `CONFIG`.
    #[test]
    fn a_reconnect_checks_the_policy_again_and_requests_never_do() {
        run_logged(|logs| async move {
            let server = Server::start();
            // redis-cli's own `CONFIG GET`s (it sends some to a Valkey).
            let base = server.command_calls("config|get");
            let backend = connect(&server.url()).await;
            assert_eq!(backend.eviction_policy(), Some(EvictionPolicy::NoEviction));
            assert_eq!(
                server.command_calls("config|get") - base,
                1,
                "checked at connect"
            );
            let key = bytes::Bytes::from_static(b"trl:{eviction-reconnect}");
            for _ in 0..3 {
                let token = Token::generate();
                let got = backend.acquire(&key, &token, Duration::from_secs(5)).await;
                assert_eq!(got.expect("acquire"), Acquire::acquired(None));
                assert!(backend.release(&key, &token).await.expect("release"));
            }
            assert_eq!(
                server.command_calls("config|get") - base,
                1,
                "no check on the acquire path"
            );

            assert_eq!(
                server.cli(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]),
                "OK"
            );
            backend.clients()[0]
                .force_reconnection()
                .await
                .expect("reconnect");
            let evicts = Some(EvictionPolicy::Evicts("allkeys-lru".into()));
            assert!(
                eventually(Duration::from_secs(5), || backend.eviction_policy()
                    == evicts)
                .await,
                "checked again after the reconnect: {:?}",
                backend.eviction_policy()
            );
            assert_eq!(server.command_calls("config|get") - base, 2);
            assert_eq!(
                logs.lines_with(&["WARN", "maxmemory_policy=allkeys-lru"]),
                1,
                "warned once for the new policy"
            );
        });
    }

    /// A backend over a client that connects only later (built with
    /// `RedisBackend::new` before `init`) checks when the client connects.
    #[test]
    fn a_client_connected_later_is_checked_when_it_connects() {
        run_logged(|logs| async move {
            let server = Server::start_with(&["--maxmemory-policy", "allkeys-lru"]);
            let config = fred::types::config::Config::from_url(&server.url()).expect("url");
            let client = fred::clients::Client::new(config, None, None, None);
            let backend = RedisBackend::new(client.clone());
            assert_eq!(backend.eviction_policy(), None, "nothing to check yet");
            let _task = client.init().await.expect("connect");
            let evicts = Some(EvictionPolicy::Evicts("allkeys-lru".into()));
            assert!(
                eventually(Duration::from_secs(5), || backend.eviction_policy()
                    == evicts)
                .await,
                "checked once connected: {:?}",
                backend.eviction_policy()
            );
            assert_eq!(
                logs.lines_with(&["WARN", "maxmemory_policy=allkeys-lru"]),
                1
            );
            let _ = client.quit().await;
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
}
