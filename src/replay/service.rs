//! [`Idempotency`], the middleware service, and the request flow:
//! key → body + fingerprint → join or claim → replay / reject / run and
//! record.
//!
//! A request that wins its claim runs in a task of its own (the inner
//! service's future and the response body up to the record limit), which
//! renews the claim while it runs and records the outcome whatever becomes
//! of the connection; the connection only waits for it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::response::Parts;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tower_service::Service;

use super::body::{Held, ResponseBody};
use super::feed::{Feed, Published};
use super::flight::{Flight, Join, Outcome};
use super::key::IdempotencyKey;
use super::layer::FEED_RETRY;
use super::layer::{Config, IdempotencyLayer};
use super::record::{NotStoredReason, Record, StoredResponse};
use super::safe::SafeToRetry;
use super::seal::{open, seal, Unsealed};
use super::stats::ReplayOutcome;
use super::store::{Claim, EntryKey, ReplayBackend, ReplayStore};
use crate::backend::{BackendError, Token};
use crate::key::KeyPart;
use crate::Rejection;

/// Response header added to replayed responses.
pub(crate) const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Renewals of a running request's claim, each a third of the TTL apart
/// (the lock's default watchdog cap): past them the claim expires a TTL
/// after the last one.
const MAX_RENEWALS: u32 = 20;
/// First pause between two looks at the store while joining a request that
/// runs on another instance; it doubles up to [`JOIN_POLL_MAX`].
const JOIN_POLL_START: Duration = Duration::from_millis(25);
/// Longest pause between two looks at the store while joining.
const JOIN_POLL_MAX: Duration = Duration::from_millis(200);
/// Longest wait on the feed before one more look at the store: a
/// publication lost (subscriber reconnecting, PUBLISH refused by an ACL)
/// costs a joining duplicate at most this.
const FEED_RECHECK: Duration = Duration::from_secs(2);
/// First pause between two attempts to write a record; it doubles up to
/// [`RECORD_BACKOFF_MAX`].
const RECORD_BACKOFF_START: Duration = Duration::from_millis(20);
/// Longest pause between two attempts to write a record.
const RECORD_BACKOFF_MAX: Duration = Duration::from_secs(1);

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
    Run(Request<B>, Box<Claimed>),
}

/// What the connection waits for from the detached task.
type Answer<ResB, E> = Result<Response<ResponseBody<ResB>>, E>;

async fn run<S, B, ResB>(config: Arc<Config>, inner: S, req: Request<B>) -> Answer<ResB, S::Error>
where
    S: Service<Request<B>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: Body + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body + Send + 'static,
    ResB::Data: From<Bytes> + Send,
    ResB::Error: Send,
{
    let (req, claimed) = match admit(&config, req).await {
        Admit::Answer(res) => return Ok(res.map(ResponseBody::full)),
        Admit::Run(req, claimed) => (req, *claimed),
    };
    // From here on the request runs to its end and its outcome is recorded,
    // whatever becomes of this future (client gone, outer timeout).
    let (tx, rx) = oneshot::channel();
    tokio::spawn(execute(config, inner, req, claimed, tx));
    match rx.await {
        Ok(answer) => answer,
        // The task ended without an answer: the runtime is shutting down.
        Err(_) => Ok(internal_error().map(ResponseBody::full)),
    }
}

/// A claim won by this request: the key, our token, and when it expires.
struct Claimed {
    key: EntryKey,
    digest: String,
    token: Token,
    /// The request's fingerprint, to which its record is bound.
    fingerprint: Bytes,
    /// When the claim expires, as far as we know (from the last renewal
    /// that succeeded).
    expires: Instant,
    /// When to renew next; `None` after the last allowed renewal.
    next_renewal: Option<Instant>,
    renewals: u32,
    flight: Option<Flight>,
}

