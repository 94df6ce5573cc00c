//! [`ReplayStore`] for [`MemoryBackend`]: claims and records in this
//! process's memory, shared by clones of the backend, bounded in entries
//! and bytes.
//!
//! One map from storage key to entry, and two indexes ordered by expiry
//! (claims, records). Every write first removes a bounded number of
//! expired entries from the front of each index (never a pass over the
//! map), then, when the new entry would cross a limit, evicts: expired
//! entries first, then the records closest to their expiry. Claims are
//! never evicted: when only claims are left, a new claim is refused (the
//! layer answers 503).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::record::{NotStoredReason, Record};
use super::store::{Claim, ReplayStore};
use crate::backend::{BackendError, BackendFuture, Token};
use crate::MemoryBackend;

/// Default most entries (claims and records) kept: 100,000.
pub(crate) const DEFAULT_ENTRY_LIMIT: usize = 100_000;
/// Default most bytes kept: 64 MiB.
pub(crate) const DEFAULT_BYTE_LIMIT: usize = 64 * 1024 * 1024;
/// Expired entries removed from the front of each index per write, at most:
/// more than the one entry a write adds, so a backlog drains while writes
/// go on, and a write never pays for more than this.
const SWEEP_BATCH: usize = 8;
/// Bytes counted per entry beyond its key, fingerprint and encoded record:
/// the map slot (with the map's spare capacity), the index node and the
/// allocations' own headers, so the count follows the resident memory
/// (measured with `benches/replay_memory.rs`: about 600 bytes of RSS per
/// entry for a 201 with a 100-byte JSON body and two stored headers).
const ENTRY_OVERHEAD: usize = 320;

/// The table behind [`MemoryBackend`]'s [`ReplayStore`] implementation.
#[derive(Debug, Default)]
pub(crate) struct ReplayTable {
    inner: Mutex<Table>,
}

/// Where an entry sits in its index: its expiry, and a sequence number
/// that makes equal expiries distinct (and orders them by age).
type Slot = (Instant, u64);

#[derive(Debug)]
struct Table {
    map: HashMap<Bytes, Entry>,
    /// In-flight claims by expiry.
    claims: BTreeMap<Slot, Bytes>,
    /// Completed records by expiry: the front is the next to expire, and
    /// the first evicted.
    records: BTreeMap<Slot, Bytes>,
    /// Bytes counted over all entries (see [`entry_size`]).
    bytes: usize,
    seq: u64,
    entry_limit: usize,
    byte_limit: usize,
    /// Unexpired records evicted since the last warning, and when that was.
    evicted: u64,
    warned: Option<Instant>,
}

impl Default for Table {
    fn default() -> Self {
        Self {
            map: HashMap::new(),
            claims: BTreeMap::new(),
            records: BTreeMap::new(),
            bytes: 0,
            seq: 0,
            entry_limit: DEFAULT_ENTRY_LIMIT,
            byte_limit: DEFAULT_BYTE_LIMIT,
            evicted: 0,
            warned: None,
        }
    }
}

#[derive(Debug)]
struct Entry {
    token: Token,
    fingerprint: Box<[u8]>,
    /// The encoded [`Record`] once the request completed: one allocation
    /// of known size, decoded on replay.
    record: Option<Bytes>,
    slot: Slot,
    size: usize,
}

/// A new claim found the store full of in-flight claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full {
    entry_limit: usize,
    byte_limit: usize,
}

impl Full {
    fn into_error(self) -> BackendError {
        BackendError::new(format!(
            "the memory idempotency store is full of in-flight claims \
             (limits: {} entries, {} bytes); no claim is evicted, so new keys \
             are refused until one completes",
            self.entry_limit, self.byte_limit
        ))
    }
}

/// Bytes counted for an entry: its storage key (shared by the map and the
/// index), fingerprint and encoded record, plus [`ENTRY_OVERHEAD`].
fn entry_size(key: usize, fingerprint: usize, record: usize) -> usize {
    ENTRY_OVERHEAD + key + fingerprint + record
}

