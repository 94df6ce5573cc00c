//! [`RedisLock`], the middleware service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::body::ResponseBody;
use super::config::Config;
use super::future::ResponseFuture;
use super::layer::RedisLockLayer;
use crate::backend::LockBackend;
use crate::key::KeyPart;

/// Middleware that takes a lease per request (see [`RedisLockLayer`]).
pub struct RedisLock<S, const STREAM: bool = false> {
    inner: S,
    config: Arc<Config>,
}

impl<S, const STREAM: bool> RedisLock<S, STREAM> {
    pub(crate) fn from_parts(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// The wrapped service.
    ///
    /// ```
    /// # use tower_redis_lock::{key::Route, lock::RedisLock, MemoryBackend, RedisLockLayer};
    /// # use tower_layer::Layer;
    /// let svc: RedisLock<&str> = RedisLockLayer::new(MemoryBackend::new(), Route).layer("inner");
    /// assert_eq!(*svc.get_ref(), "inner");
    /// ```
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

impl<S> RedisLock<S> {
    /// Shorthand for [`RedisLockLayer::new`].
    pub fn layer(backend: impl LockBackend, key: impl KeyPart) -> RedisLockLayer {
        RedisLockLayer::new(backend, key)
    }
}

impl<S: Clone, const STREAM: bool> Clone for RedisLock<S, STREAM> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug, const STREAM: bool> fmt::Debug for RedisLock<S, STREAM> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLock")
            .field("inner", &self.inner)
            .field("backend", &self.config.backend)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResB> Service<Request<B>> for RedisLock<S, true>
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
        // The ready service is called now if nothing needs waiting for, else
        // it goes into the future and a fresh clone stays here.
        ResponseFuture::new(self.config.clone(), &mut self.inner, req)
    }
}

impl<S, B, ResB> Service<Request<B>> for RedisLock<S, false>
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
        let digest = self.config.digest;
        ResponseFuture::buffered(self.config.clone(), &mut self.inner, req, digest)
    }
}

#[cfg(test)]
mod tests;
