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

// `IdempotencyKey` and `Option<IdempotencyKey>` in a handler's arguments:
// the key the layer validated and claimed for this request.
extension_extractor!(IdempotencyKey, MISSING_KEY);
