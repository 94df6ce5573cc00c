//! The types of the store contract, for someone writing a store: what the
//! methods of [`LockBackend`](super::LockBackend) and
//! [`IdempotencyBackend`](super::IdempotencyBackend) take and return. An application
//! that only uses the crate's stores never names them.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;

use super::BackendError;
use crate::key::{KeySpace, LockKey};

/// What a store's method returns: its answer, either given in the call (an
/// in-process store: [`BackendFuture::ready`], no allocation, and the layer
/// takes it without a timer) or still on its way (a boxed `Send` future:
/// [`BackendFuture::new`]). Await it like any future.
///
/// ```
/// use tower_redis_lock::backend::contract::BackendFuture;
/// # async fn demo() {
/// let now: BackendFuture<bool> = BackendFuture::ready(Ok(true));
/// let later: BackendFuture<bool> = BackendFuture::new(async { Ok(false) });
/// assert!(now.await.unwrap());
/// assert!(!later.await.unwrap());
/// # }
/// ```
#[must_use = "a store's answer does nothing unless awaited"]
pub struct BackendFuture<T>(Answer<T>);

enum Answer<T> {
    /// Answered in the call; taken by the first poll.
    Ready(Option<Result<T, BackendError>>),
    /// On its way.
    Pending(Pin<Box<dyn Future<Output = Result<T, BackendError>> + Send + 'static>>),
}

impl<T> BackendFuture<T> {
    /// An answer still on its way: `future`, boxed.
    pub fn new(future: impl Future<Output = Result<T, BackendError>> + Send + 'static) -> Self {
        Self(Answer::Pending(Box::pin(future)))
    }

    /// An answer given in the call (what an in-process store returns).
    pub fn ready(result: Result<T, BackendError>) -> Self {
        Self(Answer::Ready(Some(result)))
    }

    /// The answer, if the store gave it in the call; else the future back,
    /// to await. Lets a caller skip timers and boxing for an in-process
    /// store.
    ///
    /// ```
    /// use tower_redis_lock::backend::contract::BackendFuture;
    /// assert!(matches!(BackendFuture::ready(Ok(1)).into_ready(), Ok(Ok(1))));
    /// assert!(BackendFuture::new(async { Ok(1) }).into_ready().is_err());
    /// ```
    pub fn into_ready(self) -> Result<Result<T, BackendError>, Self> {
        match self.0 {
            Answer::Ready(Some(result)) => Ok(result),
            other => Err(Self(other)),
        }
    }
}

// Never pinned structurally: the answer is moved out, the pending future
// is boxed.
impl<T> Unpin for BackendFuture<T> {}

impl<T> Future for BackendFuture<T> {
    type Output = Result<T, BackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.0 {
            Answer::Ready(result) => Poll::Ready(result.take().unwrap_or_else(|| {
                Err(BackendError::new(
                    "a store's answer was polled after it completed",
                ))
            })),
            Answer::Pending(future) => {
                let answer = future.as_mut().poll(cx);
                if answer.is_ready() {
                    // The store's future is done: dropped here, not with
                    // whoever holds this answer.
                    this.0 = Answer::Ready(None);
                }
                answer
            }
        }
    }
}

impl<T> fmt::Debug for BackendFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            Answer::Ready(_) => "BackendFuture::Ready",
            Answer::Pending(_) => "BackendFuture::Pending",
        })
    }
}

/// Outcome of [`LockBackend::acquire`](super::LockBackend::acquire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquire {
    /// The lease is ours.
    Acquired {
        /// Fencing token, when the backend issues one.
        fence: Option<u64>,
        /// How long, from this answer, the lease is safe to rely on when
        /// that is less than the TTL (Redlock: the TTL minus the time the
        /// quorum took minus the clock-drift allowance). `None`: the whole
        /// TTL.
        validity: Option<Duration>,
    },
    /// Someone else holds it.
    Held {
        /// How long the holder's lease has left, if known.
        retry_after: Option<Duration>,
    },
}

impl Acquire {
    /// The lease is ours for the whole TTL, with `fence` if the backend
    /// issues one (what a backend of your own answers; Redlock adds a
    /// validity).
    ///
    /// ```
    /// use tower_redis_lock::backend::contract::Acquire;
    /// assert_eq!(Acquire::acquired(None), Acquire::Acquired { fence: None, validity: None });
    /// ```
    pub fn acquired(fence: Option<u64>) -> Self {
        Self::Acquired {
            fence,
            validity: None,
        }
    }
}

