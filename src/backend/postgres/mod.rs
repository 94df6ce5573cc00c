//! [`PostgresBackend`]: an idempotency store whose claim, the handler's own
//! writes and the record commit in **one PostgreSQL transaction**.
//!
//! For a new key the store opens a transaction on a connection of the
//! application's pool, inserts the claim row and keeps the transaction open,
//! keyed by the claim token; the layer hands it to the handler as a
//! [`PgTransaction`] in the request's extensions; the handler writes its side
//! effects on it; [`complete`](ReplayBackend::complete) writes the record
//! into the claim row and commits. Until that commit nothing of the request
//! is visible to anyone, and a crash, a `kill -9` or a lost connection
//! anywhere before it leaves nothing: PostgreSQL aborts the transaction, the
//! claim row goes with the side effects, and the retry runs on a clean
//! slate. After the commit every retry replays.
//!
//! A duplicate's insert of the same key waits on the first transaction's
//! row lock (bounded by [`PostgresBackend::lock_wait`], PostgreSQL's
//! `lock_timeout`): when the first commits, the duplicate reads the record;
//! when it aborts, the duplicate's insert succeeds and its handler runs.
//! Nothing but done rows is ever committed (a row of a transaction that
//! commits on its own, behind the store's back, is treated as a claim that
//! expires after its lease).
//!
//! The table is in [`PostgresBackend`]'s docs.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::Pool;
use tokio::time::Instant;

use super::{Claim, EntryKey, ReplayBackend};
use crate::backend::{BackendError, BackendErrorKind, BackendFuture, Token};

mod claim;
mod sql;

use claim::Ask;
mod transaction;

use sql::*;
pub use transaction::PgTransaction;
use transaction::{take_conn, Conn};

/// An idempotency store in PostgreSQL whose record commits in the handler's
/// own transaction: **exactly once for database side effects**.
///
/// Built over the [`deadpool_postgres::Pool`] the application already has;
/// the table is created by [`migrate`](Self::migrate) (or by the SQL under
/// [The table](#the-table), run by your own migrations). Clones share the
/// store.
///
/// ```no_run
/// use axum::{routing::post, Router};
/// use tower_redis_lock::backend::{PgTransaction, PostgresBackend};
/// use tower_redis_lock::key::{RequestMethod, Route, Header};
/// use tower_redis_lock::replay::IdempotencyKey;
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
/// **What the transaction covers**: the claim row, every statement the
/// handler runs through its [`PgTransaction`], and the record. What
/// [`store_when`](crate::IdempotencyLayer::store_when) refuses, a response
/// marked [`SafeToRetry`](crate::replay::SafeToRetry), a panic or an error of
/// the handler roll it back and free the key; a commit that fails (or whose
/// answer is lost) is answered 503 with `Retry-After`, never with the
/// handler's success (the retry then replays, or runs on a clean slate).
///
/// **What it does not cover**: calls outside this database (the card
/// network, an email provider: pass the `Idempotency-Key` downstream, so
/// that their retry is a no-op there too), and statements on other
/// connections (autocommit writes elsewhere are not undone).
///
/// Round trips: a replay (or a mismatch) is one statement; a new key three
/// (`BEGIN`, the claim row, the scope's count), its record two (the update,
/// `COMMIT`).
///
/// Each claim in flight holds one pooled connection until its record is
/// committed (and a duplicate's claim one while it waits): size the pool
/// for the concurrent requests of the routes it serves. The lease is the
/// transaction: it lasts as long as the handler (a handler that never ends
/// holds its key), and PostgreSQL frees it when the connection dies. An
/// instance that is frozen rather than dead (`SIGSTOP`, a partition) holds
/// its keys until it resumes or its connection is cut: bound that with the
/// role's `idle_in_transaction_session_timeout` (above your slowest handler)
/// or TCP keepalives.
/// Expired records are deleted by a bounded sweep (at most 500 rows, at
/// most every 10 s, on a claim).
///
/// The scope quota counts the scope's committed rows plus the claims in
/// flight in this process: claims in flight on other instances are not
/// visible until they commit, so a scope may pass its quota by those.
///
/// # The table
///
/// Created by [`migrate`](Self::migrate), or by your own migrations with
/// this SQL:
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS trl_idempotency (
///     entry       bytea PRIMARY KEY,     -- prefix:{scope}:digest:idem (digests, no user data)
///     scope       bytea NOT NULL,        -- prefix:{scope}: what the quota counts per
///     token       bytea NOT NULL,        -- the claim token of the request that wrote it
///     fingerprint bytea NOT NULL,        -- the request's fingerprint
///     state       smallint NOT NULL,     -- 0 claimed, 1 done
///     record      bytea,                 -- the sealed record (opaque, untrusted when read)
///     expires_at  timestamptz NOT NULL
/// );
/// CREATE INDEX IF NOT EXISTS trl_idempotency_scope ON trl_idempotency (scope, expires_at);
/// CREATE INDEX IF NOT EXISTS trl_idempotency_expiry ON trl_idempotency (expires_at);
/// ```
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    lock_wait: Duration,
    /// The claims whose transactions are open in this process.
    open: Mutex<HashMap<Bytes, Open>>,
    /// When the last sweep began.
    swept: Mutex<Option<Instant>>,
}

