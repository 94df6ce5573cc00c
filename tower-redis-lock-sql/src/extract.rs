//! The axum extractors of the request's transaction: [`PgTransaction`] and
//! [`SqlxTransaction`], each also as an `Option`. Each reads what the store
//! put into the request's extensions when the request won its claim
//! ([`IdempotencyBackend::claimed`](tower_redis_lock::backend::IdempotencyBackend::claimed)),
//! and without it answers the middleware's 500 problem+json naming the
//! missing layer.

#[cfg(feature = "postgres")]
use crate::PgTransaction;
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
use crate::SqlxTransaction;
use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use http::request::Parts;
use tower_redis_lock::Rejection;

/// The rejection of the [`PgTransaction`] extractor without a transaction:
/// no idempotency layer over a `PostgresBackend` is in front of the handler.
#[cfg(feature = "postgres")]
const MISSING_PG_TRANSACTION: Rejection = Rejection::MissingExtension {
    extractor: "PgTransaction",
    layer: "IdempotencyLayer over a PostgresBackend",
};

/// The rejection of the [`SqlxTransaction`] extractor without a
/// transaction: no idempotency layer over a sqlx store is in front of the
/// handler.
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
const MISSING_SQLX_TRANSACTION: Rejection = Rejection::MissingExtension {
    extractor: "SqlxTransaction",
    layer: "IdempotencyLayer over a SqlxPostgresBackend or SqliteBackend",
};

/// `PgTransaction` in a handler's arguments: the transaction the store
/// opened for this request's claim.
#[cfg(feature = "postgres")]
impl<S: Send + Sync> FromRequestParts<S> for PgTransaction {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<PgTransaction>()
            .cloned()
            .ok_or(MISSING_PG_TRANSACTION)
    }
}

/// `Option<PgTransaction>`: `None` on a route without the store's layer.
#[cfg(feature = "postgres")]
impl<S: Send + Sync> OptionalFromRequestParts<S> for PgTransaction {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<PgTransaction>().cloned())
    }
}

/// `SqlxTransaction<Postgres>` or `SqlxTransaction<Sqlite>` in a handler's
/// arguments: the transaction the store opened for this request's claim.
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
impl<S: Send + Sync, DB: sqlx::Database> FromRequestParts<S> for SqlxTransaction<DB> {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<SqlxTransaction<DB>>()
            .cloned()
            .ok_or(MISSING_SQLX_TRANSACTION)
    }
}

/// `Option<SqlxTransaction<DB>>`: `None` on a route without the store's
/// layer.
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
impl<S: Send + Sync, DB: sqlx::Database> OptionalFromRequestParts<S> for SqlxTransaction<DB> {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<SqlxTransaction<DB>>().cloned())
    }
}
