//! [`ResponseFuture`]: derive key → receive the body (unless streamed) →
//! acquire → call → release or wrap the body. The hub of a request: it
//! calls the leaves (the key parts, the body reader, the acquire engine,
//! the lease's guard, the response body) and acts on what they return.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::acquire::{self, AcquireFuture, Admission, NoLease};
use super::body::ResponseBody;
use super::config::Config;
use super::config::ReleaseMode;
use super::lease::{LeaseGuard, ReleaseFuture};
use crate::key::{body_part, KeyWriter, LockKey};
use crate::rejection::Rejection;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
/// The request rebuilt, its key, and its buffered body's length.
type Prepared<B> = Result<(Request<B>, LockKey, usize), Rejection>;

pin_project! {
    /// Response future of [`RedisLock`](super::RedisLock): prepare (receive
    /// the body, digest it if asked) → acquire → call the inner service → release
    /// or hand the lease to the [`ResponseBody`].
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B>,
        config: Arc<Config>,
        // A HEAD request: its answer's body is never sent.
        head: bool,
        // A gRPC request: a rejection is answered with a gRPC status.
        grpc: bool,
    }
}

pin_project! {
    /// Each state owns what it needs; `Done` owns nothing.
    #[project = StateProj]
    #[project_replace = StateOwned]
    enum State<S, B>
    where
        S: Service<Request<B>>,
    {
        /// Receiving the body (and digesting it, if asked).
        Prepare { prepare: BoxFuture<Prepared<B>>, inner: S },
        /// Waiting for the backend.
        Acquire { acquire: AcquireFuture, inner: S, req: Request<B> },
        /// The inner service runs; `guard` holds the lease (none when
        /// running unlocked).
        Call { #[pin] fut: S::Future, guard: Option<LeaseGuard> },
        /// Waiting for the release before handing over `then`.
        Release { #[pin] release: ReleaseFuture, then: Then<S::Response, S::Error> },
        /// Answer with this instead of calling the inner service.
        Reject { rejection: Rejection },
        /// Finished: polling again is a bug in the caller.
        Done,
    }
}

/// What a future hands over once its release finished.
enum Then<R, E> {
    /// The inner service's result, as it came.
    Result(Result<R, E>),
    /// A response whose body was read whole (it ended at the first poll).
    Whole(http::response::Parts, Bytes),
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Prepare { .. } => "Prepare",
            State::Acquire { .. } => "Acquire",
            State::Call { .. } => "Call",
            State::Release { .. } => "Release",
            State::Reject { .. } => "Reject",
            State::Done => "Done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    /// Go on without a lease: reject, or call the inner service unlocked.
    fn without_lease(inner: &mut S, mut req: Request<B>, how: NoLease) -> State<S, B> {
        match how {
            NoLease::Reject(rejection) => State::Reject { rejection },
            NoLease::Unlocked(lease) => {
                req.extensions_mut().insert(lease);
                State::Call {
                    fut: inner.call(req),
                    guard: None,
                }
            }
        }
    }

    /// The state once the acquire answered: call the inner service with
    /// the lease in the request's extensions (a granted lease held by its
    /// guard), or reject.
    fn admitted(
        config: &Arc<Config>,
        inner: &mut S,
        mut req: Request<B>,
        admission: Admission,
    ) -> State<S, B> {
        let (guard, lease) = match admission {
            Admission::Locked(taken) => {
                let (guard, lease) = taken.hold(config);
                (Some(guard), lease)
            }
            Admission::Unlocked(lease) => (None, lease),
            Admission::Rejected(rejection) => return State::Reject { rejection },
        };
        req.extensions_mut().insert(lease);
        State::Call {
            fut: inner.call(req),
            guard,
        }
    }

    /// Take the lease on `key` for `req`: straight to the call when the
    /// backend answered in the call (in-process), else wait for it with
    /// the ready service (a fresh clone stays behind).
    fn acquiring(config: &Arc<Config>, inner: &mut S, req: Request<B>, key: LockKey) -> State<S, B>
    where
        S: Clone,
    {
        let storage = config.settings.key_space.storage_key(&key);
        // Nothing buffered: a streamed or empty body.
        match acquire::start(config, key, storage, 0) {
            AcquireFuture::Ready(Some(admission)) => Self::admitted(config, inner, req, admission),
            acquire => State::Acquire {
                acquire,
                inner: take_ready(inner),
                req,
            },
        }
    }

    /// [`acquiring`](Self::acquiring) with a service already taken along
    /// (after the body was received: `held` bytes of it).
    fn acquiring_owned(
        config: &Arc<Config>,
        mut inner: S,
        req: Request<B>,
        (key, held): (LockKey, usize),
    ) -> State<S, B> {
        let storage = config.settings.key_space.storage_key(&key);
        match acquire::start(config, key, storage, held) {
            AcquireFuture::Ready(Some(admission)) => {
                Self::admitted(config, &mut inner, req, admission)
            }
            acquire => State::Acquire {
                acquire,
                inner,
                req,
            },
        }
    }

    /// The future of one call of the service whose ready inner service is
    /// `inner`: called right away when nothing needs waiting for, else
    /// taken along (clone-and-swap).
    pub(crate) fn new(config: Arc<Config>, inner: &mut S, req: Request<B>) -> Self
    where
        S: Clone,
    {
        let (parts, body) = req.into_parts();
        let derived = derive(&config, &parts);
        let head = parts.method == http::Method::HEAD;
        let grpc = crate::wire::grpc::is_grpc(&parts.headers);
        let req = Request::from_parts(parts, body);
        let state = match derived {
            Ok(writer) => Self::acquiring(&config, inner, req, writer.finish()),
            Err(how) => Self::without_lease(inner, req, how),
        };
        Self {
            state,
            config,
            head,
            grpc,
        }
    }

    /// Receive the whole body (and hash it into the key when `digest`)
    /// before acquiring, so a client that stalls mid-body holds no lease.
    pub(crate) fn buffered(
        config: Arc<Config>,
        inner: &mut S,
        req: Request<B>,
        digest: bool,
    ) -> Self
    where
        S: Clone,
        B: Body + From<Bytes> + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let (parts, body) = req.into_parts();
        let derived = derive(&config, &parts);
        let head = parts.method == http::Method::HEAD;
        let grpc = crate::wire::grpc::is_grpc(&parts.headers);
        let req = Request::from_parts(parts, body);
        let state = match derived {
            // Nothing to wait for (a GET, an empty body): acquire at once,
            // the request as it came.
            Ok(mut writer) if req.body().is_end_stream() => {
                if digest {
                    body_part(&mut writer, &blake3::hash(&[]));
                }
                Self::acquiring(&config, inner, req, writer.finish())
            }
            Ok(writer) => State::Prepare {
                prepare: Box::pin(read_body(config.clone(), req, writer, digest, grpc)),
                inner: take_ready(inner),
            },
            Err(how) => Self::without_lease(inner, req, how),
        };
        Self {
            state,
            config,
            head,
            grpc,
        }
    }
}

impl<S, B, ResB> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    ResB: Body,
    ResB::Data: From<Bytes>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Prepare { prepare, .. } => {
                    let prepared = ready!(prepare.as_mut().poll(cx));
                    let StateOwned::Prepare { inner, .. } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Prepare")
                    };
                    match prepared {
                        Ok((req, key, held)) => {
                            Self::acquiring_owned(this.config, inner, req, (key, held))
                        }
                        Err(rejection) => State::Reject { rejection },
                    }
                }
                StateProj::Acquire { acquire, .. } => {
                    let admission = ready!(Pin::new(acquire).poll(cx));
                    let StateOwned::Acquire { mut inner, req, .. } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Acquire")
                    };
                    Self::admitted(this.config, &mut inner, req, admission)
                }
                StateProj::Call { fut, guard } => {
                    let result = ready!(fut.poll(cx));
                    let Some(guard) = guard.take() else {
                        this.state.set(State::Done);
                        return Poll::Ready(result.map(|res| res.map(ResponseBody::passthrough)));
                    };
                    match after_call(result, guard, this.config.release, *this.head, cx) {
                        AfterCall::Respond(res) => {
                            this.state.set(State::Done);
                            return Poll::Ready(res);
                        }
                        AfterCall::Release(release, then) => State::Release { release, then },
                    }
                }
                StateProj::Release { release, .. } => {
                    ready!(release.poll(cx));
                    let StateOwned::Release { then, .. } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Release")
                    };
                    return Poll::Ready(hand_over(then));
                }
                StateProj::Reject { rejection } => {
                    let res = this.config.settings.reject(rejection);
                    let res = crate::rejection::for_request(res, *this.grpc);
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(res.map(ResponseBody::full)));
                }
                StateProj::Done => {
                    panic!("tower-redis-lock: ResponseFuture polled after it completed")
                }
            };
            this.state.set(next);
        }
    }
}

