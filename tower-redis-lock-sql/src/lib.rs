//! Exactly once for database side effects: the idempotency stores of
//! [`tower-redis-lock`](https://docs.rs/tower-redis-lock) in SQL. Behind
//! its [`IdempotencyLayer`](tower_redis_lock::IdempotencyLayer), the claim,
//! the handler's own writes and the idempotency record commit in **one
//! database transaction**, the application's own: a crash, a kill or a lost
//! connection before the commit leaves nothing (the retry runs on a clean
//! slate); after it every retry replays.
//!
//! - [`PostgresBackend`] (feature `postgres`): PostgreSQL over the
//!   application's tokio-postgres ([deadpool-postgres]) pool; the handler
//!   takes a [`PgTransaction`].
//! - [`SqlxPostgresBackend`] (feature `sqlx-postgres`): PostgreSQL over the
//!   application's `sqlx::PgPool`; the handler takes a
//!   [`SqlxTransaction<Postgres>`](SqlxTransaction).
//! - [`SqliteBackend`] (feature `sqlx-sqlite`): SQLite over the
//!   application's `sqlx::SqlitePool`, the durable store for one machine;
//!   the handler takes a [`SqlxTransaction<Sqlite>`](SqlxTransaction).
//!
//! [deadpool-postgres]: https://docs.rs/deadpool-postgres
//!
//! ```toml
//! [dependencies]
//! tower-redis-lock = "0.2"
//! tower-redis-lock-sql = { version = "0.1", features = ["sqlx-postgres"] }
//! ```
//!
//! ```no_run
//! # #[cfg(feature = "sqlx-postgres")]
//! # mod demo {
//! use axum::{routing::post, Router};
//! use sqlx::Postgres;
//! use axum::http::StatusCode;
//! use axum::response::{IntoResponse, Response};
//! use tower_redis_lock::idempotency::{IdempotencyKey, SafeToRetry};
//! use tower_redis_lock::key::{Header, RequestMethod, Route};
//! use tower_redis_lock::IdempotencyLayer;
//! use tower_redis_lock_sql::{SqlxPostgresBackend, SqlxTransaction};
//!
//! async fn pay(tx: SqlxTransaction<Postgres>, key: IdempotencyKey) -> Result<&'static str, Response> {
//!     // A payment provider gets `key.downstream()` as its idempotency key.
//!     let mut conn = tx.conn().await.map_err(db_error)?;
//!     sqlx::query("INSERT INTO charges (idempotency_key) VALUES ($1)")
//!         .bind(key.as_str())
//!         .execute(&mut *conn) // commits with the idempotency record, or not at all
//!         .await
//!         .map_err(db_error)?;
//!     Ok("charged")
//! }
//!
//! /// Nothing was charged: 503, and the key stays free for the retry
//! /// (`SafeToRetry`). An `Err(String)` would be answered 200, and recorded.
//! fn db_error(e: impl std::fmt::Display) -> Response {
//!     (StatusCode::SERVICE_UNAVAILABLE, SafeToRetry, e.to_string()).into_response()
//! }
//!
//! async fn app(pool: sqlx::PgPool) -> Result<Router, tower_redis_lock::backend::BackendError> {
//!     let store = SqlxPostgresBackend::new(pool); // or SqliteBackend::new(sqlite_pool)
//!     store.migrate().await?;
//!     let key = (RequestMethod, Route, Header::trusted_identity("x-user-id"));
//!     Ok(Router::new().route("/payments", post(pay).layer(IdempotencyLayer::new(store, key))))
//! }
//! # }
//! ```
//!
//! A duplicate in flight is answered as with the middleware's other stores
//! (409, or with `.join_timeout` it joins and replays), its waits on a
//! statement of its own, outside any handler's transaction. What
//! `store_when` refuses, `SafeToRetry`, a panic or a service error roll the
//! transaction back and free the key; a commit that fails is answered 503
//! with `Retry-After`, never with the handler's success. What the
//! transaction does not cover: calls outside that database, and statements
//! on other connections (below). `examples/exactly_once.rs` is each of
//! these stores behind a payments route (`STORE=postgres`, `sqlx`,
//! `sqlite`), with `STORE=redis` as the control: run two of it on one
//! database and kill one with SIGKILL mid-handler while clients retry, and
//! on a SQL store no key is charged twice; on Redis some are.
//!
//! The stores implement the middleware's public store contract
//! ([`IdempotencyBackend`](tower_redis_lock::backend::IdempotencyBackend)
//! and [`Backend`](tower_redis_lock::backend::Backend)) and pass its store
//! suite (`tower_redis_lock::backend::Suite`), like a store you would write
//! for your own database.
//!
//! # Graceful shutdown
//!
//! A claim in flight holds a pooled connection and an open transaction until
//! its request is completed or abandoned.
//! [`Backend::drain`](tower_redis_lock::backend::Backend::drain) waits, at
//! most its timeout, until no claim of this process is open (claimed and not
//! yet completed or abandoned), and otherwise answers an error that says how
//! many are left (their transactions roll back when the process ends).
//! Call it once the server stopped taking requests:
//!
//! ```no_run
//! # #[cfg(feature = "sqlx-sqlite")]
//! # async fn demo(store: tower_redis_lock_sql::SqliteBackend) {
//! use std::time::Duration;
//! use tower_redis_lock::backend::Backend;
//!
//! // ... axum::serve(..).with_graceful_shutdown(..).await ...
//! if let Err(e) = store.drain(Duration::from_secs(5)).await {
//!     eprintln!("{e}");
//! }
//! # }
//! ```
//!
//! # The handler's transaction is the application's
//!
//! It is opened with a plain `BEGIN`: the connection's own isolation level
//! (`default_transaction_isolation`), `lock_timeout` and
//! `statement_timeout` hold, unless the store is told otherwise
//! (`isolation`, `immediate`). A PostgreSQL store's `lock_wait` bounds one thing
//! only: a duplicate's wait for the request that holds its key, which runs
//! on its own statement **outside** the handler's transaction. A handler
//! statement that waits on a row lock waits as it would without the layer,
//! bounded by what the application configured.
//!
//! # The protocol
//!
//! - **Claim**: one look outside any transaction: the key's live row
//!   answers at once (a replay, a mismatch, a claim in flight, a key made
//!   final), and the scope's use is counted in the same statement (so the
//!   handler's transaction never reads the scope: no serialization
//!   conflicts between one client's concurrent requests). Then the key's
//!   *hold*, taken without waiting: PostgreSQL a session-level advisory
//!   lock of the claim's connection; SQLite a committed claim row with an
//!   expiry. Then `BEGIN`, and the claim's write in it (PostgreSQL the
//!   claim row, which returns the transaction id; SQLite the claim row's
//!   mark, written when the handler first asks for the connection). A claim
//!   runs to its end on a task of its own: one placed after the layer
//!   stopped waiting for it is undone, never left behind.
//! - **Join**: a duplicate whose hold is refused waits for the holder on
//!   its own statement outside any handler's transaction (PostgreSQL: an
//!   advisory lock wait bounded by `lock_wait`), then looks again and reads
//!   the committed record, whatever the isolation level: never a
//!   serialization failure of a waiting insert. The layer keeps joining
//!   until its `join_timeout`.
//! - **Complete**: the record is written into the claim row in the
//!   handler's transaction only if the transaction is still the one the
//!   claim opened (PostgreSQL: `pg_current_xact_id_if_assigned()` equals
//!   the claim's; SQLite: the connection's commit and rollback hooks saw
//!   nothing end it), then `COMMIT`, then the hold is let go. The `COMMIT`
//!   is bounded by the store's `commit_timeout` (5 s), not by the layer's
//!   deadline; one whose answer is lost (the connection dropped) is asked
//!   about by the transaction's id (`pg_xact_status`) until that bound. A
//!   `COMMIT` refused by the database (a serialization failure, a deadlock,
//!   a deferred constraint) rolls everything back: the layer answers 503
//!   with `Retry-After`, nothing is recorded, the key is free, and the
//!   retry runs on a clean slate. One not confirmed within the bound is
//!   answered 503 `outcome-unknown` ("retry with the same key"): the key
//!   stays claimed until the outcome is known, then the retry replays, or
//!   runs if nothing committed.
//! - **Abandon** (`store_when` refuses the answer, `SafeToRetry`, a service
//!   error, a panic): first the transaction's fate. Still the claim's, or
//!   rolled back with nothing committed: roll back, let go of the hold, the
//!   key is free. Ended by the handler (below): the key is made final.
//! - **Take-over**: an expired row (a record past its retention, a row
//!   hold whose process died) is taken by the next claim; never a claim row
//!   its handler committed.
//! - **Sweep**: expired rows are deleted in batches of 1,000 by the expiry
//!   index, batch after batch while a batch was full (at most a few seconds
//!   per sweep, a sweep at most every few seconds, started by claims).
//!
//! # A handler that ends the transaction itself
//!
//! A handler may `COMMIT` (or `END`, `COMMIT AND CHAIN`, `ROLLBACK`) the
//! request's transaction itself: its statements run as they would without
//! the layer, and another connection sees what it committed at once (some
//! handlers commit a pending row on purpose before they call a provider).
//! The layer never runs that key again, whichever way the request ends:
//!
//! | the request ends by | the answer, and the key |
//! |---|---|
//! | an answer the layer records | 500 problem+json `transaction-ended`, kept as the key's final record: every retry replays it |
//! | an answer it does not record (a 429, `SafeToRetry`), a service error, a panic | the same 500 `transaction-ended`; the key is final (a row in state 2) |
//! | the process dies after the handler's `COMMIT` | PostgreSQL: the next claim finds the committed claim row with its hold free and answers `transaction-ended`; SQLite: the row's mark committed with the handler's work: in flight until its lease ends, then `transaction-ended` |
//! | SQLite rolled the transaction back itself (`RAISE(ROLLBACK)`, `ON CONFLICT ROLLBACK`, a full disk) and nothing committed since | the key is free (503 for a failed record, else the handler's answer), as PostgreSQL frees an aborted transaction |
//!
//! What no store can tell: a handler that rolls the transaction back
//! itself, then commits writes of its own on the same connection, and whose
//! process dies (or whose connection is lost) before the layer makes the
//! key final. The claim went with the rollback: on SQLite the key runs
//! again once the claim row expires; on PostgreSQL the hold goes with the
//! session, and the key runs again at once.
//!
//! What the stores tell apart: SQLite sees every commit and rollback of the
//! claim's connection (its commit and rollback hooks), so a rollback with
//! nothing committed after it frees the key. PostgreSQL knows whether the
//! claim's transaction committed (`pg_xact_status`) but not what a handler
//! wrote after its own `ROLLBACK`, so a handler that ends the transaction
//! either way makes the key final. That holds when the handler then opens a
//! transaction of its own in which a statement fails: PostgreSQL tells such
//! a transaction from the claim's only by a savepoint, so the request's
//! transaction opens with one (`SAVEPOINT tower_redis_lock_claim`, set
//! with the `BEGIN`, no round trip of its own). Its writes then get one
//! subtransaction id besides the transaction's; a handler's own
//! savepoints nest inside it as before. The name is the store's: a handler
//! must neither release it nor roll back to it (the store could then
//! misread how the transaction ended). Inside a subtransaction PostgreSQL
//! refuses `pg_export_snapshot()`.
//!
//! # What each store does not promise
//!
//! - **Calls outside the database** (a payment provider, an email) are not
//!   undone: a crash between such a call and the commit rolls the claim
//!   back and the retry calls again. Send the provider
//!   [`IdempotencyKey::downstream`](tower_redis_lock::idempotency::IdempotencyKey::downstream)
//!   as its own idempotency key.
//! - Writes on **other connections** than the request's transaction.
//! - **PostgreSQL 13 or later** (`pg_current_xact_id`, `pg_xact_status`):
//!   `migrate` refuses an older server.
//! - **PostgreSQL, no transaction-mode pooler**: the hold is a
//!   session-level advisory lock, so the claim's statements must run on one
//!   server session. Connect the pool directly or through a session-mode
//!   pool (pgbouncer `pool_mode=session`); behind `pool_mode=transaction`
//!   a hold could stay on a server session nobody uses, or be taken twice.
//!   A store that lets go of a hold its session did not have says so (an
//!   error naming the pooler) instead of going on.
//! - **PostgreSQL**: a claim in flight holds one pooled connection until
//!   its record commits; a frozen (not dead) instance holds its keys until
//!   its connection is cut (TCP keepalives bound that). The store turns
//!   `idle_in_transaction_session_timeout` off for the request's
//!   transaction (`SET LOCAL`): a handler may wait on a provider longer
//!   than that timeout, and the session's end would take the key's hold
//!   with it while the handler still runs. The hold is an advisory lock on
//!   a 64-bit hash of the key: an application's own advisory lock of the
//!   same number would contend with it. The scope quota counts committed
//!   rows and this process's claims in flight, not other instances'
//!   claims in flight.
//! - **SQLite**: one machine, and its clock (a claim row's lease and a
//!   record's retention are wall-clock milliseconds: a clock set back
//!   lengthens them). The store sets the claim connection's commit and
//!   rollback hooks while the handler runs: an application's own hooks on
//!   the pool's connections would be replaced. A process killed mid-handler leaves its
//!   committed claim row (none of its writes): retries get 409 until the
//!   row's lease (the layer's `ttl`, renewed while the handler runs)
//!   expires, then the next claim takes it over, where PostgreSQL frees the
//!   key at once. A handler that reads before it writes may get
//!   `SQLITE_BUSY_SNAPSHOT` when another write committed in between (a
//!   deferred transaction's rule): answered 503, nothing kept; use
//!   [`immediate`](SqliteBackend::immediate) for such
//!   handlers. A claim, a renewal and a completion each take SQLite's
//!   single write lock briefly; a handler's transaction holds it from its
//!   first `conn()` (which writes the claim's mark, even for a handler that
//!   only reads) to its commit. Meanwhile the claim's renewals cannot write
//!   (they wait `busy_timeout` and fail), and need not: no other claim can
//!   take the row over while the lock is held. `conn()` itself waits up to
//!   `busy_timeout` for the lock, and fails after it. A claim waits for it up
//!   to the pool's `busy_timeout` (sqlx's default 5 s: the layer waits that
//!   long plus half a second for a SQLite claim, whatever its `deadline`):
//!   a second payment during a long handler is answered when its turn
//!   comes, or 503 with nothing left behind. The claim, the join and the take-over are as
//!   strong as on PostgreSQL (a claim row is taken only if free or expired,
//!   in one write; a record is written only by the token that holds the
//!   row, in the handler's transaction); a take-over of a claim whose
//!   process is alive but past its lease is possible, and then only one of
//!   the two transactions can commit a record (the other's completion finds
//!   the row not its own and rolls back). **The limit**: a handler that
//!   holds its transaction, and so the write lock, past the claim's lease
//!   and then ends it itself (`ROLLBACK`, then a charge in autocommit)
//!   leaves a lapsed row that its renewals could not push out: once the
//!   lock is free, a claim of *another process* on the same database file
//!   may take it over and run the handler again. Keep such handlers well
//!   inside the layer's `ttl`, or serve one database file from one process
//!   (one store's claims find each other's keys in flight without asking
//!   the database).
//!
//! # The table
//!
//! Created by each store's `migrate`. PostgreSQL:
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS trl_idempotency (
//!     entry       bytea PRIMARY KEY,     -- prefix:{scope}:digest:idem (digests, no user data)
//!     scope       bytea NOT NULL,        -- prefix:{scope}: what the quota counts per
//!     token       bytea NOT NULL,        -- the claim token of the request that wrote it
//!     fingerprint bytea NOT NULL,        -- the request's fingerprint
//!     state       smallint NOT NULL,     -- 0 claimed, 1 done, 2 ended (final, no record), 3 SQLite's marked claim
//!     record      bytea,                 -- the sealed record (opaque, untrusted when read)
//!     expires_at  timestamptz NOT NULL
//! );
//! CREATE INDEX IF NOT EXISTS trl_idempotency_scope ON trl_idempotency (scope, expires_at);
//! CREATE INDEX IF NOT EXISTS trl_idempotency_expiry ON trl_idempotency (expires_at);
//! ```
//!
//! SQLite: the same columns as `BLOB`/`INTEGER`, `expires_at` in
//! milliseconds since the Unix epoch, and `PRAGMA journal_mode = WAL`.
//!
//! # Features and MSRV
//!
//! - `postgres`: [`PostgresBackend`] and [`PgTransaction`] (tokio-postgres
//!   0.7, deadpool-postgres 0.14).
//! - `sqlx-postgres`: [`SqlxPostgresBackend`] and [`SqlxTransaction`]
//!   (sqlx 0.9).
//! - `sqlx-sqlite`: [`SqliteBackend`] and [`SqlxTransaction`] (sqlx 0.9,
//!   SQLite bundled).
//!
//! Rust 1.94 (sqlx 0.9's). sqlx and tokio-postgres types are in this
//! crate's API: their next major is this crate's, not the middleware's.
//!
//! # Files
//!
//! | path | holds |
//! |---|---|
//! | `protocol.rs` | the protocol, written once over an adapter: claim, join, complete, abandon, take-over, sweep, drain |
//! | `protocol/commit.rs` | the handler's `COMMIT`, bounded, and asked about by the transaction id when its answer is lost |
//! | `protocol/rows.rs` | the rows' states, what a committed row answers a claim, the clock of their expiries |
//! | `protocol/open.rs` | one open claim |
//! | `protocol/sessions.rs` | the check that each pooled connection is one server session (no transaction-mode pooler) |
//! | `protocol/settings.rs` | a store's settings and their defaults |
//! | `adapter.rs` | what one database client gives the protocol (crate-private) |
//! | `open_count.rs` | how many claims are open, and the drain that waits for none |
//! | `isolation.rs` | [`Isolation`] |
//! | `pg_sql.rs` | the PostgreSQL statements, shared by both PostgreSQL adapters |
//! | `tokio_pg.rs`, `tokio_pg/transaction.rs`, `tokio_pg/client.rs` | [`PostgresBackend`], [`PgTransaction`]; statements on a pooled tokio-postgres connection |
//! | `sqlx_conn.rs` | a pooled sqlx connection, [`SqlxTransaction`] |
//! | `sqlx_pg.rs`, `sqlx_pg/sessions.rs` | [`SqlxPostgresBackend`]; the session check on sqlx |
//! | `sqlite.rs` | [`SqliteBackend`] |
//! | `sqlite_sql.rs` | the SQLite statements |
//! | `extract.rs` | the axum extractors of the transactions |

#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    rust_2018_idioms,
    unreachable_pub,
    missing_debug_implementations
)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// A build without every feature lacks some of the stores the docs link
// (`SqliteBackend::immediate` without `sqlx-sqlite`, ...): their names stay,
// unlinked, instead of failing the build. The all-features build (docs.rs,
// CI) checks every link.
#![cfg_attr(
    not(all(
        feature = "postgres",
        feature = "sqlx-postgres",
        feature = "sqlx-sqlite"
    )),
    allow(rustdoc::broken_intra_doc_links)
)]

