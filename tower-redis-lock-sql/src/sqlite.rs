//! [`SqliteBackend`]: the SQL protocol on SQLite through sqlx.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr, Sqlite};
use sqlx_core::transaction::TransactionManager;
use tower_redis_lock::backend::contract::{BackendFuture, Claim, EntryKey, Token};
use tower_redis_lock::backend::{Backend, BackendError, ClaimTerms, IdempotencyBackend};
use tower_redis_lock::key::KeySpace;

use crate::adapter::{Adapter, Ask, Committed, Fate, Found, Hold, Look, Marked, Recorded, Step};
use crate::protocol::{millis, SqlStore};
use crate::sqlite_sql::*;
use crate::sqlx_conn::{sqlx_error, SqlxConn, SqlxTransaction};

type Conn = SqlxConn<Sqlite>;
type Tm = <Sqlite as sqlx::Database>::TransactionManager;

/// What the claim's connection's commit and rollback hooks saw since the
/// claim: how the handler's transaction ended, if it did. SQLite sees every
/// commit of the connection, the handler's own `COMMIT`, an autocommit
/// write after its `ROLLBACK`, and its own rollbacks (`RAISE(ROLLBACK)`,
/// `ON CONFLICT ROLLBACK`, a full disk).
#[derive(Debug, Default)]
pub(crate) struct Ends {
    commits: AtomicU64,
    rollbacks: AtomicU64,
}

impl Ends {
    fn fate(&self) -> Fate {
        if self.commits.load(Ordering::Acquire) > 0 {
            Fate::Ended
        } else if self.rollbacks.load(Ordering::Acquire) > 0 {
            Fate::RolledBack
        } else {
            Fate::Ours
        }
    }
}

/// What the margin above the pool's `busy_timeout` gives a claim: its look
/// and its transaction's start once its hold is written.
const CLAIM_MARGIN: Duration = Duration::from_millis(500);

/// `busy_timeout` before it was read: sqlx's default.
const DEFAULT_BUSY: Duration = Duration::from_secs(5);

/// The sqlx SQLite adapter.
#[derive(Clone)]
pub(crate) struct SqlxSqlite {
    pool: SqlitePool,
    /// The pool's `busy_timeout` in ms (read from a connection), or
    /// `u64::MAX` until then.
    busy_ms: Arc<AtomicU64>,
}

