//! The queue's rules by counts and order: FIFO heads, caps, a leaving head
//! passes its turn, and through a `Locker` on a counting backend, how many
//! acquires each waited request costs and that the holders never overlap.

use crate::backend::Backend;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::*;
use crate::backend::contract::Watch;
use crate::backend::{Acquire, BackendFuture, LockBackend, MemoryBackend, Token};
use crate::key::Route;
use crate::RedisLockLayer;

fn key() -> Bytes {
    Bytes::from_static(b"trl:{k}")
}

/// Bounds by count alone.
fn counts(per_key: usize, total: usize) -> Bounds {
    Bounds {
        per_key,
        total,
        bytes: usize::MAX,
    }
}

#[tokio::test]
async fn the_head_is_the_first_to_come_and_a_leaving_head_passes_its_turn() {
    let queue = Arc::new(WaitQueue::default());
    let later = Instant::now() + Duration::from_secs(10);
    let a = queue.enter(&key(), later, counts(64, 64), 0).unwrap();
    let b = queue.enter(&key(), later, counts(64, 64), 0).unwrap();
    let c = queue.enter(&key(), later, counts(64, 64), 0).unwrap();
    assert!(a.is_head() && !b.is_head() && !c.is_head());
    // A waiter behind the head leaves: the head stays.
    drop(b);
    assert!(a.is_head());
    // The head leaves (its client went away): the next one is told.
    let turn = tokio::spawn(async move {
        c.head().await;
        c
    });
    tokio::task::yield_now().await;
    drop(a);
    let c = tokio::time::timeout(Duration::from_secs(5), turn)
        .await
        .expect("the next waiter was told")
        .unwrap();
    assert!(c.is_head());
    assert_eq!(queue.len(&key()), 1);
    drop(c);
    assert_eq!(
        (queue.len(&key()), queue.total()),
        (0, 0),
        "nothing left behind"
    );
}

#[test]
fn caps_per_key_and_in_all() {
    let queue = Arc::new(WaitQueue::default());
    let later = Instant::now() + Duration::from_secs(10);
    let _a = queue.enter(&key(), later, counts(2, 3), 0).unwrap();
    let _b = queue.enter(&key(), later, counts(2, 3), 0).unwrap();
    assert_eq!(
        queue.enter(&key(), later, counts(2, 3), 0).unwrap_err(),
        Full::Key
    );
    let other = Bytes::from_static(b"trl:{o}");
    let _c = queue.enter(&other, later, counts(2, 3), 0).unwrap();
    assert_eq!(
        queue.enter(&other, later, counts(2, 3), 0).unwrap_err(),
        Full::Total
    );
}

#[test]
fn cap_on_the_bytes_waiters_hold() {
    let queue = Arc::new(WaitQueue::default());
    let later = Instant::now() + Duration::from_secs(10);
    let bounds = Bounds {
        per_key: 64,
        total: 64,
        bytes: 100,
    };
    let a = queue.enter(&key(), later, bounds, 60).unwrap();
    assert_eq!(
        queue.enter(&key(), later, bounds, 41).unwrap_err(),
        Full::Bytes
    );
    let _b = queue.enter(&key(), later, bounds, 40).unwrap();
    assert_eq!(queue.bytes(), 100);
    drop(a);
    assert_eq!(queue.bytes(), 40, "a leaving waiter gives its bytes back");
    let _c = queue.enter(&key(), later, bounds, 60).unwrap();
}

#[tokio::test]
async fn the_head_looks_when_the_count_moves_or_the_lease_expires_and_not_before() {
    let queue = Arc::new(WaitQueue::default());
    let now = Instant::now();
    let expires = now + Duration::from_secs(10);
    let t = queue.enter(&key(), expires, counts(64, 64), 0).unwrap();
    assert!(
        matches!(t.next(now), Next::Watch),
        "the first head subscribes"
    );
    let (tx, rx) = tokio::sync::watch::channel(7u64);
    t.watched(Some(Watch::new(rx, ())));
    assert!(
        matches!(t.next(now), Next::Look),
        "a release may have come before the watch"
    );
    t.looking(now);
    t.found_held(expires);
    // Nothing moved: sleep until the expiry.
    match t.next(now) {
        Next::Sleep { at, seen, .. } => assert_eq!((at, seen), (expires, 7)),
        _ => panic!("looked while the holder holds"),
    }
    tx.send_modify(|n| *n += 1);
    assert!(matches!(t.next(now), Next::Look), "a release is heard");
    t.looking(now);
    assert!(matches!(t.next(now), Next::Sleep { .. }));
    assert!(matches!(t.next(expires), Next::Look), "the lease expired");
    // The watch ends: back-off from now on.
    drop(tx);
    assert!(matches!(t.next(now), Next::Look));
    t.looking(now);
    match t.next(now) {
        Next::Sleep {
            watch: None, at, ..
        } => assert!(at > now && at <= now + BACKOFF_MAX),
        _ => panic!("no back-off without a watch"),
    }
}

/// A `MemoryBackend` behind a wrapper (so the layer goes through the
/// trait, as with Redis) that counts acquires and watches.
#[derive(Debug, Clone, Default)]
struct Counting {
    inner: MemoryBackend,
    acquires: Arc<AtomicUsize>,
    watches: Arc<AtomicUsize>,
}

