//! The SQL stores: **exactly once for database side effects**. The claim,
//! the handler's own writes and the idempotency record commit in one
//! database transaction, the application's own.
//!
//! - [`PostgresBackend`] (feature
//!   `postgres`): PostgreSQL over the application's tokio-postgres
//!   (deadpool-postgres) pool; the handler takes a
//!   [`PgTransaction`].
//! - [`SqlxPostgresBackend`] (feature
//!   `sqlx-postgres`): PostgreSQL over the application's `sqlx::PgPool`.
//! - [`SqliteBackend`] (feature
//!   `sqlx-sqlite`): SQLite over the application's `sqlx::SqlitePool`, the
//!   durable store for one machine.
//!
//! The handler takes the request's transaction (a [`SqlxTransaction`]
//! with the sqlx stores, a `PgTransaction` with `PostgresBackend`) and runs
//! its own queries in it. The three stores run one protocol, written once over a
//! small adapter per client (crate-private).
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
//!   answers at once (a replay, a mismatch, a claim in flight), and the
//!   scope's use is counted in the same statement (so the handler's
//!   transaction never reads the scope: no serialization conflicts between
//!   one client's concurrent requests). Then the key's *hold*, taken
//!   without waiting: PostgreSQL a session-level advisory lock of the
//!   claim's connection; SQLite a committed claim row with an expiry. Then
//!   `BEGIN`, and the claim's write in it (PostgreSQL the claim row, which
//!   returns the transaction id; SQLite a marker row in a temporary table).
//! - **Join**: a duplicate whose hold is refused waits for the holder on
//!   its own statement outside any handler's transaction (PostgreSQL: an
//!   advisory lock wait bounded by `lock_wait`), then looks again and reads
//!   the committed record, whatever the isolation level: never a
//!   serialization failure of a waiting insert. The layer keeps joining
//!   until its `join_timeout`.
//! - **Complete**: the record is written into the claim row in the
//!   handler's transaction only if the transaction is still the one the
//!   claim opened (PostgreSQL: `pg_current_xact_id_if_assigned()` equals
//!   the claim's; SQLite: the marker row is there), then `COMMIT`, then the
//!   hold is let go. A serialization failure (40001) or deadlock at
//!   `COMMIT` rolls everything back: the layer answers 503 with
//!   `Retry-After`, nothing is recorded, the key is free, and the retry
//!   runs on a clean slate.
//! - **A handler that ends the transaction itself** (`COMMIT` or
//!   `ROLLBACK` on it) is caught at completion: the store keeps the hold,
//!   the layer answers 500 problem+json (`transaction-ended`) and the store
//!   writes that answer as the key's final record, outside any transaction.
//!   Every retry replays it: the key never runs twice.
//! - **Abandon** (the outcome is not kept): roll back, let go of the hold.
//! - **Take-over**: an expired row (a record past its retention, a row
//!   hold whose process died) is taken by the next claim.
//! - **Sweep**: expired rows are deleted in batches of 1,000 by the expiry
//!   index, batch after batch while a batch was full (at most a few seconds
//!   per sweep, a sweep at most every few seconds, started by claims).
//!
//! # What each store does not promise
//!
//! - **Calls outside the database** (a payment provider, an email) are not
//!   undone: a crash between such a call and the commit rolls the claim
//!   back and the retry calls again. Send the provider
//!   [`IdempotencyKey::downstream`](crate::idempotency::IdempotencyKey::downstream)
//!   as its own idempotency key.
//! - Writes on **other connections** than the request's transaction.
//! - **PostgreSQL**: a claim in flight holds one pooled connection until
//!   its record commits; a frozen (not dead) instance holds its keys until
//!   its connection is cut (bound it with
//!   `idle_in_transaction_session_timeout` or TCP keepalives). The hold is
//!   an advisory lock on a 64-bit hash of the key: an application's own
//!   advisory lock of the same number would contend with it. The scope
//!   quota counts committed rows and this process's claims in flight, not
//!   other instances' claims in flight.
//! - **SQLite**: one machine. A process killed mid-handler leaves its
//!   committed claim row (none of its writes): retries get 409 until the
//!   row's lease (the layer's `ttl`, renewed while the handler runs)
//!   expires, then the next claim takes it over, where PostgreSQL frees the
//!   key at once. A handler that reads before it writes may get
//!   `SQLITE_BUSY_SNAPSHOT` when another write committed in between (a
//!   deferred transaction's rule): answered 503, nothing kept; use
//!   [`immediate`](crate::backend::SqliteBackend::immediate) for such
//!   handlers. A claim, a renewal and a completion each take SQLite's
//!   single write lock briefly (and wait for it up to the pool's
//!   `busy_timeout`); a handler's transaction holds it from its first
//!   write to its commit. The claim, the join and the take-over are as
//!   strong as on PostgreSQL (a claim row is taken only if free or expired,
//!   in one write; a record is written only by the token that holds the
//!   row, in the handler's transaction); a take-over of a claim whose
//!   process is alive but past its lease is possible, and then only one of
//!   the two transactions can commit a record (the other's completion finds
//!   the row not its own and rolls back).
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
//!     state       smallint NOT NULL,     -- 0 claimed, 1 done
//!     record      bytea,                 -- the sealed record (opaque, untrusted when read)
//!     expires_at  timestamptz NOT NULL
//! );
//! CREATE INDEX IF NOT EXISTS trl_idempotency_scope ON trl_idempotency (scope, expires_at);
//! CREATE INDEX IF NOT EXISTS trl_idempotency_expiry ON trl_idempotency (expires_at);
//! ```
//!
//! SQLite: the same columns as `BLOB`/`INTEGER`, `expires_at` in
//! milliseconds since the Unix epoch, and `PRAGMA journal_mode = WAL`.