/// One open claim: its transaction's connection, shared with the handler's
/// [`PgTransaction`].
struct Open {
    token: Token,
    fingerprint: Bytes,
    scope: Bytes,
    expires: Instant,
    conn: Arc<tokio::sync::Mutex<Option<Conn>>>,
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("lock_wait", &self.inner.lock_wait)
            .field("open", &self.lock_open().len())
            .finish_non_exhaustive()
    }
}

fn pg_error(what: &str, e: tokio_postgres::Error) -> BackendError {
    let kind = if e.is_closed() || e.code().is_none() {
        BackendErrorKind::Unavailable
    } else {
        BackendErrorKind::Other
    };
    BackendError::with_kind(kind, format!("postgres {what}")).with_source(e)
}

fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

fn positive_ms(ms: Option<i64>) -> Option<Duration> {
    ms.filter(|ms| *ms > 0)
        .map(|ms| Duration::from_millis(ms as u64))
}

impl PostgresBackend {
    /// A store on `pool`'s connections, in the table `trl_idempotency`
    /// (create it with [`migrate`](Self::migrate)).
    ///
    /// ```no_run
    /// # fn demo(pool: deadpool_postgres::Pool) {
    /// let store = tower_redis_lock::backend::PostgresBackend::new(pool);
    /// # let _ = store; }
    /// ```
    pub fn new(pool: Pool) -> Self {
        Self {
            inner: Arc::new(Inner {
                pool,
                lock_wait: DEFAULT_LOCK_WAIT,
                open: Mutex::new(HashMap::new()),
                swept: Mutex::new(None),
            }),
        }
    }

