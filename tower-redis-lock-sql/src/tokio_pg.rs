//! [`PostgresBackend`]: the SQL protocol on PostgreSQL through
//! tokio-postgres (over a deadpool-postgres pool).

use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::Pool;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;
use tower_redis_lock::backend::contract::{BackendFuture, Claim, EntryKey, Token};
use tower_redis_lock::backend::{Backend, BackendError, IdempotencyBackend};
use tower_redis_lock::key::KeySpace;

use crate::adapter::{lock_id, Adapter, Ask, Committed, Found, Hold, Look, Marked, Recorded, Step};
use crate::pg_sql::*;
use crate::protocol::{millis, SqlStore};
use crate::Isolation;

mod transaction;

use transaction::Conn;
pub use transaction::PgTransaction;

/// The tokio-postgres adapter.
#[derive(Clone)]
pub(crate) struct TokioPg {
    pool: Pool,
}

fn pg_error(what: &str, e: tokio_postgres::Error) -> BackendError {
    let message = format!("postgres {what}");
    let error = if e.is_closed() || e.code().is_none() {
        BackendError::unavailable(message)
    } else {
        BackendError::new(message)
    };
    error.with_source(e)
}

fn code(e: &tokio_postgres::Error) -> Option<&str> {
    e.code().map(SqlState::code)
}

