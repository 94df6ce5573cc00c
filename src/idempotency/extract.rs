//! axum extractors: the validated [`IdempotencyKey`], and the request's
//! transaction of a transactional store.

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

/// The rejection of the [`PgTransaction`](crate::backend::PgTransaction)
/// extractor without a transaction: no idempotency layer over a
/// `PostgresBackend` is in front of the handler.
#[cfg(feature = "postgres")]
const MISSING_TRANSACTION: Rejection = Rejection::MissingExtension {
    extractor: "PgTransaction",
    layer: "IdempotencyLayer over a PostgresBackend",
};

// `PgTransaction` and `Option<PgTransaction>`: the transaction the store
// opened for this request's claim.
#[cfg(feature = "postgres")]
extension_extractor!(crate::backend::PgTransaction, MISSING_TRANSACTION);

/// The rejection of the [`SqlxTransaction`](crate::backend::SqlxTransaction)
/// extractor without a transaction: no idempotency layer over a sqlx store
/// is in front of the handler.
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
const MISSING_SQLX_TRANSACTION: Rejection = Rejection::MissingExtension {
    extractor: "SqlxTransaction",
    layer: "IdempotencyLayer over a SqlxPostgresBackend or SqliteBackend",
};

// `SqlxTransaction<Postgres>` / `SqlxTransaction<Sqlite>` and their
// `Option`s: the transaction the store opened for this request's claim.
#[cfg(feature = "sqlx-postgres")]
extension_extractor!(
    crate::backend::SqlxTransaction<sqlx::Postgres>,
    MISSING_SQLX_TRANSACTION
);
#[cfg(feature = "sqlx-sqlite")]
extension_extractor!(
    crate::backend::SqlxTransaction<sqlx::Sqlite>,
    MISSING_SQLX_TRANSACTION
);