/// The releases of one key as a backend hears them
/// ([`LockBackend::watch`](super::LockBackend::watch)), for the requests of
/// a lock layer that wait for the key
/// ([`RedisLockLayer::wait`](crate::RedisLockLayer::wait)).
///
/// A count that grows by at least one with every release of the key the
/// backend hears of (it need not start at zero, and may also grow when the
/// backend may have missed a release, so that waiters look again). The
/// waiter compares counts; it never reads a meaning into the number. The
/// watch ends ([`is_live`](Self::is_live) turns `false`) when the backend
/// stops hearing releases (its subscriber connection is gone): waiters then
/// look again with a bounded back-off.
///
/// A backend of your own makes one with [`Watch::new`] from the receiving
/// end of a [`tokio::sync::watch`] channel whose sender it bumps on each
/// release, and a value kept alive as long as the watch (dropping it is the
/// backend's cue to stop listening for the key).
///
/// ```
/// use tower_redis_lock::backend::contract::Watch;
/// let (tx, rx) = tokio::sync::watch::channel(0u64);
/// let watch = Watch::new(rx, ());
/// tx.send_modify(|n| *n += 1); // a release was heard
/// assert_eq!(watch.count(), 1);
/// ```
pub struct Watch {
    rx: tokio::sync::watch::Receiver<u64>,
    _keep: Box<dyn Send + Sync>,
}

impl Watch {
    /// A watch on the releases counted by `rx`'s sender, holding `keep`
    /// (a subscription handle, say) until it is dropped.
    pub fn new(rx: tokio::sync::watch::Receiver<u64>, keep: impl Send + Sync + 'static) -> Self {
        Self {
            rx,
            _keep: Box::new(keep),
        }
    }

    /// The releases counted so far.
    pub fn count(&self) -> u64 {
        *self.rx.borrow()
    }

    /// `false` once the backend stopped counting.
    pub fn is_live(&self) -> bool {
        self.rx.has_changed().is_ok()
    }

    /// Resolves once the count differs from `seen` (at once if it already
    /// does), or the watch ended (`false`).
    pub async fn changed_from(&self, seen: u64) -> bool {
        let mut rx = self.rx.clone();
        let changed = rx.wait_for(|n| *n != seen).await.is_ok();
        changed
    }
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field("count", &self.count())
            .field("live", &self.is_live())
            .finish()
    }
}

/// The owner's secret for one lease: when it was issued (48 bits) and 80
/// bits from a CSPRNG.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token([u8; 16]);

impl Token {
    /// A fresh token, unique and unpredictable. Its last 6 bytes are the
    /// time it was made (milliseconds since the Unix epoch, big endian): a
    /// store that finds a key held reads from the holder's token how long
    /// it has been held, in the same reply (the Redis store's native
    /// acquire does, instead of a `PTTL`). The first 10 bytes are keyed
    /// BLAKE3 of a per-process counter and the process id, under a key
    /// drawn once per process from the operating system's CSPRNG (one
    /// system call per process instead of one per token; the process id
    /// keeps a forked child's tokens apart from its parent's). One BLAKE3
    /// output block (64 bytes, one compression) makes four tokens, kept
    /// per thread until used (and dropped when the process id changed).
    ///
    /// # Panics
    /// If the operating system has no random source to give (it always has
    /// one on the platforms Tokio runs on).
    pub fn generate() -> Self {
        static KEY: std::sync::LazyLock<[u8; 32]> = std::sync::LazyLock::new(|| {
            let mut key = [0u8; 32];
            if let Err(e) = getrandom::fill(&mut key) {
                panic!("tower-redis-lock: the OS random source failed: {e}");
            }
            key
        });
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        /// Tokens drawn but not yet handed out on this thread.
        struct Drawn {
            block: [u8; 64],
            next: usize,
            pid: u32,
        }
        thread_local! {
            static DRAWN: std::cell::RefCell<Drawn> = const {
                std::cell::RefCell::new(Drawn { block: [0; 64], next: 4, pid: 0 })
            };
        }
        let pid = std::process::id();
        DRAWN.with(|drawn| {
            let mut drawn = drawn.borrow_mut();
            if drawn.next == 4 || drawn.pid != pid {
                let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mut input = [0u8; 12];
                input[..8].copy_from_slice(&n.to_le_bytes());
                input[8..].copy_from_slice(&pid.to_le_bytes());
                let mut hasher = blake3::Hasher::new_keyed(&KEY);
                hasher.update(&input);
                hasher.finalize_xof().fill(&mut drawn.block);
                drawn.next = 0;
                drawn.pid = pid;
            }
            let at = drawn.next * 16;
            drawn.next += 1;
            let mut bytes = [0u8; 16];
            bytes[..16 - issued::STAMP].copy_from_slice(&drawn.block[at..at + 16 - issued::STAMP]);
            issued::stamp(&mut bytes, issued::now_ms());
            Self(bytes)
        })
    }