/// One parameterized statement, prepared once per connection (deadpool's
/// statement cache).
async fn query(
    conn: &Conn,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, tokio_postgres::Error> {
    let client = conn.client();
    let statement = client.prepare_cached(sql).await?;
    client.query(&statement, params).await
}

async fn execute(
    conn: &Conn,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64, tokio_postgres::Error> {
    let client = conn.client();
    let statement = client.prepare_cached(sql).await?;
    client.execute(&statement, params).await
}

fn look_of(row: &Row) -> Result<Look, tokio_postgres::Error> {
    let state: Option<i16> = row.try_get(1)?;
    let live = match state {
        Some(state) => Some(Found {
            fingerprint: row.try_get(0)?,
            state,
            record: row.try_get(2)?,
            left_ms: row.try_get(3)?,
        }),
        None => None,
    };
    Ok(Look {
        live,
        count: row.try_get(4)?,
        bytes: row.try_get(5)?,
        oldest_ms: row.try_get(6)?,
    })
}

impl Adapter for TokioPg {
    type Conn = Conn;
    const NAME: &'static str = "postgres";
    const HOLD: Hold = Hold::Session;

    fn connect(&self) -> Step<'_, Conn> {
        Box::pin(async move {
            self.pool
                .get()
                .await
                .map(Conn::new)
                .map_err(|e| BackendError::unavailable("postgres pool").with_source(e))
        })
    }

    fn release(conn: Conn) {
        conn.release()
    }

    fn migrate(&self) -> Step<'_, ()> {
        Box::pin(async move {
            let conn = self.connect().await?;
            // Already there: done, without a lock (`CREATE INDEX IF NOT
            // EXISTS` takes a share lock on the table before it finds the
            // index, which would wait for every claim in flight).
            let present: bool = conn
                .client()
                .query_one(PRESENT, &[])
                .await
                .and_then(|row| row.try_get(0))
                .map_err(|e| pg_error("migrate", e))?;
            if !present {
                conn.client()
                    .batch_execute(SCHEMA)
                    .await
                    .map_err(|e| pg_error("migrate (creating trl_idempotency)", e))?;
            }
            conn.release();
            Ok(())
        })
    }

    fn look<'a>(conn: &'a mut Conn, ask: &'a Ask, _now: i64) -> Step<'a, Look> {
        Box::pin(async move {
            let rows = query(conn, LOOK, &[&&ask.key.entry()[..], &&ask.key.scope()[..]])
                .await
                .map_err(|e| pg_error("claim", e))?;
            let row = rows
                .first()
                .ok_or_else(|| BackendError::protocol("postgres claim: no row"))?;
            look_of(row).map_err(|e| pg_error("claim", e))
        })
    }

    fn hold<'a>(conn: &'a mut Conn, ask: &'a Ask, _now: i64) -> Step<'a, bool> {
        Box::pin(async move {
            let rows = query(conn, HOLD, &[&ask.lock_id()])
                .await
                .map_err(|e| pg_error("claim (hold)", e))?;
            Ok(rows
                .first()
                .and_then(|r| r.try_get(0).ok())
                .unwrap_or(false))
        })
    }

    fn wait<'a>(conn: &'a mut Conn, ask: &'a Ask, bound: Duration) -> Step<'a, bool> {
        Box::pin(async move {
            let sql = wait(ask.lock_id(), millis(bound).max(1));
            match conn.client().batch_execute(&sql).await {
                Ok(()) => Ok(true),
                Err(e) if code(&e) == Some(SqlState::LOCK_NOT_AVAILABLE.code()) => Ok(false),
                Err(e) => Err(pg_error("claim (wait)", e)),
            }
        })
    }

    fn unhold<'a>(conn: &'a mut Conn, entry: &'a [u8], _token: &'a Token) -> Step<'a, ()> {
        Box::pin(async move {
            query(conn, UNHOLD, &[&lock_id(entry)])
                .await
                .map(|_| ())
                .map_err(|e| pg_error("unhold", e))
        })
    }

    fn begin<'a>(conn: &'a mut Conn, begin: Option<&'a str>) -> Step<'a, ()> {
        Box::pin(async move {
            conn.client()
                .batch_execute(begin.unwrap_or("BEGIN"))
                .await
                .map_err(|e| pg_error("begin", e))
        })
    }

    fn mark<'a>(conn: &'a mut Conn, ask: &'a Ask, _now: i64) -> Step<'a, Marked> {
        Box::pin(async move {
            let lease = millis(ask.lease);
            for sql in [INSERT, TAKE_OVER] {
                let rows = query(
                    conn,
                    sql,
                    &[
                        &&ask.key.entry()[..],
                        &&ask.key.scope()[..],
                        &&ask.token.as_bytes()[..],
                        &&ask.fp[..],
                        &lease,
                    ],
                )
                .await;
                match rows {
                    Ok(rows) => match rows.first() {
                        Some(row) => {
                            let xid: String = row.try_get(0).map_err(|e| pg_error("claim", e))?;
                            return Ok(Marked::Ours(xid));
                        }
                        None => continue,
                    },
                    Err(e) if code(&e).is_some_and(is_retryable) => return Ok(Marked::Retry),
                    Err(e) => return Err(pg_error("claim", e)),
                }
            }
            Ok(Marked::Taken)
        })
    }

    fn record<'a>(
        conn: &'a mut Conn,
        entry: &'a [u8],
        token: &'a Token,
        record: &'a [u8],
        expires: (i64, i64),
        marker: &'a str,
    ) -> Step<'a, Recorded> {
        Box::pin(async move {
            let done = execute(
                conn,
                RECORD,
                &[&entry, &&token.as_bytes()[..], &record, &expires.1, &marker],
            )
            .await;
            match done {
                Ok(1) => Ok(Recorded::Written),
                Ok(_) => Ok(Recorded::Ended),
                Err(e)
                    if code(&e).is_some_and(|c| is_retryable(c) || c == IN_FAILED_TRANSACTION) =>
                {
                    Ok(Recorded::Failed)
                }
                Err(e) => Err(pg_error("complete", e)),
            }
        })
    }

    fn commit(conn: &mut Conn) -> Step<'_, Committed> {
        Box::pin(async move {
            match conn.client().batch_execute("COMMIT").await {
                Ok(()) => Ok(Committed::Yes),
                // The database rolled it back: no transaction is left open.
                Err(e) if code(&e).is_some_and(is_retryable) => Ok(Committed::Refused),
                Err(e) => Err(pg_error("commit", e)),
            }
        })
    }

    fn rollback(conn: &mut Conn) -> Step<'_, ()> {
        Box::pin(async move {
            conn.client()
                .batch_execute("ROLLBACK")
                .await
                .map_err(|e| pg_error("rollback", e))
        })
    }

    fn finalize<'a>(
        conn: &'a mut Conn,
        ask: &'a Ask,
        record: &'a [u8],
        expires: (i64, i64),
    ) -> Step<'a, ()> {
        Box::pin(async move {
            // Whatever the handler left open goes (a warning if nothing).
            conn.client()
                .batch_execute("ROLLBACK")
                .await
                .map_err(|e| pg_error("rollback", e))?;
            execute(
                conn,
                FINALIZE,
                &[
                    &&ask.key.entry()[..],
                    &&ask.key.scope()[..],
                    &&ask.token.as_bytes()[..],
                    &&ask.fp[..],
                    &record,
                    &expires.1,
                ],
            )
            .await
            .map(|_| ())
            .map_err(|e| pg_error("complete (final record)", e))
        })
    }

    fn recorded<'a>(
        conn: &'a mut Conn,
        entry: &'a [u8],
        token: &'a Token,
        _now: i64,
    ) -> Step<'a, bool> {
        Box::pin(async move {
            query(conn, RECORDED, &[&entry, &&token.as_bytes()[..]])
                .await
                .map(|rows| !rows.is_empty())
                .map_err(|e| pg_error("complete", e))
        })
    }

    fn extend<'a>(
        _conn: &'a mut Conn,
        _entry: &'a [u8],
        _token: &'a Token,
        _expires: (i64, i64),
    ) -> Step<'a, bool> {
        // A session hold lasts as long as its connection.
        Box::pin(std::future::ready(Ok(true)))
    }

    fn sweep(conn: &mut Conn, batch: i64, _now: i64) -> Step<'_, u64> {
        Box::pin(async move {
            execute(conn, SWEEP, &[&batch])
                .await
                .map_err(|e| pg_error("sweep", e))
        })
    }
}

