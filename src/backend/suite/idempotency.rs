//! The [`IdempotencyBackend`] checks: claim, complete, extend, abandon (also
//! dropped unpolled), the scope's quota, and the tombstone a late claim
//! obeys.

use std::time::Duration;

use bytes::Bytes;

use super::fresh::{answered, entry_in, fresh_digest};
use crate::backend::{Claim, ClaimTerms, EntryKey, IdempotencyBackend, Token};

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(60);
/// A share no check reaches.
const ROOMY: (u64, u64) = (1_000, 1 << 30);

pub(super) async fn run<B: IdempotencyBackend + ?Sized>(store: &B) {
    assert!(
        !store.name().is_empty(),
        "IdempotencyBackend::name: a short name for logs, not an empty string"
    );
    a_claim_is_taken_once_and_resent_claims_count_as_ours(store).await;
    a_completed_entry_answers_with_its_record(store).await;
    extend_acts_only_on_our_live_claim(store).await;
    abandon_frees_only_our_claim(store).await;
    abandon_takes_effect_when_dropped_unpolled(store).await;
    a_scope_is_held_to_its_entries_and_bytes(store).await;
}

/// A fresh entry in a fresh scope.
fn fresh(check: &str) -> EntryKey {
    entry_in(&fresh_digest(check), "entry")
}

async fn claim<B: IdempotencyBackend + ?Sized>(
    store: &B,
    key: &EntryKey,
    token: &Token,
    fp: &[u8],
) -> Claim {
    answered(
        "IdempotencyBackend::claim",
        store
            .claim(key, token, fp, &ClaimTerms::new(LEASE, ROOMY.0, ROOMY.1))
            .await,
    )
}

async fn complete<B: IdempotencyBackend + ?Sized>(
    store: &B,
    key: &EntryKey,
    token: &Token,
    record: &Bytes,
) -> bool {
    answered(
        "IdempotencyBackend::complete",
        store.complete(key, token, b"fp", record, RETENTION).await,
    )
}

async fn extend<B: IdempotencyBackend + ?Sized>(store: &B, key: &EntryKey, token: &Token) -> bool {
    answered(
        "IdempotencyBackend::extend",
        store.extend(key, token, LEASE).await,
    )
}

async fn abandon<B: IdempotencyBackend + ?Sized>(store: &B, key: &EntryKey, token: &Token) -> bool {
    answered(
        "IdempotencyBackend::abandon",
        store.abandon(key, token, LEASE).await,
    )
}

/// Claim, re-sent claim, in flight, mismatch.
async fn a_claim_is_taken_once_and_resent_claims_count_as_ours<B: IdempotencyBackend + ?Sized>(
    store: &B,
) {
    let key = fresh("claim");
    let (a, b) = (Token::generate(), Token::generate());
    assert_eq!(
        claim(store, &key, &a, b"fp").await,
        Claim::Claimed,
        "IdempotencyBackend::claim: a free key is claimed"
    );
    assert_eq!(
        claim(store, &key, &a, b"fp").await,
        Claim::Claimed,
        "IdempotencyBackend::claim: a claim that finds our own token counts as claimed \
         (a client re-sends the command after a lost reply)"
    );
    match claim(store, &key, &b, b"fp").await {
        Claim::InFlight {
            retry_after: Some(left),
        } => assert!(
            left <= LEASE && !left.is_zero(),
            "IdempotencyBackend::claim: `InFlight::retry_after` is the claim's time left, \
             within its lease ({LEASE:?}), got {left:?}"
        ),
        other => panic!(
            "IdempotencyBackend::claim: another token with the same fingerprint finds the \
             claim in flight, with its time left, got {other:?}"
        ),
    }
    assert_eq!(
        claim(store, &key, &b, b"other").await,
        Claim::Mismatch,
        "IdempotencyBackend::claim: another fingerprint on a claimed key is a mismatch"
    );
}