/// The `IdempotencyBackend` impl of a SQL store whose `store` field is the
/// protocol (`protocol::SqlStore`): every step is the protocol's, and
/// `claimed` puts `$handle` (made from the claim's shared connection
/// `$conn`) into the request's extensions. Written once for the three
/// adapters.
macro_rules! replay_backend_over_protocol {
    ($store:ty, $name:literal, |$conn:ident| $handle:expr) => {
        impl $crate::backend::IdempotencyBackend for $store {
            fn claim(
                &self,
                key: &$crate::backend::EntryKey,
                token: &$crate::backend::Token,
                fingerprint: &[u8],
                lease: std::time::Duration,
                max_entries: u64,
                max_bytes: u64,
            ) -> $crate::backend::BackendFuture<$crate::backend::Claim> {
                self.store.claim(super::adapter::Ask {
                    key: key.clone(),
                    token: *token,
                    fp: bytes::Bytes::copy_from_slice(fingerprint),
                    lease,
                    max_entries,
                    max_bytes,
                })
            }

            fn complete(
                &self,
                key: &$crate::backend::EntryKey,
                token: &$crate::backend::Token,
                record: &bytes::Bytes,
                retention: std::time::Duration,
            ) -> $crate::backend::BackendFuture<bool> {
                self.store.complete(key, token, record, retention)
            }

            fn extend(
                &self,
                key: &$crate::backend::EntryKey,
                token: &$crate::backend::Token,
                lease: std::time::Duration,
            ) -> $crate::backend::BackendFuture<bool> {
                self.store.extend(key, token, lease)
            }

            fn abandon(
                &self,
                key: &$crate::backend::EntryKey,
                token: &$crate::backend::Token,
                _lease: std::time::Duration,
            ) -> $crate::backend::BackendFuture<bool> {
                self.store.abandon(key, token)
            }

            fn claimed(
                &self,
                key: &$crate::backend::EntryKey,
                token: &$crate::backend::Token,
                extensions: &mut http::Extensions,
            ) {
                if let Some($conn) = self.store.claim_conn(key, token) {
                    extensions.insert($handle);
                }
            }

            fn is_transactional(&self) -> bool {
                true
            }

            fn hold(&self) -> Option<Box<dyn Send>> {
                None
            }

            fn feed(
                &self,
                _key_space: &$crate::key::KeySpace,
            ) -> Option<
                $crate::backend::BackendFuture<
                    tokio::sync::mpsc::Receiver<(bytes::Bytes, bytes::Bytes)>,
                >,
            > {
                None
            }
        }

        impl $crate::backend::Backend for $store {
            fn name(&self) -> &'static str {
                $name
            }

            fn is_in_process(&self) -> bool {
                false
            }

            fn drain(&self, _timeout: std::time::Duration) -> $crate::backend::BackendFuture<()> {
                $crate::backend::BackendFuture::ready(Ok(()))
            }
        }
    };
}

pub(crate) mod adapter;
pub(crate) mod protocol;

#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod sqlx_conn;

#[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
pub(crate) mod pg_sql;

#[cfg(feature = "postgres")]
mod tokio_pg;

#[cfg(feature = "sqlx-postgres")]
mod sqlx_pg;

#[cfg(feature = "sqlx-sqlite")]
mod sqlite;

pub use protocol::Isolation;
#[cfg(feature = "sqlx-sqlite")]
pub use sqlite::SqliteBackend;
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
pub use sqlx_conn::SqlxTransaction;
#[cfg(feature = "sqlx-postgres")]
pub use sqlx_pg::SqlxPostgresBackend;
#[cfg(feature = "postgres")]
pub use tokio_pg::{PgTransaction, PostgresBackend};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod untrusted_rows;
