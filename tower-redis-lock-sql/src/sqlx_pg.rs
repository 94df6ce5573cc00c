//! [`SqlxPostgresBackend`]: the SQL protocol on PostgreSQL through sqlx.

use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::{PgPool, PgRow};
use sqlx::{AssertSqlSafe, Postgres, Row, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;
use tower_redis_lock::backend::contract::{BackendFuture, Claim, EntryKey, Token};
use tower_redis_lock::backend::{Backend, BackendError, ClaimTerms, IdempotencyBackend};
use tower_redis_lock::key::KeySpace;

use crate::adapter::{Adapter, Ask, Committed, Fate, Found, Hold, Look, Marked, Recorded, Step};
use crate::pg_sql::*;
use crate::protocol::{millis, SqlStore};
use crate::sqlx_conn::{code, sqlx_error, SqlxConn, SqlxTransaction};
use crate::Isolation;

type Conn = SqlxConn<Postgres>;
type Tm = <Postgres as sqlx::Database>::TransactionManager;

mod sessions;

use sessions::Two;

/// The sqlx PostgreSQL adapter.
#[derive(Clone)]
pub(crate) struct SqlxPg {
    pool: PgPool,
}

fn found(row: &PgRow) -> Result<Look, sqlx::Error> {
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

/// Whether the transaction open now, which a statement failed in, is the
/// one the claim opened ([`CLAIM_SAVEPOINT`]); rolled back either way (and
/// sqlx's count with it).
async fn failed_is_ours(conn: &mut Conn) -> Result<bool, BackendError> {
    let ours = match sqlx::raw_sql(BACK_TO_CLAIM).execute(conn.get()).await {
        Ok(_) => true,
        Err(e) if not_the_claims(code(&e).as_deref()) => false,
        Err(e) => return Err(sqlx_error("rollback (to the claim)", e)),
    };
    Tm::rollback(conn.get())
        .await
        .map_err(|e| sqlx_error("rollback", e))?;
    Ok(ours)
}

impl Adapter for SqlxPg {
    type Conn = Conn;
    type Marker = String;
    const NAME: &'static str = "sqlx-postgres";
    const HOLD: Hold = Hold::Session;

    fn connect(&self) -> Step<'_, Conn> {
        Box::pin(async move {
            self.pool
                .acquire()
                .await
                .map(SqlxConn::new)
                .map_err(|e| sqlx_error("postgres pool", e))
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
            let mut two = Two(a, b);
            let fine = sessions_apart(&mut two).await?;
            let Two(a, b) = two;
            a.release();
            b.release();
            Ok(fine)
        })
    }

    fn migrate(&self) -> Step<'_, ()> {
        Box::pin(async move {
            let mut conn = self.connect().await?;
            let version: i32 = sqlx::query_scalar(SERVER_VERSION)
                .fetch_one(conn.get())
                .await
                .map_err(|e| sqlx_error("migrate", e))?;
            if let Some(e) = too_old(version) {
                return Err(e);
            }
            let present: bool = sqlx::query_scalar(PRESENT)
                .fetch_one(conn.get())
                .await
                .map_err(|e| sqlx_error("migrate", e))?;
            if !present {
                sqlx::raw_sql(SCHEMA)
                    .execute(conn.get())
                    .await
                    .map_err(|e| sqlx_error("migrate (creating trl_idempotency)", e))?;
            }
            conn.release();
            Ok(())
        })
    }

    fn look<'a>(conn: &'a mut Conn, ask: &'a Ask, _now: i64) -> Step<'a, Look> {
        Box::pin(async move {
            let row = sqlx::query(LOOK)
                .bind(&ask.key.entry()[..])
                .bind(&ask.key.scope()[..])
                .fetch_one(conn.get())
                .await
                .and_then(|row| found(&row));
            row.map_err(|e| sqlx_error("claim", e))
        })
    }

    fn hold<'a>(conn: &'a mut Conn, ask: &'a Ask, _now: i64) -> Step<'a, bool> {
        Box::pin(async move {
            sqlx::query_scalar(HOLD)
                .bind(ask.lock_id())
                .fetch_one(conn.get())
                .await
                .map_err(|e| sqlx_error("claim (hold)", e))
        })
    }

    fn wait<'a>(conn: &'a mut Conn, ask: &'a Ask, bound: Duration) -> Step<'a, bool> {
        Box::pin(async move {
            let sql = wait(ask.lock_id(), millis(bound).max(1));
            match sqlx::raw_sql(AssertSqlSafe(sql)).execute(conn.get()).await {
                Ok(_) => Ok(true),
                Err(e) if code(&e).as_deref() == Some("55P03") => Ok(false),
                Err(e) => Err(sqlx_error("claim (wait)", e)),
            }
        })
    }

    fn unhold<'a>(conn: &'a mut Conn, entry: &'a [u8], _token: &'a Token) -> Step<'a, ()> {
        Box::pin(async move {
            let held: bool = sqlx::query_scalar(UNHOLD)
                .bind(crate::adapter::lock_id(entry))
                .fetch_one(conn.get())
                .await
                .map_err(|e| sqlx_error("unhold", e))?;
            match held {
                true => Ok(()),
                false => Err(not_held(Self::NAME)),
            }
        })
    }

    fn begin<'a>(conn: &'a mut Conn, begin: Option<&'a str>) -> Step<'a, ()> {
        Box::pin(async move {
            let statement = AssertSqlSafe(begin_statement(begin)).into_sql_str();
            Tm::begin(conn.get(), Some(statement))
                .await
                .map_err(|e| sqlx_error("begin", e))
        })
    }

    fn mark<'a>(conn: &'a mut Conn, ask: &'a Ask, _now: i64) -> Step<'a, Marked<String>> {
        Box::pin(async move {
            for sql in [INSERT, TAKE_OVER] {
                let row: Result<Option<String>, _> = sqlx::query_scalar(sql)
                    .bind(&ask.key.entry()[..])
                    .bind(&ask.key.scope()[..])
                    .bind(&ask.token.as_bytes()[..])
                    .bind(&ask.fp[..])
                    .bind(millis(ask.lease))
                    .fetch_optional(conn.get())
                    .await;
                match row {
                    Ok(Some(xid)) => return Ok(Marked::Ours(xid)),
                    Ok(None) => continue,
                    Err(e) if code(&e).as_deref().is_some_and(is_retryable) => {
                        return Ok(Marked::Retry)
                    }
                    Err(e) => return Err(sqlx_error("claim", e)),
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
            let done = sqlx::query(RECORD)
                .bind(entry)
                .bind(&token.as_bytes()[..])
                .bind(record)
                .bind(expires.1)
                .bind(marker)
                .execute(conn.get())
                .await;
            match done {
                Ok(r) if r.rows_affected() == 1 => Ok(Recorded::Written),
                Ok(_) => Ok(Recorded::Ended),
                Err(e)
                    if code(&e)
                        .as_deref()
                        .is_some_and(|c| is_retryable(c) || c == IN_FAILED_TRANSACTION) =>
                {
                    Ok(match failed_is_ours(conn).await? {
                        true => Recorded::Failed,
                        false => Recorded::Ended,
                    })
                }
                Err(e) => Err(sqlx_error("complete", e)),
            }
        })
    }

    fn is_transient(e: &BackendError) -> bool {
        std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<sqlx::Error>())
            .and_then(crate::sqlx_conn::code)
            .is_some_and(|c| crate::pg_sql::is_transient(&c))
    }

    fn commit(conn: &mut Conn) -> Step<'_, Committed> {
        Box::pin(async move {
            match Tm::commit(conn.get()).await {
                Ok(()) => Ok(Committed::Yes),
                // The database answered with an error: it rolled the
                // transaction back (a serialization failure, a deferred
                // constraint); make sqlx's count agree.
                Err(e) if code(&e).is_some() => {
                    let _ = Tm::rollback(conn.get()).await;
                    Ok(Committed::Refused)
                }
                // No answer (the connection lost): asked by the id.
                Err(e) => Err(sqlx_error("commit", e)),
            }
        })
    }

    fn fate<'a>(conn: &'a mut Conn, marker: &'a String) -> Step<'a, Fate> {
        Box::pin(async move {
            let row: Result<(bool, Option<String>), _> = sqlx::query_as(FATE)
                .bind(marker)
                .fetch_one(conn.get())
                .await;
            match row {
                Ok((ours, _)) => {
                    if !ours {
                        // Whatever the handler left open goes (a warning if
                        // nothing), and sqlx's count with it.
                        Tm::rollback(conn.get())
                            .await
                            .map_err(|e| sqlx_error("rollback", e))?;
                    }
                    Ok(fate_of(ours))
                }
                // The transaction open now failed (a statement failed in
                // it): the claim's, with nothing of it committed, or one
                // the handler opened after ending the claim's.
                Err(e) if code(&e).as_deref() == Some(IN_FAILED_TRANSACTION) => {
                    Ok(match failed_is_ours(conn).await? {
                        true => Fate::RolledBack,
                        false => Fate::Ended,
                    })
                }
                Err(e) => Err(sqlx_error("abandon", e)),
            }
        })
    }

    fn end<'a>(conn: &'a mut Conn, ask: &'a Ask, _now: i64) -> Step<'a, ()> {
        Box::pin(async move {
            sqlx::query(END)
                .bind(&ask.key.entry()[..])
                .bind(&ask.key.scope()[..])
                .bind(&ask.token.as_bytes()[..])
                .bind(&ask.fp[..])
                .bind(millis(ask.retention))
                .execute(conn.get())
                .await
                .map_err(|e| sqlx_error("making the key final", e))
                .and_then(|done| match done.rows_affected() {
                    1 => Ok(()),
                    _ => Err(crate::adapter::not_made_final(Self::NAME)),
                })
        })
    }

    fn outcome<'a>(&'a self, marker: &'a String) -> Step<'a, Option<bool>> {
        Box::pin(async move {
            let mut conn = self.connect().await?;
            let status: Option<String> = sqlx::query_scalar(STATUS)
                .bind(marker)
                .fetch_one(conn.get())
                .await
                .map_err(|e| sqlx_error("commit (status)", e))?;
            conn.release();
            Ok(outcome_of(status.as_deref()))
        })
    }

    fn rollback(conn: &mut Conn) -> Step<'_, ()> {
        Box::pin(async move {
            Tm::rollback(conn.get())
                .await
                .map_err(|e| sqlx_error("rollback", e))
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
            sqlx::raw_sql("ROLLBACK")
                .execute(conn.get())
                .await
                .map_err(|e| sqlx_error("rollback", e))?;
            sqlx::query(FINALIZE)
                .bind(&ask.key.entry()[..])
                .bind(&ask.key.scope()[..])
                .bind(&ask.token.as_bytes()[..])
                .bind(&ask.fp[..])
                .bind(record)
                .bind(expires.1)
                .execute(conn.get())
                .await
                .map(|_| ())
                .map_err(|e| sqlx_error("complete (final record)", e))
        })
    }

    fn recorded<'a>(
        conn: &'a mut Conn,
        entry: &'a [u8],
        token: &'a Token,
        _now: i64,
    ) -> Step<'a, bool> {
        Box::pin(async move {
            sqlx::query(RECORDED)
                .bind(entry)
                .bind(&token.as_bytes()[..])
                .fetch_optional(conn.get())
                .await
                .map(|r| r.is_some())
                .map_err(|e| sqlx_error("complete", e))
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
            sqlx::query(SWEEP)
                .bind(batch)
                .execute(conn.get())
                .await
                .map(|r| r.rows_affected())
                .map_err(|e| sqlx_error("sweep", e))
        })
    }
}

