//! In-process leases and idempotency records: [`MemoryBackend`] (every
//! inherent method here), its lease table and [`LockBackend`]; the
//! idempotency table and [`IdempotencyBackend`](super::IdempotencyBackend)
//! for it are in `records.rs`.

mod records;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::time::Instant;

use super::{Acquire, Backend, BackendFuture, LockBackend, Token};
use crate::backend::contract::Watch;
use crate::backend::expiring::{Entries, Expiring, ExpiringMap, Key};
use crate::backend::watchers::Watchers;
use crate::settings::at_most_max;

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
/// Fencing tokens ([`fencing`](crate::RedisLockLayer::fencing)) come from
/// one counter for the whole table, `max(last + 1, system clock in µs)`: they
/// strictly increase across every key for the life of the backend whatever
/// the clock does, a key keeps no fence state once its lease is gone, and a
/// new backend (a restart) starts above the fences of the one before as
/// long as the system clock did not go back meanwhile.
///
/// As the store of an [`IdempotencyLayer`](crate::IdempotencyLayer), it
/// keeps at most 100,000 claims and records and 64 MiB
/// ([`idempotency_entry_limit`](Self::idempotency_entry_limit),
/// [`idempotency_byte_limit`](Self::idempotency_byte_limit)); expired ones are swept
/// a few at a time on every claim and completion, and nothing unexpired is ever evicted: a
/// new key that finds the store full is refused with 503.
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
    leases: ExpiringMap<Entry>,
    /// The last fencing token issued, for every key.
    fence: AtomicU64,
    idempotency: records::IdempotencyTable,
    /// Keys that requests wait for: a release bumps its key's count.
    watchers: Arc<Watchers>,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            leases: ExpiringMap::new(SHARDS, SWEEP_EVERY),
            fence: AtomicU64::new(0),
            idempotency: Default::default(),
            watchers: Default::default(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    token: Token,
    expires: Instant,
    fence: Option<u64>,
}

impl Expiring for Entry {
    fn expires(&self) -> Option<Instant> {
        Some(self.expires)
    }
}

impl MemoryBackend {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Idempotency claims and records (see `records.rs`).
    pub(crate) fn idempotency_table(&self) -> &records::IdempotencyTable {
        &self.inner.idempotency
    }

    /// Synchronous acquire (the async trait method wraps this).
    pub(crate) fn try_acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> Acquire {
        self.acquire_inner(key, token, ttl, false)
    }

    /// Synchronous acquire that also issues a fencing token (see
    /// [`next_fence`](Self::next_fence)).
    pub(crate) fn try_acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> Acquire {
        self.acquire_inner(key, token, ttl, true)
    }

    fn acquire_inner(&self, key: &Bytes, token: &Token, ttl: Duration, fenced: bool) -> Acquire {
        let now = Instant::now();
        let (mut shard, key) = self.inner.leases.lock(key);
        self.acquire_locked(&mut shard, key, token, ttl, fenced, now)
    }

    fn acquire_locked(
        &self,
        shard: &mut Entries<Entry>,
        key: Key<'_>,
        token: &Token,
        ttl: Duration,
        fenced: bool,
        now: Instant,
    ) -> Acquire {
        let fence = match shard.live(key, now) {
            Some(entry) if entry.token != *token => {
                return Acquire::Held {
                    retry_after: Some(entry.expires - now),
                };
            }
            // Re-sent acquire of our own live lease: same fence as before.
            Some(entry) if entry.fence.is_some() || !fenced => entry.fence,
            _ if fenced => Some(self.next_fence()),
            _ => None,
        };
        let entry = Entry {
            token: *token,
            expires: now + at_most_max(ttl),
            fence,
        };
        shard.insert_and_sweep(key, entry, now);
        Acquire::acquired(fence)
    }

