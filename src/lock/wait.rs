//! The wait queue: requests that found their key held wait here, per key,
//! first come first served, instead of answering 409 at once
//! ([`RedisLockLayer::wait`](super::RedisLockLayer::wait)).
//!
//! Only the **head** of a key's queue acts; the others wait, holding
//! nothing (no lease, no Redis command; only their wait bound's timer),
//! until they are the head.
//! The head listens on the backend's [`Watch`] of the key (subscribed by
//! the first head of a waiting episode; the last waiter to leave drops it,
//! which unsubscribes) and takes one look at the store, one acquire, when
//!
//! - the watch counted a release since its last look (a release in this
//!   process is counted in the call; from another instance, when the
//!   backend hears it),
//! - the holder's lease expires (its remaining time came with the refused
//!   acquire): an expired lease is no release,
//! - or, when the backend hears nothing (no watch, or it ended), its
//!   back-off runs out: 25 ms, doubling to 400 ms, never past the expiry.
//!
//! So one release admits at most one waiter of this layer per instance, and
//! while the holder holds, the head sends nothing. A request that arrives
//! while others wait for its key here queues behind them without asking
//! the store, so it cannot take a lease released in front of them. A head that takes the
//! lease, or gives up, or whose client goes away (its future dropped)
//! leaves at once, and the next waiter is the head, with what the last one
//! knew (the count it saw, the holder's expiry). The counts are compared,
//! never reset, so a release that happened while the head was asking the
//! store is not lost: the head looks again at once.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::contract::Watch;

/// Default most waiters per key (per layer and instance).
pub(crate) const DEFAULT_PER_KEY: usize = 64;
/// Default most waiters in all (per layer and instance).
pub(crate) const DEFAULT_TOTAL: usize = 4096;
/// Default most request-body bytes held by waiters in all (per layer and
/// instance): 256 waiters at the default 64 KiB body limit.
pub(crate) const DEFAULT_BYTES: usize = 16 * 1024 * 1024;
/// First back-off between two looks when the backend hears nothing.
const BACKOFF_START: Duration = Duration::from_millis(25);
/// Longest back-off between two looks.
const BACKOFF_MAX: Duration = Duration::from_millis(400);

/// The wait queues of one layer (shared by its clones, services and
/// lockers).
#[derive(Debug, Default)]
pub(crate) struct WaitQueue {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    keys: HashMap<Bytes, KeyQueue>,
    total: usize,
    /// Request-body bytes the waiters hold.
    bytes: usize,
    next: u64,
}

/// Whether the head hears releases of its key.
#[derive(Debug)]
enum Watching {
    /// Not asked yet (the next head asks).
    Unknown,
    /// The backend counts the key's releases.
    Live(Arc<Watch>),
    /// The backend hears nothing (or the watch ended): back-off.
    Off,
}

#[derive(Debug)]
struct KeyQueue {
    /// Ids and wake-ups, in arrival order; the front is the head.
    waiters: VecDeque<(u64, Arc<Notify>)>,
    watching: Watching,
    /// The release count at the last look.
    seen: u64,
    /// Look now (a watch was just made: a release may have come before it).
    look_now: bool,
    /// When the holder's lease expires, from the last look.
    expires: Instant,
    /// The next pause between two looks without a watch.
    backoff: Duration,
    /// When the next look without a watch is due.
    next_look: Instant,
}

/// Why a request cannot wait.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Full {
    /// Its key's queue holds `per_key` waiters.
    Key,
    /// This layer's queues hold `total` waiters.
    Total,
    /// This layer's waiters hold its most request-body bytes.
    Bytes,
}

/// What the head does next.
pub(crate) enum Next {
    /// Ask the backend to watch the key (then [`Ticket::watched`]).
    Watch,
    /// Look at the store now (then [`Ticket::found_held`] or leave).
    Look,
    /// Wait until `at`, or until the watch's count leaves `seen`.
    Sleep {
        watch: Option<Arc<Watch>>,
        seen: u64,
        at: Instant,
    },
}

/// One request's place in a key's queue; leaves it when dropped.
#[derive(Debug)]
pub(crate) struct Ticket {
    queue: Arc<WaitQueue>,
    key: Bytes,
    id: u64,
    wake: Arc<Notify>,
    /// The request-body bytes this waiter holds.
    bytes: usize,
}

/// The bounds of [`WaitQueue::enter`]: waiters per key and in all, and the
/// request-body bytes they hold in all.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub(crate) per_key: usize,
    pub(crate) total: usize,
    pub(crate) bytes: usize,
}

impl WaitQueue {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Join the queue of `key`, whose holder's lease expires at `expires`,
    /// holding `bytes` of request body, unless it holds `bounds.per_key`
    /// waiters, or the layer `bounds.total`, or this one's bytes would
    /// take the layer's waiters past `bounds.bytes`.
    pub(crate) fn enter(
        self: &Arc<Self>,
        key: &Bytes,
        expires: Instant,
        bounds: Bounds,
        bytes: usize,
    ) -> Result<Ticket, Full> {
        let Bounds { per_key, total, .. } = bounds;
        let mut state = self.lock();
        if state.total >= total {
            return Err(Full::Total);
        }
        if state.bytes.saturating_add(bytes) > bounds.bytes {
            return Err(Full::Bytes);
        }
        let id = state.next;
        let now = Instant::now();
        let queue = state.keys.entry(key.clone()).or_insert_with(|| KeyQueue {
            waiters: VecDeque::new(),
            watching: Watching::Unknown,
            seen: 0,
            look_now: false,
            expires,
            backoff: BACKOFF_START,
            next_look: now + BACKOFF_START,
        });
        if queue.waiters.len() >= per_key {
            return Err(Full::Key);
        }
        let wake = Arc::new(Notify::new());
        queue.waiters.push_back((id, wake.clone()));
        state.next += 1;
        state.total += 1;
        state.bytes += bytes;
        Ok(Ticket {
            queue: self.clone(),
            key: key.clone(),
            id,
            wake,
            bytes,
        })
    }