fn found(row: &SqliteRow) -> Result<Look, sqlx::Error> {
    let state: Option<i64> = row.try_get(1)?;
    let live = match state {
        Some(state) => Some(Found {
            fingerprint: row.try_get(0)?,
            // Any integer fits the column: one past 16 bits is no state the
            // store writes (`i16::MIN` is none either: a malformed row).
            state: i16::try_from(state).unwrap_or(i16::MIN),
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

impl Adapter for SqlxSqlite {
    type Conn = Conn;
    type Marker = Arc<Ends>;
    const NAME: &'static str = "sqlite";
    const HOLD: Hold = Hold::Row;

    fn connect(&self) -> Step<'_, Conn> {
        Box::pin(async move {
            let mut conn = self
                .pool
                .acquire()
                .await
                .map(SqlxConn::new)
                .map_err(|e| sqlx_error("sqlite pool", e))?;
            if self.busy_ms.load(Ordering::Relaxed) == u64::MAX {
                let ms: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
                    .fetch_one(conn.get())
                    .await
                    .map_err(|e| sqlx_error("sqlite busy_timeout", e))?;
                self.busy_ms.store(ms.max(0) as u64, Ordering::Relaxed);
            }
            Ok(conn)
        })
    }

    fn release(conn: Conn) {
        conn.release()
    }

    fn migrate(&self) -> Step<'_, ()> {
        Box::pin(async move {
            let mut conn = self.connect().await?;
            sqlx::raw_sql(SCHEMA)
                .execute(conn.get())
                .await
                .map_err(|e| sqlx_error("migrate", e))?;
            conn.release();
            Ok(())
        })
    }

    fn look<'a>(conn: &'a mut Conn, ask: &'a Ask, now: i64) -> Step<'a, Look> {
        Box::pin(async move {
            sqlx::query(LOOK)
                .bind(&ask.key.entry()[..])
                .bind(&ask.key.scope()[..])
                .bind(now)
                .fetch_one(conn.get())
                .await
                .and_then(|row| found(&row))
                .map_err(|e| sqlx_error("claim", e))
        })
    }

    fn hold<'a>(conn: &'a mut Conn, ask: &'a Ask, now: i64) -> Step<'a, bool> {
        Box::pin(async move {
            sqlx::query(HOLD)
                .bind(&ask.key.entry()[..])
                .bind(&ask.key.scope()[..])
                .bind(&ask.token.as_bytes()[..])
                .bind(&ask.fp[..])
                .bind(now)
                .bind(millis(ask.lease))
                .fetch_optional(conn.get())
                .await
                .map(|row| row.is_some())
                .map_err(|e| match is_busy(&e) {
                    true => BackendError::unavailable(
                        "sqlite: the database's write lock was not free within the pool's \
                         busy_timeout (another request's transaction holds it); nothing was \
                         claimed",
                    )
                    .with_source(e),
                    false => sqlx_error("claim (hold)", e),
                })
        })
    }

    fn wait<'a>(_conn: &'a mut Conn, _ask: &'a Ask, _bound: Duration) -> Step<'a, bool> {
        // A committed claim row: the next look answers (in flight, or the
        // row committed meanwhile).
        Box::pin(std::future::ready(Ok(true)))
    }

    fn unhold<'a>(conn: &'a mut Conn, entry: &'a [u8], token: &'a Token) -> Step<'a, ()> {
        Box::pin(async move {
            // The hooks go before the connection goes back to the pool.
            let mut handle = conn
                .get()
                .lock_handle()
                .await
                .map_err(|e| sqlx_error("unhold", e))?;
            handle.remove_commit_hook();
            handle.remove_rollback_hook();
            drop(handle);
            sqlx::query(UNHOLD)
                .bind(entry)
                .bind(&token.as_bytes()[..])
                .execute(conn.get())
                .await
                .map(|_| ())
                .map_err(|e| sqlx_error("unhold", e))
        })
    }

    fn begin<'a>(conn: &'a mut Conn, begin: Option<&'a str>) -> Step<'a, ()> {
        Box::pin(async move {
            let statement = begin.map(|b| AssertSqlSafe(b.to_owned()).into_sql_str());
            Tm::begin(conn.get(), statement)
                .await
                .map_err(|e| sqlx_error("begin", e))
        })
    }

    fn mark<'a>(conn: &'a mut Conn, ask: &'a Ask, _now: i64) -> Step<'a, Marked<Arc<Ends>>> {
        Box::pin(async move {
            let ends = Arc::new(Ends::default());
            let mut handle = conn
                .get()
                .lock_handle()
                .await
                .map_err(|e| sqlx_error("claim (hooks)", e))?;
            let seen = ends.clone();
            handle.set_commit_hook(move || {
                seen.commits.fetch_add(1, Ordering::AcqRel);
                true
            });
            let seen = ends.clone();
            handle.set_rollback_hook(move || {
                seen.rollbacks.fetch_add(1, Ordering::AcqRel);
            });
            drop(handle);
            // The durable mark waits for the handler's first `conn()`: a
            // handler that has not asked for the connection does not hold
            // the write lock.
            let (entry, token) = (ask.key.entry().clone(), ask.token);
            conn.prelude = Some(std::sync::Arc::new(move |c| {
                let (entry, token) = (entry.clone(), token);
                Box::pin(async move {
                    let marked = sqlx::query(MARK)
                        .bind(&entry[..])
                        .bind(&token.as_bytes()[..])
                        .execute(c)
                        .await?;
                    match marked.rows_affected() {
                        1 => Ok(()),
                        // Taken over: another request holds the key now.
                        _ => Err(sqlx::Error::RowNotFound),
                    }
                })
            }));
            Ok(Marked::Ours(ends))
        })
    }

    fn record<'a>(
        conn: &'a mut Conn,
        entry: &'a [u8],
        token: &'a Token,
        record: &'a [u8],
        expires: (i64, i64),
        marker: &'a Arc<Ends>,
    ) -> Step<'a, Recorded> {
        Box::pin(async move {
            match marker.fate() {
                Fate::Ours => {}
                Fate::Ended => return Ok(Recorded::Ended),
                Fate::RolledBack => return Ok(Recorded::Failed),
            }
            let done = sqlx::query(RECORD)
                .bind(entry)
                .bind(&token.as_bytes()[..])
                .bind(record)
                .bind(expires.0.saturating_add(expires.1))
                .execute(conn.get())
                .await;
            match done {
                Ok(r) if r.rows_affected() == 1 => Ok(Recorded::Written),
                Ok(_) => Ok(Recorded::Failed),
                Err(e) if is_busy(&e) => Ok(Recorded::Failed),
                Err(e) => Err(sqlx_error("complete", e)),
            }
        })
    }

    fn is_transient(e: &BackendError) -> bool {
        std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<sqlx::Error>())
            .is_some_and(is_busy)
    }

    fn commit(conn: &mut Conn) -> Step<'_, Committed> {
        Box::pin(async move {
            match Tm::commit(conn.get()).await {
                Ok(()) => Ok(Committed::Yes),
                // A COMMIT that fails commits nothing (a full disk, an I/O
                // error): rolled back.
                Err(e) => {
                    tracing::warn!(error = %e, "sqlite: COMMIT failed; the transaction is rolled back");
                    let _ = Tm::rollback(conn.get()).await;
                    // SQLite may have rolled it back itself, and then sqlx
                    // still counts it open: never pooled again.
                    conn.discard();
                    Ok(Committed::Refused)
                }
            }
        })
    }

    fn fate<'a>(conn: &'a mut Conn, marker: &'a Arc<Ends>) -> Step<'a, Fate> {
        Box::pin(async move {
            let fate = marker.fate();
            if fate != Fate::Ours {
                // Whatever the handler left open goes (an error if nothing),
                // by a plain `ROLLBACK`: sqlx's count of transactions no
                // longer says what is open.
                let _ = sqlx::raw_sql("ROLLBACK").execute(conn.get()).await;
            }
            Ok(fate)
        })
    }

    fn end<'a>(conn: &'a mut Conn, ask: &'a Ask, now: i64) -> Step<'a, ()> {
        Box::pin(async move {
            sqlx::query(END)
                .bind(&ask.key.entry()[..])
                .bind(&ask.key.scope()[..])
                .bind(&ask.token.as_bytes()[..])
                .bind(&ask.fp[..])
                .bind(now + millis(ask.retention))
                .execute(conn.get())
                .await
                .map_err(|e| sqlx_error("making the key final", e))
                .and_then(|done| match done.rows_affected() {
                    1 => Ok(()),
                    _ => Err(crate::adapter::not_made_final(Self::NAME)),
                })
        })
    }

    fn outcome<'a>(&'a self, _marker: &'a Arc<Ends>) -> Step<'a, Option<bool>> {
        // Never asked: a failed COMMIT is rolled back (`commit`).
        Box::pin(std::future::ready(Ok(Some(false))))
    }

    fn claim_timeout(&self, deadline: Duration) -> Duration {
        let busy = match self.busy_ms.load(Ordering::Relaxed) {
            u64::MAX => DEFAULT_BUSY,
            ms => Duration::from_millis(ms),
        };
        deadline.max(busy + CLAIM_MARGIN)
    }

    fn rollback(conn: &mut Conn) -> Step<'_, ()> {
        Box::pin(async move {
            match Tm::rollback(conn.get()).await {
                Ok(()) => Ok(()),
                // The handler rolled it back itself.
                Err(e) if no_transaction(&e) => Ok(()),
                Err(e) => Err(sqlx_error("rollback", e)),
            }
        })
    }

    fn finalize<'a>(
        conn: &'a mut Conn,
        ask: &'a Ask,
        record: &'a [u8],
        expires: (i64, i64),
    ) -> Step<'a, ()> {
        Box::pin(async move {
            // Whatever the handler left open goes (an error if nothing).
            let _ = sqlx::raw_sql("ROLLBACK").execute(conn.get()).await;
            sqlx::query(FINALIZE)
                .bind(&ask.key.entry()[..])
                .bind(&ask.key.scope()[..])
                .bind(&ask.token.as_bytes()[..])
                .bind(&ask.fp[..])
                .bind(record)
                .bind(expires.0.saturating_add(expires.1))
                .execute(conn.get())
                .await
                .map_err(|e| sqlx_error("complete (final record)", e))
                .and_then(|done| match done.rows_affected() {
                    1 => Ok(()),
                    _ => Err(crate::adapter::not_made_final(Self::NAME)),
                })
        })
    }

    fn recorded<'a>(
        conn: &'a mut Conn,
        entry: &'a [u8],
        token: &'a Token,
        now: i64,
    ) -> Step<'a, bool> {
        Box::pin(async move {
            sqlx::query(RECORDED)
                .bind(entry)
                .bind(&token.as_bytes()[..])
                .bind(now)
                .fetch_optional(conn.get())
                .await
                .map(|r| r.is_some())
                .map_err(|e| sqlx_error("complete", e))
        })
    }

    fn extend<'a>(
        conn: &'a mut Conn,
        entry: &'a [u8],
        token: &'a Token,
        expires: (i64, i64),
    ) -> Step<'a, bool> {
        Box::pin(async move {
            sqlx::query(EXTEND)
                .bind(entry)
                .bind(&token.as_bytes()[..])
                .bind(expires.0.saturating_add(expires.1))
                .execute(conn.get())
                .await
                .map(|r| r.rows_affected() == 1)
                .map_err(|e| sqlx_error("extend", e))
        })
    }

    fn sweep(conn: &mut Conn, batch: i64, now: i64) -> Step<'_, u64> {
        Box::pin(async move {
            sqlx::query(SWEEP)
                .bind(batch)
                .bind(now)
                .execute(conn.get())
                .await
                .map(|r| r.rows_affected())
                .map_err(|e| sqlx_error("sweep", e))
        })
    }
}