impl Claimed {
    /// Push the claim's expiry out by a TTL; `false` when it is not ours
    /// any more. A renewal that fails (store down, slow) is tried again a
    /// sixth of a TTL later; the expiry we know stays where it was.
    async fn renew(&mut self, config: &Config) -> bool {
        self.renewals += 1;
        let call = config.store.extend(&self.key, &self.token, config.ttl);
        let sent = Instant::now();
        let outcome = tokio::time::timeout(config.deadline, call).await;
        let mut pause = config.ttl / 3;
        let ours = match outcome {
            Ok(Ok(true)) => {
                self.expires = sent + config.ttl;
                tracing::debug!(key = %self.digest, outcome = "claim_renewed", renewals = self.renewals);
                true
            }
            Ok(Ok(false)) => {
                tracing::warn!(key = %self.digest, outcome = "claim_lost", "the claim expired or was taken while its request ran");
                false
            }
            Ok(Err(e)) => {
                tracing::warn!(key = %self.digest, outcome = "renew_failed", error = %e, "claim not renewed");
                pause = config.ttl / 6;
                true
            }
            Err(_) => {
                tracing::warn!(key = %self.digest, outcome = "renew_failed", "renewing the claim timed out");
                pause = config.ttl / 6;
                true
            }
        };
        self.next_renewal = (ours && self.renewals < MAX_RENEWALS).then(|| Instant::now() + pause);
        ours
    }

    /// Renew if it is time to.
    async fn renew_if_due(&mut self, config: &Config) -> bool {
        match self.next_renewal {
            Some(at) if at <= Instant::now() => self.renew(config).await,
            _ => true,
        }
    }
}

/// What the detached task got from the inner service.
enum Executed<B: Body> {
    /// The key is to be freed (marked safe to retry, or not stored by the
    /// status policy): the response goes out as it is.
    Free(Response<B>),
    /// The whole body, within the record limit.
    Full(Parts, Bytes),
    /// Reading stopped at `held` (over the limit, trailers or an error)
    /// after `prefix`.
    Partial(Parts, Bytes, Held<B>, Pin<Box<B>>),
    /// Not read: its length is unknown (a stream) or over the limit.
    Unread(Parts, B, NotStoredReason),
}

/// Call the inner service and read the response body up to the record
/// limit; decide whether the key is freed.
async fn call_and_collect<S, B, ResB>(
    config: Arc<Config>,
    mut inner: S,
    req: Request<B>,
) -> Result<Executed<ResB>, S::Error>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    ResB: Body,
    ResB::Data: From<Bytes>,
{
    let res = inner.call(req).await?;
    let status = res.status();
    if res.extensions().get::<SafeToRetry>().is_some() || !(config.store_when)(status) {
        return Ok(Executed::Free(res));
    }
    let (parts, body) = res.into_parts();
    let reason = match body.size_hint().exact() {
        None => Some(NotStoredReason::Streaming),
        Some(n) if n > config.record_limit as u64 => Some(NotStoredReason::TooLarge),
        Some(_) => None,
    };
    if let Some(reason) = reason {
        return Ok(Executed::Unread(parts, body, reason));
    }
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
    Ok(match stopped {
        None => Executed::Full(parts, buf.freeze()),
        Some(held) => Executed::Partial(parts, buf.freeze(), held, body),
    })
}

