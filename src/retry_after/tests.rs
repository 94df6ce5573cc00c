use super::*;

const TTL: Duration = Duration::from_secs(70);

#[test]
fn remaining_ttl_until_enough_holds_were_seen() {
    let holds = HoldTimes::default();
    let left = Duration::from_secs(69);
    assert_eq!(holds.retry_after(Some(left), TTL, None), left);
    assert_eq!(holds.retry_after(None, TTL, None), TTL);
    assert_eq!(
        holds.retry_after(Some(left), TTL, Some(Duration::from_secs(5))),
        Duration::from_secs(5),
        "the cap applies without samples too"
    );
    holds.record(Duration::from_millis(600));
    holds.record(Duration::from_millis(600));
    assert_eq!(holds.retry_after(Some(left), TTL, None), left);
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
