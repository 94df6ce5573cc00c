//! [`Watchers`]: the keys this process watches for releases
//! ([`LockBackend::watch`](super::LockBackend::watch)), each with a count
//! of the releases heard, shared by the memory and Redis backends.
//!
//! A release made in this process bumps its key's count at once (no round
//! trip); the Redis backend also bumps it for what its subscriber hears from
//! other instances, and drops the echo of its own releases (the publication
//! carries the first 16 hex characters of the released token), so that one
//! release is one bump. A release of a key nobody watches costs one atomic
//! load. The subscriber that hears other instances' releases is told which
//! keys to follow as data ([`Subscription`] orders on a channel), never
//! through a callback.

// The Redis backend uses all of it; the memory backend only the local part.
#![cfg_attr(not(feature = "redis"), allow(dead_code))]

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};

use super::contract::{Token, Watch};
use super::BackendError;

/// Echoes of our own releases remembered per key, at most.
const OWN: usize = 8;
/// Length of the token prefix a release publishes.
pub(crate) const TAG: usize = 16;

/// What the watched keys ask of the subscriber that hears their releases
/// from other instances (the Redis backend's subscription task, `redis/watch.rs`),
/// in the order asked, on one channel: so that a key's unsubscribe never
/// overtakes its next subscribe.
#[derive(Debug)]
pub(crate) enum Subscription {
    /// Subscribe to the channel of a key that got its first watch; the
    /// answer says whether the server confirmed it.
    Subscribe(Bytes, oneshot::Sender<Result<(), BackendError>>),
    /// Nobody watches the key any more: unsubscribe (unless it is watched
    /// again by the time the order is read).
    Unsubscribe(Bytes),
}

/// The watched keys of one backend (shared by its clones).
#[derive(Default)]
pub(crate) struct Watchers {
    map: Mutex<HashMap<Bytes, Slot>>,
    /// How many keys are watched: a release looks at the map only if any.
    watched: AtomicUsize,
    /// Slot generations, so that a watch of an earlier slot of a key never
    /// leaves a later one.
    ids: AtomicU64,
    /// Where keys nobody watches any more are told (`None`: nobody
    /// listens, as for the memory backend).
    subscriber: Option<mpsc::UnboundedSender<Subscription>>,
}

impl std::fmt::Debug for Watchers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchers")
            .field("watched", &self.watched.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

struct Slot {
    id: u64,
    tx: watch::Sender<u64>,
    users: usize,
    /// Tags of our own releases of the key whose publication has not come
    /// back yet.
    own: VecDeque<[u8; TAG]>,
}

/// Leaves the key's slot when its watch is dropped.
struct Leave {
    watchers: Arc<Watchers>,
    key: Bytes,
    id: u64,
}

impl Drop for Leave {
    fn drop(&mut self) {
        self.watchers.leave(&self.key, self.id);
    }
}

impl Watchers {
    /// Watchers that send [`Subscription::Unsubscribe`] to `subscriber`
    /// for each key nobody watches any more.
    pub(crate) fn with_subscriber(subscriber: mpsc::UnboundedSender<Subscription>) -> Self {
        Self {
            subscriber: Some(subscriber),
            ..Self::default()
        }
    }

    /// Tell the subscriber, if any, that nobody watches `key` any more.
    fn idle(&self, key: Bytes) {
        if let Some(subscriber) = &self.subscriber {
            let _ = subscriber.send(Subscription::Unsubscribe(key));
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Bytes, Slot>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Watch `key`; `true` when nobody watched it before (the caller
    /// subscribes).
    pub(crate) fn watch(self: &Arc<Self>, key: &Bytes) -> (Watch, bool) {
        let mut map = self.lock();
        let mut first = false;
        let slot = map.entry(key.clone()).or_insert_with(|| {
            first = true;
            self.watched.fetch_add(1, Ordering::Relaxed);
            Slot {
                id: self.ids.fetch_add(1, Ordering::Relaxed),
                tx: watch::channel(0).0,
                users: 0,
                own: VecDeque::new(),
            }
        });
        slot.users += 1;
        let leave = Leave {
            watchers: self.clone(),
            key: key.clone(),
            id: slot.id,
        };
        (Watch::new(slot.tx.subscribe(), leave), first)
    }

    fn leave(&self, key: &Bytes, id: u64) {
        let mut map = self.lock();
        let Some(slot) = map.get_mut(key) else { return };
        if slot.id != id {
            return;
        }
        slot.users -= 1;
        if slot.users == 0 {
            map.remove(key);
            self.watched.fetch_sub(1, Ordering::Relaxed);
            drop(map);
            self.idle(key.clone());
        }
    }

    /// The subscription to `key`'s channel failed: its slot goes, so that
    /// every watch of it reads as ended (their waiters look for the lease
    /// themselves), those taken while the subscription was on its way
    /// included, and the next watch subscribes again.
    pub(crate) fn unsubscribed(&self, key: &[u8]) {
        if self.lock().remove(key).is_some() {
            self.watched.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Whether anyone in this process watches `key`.
    pub(crate) fn is_watched(&self, key: &[u8]) -> bool {
        self.watched.load(Ordering::Relaxed) > 0 && self.lock().contains_key(key)
    }

    /// A release of `key` made here succeeded: bump its count.
    pub(crate) fn released(&self, key: &[u8]) {
        if self.watched.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Some(slot) = self.lock().get(key) {
            slot.tx.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// A release of `key` with `token` is being sent from here: its
    /// publication (the first 16 of the token's 32 hex characters), when it
    /// comes back, is an echo.
    pub(crate) fn releasing(&self, key: &[u8], token: &Token) {
        if self.watched.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Some(slot) = self.lock().get_mut(key) {
            if slot.own.len() == OWN {
                slot.own.pop_front();
            }
            let mut tag = [0; TAG];
            tag.copy_from_slice(&token.to_hex()[..TAG]);
            slot.own.push_back(tag);
        }
    }

    /// The subscriber heard `message` on `channel` (a key): a release from
    /// another instance bumps the key's count; the echo of one of ours is
    /// dropped (it was counted when its reply came); anything else (an empty
    /// probe, a stranger's message) is ignored.
    pub(crate) fn heard(&self, channel: &[u8], message: &[u8]) {
        if message.len() != TAG {
            return;
        }
        let mut map = self.lock();
        let Some(slot) = map.get_mut(channel) else {
            return;
        };
        if let Some(at) = slot.own.iter().position(|t| t[..] == *message) {
            slot.own.remove(at);
            return;
        }
        slot.tx.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Releases may have been missed (the subscriber reconnected, or fell
    /// behind): bump every count, so that each waiter looks once more.
    pub(crate) fn bump_all(&self) {
        for slot in self.lock().values() {
            slot.tx.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Nothing more will be heard (the subscriber is gone): end every watch
    /// (their waiters fall back to looking with a back-off); later watches
    /// start new slots.
    pub(crate) fn close_all(&self) {
        let keys: Vec<Bytes> = {
            let mut map = self.lock();
            self.watched.fetch_sub(map.len(), Ordering::Relaxed);
            map.drain().map(|(key, _)| key).collect()
        };
        for key in keys {
            self.idle(key);
        }
    }
}

#[cfg(test)]
mod tests;
