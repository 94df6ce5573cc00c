//! Unit tests of `wire/mod.rs`.

use std::time::Duration;

use super::*;

#[test]
fn retry_after_rounds_up_and_is_at_least_one() {
    assert_eq!(retry_after_secs(Duration::ZERO), 1);
    assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
    assert_eq!(retry_after_secs(Duration::from_secs(3)), 3);
    assert_eq!(retry_after_secs(Duration::from_millis(3001)), 4);
}

#[test]
fn retry_after_of_the_longest_delay_does_not_overflow() {
    assert_eq!(retry_after_secs(Duration::MAX), u64::MAX);
}