/// Complete, re-sent complete, done, mismatch on done, not ours.
async fn a_completed_entry_answers_with_its_record<B: IdempotencyBackend + ?Sized>(store: &B) {
    let key = fresh("complete");
    let (a, b) = (Token::generate(), Token::generate());
    let record = Bytes::from_static(b"sealed record bytes");
    assert_eq!(
        claim(store, &key, &a, b"fp").await,
        Claim::Claimed,
        "IdempotencyBackend::claim: a free key is claimed"
    );
    assert!(
        !complete(store, &key, &b, &record).await,
        "IdempotencyBackend::complete: another token's claim stores nothing (expected false)"
    );
    assert!(
        complete(store, &key, &a, &record).await,
        "IdempotencyBackend::complete: our claim turns into a done entry (expected true)"
    );
    assert!(
        complete(store, &key, &a, &record).await,
        "IdempotencyBackend::complete: a completion that finds our own record counts as done \
         (expected true)"
    );
    assert_eq!(
        claim(store, &key, &b, b"fp").await,
        Claim::Done(record),
        "IdempotencyBackend::claim: a done entry answers with its record, byte for byte"
    );
    assert_eq!(
        claim(store, &key, &b, b"other").await,
        Claim::Mismatch,
        "IdempotencyBackend::claim: another fingerprint on a done entry is a mismatch"
    );
    assert!(
        !extend(store, &key, &a).await,
        "IdempotencyBackend::extend: a done entry is no claim to extend (expected false)"
    );
    assert!(
        !abandon(store, &key, &a).await,
        "IdempotencyBackend::abandon: a done entry is never abandoned (expected false)"
    );
    let after = claim(store, &key, &b, b"fp").await;
    assert!(
        matches!(after, Claim::Done(_)),
        "IdempotencyBackend::claim: a done entry stays done after a refused extend and \
         abandon, got {after:?}"
    );
}

/// Extend: ours and live only.
async fn extend_acts_only_on_our_live_claim<B: IdempotencyBackend + ?Sized>(store: &B) {
    let key = fresh("extend");
    let (a, b) = (Token::generate(), Token::generate());
    assert!(
        !extend(store, &key, &a).await,
        "IdempotencyBackend::extend: nothing there, nothing to extend (expected false)"
    );
    assert_eq!(
        claim(store, &key, &a, b"fp").await,
        Claim::Claimed,
        "IdempotencyBackend::claim: a free key is claimed"
    );
    assert!(
        !extend(store, &key, &b).await,
        "IdempotencyBackend::extend: another token's claim is not extended (expected false)"
    );
    assert!(
        extend(store, &key, &a).await,
        "IdempotencyBackend::extend: our live claim is extended (expected true)"
    );
    let after = claim(store, &key, &b, b"fp").await;
    assert!(
        matches!(after, Claim::InFlight { .. }),
        "IdempotencyBackend::claim: an extended claim is still in flight, got {after:?}"
    );
}

/// Abandon: only ours; the key is free after it.
async fn abandon_frees_only_our_claim<B: IdempotencyBackend + ?Sized>(store: &B) {
    let key = fresh("abandon");
    let (a, b) = (Token::generate(), Token::generate());
    assert_eq!(
        claim(store, &key, &a, b"fp").await,
        Claim::Claimed,
        "IdempotencyBackend::claim: a free key is claimed"
    );
    assert!(
        !abandon(store, &key, &b).await,
        "IdempotencyBackend::abandon: another token's claim is not abandoned (expected false)"
    );
    let after = claim(store, &key, &b, b"fp").await;
    assert!(
        matches!(after, Claim::InFlight { .. }),
        "IdempotencyBackend::abandon: a claim survives an abandon with another token, got \
         {after:?}"
    );
    assert!(
        abandon(store, &key, &a).await,
        "IdempotencyBackend::abandon: our claim is deleted (expected true)"
    );
    assert_eq!(
        claim(store, &key, &b, b"other").await,
        Claim::Claimed,
        "IdempotencyBackend::abandon: an abandoned key is free again, whatever the fingerprint"
    );
}

/// Abandon takes effect even when its future is dropped unpolled.
async fn abandon_takes_effect_when_dropped_unpolled<B: IdempotencyBackend + ?Sized>(store: &B) {
    let key = fresh("abandon-unpolled");
    let (a, b) = (Token::generate(), Token::generate());
    assert_eq!(
        claim(store, &key, &a, b"fp").await,
        Claim::Claimed,
        "IdempotencyBackend::claim: a free key is claimed"
    );
    drop(store.abandon(&key, &a, LEASE));
    // Delivered in the background by a store that sends it (Redis): look
    // until it landed, bounded well below the lease.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match claim(store, &key, &b, b"fp").await {
            Claim::Claimed => break,
            Claim::InFlight { .. } if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await
            }
            other => panic!(
                "IdempotencyBackend::abandon: it takes effect even when its future is dropped \
                 unpolled; 5 s later the key still answers {other:?}"
            ),
        }
    }
}

