//! An app that only takes leases from handlers (`Locker`, no layer) over a
//! shared backend (Redis) gets the same once-per-process warning without a
//! secret; over `MemoryBackend` it gets none. The warning is process-wide;
//! under the internal `__test-hooks` feature of the shared binary it is per
//! thread, and this test has its thread to itself.

use std::sync::{Arc, Mutex};

use tower_redis_lock::key::{KeySpace, Route};
use tower_redis_lock::lock::Locker;
use tower_redis_lock::{MemoryBackend, RedisBackend, RedisLockLayer};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
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

/// A Redis backend that is never connected: the warning depends only on the
/// backend being shared, not on traffic.
fn redis() -> RedisBackend {
    let client = RedisBackend::builder("redis://127.0.0.1:1")
        .expect("valid URL")
        .build()
        .expect("fred client");
    RedisBackend::new(client)
}

#[tokio::test]
async fn locker_without_a_secret_warns_once() {
    let out = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(out.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let count = || {
        String::from_utf8_lossy(&out.0.lock().unwrap())
            .matches("no secret configured")
            .count()
    };
    let _ = RedisLockLayer::new(redis(), Route)
        .key_space(KeySpace::default().secret(b"s"))
        .locker();
    assert_eq!(count(), 0, "a keyed locker does not warn");
    let _ = Locker::new(MemoryBackend::new(), Route);
    let _ = RedisLockLayer::new(MemoryBackend::new(), Route).locker();
    assert_eq!(count(), 0, "a MemoryBackend locker does not warn");
    let _ = Locker::new(redis(), Route);
    assert_eq!(count(), 1);
    let _ = Locker::new(redis(), Route);
    assert_eq!(count(), 1, "once per process");
}
