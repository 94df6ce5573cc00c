//! [`IdempotencyLayer`] and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{Response, StatusCode};
use tower_layer::Layer;

use super::rejection::ReplayRejection;
use super::service::Idempotency;
use super::store::ReplayStore;
use crate::key::{DigestKey, KeyPart, KeyWriter, Method, Route};
use crate::{DEFAULT_BODY_LIMIT, DEFAULT_BODY_TIMEOUT, DEFAULT_DEADLINE, DEFAULT_PREFIX};

/// Default retention of a completed record: 24 h.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
/// Default claim (in-flight lease) time to live: 30 s.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);
/// Default largest response body kept in a record: 64 KiB.
pub const DEFAULT_RECORD_LIMIT: usize = 64 * 1024;

/// The response headers kept by default: `content-type`, `content-encoding`,
/// `content-language`, `content-location`, `location`, `etag`,
/// `last-modified`. Anything else (cookies, dates, tracing ids, hop-by-hop
/// headers) is not replayed unless you add it.
pub const DEFAULT_STORED_HEADERS: [HeaderName; 7] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
];

/// The default rule for which responses are stored: 2xx and 4xx except
/// 408, 409 and 429.
///
/// 5xx are not stored: the failure is the server's, and the client must be
/// able to retry with the same key and get a real execution. 408 (the
/// request never fully arrived), 409 (a conflict that may clear) and 429
/// (rate limited) are transient by nature, so a retry should run again too.
/// Other 4xx (validation errors, 402 card declined, 404) are deterministic
/// answers to that request and are replayed. 1xx and 3xx are not stored.
pub fn default_store_when(status: StatusCode) -> bool {
    status.is_success() || (status.is_client_error() && !matches!(status.as_u16(), 408 | 409 | 429))
}

type StorePredicate = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;
type Responder = Arc<dyn Fn(&ReplayRejection) -> Response<Bytes> + Send + Sync>;

/// Configuration shared by a layer, its services and their futures.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn ReplayStore>,
    pub(crate) key: Arc<dyn KeyPart>,
    pub(crate) require_key: bool,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) body_limit: usize,
    pub(crate) body_timeout: Duration,
    pub(crate) record_limit: usize,
    pub(crate) retention: Duration,
    pub(crate) lease_ttl: Duration,
    pub(crate) deadline: Duration,
    pub(crate) store_when: StorePredicate,
    pub(crate) digest_key: DigestKey,
    pub(crate) prefix: Arc<str>,
    pub(crate) responder: Option<Responder>,
}

impl Config {
    pub(crate) fn key_writer(&self) -> KeyWriter {
        KeyWriter::new(&self.digest_key)
    }

    /// The response for a rejection: the user's responder or problem+json.
    pub(crate) fn reject(&self, rejection: &ReplayRejection) -> Response<Bytes> {
        match &self.responder {
            Some(f) => f(rejection),
            None => rejection.to_response(),
        }
    }
}

