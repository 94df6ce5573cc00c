use super::*;

#[test]
fn tokens_differ_and_debug_hides_most() {
    let a = Token::generate();
    let b = Token::generate();
    assert_ne!(a, b);
    let dbg = format!("{a:?}");
    let hex = a.to_hex();
    assert!(!dbg.contains(std::str::from_utf8(&hex).unwrap()));
}

#[test]
fn tokens_are_unique_across_threads_and_look_random() {
    let threads: Vec<_> = (0..4)
        .map(|_| std::thread::spawn(|| (0..25_000).map(|_| Token::generate()).collect::<Vec<_>>()))
        .collect();
    let mut all = std::collections::HashSet::new();
    let mut ones = 0u64;
    for t in threads {
        for token in t.join().expect("thread") {
            ones += token
                .as_bytes()
                .iter()
                .map(|b| u64::from(b.count_ones()))
                .sum::<u64>();
            assert!(all.insert(token), "a token came twice");
        }
    }
    assert_eq!(all.len(), 100_000);
    // Half of the 12.8 M bits set, within a few standard deviations
    // (sd = sqrt(n)/2 = 1789): a counter or a constant would be far off.
    let bits = 100_000u64 * 128;
    assert!(
        ones.abs_diff(bits / 2) < 20_000,
        "{ones} of {bits} bits set"
    );
}

#[test]
fn error_display_names_cause() {
    let e = BackendError::timeout(Duration::from_millis(200));
    assert!(e.is_timeout());
    assert!(!BackendError::new("custom").is_timeout());
    assert!(e.to_string().contains("200 ms"));
}
