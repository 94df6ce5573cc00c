//! [`ResponseFuture`]: derive key → (read body) → acquire → call → wrap body.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::key::{body_part, KeyWriter, LockKey};
use crate::layer::{Admission, NoLease, ReleaseMode, Shared};
use crate::lease::{LeaseGuard, ReleaseFuture};
use crate::response::Rejection;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
type Prepared<B> = Result<(Request<B>, LockKey), Rejection>;

pin_project! {
    /// Response future of [`RedisLock`](crate::RedisLock).
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S::Future>,
        shared: Arc<Shared>,
        inner: Option<S>,
        req: Option<Request<B>>,
        prepare: Option<BoxFuture<Prepared<B>>>,
        acquire: Option<BoxFuture<Admission>>,
        guard: Option<LeaseGuard>,
        release: Option<ReleaseFuture>,
        ready: Option<Result<S::Response, S::Error>>,
        // A response whose body was read whole while waiting for the release.
        finished: Option<(http::response::Parts, Bytes)>,
        rejection: Option<Rejection>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        // Reading the body for its digest.
        Prepare,
        // Waiting for the backend.
        Acquire,
        // The inner service is running.
        Call { #[pin] fut: F },
        // Waiting for the release before handing over `ready`.
        Release,
        // `rejection` is the answer.
        Reject,
        Done,
    }
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn empty(shared: Arc<Shared>, inner: S) -> Self {
        Self {
            state: State::Done,
            shared,
            inner: Some(inner),
            req: None,
            prepare: None,
            acquire: None,
            guard: None,
            release: None,
            ready: None,
            finished: None,
            rejection: None,
        }
    }

    /// Go on without a lease: reject, or call the inner service unlocked.
    fn without_lease(&mut self, mut req: Request<B>, how: NoLease) {
        match how {
            NoLease::Reject(r) => {
                self.rejection = Some(r);
                self.state = State::Reject;
            }
            NoLease::Unlocked(lease) => {
                req.extensions_mut().insert(lease);
                self.state = match self.inner.take() {
                    Some(mut inner) => State::Call {
                        fut: inner.call(req),
                    },
                    None => State::Done,
                };
            }
        }
    }

    pub(crate) fn new(shared: Arc<Shared>, inner: S, req: Request<B>) -> Self {
        let mut this = Self::empty(shared.clone(), inner);
        let (parts, body) = req.into_parts();
        let derived = shared.derive(&parts);
        let req = Request::from_parts(parts, body);
        match derived {
            Ok(writer) => {
                this.acquire = Some(Box::pin(shared.acquire(writer.finish())));
                this.req = Some(req);
                this.state = State::Acquire;
            }
            Err(how) => this.without_lease(req, how),
        }
        this
    }

    pub(crate) fn with_body_digest(shared: Arc<Shared>, inner: S, req: Request<B>) -> Self
    where
        B: Body + From<Bytes> + Send + 'static,
        B::Data: Send,
    {
        let mut this = Self::empty(shared.clone(), inner);
        let (parts, body) = req.into_parts();
        let derived = shared.derive(&parts);
        let req = Request::from_parts(parts, body);
        match derived {
            Ok(writer) => {
                this.prepare = Some(Box::pin(read_body(
                    req,
                    writer,
                    shared.body_limit,
                    shared.body_timeout,
                )));
                this.state = State::Prepare;
            }
            Err(how) => this.without_lease(req, how),
        }
        this
    }
}

