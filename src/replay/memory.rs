//! [`ReplayStore`] for [`MemoryBackend`]: claims and records in this
//! process's memory, shared by clones of the backend.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::record::Record;
use super::store::{Claim, ReplayStore};
use crate::backend::{BackendFuture, Token};
use crate::MemoryBackend;

/// Swept of expired entries every this many writes once larger than this.
const SWEEP_EVERY: usize = 1024;

/// The table behind [`MemoryBackend`]'s [`ReplayStore`] implementation.
#[derive(Debug, Default)]
pub(crate) struct ReplayTable {
    inner: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    map: HashMap<Bytes, Entry>,
    writes: usize,
    entry_limit: Option<usize>,
    byte_limit: Option<usize>,
}

#[derive(Debug)]
struct Entry {
    token: Token,
    fingerprint: Bytes,
    record: Option<Record>,
    expires: Instant,
}

impl ReplayTable {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // The map is consistent after every statement; poisoning only means
        // another thread panicked elsewhere while holding the lock.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn claim(&self, key: &Bytes, token: &Token, fp: &[u8], lease: Duration) -> Claim {
        let now = Instant::now();
        let mut t = self.lock();
        let claim = match t.map.get_mut(key) {
            Some(e) if e.expires > now => {
                if e.fingerprint != fp {
                    return Claim::Mismatch;
                }
                match &e.record {
                    Some(record) => return Claim::Done(record.clone()),
                    None if e.token == *token => {
                        e.expires = now + lease;
                        Claim::Claimed
                    }
                    None => {
                        return Claim::InFlight {
                            retry_after: Some(e.expires - now),
                        }
                    }
                }
            }
            _ => {
                t.map.insert(
                    key.clone(),
                    Entry {
                        token: *token,
                        fingerprint: Bytes::copy_from_slice(fp),
                        record: None,
                        expires: now + lease,
                    },
                );
                Claim::Claimed
            }
        };
        t.writes += 1;
        if t.writes >= SWEEP_EVERY {
            t.writes = 0;
            if t.map.len() > SWEEP_EVERY {
                t.map.retain(|_, e| e.expires > now);
            }
        }
        claim
    }

    pub(crate) fn complete(
        &self,
        key: &Bytes,
        token: &Token,
        record: &Record,
        retention: Duration,
    ) -> bool {
        let now = Instant::now();
        let mut t = self.lock();
        match t.map.get_mut(key) {
            Some(e) if e.token == *token && e.expires > now => {
                if e.record.is_none() {
                    e.record = Some(record.clone());
                    e.expires = now + retention;
                }
                true
            }
            _ => false,
        }
    }

    pub(crate) fn abandon(&self, key: &Bytes, token: &Token) -> bool {
        let now = Instant::now();
        let mut t = self.lock();
        match t.map.get(key) {
            Some(e) if e.token == *token && e.record.is_none() => {
                let live = e.expires > now;
                t.map.remove(key);
                live
            }
            _ => false,
        }
    }

    /// Entries stored (live or not yet swept).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().map.len()
    }
}

impl MemoryBackend {
    /// Most idempotency entries (claims and records) kept.
    pub fn replay_entry_limit(self, limit: usize) -> Self {
        self.replay_table().lock().entry_limit = Some(limit);
        self
    }

    /// Most bytes of idempotency entries kept.
    pub fn replay_byte_limit(self, limit: usize) -> Self {
        self.replay_table().lock().byte_limit = Some(limit);
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
        let out = self.replay_table().claim(key, token, fingerprint, lease);
        Box::pin(std::future::ready(Ok(out)))
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
    use crate::replay::record::NotStoredReason;

    const LEASE: Duration = Duration::from_secs(5);

    fn done() -> Record {
        Record::NotStored {
            status: http::StatusCode::OK,
            reason: NotStoredReason::Streaming,
        }
    }

    #[test]
    fn claim_conflict_mismatch_done() {
        let t = ReplayTable::default();
        let key = Bytes::from_static(b"k");
        let (a, b) = (Token::generate(), Token::generate());
        assert_eq!(t.claim(&key, &a, b"fp", LEASE), Claim::Claimed);
        assert_eq!(t.claim(&key, &a, b"fp", LEASE), Claim::Claimed, "re-sent");
        assert!(matches!(
            t.claim(&key, &b, b"fp", LEASE),
            Claim::InFlight { retry_after: Some(d) } if d <= LEASE
        ));
        assert_eq!(t.claim(&key, &b, b"other", LEASE), Claim::Mismatch);
        assert!(!t.complete(&key, &b, &done(), LEASE), "not b's claim");
        assert!(t.complete(&key, &a, &done(), LEASE));
        assert!(t.complete(&key, &a, &done(), LEASE), "re-sent completion");
        assert_eq!(t.claim(&key, &b, b"fp", LEASE), Claim::Done(done()));
        assert!(!t.abandon(&key, &a), "a done record is not abandoned");
    }

    #[test]
    fn abandon_and_expiry_free_the_key() {
        let t = ReplayTable::default();
        let key = Bytes::from_static(b"k");
        let (a, b) = (Token::generate(), Token::generate());
        t.claim(&key, &a, b"fp", LEASE);
        assert!(!t.abandon(&key, &b));
        assert!(t.abandon(&key, &a));
        assert_eq!(t.claim(&key, &b, b"other", Duration::ZERO), Claim::Claimed);
        // b's claim expired at once: a new claim with any fingerprint wins.
        assert_eq!(t.claim(&key, &a, b"fp", LEASE), Claim::Claimed);
        assert!(!t.complete(&key, &b, &done(), LEASE));
        assert_eq!(t.len(), 1);
    }
}
