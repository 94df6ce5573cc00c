//! [`OpenCount`]: how many claims of a store are open in this process, and
//! the drain that waits for none to be.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tower_redis_lock::backend::contract::BackendFuture;
use tower_redis_lock::backend::BackendError;

/// How many claims of a store are open (claimed, and not yet completed or
/// abandoned), shared by the clones of a store and by every [`Counted`].
#[derive(Clone)]
pub(crate) struct OpenCount(Arc<watch::Sender<usize>>);

impl OpenCount {
    pub(crate) fn new() -> Self {
        Self(Arc::new(watch::Sender::new(0)))
    }

    /// One more open claim, counted until the guard is dropped.
    pub(crate) fn open(&self) -> Counted {
        self.0.send_modify(|n| *n += 1);
        Counted(self.0.clone())
    }

    /// Wait, at most `timeout`, until no claim is open; else a timeout
    /// error that says how many are (`store` names the store). Answered in
    /// the call when none is.
    pub(crate) fn drain(&self, store: &'static str, timeout: Duration) -> BackendFuture<()> {
        let mut open = self.0.subscribe();
        if *open.borrow_and_update() == 0 {
            return BackendFuture::ready(Ok(()));
        }
        BackendFuture::new(async move {
            // Every sender is gone only once every claim is: nothing left.
            let none = tokio::time::timeout(timeout, open.wait_for(|n| *n == 0))
                .await
                .is_ok();
            if none {
                return Ok(());
            }
            let left = *open.borrow();
            Err(BackendError::timeout(timeout).with_source(StillOpen { store, left }))
        })
    }
}

/// One open claim in its store's [`OpenCount`]: counted when made,
/// uncounted when dropped.
pub(crate) struct Counted(Arc<watch::Sender<usize>>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// What a drain that ran out of time says: how many claims were still open.
#[derive(Debug)]
struct StillOpen {
    store: &'static str,
    left: usize,
}

impl fmt::Display for StillOpen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} claim(s) still open (claimed, not yet completed or abandoned); their \
             transactions roll back and their keys are freed when the process ends",
            self.store, self.left
        )
    }
}

impl std::error::Error for StillOpen {}