/// The detached task: run the request to its end while renewing the claim,
/// record the outcome (or free the key), tell the duplicates that joined,
/// then hand the answer to the connection if it still waits.
async fn execute<S, B, ResB>(
    config: Arc<Config>,
    inner: S,
    req: Request<B>,
    mut claim: Claimed,
    tx: oneshot::Sender<Answer<ResB, S::Error>>,
) where
    S: Service<Request<B>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: Send + 'static,
    ResB: Body + Send + 'static,
    ResB::Data: From<Bytes> + Send,
    ResB::Error: Send,
{
    // A graceful shutdown's drain waits for this request's record.
    let _hold = config.store.hold();
    let began = Instant::now();
    // A task of its own, so that a panic in the handler or its body is
    // caught (as a `JoinError`) and recorded like any other outcome.
    let mut work = tokio::spawn(call_and_collect(config.clone(), inner, req));
    let joined = loop {
        // The work, or the next renewal, whichever comes first (by hand:
        // tokio's `select!` needs its `macros` feature).
        let mut renewal = std::pin::pin!(sleep_until(claim.next_renewal));
        let step = std::future::poll_fn(|cx| {
            if let Poll::Ready(joined) = Pin::new(&mut work).poll(cx) {
                return Poll::Ready(Some(joined));
            }
            renewal.as_mut().poll(cx).map(|()| None)
        })
        .await;
        match step {
            Some(joined) => break joined,
            None => {
                claim.renew(&config).await;
            }
        }
    };
    let status_of = |parts: &Parts| parts.status;
    let (record, answer): (Option<Record>, Answer<ResB, S::Error>) = match joined {
        Ok(Ok(Executed::Free(res))) => {
            tracing::debug!(key = %claim.digest, status = res.status().as_u16(), outcome = "freed", "not recorded: the key is free for a retry");
            free(&config, &claim).await;
            if let Some(flight) = claim.flight.take() {
                flight.finish(Outcome::Freed);
            }
            let _ = tx.send(Ok(res.map(ResponseBody::passthrough)));
            return;
        }
        Ok(Ok(Executed::Full(parts, body))) => {
            let record = Record::Response(StoredResponse {
                status: parts.status,
                headers: stored_headers(&config, &parts.headers),
                body: body.clone(),
            });
            let res = Response::from_parts(parts, ResponseBody::full(body));
            (Some(record), Ok(res))
        }
        Ok(Ok(Executed::Partial(parts, prefix, held, body))) => {
            let reason = match &held {
                Held::Error(_) => NotStoredReason::BodyFailed,
                Held::Frame(frame) if frame.is_data() => NotStoredReason::TooLarge,
                Held::Frame(_) => NotStoredReason::Streaming,
            };
            let record = Record::NotStored {
                status: status_of(&parts),
                reason,
            };
            let res = Response::from_parts(parts, ResponseBody::resumed(prefix, held, body));
            (Some(record), Ok(res))
        }
        Ok(Ok(Executed::Unread(parts, body, reason))) => {
            let record = Record::NotStored {
                status: parts.status,
                reason,
            };
            (
                Some(record),
                Ok(Response::from_parts(parts, ResponseBody::passthrough(body))),
            )
        }
        Ok(Err(e)) => {
            let record = Record::NotStored {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                reason: NotStoredReason::ServiceFailed,
            };
            (Some(record), Err(e))
        }
        Err(e) if e.is_panic() => {
            tracing::error!(key = %claim.digest, outcome = "panicked", "the handler panicked after the request began; recorded as a 500");
            let res = panic_response();
            let record = Record::Response(StoredResponse {
                status: res.status(),
                headers: stored_headers(&config, res.headers()),
                body: res.body().clone(),
            });
            (Some(record), Ok(res.map(ResponseBody::full)))
        }
        Err(_) => {
            // Cancelled: the runtime is shutting down. The claim expires.
            tracing::warn!(key = %claim.digest, outcome = "cancelled", "the request was cancelled by the runtime; its claim expires after its TTL");
            (None, Ok(internal_error().map(ResponseBody::full)))
        }
    };
    let outcome = match record {
        Some(record) => {
            let written = write_record(&config, &mut claim, &record).await;
            config.stats.record(ReplayOutcome::of_record(written));
            config.holds.record(began.elapsed());
            if written {
                Outcome::Recorded(record)
            } else {
                Outcome::Unknown
            }
        }
        None => Outcome::Unknown,
    };
    if let Some(flight) = claim.flight.take() {
        flight.finish(outcome);
    }
    let _ = tx.send(answer);
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Store `record` in place of our claim, retrying with back-off until the
/// claim would expire (renewing it meanwhile). On failure the claim is left
/// to expire, never freed early: until then a retry is refused, not run.
async fn write_record(config: &Config, claim: &mut Claimed, record: &Record) -> bool {
    let sealed = seal(
        &config.key_space,
        &claim.key.entry,
        &claim.fingerprint,
        record,
    );
    let mut backoff = RECORD_BACKOFF_START;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let call = config
            .store
            .complete(&claim.key, &claim.token, &sealed, config.retention);
        match tokio::time::timeout(config.deadline, call).await {
            Ok(Ok(true)) => {
                tracing::debug!(key = %claim.digest, outcome = "recorded", attempts);
                return true;
            }
            Ok(Ok(false)) => {
                tracing::error!(key = %claim.digest, outcome = "claim_lost", "the claim expired before the response was recorded; a retry may run again (choose a longer ttl)");
                return false;
            }
            Ok(Err(e)) => {
                tracing::warn!(key = %claim.digest, outcome = "record_failed", attempts, error = %e, "recording the response failed; retrying");
            }
            Err(_) => {
                tracing::warn!(key = %claim.digest, outcome = "record_failed", attempts, "recording the response timed out; retrying");
            }
        }
        // A renewal that finds no claim may mean an attempt that timed out
        // landed after all (the entry is done): the next attempt tells,
        // since a completion finding our own record succeeds.
        claim.renew_if_due(config).await;
        if Instant::now() + backoff + config.deadline >= claim.expires {
            tracing::error!(key = %claim.digest, outcome = "record_failed", attempts, store = config.store.name(), "the response could not be recorded before the claim expires; the claim is left to expire (never freed early): retries get 409 until then, and run again after it");
            return false;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RECORD_BACKOFF_MAX);
    }
}