/// Derive the key from the request head with the layer's key parts; `Err`
/// says how to go on without a lease.
fn derive(config: &Config, parts: &http::request::Parts) -> Result<KeyWriter, NoLease> {
    let mut writer = config.settings.key_space.writer();
    match config.settings.key.write(parts, &mut writer) {
        Ok(()) => Ok(writer),
        Err(missing) => Err(acquire::missing_part(config, missing)),
    }
}

/// The ready service, to call later; a fresh clone stays in its place
/// (tower's "be careful when cloning inner services").
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

/// What to do with the inner service's answer while holding the lease.
// A value that lives for one match, never stored: boxing the larger variant
// would cost an allocation per request for nothing.
#[allow(clippy::large_enum_variant)]
enum AfterCall<ResB: Body, E> {
    /// Hand this over now (the response's body holds the lease, or there
    /// is no lease left to release).
    Respond(Result<Response<ResponseBody<ResB>>, E>),
    /// Release first, then hand over.
    Release(ReleaseFuture, Then<Response<ResB>, E>),
}

fn after_call<ResB, E>(
    result: Result<Response<ResB>, E>,
    guard: LeaseGuard,
    mode: ReleaseMode,
    head: bool,
    cx: &mut Context<'_>,
) -> AfterCall<ResB, E>
where
    ResB: Body,
    ResB::Data: From<Bytes>,
{
    let res = match result {
        Ok(res) => res,
        // An error is no response to stream: release before returning it.
        Err(err) => return release_then(guard, Then::Result(Err(err))),
    };
    if mode == ReleaseMode::HoldUntilTtl {
        guard.keep_until_ttl();
        return AfterCall::Respond(Ok(res.map(ResponseBody::passthrough)));
    }
    let wait = mode == ReleaseMode::OnCompletion;
    let declared = declared_len(res.headers(), res.body());
    if !wait && (res.body().is_end_stream() || never_polled(head, res.status(), declared)) {
        // Fire-and-forget, nothing to poll: released now (dropping the
        // armed guard spawns it), and the body left as it is, so that an
        // empty one still reads as ended (HTTP/2 sends the head with
        // END_STREAM; a gRPC trailers-only answer keeps its trailers).
        drop(guard);
        return AfterCall::Respond(Ok(res.map(ResponseBody::passthrough)));
    }
    if wait && (res.body().is_end_stream() || never_polled(head, res.status(), declared)) {
        // Nothing will be polled from the body (it is empty, or hyper drops
        // it unwritten): release before the response leaves, not from the
        // body's `Drop` after the client has its answer.
        return release_then(guard, Then::Result(Ok(res)));
    }
    let (parts, body) = res.into_parts();
    let mut body = Box::pin(body);
    // Poll once here: a body already in memory (axum's String/Json/Bytes
    // answers) ends now, so the release runs before the head leaves and the
    // server writes head and body together, not the head and then, after the
    // release, the body (a write and a read more).
    let first = if wait {
        match body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) if body.is_end_stream() => match frame.into_data() {
                Ok(mut data) => {
                    let bytes = data.copy_to_bytes(data.remaining());
                    return release_then(guard, Then::Whole(parts, bytes));
                }
                // Trailers only: the body hands them out.
                Err(frame) => Some(Ok(frame)),
            },
            Poll::Ready(None) => {
                return release_then(guard, Then::Whole(parts, Bytes::new()));
            }
            Poll::Ready(Some(item)) => Some(item),
            Poll::Pending => None,
        }
    } else {
        None
    };
    let body = ResponseBody::locked(body, guard, declared, wait, first);
    AfterCall::Respond(Ok(Response::from_parts(parts, body)))
}

