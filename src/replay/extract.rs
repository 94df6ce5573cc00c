//! axum extractor for the validated [`IdempotencyKey`].

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use http::request::Parts;

use super::key::IdempotencyKey;
use crate::Rejection;

/// The rejection of the [`IdempotencyKey`] extractor without a validated
/// key: the [`IdempotencyLayer`](super::IdempotencyLayer) is not in front of
/// the handler (or the key is optional and was absent: take
/// `Option<IdempotencyKey>` then).
const MISSING_KEY: Rejection = Rejection::MissingExtension {
    extractor: "IdempotencyKey",
    layer: "IdempotencyLayer",
};

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
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyKey>()
            .cloned()
            .ok_or(MISSING_KEY)
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
