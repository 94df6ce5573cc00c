//! The idempotency layer's in-process store is bounded: `MemoryBackend`
//! keeps at most its entry limit of claims and records, never evicts an
//! unexpired one, and refuses a new claim with 503 when full. Real HTTP
//! over loopback; counts, not time.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::{replayed, req, send, serve, Gate};
use tower_redis_lock::key::{Header, RequestMethod, Route};
use tower_redis_lock::{IdempotencyLayer, MemoryBackend};

fn layer(backend: MemoryBackend) -> IdempotencyLayer {
    IdempotencyLayer::new(
        backend,
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
}

fn pay(key: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    req(
        "POST",
        "/payments",
        &[("x-user-id", "alice"), ("idempotency-key", key)],
        "{}",
    )
}

async fn count(State(runs): State<Arc<AtomicUsize>>) -> impl IntoResponse {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("run {n}"))
}

/// Three records fit; a fourth key is refused with 503 (its handler does
/// not run) rather than a record being evicted: every record is still
/// replayed, so no retry ever runs twice because the store filled up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_refuses_new_keys_and_keeps_every_record() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/payments",
            post(count).layer(layer(MemoryBackend::new().idempotency_entry_limit(3))),
        )
        .with_state(runs.clone());
    let addr = serve(app).await;

    for key in ["k1", "k2", "k3"] {
        let r = send(addr, pay(key)).await;
        assert_eq!((r.status, replayed(&r)), (201, false), "{key}");
    }
    let full = send(addr, pay("k4")).await;
    assert_eq!(full.status, 503, "{full:?}");
    assert!(full.headers.get(http::header::RETRY_AFTER).is_some());
    assert_eq!(runs.load(Ordering::SeqCst), 3, "k4 did not run");
    for (key, body) in [("k1", "run 1"), ("k2", "run 2"), ("k3", "run 3")] {
        let r = send(addr, pay(key)).await;
        assert!(replayed(&r), "{key} was evicted");
        assert_eq!(&r.body[..], body.as_bytes());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

async fn gated(State(gate): State<Gate>) -> impl IntoResponse {
    gate.pass(()).await;
    (StatusCode::CREATED, "paid")
}

/// With the store full of in-flight claims, a new key is refused with 503
/// (its handler does not run) rather than a claim being evicted: the two
/// running requests keep their keys (a duplicate gets 409). Once they
/// finished, their records are kept too: the new key is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_never_evicted_new_keys_get_503() {
    let (gate, mut entered) = Gate::new();
    let app = Router::new()
        .route(
            "/payments",
            post(gated).layer(layer(MemoryBackend::new().idempotency_entry_limit(2))),
        )
        .with_state(gate.clone());
    let addr = serve(app).await;

    let a = tokio::spawn(send(addr, pay("a")));
    entered.recv().await.unwrap();
    let b = tokio::spawn(send(addr, pay("b")));
    entered.recv().await.unwrap();
    // The answer, or the handler entering (a bug: it would wait at the gate).
    let full = tokio::select! {
        reply = send(addr, pay("c")) => reply,
        _ = entered.recv() => panic!("the handler ran for a third key: a claim was evicted or the limit ignored"),
    };
    assert_eq!(full.status, 503, "{full:?}");
    assert!(full.headers.get(http::header::RETRY_AFTER).is_some());
    for key in ["a", "b"] {
        assert_eq!(
            send(addr, pay(key)).await.status,
            409,
            "{key} kept its claim"
        );
    }
    assert_eq!(gate.runs(), 2);

    // One at a time (the semaphore is fair: `a` waited first), so `a` is
    // recorded before `b`.
    gate.permits.add_permits(1);
    assert_eq!(a.await.unwrap().status, 201);
    gate.permits.add_permits(1);
    assert_eq!(b.await.unwrap().status, 201);
    // Records now, and still never evicted: the new key is refused.
    let c = send(addr, pay("c")).await;
    assert_eq!(c.status, 503, "{c:?}");
    assert_eq!(gate.runs(), 2);
    for key in ["a", "b"] {
        assert!(replayed(&send(addr, pay(key)).await), "{key}");
    }
    assert_eq!(gate.runs(), 2);
}
