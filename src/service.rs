//! [`RedisLock`], the middleware service.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::future::ResponseFuture;
use crate::layer::{BodyDigest, NoBodyDigest, RedisLockLayer, Shared};
use crate::LockBackend;

/// Middleware that takes a lease per request (see [`RedisLockLayer`]).
pub struct RedisLock<S, D = NoBodyDigest> {
    inner: S,
    shared: Arc<Shared>,
    _digest: PhantomData<fn() -> D>,
}

impl<S, D> RedisLock<S, D> {
    pub(crate) fn from_parts(inner: S, shared: Arc<Shared>) -> Self {
        Self {
            inner,
            shared,
            _digest: PhantomData,
        }
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

impl<S> RedisLock<S, NoBodyDigest> {
    /// Shorthand for [`RedisLockLayer::new`].
    pub fn layer(backend: impl LockBackend) -> RedisLockLayer<NoBodyDigest> {
        RedisLockLayer::new(backend)
    }
}

impl<S: Clone, D> Clone for RedisLock<S, D> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
            _digest: PhantomData,
        }
    }
}

impl<S: fmt::Debug, D> fmt::Debug for RedisLock<S, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLock")
            .field("inner", &self.inner)
            .field("backend", &self.shared.backend)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResB> Service<Request<B>> for RedisLock<S, NoBodyDigest>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone,
    ResB: Body,
    ResB::Data: From<Bytes>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The ready service goes into the future; a fresh clone stays here.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(self.shared.clone(), inner, req)
    }
}

impl<S, B, ResB> Service<Request<B>> for RedisLock<S, BodyDigest>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResB: Body,
    ResB::Data: From<Bytes>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::with_body_digest(self.shared.clone(), inner, req)
    }
}
