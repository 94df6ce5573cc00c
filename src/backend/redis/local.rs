//! The local in-flight table: duplicates of a lease this process holds (or is
//! taking right now) are answered without a round trip to the backend.
//!
//! Rules that keep it correct:
//!
//! - An entry is only written after the backend said *acquired*, and expires
//!   at `call start + ttl`, which is never later than the backend's own expiry
//!   (the backend started its clock after the call started). So a local "held"
//!   never outlives the lease.
//! - A re-acquire or an extend with our own token first shortens the entry to
//!   that call's `start + ttl` (a shorter TTL ends the lease sooner), and
//!   lengthens it to that only once the backend confirmed; a re-acquire that
//!   finds the key held by another token forgets the entry.
//! - Release and extend go to the backend as before; release removes the
//!   local entry first (synchronously, at the call), so a local entry never
//!   outlives our own release either.
//! - A miss (no entry, or an expired one) always asks the backend.
//! - While one request is asking the backend for a key, same-key requests
//!   arriving here wait for that answer instead of sending their own: an
//!   *acquired* makes them *held*; a *held* is passed on as is; an error or a
//!   cancelled call lets each of them ask the backend itself.
//!
//! The table never calls the backend: [`InFlight::begin`] answers hit or
//! miss ([`Begin`]), the caller (`lock.rs`) sends the acquire and reports
//! its answer back ([`Lead::finish`], [`InFlight::reacquired`]); likewise
//! for an extend ([`InFlight::shorten`], [`InFlight::extended`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::backend::expiring::{Expiring, ExpiringMap};
use crate::backend::{Acquire, BackendError, Token};

const SHARDS: usize = 16;
/// Sweep a shard of expired entries every this many writes once it holds more
/// than this many (entries kept by `HoldUntilTtl` or a lost release).
const SWEEP_EVERY: usize = 1024;

/// The table of the leases this process holds, and of the acquires it is
/// sending; held by `RedisBackend` (see `RedisBackend::local_dedup`). Each
/// call hashes its key once (keyed SipHash): the hash picks the shard and
/// finds the slot.
#[derive(Debug)]
pub(crate) struct InFlight {
    slots: ExpiringMap<Slot>,
}

impl Default for InFlight {
    fn default() -> Self {
        Self {
            slots: ExpiringMap::new(SHARDS, SWEEP_EVERY),
        }
    }
}

#[derive(Debug)]
enum Slot {
    /// `leader` is asking the backend (`marked`: its acquire leaves the
    /// mark that makes a release publish); `waiters` want its answer.
    Pending {
        leader: Token,
        marked: bool,
        waiters: Vec<oneshot::Sender<Acquire>>,
    },
    /// We hold the lease until at least `expires`.
    Held { token: Token, expires: Instant },
}

impl Expiring for Slot {
    /// A pending slot is removed by its leader (or its leader's drop),
    /// never by the sweep.
    fn expires(&self) -> Option<Instant> {
        match self {
            Slot::Pending { .. } => None,
            Slot::Held { expires, .. } => Some(*expires),
        }
    }
}

/// What to do with an acquire: the table's hit or miss.
pub(crate) enum Begin {
    /// Hit: a duplicate of a lease this process holds; answer this without
    /// asking the backend.
    Hit(Acquire),
    /// Another request of this process is asking for the key: wait for its
    /// answer (a closed channel: it failed or gave up, ask the backend);
    /// `marked`: its acquire leaves the mark.
    Wait {
        answer: oneshot::Receiver<Acquire>,
        marked: bool,
    },
    /// Miss: ask the backend, and report its answer with [`Lead::finish`]
    /// (dropped unfinished, the waiters ask for themselves).
    Lead(Lead),
    /// Our own lease taken again: ask the backend, and report its answer
    /// with [`InFlight::reacquired`] (the entry was shortened to end at the
    /// earliest at `expires`).
    Bypass { expires: Instant },
}

impl InFlight {
    /// Hit or miss for an acquire of `key` with `token` for `ttl`
    /// (`marked`: one that leaves the mark).
    pub(crate) fn begin(
        self: &Arc<Self>,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
        marked: bool,
    ) -> Begin {
        // `Duration::MAX` ("for ever") is ten years here, as in the memory
        // store: an `Instant` cannot go further.
        let ttl = crate::settings::at_most_max(ttl);
        let now = Instant::now();
        let (mut shard, slot_key) = self.slots.lock(key);
        match shard.live_mut(slot_key, now) {
            Some(Slot::Held { token: t, expires }) => {
                if t == token {
                    // Our own lease, taken again, perhaps with a shorter TTL:
                    // the entry may not outlive the lease the call is about
                    // to set (it ends at the earliest `now + ttl`).
                    *expires = (*expires).min(now + ttl);
                    Begin::Bypass { expires: now + ttl }
                } else {
                    Begin::Hit(Acquire::Held {
                        retry_after: Some(*expires - now),
                    })
                }
            }
            Some(Slot::Pending {
                leader,
                marked: leader_marked,
                waiters,
            }) => {
                if leader == token {
                    return Begin::Bypass { expires: now + ttl };
                }
                let (tx, rx) = oneshot::channel();
                waiters.push(tx);
                Begin::Wait {
                    answer: rx,
                    marked: *leader_marked,
                }
            }
            None => {
                let pending = Slot::Pending {
                    leader: *token,
                    marked,
                    waiters: Vec::new(),
                };
                let hash = slot_key.hash();
                shard.insert_and_sweep(slot_key, pending, now);
                Begin::Lead(Lead {
                    table: self.clone(),
                    key: key.clone(),
                    hash,
                    token: *token,
                    expires: now + ttl,
                    done: false,
                })
            }
        }
    }

