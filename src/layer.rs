//! [`RedisLockLayer`] and its builder.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Response;
use tower_layer::Layer;

use crate::backend::{Acquire, BackendError, LockBackend, Token};
use crate::key::{DigestKey, KeyPart, KeyWriter, LockKey, Method, Route};
use crate::lease::{Lease, LeaseGuard, LeaseStatus};
use crate::renew::{RenewTarget, Renewal, Watchdog};
use crate::response::{Rejection, Responder};
use crate::service::RedisLock;
use crate::stats::{LockStats, Outcome};

/// Default lease time to live: 10 s.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);
/// Default deadline for every backend call: 200 ms.
pub const DEFAULT_DEADLINE: Duration = Duration::from_millis(200);
/// Default key prefix: `trl`.
pub const DEFAULT_PREFIX: &str = "trl";
/// Default body limit for the body digest: 64 KiB.
pub const DEFAULT_BODY_LIMIT: usize = 64 * 1024;
/// Default deadline for receiving the whole body when it is digested: 10 s.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// What to do when the backend fails or misses its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailPolicy {
    /// Answer 503 with `Retry-After` (the default): never risk a double run.
    #[default]
    Closed,
    /// Run the handler unlocked (the lease says
    /// [`LeaseStatus::FailOpen`]): availability over exclusion.
    Open,
}

/// What to do when a key part cannot be derived (no identity, no header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingPartPolicy {
    /// Answer with the part's status (401 for identities, 400 otherwise).
    #[default]
    Reject,
    /// Run the handler unlocked (the lease says [`LeaseStatus::Skipped`]).
    Skip,
}

/// When the lease is given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReleaseMode {
    /// Release when the response body ends, and *before* its end is reported
    /// to the server, so a client that read the whole response can repeat the
    /// request at once (the default).
    #[default]
    OnCompletion,
    /// Start the release when the response body ends but do not wait for it:
    /// saves the release round trip from the response's tail latency, at the
    /// risk of a spurious 409 for a client that repeats immediately.
    FireAndForget,
    /// Debounce: keep the lease for its whole TTL after a response, so a
    /// repeat within the window is rejected even after completion. (On error,
    /// cancellation or panic before a response the lease is still released.)
    HoldUntilTtl,
}

/// Marker: the key does not include the request body.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoBodyDigest;

/// Marker: the key includes a digest of the request body, which is buffered
/// up to a limit. Set with [`RedisLockLayer::body_digest`].
#[derive(Debug, Clone, Copy, Default)]
pub struct BodyDigest;

/// Configuration shared by a layer, its services and their futures.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) backend: Arc<dyn LockBackend>,
    pub(crate) key: Arc<dyn KeyPart>,
    pub(crate) digest_key: DigestKey,
    pub(crate) prefix: Arc<str>,
    pub(crate) ttl: Duration,
    pub(crate) deadline: Duration,
    pub(crate) fail: FailPolicy,
    pub(crate) missing: MissingPartPolicy,
    pub(crate) release: ReleaseMode,
    pub(crate) body_limit: usize,
    pub(crate) body_timeout: Duration,
    pub(crate) responder: Option<Responder>,
    pub(crate) stats: LockStats,
    pub(crate) renewal: Option<Renewal>,
    pub(crate) fencing: bool,
}

/// Result of trying to admit a request.
pub(crate) enum Admission {
    /// Lease held (guard releases it).
    Locked(LeaseGuard, Lease),
    /// Run without a lease (fail-open or skipped).
    Unlocked(Lease),
    /// Answer with this instead.
    Rejected(Rejection),
}

/// A request that goes on without a lease.
pub(crate) enum NoLease {
    /// Answer with this.
    Reject(Rejection),
    /// Run the handler unlocked.
    Unlocked(Lease),
}

impl Shared {
    pub(crate) fn key_writer(&self) -> KeyWriter {
        KeyWriter::new(&self.digest_key)
    }