    /// How long one claim waits for the transaction of another request that
    /// holds its key (PostgreSQL's `lock_timeout`), default 100 ms; then
    /// [`Claim::InFlight`], and a joining duplicate claims again (so it
    /// waits on the lock again) until the layer's
    /// [`join_timeout`](crate::IdempotencyLayer::join_timeout). Keep it
    /// below the layer's [`deadline`](crate::IdempotencyLayer::deadline)
    /// (200 ms by default), which bounds the whole claim.
    ///
    /// ```no_run
    /// # fn demo(pool: deadpool_postgres::Pool) {
    /// let store = tower_redis_lock::backend::PostgresBackend::new(pool)
    ///     .lock_wait(std::time::Duration::from_millis(50));
    /// # let _ = store; }
    /// ```
    pub fn lock_wait(self, wait: Duration) -> Self {
        let inner = Inner {
            pool: self.inner.pool.clone(),
            lock_wait: wait.max(Duration::from_millis(1)),
            open: Mutex::new(HashMap::new()),
            swept: Mutex::new(None),
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Create the table and its indexes if they are missing (the SQL is
    /// under [The table](Self#the-table)); safe to run from several
    /// instances at once.
    ///
    /// ```no_run
    /// # async fn demo(store: tower_redis_lock::backend::PostgresBackend) -> Result<(), tower_redis_lock::backend::BackendError> {
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self) -> Result<(), BackendError> {
        let conn = self.connection().await?;
        // Already there: done, without a lock. (`CREATE INDEX IF NOT
        // EXISTS` takes a share lock on the table before it finds the
        // index, which would wait for every claim in flight, and stall
        // every new claim behind it: an instance starting beside busy ones.)
        let present = conn
            .client()
            .query_one(PRESENT, &[])
            .await
            .map_err(|e| pg_error("migrate", e))?;
        if present.try_get::<_, bool>(0).unwrap_or(false) {
            conn.release();
            return Ok(());
        }
        let done = conn.client().batch_execute(SCHEMA).await;
        done.map_err(|e| pg_error(&format!("migrate (creating {TABLE})"), e))?;
        conn.release();
        Ok(())
    }

    fn lock_open(&self) -> MutexGuard<'_, HashMap<Bytes, Open>> {
        // Every statement leaves the map whole; poisoning only means a
        // panic elsewhere while it was held.
        self.inner.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn connection(&self) -> Result<Conn, BackendError> {
        self.inner.pool.get().await.map(Conn::new).map_err(|e| {
            BackendError::with_kind(BackendErrorKind::Unavailable, "postgres pool").with_source(e)
        })
    }

    /// Take our open claim of `key` out of the table, if it is ours.
    fn take_open(&self, key: &EntryKey, token: &Token) -> Option<Open> {
        let mut open = self.lock_open();
        match open.get(&key.entry) {
            Some(o) if o.token == *token => open.remove(&key.entry),
            _ => None,
        }
    }
}

impl ReplayBackend for PostgresBackend {
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
        max_entries: u64,
        max_bytes: u64,
    ) -> BackendFuture<Claim> {
        if let Some(answer) = self.claim_here(key, token, fingerprint, lease) {
            return Box::pin(std::future::ready(Ok(answer)));
        }
        self.sweep_if_due();
        let store = self.clone();
        let ask = Ask {
            key: key.clone(),
            token: *token,
            fp: Bytes::copy_from_slice(fingerprint),
            lease,
            max_entries,
            max_bytes,
        };
        // Dropped part-way (the layer's deadline), the future drops its
        // connection unclean: the transaction aborts with it.
        Box::pin(async move { store.claim_in_db(ask).await })
    }

    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        let open = self.take_open(key, token);
        let store = self.clone();
        let (key, token, record) = (key.clone(), *token, record.clone());
        Box::pin(async move {
            let retention_ms = millis(retention);
            let Some(open) = open else {
                // Not open here: done already (a completion re-sent after
                // its commit), or not ours.
                let conn = store.connection().await?;
                let found = conn
                    .client()
                    .query_opt(RECORDED, &[&&key.entry[..], &&token.as_bytes()[..]])
                    .await
                    .map_err(|e| pg_error("complete", e))?;
                conn.release();
                return Ok(found.is_some());
            };
            let Some(conn) = take_conn(&open).await else {
                return Ok(false);
            };
            let updated = conn
                .client()
                .execute(
                    RECORD,
                    &[
                        &&key.entry[..],
                        &&token.as_bytes()[..],
                        &&record[..],
                        &retention_ms,
                    ],
                )
                .await
                .map_err(|e| pg_error("complete", e))?;
            if updated != 1 {
                // Our claim row is gone from our own transaction (the
                // handler rolled it back, or committed it away): nothing
                // of this request is kept.
                let _ = conn.finish("ROLLBACK").await;
                return Ok(false);
            }
            conn.finish("COMMIT")
                .await
                .map_err(|e| pg_error("commit", e))?;
            Ok(true)
        })
    }

    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        // The row lock is the claim: it holds while the transaction is open.
        let mut open = self.lock_open();
        let ours = match open.get_mut(&key.entry) {
            Some(o) if o.token == *token => {
                o.expires = Instant::now() + lease;
                true
            }
            _ => false,
        };
        Box::pin(std::future::ready(Ok(ours)))
    }

    fn abandon(&self, key: &EntryKey, token: &Token, _lease: Duration) -> BackendFuture<bool> {
        // Out of the table now, rolled back on a task of its own: it takes
        // effect even if this future is never polled.
        let Some(open) = self.take_open(key, token) else {
            return Box::pin(std::future::ready(Ok(false)));
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to roll back on: closing the connection (dropping
            // it unclean) aborts the transaction just as well.
            drop(open);
            return Box::pin(std::future::ready(Ok(true)));
        };
        let rollback = runtime.spawn(async move {
            if let Some(conn) = take_conn(&open).await {
                let _ = conn.finish("ROLLBACK").await;
            }
        });
        Box::pin(async move {
            let _ = rollback.await;
            Ok(true)
        })
    }

    fn claimed(&self, key: &EntryKey, token: &Token, extensions: &mut http::Extensions) {
        let open = self.lock_open();
        if let Some(o) = open.get(&key.entry).filter(|o| o.token == *token) {
            extensions.insert(PgTransaction {
                conn: o.conn.clone(),
            });
        }
    }

    fn is_transactional(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "postgres"
    }
}

#[cfg(test)]
pub(crate) mod tests;
