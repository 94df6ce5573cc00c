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

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::backend::expiring::{Entries, Expiring, ExpiringMap, Key};
use crate::backend::{Acquire, BackendError, BackendFuture, Token};

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
    /// `leader` is asking the backend; `waiters` want its answer.
    Pending {
        leader: Token,
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

/// What to do with an acquire.
enum Begin {
    /// Answer this without asking the backend.
    Local(Acquire),
    /// Wait for the leader's answer.
    Wait(oneshot::Receiver<Acquire>),
    /// Ask the backend and record the answer.
    Lead,
    /// Ask the backend, leave the table alone (re-entrant acquire).
    Bypass,
}

impl InFlight {
    /// What to do with an acquire of `key`, and the key's hash (for
    /// [`finish`](Self::finish)).
    fn begin(&self, key: &Bytes, token: &Token, ttl: Duration) -> (Begin, u64) {
        let now = Instant::now();
        let (mut shard, key) = self.slots.lock(key);
        (
            self.begin_locked(&mut shard, key, token, ttl, now),
            key.hash(),
        )
    }

    fn begin_locked(
        &self,
        shard: &mut Entries<Slot>,
        key: Key<'_>,
        token: &Token,
        ttl: Duration,
        now: Instant,
    ) -> Begin {
        match shard.live_mut(key, now) {
            Some(Slot::Held { token: t, expires }) => {
                if t == token {
                    // Our own lease, taken again, perhaps with a shorter TTL:
                    // the entry may not outlive the lease the call is about
                    // to set (it ends at the earliest `now + ttl`).
                    *expires = (*expires).min(now + ttl);
                    Begin::Bypass
                } else {
                    Begin::Local(Acquire::Held {
                        retry_after: Some(*expires - now),
                    })
                }
            }
            Some(Slot::Pending { leader, waiters }) => {
                if leader == token {
                    return Begin::Bypass;
                }
                let (tx, rx) = oneshot::channel();
                waiters.push(tx);
                Begin::Wait(rx)
            }
            None => {
                let pending = Slot::Pending {
                    leader: *token,
                    waiters: Vec::new(),
                };
                shard.insert_and_sweep(key, pending, now);
                Begin::Lead
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
            Slot::Pending { leader, waiters } if leader == token => std::mem::take(waiters),
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

    /// Forget our entry for `key` (release, or an extend the backend refused).
    pub(crate) fn forget(&self, key: &Bytes, token: &Token) {
        let (mut shard, key) = self.slots.lock(key);
        if matches!(shard.get(key), Some(Slot::Held { token: t, .. }) if t == token) {
            shard.remove(key);
        }
    }

    /// Before a call that resets our lease to end at the earliest `expires`
    /// (an extend, a re-acquire): the entry may not live longer than that.
    fn shorten(&self, key: &Bytes, token: &Token, expires: Instant) {
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

    /// Acquire through the table; `call` asks the backend.
    pub(crate) fn acquire<F, Fut>(
        self: &Arc<Self>,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
        call: F,
    ) -> BackendFuture<Acquire>
    where
        F: FnOnce(&Bytes, &Token, Duration) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Acquire, BackendError>> + Send + 'static,
    {
        let (begin, hash) = self.begin(key, token, ttl);
        match begin {
            Begin::Local(answer) => BackendFuture::ready(Ok(answer)),
            Begin::Bypass => {
                let expires = Instant::now() + ttl;
                let fut = call(key, token, ttl);
                let (table, key, token) = (self.clone(), key.clone(), *token);
                BackendFuture::new(async move {
                    let result = fut.await;
                    match result {
                        Ok(Acquire::Acquired { .. }) => table.extended(&key, &token, expires),
                        Ok(Acquire::Held { .. }) => table.forget(&key, &token),
                        Err(_) => {}
                    }
                    result
                })
            }
            Begin::Wait(rx) => {
                let (key, token) = (key.clone(), *token);
                BackendFuture::new(async move {
                    match rx.await {
                        Ok(answer) => Ok(answer),
                        // The leader failed or gave up: ask ourselves.
                        Err(_) => call(&key, &token, ttl).await,
                    }
                })
            }
            Begin::Lead => {
                let started = Instant::now();
                let fut = call(key, token, ttl);
                let mut lead = Lead {
                    table: self.clone(),
                    key: key.clone(),
                    hash,
                    token: *token,
                    expires: started + ttl,
                    done: false,
                };
                BackendFuture::new(async move {
                    let result = fut.await;
                    lead.done = true;
                    lead.table.finish(
                        &lead.key,
                        lead.hash,
                        &lead.token,
                        result.as_ref().ok().copied(),
                        lead.expires,
                    );
                    result
                })
            }
        }
    }

    /// Extend through the table: on success the local entry may live until
    /// `call start + ttl`; a refusal forgets it.
    pub(crate) fn extend(
        self: &Arc<Self>,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
        call: impl Future<Output = Result<bool, BackendError>> + Send + 'static,
    ) -> BackendFuture<bool> {
        let expires = Instant::now() + ttl;
        self.shorten(key, token, expires);
        let (table, key, token) = (self.clone(), key.clone(), *token);
        BackendFuture::new(async move {
            let result = call.await;
            match result {
                Ok(true) => table.extended(&key, &token, expires),
                Ok(false) => table.forget(&key, &token),
                Err(_) => {}
            }
            result
        })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.len()
    }
}

/// The leader's claim on a `Pending` slot; if the acquire future is dropped
/// (deadline, client gone) the slot is cleared and the waiters go on alone.
struct Lead {
    table: Arc<InFlight>,
    key: Bytes,
    /// `key`'s hash in the table.
    hash: u64,
    token: Token,
    expires: Instant,
    done: bool,
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
