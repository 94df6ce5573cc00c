//! The database's answer to `COMMIT` is lost (PostgreSQL stores): the
//! store's pool reaches PostgreSQL through a fault proxy
//! (`common::proxy`, real bytes, real server), and the commit is slow (a
//! deferred trigger sleeps 1.5 s at commit), so the test can act while it
//! runs.
//!
//! - Cut every connection while the commit runs, new connections still
//!   let through: the commit lands on the server; the store must find out
//!   (by the transaction's id) that it did: the handler's 201, the retry
//!   replays it, one charge.
//! - Black-hole the proxy while the commit runs and keep it so past the
//!   store's `commit_timeout`: 503 `outcome-unknown`; then restore: the
//!   retry replays the 201 if the commit landed (it does: the server had
//!   it), or runs once if it had not; one charge either way, never two.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::charging::{
    committing, retry_while_pending, serve_charging, slow_commit_schema, until,
};
use common::proxy::FaultProxy;
use common::stores::{layer, pay, pg_stores, send, Env, Kind, Pools};

const PG: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 5432);

async fn cut_during_commit(kind: Kind) {
    let env = Env::new(kind).await;
    slow_commit_schema(&env, 1.5).await;
    let proxy = FaultProxy::start(PG).await;
    let store = env
        .store(&Pools {
            via: Some(proxy.addr()),
            ..Pools::default()
        })
        .await;
    let (addr, app) = serve_charging(layer(&store)).await;
    let first = tokio::spawn(send(addr, pay("k1", "")));
    let running = until(Duration::from_secs(10), || async {
        committing(&env).await > 0
    })
    .await;
    proxy.cut();
    let first = first.await.unwrap().0;
    let landed = until(Duration::from_secs(10), || async {
        committing(&env).await == 0 && env.charges().await > 0
    })
    .await;
    let retry = retry_while_pending(addr, Duration::from_secs(10), || pay("k1", "")).await;
    let report = format!(
        "{kind:?}: the commit ran: {running}, first {first:?}, the commit landed: {landed}, \
         retries {retry:?}; handler runs {}, charges {}",
        app.runs(),
        env.charges().await
    );
    println!("{report}");
    assert!(running && landed, "{report}");
    assert_eq!(env.charges().await, 1, "never a second charge: {report}");
    assert_eq!(
        first, "201",
        "the store learns that its commit landed: {report}"
    );
    assert_eq!(
        retry.last().map(String::as_str),
        Some("201 replayed"),
        "{report}"
    );
    assert_eq!(app.runs(), 1, "{report}");
}

pg_stores!(
    connections_cut_during_the_commit_the_store_finds_it_landed,
    cut_during_commit
);

async fn black_hole_during_commit(kind: Kind) {
    let env = Env::new(kind).await;
    slow_commit_schema(&env, 1.5).await;
    let proxy = FaultProxy::start(PG).await;
    let store = env
        .store(&Pools {
            via: Some(proxy.addr()),
            commit_timeout: Some(Duration::from_millis(500)),
            ..Pools::default()
        })
        .await;
    let (addr, app) = serve_charging(layer(&store)).await;
    let first = tokio::spawn(send(addr, pay("k1", "")));
    let running = until(Duration::from_secs(10), || async {
        committing(&env).await > 0
    })
    .await;
    proxy.black_hole();
    // Black-holed until the answer: past the commit bound (or for as long
    // as the store waits without one: then the answer is late, see below).
    let answered = tokio::time::timeout(Duration::from_secs(10), first).await;
    let first = match answered {
        Ok(joined) => joined.unwrap().0,
        Err(_) => "no answer within 10 s while black-holed".to_owned(),
    };
    let finished = until(Duration::from_secs(10), || async {
        committing(&env).await == 0
    })
    .await;
    let landed = env.charges().await;
    proxy.restore();
    let retry = retry_while_pending(addr, Duration::from_secs(10), || pay("k1", "")).await;
    let report = format!(
        "{kind:?}: the commit ran: {running}, first {first:?}, the commit finished: {finished} \
         with {landed} charge(s), retries after restore {retry:?}; handler runs {}, charges {}",
        app.runs(),
        env.charges().await
    );
    println!("{report}");
    assert!(running && finished, "{report}");
    assert_eq!(env.charges().await, 1, "one charge, never two: {report}");
    assert_eq!(first, "503 outcome-unknown retry-after", "{report}");
    // It landed: the retry replays; had it not, the retry runs once.
    let (last, runs) = match landed {
        1 => ("201 replayed", 1),
        _ => ("201", 2),
    };
    assert_eq!(retry.last().map(String::as_str), Some(last), "{report}");
    assert_eq!(app.runs(), runs, "{report}");
}

pg_stores!(
    black_holed_past_the_commit_timeout_outcome_unknown_then_one_charge,
    black_hole_during_commit
);
