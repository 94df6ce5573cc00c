//! [`RedisLockLayer`] and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::config::{Config, ReleaseMode};
use super::locker::Locker;
use super::renew::Renewal;
use super::service::RedisLock;
use crate::backend::LockBackend;
use crate::key::{KeyPart, KeySpace};
use crate::rejection::Rejection;
use crate::settings::{at_least_1ms, at_most_max, MAX_DURATION};
use crate::stats::LockStats;

/// Layer that takes a lease per request and answers duplicates with 409.
///
/// The key is required: it says which requests are "the same". Put the
/// caller's identity in it, or two different users of one route exclude each
/// other. Every other setting has a default:
///
/// | setting | default |
/// |---|---|
/// | [`ttl`](Self::ttl) | 10 s |
/// | [`deadline`](Self::deadline) | 200 ms per backend call |
/// | [`key_space`](Self::key_space) | prefix `trl`, no secret ([`KeySpace::default`](crate::key::KeySpace::default)) |
/// | [`body_limit`](Self::body_limit) | 64 KiB (413 beyond): the body is received whole before the lease is taken |
/// | [`body_timeout`](Self::body_timeout) | 10 s (408 beyond) |
/// | [`digest_body`](Self::digest_body) | off |
/// | [`stream_body`](Self::stream_body) | off: bodies are buffered, so a stalled upload holds no lease |
/// | [`fail_open`](Self::fail_open) | off: fail closed (503) |
/// | [`skip_missing_part`](Self::skip_missing_part) | off: a missing key part is rejected (401/400); a malformed one always is |
/// | [`fire_and_forget`](Self::fire_and_forget), [`hold_until_ttl`](Self::hold_until_ttl) | neither: the lease is released when the response ends, before its end is reported |
/// | [`renew`](Self::renew) | off |
/// | [`fencing`](Self::fencing) | off |
/// | [`wait`](Self::wait) | off: 409 at once for a held key |
/// | [`max_waiters`](Self::max_waiters) | 64 per key, 4096 in all (per instance) |
/// | [`max_waiting_bytes`](Self::max_waiting_bytes) | 16 MiB of buffered bodies held by waiters (per instance) |
/// | [`label`](Self::label) | `"lock"` |
/// | [`on_rejection`](Self::on_rejection) | RFC 9457 problem+json |
///
/// # Request bodies
///
/// The layer receives the whole request body (at most
/// [`body_limit`](Self::body_limit), within [`body_timeout`](Self::body_timeout))
/// *before* it takes the lease, so a client that stalls mid-body holds no
/// lease and cannot lock its key out; the handler then gets the same bytes
/// (as one chunk; trailers are not forwarded). For that the request body type
/// must be rebuildable from bytes (`From<Bytes>`): axum's `Body`,
/// `Full<Bytes>`. With hyper's `Incoming`, map the body to axum's `Body`
/// first. Routes that take large uploads opt out with
/// [`stream_body`](Self::stream_body), at the price of a lease held while
/// the client uploads.
///
/// The parameter `STREAM` says which: `false` (the default, what
/// [`new`](Self::new) builds) receives the body first; `true` (what
/// [`stream_body`](Self::stream_body) returns) takes the lease at the
/// request head and needs no `From<Bytes>`.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_lock::{key::{RequestMethod, Route, Header}, MemoryBackend, RedisLockLayer};
///
/// let layer = RedisLockLayer::new(
///     MemoryBackend::new(),
///     (RequestMethod, Route, Header::trusted_identity("x-user-id")),
/// )
/// .ttl(Duration::from_secs(30))
/// .digest_body();
/// # let _ = layer;
/// ```
#[must_use]
pub struct RedisLockLayer<const STREAM: bool = false> {
    pub(crate) config: Arc<Config>,
}

impl<const STREAM: bool> Clone for RedisLockLayer<STREAM> {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
        }
    }
}