    /// Derive the key from the request head; `Err` says how to go on without
    /// a lease.
    pub(crate) fn derive(&self, parts: &http::request::Parts) -> Result<KeyWriter, NoLease> {
        let mut writer = self.key_writer();
        match self.key.write(parts, &mut writer) {
            Ok(()) => Ok(writer),
            Err(missing) => Err(match self.missing {
                MissingPartPolicy::Reject => {
                    tracing::debug!(
                        part = missing.part(),
                        outcome = "missing_part",
                        "rejected: {missing}"
                    );
                    NoLease::Reject(Rejection::MissingPart(missing))
                }
                MissingPartPolicy::Skip => {
                    self.stats.record(Outcome::Skipped);
                    tracing::debug!(part = missing.part(), outcome = "skipped");
                    NoLease::Unlocked(Lease::new(None, LeaseStatus::Skipped, self.ttl, None))
                }
            }),
        }
    }

    /// One backend round trip (with deadline) to take the lease on `key`, in
    /// a `lock` span that names the key digest.
    pub(crate) async fn acquire(self: Arc<Self>, key: LockKey) -> Admission {
        let span = tracing::debug_span!("lock", key = %key);
        tracing::Instrument::instrument(self.acquire_in_span(key), span).await
    }

    async fn acquire_in_span(self: Arc<Self>, key: LockKey) -> Admission {
        let storage = key.storage_key(&self.prefix);
        let token = Token::generate();
        let started = Instant::now();
        let call = if self.fencing {
            self.backend.acquire_fenced(&storage, &token, self.ttl)
        } else {
            self.backend.acquire(&storage, &token, self.ttl)
        };
        // If this future is dropped (client gone) or gives up before the
        // answer, the command may still land: clean up after it.
        let mut pending = PendingAcquire {
            backend: self.backend.clone(),
            storage: storage.clone(),
            key,
            token,
            // Until a late lease would expire on its own.
            wait: self.ttl.max(self.deadline),
            armed: true,
        };
        let result = tokio::time::timeout(self.deadline, call).await;
        if matches!(result, Ok(Ok(_))) {
            pending.armed = false;
        }
        drop(pending);
        let latency = started.elapsed();
        let latency_us = latency.as_micros() as u64;
        self.stats.acquire_latency(latency, result.is_err());
        match result {
            Ok(Ok(Acquire::Acquired { fence })) => {
                self.stats.record(Outcome::Acquired);
                tracing::debug!(key = %key, outcome = "acquired", latency_us, fence);
                let mut lease = Lease::new(Some(key), LeaseStatus::Locked, self.ttl, fence);
                let mut guard = LeaseGuard::new(
                    self.backend.clone(),
                    storage.clone(),
                    key,
                    token,
                    self.deadline,
                );
                guard.set_stats(self.stats.clone());
                if let Some(renewal) = self.renewal {
                    guard.set_watchdog(Watchdog::spawn(
                        renewal,
                        RenewTarget {
                            backend: self.backend.clone(),
                            key: storage,
                            digest: key,
                            token,
                            ttl: self.ttl,
                            deadline: self.deadline,
                            stats: self.stats.clone(),
                            state: lease.watch(),
                            since: started,
                        },
                    ));
                }
                Admission::Locked(guard, lease)
            }
            Ok(Ok(Acquire::Held { retry_after })) => {
                self.stats.record(Outcome::Conflict);
                tracing::debug!(key = %key, outcome = "conflict", latency_us);
                Admission::Rejected(Rejection::Conflict {
                    key,
                    retry_after: retry_after.unwrap_or(self.ttl),
                })
            }
            Ok(Err(error)) => self.backend_failed(key, error, latency_us),
            Err(_) => self.backend_failed(key, BackendError::timeout(self.deadline), latency_us),
        }
    }

    fn backend_failed(&self, key: LockKey, error: BackendError, latency_us: u64) -> Admission {
        match self.fail {
            FailPolicy::Closed => {
                self.stats.record(Outcome::BackendError);
                tracing::warn!(key = %key, outcome = "backend_error", latency_us, error = %error, "lock backend failed; answering 503 (fail-closed)");
                Admission::Rejected(Rejection::Unavailable {
                    retry_after: Duration::from_secs(1),
                })
            }
            FailPolicy::Open => {
                self.stats.record(Outcome::FailOpen);
                tracing::warn!(key = %key, outcome = "fail_open", latency_us, error = %error, "lock backend failed; running unlocked (fail-open)");
                Admission::Unlocked(Lease::new(Some(key), LeaseStatus::FailOpen, self.ttl, None))
            }
        }
    }