/// Free our claim: the handler said nothing happened. Waits up to the
/// deadline; the abandon is delivered beyond it all the same.
async fn free(config: &Config, claim: &Claimed) {
    let call = config.store.abandon(&claim.key, &claim.token, config.ttl);
    match tokio::time::timeout(config.deadline, call).await {
        Ok(Ok(freed)) => tracing::debug!(key = %claim.digest, outcome = "abandoned", freed),
        Ok(Err(e)) => {
            tracing::warn!(key = %claim.digest, outcome = "abandon_failed", error = %e, "claim not freed; it expires after its TTL")
        }
        Err(_) => {
            tracing::debug!(key = %claim.digest, outcome = "abandoning", "freeing the claim goes on after the deadline");
        }
    }
}

/// A claim sent for a request whose handler has not begun. Until
/// [`keep`](Self::keep) (the claim is ours and the handler starts) or
/// [`settle`](Self::settle) (the store answered that nothing of ours was
/// written), dropping it abandons the claim: deadline passed, store error,
/// client gone while the claim was on its way, shutdown. The abandon is
/// delivered like a release, and removes a claim of ours that lands later.
struct PendingClaim {
    store: Arc<dyn ReplayStore>,
    key: Option<EntryKey>,
    token: Token,
    lease: Duration,
    digest: crate::key::LockKey,
}

impl PendingClaim {
    fn new(config: &Config, key: EntryKey, token: Token, digest: crate::key::LockKey) -> Self {
        Self {
            store: config.store.clone(),
            key: Some(key),
            token,
            lease: config.ttl,
            digest,
        }
    }

    /// The claim is ours: the handler runs, and the claim is recorded or
    /// freed by the detached task, never abandoned from here.
    fn keep(mut self) -> EntryKey {
        self.key.take().expect("kept once")
    }

    /// The store wrote nothing of ours (in flight, done, mismatch, over
    /// quota): nothing to abandon.
    fn settle(mut self) {
        self.key = None;
    }
}

impl Drop for PendingClaim {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            tracing::debug!(key = %self.digest, outcome = "abandoning", "the request ended before its handler began; its claim is taken back");
            // Takes effect even unpolled (see `ReplayStore::abandon`).
            drop(self.store.abandon(&key, &self.token, self.lease));
        }
    }
}

/// The answer recorded for a handler that panicked after it began.
fn panic_response() -> Response<Bytes> {
    crate::rejection::problem_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "handler-failed",
        "Request failed",
        "The request failed on the server after it began; whether it took effect is \
         unknown. Repeating it with this Idempotency-Key returns this answer; look the \
         result up before repeating it with a new key.",
        None,
        |_| {},
    )
}

/// The answer when the detached task ended without one (runtime shutdown).
fn internal_error() -> Response<Bytes> {
    crate::rejection::problem_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "handler-failed",
        "Request failed",
        "The server stopped before the request completed.",
        None,
        |_| {},
    )
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

/// The answer to a request that found a finished record (`joined`: it
/// waited for the request in flight to record it).
fn answer_record(
    config: &Config,
    digest: &crate::key::LockKey,
    record: Record,
    joined: bool,
) -> Response<Bytes> {
    match record {
        Record::Response(stored) => {
            tracing::debug!(key = %digest, outcome = "replayed", joined);
            config.stats.record(if joined {
                ReplayOutcome::Joined
            } else {
                ReplayOutcome::Replayed
            });
            replay(config, stored)
        }
        Record::NotStored { status, reason } => {
            config.stats.record(ReplayOutcome::NotStored);
            let r = Rejection::NotStored {
                status,
                reason: reason.explain(),
            };
            tracing::debug!(key = %digest, outcome = r.kind(), "rejected: {r}");
            config.reject(&r)
        }
    }
}

