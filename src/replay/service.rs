//! [`Idempotency`], the middleware service, and the request flow:
//! key → body + fingerprint → claim → replay / reject / run and record.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::runtime::Handle;
use tower_service::Service;

use super::body::{Held, ResponseBody};
use super::key::IdempotencyKey;
use super::layer::{Config, IdempotencyLayer};
use super::record::{NotStoredReason, Record, StoredResponse};
use super::stats::Outcome;
use super::store::{Claim, ReplayBackend, ReplayStore};
use crate::backend::{BackendError, Token};
use crate::key::KeyPart;
use crate::Rejection;

/// Response header added to replayed responses.
pub(crate) const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Response future of [`Idempotency`].
pub struct ResponseFuture<B: Body, E> {
    inner: BoxFuture<Result<Response<ResponseBody<B>>, E>>,
}

impl<B: Body, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<B: Body, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

/// Middleware that stores and replays responses per `Idempotency-Key` (see
/// [`IdempotencyLayer`]).
pub struct Idempotency<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> Idempotency<S> {
    pub(crate) fn from_parts(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// Shorthand for [`IdempotencyLayer::new`].
    pub fn layer(backend: impl ReplayBackend, key: impl KeyPart) -> IdempotencyLayer {
        IdempotencyLayer::new(backend, key)
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwrap the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("backend", &self.config.store.name())
            .finish_non_exhaustive()
    }
}

impl<S, B, ResB> Service<Request<B>> for Idempotency<S>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResB: Body + Send + 'static,
    ResB::Data: From<Bytes> + Send,
    ResB::Error: Send,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The ready service goes into the future; a fresh clone stays here.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture {
            inner: Box::pin(run(self.config.clone(), inner, req)),
        }
    }
}

/// What the layer does before the handler: either a ready answer or a claim.
enum Admit<B> {
    Answer(Response<Bytes>),
    Run(Request<B>, Box<ClaimGuard>),
}

async fn run<S, B, ResB>(
    config: Arc<Config>,
    mut inner: S,
    req: Request<B>,
) -> Result<Response<ResponseBody<ResB>>, S::Error>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    B: Body + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body,
    ResB::Data: From<Bytes>,
{
    let (req, guard) = match admit(&config, req).await {
        Admit::Answer(res) => return Ok(res.map(ResponseBody::full)),
        Admit::Run(req, guard) => (req, *guard),
    };
    let res = match inner.call(req).await {
        Ok(res) => res,
        Err(e) => {
            guard.abandon().await;
            return Err(e);
        }
    };
    let status = res.status();
    if !(config.store_when)(status) {
        // Not kept: free the key now, so a retry runs for real.
        tracing::debug!(key = %guard.digest(), status = status.as_u16(), outcome = "not_stored_by_policy");
        guard.abandon().await;
        return Ok(res.map(ResponseBody::passthrough));
    }
    let (parts, body) = res.into_parts();
    let not_stored = |reason| Record::NotStored { status, reason };
    let reason = match body.size_hint().exact() {
        None => Some(NotStoredReason::Streaming),
        Some(n) if n > config.record_limit as u64 => Some(NotStoredReason::TooLarge),
        Some(_) => None,
    };
    if let Some(reason) = reason {
        // The operation happened; only its answer cannot be kept.
        config.count_record(guard.complete(not_stored(reason), config.retention).await);
        return Ok(Response::from_parts(parts, ResponseBody::passthrough(body)));
    }
    // Small, with a known length: collect, record, then send it in one piece.
    let mut body = Box::pin(body);
    let mut buf = BytesMut::new();
    let stopped: Option<Held<ResB>> = loop {
        if body.is_end_stream() {
            break None;
        }
        match body.frame().await {
            None => break None,
            Some(Err(e)) => break Some(Held::Error(e)),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) => {
                    let bytes = data.copy_to_bytes(data.remaining());
                    if buf.len() + bytes.len() > config.record_limit {
                        break Some(Held::Frame(Frame::data(ResB::Data::from(bytes))));
                    }
                    buf.extend_from_slice(&bytes);
                }
                // Trailers: not something a replay can reproduce.
                Err(frame) => break Some(Held::Frame(frame)),
            },
        }
    };
    let prefix = buf.freeze();
    let (record, body) = match stopped {
        None => (
            Record::Response(StoredResponse {
                status,
                headers: stored_headers(&config, &parts.headers),
                body: prefix.clone(),
            }),
            ResponseBody::full(prefix),
        ),
        Some(Held::Error(e)) => {
            // A broken response is not kept: free the key.
            guard.abandon().await;
            let body = ResponseBody::resumed(prefix, Held::Error(e), body);
            return Ok(Response::from_parts(parts, body));
        }
        Some(Held::Frame(frame)) => {
            let reason = if frame.is_data() {
                NotStoredReason::TooLarge
            } else {
                NotStoredReason::Streaming
            };
            let body = ResponseBody::resumed(prefix, Held::Frame(frame), body);
            (not_stored(reason), body)
        }
    };
    config.count_record(guard.complete(record, config.retention).await);
    Ok(Response::from_parts(parts, body))
}

