//! The tests every [`ReplayBackend`] passes: the contract of its docs, one
//! method at a time, through the trait alone. [`every_store_check`] runs
//! them all on a store (each on keys of its own, so one store serves them
//! all); a store whose commands can be re-sent after the request gave up
//! (Redis) also passes [`abandon_before_claim_leaves_a_tombstone`].
//!
//! Run here against [`MemoryBackend`](crate::MemoryBackend) and a real
//! `redis-server`, and against a real PostgreSQL database in
//! `postgres/tests.rs`; a new store adds one test that calls them.

use std::time::Duration;

use bytes::Bytes;

use super::{Claim, EntryKey, ReplayBackend};
use crate::backend::Token;
use crate::key::KeySpace;

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(60);
/// A share no check reaches.
const ROOMY: (u64, u64) = (1_000, 1 << 30);

/// A fresh entry in a fresh scope (random, so runs never meet).
fn fresh(check: &str) -> EntryKey {
    let scope = fresh_scope(check);
    entry_in(&scope, "entry")
}

fn fresh_scope(check: &str) -> crate::key::LockKey {
    let mut w = KeySpace::default().writer();
    w.push("check", check.as_bytes());
    w.push("run", Token::generate().as_bytes());
    w.finish()
}

fn entry_in(scope: &crate::key::LockKey, name: &str) -> EntryKey {
    let mut w = KeySpace::default().writer();
    w.push("entry", name.as_bytes());
    EntryKey::new(&KeySpace::default(), scope, &w.finish())
}

async fn claim(store: &dyn ReplayBackend, key: &EntryKey, token: &Token, fp: &[u8]) -> Claim {
    store
        .claim(key, token, fp, LEASE, ROOMY.0, ROOMY.1)
        .await
        .expect("claim answered")
}

/// Every check below, on `store`.
pub(crate) async fn every_store_check(store: &dyn ReplayBackend) {
    a_claim_is_taken_once_and_resent_claims_count_as_ours(store).await;
    a_completed_entry_answers_with_its_record(store).await;
    extend_acts_only_on_our_live_claim(store).await;
    abandon_frees_only_our_claim(store).await;
    abandon_takes_effect_when_dropped_unpolled(store).await;
    a_scope_is_held_to_its_entries_and_bytes(store).await;
}

/// Claim, re-sent claim, in flight, mismatch.
pub(crate) async fn a_claim_is_taken_once_and_resent_claims_count_as_ours(
    store: &dyn ReplayBackend,
) {
    let key = fresh("claim");
    let (a, b) = (Token::generate(), Token::generate());
    assert_eq!(claim(store, &key, &a, b"fp").await, Claim::Claimed);
    assert_eq!(
        claim(store, &key, &a, b"fp").await,
        Claim::Claimed,
        "a re-sent claim finds our own token"
    );
    match claim(store, &key, &b, b"fp").await {
        Claim::InFlight {
            retry_after: Some(left),
        } => assert!(left <= LEASE && !left.is_zero(), "time left {left:?}"),
        other => panic!("another token, same fingerprint: in flight, got {other:?}"),
    }
    assert_eq!(
        claim(store, &key, &b, b"other").await,
        Claim::Mismatch,
        "another fingerprint"
    );
}

/// Complete, re-sent complete, done, mismatch on done, not ours.
pub(crate) async fn a_completed_entry_answers_with_its_record(store: &dyn ReplayBackend) {
    let key = fresh("complete");
    let (a, b) = (Token::generate(), Token::generate());
    let record = Bytes::from_static(b"sealed record bytes");
    assert_eq!(claim(store, &key, &a, b"fp").await, Claim::Claimed);
    assert!(
        !store.complete(&key, &b, &record, RETENTION).await.unwrap(),
        "not b's claim: nothing stored"
    );
    assert!(store.complete(&key, &a, &record, RETENTION).await.unwrap());
    assert!(
        store.complete(&key, &a, &record, RETENTION).await.unwrap(),
        "a re-sent completion finds our own record"
    );
    assert_eq!(claim(store, &key, &b, b"fp").await, Claim::Done(record));
    assert_eq!(claim(store, &key, &b, b"other").await, Claim::Mismatch);
    assert!(
        !store.extend(&key, &a, LEASE).await.unwrap(),
        "a done entry is no claim to extend"
    );
    assert!(
        !store.abandon(&key, &a, LEASE).await.unwrap(),
        "a done entry is never abandoned"
    );
    assert!(matches!(
        claim(store, &key, &b, b"fp").await,
        Claim::Done(_)
    ));
}