/// Time between two warnings about evicted unexpired records.
const WARN_EVERY: Duration = Duration::from_secs(60);

impl Table {
    fn next_slot(&mut self, expires: Instant) -> Slot {
        self.seq += 1;
        (expires, self.seq)
    }

    /// Remove `key`'s entry and its index slot.
    fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let e = self.map.remove(key)?;
        let index = match e.record {
            Some(_) => &mut self.records,
            None => &mut self.claims,
        };
        index.remove(&e.slot);
        self.bytes -= e.size;
        Some(e)
    }

    /// Pop the front of the claims (`records == false`) or records index
    /// if it expired by `now` (or unconditionally with `live`).
    fn pop_front(&mut self, records: bool, now: Instant, live: bool) -> bool {
        let index = if records {
            &mut self.records
        } else {
            &mut self.claims
        };
        let Some(entry) = index.first_entry() else {
            return false;
        };
        if !live && entry.key().0 > now {
            return false;
        }
        let key = entry.remove();
        if let Some(e) = self.map.remove(&key) {
            self.bytes -= e.size;
        }
        true
    }

    /// Remove up to [`SWEEP_BATCH`] expired entries from each index.
    fn sweep(&mut self, now: Instant) {
        for records in [false, true] {
            for _ in 0..SWEEP_BATCH {
                if !self.pop_front(records, now, false) {
                    break;
                }
            }
        }
    }

    fn over(&self, entries: usize, bytes: usize) -> bool {
        self.map.len() + entries > self.entry_limit || self.bytes + bytes > self.byte_limit
    }

    /// Evict until `entries` more entries and `bytes` more bytes fit:
    /// expired entries first, then the records closest to their expiry.
    /// `false` if only claims are left and it still does not fit.
    fn make_room(&mut self, entries: usize, bytes: usize, now: Instant) -> bool {
        while self.over(entries, bytes) {
            if self.pop_front(false, now, false) || self.pop_front(true, now, false) {
                continue;
            }
            if !self.pop_front(true, now, true) {
                return false;
            }
            self.evicted += 1;
        }
        if self.evicted > 0 && self.warned.is_none_or(|at| now >= at + WARN_EVERY) {
            tracing::warn!(
                evicted = self.evicted,
                entries = self.map.len(),
                bytes = self.bytes,
                "the memory idempotency store is full: evicted the oldest unexpired records, \
                 so a retry with one of their keys runs again; raise \
                 MemoryBackend::replay_entry_limit / replay_byte_limit, or use Redis"
            );
            self.evicted = 0;
            self.warned = Some(now);
        }
        true
    }
}

