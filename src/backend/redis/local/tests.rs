//! Unit tests of the local in-flight table, driven through a backend that
//! counts round trips (expiry on paused time).

use super::*;
use crate::backend::Backend;
use crate::backend::{BackendFuture, LockBackend, MemoryBackend};
use std::sync::atomic::{AtomicUsize, Ordering};

const TTL: Duration = Duration::from_secs(5);

/// A backend that counts acquires and can be told to stall them.
#[derive(Debug, Clone)]
struct Counting {
    mem: MemoryBackend,
    acquires: Arc<AtomicUsize>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Counting {
    fn with_permits(permits: usize) -> Self {
        Self {
            mem: MemoryBackend::new(),
            acquires: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(permits)),
        }
    }
    fn stalled() -> Self {
        Self::with_permits(0)
    }
    fn open() -> Self {
        Self::with_permits(1 << 20)
    }
}

impl LockBackend for Counting {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquires.fetch_add(1, Ordering::SeqCst);
        let (this, key, token) = (self.clone(), key.clone(), *token);
        BackendFuture::new(async move {
            let _permit = this.gate.acquire().await.expect("gate open");
            Ok(this.mem.try_acquire(&key, &token, ttl))
        })
    }
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.mem.release(key, token)
    }
    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        self.mem.extend(key, token, ttl)
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquire(key, token, ttl)
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.release(key, token)
    }

    fn watch(&self, _key: &Bytes) -> Option<BackendFuture<crate::backend::contract::Watch>> {
        None
    }

    fn native_calls(&self) -> Option<u64> {
        None
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

/// Any [`LockBackend`] behind the table, the way `RedisBackend` uses it
/// (`lock.rs`): the table answers hit or miss, this sends the call and
/// reports the answer back; a duplicate of a lease held (or being taken)
/// here is answered `Held` from memory, without a backend round trip. The
/// tests drive the table through it, over a backend that counts round
/// trips.
#[derive(Debug, Clone)]
struct LocalDedup<B> {
    inner: B,
    table: Arc<InFlight>,
}

impl<B: LockBackend + Clone> LocalDedup<B> {
    /// Put the table in front of `inner`.
    fn new(inner: B) -> Self {
        Self {
            inner,
            table: Arc::new(InFlight::default()),
        }
    }

    fn ask(
        &self,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
        fenced: bool,
    ) -> BackendFuture<Acquire> {
        match fenced {
            true => self.inner.acquire_fenced(key, token, ttl),
            false => self.inner.acquire(key, token, ttl),
        }
    }

    fn take(
        &self,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
        fenced: bool,
    ) -> BackendFuture<Acquire> {
        match self.table.begin(key, token, ttl, false) {
            Begin::Hit(answer) => BackendFuture::ready(Ok(answer)),
            Begin::Lead(lead) => {
                let call = self.ask(key, token, ttl, fenced);
                BackendFuture::new(async move {
                    let result = call.await;
                    lead.finish(result.as_ref().ok().copied());
                    result
                })
            }
            Begin::Bypass { expires } => {
                let call = self.ask(key, token, ttl, fenced);
                let (table, key, token) = (self.table.clone(), key.clone(), *token);
                BackendFuture::new(async move {
                    let result = call.await;
                    table.reacquired(&key, &token, expires, &result);
                    result
                })
            }
            Begin::Wait { answer: rx, .. } => {
                let (this, key, token) = (self.clone(), key.clone(), *token);
                BackendFuture::new(async move {
                    match rx.await {
                        Ok(answer) => Ok(answer),
                        // The leader failed or gave up: ask ourselves.
                        Err(_) => this.ask(&key, &token, ttl, fenced).await,
                    }
                })
            }
        }
    }
}

impl<B: LockBackend + Clone> LockBackend for LocalDedup<B> {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.take(key, token, ttl, false)
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.take(key, token, ttl, true)
    }

    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.table.forget(key, token);
        self.inner.release(key, token)
    }

    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        let expires = Instant::now() + ttl;
        self.table.shorten(key, token, expires);
        let call = self.inner.extend(key, token, ttl);
        let (table, key, token) = (self.table.clone(), key.clone(), *token);
        BackendFuture::new(async move {
            let result = call.await;
            table.extend_answered(&key, &token, expires, &result);
            result
        })
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.release(key, token)
    }

    fn watch(&self, _key: &Bytes) -> Option<BackendFuture<crate::backend::contract::Watch>> {
        None
    }

    fn native_calls(&self) -> Option<u64> {
        None
    }
}

impl<B: LockBackend + Clone> Backend for LocalDedup<B> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn is_in_process(&self) -> bool {
        false
    }

    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

fn key() -> Bytes {
    Bytes::from_static(b"trl:{k}")
}

