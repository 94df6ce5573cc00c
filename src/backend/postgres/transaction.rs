//! The claim's transaction: the pooled connection it runs on (closed, never
//! pooled, while a transaction may be open on it) and [`PgTransaction`], the
//! handler's handle on it.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use deadpool_postgres::{ClientWrapper, Object};

use super::Open;
use crate::backend::BackendError;

/// A pooled connection. Dropped while a transaction may be open on it, it
/// is taken out of the pool and closed (PostgreSQL then aborts the
/// transaction); only after a `COMMIT` or `ROLLBACK` that answered does it
/// go back to the pool.
pub(super) struct Conn {
    obj: Option<Object>,
    clean: bool,
}

impl Conn {
    pub(super) fn new(obj: Object) -> Self {
        Self {
            obj: Some(obj),
            clean: false,
        }
    }

    pub(super) fn client(&self) -> &ClientWrapper {
        self.obj.as_ref().expect("a connection until dropped")
    }

    /// Back to the pool: no transaction is open on it.
    pub(super) fn release(mut self) {
        self.clean = true;
    }

    /// End the transaction with `sql` (`COMMIT` / `ROLLBACK`); the
    /// connection goes back to the pool only if it answered.
    pub(super) async fn finish(mut self, sql: &str) -> Result<(), tokio_postgres::Error> {
        self.client().batch_execute(sql).await?;
        self.clean = true;
        Ok(())
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(obj) = self.obj.take() {
            if !self.clean {
                // Out of the pool, and closed: the transaction aborts.
                drop(Object::take(obj));
            }
        }
    }
}

/// The connection of an open claim, once the handler let go of it (taken,
/// so that a handle the handler kept sees the transaction as over).
pub(super) async fn take_conn(o: &Open) -> Option<Conn> {
    o.conn.lock().await.take()
}

/// The request's own PostgreSQL transaction, opened by [`PostgresBackend`](crate::backend::PostgresBackend)
/// when the request won its idempotency claim: what the handler writes
/// through it commits together with the idempotency record, or not at all.
///
/// An axum extractor (feature `axum`; also in the request's extensions):
/// it answers 500 problem+json when the layer in front is not an
/// [`IdempotencyLayer`](crate::IdempotencyLayer) over a [`PostgresBackend`](crate::backend::PostgresBackend).
/// Take `Option<PgTransaction>` where the route may run without it.
///
/// Do not `COMMIT` or `ROLLBACK` it yourself: the layer commits it with the
/// record, and rolls it back when the outcome is not kept. A statement that
/// fails aborts the whole transaction (PostgreSQL's rule): use a
/// `SAVEPOINT` where a failure is expected and handled.
#[derive(Clone)]
pub struct PgTransaction {
    pub(super) conn: Arc<tokio::sync::Mutex<Option<Conn>>>,
}

impl fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransaction").finish_non_exhaustive()
    }
}

impl PgTransaction {
    /// The transaction's connection, to run statements on: a guard that
    /// derefs to deadpool's [`ClientWrapper`] (and so to
    /// [`tokio_postgres::Client`]), one user at a time until dropped. An
    /// error once the transaction is over (the handler kept the handle past
    /// its answer).
    ///
    /// ```no_run
    /// # async fn demo(tx: tower_redis_lock::backend::PgTransaction) -> Result<(), Box<dyn std::error::Error>> {
    /// let db = tx.client().await?;
    /// db.execute("UPDATE accounts SET balance = balance - 5 WHERE id = 1", &[]).await?;
    /// # Ok(()) }
    /// ```
    pub async fn client(&self) -> Result<impl Deref<Target = ClientWrapper> + Send, BackendError> {
        let guard = self.conn.clone().lock_owned().await;
        if guard.is_none() {
            return Err(BackendError::new(
                "the request's transaction is over (committed or rolled back by the idempotency layer)",
            ));
        }
        Ok(PgTransactionGuard { guard })
    }
}

/// The connection of a [`PgTransaction`], inside its transaction: derefs to
/// deadpool's [`ClientWrapper`] (and so to [`tokio_postgres::Client`]).
struct PgTransactionGuard {
    guard: tokio::sync::OwnedMutexGuard<Option<Conn>>,
}

impl fmt::Debug for PgTransactionGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransactionGuard").finish_non_exhaustive()
    }
}

impl Deref for PgTransactionGuard {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        // Checked `Some` when the guard was made, and nobody else can take
        // it while the guard holds the lock.
        self.guard
            .as_ref()
            .map(Conn::client)
            .expect("checked when the guard was made")
    }
}
