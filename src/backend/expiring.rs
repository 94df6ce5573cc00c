//! One sharded expiring map, under the crate's three in-process tables: the
//! leases of `MemoryBackend`, the local in-flight table of `RedisBackend`
//! and the idempotency claims and records of `MemoryBackend`.
//!
//! What they share lives here: entries that expire at a tokio [`Instant`],
//! a key hashed once per call (keyed SipHash) whose hash picks the shard
//! and is reused inside the shard's map, lookups that borrow the caller's
//! key (only an insert of a new key clones it), "get if live", and an
//! amortised sweep of expired entries. What each table keeps beside its
//! entries (fences, waiters, expiry indexes, scope quotas, byte counts)
//! stays in the table.
//!
//! A table with whole-table bookkeeping (the idempotency table) uses one
//! [`Entries`] behind its own lock and turns the sweep off: it removes
//! expired entries itself, a bounded number per write, in expiry order.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher, RandomState};
use std::sync::{Mutex, MutexGuard};

use bytes::Bytes;
use tokio::time::Instant;

/// An entry that expires.
pub(crate) trait Expiring {
    /// When the entry stops being live; `None` for one that does not expire
    /// by time (a pending acquire: it is removed by whoever added it).
    fn expires(&self) -> Option<Instant>;

    /// Whether the entry is still live at `now`.
    fn is_live(&self, now: Instant) -> bool {
        self.expires().is_none_or(|at| at > now)
    }
}

/// A key and its hash, computed once per call by [`ExpiringMap::key`] or
/// [`Entries::key`]; borrows the caller's bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Key<'a> {
    hash: u64,
    bytes: &'a Bytes,
}

impl Key<'_> {
    /// The key's hash, for [`ExpiringMap::key_hashed`].
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // the Redis store's local table
    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }
}

/// A key as the map stores it: the bytes and their hash.
#[derive(Debug)]
struct Stored {
    hash: u64,
    bytes: Bytes,
}

/// What stored and borrowed keys have in common, so that a lookup borrows
/// the caller's key instead of cloning it (`Stored: Borrow<dyn AsKey>`).
trait AsKey {
    fn hash(&self) -> u64;
    fn bytes(&self) -> &[u8];
}

impl AsKey for Stored {
    fn hash(&self) -> u64 {
        self.hash
    }
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl AsKey for Key<'_> {
    fn hash(&self) -> u64 {
        self.hash
    }
    fn bytes(&self) -> &[u8] {
        self.bytes
    }
}

impl<'a> Borrow<dyn AsKey + 'a> for Stored {
    fn borrow(&self) -> &(dyn AsKey + 'a) {
        self
    }
}

impl Hash for dyn AsKey + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(AsKey::hash(self));
    }
}

impl PartialEq for dyn AsKey + '_ {
    fn eq(&self, other: &Self) -> bool {
        AsKey::hash(self) == AsKey::hash(other) && self.bytes() == other.bytes()
    }
}

impl Eq for dyn AsKey + '_ {}

// `Stored` hashes and compares exactly as its `dyn AsKey` form does, as
// `Borrow` requires.
impl Hash for Stored {
    fn hash<H: Hasher>(&self, state: &mut H) {
        Hash::hash(self as &dyn AsKey, state);
    }
}

impl PartialEq for Stored {
    fn eq(&self, other: &Self) -> bool {
        (self as &dyn AsKey) == (other as &dyn AsKey)
    }
}

impl Eq for Stored {}

/// The shard maps' hasher: passes a key's precomputed hash through.
#[derive(Default)]
struct PreHashed(u64);

impl Hasher for PreHashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used; fold anything else in.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Room a shard keeps whatever it holds (see [`Entries::fit`]).
const MIN_ROOM: usize = 64;

/// One shard: entries by key, and the write count that paces the sweep.
#[derive(Debug)]
pub(crate) struct Entries<V> {
    hasher: RandomState,
    map: HashMap<Stored, V, BuildHasherDefault<PreHashed>>,
    writes: usize,
    /// Sweep every this many inserts once more entries than this are kept;
    /// `None`: never (the table sweeps itself).
    sweep_every: Option<usize>,
}

impl<V: Expiring> Entries<V> {
    /// An empty shard hashing with `hasher`.
    pub(crate) fn new(hasher: RandomState, sweep_every: Option<usize>) -> Self {
        Self {
            hasher,
            map: HashMap::default(),
            writes: 0,
            sweep_every,
        }
    }