/// The layer's feed of published outcomes, started on first use and again
/// after it closed; `None` when the store publishes nothing or its
/// subscriber cannot be opened now (then waiters look again instead; a new
/// attempt is made at most once per [`FEED_RETRY`], and the first failure
/// is logged).
async fn feed_of(config: &Config) -> Option<Arc<Feed>> {
    let slot = &config.feed;
    let live = |slot: &super::layer::FeedSlot| {
        slot.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .filter(|f| f.is_live())
            .cloned()
    };
    if let Some(feed) = live(slot) {
        return Some(feed);
    }
    // Not started yet (nothing runs until awaited); `None` for a store
    // that publishes nothing, with no lock taken.
    let start = config.store.feed(&config.key_space)?;
    let mut starting = slot.starting.lock().await;
    if let Some(feed) = live(slot) {
        return Some(feed);
    }
    if starting.is_some_and(|failed| failed.elapsed() < FEED_RETRY) {
        return None;
    }
    let bound = config.deadline.max(Duration::from_secs(1));
    let error = match tokio::time::timeout(bound, start).await {
        Ok(Ok(feed)) => {
            *starting = None;
            *slot.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(feed.clone());
            return Some(feed);
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {} ms", bound.as_millis()),
    };
    *starting = Some(Instant::now());
    if !slot.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            error = %error,
            "no subscription for joining duplicates (check that the Redis user may PSUBSCRIBE \
             and PUBLISH on the key space's channels, see SECURITY.md); duplicates look at the \
             store again instead, which answers them later"
        );
    }
    None
}