    /// The response for a rejection: the user's responder or problem+json.
    pub(crate) fn reject(&self, rejection: &Rejection) -> Response<Bytes> {
        match &self.responder {
            Some(f) => f(rejection),
            None => rejection.to_response(),
        }
    }
}

/// An acquire in flight. Dropped while armed (it failed, missed its
/// deadline, or its future was dropped because the client went away), it
/// sends a best-effort compare-and-delete with our token in the background:
/// if the command still lands, the late lease blocks no one for a whole TTL
/// (a single fred client keeps the order, so the release follows it).
struct PendingAcquire {
    backend: Arc<dyn LockBackend>,
    storage: Bytes,
    key: LockKey,
    token: Token,
    wait: Duration,
    armed: bool,
}

impl Drop for PendingAcquire {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(cleanup_late_acquire(
                self.backend.clone(),
                self.storage.clone(),
                self.key,
                self.token,
                self.wait,
            ));
        }
    }
}

async fn cleanup_late_acquire(
    backend: Arc<dyn LockBackend>,
    storage: Bytes,
    key: LockKey,
    token: Token,
    deadline: Duration,
) {
    match tokio::time::timeout(deadline, backend.release(&storage, &token)).await {
        Ok(Ok(true)) => {
            tracing::debug!(key = %key, outcome = "late_acquire_cleaned", "an acquire that landed after its deadline was released")
        }
        Ok(Ok(false)) => {}
        Ok(Err(_)) | Err(_) => {
            tracing::debug!(key = %key, "cleanup after a timed-out acquire failed; a late acquire expires after its TTL")
        }
    }
}

/// Layer that takes a lease per request and answers duplicates with 409.
///
/// Built with a consuming builder; every setting has a default:
///
/// | setting | default |
/// |---|---|
/// | [`key`](Self::key) | `(Method, Route)` |
/// | [`ttl`](Self::ttl) | 10 s ([`DEFAULT_TTL`]) |
/// | [`deadline`](Self::deadline) | 200 ms per backend call ([`DEFAULT_DEADLINE`]) |
/// | [`fail_policy`](Self::fail_policy) | [`FailPolicy::Closed`] (503) |
/// | [`on_missing_part`](Self::on_missing_part) | [`MissingPartPolicy::Reject`] |
/// | [`release_mode`](Self::release_mode) | [`ReleaseMode::OnCompletion`] |
/// | [`prefix`](Self::prefix) | `trl` |
/// | [`secret`](Self::secret) | none (public digest key) |
///
/// ```
/// use std::time::Duration;
/// use tower_redis_lock::{key::{Method, Route, TrustedHeader}, MemoryBackend, RedisLockLayer};
///
/// let layer = RedisLockLayer::new(MemoryBackend::new())
///     .key((Method, Route, TrustedHeader::new("x-user-id")))
///     .ttl(Duration::from_secs(30))
///     .body_digest(16 * 1024);
/// # let _ = layer;
/// ```
#[must_use]
pub struct RedisLockLayer<D = NoBodyDigest> {
    pub(crate) shared: Arc<Shared>,
    _digest: PhantomData<fn() -> D>,
}

impl<D> Clone for RedisLockLayer<D> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            _digest: PhantomData,
        }
    }
}

impl<D> fmt::Debug for RedisLockLayer<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shared;
        f.debug_struct("RedisLockLayer")
            .field("backend", &s.backend)
            .field("prefix", &s.prefix)
            .field("ttl", &s.ttl)
            .field("deadline", &s.deadline)
            .field("fail", &s.fail)
            .field("missing", &s.missing)
            .field("release", &s.release)
            .field("body_digest", &std::any::type_name::<D>())
            .field("body_limit", &s.body_limit)
            .finish_non_exhaustive()
    }
}

impl RedisLockLayer<NoBodyDigest> {
    /// A layer over `backend` with the defaults in the table above.
    pub fn new(backend: impl LockBackend) -> Self {
        Self::from_arc(Arc::new(backend))
    }