/// Release, then hand `then` over: at once when the backend released in
/// the call (in-process), else once the release future finished.
fn release_then<ResB, E>(guard: LeaseGuard, then: Then<Response<ResB>, E>) -> AfterCall<ResB, E>
where
    ResB: Body,
{
    let release = guard.release();
    if release.is_done() {
        return AfterCall::Respond(hand_over(then));
    }
    AfterCall::Release(release, then)
}

/// The answer a future hands over once its lease is released.
fn hand_over<ResB: Body, E>(
    then: Then<Response<ResB>, E>,
) -> Result<Response<ResponseBody<ResB>>, E> {
    match then {
        Then::Whole(parts, bytes) => Ok(Response::from_parts(parts, ResponseBody::full(bytes))),
        Then::Result(result) => result.map(|res| res.map(ResponseBody::passthrough)),
    }
}

/// `true` when the body of this answer is never written, so a server may drop
/// it without polling it: the answer to HEAD (axum swaps its body for an empty
/// one), 1xx, 204 and 304 (hyper drops it), or a body declared empty.
fn never_polled(head: bool, status: http::StatusCode, declared: Option<u64>) -> bool {
    head || status.is_informational()
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED
        || declared == Some(0)
}

/// The body length the client will see, if declared up front.
fn declared_len<B: Body>(headers: &http::HeaderMap, body: &B) -> Option<u64> {
    crate::wire::body::declared_length(headers).or_else(|| body.size_hint().exact())
}