/// Wait for the request in flight on this instance, up to `until`.
/// `None`: it ended without an outcome for us (freed, or gone): claim.
async fn wait_local(
    mut rx: watch::Receiver<Option<Outcome>>,
    until: Instant,
) -> Result<Option<Outcome>, ()> {
    match tokio::time::timeout_at(until, rx.wait_for(Option::is_some)).await {
        Ok(Ok(outcome)) => Ok(outcome.clone()),
        Ok(Err(_)) => Ok(None),
        Err(_) => Err(()),
    }
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
    fp.push("query", parts.uri.query().unwrap_or("").as_bytes());
    for name in &config.fingerprint_headers {
        fp.push("header", name.as_str().as_bytes());
        for value in parts.headers.get_all(name) {
            fp.push("value", value.as_bytes());
        }
    }
    fp.push("body", blake3::hash(&bytes).as_bytes());
    let fingerprint = fp.finish();
    let scope_digest = scope.finish();
    match &key {
        Some(key) => scope.push("idempotency-key", key.as_str().as_bytes()),
        None => scope.push("fingerprint", fingerprint.as_bytes()),
    }
    let digest = scope.finish();
    let storage = EntryKey::new(&config.key_space, &scope_digest, &digest);
    let fingerprint = Bytes::copy_from_slice(fingerprint.as_bytes());
    let joining = !config.join_timeout.is_zero();
    let join_until = Instant::now() + config.join_timeout;

    // 3. A duplicate of a request in flight on this instance waits for its
    //    outcome here, without a round trip.
    if joining {
        match config.flights.join(&storage.entry, &fingerprint) {
            Join::Absent => {}
            Join::Mismatch => {
                config.stats.record(ReplayOutcome::Mismatch);
                return reject(Rejection::Mismatch);
            }
            Join::Wait(rx) => {
                tracing::debug!(key = %digest, outcome = "joining", "waiting for the request in flight here");
                match wait_local(rx, join_until).await {
                    Ok(Some(Outcome::Recorded(record))) => {
                        return Admit::Answer(answer_record(config, &digest, record, true))
                    }
                    // Freed, or gone without a word: ask the store.
                    Ok(Some(Outcome::Freed)) | Ok(None) => {}
                    Ok(Some(Outcome::Unknown)) | Err(()) => {
                        config.stats.record(ReplayOutcome::Conflict);
                        return reject(Rejection::InFlight {
                            retry_after: config.holds.retry_after(None, config.ttl, None),
                        });
                    }
                }
            }
        }
    }

    // 4. One round trip: claim, or learn what is there. A duplicate of a
    //    request in flight elsewhere waits for what the store publishes
    //    (listening before it asks, so nothing is missed), or, without a
    //    feed, looks again with growing pauses, until the join bound.
    let feed = match joining {
        true => feed_of(config).await,
        false => None,
    };
    let mut waiter = feed.as_ref().map(|f| f.waiter(&storage.entry));
    let token = Token::generate();
    // From the first claim sent until the store has answered it, dropping
    // this future (client gone) or giving up (deadline) takes the claim back.
    let pending = PendingClaim::new(config, storage.clone(), token, digest);
    let mut pause = JOIN_POLL_START;
    let mut waited = false;
    // Set when a wait on a live feed ran out before the join bound: if the
    // next look finds the record, the feed missed its publication.
    let mut missed = false;
    let claimed = loop {
        let started = Instant::now();
        let call = config
            .store
            .claim(&storage, &token, &fingerprint, config.ttl, config.quota);
        let claimed = tokio::time::timeout(config.deadline, call).await;
        config.stats.round_trip(started.elapsed(), claimed.is_err());
        let latency_us = started.elapsed().as_micros() as u64;
        if let Ok(Ok(Claim::InFlight { .. })) = &claimed {
            let now = Instant::now();
            if joining && now < join_until {
                if !waited {
                    tracing::debug!(key = %digest, outcome = "joining", latency_us, "waiting for the request in flight elsewhere");
                    waited = true;
                }
                match waiter.as_mut() {
                    Some(w) => match w.wait(join_until.min(now + FEED_RECHECK)).await {
                        // Only a record sealed with the secret for this key
                        // and fingerprint is an answer; anything else
                        // published is a wake-up: look at the store.
                        Some(Published::Done(sealed)) => {
                            if let Some(record) =
                                published_record(config, &storage, &fingerprint, sealed)
                            {
                                // Answered by the original: nothing of ours was written.
                                pending.settle();
                                return Admit::Answer(answer_record(config, &digest, record, true));
                            }
                            waiter = feed.as_ref().map(|f| f.waiter(&storage.entry));
                        }
                        // Freed: listen again, then claim.
                        Some(Published::Freed) => {
                            waiter = feed.as_ref().map(|f| f.waiter(&storage.entry));
                        }
                        // The bound or a recheck: one more look. A closed
                        // feed stops being listened to.
                        None => {
                            let live = feed.as_ref().is_some_and(|f| f.is_live());
                            missed = live;
                            if !live || Instant::now() >= join_until {
                                waiter = None;
                            }
                        }
                    },
                    None => {
                        tokio::time::sleep(pause.min(join_until - now)).await;
                        pause = (pause * 2).min(JOIN_POLL_MAX);
                    }
                }
                continue;
            }
        }
        if let Ok(Ok(Claim::Claimed)) = &claimed {
            tracing::debug!(key = %digest, outcome = "claimed", latency_us);
        }
        if missed && matches!(claimed, Ok(Ok(Claim::Done(_)))) {
            feed_missed(config);
        }
        break (claimed, started);
    };
    drop(waiter);
    let (claimed, sent) = claimed;
    match claimed {
        Ok(Ok(Claim::Claimed)) => {
            let storage = pending.keep();
            config.stats.record(ReplayOutcome::Claimed);
            if let Some(key) = key {
                parts.extensions.insert(key);
            }
            let flight = joining.then(|| {
                config
                    .flights
                    .begin(storage.entry.clone(), fingerprint.clone())
            });
            let claim = Claimed {
                key: storage,
                digest: digest.to_string(),
                token,
                fingerprint,
                expires: sent + config.ttl,
                next_renewal: Some(sent + config.ttl / 3),
                renewals: 0,
                flight,
            };
            Admit::Run(Request::from_parts(parts, B::from(bytes)), Box::new(claim))
        }
        Ok(Ok(Claim::Done(sealed))) => {
            pending.settle();
            match open(&config.key_space, &storage.entry, &fingerprint, sealed) {
                Ok(record) => Admit::Answer(answer_record(config, &digest, record, waited)),
                Err(e) => untrusted_record(config, &digest, e),
            }
        }
        Ok(Ok(Claim::InFlight { retry_after })) => {
            pending.settle();
            config.stats.record(ReplayOutcome::Conflict);
            reject(Rejection::InFlight {
                retry_after: config.holds.retry_after(retry_after, config.ttl, None),
            })
        }
        Ok(Ok(Claim::Mismatch)) => {
            pending.settle();
            config.stats.record(ReplayOutcome::Mismatch);
            reject(Rejection::Mismatch)
        }
        Ok(Ok(Claim::OverQuota { retry_after })) => {
            pending.settle();
            over_quota(config, &digest, &scope_digest);
            config.stats.record(ReplayOutcome::OverQuota);
            reject(Rejection::OverQuota { retry_after })
        }
        // A failed or timed-out claim may still land on the server (fred
        // re-sends commands after a reconnect): dropping `pending` takes it
        // back, delivered until Redis answers.
        Ok(Err(e)) => unavailable(config, &digest, e),
        Err(_) => unavailable(config, &digest, BackendError::timeout(config.deadline)),
    }
}