    /// A layer over a shared backend.
    pub fn from_arc(backend: Arc<dyn LockBackend>) -> Self {
        Self {
            shared: Arc::new(Shared {
                backend,
                key: Arc::new((Method, Route)),
                digest_key: DigestKey::public(),
                prefix: Arc::from(DEFAULT_PREFIX),
                ttl: DEFAULT_TTL,
                deadline: DEFAULT_DEADLINE,
                fail: FailPolicy::Closed,
                missing: MissingPartPolicy::Reject,
                release: ReleaseMode::OnCompletion,
                body_limit: DEFAULT_BODY_LIMIT,
                body_timeout: DEFAULT_BODY_TIMEOUT,
                responder: None,
                stats: LockStats::new(),
                renewal: None,
                fencing: false,
            }),
            _digest: PhantomData,
        }
    }

    /// Add a digest of the request body to the key, buffering at most `limit`
    /// bytes (413 problem+json beyond it; a declared `Content-Length` over the
    /// limit is refused before anything is read). The handler still receives
    /// the body byte for byte (as one chunk; trailers are not forwarded).
    ///
    /// The request body type must be rebuildable from bytes (`From<Bytes>`):
    /// axum's `Body`, `Full<Bytes>`, `String`... With hyper's `Incoming`,
    /// map the body to one of those first.
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).body_digest(64 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn body_digest(self, limit: usize) -> RedisLockLayer<BodyDigest> {
        let mut layer = RedisLockLayer {
            shared: self.shared,
            _digest: PhantomData,
        };
        layer.shared_mut().body_limit = limit;
        layer
    }
}

impl<D> RedisLockLayer<D> {
    fn shared_mut(&mut self) -> &mut Shared {
        Arc::make_mut(&mut self.shared)
    }

