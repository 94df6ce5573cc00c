use super::*;
use std::sync::atomic::AtomicU32;

use bytes::Bytes;

use crate::backend::Token;

/// A route whose attempts fail until `fail_first` were made, then answer
/// "done" once `gate` is open; it counts the attempts.
struct Flaky {
    calls: Arc<AtomicU32>,
    fail_first: u32,
    gate: tokio::sync::watch::Receiver<bool>,
}

impl Route for Flaky {
    type Sent = Pin<Box<dyn Future<Output = Result<Reply, BackendError>> + Send>>;

    fn send(&self, _job: Job) -> Self::Sent {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        let fail = n < self.fail_first;
        let mut gate = self.gate.clone();
        Box::pin(async move {
            if fail {
                return Err(BackendError::new("down"));
            }
            let _ = gate.wait_for(|open| *open).await;
            Ok(Reply::Done(true))
        })
    }
}

fn flaky(fail_first: u32) -> (Arc<Flaky>, tokio::sync::watch::Sender<bool>) {
    let (go, gate) = tokio::sync::watch::channel(false);
    let route = Flaky {
        calls: Arc::default(),
        fail_first,
        gate,
    };
    (Arc::new(route), go)
}

fn job() -> Job {
    let token = Token::generate().to_hex();
    Job::release(&Bytes::from_static(b"trl:{k}"), token, false)
}

/// Deliver a release through `route`, its first attempt sent first (as the
/// store's hubs do).
fn deliver(deliveries: &Arc<Deliveries>, route: &Arc<Flaky>, after: After) -> Delivery {
    let job = job();
    let first = route.send(job.clone());
    deliveries.deliver(route, job, first, after)
}

#[tokio::test]
async fn retries_until_it_answers_and_drain_waits() {
    let deliveries = Arc::new(Deliveries::default());
    let (route, go) = flaky(2);
    let fut = deliver(&deliveries, &route, After::Nothing);
    // The caller gives up at once: the delivery goes on.
    drop(fut);
    assert_eq!(deliveries.pending(), 1);
    let err = deliveries
        .drain(Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("1 release(s)"), "{err}");
    let ticket = deliveries.ticket();
    assert_eq!(deliveries.pending(), 2, "a ticket counts like a release");
    drop(ticket);
    go.send(true).unwrap();
    deliveries.drain(Duration::from_secs(5)).await.unwrap();
    assert_eq!(route.calls.load(Ordering::SeqCst), 3);
    assert_eq!(deliveries.pending(), 0);
}

#[tokio::test]
async fn gives_up_at_the_horizon() {
    let deliveries = Arc::new(Deliveries::default());
    deliveries.saw_ttl(Duration::from_millis(60));
    let started = Instant::now();
    let (route, _go) = flaky(u32::MAX);
    let result = deliver(&deliveries, &route, After::Nothing).await;
    assert!(result.is_err());
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(deliveries.pending(), 0);
}

/// What to do once the job is answered is data: a done release wakes the
/// watchers of its key, once.
#[tokio::test]
async fn a_done_release_wakes_its_watchers() {
    let deliveries = Arc::new(Deliveries::default());
    let watchers = Arc::new(Watchers::default());
    let (watch, _) = watchers.watch(&Bytes::from_static(b"trl:{k}"));
    let before = watch.count();
    let (route, go) = flaky(0);
    go.send(true).unwrap();
    let done = deliver(&deliveries, &route, After::Wake(watchers.clone()));
    assert!(done.await.unwrap());
    assert_eq!(watch.count(), before + 1);
}

/// Outside a runtime (a caller that drives a release with an executor of
/// its own) the delivery runs in its future, as its docs say: no panic for
/// want of Tokio's timer, and its answer comes back.
#[test]
fn outside_a_runtime_it_runs_in_its_future() {
    let deliveries = Arc::new(Deliveries::default());
    let (route, go) = flaky(0);
    go.send_replace(true);
    let delivery = deliver(&deliveries, &route, After::Nothing);
    let answer = futures_util::FutureExt::now_or_never(delivery);
    assert!(
        matches!(answer, Some(Ok(true))),
        "answered in the caller's poll: {answer:?}"
    );
    assert_eq!(deliveries.pending(), 0);
}