fn stored_headers(config: &Config, headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in &config.stored_headers {
        for value in headers.get_all(name) {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

async fn admit<B>(config: &Arc<Config>, req: Request<B>) -> Admit<B>
where
    B: Body + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let reject = |r: Rejection| {
        tracing::debug!(outcome = r.kind(), "rejected: {r}");
        Admit::Answer(config.reject(&r))
    };
    let (mut parts, body) = req.into_parts();

    // 1. The scope (who, which route: 401 first) and the Idempotency-Key.
    let mut scope = config.key_space.writer();
    scope.push("replay", b"v1");
    if let Err(missing) = config.key.write(&parts, &mut scope) {
        return reject(Rejection::MissingPart(missing));
    }
    let key = match IdempotencyKey::from_headers(&parts.headers) {
        Ok(Some(key)) => Some(key),
        Ok(None) if config.require_key => return reject(Rejection::MissingIdempotencyKey),
        Ok(None) => None,
        Err(e) => {
            return reject(Rejection::InvalidIdempotencyKey {
                reason: e.to_string(),
            })
        }
    };

    // 2. The body, buffered for the fingerprint.
    let bytes = match read_body(body, &parts.headers, config).await {
        Ok(bytes) => bytes,
        Err(r) => return reject(r),
    };
    let mut fp = config.key_space.writer();
    fp.push("method", parts.method.as_str().as_bytes());
    fp.push("path", parts.uri.path().as_bytes());
    for name in &config.fingerprint_headers {
        fp.push("header", name.as_str().as_bytes());
        for value in parts.headers.get_all(name) {
            fp.push("value", value.as_bytes());
        }
    }
    fp.push("body", blake3::hash(&bytes).as_bytes());
    let fingerprint = fp.finish();
    match &key {
        Some(key) => scope.push("idempotency-key", key.as_str().as_bytes()),
        None => scope.push("fingerprint", fingerprint.as_bytes()),
    }
    let digest = scope.finish();
    let storage = config.key_space.storage_key_with_suffix(&digest, ":idem");

    // 3. One round trip: claim, or learn what is there.
    let token = Token::generate();
    let started = Instant::now();
    let claimed = tokio::time::timeout(
        config.deadline,
        config
            .store
            .claim(&storage, &token, fingerprint.as_bytes(), config.ttl),
    )
    .await;
    let latency_us = started.elapsed().as_micros() as u64;
    config.count_claim_latency(started.elapsed(), claimed.is_err());
    let guard = ClaimGuard {
        store: config.store.clone(),
        key: storage,
        digest: digest.to_string(),
        token,
        deadline: config.deadline,
        handle: Handle::try_current().ok(),
        armed: true,
    };
    match claimed {
        Ok(Ok(Claim::Claimed)) => {
            tracing::debug!(key = %digest, outcome = "claimed", latency_us);
            config.count(Outcome::Claimed);
            if let Some(key) = key {
                parts.extensions.insert(key);
            }
            Admit::Run(Request::from_parts(parts, B::from(bytes)), Box::new(guard))
        }
        other => {
            // Not ours: nothing to give back (a timed-out claim may still
            // land on the server, so that case keeps the guard armed and
            // abandons in the background).
            let timed_out = other.is_err();
            if !timed_out {
                guard.disarm();
            } else {
                drop(guard);
            }
            match other {
                Ok(Ok(Claim::Done(Record::Response(stored)))) => {
                    tracing::debug!(key = %digest, outcome = "replayed", latency_us);
                    config.count(Outcome::Replayed);
                    Admit::Answer(replay(stored))
                }
                Ok(Ok(Claim::Done(Record::NotStored { status, reason }))) => {
                    config.count(Outcome::NotStored);
                    reject(Rejection::NotStored {
                        status,
                        reason: reason.explain(),
                    })
                }
                Ok(Ok(Claim::InFlight { retry_after })) => {
                    config.count(Outcome::Conflict);
                    reject(Rejection::InFlight {
                        retry_after: retry_after.unwrap_or(config.ttl),
                    })
                }
                Ok(Ok(Claim::Mismatch)) => {
                    config.count(Outcome::Mismatch);
                    reject(Rejection::Mismatch)
                }
                Ok(Err(e)) => unavailable(config, &digest, e),
                Err(_) => unavailable(config, &digest, BackendError::timeout(config.deadline)),
                Ok(Ok(Claim::Claimed)) => unreachable_claimed(config),
            }
        }
    }
}

// Kept out of line so the match above stays exhaustive without a panic.
fn unreachable_claimed<B>(config: &Config) -> Admit<B> {
    Admit::Answer(config.reject(&Rejection::Unavailable {
        retry_after: Duration::from_secs(1),
    }))
}

fn unavailable<B>(config: &Config, digest: &crate::key::LockKey, error: BackendError) -> Admit<B> {
    tracing::warn!(key = %digest, outcome = "backend_error", error = %error, "idempotency store failed; answering 503");
    config.count(Outcome::BackendError);
    Admit::Answer(config.reject(&Rejection::Unavailable {
        retry_after: Duration::from_secs(1),
    }))
}

fn replay(stored: StoredResponse) -> Response<Bytes> {
    let mut res = Response::new(stored.body);
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored.headers;
    res.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    res
}

/// Buffer the request body (up to the limit, within the deadline).
async fn read_body<B>(body: B, headers: &HeaderMap, config: &Config) -> Result<Bytes, Rejection>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let limit = config.body_limit;
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Rejection::PayloadTooLarge { limit });
    }
    match tokio::time::timeout(config.body_timeout, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<LengthLimitError>() => Err(Rejection::PayloadTooLarge { limit }),
        Ok(Err(_)) => Err(Rejection::InvalidBody),
        Err(_) => Err(Rejection::BodyTimeout {
            after: config.body_timeout,
        }),
    }
}

