//! The integration tests, in one binary (each binary links the crates
//! again): the crash tests and the layer over a SQL store over real HTTP
//! (`exactly_once`), and what the `exactly_once` example prints
//! (`examples`, `example_provider`). Shared helpers in `common`.
//!
//! The store-parameterised tests run one body against every SQL store
//! (`common::stores`), so they need every feature (`--all-features`):
//! a handler that ends its own transaction (`every_path`), a process
//! killed after its handler's own `COMMIT` (`crash_after_commit`),
//! SQLite's single writer (`sqlite_concurrency`), a slow `COMMIT`
//! (`slow_commit`), a lost `COMMIT` answer through a fault proxy
//! (`lost_ack`), a server-side idle timeout (`idle_in_transaction`) and a
//! transaction-mode pooler (`pooler`).

mod common;
mod exactly_once;
mod example_provider;
mod examples;

#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod crash_after_commit;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod every_path;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod idle_in_transaction;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod lost_ack;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod pooler;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod slow_commit;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod sqlite_concurrency;