#[tokio::test(start_paused = true)]
async fn held_duplicate_is_answered_locally_and_release_reopens() {
    let backend = Counting::open();
    let dedup = LocalDedup::new(backend.clone());
    let (a, b) = (Token::generate(), Token::generate());
    assert!(matches!(
        dedup.acquire(&key(), &a, TTL).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    match dedup.acquire(&key(), &b, TTL).await.unwrap() {
        Acquire::Held {
            retry_after: Some(d),
        } => assert!(d <= TTL && d > TTL - Duration::from_secs(1), "{d:?}"),
        other => panic!("expected held, got {other:?}"),
    }
    assert_eq!(
        backend.acquires.load(Ordering::SeqCst),
        1,
        "no second round trip"
    );
    assert!(dedup.release(&key(), &a).await.unwrap());
    assert_eq!(dedup.table.len(), 0, "release forgets the entry");
    assert!(matches!(
        dedup.acquire(&key(), &b, TTL).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    assert_eq!(backend.acquires.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn concurrent_duplicates_wait_for_the_leader() {
    let backend = Counting::stalled();
    let dedup = LocalDedup::new(backend.clone());
    let leader = dedup.acquire(&key(), &Token::generate(), TTL);
    let followers: Vec<_> = (0..10)
        .map(|_| dedup.acquire(&key(), &Token::generate(), TTL))
        .collect();
    let leader = tokio::spawn(leader);
    let followers: Vec<_> = followers.into_iter().map(tokio::spawn).collect();
    backend.gate.add_permits(1 << 20);
    assert!(matches!(
        leader.await.unwrap().unwrap(),
        Acquire::Acquired { .. }
    ));
    for f in followers {
        assert!(matches!(
            f.await.unwrap().unwrap(),
            Acquire::Held {
                retry_after: Some(_)
            }
        ));
    }
    assert_eq!(backend.acquires.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn cancelled_leader_lets_waiters_ask_themselves() {
    let backend = Counting::stalled();
    let dedup = LocalDedup::new(backend.clone());
    let leader = dedup.acquire(&key(), &Token::generate(), TTL);
    let follower = tokio::spawn(dedup.acquire(&key(), &Token::generate(), TTL));
    drop(leader); // deadline hit, client gone
    tokio::task::yield_now().await;
    backend.gate.add_permits(1 << 20);
    assert!(matches!(
        follower.await.unwrap().unwrap(),
        Acquire::Acquired { .. }
    ));
    assert_eq!(backend.acquires.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn local_entry_never_outlives_the_lease() {
    let backend = Counting::open();
    let dedup = LocalDedup::new(backend.clone());
    let ttl = Duration::from_millis(30);
    let (a, b) = (Token::generate(), Token::generate());
    assert!(matches!(
        dedup.acquire(&key(), &a, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    // Paused clock: the lease's TTL passes at once, and the instant the
    // backend itself has let the lease go, the table must too.
    until_backend_expired(&backend, ttl).await;
    assert!(matches!(
        dedup.acquire(&key(), &b, TTL).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    assert_eq!(backend.acquires.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn refused_extend_forgets_and_reentrant_acquire_bypasses() {
    let backend = Counting::open();
    let dedup = LocalDedup::new(backend.clone());
    let a = Token::generate();
    dedup.acquire(&key(), &a, TTL).await.unwrap();
    // Same token again (a re-sent acquire): goes to the backend.
    assert!(matches!(
        dedup.acquire(&key(), &a, TTL).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    assert_eq!(backend.acquires.load(Ordering::SeqCst), 2);
    // The backend lost the lease behind our back: extend says so and the
    // local entry goes.
    backend.mem.try_release(&key(), &a);
    assert!(!dedup.extend(&key(), &a, TTL).await.unwrap());
    assert_eq!(dedup.table.len(), 0);
}

/// Let `ttl` pass on the paused clock: the backend's lease of `key`,
/// held until now, has then expired.
async fn until_backend_expired(backend: &Counting, ttl: Duration) {
    assert!(backend.mem.is_held(&key()), "the backend holds the lease");
    tokio::time::advance(ttl).await;
    assert!(!backend.mem.is_held(&key()), "backend lease did not expire");
}

#[tokio::test(start_paused = true)]
async fn shorter_ttl_reacquire_shortens_the_entry() {
    let backend = Counting::open();
    let dedup = LocalDedup::new(backend.clone());
    let (a, b) = (Token::generate(), Token::generate());
    dedup.acquire(&key(), &a, TTL).await.unwrap();
    // The same token again with a much shorter TTL: the lease now ends
    // sooner, and so must the local entry.
    assert!(matches!(
        dedup
            .acquire(&key(), &a, Duration::from_millis(30))
            .await
            .unwrap(),
        Acquire::Acquired { .. }
    ));
    until_backend_expired(&backend, Duration::from_millis(30)).await;
    assert!(
        matches!(
            dedup.acquire(&key(), &b, TTL).await.unwrap(),
            Acquire::Acquired { .. }
        ),
        "a second token is admitted as soon as the shorter lease expired"
    );
}

#[tokio::test(start_paused = true)]
async fn shorter_extend_shortens_the_entry() {
    let backend = Counting::open();
    let dedup = LocalDedup::new(backend.clone());
    let (a, b) = (Token::generate(), Token::generate());
    dedup.acquire(&key(), &a, TTL).await.unwrap();
    assert!(dedup
        .extend(&key(), &a, Duration::from_millis(30))
        .await
        .unwrap());
    until_backend_expired(&backend, Duration::from_millis(30)).await;
    assert!(matches!(
        dedup.acquire(&key(), &b, TTL).await.unwrap(),
        Acquire::Acquired { .. }
    ));
}
