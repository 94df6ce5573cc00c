use super::*;

#[tokio::test]
async fn delivered_to_every_waiter_of_the_key_and_the_table_empties() {
    let feed = Arc::new(Feed::default());
    let key = Bytes::from_static(b"trl:{k}:idem");
    let (mut a, mut b) = (feed.waiter(&key), feed.waiter(&key));
    let other = feed.waiter(&Bytes::from_static(b"other"));
    feed.deliver(b"trl:{k}:idem", Bytes::new());
    let until = Instant::now() + std::time::Duration::from_secs(1);
    assert!(matches!(a.wait(until).await, Some(Published::Freed)));
    assert!(matches!(b.wait(until).await, Some(Published::Freed)));
    drop((a, b));
    assert_eq!(feed.lock().len(), 1, "only the other key's waiter");
    drop(other);
    assert!(feed.lock().is_empty());
}

#[tokio::test]
async fn a_closed_feed_wakes_its_waiters_at_once() {
    let feed = Arc::new(Feed::default());
    let key = Bytes::from_static(b"trl:{k}:idem");
    let mut w = feed.waiter(&key);
    feed.close();
    assert!(!feed.is_live());
    let until = Instant::now() + std::time::Duration::from_secs(3600);
    let woke = tokio::time::timeout(std::time::Duration::from_secs(5), w.wait(until)).await;
    assert!(matches!(woke, Ok(None)), "woken, with nothing");
}