impl ReplayTable {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // The map is consistent after every statement; poisoning only means
        // another thread panicked elsewhere while holding the lock.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn claim(
        &self,
        key: &Bytes,
        token: &Token,
        fp: &[u8],
        lease: Duration,
    ) -> Result<Claim, Full> {
        self.claim_at(key, token, fp, lease, Instant::now())
    }

    fn claim_at(
        &self,
        key: &Bytes,
        token: &Token,
        fp: &[u8],
        lease: Duration,
        now: Instant,
    ) -> Result<Claim, Full> {
        let mut t = self.lock();
        t.sweep(now);
        if let Some(e) = t.map.get(key).filter(|e| e.slot.0 > now) {
            if *e.fingerprint != *fp {
                return Ok(Claim::Mismatch);
            }
            if let Some(record) = &e.record {
                // Our own encoding: it always decodes.
                return Ok(Record::decode(record.clone())
                    .map_or(Claim::InFlight { retry_after: None }, Claim::Done));
            }
            if e.token != *token {
                return Ok(Claim::InFlight {
                    retry_after: Some(e.slot.0 - now),
                });
            }
            // A re-sent claim of our own: extend it.
            let old = e.slot;
            let slot = t.next_slot(now + lease);
            t.claims.remove(&old);
            t.claims.insert(slot, key.clone());
            t.map.get_mut(key).expect("just found").slot = slot;
            return Ok(Claim::Claimed);
        }
        // Free (absent or expired): a new claim.
        t.remove(key);
        let size = entry_size(key.len(), fp.len(), 0);
        if !t.make_room(1, size, now) {
            return Err(Full {
                entry_limit: t.entry_limit,
                byte_limit: t.byte_limit,
            });
        }
        let slot = t.next_slot(now + lease);
        t.claims.insert(slot, key.clone());
        t.map.insert(
            key.clone(),
            Entry {
                token: *token,
                fingerprint: fp.into(),
                record: None,
                slot,
                size,
            },
        );
        t.bytes += size;
        Ok(Claim::Claimed)
    }

    pub(crate) fn complete(
        &self,
        key: &Bytes,
        token: &Token,
        record: &Record,
        retention: Duration,
    ) -> bool {
        self.complete_at(key, token, record, retention, Instant::now())
    }

    fn complete_at(
        &self,
        key: &Bytes,
        token: &Token,
        record: &Record,
        retention: Duration,
        now: Instant,
    ) -> bool {
        let mut t = self.lock();
        t.sweep(now);
        let (old_slot, old_size, fp_len) = match t.map.get(key) {
            Some(e) if e.token == *token && e.slot.0 > now => {
                if e.record.is_some() {
                    return true; // a re-sent completion
                }
                (e.slot, e.size, e.fingerprint.len())
            }
            _ => return false,
        };
        let mut encoded = Bytes::copy_from_slice(&record.encode());
        let mut size = entry_size(key.len(), fp_len, encoded.len());
        if size > t.byte_limit {
            // Larger than the whole store: keep that it ran, not its answer.
            let status = match record {
                Record::Response(r) => r.status,
                Record::NotStored { status, .. } => *status,
            };
            encoded = Record::NotStored {
                status,
                reason: NotStoredReason::TooLarge,
            }
            .encode();
            size = entry_size(key.len(), fp_len, encoded.len());
        }
        t.claims.remove(&old_slot);
        let slot = t.next_slot(now + retention);
        t.records.insert(slot, key.clone());
        let e = t.map.get_mut(key).expect("just found");
        e.record = Some(encoded);
        e.slot = slot;
        e.size = size;
        t.bytes = t.bytes - old_size + size;
        // The entry count is unchanged; the bytes may now be over the limit.
        t.make_room(0, 0, now);
        true
    }

    pub(crate) fn extend(&self, key: &Bytes, token: &Token, lease: Duration) -> bool {
        let now = Instant::now();
        let mut t = self.lock();
        let old = match t.map.get(key) {
            Some(e) if e.token == *token && e.record.is_none() && e.slot.0 > now => e.slot,
            _ => return false,
        };
        // Move the claim in the claims index, as a re-sent claim does.
        t.claims.remove(&old);
        let slot = t.next_slot(now + lease);
        t.claims.insert(slot, key.clone());
        t.map.get_mut(key).expect("just found").slot = slot;
        true
    }

    pub(crate) fn abandon(&self, key: &Bytes, token: &Token) -> bool {
        let now = Instant::now();
        let mut t = self.lock();
        match t.map.get(key) {
            Some(e) if e.token == *token && e.record.is_none() => {
                let live = e.slot.0 > now;
                t.remove(key);
                live
            }
            _ => false,
        }
    }

    fn set_limits(&self, entries: Option<usize>, bytes: Option<usize>) {
        let mut t = self.lock();
        if let Some(n) = entries {
            t.entry_limit = n;
        }
        if let Some(n) = bytes {
            t.byte_limit = n;
        }
    }

    /// Entries stored (live or not yet swept).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().map.len()
    }
}

