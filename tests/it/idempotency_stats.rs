//! `IdempotencyLayer::stats()` counts what a sequence of requests did, on
//! `MemoryBackend` and on a `redis-server` of the test's own. Real HTTP over
//! loopback.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::{replayed, req, send, serve, Env, Gate, Kind, Reply};
use tower_redis_lock::key::{Header, RequestMethod, Route};
use tower_redis_lock::IdempotencyStats;
use tower_redis_lock::{IdempotencyLayer, MemoryBackend};

#[derive(serde::Deserialize)]
struct Params {
    status: Option<u16>,
    big: Option<usize>,
}

async fn create(
    State(runs): State<Arc<AtomicUsize>>,
    Query(p): Query<Params>,
) -> impl IntoResponse {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let status = StatusCode::from_u16(p.status.unwrap_or(201)).unwrap();
    (status, "x".repeat(p.big.unwrap_or(0)) + &format!("run {n}"))
}

async fn held(State(gate): State<Gate>) -> impl IntoResponse {
    gate.pass(()).await;
    (StatusCode::CREATED, "paid")
}

fn pay(path: &str, key: &str, body: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    req(
        "POST",
        path,
        &[("x-user-id", "alice"), ("idempotency-key", key)],
        body,
    )
}

/// The outcome counters, in the order of the fields.
fn counts(s: &IdempotencyStats) -> [(&'static str, u64); 9] {
    [
        ("claimed", s.claimed),
        ("replayed", s.replayed),
        ("joined", s.joined),
        ("mismatch", s.mismatch),
        ("conflict", s.conflict),
        ("not_stored", s.not_stored),
        ("recorded", s.recorded),
        ("record_failed", s.record_failed),
        ("backend_error", s.backend_error),
    ]
}

/// Claims, replays, a mismatch, a conflict while in flight, a response too
/// large to keep and its not-stored answer, a recorded 500 and its replay:
/// each counted once, in its own counter, and nothing else.
async fn counters_follow_the_requests(kind: Kind) {
    let env = Env::new(kind).await;
    let layer = env
        .idempotency_layer((RequestMethod, Route, Header::trusted_identity("x-user-id")))
        .await
        .record_limit(64)
        .label("payments");
    let runs = Arc::new(AtomicUsize::new(0));
    let (gate, mut entered) = Gate::new();
    let app = Router::new()
        .route("/payments", post(create).layer(layer.clone()))
        .with_state(runs.clone())
        .merge(
            Router::new()
                .route("/held", post(held).layer(layer.clone()))
                .with_state(gate.clone()),
        );
    let addr = serve(app).await;
    let status = |r: &Reply| r.status;

    // claimed + recorded, then replayed twice, then a mismatch.
    assert_eq!(status(&send(addr, pay("/payments", "a", "{}")).await), 201);
    for _ in 0..2 {
        assert!(replayed(&send(addr, pay("/payments", "a", "{}")).await));
    }
    assert_eq!(
        status(&send(addr, pay("/payments", "a", "{\"x\":1}")).await),
        422
    );
    // In flight: a duplicate is a conflict; the first is recorded after.
    let first = tokio::spawn(send(addr, pay("/held", "b", "{}")));
    entered.recv().await.unwrap();
    assert_eq!(status(&send(addr, pay("/held", "b", "{}")).await), 409);
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 201);
    // Too large to keep: recorded as not stored; its retry is answered so.
    let big = || pay("/payments?big=100", "c", "{}");
    assert_eq!(status(&send(addr, big()).await), 201);
    assert_eq!(status(&send(addr, big()).await), 410);
    // A 500 after the handler began is recorded too (the default), and its
    // retry gets it replayed.
    let failed = || pay("/payments?status=500", "d", "{}");
    assert_eq!(status(&send(addr, failed()).await), 500);
    let again = send(addr, failed()).await;
    assert_eq!(again.status, 500);
    assert!(replayed(&again));

    let s = layer.stats();
    assert_eq!(
        counts(&s),
        [
            ("claimed", 4),
            ("replayed", 3),
            ("joined", 0),
            ("mismatch", 1),
            ("conflict", 1),
            ("not_stored", 1),
            ("recorded", 4),
            ("record_failed", 0),
            ("backend_error", 0),
        ]
    );
    assert_eq!(s.round_trips, 10, "every request that reached the store");
    assert_eq!(s.round_trip_timeouts, 0);
    assert!(s.mean_round_trip().is_some());
    assert_eq!(runs.load(Ordering::SeqCst) + gate.runs(), 4);
    // A layer over another store counts on its own.
    let other = env
        .idempotency_layer((RequestMethod, Route, Header::trusted_identity("x-user-id")))
        .await;
    assert_eq!(other.stats(), IdempotencyStats::default());
}