    /// `bytes` hashed once, for every call on this shard.
    pub(crate) fn key<'a>(&self, bytes: &'a Bytes) -> Key<'a> {
        hash_key(&self.hasher, bytes)
    }

    /// The entry under `key`, live or not.
    pub(crate) fn get(&self, key: Key<'_>) -> Option<&V> {
        self.map.get(&key as &dyn AsKey)
    }

    /// The entry under `key`, live or not, to change in place.
    pub(crate) fn get_mut(&mut self, key: Key<'_>) -> Option<&mut V> {
        self.map.get_mut(&key as &dyn AsKey)
    }

    /// The entry under `key` if it is live at `now`.
    pub(crate) fn live(&self, key: Key<'_>, now: Instant) -> Option<&V> {
        self.get(key).filter(|v| v.is_live(now))
    }

    /// The entry under `key` if it is live at `now`, to change in place.
    pub(crate) fn live_mut(&mut self, key: Key<'_>, now: Instant) -> Option<&mut V> {
        self.get_mut(key).filter(|v| v.is_live(now))
    }

    /// Put `value` under `key`, replacing what was there; the key is cloned
    /// only when new.
    pub(crate) fn insert(&mut self, key: Key<'_>, value: V) {
        match self.map.get_mut(&key as &dyn AsKey) {
            Some(slot) => *slot = value,
            None => {
                let stored = Stored {
                    hash: key.hash,
                    bytes: key.bytes.clone(),
                };
                self.map.insert(stored, value);
            }
        }
    }

    /// [`insert`](Self::insert), then sweep if one is due at `now`.
    pub(crate) fn insert_and_sweep(&mut self, key: Key<'_>, value: V, now: Instant) {
        self.insert(key, value);
        self.after_write(now);
    }

    /// Remove and return the entry under `key`.
    pub(crate) fn remove(&mut self, key: Key<'_>) -> Option<V> {
        let removed = self.map.remove(&key as &dyn AsKey);
        self.fit();
        removed
    }

    /// Give memory back once the shard holds far fewer entries than it has
    /// room for (a burst of keys gone): a `HashMap` keeps its room
    /// otherwise. At most twice the entries (or a small floor) are kept
    /// room for, and a shrink comes only after the entries fell to a
    /// quarter of the room, so its cost is spread over those removals.
    fn fit(&mut self) {
        let floor = self.sweep_every.unwrap_or(0).max(MIN_ROOM);
        let wanted = self.map.len().max(floor);
        if self.map.capacity() > 4 * wanted {
            self.map.shrink_to(2 * wanted);
        }
    }

    /// Entries stored, live or not yet swept.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Count a write; every `sweep_every` writes, once the shard holds more
    /// than that many entries, drop the expired ones (amortised: one pass
    /// per `sweep_every` writes, so memory follows the live entries).
    fn after_write(&mut self, now: Instant) {
        let Some(every) = self.sweep_every else {
            return;
        };
        self.writes += 1;
        if self.writes >= every {
            self.writes = 0;
            if self.map.len() > every {
                self.map.retain(|_, v| v.is_live(now));
                self.fit();
            }
        }
    }
}

fn hash_key<'a>(hasher: &RandomState, bytes: &'a Bytes) -> Key<'a> {
    Key {
        hash: hasher.hash_one(bytes.as_ref()),
        bytes,
    }
}

/// Entries spread over shards, each behind its own lock, picked by the
/// key's hash.
#[derive(Debug)]
pub(crate) struct ExpiringMap<V> {
    hasher: RandomState,
    shards: Box<[Mutex<Entries<V>>]>,
}

impl<V: Expiring> ExpiringMap<V> {
    /// `shards` empty shards, each swept every `sweep_every` writes once it
    /// holds more than that many entries.
    pub(crate) fn new(shards: usize, sweep_every: usize) -> Self {
        let hasher = RandomState::new();
        Self {
            shards: (0..shards.max(1))
                .map(|_| Mutex::new(Entries::new(hasher.clone(), Some(sweep_every))))
                .collect(),
            hasher,
        }
    }

    /// `bytes` hashed once: the hash picks the shard and finds the entry.
    pub(crate) fn key<'a>(&self, bytes: &'a Bytes) -> Key<'a> {
        hash_key(&self.hasher, bytes)
    }

    /// `bytes` with the hash an earlier [`key`](Self::key) of the same
    /// bytes gave ([`Key::hash`]): a call that comes back to a key it
    /// looked up hashes it once.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // the Redis store's local table
    pub(crate) fn key_hashed<'a>(&self, bytes: &'a Bytes, hash: u64) -> Key<'a> {
        debug_assert_eq!(hash, self.key(bytes).hash, "a hash of other bytes");
        Key { hash, bytes }
    }

    /// The shard that holds `key`, locked.
    pub(crate) fn shard(&self, key: Key<'_>) -> MutexGuard<'_, Entries<V>> {
        // Bits the shard's map uses neither for its bucket index (low bits)
        // nor its tag (top 7 bits), so a shard's keys still spread in it.
        let idx = ((key.hash >> 32) as usize) % self.shards.len();
        lock(&self.shards[idx])
    }

    /// `bytes` hashed once and its shard, locked.
    pub(crate) fn lock<'a>(&self, bytes: &'a Bytes) -> (MutexGuard<'_, Entries<V>>, Key<'a>) {
        let key = self.key(bytes);
        (self.shard(key), key)
    }

    /// Entries stored over all shards, live or not yet swept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }
}

/// Lock a shard. A poisoned lock only means another thread panicked while
/// holding it; every shard is consistent after each statement, so go on.
fn lock<V>(shard: &Mutex<Entries<V>>) -> MutexGuard<'_, Entries<V>> {
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests;
