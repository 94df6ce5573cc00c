//! A lease key's value as a refused acquire reads it back (`SET … NX PX …
//! GET` returns the holder's value: anything anyone who can write the key
//! put there, or an older instance's random token): never panics, never
//! tells more time left than the TTL, tells some only for 32 lowercase hex
//! digits, and tells a token stamped by this crate its true time left.
//!
//! The decoder is crate-private, so this target compiles its source file on
//! its own, by path (standard library only).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../src/backend/contract/issued.rs"]
#[allow(dead_code)]
mod issued;

fuzz_target!(|input: (u32, u64, u64, &[u8])| {
    let (ttl_ms, now_ms, age_ms, value) = input;
    let ttl_ms = u64::from(ttl_ms);
    // Arbitrary bytes as the holder's value.
    if let Some(left) = issued::time_left(value, ttl_ms, now_ms) {
        assert!(left <= ttl_ms, "{left} ms left of a {ttl_ms} ms TTL");
        assert_eq!(value.len(), 32);
        assert!(value
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b)));
    }
    // A token this crate stamped `age_ms` ago (a 48-bit clock).
    let now = now_ms & ((1 << 48) - 1);
    let issued_at = now.saturating_sub(age_ms);
    let mut token = [0u8; 16];
    issued::stamp(&mut token, issued_at);
    let hex: Vec<u8> = token
        .iter()
        .flat_map(|b| [b >> 4, b & 0x0f])
        .map(|d| b"0123456789abcdef"[usize::from(d)])
        .collect();
    assert_eq!(issued::issued_ms(&hex), Some(issued_at));
    let age = now - issued_at;
    let want = (age < ttl_ms).then(|| ttl_ms - age);
    assert_eq!(issued::time_left(&hex, ttl_ms, now), want);
});
