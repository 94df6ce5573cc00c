//! Header values as key parts (`Header`, `Header::trusted_identity`; an
//! `Idempotency-Key` as a lock layer keys it, through `Header`, raw: the
//! idempotency layer parses it with its own parser, `idempotency_key`): any
//! bytes the `http` crate accepts derive a key without panicking, two
//! different values never share a key, and the encoding is unambiguous when
//! the same bytes are split differently across two parts.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tower_redis_lock::key::{Header, KeySpace, LockKey};
use tower_redis_lock::lock::Locker;
use tower_redis_lock::{MemoryBackend, RedisLockLayer};

fn locker() -> &'static Locker {
    static LOCKER: OnceLock<Locker> = OnceLock::new();
    LOCKER.get_or_init(|| {
        RedisLockLayer::new(
            MemoryBackend::new(),
            (
                Header::new("idempotency-key"),
                Header::trusted_identity("x-user-id"),
            ),
        )
        .key_space(KeySpace::default().secret(b"fuzz -----------"))
        .locker()
    })
}

fn key(a: &[u8], b: &[u8]) -> Option<LockKey> {
    let a = http::HeaderValue::from_bytes(a).ok()?;
    let b = http::HeaderValue::from_bytes(b).ok()?;
    let request = http::Request::post("/")
        .header("idempotency-key", a)
        .header("x-user-id", b)
        .body(())
        .ok()?;
    locker().key_for(&request.into_parts().0).ok()
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    // First byte: where to split the rest into (idempotency key, user).
    let split = usize::from(data[0]) % data.len().max(1);
    let rest = &data[1..];
    let split = split.min(rest.len());
    let (a, b) = rest.split_at(split);
    let Some(k1) = key(a, b) else { return };
    assert_eq!(key(a, b), Some(k1), "deterministic");
    // Move one byte across the boundary: must be another key.
    if let Some((&first, tail)) = b.split_first() {
        let mut a2 = a.to_vec();
        a2.push(first);
        if let Some(k2) = key(&a2, tail) {
            assert_ne!(k1, k2, "split point must matter");
        }
    }
    // Raw parts through key_with: ("ab","c") != ("a","bc") for these bytes.
    if !a.is_empty() {
        let x = locker().key_with(|w| {
            w.push("v", a);
            w.push("v", b);
        });
        let y = locker().key_with(|w| {
            w.push("v", &a[..a.len() - 1]);
            let mut moved = a[a.len() - 1..].to_vec();
            moved.extend_from_slice(b);
            w.push("v", &moved);
        });
        assert_ne!(x, y);
    }
});
