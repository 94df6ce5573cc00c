use super::*;

const TTL: Duration = Duration::from_secs(5);

#[test]
fn exclusive_reentrant_and_owner_only_release() {
    let b = MemoryBackend::new();
    let key = Bytes::from_static(b"k");
    let (a, other) = (Token::generate(), Token::generate());
    assert_eq!(b.try_acquire(&key, &a, TTL), Acquire::acquired(None));
    // Re-sent acquire with our own token: still ours.
    assert_eq!(b.try_acquire(&key, &a, TTL), Acquire::acquired(None));
    match b.try_acquire(&key, &other, TTL) {
        Acquire::Held {
            retry_after: Some(d),
        } => assert!(d <= TTL && d > Duration::from_secs(4)),
        x => panic!("expected held, got {x:?}"),
    }
    assert!(!b.try_release(&key, &other), "a stranger cannot release");
    assert!(b.is_held(&key));
    assert!(b.try_release(&key, &a));
    assert!(!b.is_held(&key));
    assert!(b.is_empty());
}

#[test]
fn expiry_frees_the_key() {
    let b = MemoryBackend::new();
    let key = Bytes::from_static(b"k");
    let (a, other) = (Token::generate(), Token::generate());
    b.try_acquire(&key, &a, Duration::ZERO);
    assert_eq!(b.try_acquire(&key, &other, TTL), Acquire::acquired(None));
    assert!(!b.try_extend(&key, &a, TTL), "expired owner cannot extend");
    assert!(b.try_extend(&key, &other, TTL));
}

#[test]
fn fences_only_grow_and_survive_release() {
    let b = MemoryBackend::new();
    let key = Bytes::from_static(b"k");
    let (a, other) = (Token::generate(), Token::generate());
    let fence = |x| match x {
        Acquire::Acquired { fence: Some(f), .. } => f,
        other => panic!("expected a fenced acquire, got {other:?}"),
    };
    let first = fence(b.try_acquire_fenced(&key, &a, TTL));
    // Re-sent acquire: the same fence, not a new one.
    assert_eq!(fence(b.try_acquire_fenced(&key, &a, TTL)), first);
    assert!(b.try_release(&key, &a));
    let second = fence(b.try_acquire_fenced(&key, &other, TTL));
    assert!(second > first, "{second} after {first}");
    // Expired and taken over: still growing.
    b.try_acquire_fenced(&key, &other, Duration::ZERO);
    let third = fence(b.try_acquire_fenced(&key, &a, TTL));
    assert!(third > second, "{third} after {second}");
    // Faster than the clock's µs: the counter, not the clock, decides.
    let mut last = third;
    for i in 0..100_000 {
        let k = Bytes::from(format!("k{}", i % 7));
        let f = fence(b.try_acquire_fenced(&k, &Token::generate(), Duration::ZERO));
        assert!(f > last, "{f} after {last}");
        last = f;
    }
    // A new backend (a restarted process) starts above the old one's
    // fences: they are at least the system clock in µs.
    let restarted = MemoryBackend::new();
    let f = fence(restarted.try_acquire_fenced(&key, &a, TTL));
    let now_us = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    assert!(
        f >= first && f <= now_us,
        "{f}: first {first}, now {now_us}"
    );
    assert!(f > first, "{f} after {first}");
}

#[test]
fn sweep_bounds_memory() {
    let b = MemoryBackend::new();
    let t = Token::generate();
    for i in 0..(SHARDS * SWEEP_EVERY * 3) {
        let key = Bytes::from(format!("k{i}"));
        b.try_acquire(&key, &t, Duration::ZERO);
    }
    // Every shard swept at least once after passing the threshold.
    assert!(b.len() <= SHARDS * SWEEP_EVERY * 2, "len {}", b.len());
}

#[test]
fn fence_state_is_bounded_by_live_leases() {
    let b = MemoryBackend::new();
    let t = Token::generate();
    let n = SHARDS * SWEEP_EVERY * 3;
    for i in 0..n {
        let key = Bytes::from(format!("k{i}"));
        b.try_acquire_fenced(&key, &t, TTL);
        assert!(b.try_release(&key, &t));
    }
    // Released leases leave nothing behind, fences included (`len`
    // counts every entry a key has).
    assert_eq!(b.len(), 0);
    // Expired ones go with the sweep.
    for i in 0..n {
        b.try_acquire_fenced(&Bytes::from(format!("e{i}")), &t, Duration::ZERO);
    }
    assert!(b.len() <= SHARDS * SWEEP_EVERY * 2, "{} entries", b.len());
}

#[test]
fn a_fence_after_expiry_and_sweep_is_larger_than_every_earlier_one() {
    let b = MemoryBackend::new();
    let key = Bytes::from_static(b"k");
    let t = Token::generate();
    let fence = |x| match x {
        Acquire::Acquired { fence: Some(f), .. } => f,
        other => panic!("expected a fenced acquire, got {other:?}"),
    };
    let mut seen = vec![fence(b.try_acquire_fenced(&key, &t, Duration::ZERO))];
    seen.push(fence(b.try_acquire_fenced(
        &key,
        &Token::generate(),
        Duration::ZERO,
    )));
    // Enough other writes that every shard is swept, the expired lease
    // (and whatever the backend kept for its key) with it.
    for i in 0..(SHARDS * SWEEP_EVERY * 3) {
        let other = Bytes::from(format!("other{i}"));
        b.try_acquire_fenced(&other, &t, Duration::ZERO);
    }
    let after = fence(b.try_acquire_fenced(&key, &Token::generate(), TTL));
    assert!(seen.iter().all(|&f| after > f), "{after} after {seen:?}");
}

/// Called directly (the layers lower every duration to ten years), the
/// store takes `Duration::MAX` as "for ever", not an overflow panic.
#[test]
fn the_longest_ttl_is_taken_without_a_panic() {
    let b = MemoryBackend::new();
    let key = Bytes::from_static(b"k");
    let a = Token::generate();
    assert_eq!(
        b.try_acquire(&key, &a, Duration::MAX),
        Acquire::acquired(None)
    );
    assert!(b.try_extend(&key, &a, Duration::MAX));
    assert!(b.is_held(&key));
}
