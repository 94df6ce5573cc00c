//! Unit tests of the idempotency table: claims, records, limits, quotas and
//! the bounded sweep, on paused time.

use super::*;
use crate::idempotency::record::{NotStoredReason, Record};

const LEASE: Duration = Duration::from_secs(5);
const HOUR: Duration = Duration::from_secs(3600);
const ROOMY: Quota = Quota {
    entries: u64::MAX,
    bytes: u64::MAX,
};

fn done() -> Bytes {
    Record::NotStored {
        status: http::StatusCode::OK,
        reason: NotStoredReason::Streaming,
    }
    .encode()
}

/// Entry `i` of scope `scope`.
fn key_in(scope: usize, i: usize) -> EntryKey {
    let s = Bytes::from(format!("trl:{{{scope:032x}}}"));
    let member = Bytes::from(format!("{i:032x}"));
    EntryKey {
        entry: Bytes::from(format!("trl:{{{scope:032x}}}:{i:032x}:idem")),
        scope: s,
        member,
    }
}

fn key(i: usize) -> EntryKey {
    key_in(0, i)
}

#[test]
fn claim_conflict_mismatch_done() {
    let t = IdempotencyTable::default();
    let key = key(1);
    let (a, b) = (Token::generate(), Token::generate());
    assert_eq!(t.claim(&key, &a, b"fp", LEASE, ROOMY), Ok(Claim::Claimed));
    assert_eq!(
        t.claim(&key, &a, b"fp", LEASE, ROOMY),
        Ok(Claim::Claimed),
        "re-sent"
    );
    assert!(matches!(
        t.claim(&key, &b, b"fp", LEASE, ROOMY),
        Ok(Claim::InFlight { retry_after: Some(d) }) if d <= LEASE
    ));
    assert_eq!(
        t.claim(&key, &b, b"other", LEASE, ROOMY),
        Ok(Claim::Mismatch)
    );
    assert!(
        !t.complete(&key, &b, b"fp", &done(), LEASE),
        "not b's claim"
    );
    assert!(t.complete(&key, &a, b"fp", &done(), LEASE));
    assert!(
        t.complete(&key, &a, b"fp", &done(), LEASE),
        "re-sent completion"
    );
    assert_eq!(
        t.claim(&key, &b, b"fp", LEASE, ROOMY),
        Ok(Claim::Done(done()))
    );
    assert!(!t.abandon(&key, &a), "a done record is not abandoned");
}

#[test]
fn abandon_and_expiry_free_the_key() {
    let t = IdempotencyTable::default();
    let key = key(1);
    let (a, b) = (Token::generate(), Token::generate());
    t.claim(&key, &a, b"fp", LEASE, ROOMY).unwrap();
    assert!(!t.abandon(&key, &b));
    assert!(t.abandon(&key, &a));
    assert_eq!(
        t.claim(&key, &b, b"other", Duration::ZERO, ROOMY),
        Ok(Claim::Claimed)
    );
    // b's claim expired at once: a new claim with any fingerprint wins.
    assert_eq!(t.claim(&key, &a, b"fp", LEASE, ROOMY), Ok(Claim::Claimed));
    assert!(!t.complete(&key, &b, b"fp", &done(), LEASE));
    assert_eq!(t.len(), 1);
    let t = t.lock();
    assert_eq!(t.scopes.len(), 1);
    assert_eq!(
        t.scopes[&key.scope].expiries.len(),
        1,
        "the scope counts one entry"
    );
}

/// What the table holds for `key`: `None`, a claim (`Some(false)`)
/// or a record (`Some(true)`), without touching it.
fn state(t: &IdempotencyTable, k: &EntryKey) -> Option<bool> {
    t.lock().get(&k.entry).map(|e| e.record.is_some())
}

