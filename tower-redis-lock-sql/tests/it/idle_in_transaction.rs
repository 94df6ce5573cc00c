//! `idle_in_transaction_session_timeout` on the pool's connections
//! (PostgreSQL stores): 200 ms, set as a connection option like an
//! operator would. The handler `INSERT`s its charge, then spends 600 ms
//! outside the database (a provider call, counted), then answers 201.
//! PostgreSQL ends an idle-in-transaction session after 200 ms; the key
//! must stay held all the same: a retry with the same key 300 ms in, to
//! the same instance and to another one on the same database, gets 409
//! (or joins and replays), never a second provider call; the first
//! request is answered 201 and its charge is committed.

use crate::common;

use std::time::Duration;

use common::charging::serve_charging;
use common::stores::{layer, pay, pg_stores, send, Env, Kind, Pools};

async fn idle_timeout_keeps_the_key(kind: Kind) {
    let env = Env::new(kind).await;
    env.batch("CREATE TABLE charges (k text NOT NULL)").await;
    let store = env
        .store(&Pools {
            settings: vec![("idle_in_transaction_session_timeout", "200")],
            ..Pools::default()
        })
        .await;
    let (addr, app) = serve_charging(layer(&store)).await;
    // A second instance on the same database (its own store and pool):
    // what it knows of the key is only what PostgreSQL holds.
    let other_store = env
        .store(&Pools {
            settings: vec![("idle_in_transaction_session_timeout", "200")],
            ..Pools::default()
        })
        .await;
    let (other, other_app) = serve_charging(layer(&other_store)).await;
    let started = tokio::time::Instant::now();
    let first = tokio::spawn(send(addr, pay("k1", "?work_ms=600")));
    tokio::time::timeout(Duration::from_secs(5), app.inserted.notified())
        .await
        .expect("the first request inserts its charge");
    // The scenario's timing: the retry comes once PostgreSQL's 200 ms
    // idle-in-transaction timeout has passed, while the provider call runs.
    tokio::time::sleep_until(started + Duration::from_millis(300)).await;
    let during = send(addr, pay("k1", "?work_ms=600")).await.0;
    let elsewhere = send(other, pay("k1", "?work_ms=600")).await.0;
    let first = first.await.unwrap().0;
    let later = send(addr, pay("k1", "?work_ms=600")).await.0;
    let report = format!(
        "{kind:?}: retries 300 ms in: same instance {during:?}, another instance \
         {elsewhere:?}; first {first:?}, a later retry {later:?}; provider calls {} (+ {} on \
         the other instance), handler runs {} (+ {}), charges {}",
        app.calls(),
        other_app.calls(),
        app.runs(),
        other_app.runs(),
        env.charges().await
    );
    println!("{report}");
    for retry in [&during, &elsewhere] {
        assert!(
            retry == "409 idempotency-key-in-flight retry-after" || retry == "201 replayed",
            "the retry does not run: {report}"
        );
    }
    assert_eq!(other_app.calls(), 0, "no provider call elsewhere: {report}");
    assert_eq!(first, "201", "the first request commits: {report}");
    assert_eq!(app.calls(), 1, "one provider call: {report}");
    assert_eq!(later, "201 replayed", "{report}");
    assert_eq!(env.charges().await, 1, "the charge committed: {report}");
}

pg_stores!(
    idle_in_transaction_session_timeout_never_lets_a_retry_call_the_provider_again,
    idle_timeout_keeps_the_key
);