impl<const STREAM: bool> fmt::Debug for RedisLockLayer<STREAM> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.config;
        f.debug_struct("RedisLockLayer")
            .field("backend", &s.backend)
            .field("key_space", &s.settings.key_space)
            .field("label", &s.stats.label())
            .field("ttl", &s.settings.ttl)
            .field("deadline", &s.settings.deadline)
            .field("fail_open", &s.fail_open)
            .field("skip_missing_part", &s.skip_missing)
            .field("release", &s.release)
            .field("stream_body", &STREAM)
            .field("body_limit", &s.settings.body_limit)
            .finish_non_exhaustive()
    }
}

impl RedisLockLayer {
    /// A layer over `backend`, keyed by `key`, with the defaults in the table
    /// above. A shared backend is an `Arc<B>` (or `Arc<dyn LockBackend>`).
    pub fn new(backend: impl LockBackend, key: impl KeyPart) -> Self {
        Self {
            config: Arc::new(Config::new(backend, key)),
        }
    }

    /// Add a digest of the request body to the key, buffering at most
    /// [`body_limit`](Self::body_limit) bytes (413 problem+json beyond it; a
    /// declared `Content-Length` over the limit is refused before anything is
    /// read). The handler still receives the body byte for byte (as one
    /// chunk; trailers are not forwarded).
    ///
    /// The request body type must be rebuildable from bytes (`From<Bytes>`),
    /// as without the digest: see [`RedisLockLayer`], "Request bodies".
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).digest_body();
    /// # let _ = layer;
    /// ```
    pub fn digest_body(mut self) -> Self {
        self.config_mut().digest = true;
        self
    }

    /// Do not buffer the request body: take the lease as soon as the request
    /// head arrives and let the handler stream the body (for uploads larger
    /// than any sensible [`body_limit`](Self::body_limit)).
    /// [`body_limit`](Self::body_limit) and [`body_timeout`](Self::body_timeout)
    /// no longer apply, and the request body type needs no `From<Bytes>`
    /// (hyper's `Incoming` works as it is).
    ///
    /// **The trade-off**: the lease is held while the client uploads. A slow
    /// or stalled client keeps every duplicate of its key at 409 until it
    /// finishes, its connection drops, or the TTL runs out (renewal, if on,
    /// keeps it longer). Put an upload deadline in front of such routes
    /// (a server read timeout, or `tower_http::timeout`), and key them so
    /// that only the uploader's own requests share the lease.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).stream_body();
    /// # let _ = layer;
    /// ```
    ///
    /// # Panics
    /// After [`digest_body`](Self::digest_body): a digest needs the whole
    /// body before the lease, which a streamed body never gives (every body
    /// would key alike). A configuration error, caught at start-up.
    pub fn stream_body(self) -> RedisLockLayer<true> {
        assert!(
            !self.config.digest,
            "tower-redis-lock: `stream_body()` after `digest_body()`: a body streamed to the handler cannot be digested before the lease is taken; choose one"
        );
        RedisLockLayer {
            config: self.config,
        }
    }
}

impl<const STREAM: bool> RedisLockLayer<STREAM> {
    fn config_mut(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// How long a lease lives without its release (default 10 s): the
    /// safety net if a process dies or a network splits. Choose it longer
    /// than the slowest handler, or [`renew`](Self::renew). Values under
    /// 1 ms are raised to 1 ms,
    /// and over ten years (`Duration::MAX` too) lowered to ten years.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).ttl(std::time::Duration::from_secs(30));
    /// # let _ = layer;
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config_mut().settings.ttl = at_least_1ms(ttl);
        self
    }

