//! In-process leases.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Acquire, BackendFuture, LockBackend, Token};

const SHARDS: usize = 32;
/// A shard is swept of expired entries after this many writes once it holds
/// more than this many entries, so memory stays proportional to live leases.
const SWEEP_EVERY: usize = 1024;

/// Leases in this process's memory: the backend for single-instance services
/// and for tests. Same contract as [`RedisBackend`](crate::RedisBackend):
/// expiring entries, re-entrant acquire, compare-and-delete release.
///
/// Cloning shares the table. Expired entries are dropped lazily and by a
/// periodic sweep, so memory is bounded by the number of live leases.
///
/// As the store of an [`IdempotencyLayer`](crate::IdempotencyLayer), it
/// keeps at most 100,000 claims and records and 64 MiB
/// ([`replay_entry_limit`](Self::replay_entry_limit),
/// [`replay_byte_limit`](Self::replay_byte_limit), which say what is
/// evicted first); expired ones are swept a few at a time on every write.
///
/// ```
/// use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
/// let layer = RedisLockLayer::new(MemoryBackend::new(), Route);
/// # let _ = layer;
/// ```
#[derive(Clone, Debug, Default)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    hasher: RandomState,
    shards: Box<[Mutex<Shard>]>,
    replay: crate::replay::memory::ReplayTable,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            replay: Default::default(),
        }
    }
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<Bytes, Entry>,
    // Fencing counters: kept after release and expiry so they only grow.
    fences: HashMap<Bytes, u64>,
    writes: usize,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    token: Token,
    expires: Instant,
    fence: Option<u64>,
}

impl Shard {
    fn after_write(&mut self, now: Instant) {
        self.writes += 1;
        if self.writes >= SWEEP_EVERY {
            self.writes = 0;
            if self.map.len() > SWEEP_EVERY {
                self.map.retain(|_, e| e.expires > now);
            }
        }
    }
}

impl MemoryBackend {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    fn shard(&self, key: &[u8]) -> MutexGuard<'_, Shard> {
        let idx = (self.inner.hasher.hash_one(key) as usize) % SHARDS;
        // A poisoned shard only means another thread panicked while holding
        // it; the map itself is always left consistent, so keep going.
        self.inner.shards[idx]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Idempotency claims and records (see `replay::memory`).
    pub(crate) fn replay_table(&self) -> &crate::replay::memory::ReplayTable {
        &self.inner.replay
    }

    /// Synchronous acquire (the async trait method wraps this).
    pub(crate) fn try_acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> Acquire {
        self.acquire_inner(key, token, ttl, false)
    }

    /// Synchronous acquire that also issues a fencing token (a per-key
    /// counter that only grows; kept for the life of the backend).
    pub(crate) fn try_acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> Acquire {
        self.acquire_inner(key, token, ttl, true)
    }

    fn acquire_inner(&self, key: &Bytes, token: &Token, ttl: Duration, fenced: bool) -> Acquire {
        let now = Instant::now();
        let mut shard = self.shard(key);
        let expires = now + ttl;
        let fence = match shard.map.get(key) {
            Some(entry) if entry.expires > now && entry.token != *token => {
                return Acquire::Held {
                    retry_after: Some(entry.expires - now),
                };
            }
            // Re-sent acquire of our own live lease: same fence as before.
            Some(entry) if entry.expires > now && (entry.fence.is_some() || !fenced) => entry.fence,
            _ if fenced => {
                let counter = shard.fences.entry(key.clone()).or_insert(0);
                *counter += 1;
                Some(*counter)
            }
            _ => None,
        };
        shard.map.insert(
            key.clone(),
            Entry {
                token: *token,
                expires,
                fence,
            },
        );
        shard.after_write(now);
        Acquire::acquired(fence)
    }

    /// Synchronous release.
    pub(crate) fn try_release(&self, key: &Bytes, token: &Token) -> bool {
        let now = Instant::now();
        let mut shard = self.shard(key);
        match shard.map.get(key) {
            Some(entry) if entry.token == *token => {
                let live = entry.expires > now;
                shard.map.remove(key);
                live
            }
            Some(entry) if entry.expires <= now => {
                shard.map.remove(key);
                false
            }
            _ => false,
        }
    }