impl MemoryBackend {
    /// Most idempotency entries (in-flight claims and completed records)
    /// this backend keeps for [`IdempotencyLayer`](crate::IdempotencyLayer)
    /// (default 100,000). Clones of the backend share the store and its
    /// limits.
    ///
    /// When a new claim would exceed it, the store evicts expired entries
    /// first, then the completed records closest to their expiry (with one
    /// retention for every layer, the oldest). An evicted record is gone:
    /// a retry with its key runs the handler again, as after its retention
    /// (a WARN, at most once a minute, says so). In-flight claims are never
    /// evicted: when only claims are left, the new request is refused with
    /// 503 and `Retry-After`, and its handler does not run.
    ///
    /// ```
    /// use tower_redis_lock::MemoryBackend;
    /// let backend = MemoryBackend::new().replay_entry_limit(10_000);
    /// # let _ = backend;
    /// ```
    pub fn replay_entry_limit(self, limit: usize) -> Self {
        self.replay_table().set_limits(Some(limit), None);
        self
    }

    /// Most bytes of idempotency entries this backend keeps (default
    /// 64 MiB), counted as each entry's storage key, fingerprint and
    /// recorded response (status, stored headers, body) plus 320 bytes of
    /// bookkeeping, which follows the memory the process really uses; evicted in the order of
    /// [`replay_entry_limit`](Self::replay_entry_limit). A response larger
    /// than the whole limit is recorded as "not stored" (retries get
    /// `Rejection::NotStored`, never a second execution).
    ///
    /// ```
    /// use tower_redis_lock::MemoryBackend;
    /// let backend = MemoryBackend::new().replay_byte_limit(16 * 1024 * 1024);
    /// # let _ = backend;
    /// ```
    pub fn replay_byte_limit(self, limit: usize) -> Self {
        self.replay_table().set_limits(None, Some(limit));
        self
    }

    /// Number of idempotency entries (claims and records) stored, live or
    /// not yet swept.
    #[cfg(test)]
    pub(crate) fn idempotency_entries(&self) -> usize {
        self.replay_table().len()
    }
}

impl ReplayStore for MemoryBackend {
    fn claim(
        &self,
        key: &Bytes,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
    ) -> BackendFuture<Claim> {
        let out = self
            .replay_table()
            .claim(key, token, fingerprint, lease)
            .map_err(Full::into_error);
        Box::pin(std::future::ready(out))
    }