/// Extend: ours and live only.
pub(crate) async fn extend_acts_only_on_our_live_claim(store: &dyn ReplayBackend) {
    let key = fresh("extend");
    let (a, b) = (Token::generate(), Token::generate());
    assert!(
        !store.extend(&key, &a, LEASE).await.unwrap(),
        "nothing to extend"
    );
    assert_eq!(claim(store, &key, &a, b"fp").await, Claim::Claimed);
    assert!(!store.extend(&key, &b, LEASE).await.unwrap(), "not b's");
    assert!(store.extend(&key, &a, LEASE).await.unwrap());
    assert!(matches!(
        claim(store, &key, &b, b"fp").await,
        Claim::InFlight { .. }
    ));
}

/// Abandon: only ours; the key is free after it.
pub(crate) async fn abandon_frees_only_our_claim(store: &dyn ReplayBackend) {
    let key = fresh("abandon");
    let (a, b) = (Token::generate(), Token::generate());
    assert_eq!(claim(store, &key, &a, b"fp").await, Claim::Claimed);
    assert!(!store.abandon(&key, &b, LEASE).await.unwrap(), "not b's");
    assert!(matches!(
        claim(store, &key, &b, b"fp").await,
        Claim::InFlight { .. }
    ));
    assert!(store.abandon(&key, &a, LEASE).await.unwrap());
    assert_eq!(
        claim(store, &key, &b, b"other").await,
        Claim::Claimed,
        "free again, whatever the fingerprint"
    );
}

/// Abandon takes effect even when its future is dropped unpolled.
pub(crate) async fn abandon_takes_effect_when_dropped_unpolled(store: &dyn ReplayBackend) {
    let key = fresh("abandon-unpolled");
    let (a, b) = (Token::generate(), Token::generate());
    assert_eq!(claim(store, &key, &a, b"fp").await, Claim::Claimed);
    drop(store.abandon(&key, &a, LEASE));
    // Delivered in the background by a store that sends it (Redis): look
    // until it landed, bounded well below the lease.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match claim(store, &key, &b, b"fp").await {
            Claim::Claimed => break,
            Claim::InFlight { .. } if tokio::time::Instant::now() < deadline => {
                tokio::task::yield_now().await
            }
            other => panic!("the dropped abandon never freed the key: {other:?}"),
        }
    }
}

/// A scope holds at most its entries, and no new claim once its records
/// hold its bytes; another scope is untouched.
pub(crate) async fn a_scope_is_held_to_its_entries_and_bytes(store: &dyn ReplayBackend) {
    let scope = fresh_scope("quota");
    let t = Token::generate();
    let claim_in = |name: &'static str, entries: u64, bytes: u64| {
        let key = entry_in(&scope, name);
        async move {
            store
                .claim(&key, &t, b"fp", LEASE, entries, bytes)
                .await
                .expect("claim answered")
        }
    };
    assert_eq!(claim_in("one", 2, 1 << 30).await, Claim::Claimed);
    assert_eq!(claim_in("two", 2, 1 << 30).await, Claim::Claimed);
    match claim_in("three", 2, 1 << 30).await {
        Claim::OverQuota { retry_after } => {
            assert!(
                !retry_after.is_zero() && retry_after <= LEASE,
                "when the oldest entry expires: {retry_after:?}"
            )
        }
        other => panic!("a third entry in a scope of two: over quota, got {other:?}"),
    }
    assert_eq!(
        claim_in("one", 2, 1 << 30).await,
        Claim::Claimed,
        "a re-sent claim of an entry it holds is not refused"
    );
    let other = fresh("quota-other");
    assert_eq!(
        store
            .claim(&other, &t, b"fp", LEASE, 2, 1 << 30)
            .await
            .unwrap(),
        Claim::Claimed,
        "another scope has its own share"
    );
    // Bytes: one record of 64 bytes fills a share of 1 byte.
    let done = entry_in(&scope, "one");
    assert!(store
        .complete(&done, &t, &Bytes::from(vec![b'r'; 64]), RETENTION)
        .await
        .unwrap());
    assert!(
        matches!(claim_in("four", 100, 1).await, Claim::OverQuota { .. }),
        "records over the byte share refuse new claims"
    );
    assert!(
        matches!(claim_in("one", 100, 1).await, Claim::Done(_)),
        "and still answer with what they hold"
    );
}

/// A claim that lands after its own request abandoned it (a re-sent
/// command) claims nothing, and leaves the key to the next request.
pub(crate) async fn abandon_before_claim_leaves_a_tombstone(store: &dyn ReplayBackend) {
    let key = fresh("tombstone");
    let (a, b) = (Token::generate(), Token::generate());
    assert!(
        !store.abandon(&key, &a, LEASE).await.unwrap(),
        "nothing there yet"
    );
    let late = store.claim(&key, &a, b"fp", LEASE, ROOMY.0, ROOMY.1).await;
    assert!(late.is_err(), "the late claim claims nothing: {late:?}");
    assert_eq!(
        claim(store, &key, &b, b"fp").await,
        Claim::Claimed,
        "the next request claims the key"
    );
}

#[cfg(test)]
mod tests;