/// A full store removes expired entries to make room, and nothing
/// else: with only live entries left, a new claim is refused and every
/// record stays, whoever made it.
#[tokio::test(start_paused = true)]
async fn a_full_store_refuses_new_claims_and_never_evicts_a_live_record() {
    let t = IdempotencyTable::default();
    t.set_limits(Some(4), None);
    let tok = Token::generate();
    let claim = |i| t.claim(&key_in(i, i), &tok, b"fp", LEASE, ROOMY);
    let complete = |i, retention| {
        assert!(t.complete(&key_in(i, i), &tok, b"fp", &done(), retention));
    };
    for i in 0..3 {
        claim(i).unwrap();
        complete(i, HOUR);
    }
    claim(3).unwrap();
    complete(3, Duration::from_secs(1));
    // Two seconds later, 3 has expired: it makes room, the others stay.
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(claim(4), Ok(Claim::Claimed));
    assert_eq!(
        (0..5).map(|i| state(&t, &key_in(i, i))).collect::<Vec<_>>(),
        [Some(true), Some(true), Some(true), None, Some(false)]
    );
    // Full of live entries: refused, and nothing is evicted.
    assert_eq!(
        claim(5),
        Err(Full {
            entry_limit: 4,
            byte_limit: DEFAULT_BYTE_LIMIT
        })
    );
    assert_eq!(t.len(), 4);
    for i in 0..3 {
        assert_eq!(
            t.claim(&key_in(i, i), &Token::generate(), b"fp", LEASE, ROOMY),
            Ok(Claim::Done(done())),
            "record {i} is still replayed"
        );
    }
    // An expired claim makes room too.
    tokio::time::advance(LEASE + Duration::from_secs(1)).await;
    assert_eq!(claim(5), Ok(Claim::Claimed));
}

/// One scope's flood is refused at its quota (entries, then bytes),
/// with the time until its oldest entry expires; another scope is not
/// affected, and the flood's expired entries free its places.
#[tokio::test(start_paused = true)]
async fn a_scope_is_held_to_its_quota_and_never_displaces_another() {
    let t = IdempotencyTable::default();
    let second = || tokio::time::advance(Duration::from_secs(1));
    let tok = Token::generate();
    let quota = Quota {
        entries: 3,
        bytes: u64::MAX,
    };
    // Scope 9's record, kept an hour.
    t.claim(&key_in(9, 0), &tok, b"fp", LEASE, quota).unwrap();
    assert!(t.complete(&key_in(9, 0), &tok, b"fp", &done(), HOUR));
    // Scope 1 floods: three places (at 0, 1 and 2 s), then 429 until its
    // oldest expires.
    for i in 0..3 {
        if i > 0 {
            second().await;
        }
        assert_eq!(
            t.claim(&key_in(1, i), &tok, b"fp", LEASE, quota),
            Ok(Claim::Claimed)
        );
    }
    second().await;
    assert_eq!(
        t.claim(&key_in(1, 3), &tok, b"fp", LEASE, quota),
        Ok(Claim::OverQuota {
            retry_after: Duration::from_secs(2)
        }),
        "the first claim (at 0 s, lease 5 s) frees a place at 5 s"
    );
    assert_eq!(
        t.claim(&key_in(9, 0), &Token::generate(), b"fp", LEASE, quota),
        Ok(Claim::Done(done())),
        "the other scope's record is untouched"
    );
    assert_eq!(
        t.claim(&key_in(2, 0), &tok, b"fp", LEASE, quota),
        Ok(Claim::Claimed),
        "another scope still claims"
    );
    // Past the first claim's lease (at 6 s), the flood gets one place
    // back.
    tokio::time::advance(Duration::from_secs(3)).await;
    assert_eq!(
        t.claim(&key_in(1, 3), &tok, b"fp", LEASE, quota),
        Ok(Claim::Claimed)
    );
    // Bytes: a scope whose records hold its byte share is refused too.
    let quota = Quota {
        entries: 100,
        bytes: 2 * entry_size(key_in(5, 0).entry.len(), 2, 1000) as u64,
    };
    let big = Bytes::from(vec![b'x'; 1000]);
    for i in 0..2 {
        t.claim(&key_in(5, i), &tok, b"fp", LEASE, quota).unwrap();
        assert!(t.complete(&key_in(5, i), &tok, b"fp", &big, HOUR));
    }
    assert!(matches!(
        t.claim(&key_in(5, 2), &tok, b"fp", LEASE, quota),
        Ok(Claim::OverQuota { retry_after }) if retry_after == HOUR
    ));
}

