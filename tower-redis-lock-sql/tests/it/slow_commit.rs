//! A `COMMIT` that takes longer than the layer's deadline (PostgreSQL
//! stores): a deferred constraint trigger on `charges` sleeps at commit.
//!
//! - 0.5 s at commit, the layer's default 200 ms deadline: the commit is
//!   the store's to bound, not the deadline's: 201, one charge, and the
//!   retry replays the 201.
//! - 1.5 s at commit, the store's `commit_timeout` 200 ms: 503
//!   problem+json `outcome-unknown` with `Retry-After`; a retry while the
//!   commit still runs gets 409 and never runs the handler; once the commit
//!   landed the retry replays the 201. One charge.

use crate::common;

use std::time::Duration;

use common::charging::{
    committing, retry_while_pending, serve_charging, slow_commit_schema, until,
};
use common::stores::{layer, pay, pg_stores, send, Env, Kind, Pools};

async fn slow_commit_answers_201(kind: Kind) {
    let env = Env::new(kind).await;
    slow_commit_schema(&env, 0.5).await;
    let store = env.store(&Pools::default()).await;
    let (addr, app) = serve_charging(layer(&store)).await;
    let started = tokio::time::Instant::now();
    let first = send(addr, pay("k1", "")).await.0;
    let took = started.elapsed();
    let retry = retry_while_pending(addr, Duration::from_secs(5), || pay("k1", "")).await;
    // The test has teeth: the commit did take its 0.5 s, past the layer's
    // 200 ms deadline.
    assert!(
        took >= Duration::from_millis(450),
        "{kind:?}: the first request took {took:?}: the commit trigger did not sleep"
    );
    let seen = (first, retry, app.runs(), env.charges().await);
    assert_eq!(
        seen,
        ("201".to_owned(), vec!["201 replayed".to_owned()], 1, 1),
        "{kind:?}: (first answer, retries, handler runs, charges)"
    );
}

pg_stores!(a_slow_commit_is_answered_201, slow_commit_answers_201);

async fn commit_past_its_bound(kind: Kind) {
    let env = Env::new(kind).await;
    slow_commit_schema(&env, 1.5).await;
    let store = env
        .store(&Pools {
            commit_timeout: Some(Duration::from_millis(200)),
            ..Pools::default()
        })
        .await;
    let (addr, app) = serve_charging(layer(&store)).await;
    let first = send(addr, pay("k1", "")).await.0;
    // The commit is still running on the server (its trigger sleeps):
    // the key is in flight, whatever the first answer was.
    let running = committing(&env).await > 0;
    let during = send(addr, pay("k1", "")).await.0;
    let landed = until(Duration::from_secs(10), || async {
        committing(&env).await == 0 && env.charges().await > 0
    })
    .await;
    let after = retry_while_pending(addr, Duration::from_secs(5), || pay("k1", "")).await;
    let report = format!(
        "{kind:?}: first {first:?}, during the commit ({running}) {during:?}, the commit \
         landed: {landed}, after {after:?}; handler runs {}, charges {}",
        app.runs(),
        env.charges().await
    );
    assert_eq!(first, "503 outcome-unknown retry-after", "{report}");
    assert!(running, "the commit was still running: {report}");
    assert_eq!(
        during, "409 idempotency-key-in-flight retry-after",
        "{report}"
    );
    assert!(landed, "the commit lands on the server: {report}");
    assert_eq!(
        after.last().map(String::as_str),
        Some("201 replayed"),
        "{report}"
    );
    assert_eq!((app.runs(), env.charges().await), (1, 1), "{report}");
}

pg_stores!(
    a_commit_past_the_stores_commit_timeout_is_outcome_unknown_then_replays,
    commit_past_its_bound
);