impl<S, B, ResB> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    ResB: Body,
    ResB::Data: From<Bytes>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let mut this = self.as_mut().project();
            match this.state.as_mut().project() {
                StateProj::Prepare => {
                    let Some(prepare) = this.prepare.as_mut() else {
                        this.state.set(State::Done);
                        continue;
                    };
                    let prepared = ready!(prepare.as_mut().poll(cx));
                    *this.prepare = None;
                    match prepared {
                        Ok((req, key)) => {
                            *this.req = Some(req);
                            *this.acquire = Some(Box::pin(this.shared.clone().acquire(key)));
                            this.state.set(State::Acquire);
                        }
                        Err(rejection) => {
                            *this.rejection = Some(rejection);
                            this.state.set(State::Reject);
                        }
                    }
                }
                StateProj::Acquire => {
                    let Some(acquire) = this.acquire.as_mut() else {
                        this.state.set(State::Done);
                        continue;
                    };
                    let admission = ready!(acquire.as_mut().poll(cx));
                    *this.acquire = None;
                    let lease = match admission {
                        Admission::Locked(guard, lease) => {
                            *this.guard = Some(guard);
                            lease
                        }
                        Admission::Unlocked(lease) => lease,
                        Admission::Rejected(rejection) => {
                            *this.rejection = Some(rejection);
                            this.state.set(State::Reject);
                            continue;
                        }
                    };
                    match (this.req.take(), this.inner.take()) {
                        (Some(mut req), Some(mut inner)) => {
                            req.extensions_mut().insert(lease);
                            let fut = inner.call(req);
                            this.state.set(State::Call { fut });
                        }
                        _ => this.state.set(State::Done),
                    }
                }
                StateProj::Call { fut } => {
                    let result = ready!(fut.poll(cx));
                    let Some(guard) = this.guard.take() else {
                        this.state.set(State::Done);
                        return Poll::Ready(result.map(|res| res.map(ResponseBody::unlocked)));
                    };
                    match result {
                        Ok(res) => match this.shared.release {
                            ReleaseMode::HoldUntilTtl => {
                                guard.keep_until_ttl();
                                this.state.set(State::Done);
                                return Poll::Ready(Ok(res.map(ResponseBody::unlocked)));
                            }
                            mode => {
                                if res.body().is_end_stream() && mode == ReleaseMode::OnCompletion {
                                    // Nothing will be polled from the body:
                                    // release before the response leaves.
                                    *this.release = Some(guard.release());
                                    *this.ready = Some(Ok(res));
                                    this.state.set(State::Release);
                                } else {
                                    let wait = mode == ReleaseMode::OnCompletion;
                                    let (parts, body) = res.into_parts();
                                    let declared = declared_len(&parts.headers, &body);
                                    let mut body = Box::pin(body);
                                    // Poll once here: a body already in memory
                                    // (axum's String/Json/Bytes answers) ends
                                    // now, so the release runs before the head
                                    // leaves and the server writes head and body
                                    // together, not the head and then, after the
                                    // release, the body (a write and a read more).
                                    let first = if wait {
                                        match body.as_mut().poll_frame(cx) {
                                            Poll::Ready(Some(Ok(frame)))
                                                if body.is_end_stream() =>
                                            {
                                                match frame.into_data() {
                                                    Ok(mut data) => {
                                                        let n = data.remaining();
                                                        let bytes = data.copy_to_bytes(n);
                                                        *this.finished = Some((parts, bytes));
                                                        *this.release = Some(guard.release());
                                                        this.state.set(State::Release);
                                                        continue;
                                                    }
                                                    // Trailers only: the body hands them out.
                                                    Err(frame) => Some(Ok(frame)),
                                                }
                                            }
                                            Poll::Ready(None) => {
                                                *this.finished = Some((parts, Bytes::new()));
                                                *this.release = Some(guard.release());
                                                this.state.set(State::Release);
                                                continue;
                                            }
                                            Poll::Ready(Some(item)) => Some(item),
                                            Poll::Pending => None,
                                        }
                                    } else {
                                        None
                                    };
                                    this.state.set(State::Done);
                                    let body =
                                        ResponseBody::locked(body, guard, declared, wait, first);
                                    return Poll::Ready(Ok(Response::from_parts(parts, body)));
                                }
                            }
                        },
                        Err(err) => {
                            *this.release = Some(guard.release());
                            *this.ready = Some(Err(err));
                            this.state.set(State::Release);
                        }
                    }
                }
                StateProj::Release => {
                    if let Some(release) = this.release.as_mut() {
                        ready!(release.as_mut().poll(cx));
                        *this.release = None;
                    }
                    this.state.set(State::Done);
                    if let Some((parts, bytes)) = this.finished.take() {
                        return Poll::Ready(Ok(Response::from_parts(
                            parts,
                            ResponseBody::full(bytes),
                        )));
                    }
                    match this.ready.take() {
                        Some(result) => {
                            return Poll::Ready(result.map(|res| res.map(ResponseBody::unlocked)))
                        }
                        None => continue,
                    }
                }
                StateProj::Reject => {
                    this.state.set(State::Done);
                    let rejection = this.rejection.take().unwrap_or(Rejection::InvalidBody);
                    let res = this.shared.reject(&rejection);
                    return Poll::Ready(Ok(res.map(ResponseBody::full)));
                }
                StateProj::Done => {
                    // Polled after completion (or an internal slot went
                    // missing): answer 503 rather than panic.
                    let res = Rejection::Unavailable {
                        retry_after: Duration::from_secs(1),
                    }
                    .to_response();
                    return Poll::Ready(Ok(res.map(ResponseBody::full)));
                }
            }
        }
    }
}

/// The body length the client will see, if declared up front.
fn declared_len<B: Body>(headers: &http::HeaderMap, body: &B) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .or_else(|| body.size_hint().exact())
}

/// Buffer the body (up to `limit`, within `timeout`), hash it into the key,
/// and rebuild the request with identical bytes.
async fn read_body<B>(
    req: Request<B>,
    mut writer: KeyWriter,
    limit: usize,
    timeout: Duration,
) -> Prepared<B>
where
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
{
    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Rejection::PayloadTooLarge { limit });
    }
    let collect = async move {
        let mut body = std::pin::pin!(body);
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut total = 0usize;
        let mut hasher = blake3::Hasher::new();
        while let Some(frame) = body.as_mut().frame().await {
            let frame = frame.map_err(|_| Rejection::InvalidBody)?;
            if let Ok(mut data) = frame.into_data() {
                let n = data.remaining();
                total = total.saturating_add(n);
                if total > limit {
                    return Err(Rejection::PayloadTooLarge { limit });
                }
                let bytes = data.copy_to_bytes(n);
                hasher.update(&bytes);
                if !bytes.is_empty() {
                    chunks.push(bytes);
                }
            }
        }
        Ok((chunks, total, hasher.finalize()))
    };
    let (mut chunks, total, hash) = match tokio::time::timeout(timeout, collect).await {
        Ok(collected) => collected?,
        Err(_) => return Err(Rejection::BodyTimeout { after: timeout }),
    };
    body_part(&mut writer, &hash);
    let bytes = match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().unwrap_or_default(),
        _ => {
            let mut buf = BytesMut::with_capacity(total);
            for chunk in &chunks {
                buf.extend_from_slice(chunk);
            }
            buf.freeze()
        }
    };
    Ok((Request::from_parts(parts, B::from(bytes)), writer.finish()))
}