/// An idempotency store in PostgreSQL, over the application's own
/// [`sqlx::PgPool`], whose record commits in the handler's own transaction:
/// **exactly once for database side effects** (feature `sqlx-postgres`).
///
/// The handler takes the request's transaction as a
/// [`SqlxTransaction<Postgres>`](SqlxTransaction) and runs its own sqlx
/// queries in it:
///
/// ```no_run
/// use axum::{routing::post, Router};
/// use sqlx::Postgres;
/// use tower_redis_lock_sql::{SqlxPostgresBackend, SqlxTransaction};
/// use tower_redis_lock::key::{Header, RequestMethod, Route};
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use tower_redis_lock::idempotency::{IdempotencyKey, SafeToRetry};
/// use tower_redis_lock::IdempotencyLayer;
///
/// async fn pay(tx: SqlxTransaction<Postgres>, key: IdempotencyKey) -> Result<&'static str, Response> {
///     let mut conn = tx.conn().await.map_err(db_error)?;
///     // In the same transaction as the idempotency record: both commit, or neither.
///     sqlx::query("INSERT INTO charges (idempotency_key) VALUES ($1)")
///         .bind(key.as_str())
///         .execute(&mut *conn)
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
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), tower_redis_lock::backend::BackendError> {
/// let store = SqlxPostgresBackend::new(pool);
/// store.migrate().await?;
/// let idem = IdempotencyLayer::new(store, (RequestMethod, Route, Header::trusted_identity("x-user-id")));
/// let app: Router = Router::new().route("/payments", post(pay).layer(idem));
/// # let _ = app; Ok(()) }
/// ```
///
/// The protocol, the table and what the store does and does not promise are
/// in the [crate docs](crate); this store and
/// [`PostgresBackend`](crate::PostgresBackend) share the table.
#[derive(Clone, Debug)]
pub struct SqlxPostgresBackend {
    store: SqlStore<SqlxPg>,
}

impl SqlxPostgresBackend {
    /// A store on `pool`'s connections, in the table `trl_idempotency`
    /// (create it with [`migrate`](Self::migrate)).
    ///
    /// ```no_run
    /// # fn demo(pool: sqlx::PgPool) {
    /// let store = tower_redis_lock_sql::SqlxPostgresBackend::new(pool);
    /// # let _ = store; }
    /// ```
    pub fn new(pool: PgPool) -> Self {
        Self {
            store: SqlStore::new(SqlxPg { pool }),
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
    /// # fn demo(pool: sqlx::PgPool) {
    /// let store = tower_redis_lock_sql::SqlxPostgresBackend::new(pool)
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
    /// # fn demo(pool: sqlx::PgPool) {
    /// use tower_redis_lock_sql::Isolation;
    /// let store = tower_redis_lock_sql::SqlxPostgresBackend::new(pool)
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
    /// # fn demo(store: tower_redis_lock_sql::SqlxPostgresBackend) {
    /// let store = store.commit_timeout(std::time::Duration::from_secs(10));
    /// # let _ = store; }
    /// ```
    pub fn commit_timeout(self, timeout: Duration) -> Self {
        Self {
            store: self.store.settings(|s| s.commit_timeout = timeout),
        }
    }

    /// Create the table and its indexes if they are missing; safe to run
    /// from several instances at once.
    ///
    /// ```no_run
    /// # async fn demo(store: tower_redis_lock_sql::SqlxPostgresBackend) -> Result<(), tower_redis_lock::backend::BackendError> {
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
    /// # async fn demo(store: tower_redis_lock_sql::SqlxPostgresBackend) -> Result<(), tower_redis_lock::backend::BackendError> {
    /// let deleted = store.sweep().await?;
    /// # let _ = deleted; Ok(()) }
    /// ```
    pub async fn sweep(&self) -> Result<u64, BackendError> {
        self.store.sweep().await
    }
}

impl Backend for SqlxPostgresBackend {
    fn name(&self) -> &'static str {
        "sqlx-postgres"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    /// Waits for this process's open claims (see the [crate docs](crate)).
    fn drain(&self, timeout: Duration) -> BackendFuture<()> {
        self.store.drain(timeout)
    }
}

impl IdempotencyBackend for SqlxPostgresBackend {
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
    /// a [`SqlxTransaction`].
    fn claimed(&self, key: &EntryKey, token: &Token, extensions: &mut http::Extensions) {
        if let Some(conn) = self.store.claim_conn(key, token) {
            extensions.insert(SqlxTransaction::<Postgres> {
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