/// An idempotency store in PostgreSQL, over the application's own
/// [`deadpool_postgres::Pool`] (tokio-postgres), whose record commits in the
/// handler's own transaction: **exactly once for database side effects**
/// (feature `postgres`).
///
/// The handler takes the request's transaction as a [`PgTransaction`] and
/// runs its own statements in it:
///
/// ```no_run
/// use axum::{routing::post, Router};
/// use tower_redis_lock_sql::{PgTransaction, PostgresBackend};
/// use tower_redis_lock::key::{RequestMethod, Route, Header};
/// use tower_redis_lock::idempotency::IdempotencyKey;
/// use tower_redis_lock::IdempotencyLayer;
///
/// async fn pay(tx: PgTransaction, key: IdempotencyKey) -> Result<&'static str, String> {
///     let db = tx.client().await.map_err(|e| e.to_string())?;
///     // In the same transaction as the idempotency record: both commit, or neither.
///     db.execute("INSERT INTO charges (idempotency_key) VALUES ($1)", &[&key.as_str()])
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok("charged")
/// }
///
/// # async fn demo(pool: deadpool_postgres::Pool) -> Result<(), tower_redis_lock::backend::BackendError> {
/// let store = PostgresBackend::new(pool);
/// store.migrate().await?;
/// let idem = IdempotencyLayer::new(store, (RequestMethod, Route, Header::trusted_identity("x-user-id")))
///     .join_timeout(std::time::Duration::from_secs(5));
/// let app: Router = Router::new().route("/payments", post(pay).layer(idem));
/// # let _ = app; Ok(()) }
/// ```
///
/// The protocol, the table and what the store does and does not promise are
/// in the [crate docs](crate); this store and the sqlx PostgreSQL
/// store (feature `sqlx-postgres`) run the same protocol on the same table.
/// Clones share the store.
#[derive(Clone, Debug)]
pub struct PostgresBackend {
    store: SqlStore<TokioPg>,
}

impl PostgresBackend {
    /// A store on `pool`'s connections, in the table `trl_idempotency`
    /// (create it with [`migrate`](Self::migrate)).
    ///
    /// ```no_run
    /// # fn demo(pool: deadpool_postgres::Pool) {
    /// let store = tower_redis_lock_sql::PostgresBackend::new(pool);
    /// # let _ = store; }
    /// ```
    pub fn new(pool: Pool) -> Self {
        Self {
            store: SqlStore::new(TokioPg { pool }),
        }
    }

