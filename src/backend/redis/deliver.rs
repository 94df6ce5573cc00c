//! Delivery of releases and abandoned claims: a [`Job`] that must reach
//! Redis whatever happens to the future that asked for it. It runs in that
//! future while it is polled, and on a task of its own once that future is
//! dropped unfinished. The layer's deadline bounds how long the *response*
//! waits, never whether the job is sent. A failed attempt is retried (the
//! same job value, sent again through the dispatch) with back-off until
//! Redis answers or the lease would have expired anyway; what to do once it
//! answered is data too ([`After`]: the local watchers to wake).
//! [`Deliveries::drain`] waits for every delivery still on its way
//! (graceful shutdown).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use super::dispatch::{Dispatch, Sent};
use super::job::{Job, Reply};
use crate::backend::in_flight::{InFlight, Ticket};
use crate::backend::watchers::Watchers;
use crate::backend::{BackendError, BackendErrorKind};
use crate::run_to_end::RunToEnd;

/// The retry horizon before any TTL was seen (the layer's default TTL).
const DEFAULT_HORIZON: Duration = Duration::from_secs(10);
/// First pause between two attempts; doubled after each failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(25);
/// Longest pause between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// One attempt gives up after this long, or after the dispatch's own bound
/// where that is longer ([`Route::attempt_timeout`]): a client without a
/// command timeout could otherwise wait forever; the command may still
/// land, which is harmless for a compare-and-delete.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// The deliveries of one backend (shared by its clones) that are on their
/// way, and the tickets of what else [`drain`](Deliveries::drain) waits for.
#[derive(Debug, Default)]
pub(crate) struct Deliveries {
    in_flight: Arc<InFlight>,
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

    /// Deliver `job`, whose first attempt `first` its caller sent already
    /// (queued in call order), retried through `route` (counted until it
    /// ends), and do `after` once Redis said done. The delivery runs inside
    /// the returned future while the caller polls it (no task and no
    /// hand-off when the first attempt answers, the usual case); if the
    /// caller drops it before the end (deadline, client gone), what is left
    /// moves to a task of its own and goes on. Outside a runtime it runs
    /// only in the returned future, its attempt awaited without a timer
    /// and not retried (there is no timer to wait with).
    pub(crate) fn deliver<R: Route>(
        self: &Arc<Self>,
        route: &Arc<R>,
        job: Job,
        first: R::Sent,
        after: After,
    ) -> Delivery {
        let give_up = Instant::now() + self.horizon();
        let ticket = self.ticket();
        let delivery = retry(route.clone(), job, first, after, give_up, ticket);
        Delivery(RunToEnd::new(delivery))
    }

    /// Count something else that must end before [`drain`](Self::drain)
    /// returns (a detached idempotent request), until the ticket drops.
    pub(crate) fn ticket(&self) -> Ticket {
        self.in_flight.ticket()
    }

    /// Releases on their way now.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.in_flight.pending()
    }

    /// Wait until no release is on its way, or `timeout` passed (then an
    /// error naming how many are left).
    pub(crate) async fn drain(&self, timeout: Duration) -> Result<(), BackendError> {
        self.in_flight.idle(timeout).await.map_err(|left| {
            BackendError::with_kind(
                BackendErrorKind::Timeout,
                format!(
                    "{left} release(s), abandoned claim(s) or idempotent request(s) still on \
                     their way after {} ms; those leases and claims expire after their TTL",
                    timeout.as_millis()
                ),
            )
        })
    }
}

/// A delivery in its caller's future: done (`true`), or not ours any more
/// (`false`); moved to a task of its own when dropped unfinished
/// ([`RunToEnd`]).
pub(crate) struct Delivery(RunToEnd<Result<bool, BackendError>>);

impl Future for Delivery {
    type Output = Result<bool, BackendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx).map(|out| {
            out.unwrap_or_else(|| Err(BackendError::new("release polled after it answered")))
        })
    }
}

/// Where a delivery's attempts go: the backend's [`Dispatch`] (a unit test
/// sends them elsewhere).
pub(crate) trait Route: Send + Sync + 'static {
    /// The answer to one attempt, read.
    type Sent: Future<Output = Result<Reply, BackendError>> + Send + 'static;

    /// Send one attempt of `job` now.
    fn send(&self, job: Job) -> Self::Sent;

    /// How long one attempt may take before it is given up on and sent
    /// again.
    fn attempt_timeout(&self) -> Duration {
        ATTEMPT_TIMEOUT
    }
}

impl Route for Dispatch {
    type Sent = Sent;

    fn send(&self, job: Job) -> Sent {
        Dispatch::send(self, job)
    }

    /// Past the dispatch's own bound (a batch gives up between 1 and 1.25
    /// times its timeout): an attempt given up on while its batch still
    /// waits would stay queued (a release is never skipped) beside the
    /// next attempt, one more copy at every retry.
    fn attempt_timeout(&self) -> Duration {
        ATTEMPT_TIMEOUT.max(self.timeout().saturating_mul(3) / 2)
    }
}

/// What a delivery does once Redis said done (released, abandoned).
pub(crate) enum After {
    /// Nothing more.
    Nothing,
    /// Wake the requests of this process that wait for the job's key.
    Wake(Arc<Watchers>),
}

/// `first`, then `job` again until Redis answers, or until the next try
/// would start after `give_up`; the last error otherwise. `ticket` counts
/// the delivery until it ends.
async fn retry<R: Route>(
    route: Arc<R>,
    job: Job,
    first: R::Sent,
    after: After,
    give_up: Instant,
    ticket: Ticket,
) -> Result<bool, BackendError> {
    let mut backoff = FIRST_BACKOFF;
    let mut attempt = Some(first);
    loop {
        let call = match attempt.take() {
            Some(call) => call,
            None => route.send(job.clone()),
        };
        // Outside a runtime (a caller's own executor) there is no timer:
        // the attempt is awaited as it is, and not retried.
        let in_runtime = tokio::runtime::Handle::try_current().is_ok();
        let answer = match in_runtime {
            true => tokio::time::timeout(route.attempt_timeout(), call).await,
            false => Ok(call.await),
        };
        let error = match answer {
            Ok(Ok(Reply::Done(done))) => {
                if let (true, After::Wake(watchers)) = (done, &after) {
                    watchers.released(job.key.as_bytes());
                }
                drop(ticket);
                return Ok(done);
            }
            // Never sent for a compare-and-act: an error.
            Ok(Ok(other)) => match other.into_done() {
                Err(e) => e,
                Ok(_) => BackendError::new("a compare-and-act answered something else"),
            },
            Ok(Err(e)) => e,
            Err(_) => BackendError::timeout(route.attempt_timeout()),
        };
        if !in_runtime || Instant::now() + backoff >= give_up {
            drop(ticket);
            return Err(error);
        }
        tracing::debug!(error = %error, what = job.what(), backoff_ms = backoff.as_millis() as u64, "delivery failed; retrying");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests;
