//! The axum extractor of the validated [`IdempotencyKey`] (the SQL stores'
//! transaction extractors are in their crate,
//! [`tower-redis-lock-sql`](https://docs.rs/tower-redis-lock-sql)).

use super::header::IdempotencyKey;
use crate::Rejection;

/// The rejection of the [`IdempotencyKey`] extractor without a validated
/// key: the [`IdempotencyLayer`](super::IdempotencyLayer) is not in front of
/// the handler (or the key is optional and was absent: take
/// `Option<IdempotencyKey>` then).
const MISSING_KEY: Rejection = Rejection::MissingExtension {
    extractor: "IdempotencyKey",
    layer: "IdempotencyLayer",
};

/// `IdempotencyKey` in a handler's arguments: the key the layer validated
/// and claimed for this request; without one, a 500 naming the layer.
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IdempotencyKey {
    type Rejection = Rejection;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyKey>()
            .cloned()
            .ok_or(MISSING_KEY)
    }
}

/// `Option<IdempotencyKey>`: `None` without a validated key (no layer in
/// front, or an optional key that was absent).
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<IdempotencyKey>().cloned())
    }
}
