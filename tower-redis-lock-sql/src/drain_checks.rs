//! What every SQL store's tests check about `Backend::drain`: it waits,
//! bounded, for the claims of this process that are open (claimed, not yet
//! completed or abandoned). One body, run by the tests of each store
//! (`tests.rs` for sqlx's PostgreSQL and SQLite, `tokio_pg/tests.rs`).

use std::time::Duration;

use tower_redis_lock::backend::contract::{Claim, Token};
use tower_redis_lock::backend::{ClaimTerms, IdempotencyBackend};

use crate::untrusted_rows::entry;

/// With nothing open, a drain answers at once; while claims stay open it
/// runs out of time with an error that names how many; a drain started
/// meanwhile waits for them and returns once the last one is completed or
/// abandoned.
pub(crate) async fn drain_waits_for_open_claims<S: IdempotencyBackend>(store: &S) {
    const LEASE: Duration = Duration::from_secs(10);
    const ROOMY: (u64, u64) = (1_000, 1 << 30);
    const SHORT: Duration = Duration::from_millis(200);
    store
        .drain(SHORT)
        .await
        .expect("Backend::drain: nothing open, nothing to wait for");

    let (a, b) = (
        (entry("drain-a"), Token::generate()),
        (entry("drain-b"), Token::generate()),
    );
    for (k, t) in [&a, &b] {
        let got = store
            .claim(k, t, b"fp", &ClaimTerms::new(LEASE, ROOMY.0, ROOMY.1))
            .await;
        assert_eq!(got.unwrap(), Claim::Claimed);
    }
    // Both stay open: the drain runs out of time, and says how many.
    let err = store
        .drain(SHORT)
        .await
        .expect_err("Backend::drain: two claims are open");
    assert!(err.is_timeout(), "a drain that ran out of time: {err}");
    assert!(err.to_string().contains("2 claim(s) still open"), "{err}");

    // A drain started now waits for them ...
    let mut drain = store.drain(Duration::from_secs(30));
    assert!(
        tokio::time::timeout(SHORT, &mut drain).await.is_err(),
        "Backend::drain answered while two claims are open"
    );
    let completed = store
        .complete(&a.0, &a.1, b"fp", &bytes::Bytes::from_static(b"r"), LEASE)
        .await;
    assert!(completed.unwrap(), "the claim completes");
    assert!(
        tokio::time::timeout(SHORT, &mut drain).await.is_err(),
        "Backend::drain answered while a claim is still open"
    );
    let err = store
        .drain(SHORT)
        .await
        .expect_err("Backend::drain: one claim is open");
    assert!(err.to_string().contains("1 claim(s) still open"), "{err}");
    // ... and returns once the last one is abandoned (its rollback done).
    assert!(store.abandon(&b.0, &b.1, LEASE).await.unwrap());
    tokio::time::timeout(Duration::from_secs(5), drain)
        .await
        .expect("Backend::drain returns once no claim is open")
        .expect("drained");
    store
        .drain(SHORT)
        .await
        .expect("Backend::drain: nothing open any more");
}
