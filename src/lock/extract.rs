//! axum extractors: [`Lease`] (what the layer acquired) and [`LockGuard`]
//! (take the lease in the handler signature).

use std::convert::Infallible;

use axum::extract::{FromRef, FromRequestParts, OptionalFromRequestParts};
use axum::response::Response;
use http::request::Parts;

use super::lease::Lease;
use super::locker::{LockGuard, Locker};
use crate::rejection::Rejection;

/// The rejection of the [`Lease`] extractor without the layer in front.
const MISSING_LEASE: Rejection = Rejection::MissingExtension {
    extractor: "Lease",
    layer: "RedisLockLayer",
};

/// The request's [`Lease`], as the layer put it in the request extensions.
/// Without a [`RedisLockLayer`](crate::RedisLockLayer) in front the request
/// is rejected with a 500 naming the layer; take `Option<Lease>` where the
/// layer is optional.
impl<S: Send + Sync> FromRequestParts<S> for Lease {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Lease>()
            .cloned()
            .ok_or(MISSING_LEASE)
    }
}

/// The request's [`Lease`] if a [`RedisLockLayer`](crate::RedisLockLayer)
/// is in front, `None` otherwise.
impl<S: Send + Sync> OptionalFromRequestParts<S> for Lease {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Lease>().cloned())
    }
}

/// Takes the lease in the handler's signature, keyed by the [`Locker`]'s key
/// parts (from the router state, via `FromRef`). Answers 409/503 like the
/// layer (with its custom responder, if any).
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_redis_lock::{key::{RequestMethod, Route, Header}, lock::LockGuard, MemoryBackend, RedisLockLayer};
///
/// async fn pay(guard: LockGuard) -> &'static str {
///     // ... the work ...
///     guard.release().await; // release before answering
///     "paid"
/// }
///
/// let locker = RedisLockLayer::new(MemoryBackend::new(), (RequestMethod, Route, Header::trusted_identity("x-user-id")))
///     .locker();
/// let app: Router = Router::new().route("/pay", post(pay)).with_state(locker);
/// ```
impl<S> FromRequestParts<S> for LockGuard
where
    Locker: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let locker = Locker::from_ref(state);
        locker
            .lock_request(parts)
            .await
            .map_err(|r| locker.response_for(&r).map(axum::body::Body::from))
    }
}
