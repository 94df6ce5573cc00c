//! The wait queue is bounded in bytes as well as in count
//! (`RedisLockLayer::max_waiting_bytes`): each waiter holds its buffered
//! body, and a request whose body would take the waiters past the bound is
//! answered 409 with `Retry-After` at once, while the waiter already queued
//! still gets its turn.

use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use tower_redis_lock::key::{RequestMethod, UriPath};
use tower_redis_lock::{MemoryBackend, RedisBackend, RedisLockLayer};

use crate::common::{eventually, req, send, serve, Gate, RedisServer};

/// A handler held at its gate until the test lets it go.
async fn gated(State(gate): State<Gate>) -> &'static str {
    gate.pass(()).await;
    "done"
}

async fn fills_the_byte_bound(layer: RedisLockLayer) {
    let layer = layer
        .wait(Duration::from_secs(10))
        .max_waiting_bytes(100)
        .body_limit(1000);
    let (gate, mut entered) = Gate::new();
    let router = Router::new()
        .route("/pay", post(gated))
        .layer(layer.clone())
        .with_state(gate.clone());
    let addr = serve(router).await;

    let holder = tokio::spawn(send(addr, req("POST", "/pay", &[], "h")));
    entered.recv().await.expect("the holder runs");
    let body = "x".repeat(60);
    let waiter = tokio::spawn(send(addr, req("POST", "/pay", &[], &body)));
    assert!(eventually(Duration::from_secs(5), || layer.stats().waited == 1).await);

    // 60 + 60 bytes > 100: refused at once, with Retry-After.
    let started = std::time::Instant::now();
    let refused = send(addr, req("POST", "/pay", &[], &body)).await;
    assert_eq!(refused.status, 409, "{:?}", refused.body);
    assert!(refused.headers.contains_key("retry-after"));
    assert!(started.elapsed() < Duration::from_secs(2), "not waited");
    let stats = layer.stats();
    assert_eq!((stats.wait_full, stats.waited), (1, 1));

    // A small body still fits (60 + 40 = 100) and waits its turn.
    let small = tokio::spawn(send(addr, req("POST", "/pay", &[], &"y".repeat(40))));
    assert!(eventually(Duration::from_secs(5), || layer.stats().waited == 2).await);

    gate.permits.add_permits(3);
    assert_eq!(holder.await.unwrap().status, 200);
    assert_eq!(waiter.await.unwrap().status, 200, "the queued waiter ran");
    assert_eq!(small.await.unwrap().status, 200);
    assert_eq!(gate.runs(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_waiters_are_bounded_in_bytes() {
    fills_the_byte_bound(RedisLockLayer::new(
        MemoryBackend::new(),
        (RequestMethod, UriPath),
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_waiters_are_bounded_in_bytes() {
    let redis = RedisServer::start();
    let backend = RedisBackend::connect(&redis.url()).await.expect("connect");
    fills_the_byte_bound(RedisLockLayer::new(backend, (RequestMethod, UriPath))).await;
}
