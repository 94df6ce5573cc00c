//! The [`LockBackend`] checks: acquire, release, extend, expiry, fences,
//! drain.

use std::time::Duration;

use bytes::Bytes;

use super::fresh::{answered, fresh_lease_key};
use crate::backend::{Acquire, LockBackend, Token};

/// A lease no check outlives.
const TTL: Duration = Duration::from_secs(10);
/// A lease the expiry check waits out.
const SHORT: Duration = Duration::from_millis(200);
/// How long an expired lease may still look held (a store's clock
/// resolution, a round trip), and how long a drain may take.
const PATIENCE: Duration = Duration::from_secs(5);

pub(super) async fn run<B: LockBackend + ?Sized>(store: &B) {
    assert!(
        !store.name().is_empty(),
        "LockBackend::name: a short name for logs, not an empty string"
    );
    acquire_is_exclusive_and_resent_acquires_count_as_ours(store).await;
    release_acts_only_for_the_holder(store).await;
    a_release_takes_effect_when_dropped(store).await;
    extend_acts_only_for_the_holder(store).await;
    a_lease_expires_after_its_ttl_unless_extended(store).await;
    fences_only_grow(store).await;
    drain_answers_once_releases_are_delivered(store).await;
}

async fn acquire<B: LockBackend + ?Sized>(
    store: &B,
    key: &Bytes,
    token: &Token,
    ttl: Duration,
) -> Acquire {
    answered("LockBackend::acquire", store.acquire(key, token, ttl).await)
}

async fn release<B: LockBackend + ?Sized>(store: &B, key: &Bytes, token: &Token) -> bool {
    answered("LockBackend::release", store.release(key, token).await)
}

async fn extend<B: LockBackend + ?Sized>(
    store: &B,
    key: &Bytes,
    token: &Token,
    ttl: Duration,
) -> bool {
    answered("LockBackend::extend", store.extend(key, token, ttl).await)
}

/// Panics unless `got` took the lease, with a validity within `ttl`.
fn assert_acquired(got: Acquire, ttl: Duration, rule: &str) {
    match got {
        Acquire::Acquired { validity, .. } => {
            if let Some(v) = validity {
                assert!(
                    !v.is_zero() && v <= ttl,
                    "LockBackend::acquire: a lease's validity is within its TTL \
                     ({ttl:?}), got {v:?}"
                );
            }
        }
        other => panic!("LockBackend::acquire: {rule}, got {other:?}"),
    }
}

/// Panics unless `got` is `Held`, with a `retry_after` within `ttl`.
fn assert_held(got: Acquire, ttl: Duration, rule: &str) {
    match got {
        Acquire::Held { retry_after } => {
            if let Some(left) = retry_after {
                assert!(
                    left <= ttl,
                    "LockBackend::acquire: `Held::retry_after` is the holder's time \
                     left, within its TTL ({ttl:?}), got {left:?}"
                );
            }
        }
        other => panic!("LockBackend::acquire: {rule}, got {other:?}"),
    }
}

/// Exclusive per key; a re-sent acquire with the holder's token is ours.
async fn acquire_is_exclusive_and_resent_acquires_count_as_ours<B: LockBackend + ?Sized>(
    store: &B,
) {
    let key = fresh_lease_key("acquire");
    let (a, b) = (Token::generate(), Token::generate());
    assert_acquired(
        acquire(store, &key, &a, TTL).await,
        TTL,
        "a free key is acquired",
    );
    assert_acquired(
        acquire(store, &key, &a, TTL).await,
        TTL,
        "an acquire that finds the holder's own token counts as acquired \
         (a client re-sends the command after a lost reply)",
    );
    assert_held(
        acquire(store, &key, &b, TTL).await,
        TTL,
        "another token is refused while the lease is held",
    );
    let other = fresh_lease_key("acquire-other-key");
    assert_acquired(
        acquire(store, &other, &b, TTL).await,
        TTL,
        "a lease on one key does not hold another key",
    );
    release(store, &key, &a).await;
    release(store, &other, &b).await;
}