    /// Synchronous extend.
    pub(crate) fn try_extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> bool {
        let now = Instant::now();
        let mut shard = self.shard(key);
        match shard.map.get_mut(key) {
            Some(entry) if entry.token == *token && entry.expires > now => {
                entry.expires = now + ttl;
                true
            }
            _ => false,
        }
    }

    /// Number of entries currently stored (live or not yet swept).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).map.len())
            .sum()
    }

    /// `true` when no entry is stored.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `key` is held by a live lease right now.
    #[cfg(test)]
    pub(crate) fn is_held(&self, key: &[u8]) -> bool {
        let now = Instant::now();
        self.shard(key)
            .map
            .get(key)
            .is_some_and(|e| e.expires > now)
    }
}

impl LockBackend for MemoryBackend {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        let out = self.try_acquire(key, token, ttl);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        let out = self.try_acquire_fenced(key, token, ttl);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        let out = self.try_release(key, token);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        let out = self.try_extend(key, token, ttl);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    fn is_in_process(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(5);

    #[test]
    fn exclusive_reentrant_and_owner_only_release() {
        let b = MemoryBackend::new();
        let key = Bytes::from_static(b"k");
        let (a, other) = (Token::generate(), Token::generate());
        assert_eq!(b.try_acquire(&key, &a, TTL), Acquire::acquired(None));
        // Re-sent acquire with our own token: still ours.
        assert_eq!(b.try_acquire(&key, &a, TTL), Acquire::acquired(None));
        match b.try_acquire(&key, &other, TTL) {
            Acquire::Held {
                retry_after: Some(d),
            } => assert!(d <= TTL && d > Duration::from_secs(4)),
            x => panic!("expected held, got {x:?}"),
        }
        assert!(!b.try_release(&key, &other), "a stranger cannot release");
        assert!(b.is_held(&key));
        assert!(b.try_release(&key, &a));
        assert!(!b.is_held(&key));
        assert!(b.is_empty());
    }

    #[test]
    fn expiry_frees_the_key() {
        let b = MemoryBackend::new();
        let key = Bytes::from_static(b"k");
        let (a, other) = (Token::generate(), Token::generate());
        b.try_acquire(&key, &a, Duration::ZERO);
        assert_eq!(b.try_acquire(&key, &other, TTL), Acquire::acquired(None));
        assert!(!b.try_extend(&key, &a, TTL), "expired owner cannot extend");
        assert!(b.try_extend(&key, &other, TTL));
    }

    #[test]
    fn fences_only_grow_and_survive_release() {
        let b = MemoryBackend::new();
        let key = Bytes::from_static(b"k");
        let (a, other) = (Token::generate(), Token::generate());
        let fence = |x| match x {
            Acquire::Acquired { fence, .. } => fence,
            held => panic!("expected acquired, got {held:?}"),
        };
        assert_eq!(fence(b.try_acquire_fenced(&key, &a, TTL)), Some(1));
        // Re-sent acquire: the same fence, not a new one.
        assert_eq!(fence(b.try_acquire_fenced(&key, &a, TTL)), Some(1));
        assert!(b.try_release(&key, &a));
        assert_eq!(fence(b.try_acquire_fenced(&key, &other, TTL)), Some(2));
        // Expired and taken over: still growing.
        b.try_acquire_fenced(&key, &other, Duration::ZERO);
        assert_eq!(fence(b.try_acquire_fenced(&key, &a, TTL)), Some(3));
        assert_eq!(
            fence(b.try_acquire_fenced(&Bytes::from_static(b"other"), &a, TTL)),
            Some(1)
        );
    }

    #[test]
    fn sweep_bounds_memory() {
        let b = MemoryBackend::new();
        let t = Token::generate();
        for i in 0..(SHARDS * SWEEP_EVERY * 3) {
            let key = Bytes::from(format!("k{i}"));
            b.try_acquire(&key, &t, Duration::ZERO);
        }
        // Every shard swept at least once after passing the threshold.
        assert!(b.len() <= SHARDS * SWEEP_EVERY * 2, "len {}", b.len());
    }
}