async fn slow(State(runs): State<Arc<AtomicUsize>>) -> impl IntoResponse {
    runs.fetch_add(1, Ordering::SeqCst);
    // Longer than the claim's 1 ms TTL: the claim is gone when the layer
    // records (what is tested is the lapse itself).
    tokio::time::sleep(Duration::from_millis(50)).await;
    (StatusCode::CREATED, "late")
}

/// A claim that expired before its outcome was written, with nothing in
/// its place, is still recorded (a refused record is counted in
/// `execution::tests::a_record_another_claim_refused_is_counted_as_failed`);
/// a store that cannot take the claim is a backend error (503).
async fn record_failures_and_backend_errors_are_counted(kind: Kind) {
    let mut env = Env::new(kind).await;
    let layer = env
        .idempotency_layer((RequestMethod, Route, Header::trusted_identity("x-user-id")))
        .await
        .ttl(Duration::from_millis(1));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = |layer: IdempotencyLayer| {
        Router::new()
            .route("/payments", post(slow).layer(layer))
            .with_state(runs.clone())
    };
    let addr = serve(app(layer.clone())).await;
    assert_eq!(send(addr, pay("/payments", "a", "{}")).await.status, 201);
    let s = layer.stats();
    assert_eq!((s.claimed, s.recorded, s.record_failed), (1, 1, 0));
    let replayed = send(addr, pay("/payments", "a", "{}")).await;
    assert_eq!(replayed.status, 201, "the retry replays the late record");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The store refuses: Redis is down; the memory store has no room for a
    // claim (a limit of 0 entries).
    let refusing = match kind {
        Kind::Memory => IdempotencyLayer::new(
            MemoryBackend::new().idempotency_entry_limit(0),
            (RequestMethod, Route, Header::trusted_identity("x-user-id")),
        ),
        Kind::Redis => {
            let layer = env
                .idempotency_layer((RequestMethod, Route, Header::trusted_identity("x-user-id")))
                .await;
            env.server.as_mut().unwrap().kill();
            layer
        }
    };
    let addr = serve(app(refusing.clone())).await;
    assert_eq!(send(addr, pay("/payments", "b", "{}")).await.status, 503);
    let s = refusing.stats();
    assert_eq!(
        counts(&s)
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .collect::<Vec<_>>(),
        [("backend_error", 1)]
    );
    assert_eq!(s.round_trips, 1);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the refused request did not run"
    );
}

/// A duplicate that waits for the request in flight (on another instance
/// sharing the store) and gets its answer is counted as joined, not as a
/// replay or a conflict.
async fn joins_are_counted(kind: Kind) {
    let env = Env::new(kind).await;
    let key = || (RequestMethod, Route, Header::trusted_identity("x-user-id"));
    let (gate, mut entered) = Gate::new();
    let mut addrs = Vec::new();
    let mut layers = Vec::new();
    for _ in 0..2 {
        let layer = env
            .idempotency_layer(key())
            .await
            .join_timeout(Duration::from_secs(5));
        let app = Router::new()
            .route("/held", post(held).layer(layer.clone()))
            .with_state(gate.clone());
        addrs.push(serve(app).await);
        layers.push(layer);
    }
    let first = tokio::spawn(send(addrs[0], pay("/held", "j", "{}")));
    entered.recv().await.unwrap();
    let duplicate = tokio::spawn(send(addrs[1], pay("/held", "j", "{}")));
    // The duplicate found the key in flight (its claim was answered) and
    // waits; only then may the first request end.
    tokio::time::timeout(Duration::from_secs(5), async {
        while layers[1].stats().round_trips < 1 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the duplicate reached the store within 5 s");
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 201);
    let joined = duplicate.await.unwrap();
    assert_eq!(joined.status, 201);
    assert!(replayed(&joined));
    let s = layers[1].stats();
    assert_eq!(s.joined, 1, "{s:?}");
    assert_eq!((s.replayed, s.conflict, s.claimed), (0, 0, 0), "{s:?}");
    assert_eq!(layers[0].stats().claimed, 1);
    assert_eq!(gate.runs(), 1);
}

suite!(
    counters_follow_the_requests,
    record_failures_and_backend_errors_are_counted,
    joins_are_counted
);
