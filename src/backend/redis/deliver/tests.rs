use super::*;
use std::sync::atomic::AtomicU32;

#[tokio::test]
async fn retries_until_it_answers_and_drain_waits() {
    let deliveries = Arc::new(Deliveries::default());
    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let (go, gate) = tokio::sync::watch::channel(false);
    let attempt = move || -> BackendFuture<bool> {
        let calls = counted.clone();
        let mut gate = gate.clone();
        BackendFuture::new(async move {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            if n < 2 {
                return Err(BackendError::new("down"));
            }
            let _ = gate.wait_for(|open| *open).await;
            Ok(true)
        })
    };
    let fut = deliveries.deliver(attempt(), attempt);
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
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(deliveries.pending(), 0);
}

#[tokio::test]
async fn gives_up_at_the_horizon() {
    let deliveries = Arc::new(Deliveries::default());
    deliveries.saw_ttl(Duration::from_millis(60));
    let started = Instant::now();
    let down =
        || -> BackendFuture<bool> { BackendFuture::new(async { Err(BackendError::new("down")) }) };
    let result = deliveries.deliver(down(), down).await;
    assert!(result.is_err());
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(deliveries.pending(), 0);
}