    /// Which request parts make up the key (default `(Method, Route)`).
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer, key::{Method, Path}};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).key((Method, Path));
    /// # let _ = layer;
    /// ```
    pub fn key(mut self, key: impl KeyPart) -> Self {
        self.shared_mut().key = Arc::new(key);
        self
    }

    /// Lease time to live: the safety net if a release never arrives (crash,
    /// partition). Choose it longer than the slowest handler. Values under
    /// 1 ms are raised to 1 ms.
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).ttl(std::time::Duration::from_secs(30));
    /// # let _ = layer;
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.shared_mut().ttl = ttl.max(Duration::from_millis(1));
        self
    }

    /// Deadline for every backend call (acquire, release). On expiry the
    /// fail policy applies. Values under 1 ms are raised to 1 ms.
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).deadline(std::time::Duration::from_millis(100));
    /// # let _ = layer;
    /// ```
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.shared_mut().deadline = deadline.max(Duration::from_millis(1));
        self
    }

    /// Fail-closed (503, default) or fail-open when the backend fails.
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer, FailPolicy};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).fail_policy(FailPolicy::Open);
    /// # let _ = layer;
    /// ```
    pub fn fail_policy(mut self, policy: FailPolicy) -> Self {
        self.shared_mut().fail = policy;
        self
    }

    /// Reject (default) or run unlocked when a key part is missing.
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer, MissingPartPolicy};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).on_missing_part(MissingPartPolicy::Skip);
    /// # let _ = layer;
    /// ```
    pub fn on_missing_part(mut self, policy: MissingPartPolicy) -> Self {
        self.shared_mut().missing = policy;
        self
    }

    /// When the lease is given back (default: on completion, before the end
    /// of the response is reported).
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer, ReleaseMode};
    /// let debounce = RedisLockLayer::new(MemoryBackend::new()).release_mode(ReleaseMode::HoldUntilTtl);
    /// # let _ = debounce;
    /// ```
    pub fn release_mode(mut self, mode: ReleaseMode) -> Self {
        self.shared_mut().release = mode;
        self
    }

    /// Prefix of the backend keys (`prefix:{digest}`); default `trl`.
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).prefix("shop:lock");
    /// # let _ = layer;
    /// ```
    ///
    /// # Panics
    /// If `prefix` contains `{` or `}`: it would move the Redis Cluster hash
    /// tag out of the digest (a configuration error, caught at start-up).
    pub fn prefix(mut self, prefix: &str) -> Self {
        assert!(
            !prefix.contains(['{', '}']),
            "tower-redis-lock: the key prefix must not contain '{{' or '}}' (it would steer the Redis Cluster hash slot): {prefix:?}"
        );
        self.shared_mut().prefix = Arc::from(prefix);
        self
    }

    /// A secret that turns key digests into a MAC (BLAKE3 keyed mode), so
    /// low-entropy key material (user ids, amounts) cannot be recovered from
    /// Redis by guessing. Every instance sharing a backend must use the same
    /// secret. Without one, the first layer applied (or [`Locker`](crate::Locker)
    /// made) logs a warning, once per process.
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).secret(b"from your secret store");
    /// # let _ = layer;
    /// ```
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.shared_mut().digest_key = DigestKey::from_secret(secret.as_ref());
        self
    }

    /// Deadline for receiving the whole body when it is digested (default
    /// 10 s); a stalled upload gets 408 and never holds the lease, which is
    /// only taken after the body arrived.
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).body_timeout(std::time::Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.shared_mut().body_timeout = timeout;
        self
    }

    /// Replace the rejection responses (409, 503, 413, 408, 400, 401).
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).on_rejection(|r| {
    ///     let mut res = http::Response::new(bytes::Bytes::from("slow down"));
    ///     *res.status_mut() = r.status();
    ///     res
    /// });
    /// # let _ = layer;
    /// ```
    pub fn on_rejection<F>(mut self, f: F) -> Self
    where
        F: Fn(&Rejection) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.shared_mut().responder = Some(Arc::new(f));
        self
    }

    /// A [`Locker`](crate::Locker) with this layer's backend and settings,
    /// for taking leases from handlers (and the `LockGuard` extractor).
    pub fn locker(&self) -> crate::Locker {
        self.shared.digest_key.warn_if_public();
        crate::Locker::from_shared(self.shared.clone())
    }

    /// Renew the lease while the request runs (watchdog; off by default):
    /// see [`Renewal`] for the interval, the cap, and how a lost lease shows
    /// up in [`Lease::is_lost`].
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer, Renewal};
    /// let layer = RedisLockLayer::new(MemoryBackend::new()).renew(Renewal::new().max_renewals(10));
    /// # let _ = layer;
    /// ```
    pub fn renew(mut self, renewal: Renewal) -> Self {
        self.shared_mut().renewal = Some(renewal);
        self
    }

    /// Issue a fencing token with every lease (off by default): a number per
    /// key that only grows, taken in the same round trip as the lease
    /// (Redis: `INCR prefix:{digest}:fence`, a key that is kept, one per lock
    /// key). Read it with [`Lease::fence`] and let the storage you write to
    /// refuse stale writers:
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use tower_redis_lock::{key::{Method, Route, TrustedHeader}, Lease, MemoryBackend, RedisLockLayer};
    ///
    /// async fn pay(lease: Lease) -> &'static str {
    ///     let fence = lease.fence().expect("fencing is on") as i64;
    ///     // A request whose lease expired while it was paused cannot
    ///     // overwrite the work of the request that took the key after it:
    ///     //
    ///     //   UPDATE accounts SET balance = balance - $1, last_fence = $2
    ///     //    WHERE id = $3 AND last_fence < $2
    ///     //
    ///     // 0 rows updated: a newer holder already wrote; give up.
    ///     # let _ = fence;
    ///     "paid"
    /// }
    ///
    /// let lock = RedisLockLayer::new(MemoryBackend::new())
    ///     .key((Method, Route, TrustedHeader::new("x-user-id")))
    ///     .fencing(true);
    /// let app: Router = Router::new().route("/pay", post(pay).layer(lock));
    /// # let _ = app;
    /// ```
    pub fn fencing(mut self, on: bool) -> Self {
        self.shared_mut().fencing = on;
        self
    }

    /// Live outcome counters of this layer (shared with its clones, its
    /// services, its [`Locker`](crate::Locker) and layers derived from it).
    ///
    /// ```
    /// # use tower_redis_lock::{MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new());
    /// assert_eq!(layer.stats().snapshot().acquired, 0);
    /// ```
    pub fn stats(&self) -> LockStats {
        self.shared.stats.clone()
    }

    /// The backend's name (`"memory"`, `"redis"`).
    pub fn backend_name(&self) -> &'static str {
        self.shared.backend.name()
    }
}

impl<S, D> Layer<S> for RedisLockLayer<D> {
    type Service = RedisLock<S, D>;

    fn layer(&self, inner: S) -> Self::Service {
        self.shared.digest_key.warn_if_public();
        RedisLock::from_parts(inner, self.shared.clone())
    }
}
