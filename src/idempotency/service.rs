//! [`Idempotency`], the middleware service, and its (boxed) response future:
//! [`admit`](super::admission) the request (answer it, or win its claim),
//! then [run](super::execution) a claimed request to its end: in the
//! connection's task while it waits, in a task of its own once its future
//! is dropped (`RunToEnd`).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tokio::sync::oneshot;
use tower_service::Service;

use super::admission::{admit, Admission, BoxError};
use super::answer::internal_error;
use super::body::ResponseBody;
use super::config::Config;
use super::execution::{execute, Reply};
use super::layer::IdempotencyLayer;
use crate::backend::IdempotencyBackend;
use crate::key::KeyPart;
use crate::run_to_end::RunToEnd;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

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
    pub fn layer(backend: impl IdempotencyBackend, key: impl KeyPart) -> IdempotencyLayer {
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

    /// The wrapped service, unwrapped.
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
    /// A boxed future: a claimed request runs to its end even if this
    /// future is dropped (the rest moves to a task of its own).
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The ready service goes into the future; a fresh clone stays here.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(run(self.config.clone(), inner, req))
    }
}

/// The request flow: admission, then the run to its end and its answer.
async fn run<S, B, ResB>(config: Arc<Config>, inner: S, req: Request<B>) -> Reply<ResB, S::Error>
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
    let (parts, body) = req.into_parts();
    if config.skip_when.as_ref().is_some_and(|skip| skip(&parts)) {
        let mut inner = inner;
        let res = inner.call(Request::from_parts(parts, body)).await?;
        return Ok(res.map(ResponseBody::passthrough));
    }
    // A gRPC request is answered in gRPC: its rejections as statuses. Read
    // once, here, and handed to whatever needs to know.
    let grpc = crate::wire::grpc::is_grpc(&parts.headers);
    let req = Request::from_parts(parts, body);
    let (req, won) = match admit(&config, req, grpc).await {
        Admission::Answered(res) => {
            let res = crate::rejection::for_request(res, grpc);
            return Ok(ResponseBody::answer(res));
        }
        Admission::Run(req, won) => (req, *won),
    };
    // From here on the request runs to its end and its outcome is recorded,
    // whatever becomes of this future (client gone, outer timeout).
    let (tx, rx) = oneshot::channel();
    RunToEnd::new(execute(config, inner, req, won, grpc, tx)).await;
    match rx.await {
        Ok(answer) => answer,
        // The task ended without an answer: the runtime is shutting down.
        Err(_) => Ok(internal_error(grpc).map(ResponseBody::full)),
    }
}

#[cfg(test)]
mod tests;
