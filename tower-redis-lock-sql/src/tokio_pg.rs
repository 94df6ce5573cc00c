//! [`PostgresBackend`]: the SQL protocol on PostgreSQL through
//! tokio-postgres (over a deadpool-postgres pool).

use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::Pool;
use tokio_postgres::error::SqlState;
use tower_redis_lock::backend::contract::{BackendFuture, Claim, EntryKey, Token};
use tower_redis_lock::backend::{Backend, BackendError, ClaimTerms, IdempotencyBackend};
use tower_redis_lock::key::KeySpace;

use crate::adapter::{lock_id, Adapter, Ask, Committed, Fate, Hold, Look, Marked, Recorded, Step};
use crate::pg_sql::*;
use crate::protocol::{millis, SqlStore};
use crate::Isolation;

mod client;
mod transaction;

use client::{code, execute, look_of, pg_error, query};

use transaction::Conn;
pub use transaction::PgTransaction;

/// The tokio-postgres adapter.
#[derive(Clone)]
pub(crate) struct TokioPg {
    pool: Pool,
}

/// Whether the transaction open now, which a statement failed in, is the
/// one the claim opened ([`CLAIM_SAVEPOINT`]); rolled back either way.
async fn failed_is_ours(conn: &mut Conn) -> Result<bool, BackendError> {
    let ours = match conn.client().batch_execute(BACK_TO_CLAIM).await {
        Ok(()) => true,
        Err(e) if not_the_claims(code(&e)) => false,
        Err(e) => return Err(pg_error("rollback (to the claim)", e)),
    };
    conn.client()
        .batch_execute("ROLLBACK")
        .await
        .map_err(|e| pg_error("rollback", e))?;
    Ok(ours)
}

impl Adapter for TokioPg {
    type Conn = Conn;
    type Marker = String;
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

