//! Without a secret, a layer over a shared backend (Redis) warns once per
//! process; over `MemoryBackend`, whose keys never leave the process, it does
//! not warn at all. In the shared binary the crate is built with the internal
//! `__test-hooks` feature, which makes "once" per thread: each test runs on a
//! thread of its own (current-thread runtime), so no other test has fired
//! the warning first.

use tower_layer::Layer;
use tower_redis_lock::key::{KeySpace, Route};
use tower_redis_lock::lock::Locker;
use tower_redis_lock::{IdempotencyLayer, MemoryBackend, RedisBackend, RedisLockLayer};

use crate::common::Logs;

/// How often the "no secret" warning is in `logs`.
pub(crate) fn warnings(logs: &Logs) -> usize {
    logs.text().matches("no secret configured").count()
}

/// A Redis backend that is never connected: the warning depends only on the
/// backend being shared, not on traffic.
pub(crate) fn redis() -> RedisBackend {
    let client = RedisBackend::builder("redis://127.0.0.1:1")
        .expect("valid URL")
        .build()
        .expect("fred client");
    RedisBackend::new(client)
}

#[tokio::test]
async fn warns_once_per_process_without_a_secret() {
    let out = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(out.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    // In-process keys never warn: not applied, applied, or as a locker.
    let memory = RedisLockLayer::new(MemoryBackend::new(), Route);
    let _ = memory.layer(());
    let _ = memory.layer(());
    let _ = Locker::new(MemoryBackend::new(), Route);
    let _ = IdempotencyLayer::new(MemoryBackend::new(), Route).layer(());
    assert_eq!(warnings(&out), 0, "a MemoryBackend layer does not warn");

    // Built but never applied: the user may still call `.key_space()`.
    let plain = RedisLockLayer::new(redis(), Route);
    assert_eq!(warnings(&out), 0, "building a layer does not warn yet");

    // A layer with a secret never warns.
    let keyed = RedisLockLayer::new(redis(), Route)
        .key_space(KeySpace::default().secret(b"shared secret --"));
    let _ = keyed.layer(());
    let _ = keyed.layer(());
    assert_eq!(warnings(&out), 0, "a keyed layer does not warn");

    // The first unkeyed layer applied warns; every later one stays quiet.
    let _ = plain.layer(());
    assert_eq!(warnings(&out), 1);
    let _ = plain.layer(());
    let _ = RedisLockLayer::new(redis(), Route).layer(());
    assert_eq!(warnings(&out), 1, "once per process, not per route");
    let _ = Locker::new(redis(), Route);
    assert_eq!(warnings(&out), 1, "a locker does not repeat it");
    let text = out.text();
    assert!(text.contains("WARN"), "{text}");
    assert!(text.contains("KeySpace::secret"), "{text}");
}

/// A secret shorter than 16 bytes is no secret: the empty string that
/// `env::var(..).unwrap_or_default()` gives for an unset variable, or 15
/// bytes, warn as "no secret" and name the length; 16 bytes do not warn.
#[tokio::test]
async fn a_short_secret_is_no_secret_and_says_so() {
    for (secret, warns) in [
        (&b""[..], true),
        (&[7u8; 15][..], true),
        (&[7u8; 16][..], false),
    ] {
        let out = Logs::default();
        // Each round on a thread of its own: the warning is once per
        // thread under the test hooks, once per process otherwise.
        let text = std::thread::spawn(move || {
            let _guard = tracing::subscriber::set_default(
                tracing_subscriber::fmt()
                    .with_writer(out.clone())
                    .with_ansi(false)
                    .finish(),
            );
            let _ = RedisLockLayer::new(redis(), Route)
                .key_space(KeySpace::default().secret(secret))
                .layer(());
            out.text()
        })
        .join()
        .unwrap();
        assert_eq!(
            warnings_in(&text),
            usize::from(warns),
            "{} bytes: {text}",
            secret.len()
        );
        if warns {
            assert!(
                text.contains(&format!("was given {} bytes", secret.len())),
                "{text}"
            );
        }
    }
}

fn warnings_in(text: &str) -> usize {
    text.matches("no secret configured").count()
}