/// Idempotency mode: the first completed response for an `Idempotency-Key`
/// is stored and replayed to retries, which never reach the handler.
///
/// | request | answer |
/// |---|---|
/// | first with this key | handler runs; its response is stored if [`store_when`](Self::store_when) says so |
/// | retry, same fingerprint, first done | stored response, byte for byte, plus `Idempotent-Replayed: true` |
/// | retry while the first runs | 409 problem+json with `Retry-After` |
/// | same key, different fingerprint | 422 problem+json |
/// | key missing (required) or malformed | 400 problem+json |
/// | first done but its response was too large / streamed | 409 problem+json, not run again |
/// | store down or slow | 503 problem+json with `Retry-After` (always fail-closed) |
///
/// The stored key is a digest of the [`key`](Self::key) parts (put the
/// caller's identity there), the method and route, and the
/// `Idempotency-Key`: two users' equal keys never meet. The fingerprint is a
/// digest of the method, the concrete path, the [`fingerprint_header`](Self::fingerprint_header)s
/// and the body (buffered up to [`body_limit`](Self::body_limit)); the query
/// string is not part of it.
///
/// Settings and defaults:
///
/// | setting | default |
/// |---|---|
/// | [`key`](Self::key) | `(Method, Route)` |
/// | [`optional_key`](Self::optional_key) | key required (400 without) |
/// | [`retention`](Self::retention) | 24 h ([`DEFAULT_RETENTION`]) |
/// | [`lease_ttl`](Self::lease_ttl) | 30 s ([`DEFAULT_LEASE_TTL`]) |
/// | [`record_limit`](Self::record_limit) | 64 KiB ([`DEFAULT_RECORD_LIMIT`]) |
/// | [`stored_headers`](Self::stored_headers) | [`DEFAULT_STORED_HEADERS`] |
/// | [`store_when`](Self::store_when) | [`default_store_when`] |
/// | [`body_limit`](Self::body_limit) | 64 KiB (413 beyond) |
/// | [`deadline`](Self::deadline) | 200 ms per store call |
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_redis_lock::{key::{Method, Route, TrustedHeader}, replay::IdempotencyLayer, MemoryBackend};
///
/// let idem = IdempotencyLayer::new(MemoryBackend::new())
///     .key((Method, Route, TrustedHeader::new("x-user-id")));
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
            .field("body_limit", &c.body_limit)
            .field("record_limit", &c.record_limit)
            .field("retention", &c.retention)
            .field("lease_ttl", &c.lease_ttl)
            .field("deadline", &c.deadline)
            .field("prefix", &c.prefix)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `store` ([`MemoryBackend`](crate::MemoryBackend) or
    /// [`RedisBackend`](crate::RedisBackend)) with the defaults above.
    pub fn new(store: impl ReplayStore) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// A layer over a shared store.
    pub fn from_arc(store: Arc<dyn ReplayStore>) -> Self {
        Self {
            config: Arc::new(Config {
                store,
                key: Arc::new((Method, Route)),
                require_key: true,
                fingerprint_headers: Vec::new(),
                stored_headers: DEFAULT_STORED_HEADERS.to_vec(),
                body_limit: DEFAULT_BODY_LIMIT,
                body_timeout: DEFAULT_BODY_TIMEOUT,
                record_limit: DEFAULT_RECORD_LIMIT,
                retention: DEFAULT_RETENTION,
                lease_ttl: DEFAULT_LEASE_TTL,
                deadline: DEFAULT_DEADLINE,
                store_when: Arc::new(default_store_when),
                digest_key: DigestKey::public(),
                prefix: Arc::from(DEFAULT_PREFIX),
                responder: None,
            }),
        }
    }

    fn config_mut(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// The parts that scope the key (default `(Method, Route)`); add the
    /// caller's identity so one client's key never replays another's
    /// response. A missing part is rejected with its status (401 for an
    /// identity).
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend, key::{Method, Route, TrustedHeader}};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new())
    ///     .key((Method, Route, TrustedHeader::new("x-user-id")));
    /// # let _ = layer;
    /// ```
    pub fn key(mut self, key: impl KeyPart) -> Self {
        self.config_mut().key = Arc::new(key);
        self
    }

    /// Make the `Idempotency-Key` optional: without it, the key parts plus
    /// the fingerprint become the key, so an identical request (same parts,
    /// path, headers and body) within the retention is replayed, and any
    /// other request runs. A malformed key is still a 400.
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).optional_key();
    /// # let _ = layer;
    /// ```
    pub fn optional_key(mut self) -> Self {
        self.config_mut().require_key = false;
        self
    }

    /// Add a request header to the fingerprint (all its values, in order).
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new())
    ///     .fingerprint_header(http::header::CONTENT_TYPE);
    /// # let _ = layer;
    /// ```
    pub fn fingerprint_header(mut self, name: HeaderName) -> Self {
        self.config_mut().fingerprint_headers.push(name);
        self
    }

    /// Replace the set of response headers kept in a record.
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new())
    ///     .stored_headers([http::header::CONTENT_TYPE]);
    /// # let _ = layer;
    /// ```
    pub fn stored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config_mut().stored_headers = names.into_iter().collect();
        self
    }

    /// Keep one more response header in records.
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new())
    ///     .store_header(http::HeaderName::from_static("x-payment-id"));
    /// # let _ = layer;
    /// ```
    pub fn store_header(mut self, name: HeaderName) -> Self {
        self.config_mut().stored_headers.push(name);
        self
    }

    /// Largest request body buffered for the fingerprint (default 64 KiB);
    /// larger bodies get 413. The handler still receives the body byte for
    /// byte. The request body type must be `From<Bytes>` (axum's `Body`).
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).body_limit(16 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn body_limit(mut self, limit: usize) -> Self {
        self.config_mut().body_limit = limit;
        self
    }

    /// Deadline for receiving the request body (default 10 s; 408 after).
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).body_timeout(std::time::Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.config_mut().body_timeout = timeout;
        self
    }

    /// Largest response body kept in a record (default 64 KiB). A larger or
    /// streamed (no length known up front) response is delivered normally
    /// but recorded as "not stored": retries get a 409 problem+json saying
    /// so, never a second execution.
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).record_limit(1024 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn record_limit(mut self, limit: usize) -> Self {
        self.config_mut().record_limit = limit;
        self
    }

    /// How long a completed record is kept and replayed (default 24 h).
    /// After it, the key is free and a request with it runs again. Values
    /// under 1 ms are raised to 1 ms.
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).retention(std::time::Duration::from_secs(3600));
    /// # let _ = layer;
    /// ```
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config_mut().retention = retention.max(Duration::from_millis(1));
        self
    }

    /// How long a claim protects a running first request (default 30 s).
    /// If the process dies mid-request, the key is free again after this;
    /// choose it longer than the slowest handler, or a retry may run while
    /// the first is still going. Values under 1 ms are raised to 1 ms.
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).lease_ttl(std::time::Duration::from_secs(60));
    /// # let _ = layer;
    /// ```
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.config_mut().lease_ttl = ttl.max(Duration::from_millis(1));
        self
    }

    /// Deadline for every store call (default 200 ms). A claim that misses
    /// it is answered 503: idempotency mode is always fail-closed. Values
    /// under 1 ms are raised to 1 ms.
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).deadline(std::time::Duration::from_millis(500));
    /// # let _ = layer;
    /// ```
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.config_mut().deadline = deadline.max(Duration::from_millis(1));
        self
    }

    /// Which response statuses are stored (default [`default_store_when`]).
    /// A response that is not stored frees the key, so a retry runs again.
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// // Only successes are replayed; every error may be retried.
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).store_when(|s| s.is_success());
    /// # let _ = layer;
    /// ```
    pub fn store_when<F>(mut self, f: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.config_mut().store_when = Arc::new(f);
        self
    }

    /// Prefix of the store keys (`prefix:{digest}:idem`); default `trl`.
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).prefix("payments");
    /// # let _ = layer;
    /// ```
    ///
    /// # Panics
    /// If `prefix` contains `{` or `}` (it would move the Redis Cluster hash
    /// tag out of the digest).
    pub fn prefix(mut self, prefix: &str) -> Self {
        assert!(
            !prefix.contains(['{', '}']),
            "tower-redis-lock: the key prefix must not contain '{{' or '}}': {prefix:?}"
        );
        self.config_mut().prefix = Arc::from(prefix);
        self
    }

    /// A secret that turns the key and fingerprint digests into MACs (BLAKE3
    /// keyed mode). Every instance sharing a store must use the same secret.
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).secret(b"from your secret store");
    /// # let _ = layer;
    /// ```
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.config_mut().digest_key = DigestKey::from_secret(secret.as_ref());
        self
    }

    /// Replace the rejection responses (400, 409, 422, 413, 408, 401, 503).
    ///
    /// ```
    /// # use tower_redis_lock::{replay::IdempotencyLayer, MemoryBackend};
    /// let layer = IdempotencyLayer::new(MemoryBackend::new()).on_rejection(|r| {
    ///     let mut res = http::Response::new(bytes::Bytes::from(r.title()));
    ///     *res.status_mut() = r.status();
    ///     res
    /// });
    /// # let _ = layer;
    /// ```
    pub fn on_rejection<F>(mut self, f: F) -> Self
    where
        F: Fn(&ReplayRejection) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.config_mut().responder = Some(Arc::new(f));
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::from_parts(inner, self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_policy() {
        for ok in [200, 201, 204, 400, 402, 404, 422] {
            assert!(
                default_store_when(StatusCode::from_u16(ok).unwrap()),
                "{ok}"
            );
        }
        for no in [101, 302, 408, 409, 429, 500, 502, 503] {
            assert!(
                !default_store_when(StatusCode::from_u16(no).unwrap()),
                "{no}"
            );
        }
    }
}
