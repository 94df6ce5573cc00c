//! The idempotency table of [`MemoryBackend`] and its
//! [`IdempotencyBackend`]: claims and records in this process's memory,
//! shared by clones of the backend, bounded in entries and bytes, as a
//! whole and per scope (the limits' setters are `MemoryBackend`'s, in
//! `mod.rs`).
//!
//! One map from entry key to entry, two indexes ordered by expiry (claims,
//! records), and per scope the expiry slots of its entries. Every claim and
//! completion first removes a bounded number of expired entries from the front of
//! each index (never a pass over the map). No unexpired entry is ever
//! evicted: a new claim whose scope holds its quota is refused (429), and
//! one that would take the whole store over its limits is refused (503),
//! so that one client can never make another client's retry run again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::RandomState;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::backend::expiring::{Entries, Expiring};
use crate::backend::idempotency::{IdempotencyBackend, Quota};
use crate::backend::{BackendError, BackendFuture, Token};
use crate::backend::{Claim, ClaimTerms, EntryKey};
use crate::settings::at_most_max;
use crate::MemoryBackend;

/// Default most entries (claims and records) kept: 100,000.
pub(crate) const DEFAULT_ENTRY_LIMIT: usize = 100_000;
/// Default most bytes kept: 64 MiB.
pub(crate) const DEFAULT_BYTE_LIMIT: usize = 64 * 1024 * 1024;
/// Expired entries removed from the front of each index per write, at most:
/// more than the one entry a write adds, so a backlog drains while writes
/// go on, and a write never pays for more than this.
const SWEEP_BATCH: usize = 8;
/// Bytes counted per entry beyond its key, fingerprint and sealed record:
/// the map slot (with the map's spare capacity), the index nodes and the
/// allocations' own headers, so the count follows the resident memory
/// (BENCHMARKS.md, "Idempotency store in memory", compares the two; check
/// this value there again when the table's layout changes).
const ENTRY_OVERHEAD: usize = 320;

/// The table behind [`MemoryBackend`]'s [`IdempotencyBackend`] implementation.
#[derive(Debug, Default)]
pub(crate) struct IdempotencyTable {
    inner: Mutex<Table>,
}

/// Where an entry sits in its index: its expiry, and a sequence number
/// that makes equal expiries distinct (and orders them by age).
type Expiry = (Instant, u64);

#[derive(Debug)]
struct Table {
    /// The entries: one shard of the crate's expiring map, swept by this
    /// table in expiry order (its own sweep is off), since the limits and
    /// quotas below count every entry under one lock.
    entries: Entries<Entry>,
    /// In-flight claims by expiry.
    claims: BTreeMap<Expiry, Bytes>,
    /// Completed records by expiry.
    records: BTreeMap<Expiry, Bytes>,
    /// Per scope: the expiries of its entries, and their bytes.
    scopes: HashMap<Bytes, ScopeUse>,
    /// Bytes counted over all entries (see [`entry_size`]).
    bytes: usize,
    seq: u64,
    entry_limit: usize,
    byte_limit: usize,
}

#[derive(Debug, Default)]
struct ScopeUse {
    expiries: BTreeSet<Expiry>,
    bytes: usize,
}

impl Default for Table {
    fn default() -> Self {
        Self {
            entries: Entries::new(RandomState::new(), None),
            claims: BTreeMap::new(),
            records: BTreeMap::new(),
            scopes: HashMap::new(),
            bytes: 0,
            seq: 0,
            entry_limit: DEFAULT_ENTRY_LIMIT,
            byte_limit: DEFAULT_BYTE_LIMIT,
        }
    }
}

#[derive(Debug)]
struct Entry {
    token: Token,
    fingerprint: Box<[u8]>,
    /// The sealed record once the request completed.
    record: Option<Bytes>,
    expiry: Expiry,
    size: usize,
    scope: Bytes,
}

impl Expiring for Entry {
    fn expires(&self) -> Option<Instant> {
        Some(self.expiry.0)
    }
}

/// A new claim found the whole store at its limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full {
    entry_limit: usize,
    byte_limit: usize,
}

impl Full {
    fn into_error(self) -> BackendError {
        BackendError::new(format!(
            "the memory idempotency store is full (limits: {} entries, {} bytes); no \
             unexpired entry is evicted, so new keys are refused until entries expire: raise \
             MemoryBackend::idempotency_entry_limit / idempotency_byte_limit, shorten \
             IdempotencyLayer::retention, or lower IdempotencyLayer::scope_quota",
            self.entry_limit, self.byte_limit
        ))
    }
}

/// Bytes counted for an entry: its storage key (shared by the map and the
/// indexes), fingerprint and sealed record, plus [`ENTRY_OVERHEAD`].
fn entry_size(key: usize, fingerprint: usize, record: usize) -> usize {
    ENTRY_OVERHEAD + key + fingerprint + record
}

impl Table {
    /// The entry under `key`, live or not.
    fn get(&self, key: &Bytes) -> Option<&Entry> {
        self.entries.get(self.entries.key(key))
    }