    fn one_session_each(&self) -> Step<'_, bool> {
        Box::pin(async move {
            let b = self.connect().await?;
            let Ok(Ok(a)) = tokio::time::timeout(SECOND_CONNECTION, self.connect()).await else {
                b.release();
                return Ok(true);
            };
            let mut two = client::Two(a, b);
            let fine = sessions_apart(&mut two).await?;
            let client::Two(a, b) = two;
            a.release();
            b.release();
            Ok(fine)
        })
    }

    fn migrate(&self) -> Step<'_, ()> {
        Box::pin(async move {
            let conn = self.connect().await?;
            let version: i32 = conn
                .client()
                .query_one(SERVER_VERSION, &[])
                .await
                .and_then(|row| row.try_get(0))
                .map_err(|e| pg_error("migrate", e))?;
            if let Some(e) = too_old(version) {
                return Err(e);
            }
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
            let rows = query(conn, UNHOLD, &[&lock_id(entry)])
                .await
                .map_err(|e| pg_error("unhold", e))?;
            match rows.first().and_then(|r| r.try_get::<_, bool>(0).ok()) {
                Some(false) => Err(not_held(Self::NAME)),
                _ => Ok(()),
            }
        })
    }

    fn begin<'a>(conn: &'a mut Conn, begin: Option<&'a str>) -> Step<'a, ()> {
        Box::pin(async move {
            conn.client()
                .batch_execute(&begin_statement(begin))
                .await
                .map_err(|e| pg_error("begin", e))
        })
    }

    fn mark<'a>(conn: &'a mut Conn, ask: &'a Ask, _now: i64) -> Step<'a, Marked<String>> {
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
        marker: &'a String,
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
                    Ok(match failed_is_ours(conn).await? {
                        true => Recorded::Failed,
                        false => Recorded::Ended,
                    })
                }
                Err(e) => Err(pg_error("complete", e)),
            }
        })
    }

    fn is_transient(e: &BackendError) -> bool {
        std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<tokio_postgres::Error>())
            .and_then(|e| e.code())
            .is_some_and(|c| crate::pg_sql::is_transient(c.code()))
    }

    fn commit(conn: &mut Conn) -> Step<'_, Committed> {
        Box::pin(async move {
            match conn.client().batch_execute("COMMIT").await {
                Ok(()) => Ok(Committed::Yes),
                // The database answered with an error: it rolled the
                // transaction back (a serialization failure, a deferred
                // constraint); nothing is left open.
                Err(e) if e.code().is_some() => Ok(Committed::Refused),
                // No answer (the connection lost): asked by the id.
                Err(e) => Err(pg_error("commit", e)),
            }
        })
    }

    fn fate<'a>(conn: &'a mut Conn, marker: &'a String) -> Step<'a, Fate> {
        Box::pin(async move {
            match query(conn, FATE, &[marker]).await {
                Ok(rows) => {
                    let ours: bool = rows
                        .first()
                        .and_then(|r| r.try_get(0).ok())
                        .unwrap_or(false);
                    if !ours {
                        // Whatever the handler left open goes (a warning if
                        // nothing).
                        conn.client()
                            .batch_execute("ROLLBACK")
                            .await
                            .map_err(|e| pg_error("rollback", e))?;
                    }
                    Ok(fate_of(ours))
                }
                // The transaction open now failed (a statement failed in
                // it): the claim's, with nothing of it committed, or one
                // the handler opened after ending the claim's.
                Err(e) if code(&e) == Some(IN_FAILED_TRANSACTION) => {
                    Ok(match failed_is_ours(conn).await? {
                        true => Fate::RolledBack,
                        false => Fate::Ended,
                    })
                }
                Err(e) => Err(pg_error("abandon", e)),
            }
        })
    }

    fn end<'a>(conn: &'a mut Conn, ask: &'a Ask, _now: i64) -> Step<'a, ()> {
        Box::pin(async move {
            execute(
                conn,
                END,
                &[
                    &&ask.key.entry()[..],
                    &&ask.key.scope()[..],
                    &&ask.token.as_bytes()[..],
                    &&ask.fp[..],
                    &millis(ask.retention),
                ],
            )
            .await
            .map_err(|e| pg_error("making the key final", e))
            .and_then(|n| match n {
                1 => Ok(()),
                _ => Err(crate::adapter::not_made_final(Self::NAME)),
            })
        })
    }

    fn outcome<'a>(&'a self, marker: &'a String) -> Step<'a, Option<bool>> {
        Box::pin(async move {
            let conn = self.connect().await?;
            let rows = query(&conn, STATUS, &[marker])
                .await
                .map_err(|e| pg_error("commit (status)", e))?;
            let status: Option<String> = rows.first().and_then(|r| r.try_get(0).ok());
            conn.release();
            Ok(outcome_of(status.as_deref()))
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
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use tower_redis_lock::idempotency::{IdempotencyKey, SafeToRetry};
/// use tower_redis_lock::IdempotencyLayer;
///
/// async fn pay(tx: PgTransaction, key: IdempotencyKey) -> Result<&'static str, Response> {
///     let db = tx.client().await.map_err(db_error)?;
///     // In the same transaction as the idempotency record: both commit, or neither.
///     db.execute("INSERT INTO charges (idempotency_key) VALUES ($1)", &[&key.as_str()])
///         .await
///         .map_err(db_error)?;
///     Ok("charged")
/// }
///
/// /// Nothing was charged: 503, and the key stays free for the retry
/// /// (`SafeToRetry`). An `Err(String)` would be answered 200, and recorded.
/// fn db_error(e: impl std::fmt::Display) -> Response {
///     (StatusCode::SERVICE_UNAVAILABLE, SafeToRetry, e.to_string()).into_response()
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
            store: self.store.settings(|s| s.lock_wait = wait),
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
            store: self.store.settings(|s| s.begin = Some(level.begin())),
        }
    }

    /// How long the handler's `COMMIT` may take (default 5 s): the layer's
    /// deadline does not cut it (a commit may wait on synchronous
    /// replication or deferred triggers), this does. A `COMMIT` whose
    /// answer is lost (the connection dropped) is asked about by the
    /// transaction's id until the same bound. Past it, the request is
    /// answered 503 `outcome-unknown` ("retry with the same key"): the key
    /// stays claimed until the outcome is known, then a retry replays the
    /// record, or runs on a clean slate if nothing committed.
    ///
    /// ```no_run
    /// # fn demo(store: tower_redis_lock_sql::PostgresBackend) {
    /// let store = store.commit_timeout(std::time::Duration::from_secs(10));
    /// # let _ = store; }
    /// ```
    pub fn commit_timeout(self, timeout: Duration) -> Self {
        Self {
            store: self.store.settings(|s| s.commit_timeout = timeout),
        }
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
        terms: &ClaimTerms,
    ) -> BackendFuture<Claim> {
        self.store.claim(key, token, fingerprint, terms)
    }

    /// The claim is held by its open transaction (it never lapses while
    /// the handler runs): `fingerprint` is not needed.
    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        _fingerprint: &[u8],
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
            extensions.insert(PgTransaction {
                conn,
                holder: Default::default(),
            });
        }
    }

    fn is_transactional(&self) -> bool {
        true
    }

    /// Answers within the layer's deadline.
    fn claim_timeout(&self, deadline: Duration) -> Duration {
        deadline
    }
}

#[cfg(test)]
mod tests;
