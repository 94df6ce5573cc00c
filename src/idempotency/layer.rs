//! [`IdempotencyLayer`] and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::StatusCode;
use tower_layer::Layer;

use super::config::{
    default_store_when, Config, DEFAULT_QUOTA, DEFAULT_RECORD_LIMIT, DEFAULT_RETENTION,
    DEFAULT_STORED_HEADERS, DEFAULT_TTL,
};
use super::seal::SealKey;
use super::service::Idempotency;
use crate::backend::idempotency::Quota;
use crate::backend::IdempotencyBackend;
use crate::key::{KeyPart, KeySpace};
use crate::settings::{at_least_1ms, at_most_max, Settings};
use crate::stats::Counters;
use crate::stats::IdempotencyStats;

/// Idempotency mode: the first completed response for an `Idempotency-Key`
/// is stored and replayed to retries, which never reach the handler.
///
/// | request | answer |
/// |---|---|
/// | first with this key | handler runs to its end (in the connection's task; a client that goes away or an outer timeout does not cancel it: the rest moves to a task of its own); its response is stored unless marked [`SafeToRetry`](super::SafeToRetry) or refused by [`store_when`](Self::store_when); a panic is stored as a 500 problem+json |
/// | retry, same fingerprint, first done | stored response, byte for byte, plus `Idempotent-Replayed: true` |
/// | retry while the first runs | waits up to [`join_timeout`](Self::join_timeout) for the first one's answer (replayed as above), then 409 problem+json with `Retry-After` |
/// | same key, different fingerprint | 422 problem+json |
/// | key missing (required) or malformed | 400 problem+json |
/// | first done but its response was too large / streamed / broken | 410 problem+json, no `Retry-After`: never retry with this key |
/// | store down or slow | 503 problem+json with `Retry-After` (always fail-closed) |
///
/// The stored key is a digest of the key parts given to
/// [`new`](Self::new) (put the caller's identity there) and the
/// `Idempotency-Key`: two users' equal keys never meet. The fingerprint is a
/// digest of the method, the concrete path, the query string, the
/// [`fingerprint_header`](Self::fingerprint_header)s and the body (buffered
/// up to [`body_limit`](Self::body_limit); the handler gets the same bytes
/// as one chunk, and a request's trailers are neither fingerprinted nor
/// passed on).
///
/// Settings and defaults:
///
/// | setting | default |
/// |---|---|
/// | [`optional_key`](Self::optional_key) | key required (400 without) |
/// | [`retention`](Self::retention) | 24 h |
/// | [`ttl`](Self::ttl) | 30 s (the claim of a running first request) |
/// | [`record_limit`](Self::record_limit) | 64 KiB |
/// | [`scope_quota`](Self::scope_quota) | 1,000 entries, 1 MiB per scope (429 beyond) |
/// | [`stored_headers`](Self::stored_headers) | `content-type`, `content-encoding`, `content-language`, `content-location`, `location`, `etag`, `last-modified`, `cache-control`, `vary` |
/// | [`store_when`](Self::store_when) | every status except 409, 429 (5xx and 408 included; a gRPC answer by its status's HTTP equivalent) |
/// | [`skip_when`](Self::skip_when) | none: every request is keyed |
/// | [`join_timeout`](Self::join_timeout) | off: a duplicate in flight gets 409 at once |
/// | [`body_limit`](Self::body_limit) | 64 KiB (413 beyond); [`body_timeout`](Self::body_timeout) 10 s |
/// | [`deadline`](Self::deadline) | 200 ms per store call |
/// | [`key_space`](Self::key_space) | prefix `trl`, no secret |
/// | [`label`](Self::label) | `"idempotency"` (counters: [`stats`](Self::stats)) |
/// | [`on_rejection`](Self::on_rejection) | RFC 9457 problem+json |
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_redis_lock::{key::{RequestMethod, Route, Header}, IdempotencyLayer, MemoryBackend};
///
/// let idem = IdempotencyLayer::new(
///     MemoryBackend::new(),
///     (RequestMethod, Route, Header::trusted_identity("x-user-id")),
/// );
/// let app: Router = Router::new().route("/payments", post(|| async { "created" }).layer(idem));
/// ```
///
/// Like [`RedisLockLayer`](crate::RedisLockLayer), add it with
/// `MethodRouter::layer` / `Router::route_layer` so the route template
/// (axum's `MatchedPath`) is known.
#[must_use]
#[derive(Clone)]
pub struct IdempotencyLayer {
    pub(crate) config: Arc<Config>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("store", &c.store)
            .field("require_key", &c.require_key)
            .field("fingerprint_headers", &c.fingerprint_headers)
            .field("stored_headers", &c.stored_headers)
            .field("body_limit", &c.settings.body_limit)
            .field("record_limit", &c.record_limit)
            .field("retention", &c.retention)
            .field("ttl", &c.settings.ttl)
            .field("deadline", &c.settings.deadline)
            .field("key_space", &c.settings.key_space)
            .field("label", &c.stats.label())
            .field("join_timeout", &c.join_timeout)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `backend` ([`MemoryBackend`](crate::MemoryBackend),
    /// [`RedisBackend`](crate::RedisBackend), an `Arc` of one, or any
    /// [`IdempotencyBackend`]), scoping
    /// keys by `key` (put the caller's identity there: a missing part is
    /// rejected with its status, 401 for an identity), with the defaults
    /// above.
    pub fn new(backend: impl IdempotencyBackend, key: impl KeyPart) -> Self {
        Self::with_store(Arc::new(backend), Arc::new(key))
    }

    fn with_store(store: Arc<dyn IdempotencyBackend>, key: Arc<dyn KeyPart>) -> Self {
        let settings = Settings::new(key, DEFAULT_TTL);
        Self {
            config: Arc::new(Config {
                seal_key: SealKey::of(&settings.key_space),
                settings,
                store,
                require_key: true,
                fingerprint_headers: Vec::new(),
                stored_headers: DEFAULT_STORED_HEADERS.to_vec(),
                record_limit: DEFAULT_RECORD_LIMIT,
                retention: DEFAULT_RETENTION,
                store_when: Arc::new(default_store_when),
                skip_when: None,
                join_timeout: Duration::ZERO,
                flights: Arc::default(),
                feed: Arc::default(),
                quota: DEFAULT_QUOTA,
                quota_warned: Arc::default(),
                holds: Arc::default(),
                stats: Counters::new("idempotency"),
            }),
        }
    }

    fn config_mut(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }
}

impl IdempotencyLayer {
    /// How long the claim of a running first request lives without its
    /// record (default 30 s): the safety net if a process dies or a network
    /// splits. While the handler runs, the claim is renewed every third of
    /// it (at most 20 times); choose it longer than the slowest handler.
    /// Values under 1 ms are raised to 1 ms,
    /// and over ten years (`Duration::MAX` too) lowered to ten years.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).ttl(std::time::Duration::from_secs(60));
    /// # let _ = layer;
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config_mut().settings.ttl = at_least_1ms(ttl);
        self
    }