    /// The entry under `key` if it is live at `now`.
    fn live(&self, key: &Bytes, now: Instant) -> Option<&Entry> {
        self.entries.live(self.entries.key(key), now)
    }

    fn next_expiry(&mut self, at: Instant) -> Expiry {
        self.seq += 1;
        (at, self.seq)
    }

    fn index(&mut self, record: bool) -> &mut BTreeMap<Expiry, Bytes> {
        if record {
            &mut self.records
        } else {
            &mut self.claims
        }
    }

    /// A new entry of `token` under `key` (none there), live until `at`.
    fn put(
        &mut self,
        key: &EntryKey,
        token: &Token,
        fp: &[u8],
        record: Option<Bytes>,
        size: usize,
        at: Instant,
    ) {
        let expiry = self.next_expiry(at);
        let entry = Entry {
            token: *token,
            fingerprint: fp.into(),
            record,
            expiry,
            size,
            scope: key.scope.clone(),
        };
        self.insert(&key.entry, entry);
    }

    /// Add a new entry under `key`.
    fn insert(&mut self, key: &Bytes, entry: Entry) {
        self.index(entry.record.is_some())
            .insert(entry.expiry, key.clone());
        let scope = self.scopes.entry(entry.scope.clone()).or_default();
        scope.expiries.insert(entry.expiry);
        scope.bytes += entry.size;
        self.bytes += entry.size;
        let key = self.entries.key(key);
        self.entries.insert(key, entry);
    }

    /// Remove `key`'s entry from the map, its index and its scope.
    fn remove(&mut self, key: &Bytes) -> Option<Entry> {
        let e = self.entries.remove(self.entries.key(key))?;
        self.index(e.record.is_some()).remove(&e.expiry);
        if let Some(scope) = self.scopes.get_mut(&e.scope) {
            scope.expiries.remove(&e.expiry);
            scope.bytes -= e.size;
            if scope.expiries.is_empty() {
                self.scopes.remove(&e.scope);
            }
        }
        self.bytes -= e.size;
        Some(e)
    }

    /// Move `key`'s entry to a new expiry, record and size (all three
    /// indexes follow).
    fn update(&mut self, key: &Bytes, at: Instant, record: Option<Bytes>, size: usize) {
        let Some(mut e) = self.remove(key) else {
            return;
        };
        e.expiry = self.next_expiry(at);
        e.record = record;
        e.size = size;
        self.insert(key, e);
    }

    /// Remove the front of the claims or records index if it expired by
    /// `now`.
    fn pop_expired(&mut self, records: bool, now: Instant) -> bool {
        let index = if records { &self.records } else { &self.claims };
        let key = match index.first_key_value() {
            Some((at, key)) if at.0 <= now => key.clone(),
            _ => return false,
        };
        self.remove(&key);
        true
    }

    /// Remove up to [`SWEEP_BATCH`] expired entries from each index.
    fn sweep(&mut self, now: Instant) {
        for records in [false, true] {
            for _ in 0..SWEEP_BATCH {
                if !self.pop_expired(records, now) {
                    break;
                }
            }
        }
    }

    /// Remove the expired entries of one scope (at most its quota, since a
    /// scope never holds more), so that its count is exact.
    fn sweep_scope(&mut self, scope: &[u8], now: Instant) {
        loop {
            let Some(first) = self
                .scopes
                .get(scope)
                .and_then(|s| s.expiries.first().copied())
                .filter(|at| at.0 <= now)
            else {
                return;
            };
            let key = self
                .claims
                .get(&first)
                .or_else(|| self.records.get(&first))
                .cloned();
            match key {
                Some(key) => {
                    self.remove(&key);
                }
                // Not indexed: cannot happen; drop the stray slot.
                None => {
                    if let Some(s) = self.scopes.get_mut(scope) {
                        s.expiries.remove(&first);
                    }
                }
            }
        }
    }

    /// When the scope is at its quota: how long until its oldest entry
    /// expires.
    fn over_quota(&self, scope: &[u8], quota: Quota, now: Instant) -> Option<Duration> {
        let s = self.scopes.get(scope)?;
        let over = s.expiries.len() as u64 >= quota.entries || s.bytes as u64 >= quota.bytes;
        over.then(|| {
            s.expiries
                .first()
                .map_or(Duration::ZERO, |at| at.0.saturating_duration_since(now))
        })
    }

    /// Make room for one more entry of `bytes` by removing expired entries
    /// only; `false` if the store stays over a limit.
    fn make_room(&mut self, bytes: usize, now: Instant) -> bool {
        while self.entries.len() + 1 > self.entry_limit || self.bytes + bytes > self.byte_limit {
            if !self.pop_expired(false, now) && !self.pop_expired(true, now) {
                return false;
            }
        }
        true
    }
}

