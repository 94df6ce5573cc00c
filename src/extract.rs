//! axum extractors: [`Lease`] (what the layer acquired) and [`LockGuard`]
//! (take the lease in the handler signature).

use axum::extract::{FromRef, FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::StatusCode;

use crate::lease::Lease;
use crate::locker::{LockGuard, Locker};

/// Rejection of the [`Lease`] extractor: the layer is not in front of this
/// handler.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct MissingLease;

impl MissingLease {
    /// 500: a wiring mistake on the server, not the client's fault.
    pub fn status(&self) -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
    }
}

impl std::fmt::Display for MissingLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the `Lease` extractor found no lease: add `RedisLockLayer` to this route \
             (`Router::route_layer`, `Router::layer` or `MethodRouter::layer`), \
             or take `Option<Lease>`",
        )
    }
}

impl std::error::Error for MissingLease {}

impl IntoResponse for MissingLease {
    fn into_response(self) -> Response {
        tracing::error!("{self}");
        (self.status(), self.to_string()).into_response()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Lease {
    type Rejection = MissingLease;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Lease>().cloned().ok_or(MissingLease)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for Lease {
    type Rejection = std::convert::Infallible;

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
/// use tower_redis_lock::{key::{Method, Route, TrustedHeader}, LockGuard, MemoryBackend, RedisLockLayer};
///
/// async fn pay(guard: LockGuard) -> &'static str {
///     // ... the work ...
///     guard.release().await; // release before answering
///     "paid"
/// }
///
/// let locker = RedisLockLayer::new(MemoryBackend::new())
///     .key((Method, Route, TrustedHeader::new("x-user-id")))
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