/// Release: compare-and-delete.
async fn release_acts_only_for_the_holder<B: LockBackend + ?Sized>(store: &B) {
    let key = fresh_lease_key("release");
    let (a, b) = (Token::generate(), Token::generate());
    assert!(
        !release(store, &key, &a).await,
        "LockBackend::release: a key nobody holds is not released (expected false)"
    );
    assert_acquired(
        acquire(store, &key, &a, TTL).await,
        TTL,
        "a free key is acquired",
    );
    assert!(
        !release(store, &key, &b).await,
        "LockBackend::release: a token that does not hold the lease must not release it \
         (expected false)"
    );
    assert_held(
        acquire(store, &key, &b, TTL).await,
        TTL,
        "a lease survives a release with another token",
    );
    assert!(
        release(store, &key, &a).await,
        "LockBackend::release: the holder's token releases its lease (expected true)"
    );
    assert!(
        !release(store, &key, &a).await,
        "LockBackend::release: a lease already released is not released again \
         (expected false)"
    );
    assert_acquired(
        acquire(store, &key, &b, TTL).await,
        TTL,
        "a released key is free for the next token",
    );
    release(store, &key, &b).await;
}

/// A release takes effect even when its future is dropped unpolled: the
/// layer drops it at its deadline, or when its request goes away (a client
/// that disconnects while the response's release is on its way).
async fn a_release_takes_effect_when_dropped<B: LockBackend + ?Sized>(store: &B) {
    for notify in [false, true] {
        let key = fresh_lease_key("release-dropped");
        let (a, b) = (Token::generate(), Token::generate());
        assert_acquired(
            acquire(store, &key, &a, TTL).await,
            TTL,
            "a free key is acquired",
        );
        let method = if notify { "release_notify" } else { "release" };
        match notify {
            false => drop(store.release(&key, &a)),
            true => drop(store.release_notify(&key, &a)),
        }
        // Delivered in the background by a store that sends it: look until
        // it landed, bounded well below the lease.
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            match acquire(store, &key, &b, TTL).await {
                Acquire::Acquired { .. } => break,
                Acquire::Held { .. } if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(5)).await
                }
                other => panic!(
                    "LockBackend::{method}: it takes effect even when its future is dropped \
                     unpolled; {PATIENCE:?} later another token still gets {other:?}"
                ),
            }
        }
        release(store, &key, &b).await;
    }
}

/// Extend: compare-and-expire.
async fn extend_acts_only_for_the_holder<B: LockBackend + ?Sized>(store: &B) {
    let key = fresh_lease_key("extend");
    let (a, b) = (Token::generate(), Token::generate());
    assert!(
        !extend(store, &key, &a, TTL).await,
        "LockBackend::extend: a key nobody holds is not extended (expected false)"
    );
    assert_acquired(
        acquire(store, &key, &a, TTL).await,
        TTL,
        "a free key is acquired",
    );
    assert!(
        !extend(store, &key, &b, TTL).await,
        "LockBackend::extend: a token that does not hold the lease must not extend it \
         (expected false)"
    );
    assert!(
        extend(store, &key, &a, TTL).await,
        "LockBackend::extend: the holder's token extends its lease (expected true)"
    );
    assert_held(
        acquire(store, &key, &b, TTL).await,
        TTL,
        "an extended lease is still held",
    );
    assert!(
        release(store, &key, &a).await,
        "LockBackend::release: the holder's token releases its lease (expected true)"
    );
    assert!(
        !extend(store, &key, &a, TTL).await,
        "LockBackend::extend: a released lease is not extended (expected false)"
    );
}