    fn complete(
        &self,
        key: &Bytes,
        token: &Token,
        record: &Record,
        retention: Duration,
    ) -> BackendFuture<bool> {
        let out = self.replay_table().complete(key, token, record, retention);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn extend(&self, key: &Bytes, token: &Token, lease: Duration) -> BackendFuture<bool> {
        let out = self.replay_table().extend(key, token, lease);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn abandon(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        let out = self.replay_table().abandon(key, token);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn is_in_process(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    const LEASE: Duration = Duration::from_secs(5);

    fn done() -> Record {
        Record::NotStored {
            status: http::StatusCode::OK,
            reason: NotStoredReason::Streaming,
        }
    }

    /// A 201 with a body of `len` bytes.
    fn response(len: usize) -> Record {
        Record::Response(super::super::record::StoredResponse {
            status: StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: Bytes::from(vec![b'x'; len]),
        })
    }

    fn key(i: usize) -> Bytes {
        Bytes::from(format!("trl:{{{i:064x}}}:idem"))
    }

    #[test]
    fn claim_conflict_mismatch_done() {
        let t = ReplayTable::default();
        let key = Bytes::from_static(b"k");
        let (a, b) = (Token::generate(), Token::generate());
        assert_eq!(t.claim(&key, &a, b"fp", LEASE), Ok(Claim::Claimed));
        assert_eq!(
            t.claim(&key, &a, b"fp", LEASE),
            Ok(Claim::Claimed),
            "re-sent"
        );
        assert!(matches!(
            t.claim(&key, &b, b"fp", LEASE),
            Ok(Claim::InFlight { retry_after: Some(d) }) if d <= LEASE
        ));
        assert_eq!(t.claim(&key, &b, b"other", LEASE), Ok(Claim::Mismatch));
        assert!(!t.complete(&key, &b, &done(), LEASE), "not b's claim");
        assert!(t.complete(&key, &a, &done(), LEASE));
        assert!(t.complete(&key, &a, &done(), LEASE), "re-sent completion");
        assert_eq!(t.claim(&key, &b, b"fp", LEASE), Ok(Claim::Done(done())));
        assert!(!t.abandon(&key, &a), "a done record is not abandoned");
    }

    #[test]
    fn abandon_and_expiry_free_the_key() {
        let t = ReplayTable::default();
        let key = Bytes::from_static(b"k");
        let (a, b) = (Token::generate(), Token::generate());
        t.claim(&key, &a, b"fp", LEASE).unwrap();
        assert!(!t.abandon(&key, &b));
        assert!(t.abandon(&key, &a));
        assert_eq!(
            t.claim(&key, &b, b"other", Duration::ZERO),
            Ok(Claim::Claimed)
        );
        // b's claim expired at once: a new claim with any fingerprint wins.
        assert_eq!(t.claim(&key, &a, b"fp", LEASE), Ok(Claim::Claimed));
        assert!(!t.complete(&key, &b, &done(), LEASE));
        assert_eq!(t.len(), 1);
    }

    /// What the table holds for `key`: `None`, a claim (`Some(false)`)
    /// or a record (`Some(true)`), without touching it.
    fn state(t: &ReplayTable, k: &Bytes) -> Option<bool> {
        t.lock().map.get(k).map(|e| e.record.is_some())
    }

    /// The entry limit holds: the oldest records go first, an expired entry
    /// before any live record, and a claim never; with only claims left, a
    /// new claim is refused.
    #[test]
    fn entry_limit_evicts_expired_then_oldest_records_never_claims() {
        let t = ReplayTable::default();
        t.set_limits(Some(4), None);
        let now = Instant::now();
        let tok = Token::generate();
        let claim = |i, at| t.claim_at(&key(i), &tok, b"fp", LEASE, at);
        let complete = |i, retention, at| {
            assert!(t.complete_at(&key(i), &tok, &response(2), retention, at));
        };
        let states = |range: std::ops::Range<usize>| -> Vec<Option<bool>> {
            range.map(|i| state(&t, &key(i))).collect()
        };
        let hour = Duration::from_secs(3600);
        // Records 0, 1, 2 (kept an hour), and 3 kept one second.
        for i in 0..3 {
            claim(i, now).unwrap();
            complete(i, hour, now);
        }
        claim(3, now).unwrap();
        complete(3, Duration::from_secs(1), now);
        assert_eq!(t.len(), 4);
        // Two seconds later, 3 has expired: it goes first, the others stay.
        let later = now + Duration::from_secs(2);
        assert_eq!(claim(4, later), Ok(Claim::Claimed));
        assert_eq!(
            states(0..5),
            [Some(true), Some(true), Some(true), None, Some(false)]
        );
        // Full of live entries: the oldest record goes, then the next one.
        assert_eq!(claim(5, later), Ok(Claim::Claimed));
        assert_eq!(states(0..3), [None, Some(true), Some(true)]);
        assert_eq!(claim(6, later), Ok(Claim::Claimed));
        assert_eq!(states(0..3), [None, None, Some(true)]);
        // One more claim evicts record 2; the next finds only claims: it is
        // refused, and nothing is evicted.
        assert_eq!(claim(7, later), Ok(Claim::Claimed));
        assert_eq!(
            claim(8, later),
            Err(Full {
                entry_limit: 4,
                byte_limit: DEFAULT_BYTE_LIMIT
            })
        );
        assert_eq!(
            states(2..9),
            [
                None,
                None,
                Some(false),
                Some(false),
                Some(false),
                Some(false),
                None
            ]
        );
        // A duplicate of a kept claim is in flight, as before.
        assert!(matches!(
            t.claim_at(&key(4), &Token::generate(), b"fp", LEASE, later),
            Ok(Claim::InFlight { .. })
        ));
        // A claim that completes makes its record evictable again.
        complete(4, hour, later);
        assert_eq!(claim(8, later), Ok(Claim::Claimed));
        assert_eq!(
            states(4..9),
            [None, Some(false), Some(false), Some(false), Some(false)]
        );
        // An expired claim is not in flight any more: it makes room too.
        let after_lease = later + LEASE + Duration::from_secs(1);
        assert_eq!(claim(9, after_lease), Ok(Claim::Claimed));
        assert_eq!(t.len(), 1, "the four expired claims were swept");
    }

    /// The byte limit holds: records go oldest first until the new one
    /// fits; one larger than the whole limit is kept as "not stored".
    #[test]
    fn byte_limit_evicts_oldest_records_and_keeps_huge_ones_as_not_stored() {
        let t = ReplayTable::default();
        let small = response(100);
        let one = entry_size(key(0).len(), 2, small.encode().len());
        t.set_limits(None, Some(3 * one));
        let now = Instant::now();
        let tok = Token::generate();
        let record = |i, r: &Record| {
            t.claim_at(&key(i), &tok, b"fp", LEASE, now).unwrap();
            assert!(t.complete_at(&key(i), &tok, r, LEASE, now));
        };
        let states = |range: std::ops::Range<usize>| -> Vec<Option<bool>> {
            range.map(|i| state(&t, &key(i))).collect()
        };
        for i in 0..3 {
            record(i, &small);
        }
        assert_eq!(t.lock().bytes, 3 * one);
        // A fourth: the first goes (at the claim, which is smaller than a
        // record, so only one goes).
        record(3, &small);
        assert_eq!(states(0..4), [None, Some(true), Some(true), Some(true)]);
        assert_eq!(t.lock().bytes, 3 * one);
        // A record whose entry counts twice a small one: two go.
        record(4, &response(100 + one));
        assert_eq!(states(0..5), [None, None, None, Some(true), Some(true)]);
        assert_eq!(t.lock().bytes, 3 * one);
        // Larger than the whole store: recorded as not stored.
        record(5, &response(4 * one));
        assert_eq!(
            t.claim_at(&key(5), &Token::generate(), b"fp", LEASE, now),
            Ok(Claim::Done(Record::NotStored {
                status: StatusCode::CREATED,
                reason: NotStoredReason::TooLarge
            }))
        );
        assert!(t.lock().bytes <= 3 * one);
        // Its claim made room by evicting the oldest record, 3.
        assert_eq!(states(3..6), [None, Some(true), Some(true)]);
    }

    /// Expired entries are swept a bounded number per write, from the
    /// front of the time-ordered indexes: a backlog drains as writes go on,
    /// and no write removes more than its batch.
    #[test]
    fn sweep_is_bounded_per_write_and_drains_a_backlog() {
        let t = ReplayTable::default();
        let now = Instant::now();
        let tok = Token::generate();
        let n = 1000;
        for i in 0..n {
            t.claim_at(&key(i), &tok, b"fp", Duration::from_secs(1), now)
                .unwrap();
        }
        for i in 0..n / 2 {
            assert!(t.complete_at(&key(i), &tok, &done(), Duration::from_secs(1), now));
        }
        assert_eq!(t.len(), n);
        // All expired now: each write removes at most a batch from each index.
        let later = now + Duration::from_secs(2);
        t.claim_at(&key(n), &tok, b"fp", LEASE, later).unwrap();
        assert_eq!(t.len(), n + 1 - 2 * SWEEP_BATCH);
        let mut writes = 1;
        while t.len() > 1 {
            // A re-sent claim of our own: a write that adds nothing.
            t.claim_at(&key(n), &tok, b"fp", LEASE, later).unwrap();
            writes += 1;
            assert!(writes <= n, "the backlog does not drain");
        }
        assert_eq!(writes, n.div_ceil(2 * SWEEP_BATCH));
        let t = t.lock();
        assert_eq!(t.bytes, entry_size(key(n).len(), 2, 0));
        assert_eq!((t.claims.len(), t.records.len()), (1, 0));
    }
}