impl LockBackend for Counting {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquires.fetch_add(1, Ordering::SeqCst);
        self.inner.acquire(key, token, ttl)
    }
    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquires.fetch_add(1, Ordering::SeqCst);
        self.inner.acquire_fenced(key, token, ttl)
    }
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.inner.release(key, token)
    }
    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        self.inner.extend(key, token, ttl)
    }
    fn watch(&self, key: &Bytes) -> Option<BackendFuture<Watch>> {
        self.watches.fetch_add(1, Ordering::SeqCst);
        self.inner.watch(key)
    }

    fn native_calls(&self) -> Option<u64> {
        self.inner.native_calls()
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.release(key, token)
    }
}

impl Backend for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

/// Three lockers of one key: each waits its turn in arrival order, with
/// growing fences; the holders never overlap; the second pays the acquire
/// that found the key held, the one after subscribing, and the one that
/// took it; the third, arriving while the second waits, queues behind it
/// without asking the store and pays only the acquire that took it; one
/// watch for the whole episode.
#[tokio::test(start_paused = true)]
async fn waiters_take_turns_in_order_with_growing_fences_and_few_acquires() {
    let backend = Counting::default();
    let layer = RedisLockLayer::new(backend.clone(), Route)
        .fencing(true)
        .wait(Duration::from_secs(5));
    let locker = layer.locker();
    let key = locker.key_with(|k| k.push("account", b"1"));
    let first = locker.lock(key).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiting = Vec::new();
    for i in 1..=2 {
        let (locker, order) = (locker.clone(), order.clone());
        waiting.push(tokio::spawn(async move {
            let guard = locker.lock(key).await.unwrap();
            order
                .lock()
                .unwrap()
                .push((i, guard.lease().fence().unwrap()));
            // Hold for a while (paused clock: no real time passes).
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(guard.release().await);
        }));
        // Arrival order is spawn order.
        while layer.stats().waited < i {
            tokio::task::yield_now().await;
        }
    }
    assert_eq!(
        backend.acquires.load(Ordering::SeqCst),
        1 + 2,
        "no look while the holder holds"
    );
    let fence0 = first.lease().fence().unwrap();
    assert!(first.release().await);
    for w in waiting {
        w.await.unwrap();
    }
    let order = order.lock().unwrap().clone();
    assert_eq!(order.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [1, 2]);
    assert!(
        fence0 < order[0].1 && order[0].1 < order[1].1,
        "fences grow: {order:?}"
    );
    assert_eq!(backend.acquires.load(Ordering::SeqCst), 1 + 3 + 1);
    assert_eq!(backend.watches.load(Ordering::SeqCst), 1);
    let stats = layer.stats();
    assert_eq!(
        (
            stats.acquired,
            stats.waited,
            stats.waited_conflict,
            stats.conflict
        ),
        (3, 2, 0, 0)
    );
    assert_eq!(layer.config.queue.total(), 0);
}

/// Past its bound a waiter gets the 409, counted as waited-then-409; a
/// full queue answers 409 at once.
#[tokio::test(start_paused = true)]
async fn past_the_bound_409_and_a_full_queue_409_at_once() {
    let layer = RedisLockLayer::new(MemoryBackend::new(), Route)
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_millis(300))
        .max_waiters(1, 8);
    let locker = layer.locker();
    let key = locker.key_with(|k| k.push("account", b"1"));
    let _held = locker.lock(key).await.unwrap();
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock(key).await.map(|_| ()) }
    });
    while layer.stats().waited < 1 {
        tokio::task::yield_now().await;
    }
    let full = locker.lock(key).await.unwrap_err();
    assert_eq!(full.status(), http::StatusCode::CONFLICT);
    // The queue knows the holder's lease is fresh: the refusal says so
    // (as long again as it has held, at least 1 s), not a whole TTL.
    assert_eq!(full.retry_after(), Some(Duration::from_secs(1)));
    let timed_out = waiter.await.unwrap().unwrap_err();
    assert_eq!(timed_out.status(), http::StatusCode::CONFLICT);
    let stats = layer.stats();
    assert_eq!(
        (
            stats.waited,
            stats.waited_conflict,
            stats.wait_full,
            stats.conflict
        ),
        (1, 1, 1, 2)
    );
    assert_eq!(stats.mean_wait(), Some(Duration::from_millis(300)));
}

/// A lease that expires instead of being released wakes its waiter at its
/// expiry: one look then, none before.
#[tokio::test(start_paused = true)]
async fn an_expiring_lease_wakes_its_waiter_at_its_expiry() {
    let backend = Counting::default();
    let layer = RedisLockLayer::new(backend.clone(), Route)
        .ttl(Duration::from_secs(2))
        .wait(Duration::from_secs(5));
    let locker = layer.locker();
    let key = locker.key_with(|k| k.push("account", b"1"));
    let held = locker.lock(key).await.unwrap();
    let started = Instant::now();
    let guard = locker.lock(key).await.unwrap();
    assert!(started.elapsed() >= Duration::from_secs(2) - Duration::from_millis(1));
    assert!(started.elapsed() < Duration::from_millis(2100));
    // The holder's acquire, the waiter's first, after subscribing, at the expiry.
    assert_eq!(backend.acquires.load(Ordering::SeqCst), 4);
    drop((held, guard));
}
