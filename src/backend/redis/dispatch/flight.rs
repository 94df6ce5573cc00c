//! [`Flight`]: the lease calls on their way on one connection (native calls
//! and the lane's batches), and the one clock that bounds them all.
//!
//! A call needs a bound (the batch timeout: past it the connection may be
//! wedged and is replaced). A Tokio timer per call costs a lock of the
//! runtime's timer wheel to start and another to cancel, and, whenever the
//! runtime's driver is parked with no earlier timer (at low load, between
//! any two requests), a wake-up of the parked worker thread (an `eventfd`
//! write and a context switch); fred's per-command timer, one more each
//! (CHANGELOG.md has the count per lease before and after). Here
//! the calls of a connection share one watch task instead, which runs while
//! calls are on their way: every quarter of the timeout it wakes the calls
//! still waiting, and each one that has waited the whole timeout gives up
//! (so a call is abandoned after between 1 and 1.25 times the timeout, give
//! or take the runtime's timer, which counts whole milliseconds; and while
//! the runtime the watch was started on runs: a backend shared by several
//! runtimes is bounded by the first one's). A
//! call that gets its answer in time costs two atomic operations and a
//! registration on the connection's [`Notify`], and no timer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// The calls on their way on one connection (native calls, the lane's
/// batch).
#[derive(Debug, Default)]
pub(crate) struct Flight {
    /// Calls on their way.
    calls: AtomicUsize,
    /// Whether the watch task runs.
    watched: AtomicBool,
    /// Woken by the watch task every quarter of the timeout.
    tick: Notify,
}

impl Flight {
    /// The calls on their way now.
    pub(crate) fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Count a call on its way (until the returned guard drops), and start
    /// the watch task if none runs. Inside a Tokio runtime only.
    pub(crate) fn board(self: &Arc<Self>, timeout: Duration) -> Boarded {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if !self.watched.load(Ordering::SeqCst) && !self.watched.swap(true, Ordering::SeqCst) {
            let watching = Watching {
                flight: self.clone(),
                armed: true,
            };
            tokio::spawn(watch(watching, timeout / 4));
        }
        Boarded {
            flight: self.clone(),
            since: Instant::now(),
            timeout,
        }
    }
}

/// One call on its way (see [`Flight::board`]).
#[derive(Debug)]
pub(crate) struct Boarded {
    flight: Arc<Flight>,
    since: Instant,
    timeout: Duration,
}

impl Boarded {
    /// `call`'s answer, or `None` once it has waited the timeout.
    pub(crate) async fn within<F: Future>(&self, call: F) -> Option<F::Output> {
        let mut call = std::pin::pin!(call);
        loop {
            // Made before the call is polled: a tick that comes between the
            // poll and the wait still wakes this one.
            let tick = self.flight.tick.notified();
            let mut tick = std::pin::pin!(tick);
            let woke = std::future::poll_fn(|cx: &mut Context<'_>| {
                if let Poll::Ready(answer) = call.as_mut().poll(cx) {
                    return Poll::Ready(Some(answer));
                }
                match Pin::new(&mut tick).poll(cx) {
                    Poll::Ready(()) => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match woke {
                Some(answer) => return Some(answer),
                None if self.since.elapsed() >= self.timeout => return None,
                None => {}
            }
        }
    }
}

impl Drop for Boarded {
    fn drop(&mut self) {
        self.flight.calls.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The watch task of a flight: ticks every `period` while calls are on
/// their way, then ends (the next call starts another).
async fn watch(mut watching: Watching, period: Duration) {
    // `watching` is dropped with the task, even one never polled (its
    // runtime shut down, say, while the backend lives on in another): the
    // next call starts a watch again.
    let flight = watching.flight.clone();
    loop {
        tokio::time::sleep(period).await;
        flight.tick.notify_waiters();
        if flight.calls() == 0 {
            flight.watched.store(false, Ordering::SeqCst);
            // A call boarded between the count and the store saw the task
            // running and started none: take the watch back if so (the
            // swap decides between this task and a new one).
            if flight.calls() == 0 {
                return;
            }
            if flight.watched.swap(true, Ordering::SeqCst) {
                // Another watch runs now: leave the flag to it.
                watching.armed = false;
                return;
            }
        }
    }
}

/// The watch task's hold on its flight: the flag says "no watch" once the
/// task is gone, however it ended (unless another watch took over).
struct Watching {
    flight: Arc<Flight>,
    armed: bool,
}

impl Drop for Watching {
    fn drop(&mut self) {
        if self.armed {
            self.flight.watched.store(false, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_call_that_never_answers_gives_up_after_the_timeout() {
        let flight = Arc::new(Flight::default());
        let timeout = Duration::from_millis(100);
        let started = Instant::now();
        let boarded = flight.board(timeout);
        let answer = boarded.within(std::future::pending::<()>());
        let answer = tokio::time::timeout(Duration::from_secs(5), answer).await;
        assert_eq!(answer, Ok(None), "abandoned, not answered, within 5 s");
        assert!(started.elapsed() >= timeout, "not before the timeout");
        drop(boarded);
        assert_eq!(flight.calls(), 0);
    }

    #[test]
    fn a_watch_whose_runtime_ended_is_started_again() {
        let flight = Arc::new(Flight::default());
        let timeout = Duration::from_millis(100);
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let boarded = first.block_on(async { flight.board(timeout) });
        assert!(flight.watched.load(Ordering::SeqCst));
        drop(first);
        drop(boarded);
        assert!(
            !flight.watched.load(Ordering::SeqCst),
            "the watch went with its runtime"
        );
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let answer = second.block_on(async {
            let boarded = flight.board(timeout);
            boarded.within(std::future::pending::<()>()).await
        });
        assert_eq!(answer, None, "a call in the second runtime still gives up");
    }

    #[tokio::test]
    async fn an_answer_in_time_is_handed_over_and_the_watch_ends() {
        let flight = Arc::new(Flight::default());
        let boarded = flight.board(Duration::from_millis(40));
        assert_eq!(flight.calls(), 1);
        assert_eq!(boarded.within(async { 7 }).await, Some(7));
        drop(boarded);
        assert_eq!(flight.calls(), 0);
        // The watch task ends once nothing is on its way (within two ticks).
        for _ in 0..100 {
            if !flight.watched.load(Ordering::SeqCst) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the watch task still runs with no call on its way");
    }
}