/// Receive the body within the layer's limit and timeout (see
/// [`receive`](crate::wire::body::receive)), hash it into the key when
/// `digest`, and rebuild the request with identical bytes.
async fn read_body<B>(
    config: Arc<Config>,
    req: Request<B>,
    mut writer: KeyWriter,
    digest: bool,
    grpc: bool,
) -> Prepared<B>
where
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (parts, body) = req.into_parts();
    let mut hasher = digest.then(blake3::Hasher::new);
    let bytes = crate::wire::body::receive(
        body,
        &parts.headers,
        grpc,
        config.settings.body_limit,
        config.settings.body_timeout,
        hasher.as_mut(),
    )
    .await?;
    if let Some(hasher) = hasher {
        body_part(&mut writer, &hasher.finalize());
    }
    // A waiter is counted for its body's length (`max_waiting_bytes`), so
    // it must hold no more than that: a one-chunk body is a slice of the
    // server's read buffer (hyper's, kilobytes to hundreds of them, kept
    // whole by the slice), and a joined one may have up to twice its
    // length of room. The copy is made on a layer that waits only.
    let bytes = if config.wait.is_some() && !bytes.is_empty() {
        Bytes::copy_from_slice(&bytes)
    } else {
        bytes
    };
    let held = bytes.len();
    Ok((
        Request::from_parts(parts, B::from(bytes)),
        writer.finish(),
        held,
    ))
}
