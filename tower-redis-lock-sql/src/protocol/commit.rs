//! The handler's `COMMIT`: bounded by the store's commit timeout, not by
//! the layer's deadline, and asked about by the transaction's id when its
//! answer is lost.

use std::time::Duration;

use tokio::time::Instant;
use tower_redis_lock::backend::BackendError;

use super::Open;
use crate::adapter::{Adapter, Committed};

/// `COMMIT` the claim's transaction, bounded by the commit timeout, on
/// a task of its own (cut at the bound, it still finishes, and lets go
/// of the hold only then: the key stays claimed until its outcome is
/// known). The bound waits for the `COMMIT`'s answer only, not for the
/// unlock after it. An answer that did not arrive is asked about by the
/// transaction's id.
pub(super) async fn commit<A: Adapter>(
    adapter: &A,
    mut conn: A::Conn,
    open: Open<A>,
    bound: Duration,
) -> Result<bool, BackendError> {
    let started = Instant::now();
    let marker = open.marker.clone();
    // The COMMIT's answer comes back as soon as it arrives: the unlock
    // after it (a SQLite `DELETE` may queue behind another writer) is not
    // part of what the bound waits for.
    let (answer, answered) = tokio::sync::oneshot::channel();
    drop(tokio::spawn(async move {
        let committed = A::commit(&mut conn).await;
        let unhold = committed.is_ok();
        // Rolled back: the claim's row (SQLite) is still there, and a
        // retry must not meet it for the rest of its lease. Committed, the
        // row is the record: letting go is a no-op there, or the session's
        // unlock (PostgreSQL), never worth a retry.
        let refused = matches!(committed, Ok(Committed::Refused));
        let _ = answer.send(committed);
        if unhold {
            let (entry, token) = (open.ask.key.entry(), &open.ask.token);
            if refused {
                let _ = super::let_go::<A>(conn, entry, token, open.expires, true).await;
            } else if A::unhold(&mut conn, entry, token).await.is_ok() {
                A::release(conn);
            }
        }
        // Counted by the drain until here.
        drop(open);
    }));
    match tokio::time::timeout(bound, answered).await {
        Ok(Ok(Ok(Committed::Yes))) => Ok(true),
        Ok(Ok(Ok(Committed::Refused))) => Ok(false),
        Ok(Ok(Err(lost))) => resolve(adapter, &marker, started + bound, lost).await,
        Ok(Err(_)) => Err(BackendError::outcome_unknown(format!(
            "{}: the COMMIT's task ended without an answer (it panicked)",
            A::NAME
        ))),
        Err(_) => Err(BackendError::outcome_unknown(format!(
            "{}: COMMIT not answered within the store's commit timeout ({bound:?}); the key \
                 stays claimed until it is",
            A::NAME
        ))),
    }
}

/// Whether a transaction whose `COMMIT` answer was lost committed,
/// asked again and again on connections of their own until `deadline`.
async fn resolve<A: Adapter>(
    adapter: &A,
    marker: &A::Marker,
    deadline: Instant,
    lost: BackendError,
) -> Result<bool, BackendError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, adapter.outcome(marker)).await {
            Ok(Ok(Some(committed))) => {
                tracing::warn!(store = A::NAME, committed, error = %lost, "the COMMIT's answer was lost; found by the transaction's id");
                return Ok(committed);
            }
            // Not known yet, or the database unreachable: ask again.
            Ok(Ok(None)) | Ok(Err(_)) => {}
            Err(_) => break,
        }
        tokio::time::sleep(left.min(Duration::from_millis(50))).await;
    }
    Err(BackendError::outcome_unknown(format!(
        "{}: the COMMIT's answer was lost, and whether it committed could not be found within \
             the store's commit timeout; the key stays claimed until it is",
        A::NAME
    ))
    .with_source(lost))
}

#[cfg(test)]
mod tests;
