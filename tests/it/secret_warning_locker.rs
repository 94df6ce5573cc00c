//! An app that only takes leases from handlers (`Locker`, no layer) over a
//! shared backend (Redis) gets the same once-per-process warning without a
//! secret; over `MemoryBackend` it gets none. The warning is process-wide;
//! under the internal `__test-hooks` feature of the shared binary it is per
//! thread, and this test has its thread to itself.

use tower_redis_lock::key::{KeySpace, Route};
use tower_redis_lock::lock::Locker;
use tower_redis_lock::{MemoryBackend, RedisLockLayer};

use crate::common::Logs;
use crate::secret_warning::{redis, warnings};

#[tokio::test]
async fn locker_without_a_secret_warns_once() {
    let out = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(out.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let count = || warnings(&out);
    let _ = RedisLockLayer::new(redis(), Route)
        .key_space(KeySpace::default().secret(b"s --------------"))
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
