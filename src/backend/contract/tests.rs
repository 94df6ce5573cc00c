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
            // The random part: the last bytes are the issue time.
            ones += token.as_bytes()[..16 - issued::STAMP]
                .iter()
                .map(|b| u64::from(b.count_ones()))
                .sum::<u64>();
            assert!(all.insert(token), "a token came twice");
        }
    }
    assert_eq!(all.len(), 100_000);
    // Half of the 8 M random bits set, within a few standard deviations
    // (sd = sqrt(n)/2 = 1414): a counter or a constant would be far off.
    let bits = 100_000u64 * 80;
    assert!(
        ones.abs_diff(bits / 2) < 20_000,
        "{ones} of {bits} bits set"
    );
}

/// What a token shows of itself comes from its random part: two tokens
/// made in the same millisecond differ in their `Debug` prefix and in the
/// first 16 hex digits (the tag a notifying release publishes, by which an
/// instance tells its own release's echo from another's).
#[test]
fn a_token_shows_its_random_part_not_its_issue_time() {
    let mut same_ms = 0;
    for _ in 0..1_000 {
        let (a, b) = (Token::generate(), Token::generate());
        if issued::issued_ms(&a.to_hex()) != issued::issued_ms(&b.to_hex()) {
            continue;
        }
        same_ms += 1;
        assert_ne!(format!("{a:?}"), format!("{b:?}"));
        assert_ne!(a.to_hex()[..16], b.to_hex()[..16]);
    }
    assert!(same_ms > 0, "no two tokens made in the same millisecond");
}

#[test]
fn error_display_names_cause() {
    let e = BackendError::timeout(Duration::from_millis(200));
    assert!(e.is_timeout());
    assert!(!BackendError::new("custom").is_timeout());
    assert!(e.to_string().contains("200 ms"));
}

#[test]
fn a_token_carries_its_issue_time_and_a_holder_token_tells_its_time_left() {
    let before = issued::now_ms();
    let token = Token::generate();
    let after = issued::now_ms();
    let hex = token.to_hex();
    let at = issued::issued_ms(&hex).expect("a token of this format");
    assert!(
        (before..=after).contains(&at),
        "{before} <= {at} <= {after}"
    );
    // Held 1 s of a 3 s TTL: 2 s left.
    assert_eq!(issued::time_left(&hex, 3_000, at + 1_000), Some(2_000));
    // A holder's clock a little ahead of ours: just issued.
    assert_eq!(issued::time_left(&hex, 3_000, at - 500), Some(3_000));
    // Older than its TTL (renewed), or clocks a lease apart: unknown.
    assert_eq!(issued::time_left(&hex, 3_000, at + 3_000), None);
    assert_eq!(issued::time_left(&hex, 3_000, at - 3_000), None);
}

#[test]
fn a_holder_value_not_of_this_format_has_no_time_left() {
    let now = issued::now_ms();
    let ours = Token::generate().to_hex();
    let mut upper = ours;
    upper[20..32].make_ascii_uppercase();
    upper[31] = b'A';
    for value in [
        &b""[..],
        b"someone-else",
        &ours[..31],
        &[ours.as_slice(), b"0"].concat(),
        &upper,
        // An older instance's token: 16 random bytes, whose last 6 read
        // as a time thousands of years away.
        b"f3a1c09b7d2e4c55a0b1c2d3e4f50617",
        // Not hex.
        b"zz000000000000000000000000000000",
    ] {
        assert_eq!(
            issued::time_left(value, 70_000, now),
            None,
            "{:?}",
            String::from_utf8_lossy(value)
        );
    }
}