/// Expired entries are swept a bounded number per write, from the
/// front of the time-ordered indexes: a backlog drains as writes go on,
/// and no write removes more than its batch.
#[tokio::test(start_paused = true)]
async fn sweep_is_bounded_per_write_and_drains_a_backlog() {
    let t = IdempotencyTable::default();
    let tok = Token::generate();
    let n = 1000;
    let second = Duration::from_secs(1);
    for i in 0..n {
        t.claim(&key_in(i, i), &tok, b"fp", second, ROOMY).unwrap();
    }
    for i in 0..n / 2 {
        assert!(t.complete(&key_in(i, i), &tok, b"fp", &done(), second));
    }
    assert_eq!(t.len(), n);
    // All expired now: each write removes at most a batch from each index.
    tokio::time::advance(2 * second).await;
    t.claim(&key_in(n, n), &tok, b"fp", LEASE, ROOMY).unwrap();
    assert_eq!(t.len(), n + 1 - 2 * SWEEP_BATCH);
    let mut writes = 1;
    while t.len() > 1 {
        // A re-sent claim of our own: a write that adds nothing.
        t.claim(&key_in(n, n), &tok, b"fp", LEASE, ROOMY).unwrap();
        writes += 1;
        assert!(writes <= n, "the backlog does not drain");
    }
    assert_eq!(writes, n.div_ceil(2 * SWEEP_BATCH));
    let t = t.lock();
    assert_eq!(t.bytes, entry_size(key_in(n, n).entry.len(), 2, 0));
    assert_eq!((t.claims.len(), t.records.len(), t.scopes.len()), (1, 0, 1));
}

/// Called directly (the layers lower every duration to ten years), the
/// table takes `Duration::MAX` as "for ever", not an overflow panic.
#[test]
fn the_longest_lease_and_retention_are_taken_without_a_panic() {
    let t = IdempotencyTable::default();
    let (k1, k2) = (key(1), key(2));
    let a = Token::generate();
    assert_eq!(
        t.claim(&k1, &a, b"fp", Duration::MAX, ROOMY),
        Ok(Claim::Claimed)
    );
    assert!(t.extend(&k1, &a, Duration::MAX));
    assert!(t.complete(&k1, &a, b"fp", &done(), Duration::MAX));
    assert_eq!(
        t.claim(&k1, &a, b"fp", LEASE, ROOMY),
        Ok(Claim::Done(done()))
    );
    assert_eq!(t.claim(&k2, &a, b"fp", LEASE, ROOMY), Ok(Claim::Claimed));
}

/// A claim that lapsed while its handler ran, with nothing in its place:
/// the record is kept all the same, under the claim's fingerprint; one in
/// another's place is not.
#[tokio::test(start_paused = true)]
async fn a_lapsed_claim_with_nothing_in_its_place_keeps_its_record() {
    let t = IdempotencyTable::default();
    let (k1, k2) = (key(1), key(2));
    let (a, b) = (Token::generate(), Token::generate());
    assert_eq!(t.claim(&k1, &a, b"fp", LEASE, ROOMY), Ok(Claim::Claimed));
    assert_eq!(t.claim(&k2, &a, b"fp", LEASE, ROOMY), Ok(Claim::Claimed));
    tokio::time::advance(LEASE + Duration::from_secs(1)).await;
    // k2's lapsed claim is taken by another request.
    assert_eq!(t.claim(&k2, &b, b"fp", LEASE, ROOMY), Ok(Claim::Claimed));
    assert!(t.complete(&k1, &a, b"fp", &done(), HOUR), "kept");
    assert!(
        !t.complete(&k2, &a, b"fp", &done(), HOUR),
        "another's claim"
    );
    assert_eq!(
        t.claim(&k1, &b, b"fp", LEASE, ROOMY),
        Ok(Claim::Done(done()))
    );
    assert_eq!(
        t.claim(&k1, &b, b"other", LEASE, ROOMY),
        Ok(Claim::Mismatch)
    );
}
