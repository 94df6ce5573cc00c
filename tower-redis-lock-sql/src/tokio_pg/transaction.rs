//! A pooled tokio-postgres connection as the protocol holds it (closed,
//! never pooled, while a transaction or a hold may be open on it) and
//! [`PgTransaction`], the handler's handle on the claim's transaction.

use std::fmt;
use std::ops::Deref;

use deadpool_postgres::{ClientWrapper, Object};
use tower_redis_lock::backend::BackendError;

use crate::protocol::{ClaimConn, Holder, HolderMark};

/// A pooled connection. Dropped without [`release`](Self::release), it is
/// taken out of the pool and closed (PostgreSQL then aborts its transaction
/// and lets go of its session locks).
pub(crate) struct Conn {
    obj: Option<Object>,
    clean: bool,
}

impl Conn {
    pub(crate) fn new(obj: Object) -> Self {
        Self {
            obj: Some(obj),
            clean: false,
        }
    }

    pub(crate) fn client(&self) -> &ClientWrapper {
        self.obj.as_ref().expect("a connection until dropped")
    }

    /// Back to the pool: no transaction open on it, nothing held.
    pub(crate) fn release(mut self) {
        self.clean = true;
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

/// The request's own PostgreSQL transaction, opened by [`PostgresBackend`](crate::PostgresBackend)
/// when the request won its idempotency claim: what the handler writes
/// through it commits together with the idempotency record, or not at all.
///
/// An axum extractor (also in the request's extensions):
/// it answers 500 problem+json when the layer in front is not an
/// [`IdempotencyLayer`](tower_redis_lock::IdempotencyLayer) over a [`PostgresBackend`](crate::PostgresBackend).
/// Take `Option<PgTransaction>` where the route may run without it.
///
/// The transaction is the application's own: it was opened with the
/// connection's defaults (isolation level, `lock_timeout`,
/// `statement_timeout`) unless the store was told otherwise, and the layer
/// bounds none of its statements. A statement that fails aborts the whole
/// transaction (PostgreSQL's rule): use a `SAVEPOINT` where a failure is
/// expected and handled.
///
/// Leave `COMMIT` and `ROLLBACK` to the layer: it commits the transaction
/// with the record, and rolls it back when the outcome is not kept. A
/// handler that ends it itself runs as it would without the layer, and its
/// key is final: whatever the request then ends with (an answer, an error,
/// a panic, its process dying), it is answered 500 problem+json
/// (`transaction-ended`) and never runs again (see the
/// [crate docs](crate#a-handler-that-ends-the-transaction-itself)).
#[derive(Clone)]
pub struct PgTransaction {
    pub(crate) conn: ClaimConn<Conn>,
    pub(crate) holder: Holder,
}

impl fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransaction").finish_non_exhaustive()
    }
}

impl PgTransaction {
    /// The transaction's connection, to run statements on: a guard that
    /// derefs to deadpool's [`ClientWrapper`] (and so to
    /// [`tokio_postgres::Client`]), one user at a time until dropped
    /// (asking again from the task that holds it is an error, not a wait
    /// for itself). An error once the transaction is over (the handler kept
    /// the handle past its answer).
    ///
    /// ```no_run
    /// # async fn demo(tx: tower_redis_lock_sql::PgTransaction) -> Result<(), Box<dyn std::error::Error>> {
    /// let db = tx.client().await?;
    /// db.execute("UPDATE accounts SET balance = balance - 5 WHERE id = 1", &[]).await?;
    /// # Ok(()) }
    /// ```
    pub async fn client(&self) -> Result<impl Deref<Target = ClientWrapper> + Send, BackendError> {
        let guard = self.holder.lock(&self.conn).await?;
        let mark = self.holder.hold();
        if guard.is_none() {
            return Err(BackendError::new(
                "the request's transaction is over (committed or rolled back by the idempotency layer)",
            ));
        }
        Ok(PgTransactionGuard { guard, _mark: mark })
    }
}

/// The connection of a [`PgTransaction`], inside its transaction: derefs to
/// deadpool's [`ClientWrapper`] (and so to [`tokio_postgres::Client`]).
struct PgTransactionGuard {
    guard: tokio::sync::OwnedMutexGuard<Option<Conn>>,
    _mark: HolderMark,
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