pub(crate) type FinishFuture = Pin<Box<dyn Future<Output = bool> + Send + 'static>>;

/// Owns a claim; completes or abandons it, or, if still armed when dropped
/// (client gone, handler panicked), abandons it on a spawned task.
pub(crate) struct ClaimGuard {
    store: Arc<dyn ReplayStore>,
    key: Bytes,
    digest: String,
    token: Token,
    deadline: Duration,
    handle: Option<Handle>,
    armed: bool,
}

impl fmt::Debug for ClaimGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClaimGuard")
            .field("key", &self.digest)
            .field("armed", &self.armed)
            .finish_non_exhaustive()
    }
}

impl ClaimGuard {
    fn digest(&self) -> &str {
        &self.digest
    }

    fn disarm(mut self) {
        self.armed = false;
    }

    /// Store `record` in place of the claim.
    pub(crate) fn complete(mut self, record: Record, retention: Duration) -> FinishFuture {
        self.armed = false;
        let (store, key, token, deadline) = (
            self.store.clone(),
            self.key.clone(),
            self.token,
            self.deadline,
        );
        let digest = std::mem::take(&mut self.digest);
        Box::pin(async move {
            let call = store.complete(&key, &token, &record, retention);
            match tokio::time::timeout(deadline, call).await {
                Ok(Ok(true)) => {
                    tracing::debug!(key = %digest, outcome = "recorded");
                    true
                }
                Ok(Ok(false)) => {
                    tracing::warn!(key = %digest, outcome = "claim_lost", "the claim expired before the response was recorded; consider a longer ttl");
                    false
                }
                Ok(Err(e)) => {
                    tracing::warn!(key = %digest, outcome = "record_failed", error = %e, "response not recorded; the claim expires after its TTL");
                    false
                }
                Err(_) => {
                    tracing::warn!(key = %digest, outcome = "record_failed", "recording the response timed out; the claim expires after its TTL");
                    false
                }
            }
        })
    }

