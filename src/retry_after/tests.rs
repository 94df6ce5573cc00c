use super::*;

const TTL: Duration = Duration::from_secs(70);

#[test]
fn the_holders_elapsed_time_until_enough_holds_were_seen() {
    let holds = HoldTimes::default();
    // A fresh route: the holder took its 70 s lease 200 ms ago. Not the
    // TTL: as long again as it held so far, raised to 1 s.
    let left = TTL - Duration::from_millis(200);
    assert_eq!(
        holds.retry_after(Some(left), TTL, None),
        Duration::from_secs(1)
    );
    // Held 9 s already: 9 s more.
    let left = TTL - Duration::from_secs(9);
    assert_eq!(
        holds.retry_after(Some(left), TTL, None),
        Duration::from_secs(9)
    );
    // Never past the lease's own expiry, nor the cap.
    let left = Duration::from_secs(2);
    assert_eq!(holds.retry_after(Some(left), TTL, None), left);
    let left = TTL - Duration::from_secs(30);
    assert_eq!(
        holds.retry_after(Some(left), TTL, Some(Duration::from_secs(5))),
        Duration::from_secs(5),
        "the cap applies without samples too"
    );
    // Nothing known of the holder either: its TTL.
    assert_eq!(holds.retry_after(None, TTL, None), TTL);
    holds.record(Duration::from_millis(600));
    holds.record(Duration::from_millis(600));
    let left = TTL - Duration::from_secs(9);
    assert_eq!(
        holds.retry_after(Some(left), TTL, None),
        Duration::from_secs(9),
        "two holds are not enough to learn from"
    );
}

#[test]
fn expected_remaining_time_clamped_to_one_second_and_the_ttl() {
    let holds = HoldTimes::default();
    for _ in 0..10 {
        holds.record(Duration::from_millis(600));
    }
    // Just taken: 600 ms to go, raised to 1 s.
    let left = TTL - Duration::from_millis(5);
    assert_eq!(
        holds.retry_after(Some(left), TTL, None),
        Duration::from_secs(1)
    );
    // Holds of 20 s, holder 5 s in: 15 s.
    for _ in 0..WINDOW {
        holds.record(Duration::from_secs(20));
    }
    let left = TTL - Duration::from_secs(5);
    assert_eq!(
        holds.retry_after(Some(left), TTL, None),
        Duration::from_secs(15)
    );
    // Never later than the lease's own expiry, nor the cap.
    let short = Duration::from_secs(3);
    assert_eq!(
        holds.retry_after(Some(short), Duration::from_secs(4), None),
        short
    );
    assert_eq!(
        holds.retry_after(Some(left), TTL, Some(Duration::from_secs(2))),
        Duration::from_secs(2)
    );
}

#[test]
fn percentile_of_the_recent_window() {
    let holds = HoldTimes::default();
    for i in 1..=100u64 {
        holds.record(Duration::from_millis(i * 10));
    }
    // The window keeps the last 64 (370..=1000 ms); its p90 is 940 ms.
    assert_eq!(holds.typical(), Some(Duration::from_millis(940)));
}
