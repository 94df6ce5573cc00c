//! Requests in flight on this instance, which duplicates join.
//!
//! When a request wins its claim, it registers here under its storage key;
//! a duplicate arriving on the same instance finds it without asking the
//! store, waits (bounded by [`IdempotencyLayer::join_timeout`](super::IdempotencyLayer::join_timeout))
//! and receives the original's outcome the moment it is recorded. Clones of
//! one layer share the table; other layers and other instances join through
//! the store (see `joining.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tokio::sync::watch;
use tokio::time::Instant;

use super::record::Record;

/// What a finished request tells the duplicates that joined it.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// The outcome was recorded: answer with it.
    Recorded(Record),
    /// The key was freed (safe to retry, or not stored by policy): claim it.
    Freed,
    /// Nothing is known (the record write failed): the claim stays until it
    /// expires.
    Unknown,
}

type Slot = watch::Sender<Option<Outcome>>;

/// A request in flight: its id, its fingerprint, where its outcome goes,
/// and when it was claimed.
type Entry = (u64, Bytes, Slot, Instant);

/// The table of requests in flight on this instance.
#[derive(Debug, Default)]
pub(crate) struct Flights {
    map: Mutex<HashMap<Bytes, Entry>>,
    next: AtomicU64,
}

/// What [`Flights::join`] found.
pub(crate) enum Join {
    /// Nothing in flight here with this key.
    Absent,
    /// In flight here with another fingerprint.
    Mismatch,
    /// In flight here since the instant: wait on this.
    Wait(watch::Receiver<Option<Outcome>>, Instant),
}

impl Flights {
    fn lock(&self) -> MutexGuard<'_, HashMap<Bytes, Entry>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Look up `key`, comparing the fingerprint.
    pub(crate) fn join(&self, key: &Bytes, fingerprint: &[u8]) -> Join {
        match self.lock().get(key) {
            None => Join::Absent,
            Some((_, fp, _, _)) if fp != fingerprint => Join::Mismatch,
            Some((_, _, tx, began)) => Join::Wait(tx.subscribe(), *began),
        }
    }

    /// Register our claimed request under `key`.
    pub(crate) fn begin(self: &Arc<Self>, key: Bytes, fingerprint: Bytes) -> Flight {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, _) = watch::channel(None);
        self.lock()
            .insert(key.clone(), (id, fingerprint, tx, Instant::now()));
        Flight {
            flights: self.clone(),
            key,
            id,
        }
    }

    /// Requests in flight here.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

/// Our entry in [`Flights`]; dropping it without
/// [`finish`](Self::finish) tells the waiters nothing, so they ask the store.
#[derive(Debug)]
pub(crate) struct Flight {
    flights: Arc<Flights>,
    key: Bytes,
    id: u64,
}

impl Flight {
    /// Tell every waiter the outcome, and leave the table.
    pub(crate) fn finish(self, outcome: Outcome) {
        if let Some((_, _, tx, _)) = self.take() {
            tx.send_replace(Some(outcome));
        }
    }

    fn take(&self) -> Option<Entry> {
        let mut map = self.flights.lock();
        match map.get(&self.key) {
            Some((id, _, _, _)) if *id == self.id => map.remove(&self.key),
            _ => None,
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        // After `finish` this finds nothing; otherwise the sender is dropped
        // and the waiters fall back to the store.
        drop(self.take());
    }
}

#[cfg(test)]
mod tests;