impl IdempotencyTable {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // The map is consistent after every statement; poisoning only means
        // another thread panicked elsewhere while holding the lock.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fp: &[u8],
        lease: Duration,
        quota: Quota,
    ) -> Result<Claim, Full> {
        let now = Instant::now();
        let mut t = self.lock();
        t.sweep(now);
        if let Some(e) = t.live(&key.entry, now) {
            if *e.fingerprint != *fp {
                return Ok(Claim::Mismatch);
            }
            if let Some(record) = &e.record {
                return Ok(Claim::Done(record.clone()));
            }
            if e.token != *token {
                return Ok(Claim::InFlight {
                    retry_after: Some(e.expiry.0 - now),
                });
            }
            // A re-sent claim of our own: extend it.
            let size = e.size;
            t.update(&key.entry, now + at_most_max(lease), None, size);
            return Ok(Claim::Claimed);
        }
        // Free (absent or expired): a new claim, if the scope and the store
        // have room.
        t.remove(&key.entry);
        t.sweep_scope(&key.scope, now);
        if let Some(retry_after) = t.over_quota(&key.scope, quota, now) {
            return Ok(Claim::OverQuota { retry_after });
        }
        let size = entry_size(key.entry.len(), fp.len(), 0);
        if !t.make_room(size, now) {
            return Err(Full {
                entry_limit: t.entry_limit,
                byte_limit: t.byte_limit,
            });
        }
        t.put(key, token, fp, None, size, now + at_most_max(lease));
        Ok(Claim::Claimed)
    }

    pub(crate) fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        fp: &[u8],
        record: &Bytes,
        retention: Duration,
    ) -> bool {
        let now = Instant::now();
        let mut t = self.lock();
        t.sweep(now);
        let fp_len = match t.live(&key.entry, now) {
            Some(e) if e.token == *token => {
                if e.record.is_some() {
                    return true; // a re-sent completion
                }
                e.fingerprint.len()
            }
            Some(_) => return false,
            None => {
                // Our claim lapsed (it expired unrenewed) and nothing took
                // its place: the handler ran, so its record is kept, as a
                // claim of ours made now and completed.
                t.remove(&key.entry);
                let size = entry_size(key.entry.len(), fp.len(), record.len());
                let at = now + at_most_max(retention);
                t.put(key, token, fp, Some(record.clone()), size, at);
                return true;
            }
        };
        // Never refused for room: the handler already ran. The store may go
        // over its byte limit by this record; new claims wait until it is
        // back under.
        let size = entry_size(key.entry.len(), fp_len, record.len());
        t.update(
            &key.entry,
            now + at_most_max(retention),
            Some(record.clone()),
            size,
        );
        true
    }

    pub(crate) fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> bool {
        let now = Instant::now();
        let mut t = self.lock();
        let size = match t.live(&key.entry, now) {
            Some(e) if e.token == *token && e.record.is_none() => e.size,
            _ => return false,
        };
        t.update(&key.entry, now + at_most_max(lease), None, size);
        true
    }

    pub(crate) fn abandon(&self, key: &EntryKey, token: &Token) -> bool {
        let now = Instant::now();
        let mut t = self.lock();
        match t.get(&key.entry) {
            Some(e) if e.token == *token && e.record.is_none() => {
                let live = e.is_live(now);
                t.remove(&key.entry);
                live
            }
            _ => false,
        }
    }

    pub(super) fn set_limits(&self, entries: Option<usize>, bytes: Option<usize>) {
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
        self.lock().entries.len()
    }
}

impl IdempotencyBackend for MemoryBackend {
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        terms: &ClaimTerms,
    ) -> BackendFuture<Claim> {
        let quota = Quota {
            entries: terms.max_entries,
            bytes: terms.max_bytes,
        };
        let out = self
            .idempotency_table()
            .claim(key, token, fingerprint, terms.lease, quota)
            .map_err(Full::into_error);
        BackendFuture::ready(out)
    }

    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        let out = self
            .idempotency_table()
            .complete(key, token, fingerprint, record, retention);
        BackendFuture::ready(Ok(out))
    }

    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        let out = self.idempotency_table().extend(key, token, lease);
        BackendFuture::ready(Ok(out))
    }

    fn abandon(&self, key: &EntryKey, token: &Token, _lease: Duration) -> BackendFuture<bool> {
        let out = self.idempotency_table().abandon(key, token);
        BackendFuture::ready(Ok(out))
    }

    /// Answers within the layer's deadline.
    fn claim_timeout(&self, deadline: Duration) -> Duration {
        deadline
    }

    /// Records die with the process: nothing for a shutdown to wait for.
    fn hold(&self) -> Option<Box<dyn Send>> {
        None
    }

    /// Duplicates on this instance join the request in flight directly.
    fn feed(
        &self,
        _key_space: &crate::key::KeySpace,
    ) -> Option<BackendFuture<tokio::sync::mpsc::Receiver<(Bytes, Bytes)>>> {
        None
    }

    fn claimed(&self, _key: &EntryKey, _token: &Token, _extensions: &mut http::Extensions) {}

    fn is_transactional(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests;
