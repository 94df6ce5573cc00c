//! The idempotency layer's in-process store is bounded: `MemoryBackend`
//! keeps at most its entry limit of claims and records, evicts the oldest
//! completed records first, never an in-flight claim, and refuses a new
//! claim with 503 when only claims are left. Real HTTP over loopback;
//! counts, not time.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::{req, send, serve, Gate, Reply};
use tower_redis_lock::key::{RequestMethod, Route, TrustedHeader};
use tower_redis_lock::{IdempotencyLayer, MemoryBackend};

fn layer(backend: MemoryBackend) -> IdempotencyLayer {
    IdempotencyLayer::new(
        backend,
        (RequestMethod, Route, TrustedHeader::new("x-user-id")),
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

fn replayed(reply: &Reply) -> bool {
    reply
        .headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

async fn count(State(runs): State<Arc<AtomicUsize>>) -> impl IntoResponse {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("run {n}"))
}

/// Three records fit; the fourth key evicts the oldest, and a retry of an
/// evicted key runs again (and evicts the next oldest), while the newer
/// records are still replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_limit_evicts_oldest_records_first() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/payments",
            post(count).layer(layer(MemoryBackend::new().replay_entry_limit(3))),
        )
        .with_state(runs.clone());
    let addr = serve(app).await;

    for key in ["k1", "k2", "k3", "k4"] {
        let r = send(addr, pay(key)).await;
        assert_eq!((r.status, replayed(&r)), (201, false), "{key}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    // k2, k3, k4 are kept: replayed, the handler does not run.
    for (key, body) in [("k2", "run 2"), ("k3", "run 3"), ("k4", "run 4")] {
        let r = send(addr, pay(key)).await;
        assert!(replayed(&r), "{key} was evicted");
        assert_eq!(&r.body[..], body.as_bytes());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    // k1 was the oldest: evicted, so its retry runs again (and evicts k2).
    let r = send(addr, pay("k1")).await;
    assert_eq!(
        (r.status, replayed(&r), &r.body[..]),
        (201, false, &b"run 5"[..])
    );
    let r = send(addr, pay("k2")).await;
    assert!(!replayed(&r), "k2 was the oldest after k1 came back");
    assert_eq!(runs.load(Ordering::SeqCst), 6);
    for key in ["k4", "k1", "k2"] {
        assert!(replayed(&send(addr, pay(key)).await), "{key}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 6);
}

async fn gated(State(gate): State<Gate>) -> impl IntoResponse {
    gate.pass(()).await;
    (StatusCode::CREATED, "paid")
}

/// With the store full of in-flight claims, a new key is refused with 503
/// (its handler does not run) rather than a claim being evicted: the two
/// running requests keep their keys (a duplicate gets 409). Once they
/// finished, their records are evicted for new keys like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_never_evicted_new_keys_get_503() {
    let (gate, mut entered) = Gate::new();
    let app = Router::new()
        .route(
            "/payments",
            post(gated).layer(layer(MemoryBackend::new().replay_entry_limit(2))),
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
    // Records now: the oldest goes for a new key.
    let c = tokio::spawn(send(addr, pay("c")));
    entered.recv().await.unwrap();
    gate.permits.add_permits(1);
    assert_eq!(c.await.unwrap().status, 201);
    assert_eq!(gate.runs(), 3);
    assert!(
        replayed(&send(addr, pay("b")).await),
        "b was the newer record"
    );
    assert!(replayed(&send(addr, pay("c")).await));
    assert_eq!(gate.runs(), 3);
}