    /// Build a token from raw bytes (tests, custom backends).
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// The token as 32 lowercase hex characters (how it is stored in Redis).
    pub fn to_hex(&self) -> [u8; 32] {
        // Written here rather than through the key module's encoder: every
        // store call of a request hex-encodes its token, and this keeps
        // that call inside the contract.
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 32];
        for (pair, b) in out.chunks_exact_mut(2).zip(self.0) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 0x0f)];
        }
        out
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only a prefix: enough to correlate logs, not to forge a release.
        let hex = self.to_hex();
        write!(f, "Token({}..)", String::from_utf8_lossy(&hex[..8]))
    }
}

/// Where one request's idempotency entry lives, and the scope (identity and
/// route) whose share of the store it counts against.
///
/// The entry is `prefix:{scope}:digest:idem` (hex digests; no raw user data):
/// the scope's digest is the Redis Cluster hash tag, so an entry and its
/// scope's quota keys share a slot and one script sees them all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryKey {
    /// The entry: `prefix:{scope}:digest:idem`; also its pub/sub channel.
    pub(crate) entry: Bytes,
    /// The scope's key prefix, `prefix:{scope}`.
    pub(crate) scope: Bytes,
    /// The entry's name inside its scope (the request digest, in hex).
    pub(crate) member: Bytes,
}

impl EntryKey {
    /// The entry of `digest` in `scope` under `key_space` (the layer makes
    /// these; a store's own tests may too).
    pub fn new(key_space: &KeySpace, scope: &LockKey, digest: &LockKey) -> Self {
        let member = Bytes::from(digest.to_hex());
        let scope_key = key_space.storage_key(scope);
        let mut entry = Vec::with_capacity(scope_key.len() + member.len() + 6);
        entry.extend_from_slice(&scope_key);
        entry.push(b':');
        entry.extend_from_slice(&member);
        entry.extend_from_slice(b":idem");
        Self {
            entry: entry.into(),
            scope: scope_key,
            member,
        }
    }

    /// The entry's key, `prefix:{scope}:digest:idem`: where it is stored,
    /// and the channel its publications are made on ([`IdempotencyBackend::feed`](super::IdempotencyBackend::feed)).
    pub fn entry(&self) -> &Bytes {
        &self.entry
    }

    /// The scope's key prefix, `prefix:{scope}`: what the quota of
    /// [`IdempotencyBackend::claim`](super::IdempotencyBackend::claim) counts per (derive a store's per-scope keys
    /// from it).
    pub fn scope(&self) -> &Bytes {
        &self.scope
    }

    /// The entry's name inside its scope (the request digest, in hex).
    pub fn member(&self) -> &Bytes {
        &self.member
    }
}

/// What [`IdempotencyBackend::claim`](super::IdempotencyBackend::claim) found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The key is ours: the handler runs.
    Claimed,
    /// Another request with this key and fingerprint is running.
    InFlight {
        /// Time left on its claim, if known.
        retry_after: Option<Duration>,
    },
    /// The key was used with a different fingerprint.
    Mismatch,
    /// The first request completed; its sealed record, as stored
    /// (untrusted until the layer opens it).
    Done(Bytes),
    /// The scope holds its whole share; nothing was claimed.
    OverQuota {
        /// When the scope's oldest entry expires.
        retry_after: Duration,
    },
    /// The request that claimed this key ended its database transaction
    /// itself and something of it committed, without a record (a
    /// transactional store: the handler committed, then its process died,
    /// or it answered what the layer does not keep). The key is final: the
    /// layer answers `transaction-ended` every time, and never runs it
    /// again.
    Ended,
}

pub(crate) mod issued;
#[cfg(test)]
mod tests;
