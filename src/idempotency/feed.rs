//! [`Feed`]: records published by the store when a request that others
//! wait for (on other instances) completes, handed to those waiters.
//!
//! A store that publishes (see [`IdempotencyBackend::feed`](crate::backend::IdempotencyBackend::feed))
//! hands the layer a receiver of what it hears; the layer fills its feed
//! from it and owns the waiters. With Redis, a duplicate that finds the key
//! in flight marks it (`w` in the hash, in the same claim round trip); the
//! completion script then publishes the record on the key's channel, and
//! the layer's one subscriber connection (`PSUBSCRIBE prefix:{*:idem`,
//! made on its first joining request) wakes the waiters for that key. A
//! joined duplicate so costs its claim round trip and nothing more (with a
//! key-space secret; without one it reads the record it was woken for).

// Only the Redis store publishes; without it the feed is never filled.
#![cfg_attr(not(feature = "redis"), allow(dead_code))]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tokio::sync::watch;
use tokio::time::Instant;

/// What a waiter hears: the record, or that the key was freed.
#[derive(Debug, Clone)]
pub(crate) enum Published {
    /// The first request completed with this sealed record, as published:
    /// untrusted (anyone allowed to PUBLISH on the channel could have sent
    /// it) until the waiter opens it.
    Done(Bytes),
    /// The first request freed the key (safe to retry): claim it.
    Freed,
}

type Slot = watch::Sender<Option<Published>>;

/// What the store published for the entries this layer's duplicates wait
/// for, handed to them (one feed per layer). Filled from the store's
/// receiver ([`IdempotencyBackend::feed`](crate::backend::IdempotencyBackend::feed)) by
/// [`Feed::listen`]; when the receiver ends, the feed closes and its waiters
/// look at the store instead. Nothing delivered is trusted: a waiter opens
/// the record's seal first.
#[derive(Debug, Default)]
pub(crate) struct Feed {
    map: Mutex<HashMap<Bytes, Slot>>,
    /// Set when the subscriber connection ended: nothing more arrives.
    closed: AtomicBool,
}

impl Feed {
    /// A feed filled from `publications` until they end (then it closes) or
    /// the layer drops the feed.
    pub(crate) fn listen(
        mut publications: tokio::sync::mpsc::Receiver<(Bytes, Bytes)>,
    ) -> Arc<Self> {
        let feed = Arc::new(Self::default());
        let weak = Arc::downgrade(&feed);
        tokio::spawn(async move {
            while let Some((channel, message)) = publications.recv().await {
                let Some(feed) = weak.upgrade() else { return };
                feed.deliver(&channel, message);
            }
            if let Some(feed) = weak.upgrade() {
                feed.close();
            }
        });
        feed
    }

    /// Whether the subscriber still delivers.
    pub(crate) fn is_live(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
    }

    /// The subscriber ended: wake every waiter (they read the store) and
    /// deliver nothing more.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.lock().clear();
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Bytes, Slot>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Start listening for `key` (before asking the store, so that nothing
    /// published after the answer is missed).
    pub(crate) fn waiter(self: &Arc<Self>, key: &Bytes) -> Waiter {
        let rx = self
            .lock()
            .entry(key.clone())
            .or_insert_with(|| watch::channel(None).0)
            .subscribe();
        Waiter {
            rx,
            key: key.clone(),
            feed: self.clone(),
        }
    }

    /// Hand what was published on `channel` (the entry's key,
    /// [`EntryKey::entry`](crate::backend::EntryKey::entry)) to its waiters, if any:
    /// the sealed record as published, or an empty `message` when the entry
    /// was freed (its waiters then claim it).
    pub(crate) fn deliver(&self, channel: &[u8], message: Bytes) {
        if let Some(tx) = self.lock().remove(channel) {
            let published = match message.is_empty() {
                true => Published::Freed,
                false => Published::Done(message),
            };
            tx.send_replace(Some(published));
        }
    }
}

/// One waiter for one key; leaves the table when dropped (if last).
#[derive(Debug)]
pub(crate) struct Waiter {
    rx: watch::Receiver<Option<Published>>,
    key: Bytes,
    feed: Arc<Feed>,
}

impl Waiter {
    /// What is published for the key before `until`, if anything; `None`
    /// at `until`, or at once when the feed has closed.
    pub(crate) async fn wait(&mut self, until: Instant) -> Option<Published> {
        match tokio::time::timeout_at(until, self.rx.wait_for(Option::is_some)).await {
            Ok(Ok(published)) => published.clone(),
            _ => None,
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut map = self.feed.lock();
        if let Some(tx) = map.get(&self.key) {
            // The entry is ours (not a newer one for the key) and nobody
            // else waits on it: ours and the probe are its only receivers.
            let probe = tx.subscribe();
            if probe.same_channel(&self.rx) && tx.receiver_count() <= 2 {
                map.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests;