    /// How long a duplicate's claim waits, outside any transaction, for the
    /// request that holds its key (default 100 ms); then
    /// [`Claim::InFlight`](tower_redis_lock::backend::contract::Claim::InFlight), and a joining duplicate claims again until the
    /// layer's [`join_timeout`](tower_redis_lock::IdempotencyLayer::join_timeout). It
    /// bounds this wait only: never a statement of the handler. Keep it
    /// below the layer's [`deadline`](tower_redis_lock::IdempotencyLayer::deadline).
    ///
    /// ```no_run
    /// # fn demo(pool: deadpool_postgres::Pool) {
    /// let store = tower_redis_lock_sql::PostgresBackend::new(pool)
    ///     .lock_wait(std::time::Duration::from_millis(50));
    /// # let _ = store; }
    /// ```
    pub fn lock_wait(self, wait: Duration) -> Self {
        Self {
            store: self.store.lock_wait(wait),
        }
    }

    /// Open the handler's transaction at `level` instead of the
    /// connection's default (`default_transaction_isolation`).
    ///
    /// ```no_run
    /// # fn demo(pool: deadpool_postgres::Pool) {
    /// use tower_redis_lock_sql::Isolation;
    /// let store = tower_redis_lock_sql::PostgresBackend::new(pool)
    ///     .isolation(Isolation::Serializable);
    /// # let _ = store; }
    /// ```
    pub fn isolation(self, level: Isolation) -> Self {
        Self {
            store: self.store.begin_with(level.begin()),
        }
    }

    /// Stub for the tests: how long the store waits for a `COMMIT` to be
    /// confirmed. Does nothing yet (to be replaced by the real setter).
    ///
    /// ```no_run
    /// # fn demo(pool: deadpool_postgres::Pool) {
    /// let store = tower_redis_lock_sql::PostgresBackend::new(pool)
    ///     .commit_timeout(std::time::Duration::from_secs(5));
    /// # let _ = store; }
    /// ```
    pub fn commit_timeout(self, _timeout: Duration) -> Self {
        self
    }

    /// Create the table and its indexes if they are missing (the SQL is in
    /// the [crate docs](crate)); safe to run from several
    /// instances at once, and beside claims in flight.
    ///
    /// ```no_run
    /// # async fn demo(store: tower_redis_lock_sql::PostgresBackend) -> Result<(), tower_redis_lock::backend::BackendError> {
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self) -> Result<(), BackendError> {
        self.store.migrate().await
    }

    /// Delete every expired row now (batch after batch while they come back
    /// full, within a few seconds); how many. Claims run this on their own,
    /// at most every few seconds.
    ///
    /// ```no_run
    /// # async fn demo(store: tower_redis_lock_sql::PostgresBackend) -> Result<(), tower_redis_lock::backend::BackendError> {
    /// let deleted = store.sweep().await?;
    /// # let _ = deleted; Ok(()) }
    /// ```
    pub async fn sweep(&self) -> Result<u64, BackendError> {
        self.store.sweep().await
    }
}

impl Backend for PostgresBackend {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    /// Waits for this process's open claims (see the [crate docs](crate)).
    fn drain(&self, timeout: Duration) -> BackendFuture<()> {
        self.store.drain(timeout)
    }
}

impl IdempotencyBackend for PostgresBackend {
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
        max_entries: u64,
        max_bytes: u64,
    ) -> BackendFuture<Claim> {
        self.store
            .claim(key, token, fingerprint, lease, max_entries, max_bytes)
    }

    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        self.store.complete(key, token, record, retention)
    }

    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        self.store.extend(key, token, lease)
    }

    fn abandon(&self, key: &EntryKey, token: &Token, _lease: Duration) -> BackendFuture<bool> {
        self.store.abandon(key, token)
    }

    /// Nothing to hold: [`drain`](Backend::drain) waits for the open
    /// claims themselves.
    fn hold(&self) -> Option<Box<dyn Send>> {
        None
    }

    /// No feed: a joining duplicate waits on its own statement.
    fn feed(
        &self,
        _key_space: &KeySpace,
    ) -> Option<BackendFuture<tokio::sync::mpsc::Receiver<(Bytes, Bytes)>>> {
        None
    }

    /// Puts the claim's open transaction into the request's extensions, as
    /// a [`PgTransaction`].
    fn claimed(&self, key: &EntryKey, token: &Token, extensions: &mut http::Extensions) {
        if let Some(conn) = self.store.claim_conn(key, token) {
            extensions.insert(PgTransaction { conn });
        }
    }

    fn is_transactional(&self) -> bool {
        true
    }

    fn claim_timeout(&self, deadline: std::time::Duration) -> std::time::Duration {
        deadline
    }
}

#[cfg(test)]
mod tests;