/// A durable idempotency store for one machine in SQLite, over the
/// application's own [`sqlx::SqlitePool`], whose record commits in the
/// handler's own transaction: **exactly once for database side effects**,
/// and replays that survive a restart (feature `sqlx-sqlite`).
///
/// The handler takes the request's transaction as a
/// [`SqlxTransaction<Sqlite>`](SqlxTransaction) and runs its own sqlx
/// queries in it (see [`SqlxPostgresBackend`](crate::SqlxPostgresBackend)
/// for a handler; only the database type differs).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::SqlitePool::connect("sqlite://payments.db?mode=rwc").await?;
/// let store = tower_redis_lock_sql::SqliteBackend::new(pool);
/// store.migrate().await?; // the table, and WAL
/// # Ok(()) }
/// ```
///
/// SQLite has one writer at a time and no row locks, so a claim holds its
/// key with a **committed claim row** (its own short write transaction)
/// rather than in the handler's transaction; the handler's transaction is
/// `BEGIN` (deferred): it takes the write lock at its first write (the
/// store marks the claim row in it when the handler first asks for the
/// connection, so that a claim the handler commits itself says so), and the
/// record is written and committed with it. A claim whose hold waits for
/// the write lock (another request's transaction has written) waits its
/// turn, up to the pool's `busy_timeout` (sqlx's default 5 s; the layer
/// waits that long plus a margin, whatever its own `deadline`), then answers
/// 503 with nothing left behind: a claim placed after the layer stopped
/// waiting is undone. How each step compares with PostgreSQL is in the
/// [crate docs](crate).
///
/// What it cannot tell: a handler that rolls the request's transaction
/// back itself (undoing the claim row's mark), then commits writes of its
/// own on the same connection, and whose process dies before its answer:
/// the claim row expires and the key runs again. Alive, the same handler's
/// key is final (the hooks saw the commit).
///
/// The store sets the claim's connection's commit and rollback hooks while
/// the handler runs (they tell how the handler's transaction ended) and
/// removes them after: an application's own hooks on the pool's connections
/// would be replaced.
#[derive(Clone, Debug)]
pub struct SqliteBackend {
    store: SqlStore<SqlxSqlite>,
}