    /// Deadline for every backend call (default 200 ms). A call that misses
    /// it is answered by the fail policy (503, or the handler runs unlocked
    /// when [`fail_open`](Self::fail_open)), and whatever it may still do on
    /// the server is undone. Values under 1 ms are raised to 1 ms,
    /// and over ten years (`Duration::MAX` too) lowered to ten years.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).deadline(std::time::Duration::from_millis(100));
    /// # let _ = layer;
    /// ```
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.config_mut().settings.deadline = at_least_1ms(deadline);
        self
    }

    /// Where the keys live and how they are hashed (prefix and secret);
    /// give every layer of a fleet the same [`KeySpace`].
    ///
    /// ```
    /// # use tower_redis_lock::{key::{KeySpace, Route}, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).key_space(KeySpace::new("shop").secret(b"from your secret store"));
    /// # let _ = layer;
    /// ```
    pub fn key_space(mut self, space: KeySpace) -> Self {
        self.config_mut().settings.key_space = space;
        self
    }

    /// Largest request body received before the lease is taken (default
    /// 64 KiB): 413 problem+json beyond it, at once for a declared
    /// `Content-Length` over it. Not for a layer that streams its body
    /// ([`stream_body`](RedisLockLayer::stream_body)).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).body_limit(16 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn body_limit(mut self, limit: usize) -> Self {
        self.config_mut().settings.body_limit = limit;
        self
    }

    /// Time for the whole request body to arrive (default 10 s): a stalled
    /// upload gets 408, and never holds a lease, which is only taken once
    /// the body is in. Not for a layer that streams its body
    /// ([`stream_body`](RedisLockLayer::stream_body)).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).body_timeout(std::time::Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.config_mut().settings.body_timeout = at_most_max(timeout);
        self
    }

    /// Replace the layer's rejection answers (problem+json) with your own.
    /// The closure gets the [`Rejection`] and returns anything
    /// `axum::response::IntoResponse` (without the `axum` feature: an
    /// `http::Response` whose body is `Body<Data = Bytes>`, such as
    /// `Full<Bytes>`; the same closures work with the feature on). The body
    /// must be in memory (a string, JSON, bytes): a streaming body is
    /// replaced by the default answer, with an error in the log.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).on_rejection(|r| (r.status(), r.title()));
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "axum")]
    pub fn on_rejection<F, R>(mut self, f: F) -> Self
    where
        F: Fn(&Rejection) -> R + Send + Sync + 'static,
        R: axum::response::IntoResponse,
    {
        self.config_mut().settings.responder = Some(crate::rejection::responder(f));
        self
    }

    /// Replace the layer's rejection answers (problem+json) with your own
    /// `http::Response` (its body in memory, such as `Full<Bytes>`; with
    /// the `axum` feature anything `IntoResponse`).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).on_rejection(|r| http::Response::new(http_body_util::Full::new(bytes::Bytes::from(r.title()))));
    /// # let _ = layer;
    /// ```
    #[cfg(not(feature = "axum"))]
    pub fn on_rejection<F, B>(mut self, f: F) -> Self
    where
        F: Fn(&Rejection) -> http::Response<B> + Send + Sync + 'static,
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    {
        self.config_mut().settings.responder = Some(crate::rejection::responder(f));
        self
    }

    /// Fail open: when the backend fails or misses its deadline, run the
    /// handler unlocked (its [`Lease`](super::Lease) is not locked but has a key):
    /// availability over exclusion. By default the layer fails closed: 503
    /// with `Retry-After`, never a double run.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).fail_open();
    /// # let _ = layer;
    /// ```
    pub fn fail_open(mut self) -> Self {
        self.config_mut().fail_open = true;
        self
    }

    /// Run the handler unlocked when a key part cannot be derived (no
    /// identity, no header; its [`Lease`](super::Lease) is not locked and has
    /// no key). By default
    /// such a request is rejected with the part's status (401 for an
    /// identity, 400 otherwise). A part that is there but refused
    /// ([`MissingPart::malformed`](crate::key::MissingPart::malformed): a
    /// header sent more than once) is rejected all the same: a client that
    /// could add a second header line would otherwise choose to run
    /// unlocked.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).skip_missing_part();
    /// # let _ = layer;
    /// ```
    pub fn skip_missing_part(mut self) -> Self {
        self.config_mut().skip_missing = true;
        self
    }

    /// Start the release when the response body ends, but do not wait for
    /// it before reporting the end: saves the release round trip from the
    /// response's tail latency, at the risk of a spurious 409 for a client
    /// that repeats at once. (By default the release finishes before the end
    /// of the response is reported.) Replaces
    /// [`hold_until_ttl`](Self::hold_until_ttl).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).fire_and_forget();
    /// # let _ = layer;
    /// ```
    pub fn fire_and_forget(mut self) -> Self {
        self.config_mut().release = ReleaseMode::FireAndForget;
        self
    }

    /// Debounce: keep the lease for its whole TTL after a response, so a
    /// repeat within the window is rejected even after completion, with a
    /// `Retry-After` of the time the lease has left. On an
    /// error, a cancellation or a panic before a response the lease is
    /// still released. Replaces [`fire_and_forget`](Self::fire_and_forget).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let debounce = RedisLockLayer::new(MemoryBackend::new(), Route).hold_until_ttl();
    /// # let _ = debounce;
    /// ```
    pub fn hold_until_ttl(mut self) -> Self {
        self.config_mut().release = ReleaseMode::HoldUntilTtl;
        self
    }

    /// Renew the lease while the request runs (watchdog; off by default):
    /// see [`Renewal`] for the interval, the cap, and how a lost lease shows
    /// up in [`Lease::is_lost`](super::Lease::is_lost).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, lock::Renewal, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).renew(Renewal::new().max_renewals(10));
    /// # let _ = layer;
    /// ```
    pub fn renew(mut self, renewal: Renewal) -> Self {
        self.config_mut().renewal = Some(renewal);
        self
    }

    /// Issue a fencing token with every lease (off by default): a number per
    /// key that strictly increases, taken in the same round trip as the lease
    /// (Redis: `max(counter + 1, server clock in µs)` kept in
    /// `prefix:{digest}:fence`, which expires with its lease plus
    /// [`RedisBackend::fence_window`](crate::RedisBackend::fence_window)).
    /// Fences are large numbers (about 1.8e15, below 2^53: they fit an
    /// `i64` or a PostgreSQL `bigint`) with gaps: compare them with `>`,
    /// never count on `+ 1`. Read it with [`Lease::fence`](super::Lease::fence)
    /// and let the storage you write to refuse stale writers. A backend
    /// without fences gives `None` (`RedlockBackend`: a counter on each node
    /// would not be one sequence), so the `expect` below would panic there:
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use tower_redis_lock::{key::{RequestMethod, Route, Header}, Lease, MemoryBackend, RedisLockLayer};
    ///
    /// async fn pay(lease: Lease) -> &'static str {
    ///     let fence = lease.fence().expect("fencing is on") as i64;
    ///     // A request whose lease expired while it was paused cannot
    ///     // overwrite the work of the request that took the key after it:
    ///     //
    ///     //   UPDATE accounts SET fence = $2 WHERE id = $1 AND fence < $2 RETURNING balance
    ///     //   ... then write only WHERE id = $1 AND fence = $2
    ///     //
    ///     // 0 rows: a newer holder already claimed the row; give up.
    ///     # let _ = fence;
    ///     "paid"
    /// }
    ///
    /// let lock = RedisLockLayer::new(MemoryBackend::new(), (RequestMethod, Route, Header::trusted_identity("x-user-id")))
    ///     .fencing(true);
    /// let app: Router = Router::new().route("/pay", post(pay).layer(lock));
    /// # let _ = app;
    /// ```
    pub fn fencing(mut self, on: bool) -> Self {
        self.config_mut().fencing = on;
        self
    }

    /// Upper bound of the `Retry-After` of a 409. Default: none beyond the
    /// holder's remaining TTL.
    ///
    /// A 409's `Retry-After` is when the holder is expected to finish: the
    /// 90th percentile of how long this layer's last 64 holds took, minus
    /// how long the holder has held its lease already, at least 1 s and at
    /// most the holder's remaining TTL (and this cap). Until a layer has seen
    /// three holds it is how long the holder has held its lease so far (a
    /// hold is expected to last about as long again), with the same bounds;
    /// the TTL (capped) only when the store does not say how long the holder
    /// has left. See the crate docs, "Retry-After".
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).retry_after_cap(std::time::Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn retry_after_cap(mut self, cap: Duration) -> Self {
        self.config_mut().retry_after_cap = Some(cap.clamp(Duration::from_secs(1), MAX_DURATION));
        self
    }

    /// Wait up to `bound` for a held key instead of answering 409 at once
    /// (off by default; `Duration::ZERO` turns it off again): for routes
    /// where every request must run, one at a time per key (webhooks of one
    /// customer, debits of one account), rather than a double click to
    /// refuse. Past the bound the request gets the 409 with `Retry-After`
    /// it gets without waiting. A look at the store begun within the bound
    /// is answered (it is an acquire like any other, bounded by the
    /// [`deadline`](Self::deadline)): a request may wait up to the bound
    /// plus one deadline.
    ///
    /// What a waiting request holds and costs:
    ///
    /// - **No lease** while it waits, and nothing while it is not first:
    ///   the requests waiting for one key on one instance queue, first come
    ///   first served, and only the first one looks at the store, when the
    ///   key is released, when the holder's lease expires (its remaining
    ///   time came with the refused acquire), or, when the backend cannot
    ///   tell it of releases, with a back-off (25 ms doubling to 400 ms,
    ///   never past that expiry). Taking the lease is still one acquire,
    ///   which gives the fence and the TTL; a release admits at most one
    ///   waiter per instance.
    /// - **Woken by the release**: a release in this process is heard in the
    ///   call, without a round trip. On Redis, the first waiter of a key
    ///   subscribes to the key's channel (`SSUBSCRIBE`, sharded pub/sub, so
    ///   it works on a cluster), its acquire marks the key as waited for,
    ///   and the release script of any instance whose layer waits publishes
    ///   on that channel; the last waiter to leave unsubscribes, so an
    ///   instance hears only the keys it has waiters on. A release from a
    ///   layer that does not wait publishes nothing (its waiters elsewhere
    ///   wake at the lease's expiry): configure the fleet alike. If pub/sub
    ///   is refused by an ACL, or the subscriber connection fails, waiters
    ///   look with the back-off; after a reconnect each looks once more.
    /// - **What it costs in Redis commands**, beyond the refused acquire
    ///   that made it wait: the first waiter of a key on an instance
    ///   subscribes and the last one unsubscribes (shared by the waiters
    ///   behind it, which send nothing), and the head sends one acquire per
    ///   look (two when another request of the instance was already
    ///   asking for the key without the mark: the look then asks again,
    ///   to mark it): one right after subscribing (it marks the key), one per
    ///   release it hears (another instance may win it: then it waits
    ///   again), one at each expiry it was told of (with
    ///   [`renew`](Self::renew) the holder pushes its expiry out, so a
    ///   holder that runs N TTLs costs its waiters' head about N looks),
    ///   and, when releases cannot be heard (pub/sub refused, Redlock, the
    ///   subscriber down), one per back-off step: 25, 50, 100, 200 ms,
    ///   then every 400 ms until the bound (a 2 s bound: up to 8 looks;
    ///   10 s: up to 28). The look that takes the lease is the acquire a
    ///   plain request makes anyway.
    /// - **Bounded**: at most [`max_waiters`](Self::max_waiters) waiters,
    ///   and at most [`max_waiting_bytes`](Self::max_waiting_bytes) of
    ///   request bodies held by them (each holds its buffered body, up to
    ///   [`body_limit`](Self::body_limit)); beyond either, 409 at once with
    ///   `Retry-After`. A client that
    ///   goes away (its request future dropped, by the server or an outer
    ///   timeout such as `tower::timeout`, which the wait counts against)
    ///   leaves the queue at once, and the next waiter takes its place.
    ///
    /// **Fairness across instances** is not first come, first served: a
    /// release wakes the first waiter of every instance that waits for the
    /// key, and the first acquire to reach the store wins; the others wait
    /// again. Within one instance the order is the order in which requests
    /// found the key held (their first look at the store): a waiter is
    /// never passed by a later one on its own instance, but two requests
    /// that arrive within one round trip of each other may queue in either
    /// order, and a waiter may be passed by waiters of other instances. Redlock has no notification
    /// (a release would have to be heard from a majority of independent
    /// nodes): its waiters look with the back-off.
    ///
    /// Works with [`renew`](Self::renew) (a renewed holder's waiters wake
    /// at each expiry they were told of, look once, and wait again),
    /// [`fencing`](Self::fencing) (every holder in turn gets a larger
    /// fence) and graceful drain (releases, notifying ones included, are
    /// delivered). Counted in [`LockStats`]: `waited`, `waited_conflict`,
    /// `wait_full`, `wait_us_sum`.
    /// A bound of zero turns waiting off; one over ten years
    /// (`Duration::MAX`, "as long as it takes") is lowered to ten years.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).wait(std::time::Duration::from_secs(2));
    /// # let _ = layer;
    /// ```
    pub fn wait(mut self, bound: Duration) -> Self {
        self.config_mut().wait = (!bound.is_zero()).then_some(at_most_max(bound));
        self
    }

    /// Most requests waiting ([`wait`](Self::wait)) per key and in all,
    /// per instance (defaults 64 and 4096); a request beyond them is
    /// answered 409 at once. Each is raised to at least 1.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route)
    ///     .wait(std::time::Duration::from_secs(2))
    ///     .max_waiters(16, 1024);
    /// # let _ = layer;
    /// ```
    pub fn max_waiters(mut self, per_key: usize, total: usize) -> Self {
        self.config_mut().max_waiters = (per_key.max(1), total.max(1));
        self
    }

    /// Most bytes of request bodies held by the requests waiting
    /// ([`wait`](Self::wait)) in all, per instance (default 16 MiB): each
    /// waiter holds its buffered body, up to
    /// [`body_limit`](Self::body_limit), while it waits. A request whose
    /// body would take the waiters past it is answered 409 at once, with
    /// `Retry-After`, as when [`max_waiters`](Self::max_waiters) is
    /// reached (counted in `wait_full`). A waiter holds an exact copy of
    /// its body (not the server's read buffer it came in), so what is
    /// counted is what is held. A streamed body
    /// ([`stream_body`](Self::stream_body)) is not read while the request
    /// waits, and counts 0; over HTTP/2 the server's connection keeps what
    /// the client sent of it meanwhile, up to the connection's flow-control
    /// window (hyper's default: 1 MiB per connection).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route)
    ///     .wait(std::time::Duration::from_secs(2))
    ///     .max_waiting_bytes(4 * 1024 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn max_waiting_bytes(mut self, bytes: usize) -> Self {
        self.config_mut().max_waiting_bytes = bytes;
        self
    }

    /// A name for this layer in logs (the `layer` field of the `lock` span)
    /// and metrics (the `layer` label), so two routes' figures are told
    /// apart. Default `"lock"`.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route).label("checkout");
    /// # let _ = layer;
    /// ```
    pub fn label(mut self, label: &'static str) -> Self {
        self.config_mut().stats.set_label(label);
        self
    }

    /// This layer's outcome counters now (shared with its clones, its
    /// services, its [`Locker`](super::Locker)s and layers derived from it
    /// by further builder calls): leases, conflicts, backend errors,
    /// releases, renewals, and the acquire round trips.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let layer = RedisLockLayer::new(MemoryBackend::new(), Route);
    /// assert_eq!(layer.stats().acquired, 0);
    /// ```
    pub fn stats(&self) -> LockStats {
        let mut stats = self.config.stats.snapshot();
        stats.native_calls = self.config.backend.native_calls();
        stats
    }

    /// A [`Locker`] with this layer's backend, key and settings, for taking
    /// leases from handlers (and the `LockGuard` extractor).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, MemoryBackend, RedisLockLayer};
    /// let locker = RedisLockLayer::new(MemoryBackend::new(), Route).locker();
    /// # let _ = locker;
    /// ```
    pub fn locker(&self) -> Locker {
        self.config.warn_if_unkeyed();
        Locker::from_config(self.config.clone())
    }
}

impl<S, const STREAM: bool> Layer<S> for RedisLockLayer<STREAM> {
    type Service = RedisLock<S, STREAM>;

    fn layer(&self, inner: S) -> Self::Service {
        self.config.warn_if_unkeyed();
        RedisLock::from_parts(inner, self.config.clone())
    }
}