    /// When the lease on `key` expires, as its waiters here last saw it
    /// (none wait for it: unknown).
    pub(crate) fn holder_expires(&self, key: &[u8]) -> Option<Instant> {
        self.lock().keys.get(key).map(|q| q.expires)
    }

    /// Whether requests wait for `key` here now: a newcomer then queues
    /// behind them without asking the store (no barging past them).
    pub(crate) fn is_waiting(&self, key: &[u8]) -> bool {
        self.lock().keys.contains_key(key)
    }

    /// Waiters on `key` now.
    #[cfg(test)]
    pub(crate) fn len(&self, key: &[u8]) -> usize {
        self.lock().keys.get(key).map_or(0, |q| q.waiters.len())
    }

    /// Waiters in all now.
    #[cfg(test)]
    pub(crate) fn total(&self) -> usize {
        self.lock().total
    }

    /// Request-body bytes the waiters hold now.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

impl Ticket {
    fn with<T>(&self, f: impl FnOnce(&mut KeyQueue) -> T) -> T {
        let mut state = self.queue.lock();
        let queue = state
            .keys
            .get_mut(&self.key)
            .expect("tower-redis-lock: a ticket's queue outlived its waiters");
        f(queue)
    }

    /// Whether this request is the head of its queue.
    pub(crate) fn is_head(&self) -> bool {
        self.with(|q| q.waiters.front().is_some_and(|(id, _)| *id == self.id))
    }

    /// Resolves once this request is the head.
    pub(crate) async fn head(&self) {
        loop {
            let notified = self.wake.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.is_head() {
                return;
            }
            notified.await;
        }
    }

    /// What the head does next, at `now`.
    pub(crate) fn next(&self, now: Instant) -> Next {
        self.with(|q| {
            let watch = match &q.watching {
                Watching::Unknown => return Next::Watch,
                Watching::Live(watch) if !watch.is_live() => {
                    q.watching = Watching::Off;
                    q.next_look = now;
                    None
                }
                Watching::Live(watch) => Some(watch.clone()),
                Watching::Off => None,
            };
            let released = watch.as_ref().is_some_and(|w| w.count() != q.seen);
            let due = match &watch {
                Some(_) => q.expires,
                None => q.next_look.min(q.expires),
            };
            if q.look_now || released || now >= due {
                return Next::Look;
            }
            Next::Sleep {
                watch,
                seen: q.seen,
                at: due,
            }
        })
    }

    /// The backend's answer to [`Next::Watch`]: a watch (look at once: a
    /// release may have come before it), or none (back-off).
    pub(crate) fn watched(&self, watch: Option<Watch>) {
        self.with(|q| match watch {
            Some(watch) => {
                q.seen = watch.count();
                q.watching = Watching::Live(Arc::new(watch));
                q.look_now = true;
            }
            None => {
                q.watching = Watching::Off;
                q.look_now = true;
            }
        })
    }

    /// About to look at the store at `now`: what counts from here on is new.
    pub(crate) fn looking(&self, now: Instant) {
        self.with(|q| {
            q.look_now = false;
            if let Watching::Live(watch) = &q.watching {
                q.seen = watch.count();
            }
            q.next_look = now + q.backoff;
            q.backoff = (q.backoff * 2).min(BACKOFF_MAX);
        })
    }

    /// The look found the key held, its lease expiring at `expires`.
    pub(crate) fn found_held(&self, expires: Instant) {
        self.with(|q| q.expires = expires)
    }

    /// The look took the lease, which expires at `expires`: the next head
    /// waits for its release (or its expiry). Releases counted until now
    /// were of earlier holders.
    pub(crate) fn took(&self, expires: Instant) {
        self.with(|q| {
            if let Watching::Live(watch) = &q.watching {
                q.seen = watch.count();
            }
            q.expires = expires;
            q.backoff = BACKOFF_START;
            q.next_look = Instant::now() + BACKOFF_START;
        })
    }

    /// When the holder's lease expires, as last seen.
    pub(crate) fn expires(&self) -> Instant {
        self.with(|q| q.expires)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.queue.lock();
        state.total -= 1;
        state.bytes -= self.bytes;
        let Some(queue) = state.keys.get_mut(&self.key) else {
            return;
        };
        let was_head = queue.waiters.front().is_some_and(|(id, _)| *id == self.id);
        queue.waiters.retain(|(id, _)| *id != self.id);
        match queue.waiters.front() {
            // The next waiter's turn.
            Some((_, wake)) if was_head => wake.notify_one(),
            Some(_) => {}
            // The last one: its watch goes (the backend stops listening).
            None => {
                let gone = state.keys.remove(&self.key);
                drop(state);
                drop(gone);
            }
        }
    }
}

#[cfg(test)]
mod tests;