    /// Delete the claim: the outcome is not kept and a retry runs again.
    pub(crate) fn abandon(mut self) -> FinishFuture {
        self.armed = false;
        Box::pin(abandon_task(
            self.store.clone(),
            self.key.clone(),
            self.token,
            self.deadline,
            std::mem::take(&mut self.digest),
        ))
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.armed = false;
        let task = abandon_task(
            self.store.clone(),
            self.key.clone(),
            self.token,
            self.deadline.max(Duration::from_secs(1)),
            std::mem::take(&mut self.digest),
        );
        match &self.handle {
            Some(handle) => drop(handle.spawn(task)),
            None => tracing::warn!(
                "idempotency claim dropped outside a Tokio runtime; it expires after its TTL"
            ),
        }
    }
}

async fn abandon_task(
    store: Arc<dyn ReplayStore>,
    key: Bytes,
    token: Token,
    deadline: Duration,
    digest: String,
) -> bool {
    match tokio::time::timeout(deadline, store.abandon(&key, &token)).await {
        Ok(Ok(freed)) => {
            tracing::debug!(key = %digest, outcome = "abandoned", freed);
            freed
        }
        Ok(Err(e)) => {
            tracing::warn!(key = %digest, outcome = "abandon_failed", error = %e, "claim not freed; it expires after its TTL");
            false
        }
        Err(_) => {
            tracing::warn!(key = %digest, outcome = "abandon_failed", "freeing the claim timed out; it expires after its TTL");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body::SizeHint;
    use http_body_util::Full;
    use tower::ServiceExt;
    use tower_layer::Layer;

    use super::*;
    use crate::key::Route;
    use crate::MemoryBackend;

    /// A body that claims `hint` bytes and yields `items`.
    struct Chunks {
        items: VecDeque<Result<&'static str, &'static str>>,
        hint: u64,
    }

    impl Body for Chunks {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            let next = self.items.pop_front();
            Poll::Ready(next.map(|r| r.map(|s| Frame::data(Bytes::from_static(s.as_bytes())))))
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.hint)
        }
    }

    fn request() -> Request<Full<Bytes>> {
        Request::post("/p")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    }

    async fn drive(
        items: Vec<Result<&'static str, &'static str>>,
        hint: u64,
    ) -> (
        MemoryBackend,
        Arc<AtomicUsize>,
        Result<Bytes, &'static str>,
        u16,
    ) {
        let store = MemoryBackend::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        let inner = tower::service_fn(move |_: Request<Full<Bytes>>| {
            r.fetch_add(1, Ordering::SeqCst);
            let body = Chunks {
                items: items.clone().into(),
                hint,
            };
            async move { Ok::<_, Infallible>(Response::new(body)) }
        });
        let svc = IdempotencyLayer::new(store.clone(), Route)
            .record_limit(5)
            .layer(inner);
        let res = svc.clone().oneshot(request()).await.unwrap();
        let first = res.into_body().collect().await.map(|c| c.to_bytes());
        let retry = svc.oneshot(request()).await.unwrap();
        (store, runs, first, retry.status().as_u16())
    }

    #[tokio::test]
    async fn body_longer_than_its_hint_is_delivered_whole_and_not_stored() {
        // Claims 3 bytes (so it is collected), yields 10 (over the limit of 5).
        let (store, runs, first, retry) = drive(vec![Ok("012"), Ok("3456789")], 3).await;
        assert_eq!(first.unwrap(), Bytes::from_static(b"0123456789"));
        assert_eq!(retry, 409, "recorded as not stored, not run again");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(store.idempotency_entries(), 1);
    }

    #[tokio::test]
    async fn custom_rejection_responder() {
        let inner = tower::service_fn(|_: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ran"))))
        });
        let svc = IdempotencyLayer::new(MemoryBackend::new(), Route)
            .on_rejection(|r| (r.status(), r.kind()))
            .layer(inner);
        let req = Request::post("/p").body(Full::new(Bytes::new())).unwrap();
        let res = svc.oneshot(req).await.unwrap();
        assert_eq!(res.status(), 400);
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"idempotency-key-missing");
    }

    #[tokio::test]
    async fn body_error_frees_the_key() {
        let (store, runs, first, retry) = drive(vec![Ok("ab"), Err("boom")], 4).await;
        assert_eq!(first.unwrap_err(), "boom", "the error reaches the client");
        assert_eq!(retry, 200, "the retry ran");
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        assert_eq!(store.idempotency_entries(), 0, "nothing kept");
    }
}
