//! Release delivery: a release asked of [`RedisBackend`](super::RedisBackend)
//! goes on until Redis has answered it, whatever happens to the future that
//! asked: it runs in that future while it is polled, and on a task of its own
//! once that future is dropped unfinished. The layer's deadline bounds how
//! long the *response* waits, never whether the release is sent. A failed attempt is retried
//! with back-off until it succeeds or the lease would have expired anyway;
//! [`Deliveries::drain`] waits for every release still on its way (graceful
//! shutdown).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::Notify;

use crate::backend::{BackendError, BackendErrorKind, BackendFuture};

/// The retry horizon before any TTL was seen (the layer's default TTL).
const DEFAULT_HORIZON: Duration = Duration::from_secs(10);
/// First pause between two attempts; doubled after each failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(25);
/// Longest pause between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// One attempt gives up after this long (a client without a command timeout
/// could otherwise wait forever); the command may still land, which is
/// harmless for a compare-and-delete.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// The releases of one backend (shared by its clones) that are on their way.
#[derive(Debug, Default)]
pub(crate) struct Deliveries {
    pending: AtomicUsize,
    idle: Notify,
    /// The longest TTL asked of this backend, in ms: no lease it issued
    /// outlives it, so retrying a release longer is pointless.
    horizon_ms: AtomicU64,
}

impl Deliveries {
    /// Note a TTL asked of the backend (acquire, extend).
    pub(crate) fn saw_ttl(&self, ttl: Duration) {
        let ms = ttl.as_millis().min(u64::MAX as u128) as u64;
        if self.horizon_ms.load(Ordering::Relaxed) < ms {
            self.horizon_ms.fetch_max(ms, Ordering::Relaxed);
        }
    }

    fn horizon(&self) -> Duration {
        match self.horizon_ms.load(Ordering::Relaxed) {
            0 => DEFAULT_HORIZON,
            ms => Duration::from_millis(ms),
        }
    }

    /// Deliver a release (counted until it ends): `first` is the attempt
    /// already asked for (queued in call order), `again` makes each retry.
    /// The delivery runs inside the returned future while the caller polls
    /// it (no task and no hand-off when the first attempt answers, the
    /// usual case); if the caller drops it before the end (deadline, client
    /// gone), what is left moves to a task of its own and goes on. Outside a
    /// runtime it runs only in the returned future.
    pub(crate) fn deliver<F, Fut>(self: &Arc<Self>, first: Fut, again: F) -> BackendFuture<bool>
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = Result<bool, BackendError>> + Send + 'static,
    {
        let give_up = Instant::now() + self.horizon();
        let ticket = Ticket::new(self.clone());
        let delivery = async move {
            let result = retry(first, again, give_up).await;
            drop(ticket);
            result
        };
        BackendFuture::new(Delivery {
            rest: Some(BackendFuture::new(delivery)),
            handle: tokio::runtime::Handle::try_current().ok(),
        })
    }

    /// Count something else that must end before [`drain`](Self::drain)
    /// returns (a detached idempotent request), until the ticket drops.
    pub(crate) fn ticket(self: &Arc<Self>) -> Ticket {
        Ticket::new(self.clone())
    }

    /// Releases on their way now.
    pub(crate) fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    /// Wait until no release is on its way, or `timeout` passed (then an
    /// error naming how many are left).
    pub(crate) async fn drain(&self, timeout: Duration) -> Result<(), BackendError> {
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
        match tokio::time::timeout(timeout, wait).await {
            Ok(()) => Ok(()),
            Err(_) => Err(BackendError::with_kind(
                BackendErrorKind::Timeout,
                format!(
                    "{} release(s), abandoned claim(s) or idempotent request(s) still on their way \
                     after {} ms; those leases and claims expire after their TTL",
                    self.pending(),
                    timeout.as_millis()
                ),
            )),
        }
    }
}

/// A release being delivered in its caller's future; moved to a task of its
/// own when dropped unfinished.
struct Delivery {
    rest: Option<BackendFuture<bool>>,
    handle: Option<tokio::runtime::Handle>,
}

impl Future for Delivery {
    type Output = Result<bool, BackendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(rest) = self.rest.as_mut() else {
            return Poll::Ready(Err(BackendError::new("release polled after it answered")));
        };
        let out = Pin::new(rest).poll(cx);
        if out.is_ready() {
            self.rest = None;
        }
        out
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let (Some(rest), Some(handle)) = (self.rest.take(), self.handle.take()) {
            // The caller stopped waiting: the release still goes on (and
            // stays counted by its ticket until it ends).
            drop(handle.spawn(async move {
                let _ = rest.await;
            }));
        }
    }
}

/// One release (or claim, or detached request) on its way; counted from creation (synchronously, when the
/// release is asked for) to drop (delivered, given up, or its task dropped).
pub(crate) struct Ticket(Arc<Deliveries>);

impl Ticket {
    fn new(deliveries: Arc<Deliveries>) -> Self {
        deliveries.pending.fetch_add(1, Ordering::SeqCst);
        Self(deliveries)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.0.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// `first`, then `again` until one answers, or until the next try would start after
/// `give_up`; the last error otherwise.
async fn retry<F, Fut>(first: Fut, again: F, give_up: Instant) -> Result<bool, BackendError>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<bool, BackendError>>,
{
    let mut backoff = FIRST_BACKOFF;
    let mut attempt = Some(first);
    loop {
        let call = attempt.take().unwrap_or_else(&again);
        let error = match tokio::time::timeout(ATTEMPT_TIMEOUT, call).await {
            Ok(Ok(done)) => return Ok(done),
            Ok(Err(e)) => e,
            Err(_) => BackendError::timeout(ATTEMPT_TIMEOUT),
        };
        if Instant::now() + backoff >= give_up {
            return Err(error);
        }
        tracing::debug!(error = %error, backoff_ms = backoff.as_millis() as u64, "release failed; retrying");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests;