#[cfg(any(
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-sqlite"
))]
mod adapter;
#[cfg(any(
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-sqlite"
))]
mod extract;
mod isolation;
#[cfg(any(
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-sqlite"
))]
mod open_count;
#[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
mod pg_sql;
#[cfg(any(
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-sqlite"
))]
mod protocol;
#[cfg(feature = "sqlx-sqlite")]
mod sqlite;
#[cfg(feature = "sqlx-sqlite")]
mod sqlite_sql;
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod sqlx_conn;
#[cfg(feature = "sqlx-postgres")]
mod sqlx_pg;
#[cfg(feature = "postgres")]
mod tokio_pg;

pub use isolation::Isolation;
#[cfg(feature = "sqlx-sqlite")]
pub use sqlite::SqliteBackend;
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
pub use sqlx_conn::SqlxTransaction;
#[cfg(feature = "sqlx-postgres")]
pub use sqlx_pg::SqlxPostgresBackend;
#[cfg(feature = "postgres")]
pub use tokio_pg::{PgTransaction, PostgresBackend};

#[cfg(all(test, any(feature = "postgres", feature = "sqlx-postgres")))]
mod drain_checks;
#[cfg(test)]
mod tests;
#[cfg(all(test, any(feature = "postgres", feature = "sqlx-postgres")))]
mod untrusted_rows;