impl SqliteBackend {
    /// A store on `pool`'s connections, in the table `trl_idempotency`
    /// (create it with [`migrate`](Self::migrate)).
    ///
    /// ```no_run
    /// # fn demo(pool: sqlx::SqlitePool) {
    /// let store = tower_redis_lock_sql::SqliteBackend::new(pool);
    /// # let _ = store; }
    /// ```
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            store: SqlStore::new(SqlxSqlite {
                pool,
                busy_ms: Arc::new(AtomicU64::new(u64::MAX)),
            }),
        }
    }

    /// Open the handler's transaction with `BEGIN IMMEDIATE` (the write
    /// lock from the start, so a handler that reads before it writes never
    /// meets `SQLITE_BUSY_SNAPSHOT`) instead of `BEGIN` (deferred). Handlers
    /// then run one at a time.
    ///
    /// ```no_run
    /// # fn demo(pool: sqlx::SqlitePool) {
    /// let store = tower_redis_lock_sql::SqliteBackend::new(pool).immediate();
    /// # let _ = store; }
    /// ```
    pub fn immediate(self) -> Self {
        Self {
            store: self.store.settings(|s| s.begin = Some("BEGIN IMMEDIATE")),
        }
    }

    /// How long the handler's `COMMIT` may take (default 5 s; the layer's
    /// deadline does not cut it). Past it, the request is answered 503
    /// `outcome-unknown` and the key stays claimed until the `COMMIT`
    /// returns.
    ///
    /// ```no_run
    /// # fn demo(store: tower_redis_lock_sql::SqliteBackend) {
    /// let store = store.commit_timeout(std::time::Duration::from_secs(10));
    /// # let _ = store; }
    /// ```
    pub fn commit_timeout(self, timeout: Duration) -> Self {
        Self {
            store: self.store.settings(|s| s.commit_timeout = timeout),
        }
    }

    /// Create the table and its indexes if they are missing, and put the
    /// database in WAL mode (readers never wait for the writer).
    ///
    /// ```no_run
    /// # async fn demo(store: tower_redis_lock_sql::SqliteBackend) -> Result<(), tower_redis_lock::backend::BackendError> {
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
    /// # async fn demo(store: tower_redis_lock_sql::SqliteBackend) -> Result<(), tower_redis_lock::backend::BackendError> {
    /// let deleted = store.sweep().await?;
    /// # let _ = deleted; Ok(()) }
    /// ```
    pub async fn sweep(&self) -> Result<u64, BackendError> {
        self.store.sweep().await
    }
}

impl Backend for SqliteBackend {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    /// Waits for this process's open claims (see the [crate docs](crate)).
    fn drain(&self, timeout: Duration) -> BackendFuture<()> {
        self.store.drain(timeout)
    }
}

impl IdempotencyBackend for SqliteBackend {
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
            extensions.insert(SqlxTransaction::<Sqlite> {
                conn,
                holder: Default::default(),
            });
        }
    }

    fn is_transactional(&self) -> bool {
        true
    }

    /// The pool's `busy_timeout` plus a margin, at least `deadline`: a
    /// claim waits for the write lock (see [`SqliteBackend`]).
    fn claim_timeout(&self, deadline: Duration) -> Duration {
        self.store.claim_timeout(deadline)
    }
}
