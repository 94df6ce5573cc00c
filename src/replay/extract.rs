//! axum extractor for the validated [`IdempotencyKey`].

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::StatusCode;

use super::key::IdempotencyKey;

/// Rejection of the [`IdempotencyKey`] extractor: no key was validated for
/// this request, because the [`IdempotencyLayer`](super::IdempotencyLayer)
/// is not in front of the handler (or the key is optional and was absent:
/// take `Option<IdempotencyKey>` then).
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct MissingIdempotencyKey;

impl MissingIdempotencyKey {
    /// 500: a wiring mistake on the server, not the client's fault.
    pub fn status(&self) -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
    }
}

impl std::fmt::Display for MissingIdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the `IdempotencyKey` extractor found no validated key: add `IdempotencyLayer` \
             to this route (`MethodRouter::layer`, `Router::route_layer` or `Router::layer`), \
             or take `Option<IdempotencyKey>` when the key is optional",
        )
    }
}

impl std::error::Error for MissingIdempotencyKey {}

impl IntoResponse for MissingIdempotencyKey {
    fn into_response(self) -> Response {
        tracing::error!("{self}");
        (self.status(), self.to_string()).into_response()
    }
}

/// The key the [`IdempotencyLayer`](super::IdempotencyLayer) validated and
/// claimed for this request.
///
/// ```
/// use tower_redis_lock::replay::IdempotencyKey;
///
/// async fn create_payment(key: IdempotencyKey) -> String {
///     // e.g. also write it into a unique column, as a second line of defence
///     format!("created under {key}")
/// }
/// ```
impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = MissingIdempotencyKey;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyKey>()
            .cloned()
            .ok_or(MissingIdempotencyKey)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<IdempotencyKey>().cloned())
    }
}
