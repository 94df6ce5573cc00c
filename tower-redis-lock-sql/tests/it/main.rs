//! The integration tests, in one binary (each binary links the crates
//! again): the crash tests and the layer over a SQL store over real HTTP
//! (`exactly_once`), and what the `exactly_once` example prints
//! (`examples`). Shared helpers in `common`.

mod common;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod crash_after_commit;
// The store-parameterised tests run every store: with every feature.
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod every_path;
mod exactly_once;
mod example_provider;
mod examples;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod idle_in_transaction;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod lost_ack;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod slow_commit;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod sqlite_concurrency;
