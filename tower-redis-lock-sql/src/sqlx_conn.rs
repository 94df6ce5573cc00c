//! A pooled sqlx connection as the protocol holds it (closed, never pooled,
//! while a transaction or a hold may be open on it), and
//! [`SqlxTransaction`], the handler's handle on the claim's transaction.

use std::fmt;
use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::Database;
use tower_redis_lock::backend::BackendError;

use crate::protocol::{ClaimConn, Holder, HolderMark};

/// A pooled connection. Dropped without [`release`](Self::release), it is
/// closed instead of going back to the pool (the database then aborts its
/// transaction and lets go of its session locks).
pub(crate) struct SqlxConn<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    clean: bool,
    /// Never pooled again, even when released (see [`discard`](Self::discard)).
    discarded: bool,
    /// A statement the store runs in the claim's transaction before the
    /// handler first gets the connection (SQLite: the claim row's durable
    /// mark), kept until it has run.
    pub(crate) prelude: Option<Prelude<DB>>,
}

/// See [`SqlxConn::prelude`].
pub(crate) type Prelude<DB> = std::sync::Arc<
    dyn for<'c> Fn(
            &'c mut <DB as Database>::Connection,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<(), sqlx::Error>> + Send + 'c>,
        > + Send
        + Sync,
>;

impl<DB: Database> SqlxConn<DB> {
    pub(crate) fn new(conn: PoolConnection<DB>) -> Self {
        Self {
            conn: Some(conn),
            clean: false,
            discarded: false,
            prelude: None,
        }
    }

    pub(crate) fn get(&mut self) -> &mut DB::Connection {
        self.conn.as_mut().expect("a connection until dropped")
    }

    /// Back to the pool, unless [discarded](Self::discard).
    pub(crate) fn release(mut self) {
        self.clean = !self.discarded;
    }

    /// Closed when dropped or released: its state is not known (a failed
    /// `COMMIT` whose rollback failed too leaves sqlx counting a
    /// transaction that SQLite already ended).
    #[cfg_attr(not(feature = "sqlx-sqlite"), allow(dead_code))]
    pub(crate) fn discard(&mut self) {
        self.discarded = true;
    }
}

impl<DB: Database> Drop for SqlxConn<DB> {
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            if !self.clean {
                conn.close_on_drop();
            }
        }
    }
}

/// A sqlx error as the store reports it.
pub(crate) fn sqlx_error(what: &str, e: sqlx::Error) -> BackendError {
    let error = match &e {
        sqlx::Error::Database(_) => BackendError::new(what),
        _ => BackendError::unavailable(what),
    };
    error.with_source(e)
}

/// The SQLSTATE (or SQLite extended code) of a database error.
#[cfg_attr(not(feature = "sqlx-postgres"), allow(dead_code))] // PostgreSQL's SQLSTATEs
pub(crate) fn code(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// The request's own database transaction, opened by a sqlx store
/// ([`SqlxPostgresBackend`](crate::SqlxPostgresBackend) or
/// [`SqliteBackend`](crate::SqliteBackend)) when the request won
/// its idempotency claim: what the handler writes through it commits
/// together with the idempotency record, or not at all.
///
/// An axum extractor (also in the request's extensions):
/// it answers 500 problem+json when the layer in front is not an
/// [`IdempotencyLayer`](tower_redis_lock::IdempotencyLayer) over such a store. Take
/// `Option<SqlxTransaction<DB>>` where the route may run without it.
///
/// The transaction is the application's own: it was opened with the
/// connection's defaults (isolation level, `lock_timeout`,
/// `statement_timeout`) unless the store was told otherwise, and the layer
/// bounds none of its statements. Nested `sqlx::Connection::begin` on it
/// makes a savepoint.
///
/// Leave `COMMIT` and `ROLLBACK` to the layer: it commits the transaction
/// with the record, and rolls it back when the outcome is not kept. A
/// handler that ends it itself runs as it would without the layer, and its
/// key is final: whatever the request then ends with (an answer, an error,
/// a panic, its process dying), it is answered 500 problem+json
/// (`transaction-ended`) and never runs again (see the
/// [crate docs](crate#a-handler-that-ends-the-transaction-itself)).
pub struct SqlxTransaction<DB: Database> {
    pub(crate) conn: ClaimConn<SqlxConn<DB>>,
    pub(crate) holder: Holder,
}

impl<DB: Database> Clone for SqlxTransaction<DB> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            holder: self.holder.clone(),
        }
    }
}

impl<DB: Database> fmt::Debug for SqlxTransaction<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxTransaction").finish_non_exhaustive()
    }
}

impl<DB: Database> SqlxTransaction<DB> {
    /// The transaction's connection, to run queries on: a guard that derefs
    /// to sqlx's connection (`&mut *conn` is an executor), one user at a
    /// time until dropped (asking again from the task that holds it is an
    /// error, not a wait for itself). An error once the transaction is over
    /// (the handler kept the handle past its answer), and on SQLite when the
    /// claim is no longer the request's (its lease lapsed before the
    /// handler's first `conn()` and another request took the key over):
    /// the handler must then stop, as it must on any error here.
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlx-postgres")]
    /// # async fn demo(tx: tower_redis_lock_sql::SqlxTransaction<sqlx::Postgres>) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut conn = tx.conn().await?;
    /// sqlx::query("UPDATE accounts SET balance = balance - 5 WHERE id = 1")
    ///     .execute(&mut *conn)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn conn(
        &self,
    ) -> Result<impl DerefMut<Target = DB::Connection> + Send + use<DB>, BackendError> {
        let mut guard = self.holder.lock(&self.conn).await?;
        let mark = self.holder.hold();
        let Some(conn) = guard.as_mut() else {
            return Err(BackendError::new(
                "the request's transaction is over (committed or rolled back by the idempotency layer)",
            ));
        };
        // Taken only once it ran: a `conn()` dropped while it runs leaves
        // it for the next.
        if let Some(prelude) = conn.prelude.clone() {
            match prelude(conn.get()).await {
                Ok(()) => conn.prelude = None,
                Err(sqlx::Error::RowNotFound) => {
                    return Err(BackendError::new(
                        "the request's claim is no longer its own (its lease lapsed and another \
                         request took the key over): the handler must not go on",
                    ))
                }
                Err(e) => {
                    return Err(sqlx_error(
                        "the request's transaction could not be marked as the claim's",
                        e,
                    ))
                }
            }
        }
        Ok(Guard { guard, _mark: mark })
    }
}

/// The connection of a [`SqlxTransaction`], inside its transaction.
struct Guard<DB: Database> {
    guard: tokio::sync::OwnedMutexGuard<Option<SqlxConn<DB>>>,
    _mark: HolderMark,
}

impl<DB: Database> Deref for Guard<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        // Checked `Some` when the guard was made; nobody else can take it
        // while the guard holds the lock.
        self.guard
            .as_ref()
            .and_then(|c| c.conn.as_deref())
            .expect("checked when the guard was made")
    }
}

impl<DB: Database> DerefMut for Guard<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.guard
            .as_mut()
            .and_then(|c| c.conn.as_deref_mut())
            .expect("checked when the guard was made")
    }
}
