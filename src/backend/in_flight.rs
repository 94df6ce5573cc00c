//! A count of work that must end before a store's `drain` returns
//! (releases on their way, abandoned claims), and the wait for it to reach
//! zero.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

/// Work on its way, counted by [`Ticket`]s.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    pending: AtomicUsize,
    idle: Notify,
}

impl InFlight {
    /// Count one more until the ticket drops.
    pub(crate) fn ticket(self: &Arc<Self>) -> Ticket {
        self.pending.fetch_add(1, Ordering::SeqCst);
        Ticket(self.clone())
    }

    /// On its way now.
    pub(crate) fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    /// Wait until nothing is on its way, or `timeout` passed (then `Err`
    /// with how many are left).
    pub(crate) async fn idle(&self, timeout: Duration) -> Result<(), usize> {
        let wait = async {
            loop {
                let idle = self.idle.notified();
                let mut idle = std::pin::pin!(idle);
                idle.as_mut().enable();
                if self.pending() == 0 {
                    return;
                }
                idle.await;
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| self.pending())
    }
}

/// One piece of work counted by an [`InFlight`] until dropped.
#[derive(Debug)]
pub(crate) struct Ticket(Arc<InFlight>);

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.0.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}