/// A scope holds at most its entries, and no new claim once its records
/// hold its bytes; another scope is untouched.
async fn a_scope_is_held_to_its_entries_and_bytes<B: IdempotencyBackend + ?Sized>(store: &B) {
    let scope = fresh_digest("quota");
    let t = Token::generate();
    let claim_in = |name: &'static str, entries: u64, bytes: u64| {
        let key = entry_in(&scope, name);
        async move {
            answered(
                "IdempotencyBackend::claim",
                store
                    .claim(&key, &t, b"fp", &ClaimTerms::new(LEASE, entries, bytes))
                    .await,
            )
        }
    };
    assert_eq!(
        claim_in("one", 2, 1 << 30).await,
        Claim::Claimed,
        "IdempotencyBackend::claim: the first entry of a scope of two is claimed"
    );
    assert_eq!(
        claim_in("two", 2, 1 << 30).await,
        Claim::Claimed,
        "IdempotencyBackend::claim: the second entry of a scope of two is claimed"
    );
    match claim_in("three", 2, 1 << 30).await {
        Claim::OverQuota { retry_after } => assert!(
            !retry_after.is_zero() && retry_after <= LEASE,
            "IdempotencyBackend::claim: `OverQuota::retry_after` is when the scope's oldest \
             entry expires, within its lease ({LEASE:?}), got {retry_after:?}"
        ),
        other => panic!(
            "IdempotencyBackend::claim: a scope holding `max_entries` refuses a new entry with \
             `OverQuota` (and writes nothing), got {other:?}"
        ),
    }
    assert_eq!(
        claim_in("one", 2, 1 << 30).await,
        Claim::Claimed,
        "IdempotencyBackend::claim: a re-sent claim of an entry the scope holds is not refused \
         for room"
    );
    let other = fresh("quota-other");
    assert_eq!(
        answered(
            "IdempotencyBackend::claim",
            store
                .claim(&other, &t, b"fp", &ClaimTerms::new(LEASE, 2, 1 << 30))
                .await,
        ),
        Claim::Claimed,
        "IdempotencyBackend::claim: another scope has its own share"
    );
    // Bytes: one record of 64 bytes fills a share of 1 byte.
    let done = entry_in(&scope, "one");
    assert!(
        complete(store, &done, &t, &Bytes::from(vec![b'r'; 64])).await,
        "IdempotencyBackend::complete: our claim turns into a done entry, never refused for \
         room (expected true)"
    );
    let refused = claim_in("four", 100, 1).await;
    assert!(
        matches!(refused, Claim::OverQuota { .. }),
        "IdempotencyBackend::claim: a scope whose records hold `max_bytes` refuses new claims \
         with `OverQuota`, got {refused:?}"
    );
    let held = claim_in("one", 100, 1).await;
    assert!(
        matches!(held, Claim::Done(_)),
        "IdempotencyBackend::claim: a scope over its bytes still answers its done entries, \
         got {held:?}"
    );
}

/// A claim that lands after its own request abandoned it (a re-sent
/// command) claims nothing, and leaves the key to the next request.
pub(super) async fn abandon_before_claim_leaves_a_tombstone<B: IdempotencyBackend + ?Sized>(
    store: &B,
) {
    let key = fresh("tombstone");
    let (a, b) = (Token::generate(), Token::generate());
    assert!(
        !abandon(store, &key, &a).await,
        "IdempotencyBackend::abandon: nothing there yet, nothing abandoned (expected false)"
    );
    let late = store
        .claim(&key, &a, b"fp", &ClaimTerms::new(LEASE, ROOMY.0, ROOMY.1))
        .await;
    assert!(
        late.is_err(),
        "IdempotencyBackend::claim: a claim that finds the mark `abandon` left for its own \
         token claims nothing and is an error (a re-sent command landing after its \
         request gave up), got {late:?}"
    );
    assert_eq!(
        claim(store, &key, &b, b"fp").await,
        Claim::Claimed,
        "IdempotencyBackend::claim: after a late claim, the next request claims the key"
    );
}