    /// Deadline for every call to the store (default 200 ms). A claim that
    /// misses it is answered 503 (this layer always fails closed), and
    /// whatever it may still do on the server is undone; a record write
    /// that misses it is tried again. Values under 1 ms are raised to 1 ms,
    /// and over ten years (`Duration::MAX` too) lowered to ten years.
    /// Over [`RedisBackend::connect`](crate::RedisBackend::connect) a store
    /// call is also bounded by its fred client's command timeout (1 s): a
    /// longer deadline needs a client built with a longer one
    /// ([`RedisBackend::builder`](crate::RedisBackend::builder)).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).deadline(std::time::Duration::from_millis(100));
    /// # let _ = layer;
    /// ```
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.config_mut().settings.deadline = at_least_1ms(deadline);
        self
    }

    /// Where the keys live and how they are hashed (prefix and secret);
    /// give every layer of a fleet the same [`KeySpace`]. With a secret,
    /// records are also sealed with it (a MAC over the key, the request's
    /// fingerprint and the record).
    ///
    /// ```
    /// # use tower_redis_lock::{key::{KeySpace, Route}, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).key_space(KeySpace::new("shop").secret(b"from your secret store"));
    /// # let _ = layer;
    /// ```
    pub fn key_space(mut self, space: KeySpace) -> Self {
        let config = self.config_mut();
        config.seal_key = SealKey::of(&space);
        config.settings.key_space = space;
        // A feed listens to one key space's channels: a layer made from
        // another by a new key space gets its own.
        config.feed = Arc::default();
        self
    }

    /// Largest request body received before the claim is taken (default
    /// 64 KiB): 413 problem+json beyond it, at once for a declared
    /// `Content-Length` over it. The body is part of the fingerprint.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).body_limit(16 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn body_limit(mut self, limit: usize) -> Self {
        self.config_mut().settings.body_limit = limit;
        self
    }

    /// Time for the whole request body to arrive (default 10 s): a stalled
    /// upload gets 408, and never holds a claim, which is only taken once
    /// the body is in.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).body_timeout(std::time::Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.config_mut().settings.body_timeout = at_most_max(timeout);
        self
    }

    /// Replace the layer's rejection answers (problem+json) with your own.
    /// The closure gets the [`Rejection`](crate::Rejection) and returns
    /// anything `axum::response::IntoResponse` (without the `axum` feature:
    /// an `http::Response` whose body is `Body<Data = Bytes>`, such as
    /// `Full<Bytes>`; the same closures work with the feature on). The body
    /// must be in memory (a string, JSON, bytes): a streaming body is
    /// replaced by the default answer, with an error in the log.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).on_rejection(|r| (r.status(), r.title()));
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "axum")]
    pub fn on_rejection<F, R>(mut self, f: F) -> Self
    where
        F: Fn(&crate::Rejection) -> R + Send + Sync + 'static,
        R: axum::response::IntoResponse,
    {
        self.config_mut().settings.responder = Some(crate::rejection::responder(f));
        self
    }

    /// Replace the layer's rejection answers (problem+json) with your own
    /// `http::Response` (its body in memory, such as `Full<Bytes>`; with the
    /// `axum` feature anything `IntoResponse`).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).on_rejection(|r| http::Response::new(http_body_util::Full::<bytes::Bytes>::from(r.title())));
    /// # let _ = layer;
    /// ```
    #[cfg(not(feature = "axum"))]
    pub fn on_rejection<F, B>(mut self, f: F) -> Self
    where
        F: Fn(&crate::Rejection) -> http::Response<B> + Send + Sync + 'static,
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    {
        self.config_mut().settings.responder = Some(crate::rejection::responder(f));
        self
    }

    /// Make the `Idempotency-Key` optional: without it, the key parts plus
    /// the fingerprint become the key, so an identical request (same parts,
    /// path, headers and body) within the retention is replayed, and any
    /// other request runs. A malformed key is still a 400.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).optional_key();
    /// # let _ = layer;
    /// ```
    pub fn optional_key(mut self) -> Self {
        self.config_mut().require_key = false;
        self
    }

    /// Add a request header (any case) to the fingerprint (all its values,
    /// in order).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route)
    ///     .fingerprint_header("Content-Type");
    /// # let _ = layer;
    /// ```
    ///
    /// # Panics
    /// If `name` is not a valid header name at all (a space, a colon).
    pub fn fingerprint_header<N>(mut self, name: N) -> Self
    where
        N: TryInto<HeaderName> + fmt::Debug,
        N::Error: fmt::Debug,
    {
        let name = crate::key::header_name(name, "to fingerprint");
        self.config_mut().fingerprint_headers.push(name);
        self
    }

    /// Replace the set of response headers kept in a record (a name given
    /// twice counts once).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route)
    ///     .stored_headers([http::header::CONTENT_TYPE]);
    /// # let _ = layer;
    /// ```
    pub fn stored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config_mut().stored_headers.clear();
        names.into_iter().fold(self, Self::store_header)
    }

    /// Keep one more response header in records.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route)
    ///     .store_header(http::HeaderName::from_static("x-payment-id"));
    /// # let _ = layer;
    /// ```
    pub fn store_header(mut self, name: HeaderName) -> Self {
        let stored = &mut self.config_mut().stored_headers;
        if !stored.contains(&name) {
            stored.push(name);
        }
        self
    }

    /// Largest response body kept in a record (default 64 KiB). A larger or
    /// streamed (no length known up front) response is delivered normally
    /// but recorded as "not stored": retries get a 410 problem+json saying
    /// so (`Rejection::NotStored`), never a second execution.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).record_limit(1024 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn record_limit(mut self, limit: usize) -> Self {
        self.config_mut().record_limit = limit;
        self
    }

    /// One scope's share of the store: at most `entries` claims and records
    /// at once, and no new claim once its records hold `bytes` (default
    /// 1,000 entries and 1 MiB). A scope is everything the key parts given
    /// to [`new`](Self::new) name (the caller's identity and the route): past
    /// its share, that scope alone gets **429** problem+json with
    /// `Retry-After` (when its oldest entry expires), and no other scope's
    /// record is ever displaced. Size the store (Redis `maxmemory`, or
    /// [`MemoryBackend::idempotency_byte_limit`](crate::MemoryBackend::idempotency_byte_limit))
    /// as the number of active scopes times `bytes`, plus what the claims in
    /// flight may record: the bytes are checked when a claim is made, and a
    /// record is always written once its handler ran (a scope may pass
    /// `bytes` by up to `entries` × [`record_limit`](Self::record_limit)).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).scope_quota(10_000, 8 << 20);
    /// # let _ = layer;
    /// ```
    ///
    /// # Panics
    /// If `entries` or `bytes` is 0: no request could ever be claimed.
    pub fn scope_quota(mut self, entries: u64, bytes: u64) -> Self {
        assert!(
            entries > 0 && bytes > 0,
            "tower-redis-lock: IdempotencyLayer::scope_quota needs at least one entry and one byte \
             (got {entries} entries, {bytes} bytes)"
        );
        self.config_mut().quota = Quota { entries, bytes };
        self
    }

    /// How long a completed record is kept and replayed (default 24 h).
    /// After it, the key is free and a request with it runs again. Values
    /// under 1 ms are raised to 1 ms,
    /// and over ten years (`Duration::MAX` too) lowered to ten years.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).retention(std::time::Duration::from_secs(3600));
    /// # let _ = layer;
    /// ```
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config_mut().retention = at_least_1ms(retention);
        self
    }

    /// Which response statuses are stored (default: every status except
    /// 409 and 429; 2xx, 3xx, other 4xx and 5xx are stored, and a panic is
    /// stored as a 500). A response that is not stored frees the key, so a
    /// retry runs again (the answer waits up to the
    /// [`deadline`](Self::deadline) for the store to free it, a SQL store's
    /// own commit timeout for that store; a store slower than that frees it
    /// after the answer, and a retry sent at once may meet the claim still
    /// there: 409). A 408 from below the layer is stored: the body
    /// arrived whole before the claim, so it is a timeout that cut the
    /// handler, which may have charged. Put timeouts (tower-http's
    /// `TimeoutLayer`) outside this layer: the layer's own work then runs to
    /// its end on a task of its own, and the retry gets the record.
    ///
    /// Storing 5xx is the safe default for payments: once the handler began,
    /// the layer cannot tell "failed before charging" from "charged, then
    /// failed". Stripe makes the same choice (a 500 is saved once execution
    /// began); the IETF `Idempotency-Key` draft leaves such ambiguous
    /// outcomes to the server. A handler that *knows* nothing happened says
    /// so per response with [`SafeToRetry`](super::SafeToRetry), which frees
    /// the key whatever this predicate says.
    ///
    /// A gRPC answer (HTTP 200 whatever its outcome) is decided by its
    /// gRPC status, read from its trailers (or its headers, trailers-only):
    /// `f` is asked about the status's HTTP equivalent as `google.rpc.Code`
    /// documents it (`UNAVAILABLE` 503, `INTERNAL` and `UNKNOWN` 500,
    /// `DEADLINE_EXCEEDED` 504, `ABORTED` 409, `RESOURCE_EXHAUSTED` 429,
    /// `INVALID_ARGUMENT` 400, ...). So by default a handler's
    /// `UNAVAILABLE` is stored as a 503 is, and `ABORTED` frees the key;
    /// `.store_when(|s| !s.is_server_error())` lets every 5xx-like status
    /// run again. A gRPC answer longer than the record limit is not stored
    /// whatever its status: its trailers come after the limit.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// // Only successes are replayed; every error may be retried.
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).store_when(|s| s.is_success());
    /// # let _ = layer;
    /// ```
    pub fn store_when<F>(mut self, f: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.config_mut().store_when = Arc::new(f);
        self
    }

    /// Requests for which `f` returns `true` go to the handler untouched:
    /// no key, no claim, no record, the body not buffered (default: none).
    /// For what must not be deduplicated behind one layer: read-only calls,
    /// and gRPC streaming methods (a streaming call's messages would
    /// otherwise be buffered whole before the handler sees the first one;
    /// with tonic the layer sits in front of every method of a server).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route)
    ///     .skip_when(|req| req.uri.path() != "/payments.v1.Payments/Create");
    /// # let _ = layer;
    /// ```
    pub fn skip_when<F>(mut self, f: F) -> Self
    where
        F: Fn(&http::request::Parts) -> bool + Send + Sync + 'static,
    {
        self.config_mut().skip_when = Some(Arc::new(f));
        self
    }

    /// How long a duplicate that arrives while the first request with its
    /// key runs waits for that request's answer (default: off, it gets 409
    /// with `Retry-After` at once). Within the bound it receives the
    /// original's recorded response with `Idempotent-Replayed: true`; past
    /// it, the 409 as before.
    ///
    /// On one instance (clones of one layer) the duplicate is woken by the
    /// original the moment its record is written, with no store round trip.
    /// Across instances, with Redis, the duplicate's claim marks the key as
    /// waited for, the original's completion publishes its record on the
    /// key's channel, and the layer's one subscriber connection (opened on
    /// its first joining request, `PSUBSCRIBE prefix:{*:idem`: this key
    /// space's channels only) wakes the duplicate: one round trip in all,
    /// the claim, with a [`KeySpace`](crate::key::KeySpace) secret (without
    /// one, a second reads the record the publication announced). Looking at
    /// the store again, with pauses growing from 25 ms to 200 ms, costs a
    /// round trip per look and notices the answer up to a pause late; it is
    /// the fallback when the subscriber connection cannot be opened, and the
    /// memory store's way (a look costs nothing there).
    ///
    /// Off by default because a waiting duplicate holds its connection and a
    /// task: choose a bound a little over your handler's usual time (a few
    /// seconds for a payment).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route)
    ///     .join_timeout(std::time::Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn join_timeout(mut self, bound: Duration) -> Self {
        self.config_mut().join_timeout = at_most_max(bound);
        self
    }

    /// A name for this layer in logs and metrics (the `layer` label of
    /// `tower_redis_lock_idempotency_outcomes_total` and
    /// `tower_redis_lock_idempotency_claim_seconds` with the `metrics` feature), so two
    /// routes' figures are told apart. Default `"idempotency"`.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route).label("payments");
    /// # let _ = layer;
    /// ```
    pub fn label(mut self, label: &'static str) -> Self {
        self.config_mut().stats.set_label(label);
        self
    }
}

impl IdempotencyLayer {
    /// The layer's outcome counters now: claims, replays, joins,
    /// mismatches, conflicts, not-stored answers, records written and
    /// failed, store errors, scopes over quota, and the claim round trips.
    /// A copy; clones of the
    /// layer, its services and layers built from it by further setters
    /// share the counters. With the `metrics` feature the same counts go
    /// to the `metrics` facade, labelled with [`label`](Self::label).
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new(), Route);
    /// assert_eq!(layer.stats().replayed, 0);
    /// ```
    pub fn stats(&self) -> IdempotencyStats {
        self.config.stats.snapshot()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let c = &self.config;
        c.settings
            .key_space
            .warn_if_public(c.store.as_ref().is_in_process());
        Idempotency::from_parts(inner, self.config.clone())
    }
}

#[cfg(test)]
mod tests;