    /// The leader's answer: record it and pass it to the waiters (`hash`:
    /// the key's, from [`begin`](Self::begin)).
    fn finish(
        &self,
        key: &Bytes,
        hash: u64,
        token: &Token,
        answer: Option<Acquire>,
        expires: Instant,
    ) {
        let key = self.slots.key_hashed(key, hash);
        let mut shard = self.slots.shard(key);
        let Some(slot) = shard.get_mut(key) else {
            return;
        };
        let waiters = match slot {
            Slot::Pending {
                leader, waiters, ..
            } if leader == token => std::mem::take(waiters),
            // Not ours any more (cannot happen while we lead; be safe).
            _ => return,
        };
        let now = Instant::now();
        let told = match answer {
            Some(Acquire::Acquired { .. }) if expires > now => {
                *slot = Slot::Held {
                    token: *token,
                    expires,
                };
                Some(Acquire::Held {
                    retry_after: Some(expires - now),
                })
            }
            Some(held @ Acquire::Held { .. }) => {
                shard.remove(key);
                Some(held)
            }
            // An error, a cancelled call, or an answer that came after the
            // lease would already have expired: remember nothing.
            _ => {
                shard.remove(key);
                None
            }
        };
        drop(shard);
        if let Some(told) = told {
            for w in waiters {
                let _ = w.send(told);
            }
        }
        // Without an answer the waiters' senders drop here and each of them
        // asks the backend itself.
    }

    /// The backend's answer to a re-acquire of our own lease
    /// ([`Begin::Bypass`]): acquired, the entry may live until `expires`;
    /// held by another token, it goes; an error changes nothing.
    pub(crate) fn reacquired(
        &self,
        key: &Bytes,
        token: &Token,
        expires: Instant,
        answer: &Result<Acquire, BackendError>,
    ) {
        match answer {
            Ok(Acquire::Acquired { .. }) => self.extended(key, token, expires),
            Ok(Acquire::Held { .. }) => self.forget(key, token),
            Err(_) => {}
        }
    }

    /// Forget our entry for `key` (release, or an extend the backend refused).
    pub(crate) fn forget(&self, key: &Bytes, token: &Token) {
        let (mut shard, key) = self.slots.lock(key);
        if matches!(shard.get(key), Some(Slot::Held { token: t, .. }) if t == token) {
            shard.remove(key);
        }
    }

    /// Before a call that resets our lease to end at the earliest `expires`
    /// (an extend, a re-acquire): the entry may not live longer than that.
    pub(crate) fn shorten(&self, key: &Bytes, token: &Token, expires: Instant) {
        self.change_expiry(key, token, |e| e.min(expires));
    }

    /// After the backend confirmed a call that set our lease to end at the
    /// earliest `expires` (the entry was shortened to at most that before
    /// the call).
    fn extended(&self, key: &Bytes, token: &Token, expires: Instant) {
        self.change_expiry(key, token, |e| e.max(expires));
    }

    /// Set the expiry of our own held entry for `key` to `f(expiry)`.
    fn change_expiry(&self, key: &Bytes, token: &Token, f: impl FnOnce(Instant) -> Instant) {
        let (mut shard, key) = self.slots.lock(key);
        if let Some(Slot::Held { token: t, expires }) = shard.get_mut(key) {
            if t == token {
                *expires = f(*expires);
            }
        }
    }

    /// The backend's answer to an extend of our lease to `expires`
    /// (shortened before it was sent): done, the entry may live until then;
    /// refused, it goes; an error changes nothing.
    pub(crate) fn extend_answered(
        &self,
        key: &Bytes,
        token: &Token,
        expires: Instant,
        answer: &Result<bool, BackendError>,
    ) {
        match answer {
            Ok(true) => self.extended(key, token, expires),
            Ok(false) => self.forget(key, token),
            Err(_) => {}
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.len()
    }
}

/// The leader's claim on a `Pending` slot ([`Begin::Lead`]): reported with
/// [`finish`](Self::finish); dropped unfinished (deadline, client gone)
/// the slot is cleared and the waiters go on alone.
pub(crate) struct Lead {
    table: Arc<InFlight>,
    key: Bytes,
    /// `key`'s hash in the table.
    hash: u64,
    token: Token,
    expires: Instant,
    done: bool,
}

impl Lead {
    /// The backend's answer (`None`: an error): recorded (an acquired lease
    /// until call start + TTL) and passed to the waiters.
    pub(crate) fn finish(mut self, answer: Option<Acquire>) {
        self.done = true;
        self.table
            .finish(&self.key, self.hash, &self.token, answer, self.expires);
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        if !self.done {
            self.table
                .finish(&self.key, self.hash, &self.token, None, self.expires);
        }
    }
}

#[cfg(test)]
mod tests;
