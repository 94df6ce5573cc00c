use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;

use tokio::sync::oneshot;

use super::RunToEnd;

/// A run dropped by its caller before it ended goes on in a task of its
/// own, to its end; one polled to its end by its caller is not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_to_end_dropped_midway_finishes_in_a_task_of_its_own() {
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let (done_tx, done_rx) = oneshot::channel::<&'static str>();
    let run = RunToEnd::new(async move {
        let _ = go_rx.await;
        let _ = done_tx.send("ended");
    });
    // The caller polls it once and gives up (an outer timeout).
    let mut run = Box::pin(run);
    let polled = std::future::poll_fn(|cx| Poll::Ready(run.as_mut().poll(cx))).await;
    assert!(polled.is_pending());
    drop(run);
    go_tx
        .send(())
        .expect("the dropped run still waits for its signal");
    assert_eq!(done_rx.await, Ok("ended"));

    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    assert_eq!(
        RunToEnd::new(async move {
            counted.fetch_add(1, Ordering::SeqCst);
        })
        .await,
        Some(())
    );
    tokio::task::yield_now().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "ran once, in its caller");
}
