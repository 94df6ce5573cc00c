//! Keys hashed once per call for the sharded in-process tables (the local
//! in-flight table, `MemoryBackend`): the hash picks the shard and is reused
//! by the shard's map instead of hashing the key again.

use std::hash::{BuildHasher, Hash, Hasher, RandomState};

use bytes::Bytes;

/// A key with its hash, computed once per call (keyed SipHash, the table's
/// `RandomState`) and used both to pick the shard and inside the shard's
/// map ([`PreHashed`]).
#[derive(Debug, Clone)]
pub(crate) struct SlotKey {
    hash: u64,
    key: Bytes,
}

impl SlotKey {
    /// `key` hashed by `hasher`.
    pub(crate) fn new(hasher: &RandomState, key: &Bytes) -> Self {
        Self {
            hash: hasher.hash_one(key.as_ref()),
            key: key.clone(),
        }
    }

    /// Which of `shards` holds the key: bits the map uses neither for its
    /// bucket index (low bits) nor its tag (top 7 bits), so a shard's keys
    /// still spread in its map.
    pub(crate) fn shard(&self, shards: usize) -> usize {
        ((self.hash >> 32) as usize) % shards
    }
}

impl PartialEq for SlotKey {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.key == other.key
    }
}

impl Eq for SlotKey {}

impl Hash for SlotKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// The map's hasher: passes a [`SlotKey`]'s hash through.
#[derive(Default)]
pub(crate) struct PreHashed(u64);

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::hash::BuildHasherDefault;

    #[test]
    fn keys_are_found_by_content_even_when_hashes_collide() {
        let hasher = RandomState::new();
        let mut map: HashMap<SlotKey, u32, BuildHasherDefault<PreHashed>> = HashMap::default();
        for i in 0..1000u32 {
            map.insert(SlotKey::new(&hasher, &Bytes::from(format!("k{i}"))), i);
        }
        for i in 0..1000u32 {
            let key = SlotKey::new(&hasher, &Bytes::from(format!("k{i}")));
            assert_eq!(map.get(&key), Some(&i));
            assert!(key.shard(32) < 32);
        }
        // Same hash, other bytes: a different key.
        let a = SlotKey::new(&hasher, &Bytes::from_static(b"a"));
        let forged = SlotKey {
            hash: a.hash,
            key: Bytes::from_static(b"b"),
        };
        map.insert(a.clone(), 1);
        map.insert(forged.clone(), 2);
        assert_eq!((map.get(&a), map.get(&forged)), (Some(&1), Some(&2)));
    }
}