/// A lease ends after its TTL, and `extend` moves that end.
async fn a_lease_expires_after_its_ttl_unless_extended<B: LockBackend + ?Sized>(store: &B) {
    let (expiring, extended) = (
        fresh_lease_key("expiry"),
        fresh_lease_key("expiry-extended"),
    );
    let (a, b) = (Token::generate(), Token::generate());
    assert_acquired(
        acquire(store, &expiring, &a, SHORT).await,
        SHORT,
        "a free key is acquired",
    );
    assert_acquired(
        acquire(store, &extended, &a, SHORT).await,
        SHORT,
        "a free key is acquired",
    );
    assert!(
        extend(store, &extended, &a, TTL).await,
        "LockBackend::extend: the holder's token extends its lease (expected true)"
    );
    tokio::time::sleep(SHORT).await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        match acquire(store, &expiring, &b, TTL).await {
            Acquire::Acquired { .. } => break,
            Acquire::Held { .. } if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            other => panic!(
                "LockBackend::acquire: a lease ends when its TTL ({SHORT:?}) has passed; \
                 {PATIENCE:?} after it, another token still gets {other:?}"
            ),
        }
    }
    assert!(
        !extend(store, &expiring, &a, TTL).await,
        "LockBackend::extend: an expired lease, now another token's, is not extended \
         (expected false)"
    );
    assert!(
        !release(store, &expiring, &a).await,
        "LockBackend::release: an expired lease, now another token's, is not released \
         (expected false)"
    );
    assert_held(
        acquire(store, &extended, &b, TTL).await,
        TTL,
        "`extend` sets the lease's expiry to the new TTL from now: a lease extended to \
         10 s is still held after its first TTL of 200 ms",
    );
    release(store, &expiring, &b).await;
    release(store, &extended, &a).await;
}

/// The fence of a lease, or a panic naming the rule.
fn fence_of(got: Acquire, rule: &str) -> Option<u64> {
    match got {
        Acquire::Acquired { fence, .. } => fence,
        other => panic!("LockBackend::acquire_fenced: {rule}, got {other:?}"),
    }
}

/// Fences: none at all, or one per lease that only grows.
async fn fences_only_grow<B: LockBackend + ?Sized>(store: &B) {
    let key = fresh_lease_key("fence");
    let (a, b) = (Token::generate(), Token::generate());
    let fenced = |token: Token| {
        let key = &key;
        async move {
            answered(
                "LockBackend::acquire_fenced",
                store.acquire_fenced(key, &token, TTL).await,
            )
        }
    };
    let first = fence_of(fenced(a).await, "a free key is acquired");
    let resent = fence_of(
        fenced(a).await,
        "an acquire that finds the holder's own token counts as acquired",
    );
    assert_eq!(
        resent, first,
        "LockBackend::acquire_fenced: a re-sent acquire gets the fence it already had"
    );
    assert_held(
        acquire(store, &key, &b, TTL).await,
        TTL,
        "a lease taken with `acquire_fenced` is held like any other",
    );
    assert!(
        release(store, &key, &a).await,
        "LockBackend::release: the holder's token releases its lease (expected true)"
    );
    let next = fence_of(fenced(b).await, "a released key is free for the next token");
    match (first, next) {
        (None, None) => {}
        (Some(first), Some(next)) => assert!(
            next > first,
            "LockBackend::acquire_fenced: the next lease on a key gets a larger fence \
             than every earlier one, got {next} after {first}"
        ),
        (first, next) => panic!(
            "LockBackend::acquire_fenced: a store fences every lease or none, got \
             {first:?} and then {next:?}"
        ),
    }
    release(store, &key, &b).await;
}

/// Drain: every release above has been answered.
async fn drain_answers_once_releases_are_delivered<B: LockBackend + ?Sized>(store: &B) {
    if let Err(e) = store.drain(PATIENCE).await {
        panic!(
            "LockBackend::drain: once every release was answered there is nothing to wait \
             for, got an error after {PATIENCE:?}: {e}"
        );
    }
}