    /// A fencing token larger than every one this backend issued before, for
    /// any key: `max(last + 1, now)`, now in µs since 1970 (the unit the
    /// Redis backend uses, from the server's clock), so that a restarted
    /// process starts above the fences of the one before.
    fn next_fence(&self) -> u64 {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2));
        let mut next = 0;
        // Infallible: the closure always returns `Some`.
        let _ = self
            .inner
            .fence
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                next = last.saturating_add(1).max(now);
                Some(next)
            });
        next
    }

    /// Synchronous release; requests waiting for the key hear of it at once.
    pub(crate) fn try_release(&self, key: &Bytes, token: &Token) -> bool {
        let released = {
            let (mut shard, key) = self.inner.leases.lock(key);
            Self::release_locked(&mut shard, key, token)
        };
        if released {
            self.inner.watchers.released(key);
        }
        released
    }

    fn release_locked(shard: &mut Entries<Entry>, key: Key<'_>, token: &Token) -> bool {
        let now = Instant::now();
        match shard.get(key) {
            Some(entry) if entry.token == *token => {
                let live = entry.is_live(now);
                shard.remove(key);
                live
            }
            Some(entry) if !entry.is_live(now) => {
                shard.remove(key);
                false
            }
            _ => false,
        }
    }

    /// Synchronous extend.
    pub(crate) fn try_extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> bool {
        let now = Instant::now();
        let (mut shard, key) = self.inner.leases.lock(key);
        match shard.live_mut(key, now) {
            Some(entry) if entry.token == *token => {
                entry.expires = now + at_most_max(ttl);
                true
            }
            _ => false,
        }
    }

    /// Most idempotency entries (in-flight claims and completed records)
    /// this backend keeps for [`IdempotencyLayer`](crate::IdempotencyLayer)
    /// (default 100,000). Clones of the backend share the store and its
    /// limits.
    ///
    /// No unexpired entry is ever evicted to make room: evicting a record
    /// would let its retry run again, and would let one client's flood
    /// undo another client's payment. When a new claim would exceed the
    /// limit after expired entries are removed, the request is refused with
    /// 503 and `Retry-After`, and its handler does not run. Each scope
    /// (identity and route) holds at most its
    /// [`scope_quota`](crate::IdempotencyLayer::scope_quota), so one client
    /// fills at most that share (its bytes checked when a claim is made: the
    /// records of its claims in flight may pass it). Size the limit as
    /// scopes × quota, or as requests per retention window.
    ///
    /// ```
    /// use tower_redis_lock::MemoryBackend;
    /// let backend = MemoryBackend::new().idempotency_entry_limit(10_000);
    /// # let _ = backend;
    /// ```
    pub fn idempotency_entry_limit(self, limit: usize) -> Self {
        self.idempotency_table().set_limits(Some(limit), None);
        self
    }

    /// Most bytes of idempotency entries this backend keeps (default
    /// 64 MiB), counted as each entry's storage key, fingerprint and
    /// recorded response (status, stored headers, body) plus 320 bytes of
    /// bookkeeping, which follows the memory the process really uses. Like
    /// [`idempotency_entry_limit`](Self::idempotency_entry_limit), a new claim past
    /// it is refused (503), never made room for by evicting a record; a
    /// record is always written once its handler ran, so the count may
    /// pass the limit by the records of the claims in flight.
    ///
    /// ```
    /// use tower_redis_lock::MemoryBackend;
    /// let backend = MemoryBackend::new().idempotency_byte_limit(16 * 1024 * 1024);
    /// # let _ = backend;
    /// ```
    pub fn idempotency_byte_limit(self, limit: usize) -> Self {
        self.idempotency_table().set_limits(None, Some(limit));
        self
    }

    /// Number of idempotency entries (claims and records) stored, live or
    /// not yet swept.
    #[cfg(test)]
    pub(crate) fn idempotency_entries(&self) -> usize {
        self.idempotency_table().len()
    }

    /// Number of entries currently stored (live or not yet swept).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.leases.len()
    }

    /// `true` when no entry is stored.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `key` is held by a live lease right now.
    #[cfg(test)]
    pub(crate) fn is_held(&self, key: &Bytes) -> bool {
        let (shard, key) = self.inner.leases.lock(key);
        shard.live(key, Instant::now()).is_some()
    }
}

impl Backend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn is_in_process(&self) -> bool {
        true
    }

    /// Nothing to wait for: every call is answered in the call.
    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

impl LockBackend for MemoryBackend {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        let out = self.try_acquire(key, token, ttl);
        BackendFuture::ready(Ok(out))
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        let out = self.try_acquire_fenced(key, token, ttl);
        BackendFuture::ready(Ok(out))
    }

    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        let out = self.try_release(key, token);
        BackendFuture::ready(Ok(out))
    }

    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        let out = self.try_extend(key, token, ttl);
        BackendFuture::ready(Ok(out))
    }

    /// Releases through this backend are heard in the call by requests
    /// waiting for the key.
    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.release(key, token)
    }

    /// Releases through this backend (any clone) are heard at once, in the
    /// call; an expired lease is not a release (waiters wake at its expiry).
    fn watch(&self, key: &Bytes) -> Option<BackendFuture<Watch>> {
        let (watch, _) = self.inner.watchers.watch(key);
        Some(BackendFuture::ready(Ok(watch)))
    }

    fn native_calls(&self) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests;