/// A scope at its quota: DEBUG for each request, and a WARN at most once a
/// minute per layer (a flood must not flood the logs too).
fn over_quota(config: &Config, digest: &crate::key::LockKey, scope: &crate::key::LockKey) {
    tracing::debug!(key = %digest, scope = %scope, outcome = "over_quota", "answering 429");
    let now = Instant::now();
    let mut last = config
        .quota_warned
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if last.is_none_or(|at| now >= at + Duration::from_secs(60)) {
        *last = Some(now);
        tracing::warn!(
            scope = %scope,
            quota_entries = config.quota.entries,
            quota_bytes = config.quota.bytes,
            "a scope (identity and route) holds its whole share of the idempotency store; \
             its new keys get 429 until its oldest entries expire. If one scope is meant to \
             make that many requests (the key parts name no identity, or one client is a \
             busy backend), raise IdempotencyLayer::scope_quota"
        );
    }
}

/// A waiter found by looking at the store a record whose publication its
/// feed never delivered: the subscription is refused (an ACL without the
/// channel rules: Redis refuses `PSUBSCRIBE` without the client hearing of
/// it) or was lost. Logged once per layer; joins keep working, later.
fn feed_missed(config: &Config) {
    if !config
        .feed
        .warned
        .swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        tracing::warn!(
            "no subscription delivered a record that a duplicate waited for (check that the \
             Redis user may PSUBSCRIBE and PUBLISH on the key space's channels, see \
             SECURITY.md); duplicates look at the store again instead, which answers them later"
        );
    }
}

/// A record published for a joining duplicate, if it may be trusted as its
/// answer: only with a secret (sealed for this key and fingerprint).
/// Without one, a publication is only a wake-up and the record is read from
/// its key.
fn published_record(
    config: &Config,
    key: &EntryKey,
    fingerprint: &[u8],
    sealed: Bytes,
) -> Option<Record> {
    config.key_space.record_key()?;
    match open(&config.key_space, &key.entry, fingerprint, sealed) {
        Ok(record) => Some(record),
        Err(e) => {
            tracing::warn!(error = %e, outcome = "forged_publication", "ignored a record published for a waiting duplicate; reading the store instead");
            None
        }
    }
}

/// A record read from the store that failed authentication or decoding:
/// never replayed, never a reason to run the handler again (its first run
/// happened). 503, and an ERROR that says what to look at.
fn untrusted_record<B>(config: &Config, digest: &crate::key::LockKey, error: Unsealed) -> Admit<B> {
    tracing::error!(key = %digest, outcome = "untrusted_record", error = %error, "the stored record for this key was refused; answering 503 (check who else writes to this Redis, and that every instance uses the same KeySpace secret)");
    config.stats.record(ReplayOutcome::BackendError);
    Admit::Answer(config.reject(&Rejection::Unavailable {
        retry_after: Duration::from_secs(1),
    }))
}

fn unavailable<B>(config: &Config, digest: &crate::key::LockKey, error: BackendError) -> Admit<B> {
    tracing::warn!(key = %digest, outcome = "backend_error", error = %error, "idempotency store failed; answering 503");
    config.stats.record(ReplayOutcome::BackendError);
    Admit::Answer(config.reject(&Rejection::Unavailable {
        retry_after: Duration::from_secs(1),
    }))
}

/// The stored response, with only the headers this layer stores (a record
/// read back is untrusted: whatever else it carries is dropped).
fn replay(config: &Config, stored: StoredResponse) -> Response<Bytes> {
    let mut res = Response::new(stored.body);
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored_headers(config, &stored.headers);
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
        assert_eq!(retry, 410, "recorded as not stored, not run again");
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
    async fn body_error_is_recorded_as_not_stored() {
        // Fails on a layer that frees the key after a broken body: the
        // retry runs (200) and the handler runs twice.
        let (store, runs, first, retry) = drive(vec![Ok("ab"), Err("boom")], 4).await;
        assert_eq!(first.unwrap_err(), "boom", "the error reaches the client");
        assert_eq!(retry, 410, "done, not stored: not run again");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(store.idempotency_entries(), 1, "the outcome is kept");
    }
}
