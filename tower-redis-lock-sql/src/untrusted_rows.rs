//! What every SQL store's tests check about rows it did not write: one body,
//! run by the tests of each store (`tests.rs` for sqlx's PostgreSQL and
//! SQLite, `tokio_pg/tests.rs`), each with its own way to insert a row.

use std::future::Future;
use std::time::Duration;

use tower_redis_lock::backend::contract::{Claim, EntryKey, Token};
use tower_redis_lock::backend::{ClaimTerms, IdempotencyBackend};
use tower_redis_lock::key::KeySpace;

/// A fresh entry of a scope of its own.
pub(super) fn entry(name: &str) -> EntryKey {
    let mut scope = KeySpace::default().writer();
    scope.push("scope", b"sql-tests");
    scope.push("run", Token::generate().as_bytes());
    let mut w = KeySpace::default().writer();
    w.push("entry", name.as_bytes());
    EntryKey::new(&KeySpace::default(), &scope.finish(), &w.finish())
}

/// Rows a co-tenant of the database wrote into the store's table (`write`
/// inserts one: entry, scope, state; token `\x00`, fingerprint `fp`, no
/// record, an hour to live) are untrusted: a state the store never writes
/// and a done row without a record are errors, never an answer; a foreign
/// fingerprint is a mismatch, never a replay.
pub(super) async fn co_tenant_rows_are_untrusted<S, W, F>(store: &S, write: W)
where
    S: IdempotencyBackend,
    W: Fn(EntryKey, i16) -> F,
    F: Future<Output = ()>,
{
    const LEASE: Duration = Duration::from_secs(10);
    const ROOMY: (u64, u64) = (1_000, 1 << 30);
    let (bad_state, no_record) = (entry("bad-state"), entry("no-record"));
    for (k, state) in [(&bad_state, 7i16), (&no_record, 1)] {
        write(k.clone(), state).await;
        let got = store
            .claim(
                k,
                &Token::generate(),
                b"fp",
                &ClaimTerms::new(LEASE, ROOMY.0, ROOMY.1),
            )
            .await;
        assert!(
            got.is_err(),
            "a malformed row (state {state}) is an error, not an answer: {got:?}"
        );
    }
    let got = store
        .claim(
            &no_record,
            &Token::generate(),
            b"other",
            &ClaimTerms::new(LEASE, ROOMY.0, ROOMY.1),
        )
        .await;
    assert_eq!(got.unwrap(), Claim::Mismatch);
}

/// A retention as long as it gets (`Duration::MAX`, "keep it for ever")
/// keeps the record: no overflow of its expiry (a panic, an expiry wrapped
/// into the past, or a span the database refuses).
pub(super) async fn the_longest_retention_keeps_the_record<S: IdempotencyBackend>(store: &S) {
    let k = entry("long-retention");
    let (token, lease) = (Token::generate(), Duration::from_secs(10));
    let claim = store
        .claim(&k, &token, b"fp", &ClaimTerms::new(lease, 1_000, 1 << 30))
        .await;
    assert_eq!(claim.unwrap(), Claim::Claimed);
    let record = bytes::Bytes::from_static(b"recorded");
    let done = store
        .complete(&k, &token, b"fp", &record, Duration::MAX)
        .await;
    assert!(done.unwrap(), "recorded");
    let again = store
        .claim(
            &k,
            &Token::generate(),
            b"fp",
            &ClaimTerms::new(lease, 1_000, 1 << 30),
        )
        .await;
    assert_eq!(again.unwrap(), Claim::Done(record));
}
