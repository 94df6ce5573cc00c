//! Idempotency mode (`idempotency::IdempotencyLayer`), run against both stores:
//! `MemoryBackend` and a real `redis-server` started per test. All traffic
//! is real HTTP over loopback.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::{pay, replayed, req, send, serve, Conn, Env, Gate, Kind, Reply};
use tokio::sync::mpsc;
use tower_redis_lock::idempotency::{IdempotencyKey, IdempotencyLayer, SafeToRetry};
use tower_redis_lock::key::{Header, RequestMethod, Route};

impl Env {
    /// The layer used by most tests: identity from `x-user-id`.
    async fn replay_layer(&self) -> IdempotencyLayer {
        self.idempotency_layer((RequestMethod, Route, Header::trusted_identity("x-user-id")))
            .await
    }

    /// Entries (claims and records) in Redis; `None` for the memory store,
    /// whose table is looked at through the layer's answers instead.
    fn redis_entries(&self) -> Option<usize> {
        self.server.as_ref().map(|s| s.dbsize())
    }
}

/// Send `make()` until the answer is not 409 (the key is no longer claimed)
/// or `within` passes; returns that answer, or the last 409.
async fn until_not_in_flight(
    addr: std::net::SocketAddr,
    within: Duration,
    make: impl Fn() -> http::Request<http_body_util::Full<bytes::Bytes>>,
) -> Reply {
    let attempt = || {
        let req = make();
        async move {
            let reply = send(addr, req).await;
            if reply.status != 409 {
                Ok(reply)
            } else {
                Err(reply)
            }
        }
    };
    match common::retry_until(within, Duration::from_millis(20), attempt).await {
        Ok((_, reply)) | Err(reply) => reply,
    }
}

/// Counts executions; `?status=` picks the status, `?big=` the body size.
#[derive(Clone, Default)]
struct Counter(Arc<AtomicUsize>);

impl Counter {
    fn runs(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(serde::Deserialize)]
struct Params {
    status: Option<u16>,
    big: Option<usize>,
}

async fn create(
    State(counter): State<Counter>,
    Query(p): Query<Params>,
    body: String,
) -> impl IntoResponse {
    let n = counter.0.fetch_add(1, Ordering::SeqCst) + 1;
    let status = StatusCode::from_u16(p.status.unwrap_or(201)).unwrap();
    let body = match p.big {
        Some(len) => "x".repeat(len),
        None => format!(r#"{{"id":"pay_{n}","echo":{body:?}}}"#),
    };
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json".to_owned()),
            (header::LOCATION, format!("/payments/pay_{n}")),
            (header::HeaderName::from_static("x-run"), n.to_string()),
        ],
        body,
    )
}

fn app(layer: IdempotencyLayer, counter: Counter) -> Router {
    Router::new()
        .route("/payments", post(create).layer(layer.clone()))
        .route("/orders/{id}/pay", post(create).layer(layer))
        .with_state(counter)
}

/// The problem `type` of `kind`: its anchor in the `Rejection` docs on
/// docs.rs, for this crate's major.minor.
fn problem(kind: &str) -> String {
    format!(
        "https://docs.rs/tower-redis-lock/{}.{}/tower_redis_lock/enum.Rejection.html#{kind}",
        env!("CARGO_PKG_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MINOR")
    )
}

fn problem_type(reply: &Reply) -> String {
    assert_eq!(
        reply.headers[header::CONTENT_TYPE],
        "application/problem+json",
        "{reply:?}"
    );
    reply.json()["type"].as_str().unwrap_or("").to_owned()
}

async fn replay_is_byte_identical_and_skips_handler(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    let addr = serve(app(env.replay_layer().await, counter.clone())).await;
    let mut conn = Conn::open(addr).await;

    let first = conn.send(pay("alice", "k-1", r#"{"amount":5}"#)).await;
    assert_eq!(first.status, 201);
    assert!(!replayed(&first));
    // Sequential retry on the same keep-alive connection: the record was
    // written before the end of the first body was reported.
    let again = conn.send(pay("alice", "k-1", r#"{"amount":5}"#)).await;
    assert_eq!(counter.runs(), 1, "the handler must not run again");
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body, "byte-identical body");
    for h in [
        header::CONTENT_TYPE,
        header::LOCATION,
        header::CONTENT_LENGTH,
    ] {
        assert_eq!(again.headers.get(&h), first.headers.get(&h), "{h}");
    }
    assert!(replayed(&again));
    assert!(
        again.headers.get("x-run").is_none(),
        "headers outside the stored set are not replayed"
    );
    // The sf-string form of the same key is the same key.
    let quoted = send(addr, pay("alice", "\"k-1\"", r#"{"amount":5}"#)).await;
    assert!(replayed(&quoted) && quoted.body == first.body);
    assert_eq!(counter.runs(), 1);
}

async fn keys_are_scoped_by_identity_and_route(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    let addr = serve(app(env.replay_layer().await, counter.clone())).await;

    let alice = send(addr, pay("alice", "same", "{}")).await;
    let bob = send(addr, pay("bob", "same", "{}")).await;
    assert_eq!((alice.status, bob.status), (201, 201));
    assert!(!replayed(&bob), "bob's equal key never meets alice's");
    assert_ne!(alice.body, bob.body);
    let other_route = send(
        addr,
        req(
            "POST",
            "/orders/7/pay",
            &[("x-user-id", "alice"), ("idempotency-key", "same")],
            "{}",
        ),
    )
    .await;
    assert!(!replayed(&other_route) && other_route.status == 201);
    assert_eq!(counter.runs(), 3);
    // No identity: 401 from the key part, handler not run.
    let anon = send(
        addr,
        req("POST", "/payments", &[("idempotency-key", "x")], "{}"),
    )
    .await;
    assert_eq!(anon.status, 401);
    let anon = send(addr, req("POST", "/payments", &[], "{}")).await;
    assert_eq!(anon.status, 401, "authentication is checked before the key");
    assert_eq!(counter.runs(), 3);
}

async fn mismatch_is_422(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    let addr = serve(app(env.replay_layer().await, counter.clone())).await;

    assert_eq!(
        send(addr, pay("alice", "k", r#"{"amount":5}"#))
            .await
            .status,
        201
    );
    let other_body = send(addr, pay("alice", "k", r#"{"amount":500}"#)).await;
    assert_eq!(other_body.status, 422);
    assert_eq!(problem_type(&other_body), problem("idempotency-key-reused"));
    // Same route template, different concrete path: also a different request.
    let order = |id: &str| {
        req(
            "POST",
            &format!("/orders/{id}/pay"),
            &[("x-user-id", "alice"), ("idempotency-key", "o")],
            "{}",
        )
    };
    assert_eq!(send(addr, order("1")).await.status, 201);
    assert_eq!(send(addr, order("2")).await.status, 422);
    assert_eq!(counter.runs(), 2);
}

async fn missing_or_invalid_key_is_400(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    let addr = serve(app(env.replay_layer().await, counter.clone())).await;

    let none = send(addr, req("POST", "/payments", &[("x-user-id", "a")], "{}")).await;
    assert_eq!(none.status, 400);
    assert_eq!(problem_type(&none), problem("idempotency-key-missing"));
    let long = "k".repeat(256);
    for bad in [
        long.as_str(),
        "\"unterminated",
        "two words",
        "\"\"",
        "\"a\";p=1",
    ] {
        let r = send(addr, pay("a", bad, "{}")).await;
        assert_eq!(r.status, 400, "{bad:?}");
        assert_eq!(problem_type(&r), problem("idempotency-key-invalid"));
    }
    let twice = send(
        addr,
        req(
            "POST",
            "/payments",
            &[
                ("x-user-id", "a"),
                ("idempotency-key", "a"),
                ("idempotency-key", "b"),
            ],
            "{}",
        ),
    )
    .await;
    assert_eq!(twice.status, 400);
    assert_eq!(counter.runs(), 0);
    // Accepted: 255 bytes bare, a UUID, an sf-string with escapes.
    let max = "k".repeat(255);
    for good in [
        max.as_str(),
        "8e03978e-40d5-43e8-bc93-6894a57f9324",
        r#""order \"42\"""#,
    ] {
        assert_eq!(
            send(addr, pay("a", good, "{}")).await.status,
            201,
            "{good:?}"
        );
    }
    assert_eq!(counter.runs(), 3);
}

/// A handler held at its gate until the test lets it go.
async fn gated(State(gate): State<Gate>, key: IdempotencyKey) -> impl IntoResponse {
    // Numbered at entry, like the runs counter.
    let n = gate.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let _ = gate.entered.send(());
    gate.permits.acquire().await.unwrap().forget();
    (StatusCode::CREATED, format!("run {n} for {key}"))
}

fn gated_app(layer: IdempotencyLayer) -> (Router, Gate, mpsc::UnboundedReceiver<()>) {
    let (gate, rx) = Gate::new();
    let app = Router::new()
        .route("/payments", post(gated).layer(layer))
        .with_state(gate.clone());
    (app, gate, rx)
}

async fn concurrent_retry_gets_409_then_replay(kind: Kind) {
    let env = Env::new(kind).await;
    let (app, gate, mut entered) = gated_app(env.replay_layer().await);
    let addr = serve(app).await;

    let first = tokio::spawn(send(addr, pay("alice", "\"k\"", "{}")));
    entered.recv().await.unwrap();
    let busy = send(addr, pay("alice", "k", "{}")).await;
    assert_eq!(busy.status, 409);
    assert_eq!(problem_type(&busy), problem("idempotency-key-in-flight"));
    let after: u64 = busy.headers[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=30).contains(&after), "Retry-After {after}");
    // A different payload while in flight is still a misuse: 422.
    assert_eq!(send(addr, pay("alice", "k", "{\"x\":1}")).await.status, 422);

    gate.permits.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(
        &first.body[..],
        b"run 1 for k",
        "the extractor saw the unquoted key"
    );
    let again = send(addr, pay("alice", "k", "{}")).await;
    assert!(replayed(&again));
    assert_eq!(again.body, first.body);
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1);
}

async fn retention_expiry_lets_the_key_run_again(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    // Long enough that a loaded machine still replays within it.
    let retention = Duration::from_secs(1);
    let addr = serve(app(
        env.replay_layer().await.retention(retention),
        counter.clone(),
    ))
    .await;

    assert_eq!(send(addr, pay("a", "k", "{}")).await.status, 201);
    assert!(replayed(&send(addr, pay("a", "k", "{}")).await));
    assert_eq!(counter.runs(), 1);
    // Waiting out a time-based expiry: nothing to signal on.
    tokio::time::sleep(retention + Duration::from_millis(200)).await;
    let fresh = send(addr, pay("a", "k", "{}")).await;
    assert_eq!(fresh.status, 201);
    assert!(!replayed(&fresh));
    assert_eq!(counter.runs(), 2);
}

async fn server_errors_are_stored_and_transient_4xx_are_not(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    let addr = serve(app(env.replay_layer().await, counter.clone())).await;
    let at = |status: u16, key: &str| {
        req(
            "POST",
            &format!("/payments?status={status}"),
            &[("x-user-id", "a"), ("idempotency-key", key)],
            "{}",
        )
    };

    for transient in [429, 409] {
        let key = format!("t{transient}");
        let failed = send(addr, at(transient, &key)).await;
        assert_eq!(failed.status, transient);
        assert!(!replayed(&failed));
        // The key was freed: the retry runs and its success is stored.
        let retry = send(addr, at(201, &key)).await;
        assert_eq!(retry.status, 201, "after {transient}");
        assert!(!replayed(&retry));
        let third = send(addr, at(201, &key)).await;
        assert!(replayed(&third) && third.status == 201);
    }
    assert_eq!(counter.runs(), 4);
    // A 5xx after the handler began may hide a side effect: it is kept. So
    // is a 408 from below the layer (the body arrived whole before the
    // claim): a timeout that cut a handler that may have charged.
    for status in [500, 503, 408] {
        let key = format!("s{status}");
        let failed = send(addr, at(status, &key)).await;
        assert_eq!(failed.status, status);
        let retry = send(addr, at(status, &key)).await;
        assert!(replayed(&retry) && retry.status == status, "{retry:?}");
    }
    assert_eq!(counter.runs(), 7);
    // A deterministic 4xx (e.g. card declined) is replayed.
    assert_eq!(send(addr, at(402, "declined")).await.status, 402);
    let again = send(addr, at(402, "declined")).await;
    assert!(replayed(&again) && again.status == 402);
    assert_eq!(counter.runs(), 8);
}

async fn two_layer_instances_share_records(kind: Kind) {
    let env = Env::new(kind).await;
    let (c1, c2) = (Counter::default(), Counter::default());
    let a = serve(app(env.replay_layer().await, c1.clone())).await;
    let b = serve(app(env.replay_layer().await, c2.clone())).await;

    let first = send(a, pay("alice", "shared", r#"{"amount":1}"#)).await;
    assert_eq!(first.status, 201);
    let from_b = send(b, pay("alice", "shared", r#"{"amount":1}"#)).await;
    assert!(replayed(&from_b));
    assert_eq!(from_b.body, first.body);
    assert_eq!(
        from_b.headers.get(header::LOCATION),
        first.headers.get(header::LOCATION)
    );
    assert_eq!(
        send(b, pay("alice", "shared", r#"{"amount":2}"#))
            .await
            .status,
        422
    );
    assert_eq!((c1.runs(), c2.runs()), (1, 0));
}

async fn record_larger_than_limit_is_not_replayed_nor_rerun(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    let layer = env.replay_layer().await.record_limit(1024);
    let addr = serve(app(layer, counter.clone())).await;
    let big = |key: &str, len: usize| {
        req(
            "POST",
            &format!("/payments?big={len}"),
            &[("x-user-id", "a"), ("idempotency-key", key)],
            "{}",
        )
    };

    let first = send(addr, big("big", 4096)).await;
    assert_eq!(first.status, 201);
    assert_eq!(
        first.body.len(),
        4096,
        "the first client gets the whole body"
    );
    let retry = send(addr, big("big", 4096)).await;
    // Final, unlike the 409 of a request in flight: never retry this key.
    assert_eq!(retry.status, 410);
    assert_eq!(
        problem_type(&retry),
        problem("idempotent-response-not-stored")
    );
    assert_eq!(retry.json()["original_status"], 201);
    assert!(retry.headers.get(header::RETRY_AFTER).is_none());
    assert_eq!(counter.runs(), 1, "never a second execution");
    // Exactly at the limit is kept.
    let edge = send(addr, big("edge", 1024)).await;
    let edge_again = send(addr, big("edge", 1024)).await;
    assert!(replayed(&edge_again) && edge_again.body == edge.body);
    assert_eq!(counter.runs(), 2);
}

async fn streamed_response_is_not_stored(kind: Kind) {
    let env = Env::new(kind).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let handler = move || {
        let r = r.clone();
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            let chunks = futures_stream(vec!["a", "b", "c"]);
            (StatusCode::OK, axum::body::Body::from_stream(chunks))
        }
    };
    let app = Router::new().route("/payments", post(handler).layer(env.replay_layer().await));
    let addr = serve(app).await;
    let first = send(addr, pay("a", "s", "{}")).await;
    assert_eq!((first.status, &first.body[..]), (200, &b"abc"[..]));
    let retry = send(addr, pay("a", "s", "{}")).await;
    assert_eq!(retry.status, 410);
    assert!(retry.headers.get(header::RETRY_AFTER).is_none());
    assert!(retry.json()["detail"]
        .as_str()
        .unwrap()
        .contains("streamed"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

fn futures_stream(
    items: Vec<&'static str>,
) -> impl futures_core::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send {
    struct Iter(std::vec::IntoIter<&'static str>);
    impl futures_core::Stream for Iter {
        type Item = Result<bytes::Bytes, std::io::Error>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            std::task::Poll::Ready(
                self.0
                    .next()
                    .map(|s| Ok(bytes::Bytes::from_static(s.as_bytes()))),
            )
        }
    }
    Iter(items.into_iter())
}

async fn client_gone_mid_handler_the_retry_replays_the_original(kind: Kind) {
    let env = Env::new(kind).await;
    let (app, gate, mut entered) = gated_app(env.replay_layer().await);
    // Tells when the server dropped the request's future (a guard held
    // outside the layer).
    let (dropped_tx, mut dropped) = mpsc::unbounded_channel::<()>();
    let app = app.layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let guard = OnDrop(dropped_tx.clone());
            async move {
                let res = next.run(req).await;
                std::mem::forget(guard);
                res
            }
        },
    ));
    let addr = serve(app).await;

    let first = tokio::spawn(send(addr, pay("a", "k", "{}")));
    entered.recv().await.unwrap();
    // Claimed: a retry meanwhile is told the first one is in flight.
    let busy = send(addr, pay("a", "k", "{}")).await;
    assert_eq!(busy.status, 409, "claimed");
    assert_eq!(problem_type(&busy), problem("idempotency-key-in-flight"));
    first.abort(); // the connection closes while the handler runs
    assert!(first.await.unwrap_err().is_cancelled());
    tokio::time::timeout(Duration::from_secs(5), dropped.recv())
        .await
        .expect("the server drops the request's future when the client goes");
    // The handler was not cancelled with the connection: it finishes (two
    // permits, so a second run could not hang the test either) and its
    // answer is recorded.
    gate.permits.add_permits(2);
    let retry = until_not_in_flight(addr, Duration::from_secs(5), || pay("a", "k", "{}")).await;
    assert_eq!(retry.status, 201);
    assert!(replayed(&retry), "the original's answer: {retry:?}");
    assert_eq!(&retry.body[..], b"run 1 for k");
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1, "one execution");
}

/// Sends on drop: the request's future was dropped before it finished.
struct OnDrop(mpsc::UnboundedSender<()>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

async fn outer_timeout_mid_handler_the_retry_replays_the_original(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let layer = env.replay_layer().await;
    let app = Router::new()
        .route(
            "/payments",
            post(gated).layer(
                tower::ServiceBuilder::new()
                    .layer(axum::error_handling::HandleErrorLayer::new(
                        |_: tower::BoxError| async { StatusCode::GATEWAY_TIMEOUT },
                    ))
                    .layer(tower::timeout::TimeoutLayer::new(Duration::from_millis(
                        200,
                    )))
                    .layer(layer),
            ),
        )
        .with_state(gate.clone());
    let addr = serve(app).await;

    let first = tokio::spawn(send(addr, pay("a", "k", "{}")));
    entered.recv().await.unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.status, 504, "the outer timeout answered");
    // The timeout dropped the layer's future, not the handler.
    gate.permits.add_permits(2);
    let retry = until_not_in_flight(addr, Duration::from_secs(5), || pay("a", "k", "{}")).await;
    assert_eq!(retry.status, 201);
    assert!(replayed(&retry), "the original's answer: {retry:?}");
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1, "one execution");
}

async fn panic_after_the_side_effect_is_recorded_as_500(kind: Kind) {
    let env = Env::new(kind).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let handler = move || {
        let r = r.clone();
        async move {
            if r.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("charged, then crashed (expected in this test)");
            }
            (StatusCode::CREATED, "second run")
        }
    };
    let app = Router::new().route("/payments", post(handler).layer(env.replay_layer().await));
    let addr = serve(app).await;
    let crashed = tokio::spawn(send(addr, pay("a", "k", "{}"))).await;
    let crashed = crashed.expect("an answer, not a dropped connection");
    assert_eq!(crashed.status, 500, "{crashed:?}");
    assert_eq!(problem_type(&crashed), problem("handler-failed"));
    assert!(!replayed(&crashed));
    let retry = send(addr, pay("a", "k", "{}")).await;
    assert_eq!(retry.status, 500);
    assert!(replayed(&retry), "the recorded 500");
    assert_eq!(retry.body, crashed.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one execution");
}

async fn handler_slower_than_ttl_never_runs_twice(kind: Kind) {
    let env = Env::new(kind).await;
    let ttl = Duration::from_millis(600);
    let (app, gate, mut entered) = gated_app(env.replay_layer().await.ttl(ttl));
    let addr = serve(app).await;

    let first = tokio::spawn(send(addr, pay("a", "k", "{}")));
    entered.recv().await.unwrap();
    // Waiting out a time-based expiry: nothing to signal on. Three TTLs:
    // without renewal the claim would be long gone. Two permits, so a
    // second run could not hang the test.
    for _ in 0..3 {
        tokio::time::sleep(ttl).await;
        let retry = tokio::spawn(send(addr, pay("a", "k", "{}")));
        let retry = tokio::time::timeout(Duration::from_secs(2), retry).await;
        let Ok(retry) = retry else {
            gate.permits.add_permits(2);
            panic!("the retry ran beside the first one");
        };
        let retry = retry.unwrap();
        assert_eq!(retry.status, 409, "still in flight: {retry:?}");
    }
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1, "no second execution");
    gate.permits.add_permits(2);
    assert_eq!(first.await.unwrap().status, 201);
    let again = send(addr, pay("a", "k", "{}")).await;
    assert!(replayed(&again));
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1);
}

async fn same_key_other_query_is_422(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    let addr = serve(app(env.replay_layer().await, counter.clone())).await;
    let at = |query: &str| {
        req(
            "POST",
            &format!("/payments?{query}"),
            &[("x-user-id", "a"), ("idempotency-key", "q")],
            "{}",
        )
    };
    assert_eq!(send(addr, at("amount=5")).await.status, 201);
    let other = send(addr, at("amount=500")).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(problem_type(&other), problem("idempotency-key-reused"));
    assert!(replayed(&send(addr, at("amount=5")).await));
    assert_eq!(counter.runs(), 1);
}

async fn see_other_is_replayed(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    let addr = serve(app(env.replay_layer().await, counter.clone())).await;
    let post303 = || {
        req(
            "POST",
            "/payments?status=303",
            &[("x-user-id", "a"), ("idempotency-key", "r")],
            "{}",
        )
    };
    let first = send(addr, post303()).await;
    assert_eq!(first.status, 303);
    let again = send(addr, post303()).await;
    assert_eq!(again.status, 303);
    assert!(replayed(&again), "{again:?}");
    assert_eq!(
        again.headers.get(header::LOCATION),
        first.headers.get(header::LOCATION)
    );
    assert_eq!(counter.runs(), 1, "one execution");
}

async fn optional_key_falls_back_to_parts_and_fingerprint(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    let addr = serve(app(
        env.replay_layer().await.optional_key(),
        counter.clone(),
    ))
    .await;
    let nokey = |body: &str| req("POST", "/payments", &[("x-user-id", "a")], body);

    let first = send(addr, nokey(r#"{"amount":1}"#)).await;
    assert_eq!(first.status, 201);
    let same = send(addr, nokey(r#"{"amount":1}"#)).await;
    assert!(replayed(&same) && same.body == first.body);
    let other = send(addr, nokey(r#"{"amount":2}"#)).await;
    assert!(!replayed(&other) && other.status == 201);
    assert_eq!(counter.runs(), 2);
    // A malformed key is still refused.
    assert_eq!(send(addr, pay("a", "\"bad", "{}")).await.status, 400);
}

async fn request_body_over_limit_is_413(kind: Kind) {
    let env = Env::new(kind).await;
    let counter = Counter::default();
    let addr = serve(app(
        env.replay_layer().await.body_limit(16),
        counter.clone(),
    ))
    .await;
    let r = send(addr, pay("a", "k", &"x".repeat(17))).await;
    assert_eq!(r.status, 413);
    assert_eq!(counter.runs(), 0);
    if let Some(entries) = env.redis_entries() {
        assert_eq!(entries, 0, "nothing claimed");
    }
    // Nothing claimed: the same key with another body runs (no 409, no 422).
    // The handler receives the body byte for byte.
    let ok = send(addr, pay("a", "k", "0123456789abcdef")).await;
    assert_eq!(ok.status, 201, "nothing claimed: {:?}", ok.body);
    assert!(!replayed(&ok));
    assert!(String::from_utf8_lossy(&ok.body).contains("0123456789abcdef"));
}

async fn response_marked_safe_to_retry_frees_the_key(kind: Kind) {
    let env = Env::new(kind).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let handler = move || {
        let r = r.clone();
        async move {
            if r.fetch_add(1, Ordering::SeqCst) == 0 {
                // Nothing was charged: the handler says so.
                (
                    SafeToRetry,
                    (StatusCode::SERVICE_UNAVAILABLE, "card network down"),
                )
                    .into_response()
            } else {
                (StatusCode::CREATED, "charged").into_response()
            }
        }
    };
    let app = Router::new().route("/payments", post(handler).layer(env.replay_layer().await));
    let addr = serve(app).await;
    let failed = send(addr, pay("a", "k", "{}")).await;
    assert_eq!(failed.status, 503);
    let retry = send(addr, pay("a", "k", "{}")).await;
    assert_eq!((retry.status, &retry.body[..]), (201, &b"charged"[..]));
    assert!(!replayed(&retry), "the key was freed: the retry ran");
    assert!(replayed(&send(addr, pay("a", "k", "{}")).await));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

async fn join_bound_runs_out_is_409(kind: Kind) {
    let env = Env::new(kind).await;
    let bound = Duration::from_millis(300);
    let layer = env.replay_layer().await.ttl(Duration::from_secs(60));
    let (app, gate, mut entered) = gated_app(layer.join_timeout(bound));
    let addr = serve(app).await;

    let first = tokio::spawn(send(addr, pay("a", "k", "{}")));
    entered.recv().await.unwrap();
    let started = std::time::Instant::now();
    let busy = send(addr, pay("a", "k", "{}")).await;
    assert!(started.elapsed() >= bound, "waited {:?}", started.elapsed());
    assert_eq!(busy.status, 409);
    assert_eq!(problem_type(&busy), problem("idempotency-key-in-flight"));
    // Nothing learned yet (a fresh layer): as long again as the first has
    // run, like a 409 from the store, not the claim's 60 s TTL.
    assert_eq!(busy.headers[header::RETRY_AFTER], "1", "{busy:?}");
    gate.permits.add_permits(2);
    let first = first.await.unwrap();
    let again = send(addr, pay("a", "k", "{}")).await;
    assert!(replayed(&again) && again.body == first.body);
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1);
}

suite!(
    replay_is_byte_identical_and_skips_handler,
    keys_are_scoped_by_identity_and_route,
    mismatch_is_422,
    missing_or_invalid_key_is_400,
    concurrent_retry_gets_409_then_replay,
    retention_expiry_lets_the_key_run_again,
    server_errors_are_stored_and_transient_4xx_are_not,
    two_layer_instances_share_records,
    record_larger_than_limit_is_not_replayed_nor_rerun,
    streamed_response_is_not_stored,
    client_gone_mid_handler_the_retry_replays_the_original,
    outer_timeout_mid_handler_the_retry_replays_the_original,
    panic_after_the_side_effect_is_recorded_as_500,
    handler_slower_than_ttl_never_runs_twice,
    same_key_other_query_is_422,
    see_other_is_replayed,
    response_marked_safe_to_retry_frees_the_key,
    join_bound_runs_out_is_409,
    optional_key_falls_back_to_parts_and_fingerprint,
    request_body_over_limit_is_413,
    in_flight_retry_after_follows_recent_requests,
);

/// Redis: one hash per key in one slot, no raw data in the key, and one
/// `EVALSHA` per request on the common paths (claim+record, replay,
/// conflict, mismatch), surviving `SCRIPT FLUSH`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_one_round_trip_per_path_and_one_slot() {
    let env = Env::new(Kind::Redis).await;
    let server = env.server.as_ref().unwrap();
    let (app, gate, mut entered) = gated_app(env.replay_layer().await);
    let addr = serve(app).await;
    // EVALSHA plus EVAL (the NOSCRIPT fallback): the scripted round trips.
    let scripted = || -> u64 {
        let stats = server.cli(&["INFO", "commandstats"]);
        ["cmdstat_evalsha:", "cmdstat_eval:"]
            .iter()
            .filter_map(|name| {
                let line = stats.lines().find(|l| l.starts_with(name))?;
                line.split("calls=")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    };
    let others = || -> Vec<String> {
        server
            .cli(&["INFO", "commandstats"])
            .lines()
            .filter(|l| l.starts_with("cmdstat_"))
            .filter_map(|l| l.strip_prefix("cmdstat_")?.split(':').next())
            // Commands the scripts run inside Redis are counted too, and
            // so are fred's connection set-up and the backend's one-off
            // eviction-policy check (`config|get`, once per backend, not per
            // request); `publish` is the record write telling the 409'd
            // duplicate (inside the script); anything else would be an
            // extra round trip.
            .filter(|c| {
                !matches!(
                    *c,
                    "eval"
                        | "evalsha"
                        | "info"
                        | "ping"
                        | "hello"
                        | "script"
                        | "hmget"
                        | "hset"
                        | "hget"
                        | "pexpire"
                        | "pttl"
                        | "del"
                        | "publish"
                        | "config|get"
                        | "command|info"
                        | "time"
                        | "zadd"
                        | "zrem"
                        | "zcard"
                        | "zrange"
                        | "zrangebyscore"
                        | "get"
                        | "incrby"
                        | "decrby"
                ) && !c.starts_with("client|")
            })
            .map(|l| l.to_owned())
            .collect()
    };

    let first = tokio::spawn(send(addr, pay("alice-secret-id", "key-secret", "{}")));
    entered.recv().await.unwrap();
    let before = scripted();
    assert_eq!(
        send(addr, pay("alice-secret-id", "key-secret", "{}"))
            .await
            .status,
        409
    );
    assert_eq!(scripted() - before, 1, "conflict: one round trip");
    let before = scripted();
    assert_eq!(
        send(addr, pay("alice-secret-id", "key-secret", "[]"))
            .await
            .status,
        422
    );
    assert_eq!(scripted() - before, 1, "mismatch: one round trip");
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 201);
    let before = scripted();
    assert!(replayed(
        &send(addr, pay("alice-secret-id", "key-secret", "{}")).await
    ));
    assert_eq!(scripted() - before, 1, "replay: one round trip");
    assert!(others().is_empty(), "only scripts ran: {:?}", others());

    let keys = server.cli(&["--raw", "KEYS", "*"]);
    let mut keys: Vec<&str> = keys.lines().collect();
    keys.sort();
    // Claim and record share one key; the scope's entries and bytes are
    // counted beside it, in the same slot (the scope is the hash tag).
    assert_eq!(keys.len(), 3, "{keys:?}");
    let k = keys[0];
    assert!(k.starts_with("trl:{") && k.ends_with(":idem"), "{k}");
    let tag = &k[..k.find('}').unwrap() + 1];
    assert_eq!(keys[1], format!("{tag}:idem-bytes"));
    assert_eq!(keys[2], format!("{tag}:idem-quota"));
    for k in &keys {
        assert!(!k.contains("alice") && !k.contains("secret"), "{k}");
    }
    let ttl: i64 = server.cli(&["PTTL", k]).parse().unwrap();
    assert!(
        ttl > 23 * 3600 * 1000,
        "kept for the 24 h retention, PTTL {ttl}"
    );

    gate.permits.add_permits(1);
    let before = scripted();
    assert_eq!(send(addr, pay("carol", "fresh", "{}")).await.status, 201);
    assert_eq!(scripted() - before, 2, "first request: claim + record");

    // After SCRIPT FLUSH the NOSCRIPT fallback keeps every path working.
    server.cli(&["SCRIPT", "FLUSH"]);
    assert!(replayed(
        &send(addr, pay("alice-secret-id", "key-secret", "{}")).await
    ));
    gate.permits.add_permits(1);
    assert_eq!(send(addr, pay("bob", "new", "{}")).await.status, 201);
    assert!(replayed(&send(addr, pay("bob", "new", "{}")).await));
}

/// Redis: a renewal of the claim that hangs (the server holds every write
/// back) does not hold the handler back: the handler runs to its end while
/// the renewal waits, and the request is recorded once the server answers.
/// A paused server expires nothing, but a claim whose life has passed by
/// the clock is gone the moment it lets go: a handler held back until its
/// renewal gave up ended after that, its record found no claim, and the
/// retry ran the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_hanging_renewal_does_not_stall_the_handler() {
    let env = Env::new(Kind::Redis).await;
    let server = env.server.as_ref().unwrap();
    // A claim of 600 ms, renewed every 200 ms; a renewal may wait for the
    // server far longer than the claim lives.
    let layer = env
        .replay_layer()
        .await
        .ttl(Duration::from_millis(600))
        .deadline(Duration::from_secs(20));
    let release = Arc::new(tokio::sync::Notify::new());
    let released = release.clone();
    let (ended_tx, mut ended) = mpsc::unbounded_channel::<()>();
    let (entered_tx, mut entered) = mpsc::unbounded_channel::<()>();
    let handler = move |_key: IdempotencyKey| {
        let (released, ended_tx, entered_tx) =
            (released.clone(), ended_tx.clone(), entered_tx.clone());
        async move {
            let _ = entered_tx.send(());
            released.notified().await;
            let _ = ended_tx.send(());
            (StatusCode::CREATED, "charged")
        }
    };
    let app = Router::new().route("/payments", post(handler).layer(layer));
    let addr = serve(app).await;

    let first = tokio::spawn(send(addr, pay("rita", "k1", "{}")));
    entered.recv().await.unwrap();
    server.cli(&["CLIENT", "PAUSE", "30000", "WRITE"]);
    // The renewal's script is held back by the server: a blocked client.
    let held = || {
        server
            .cli(&["INFO", "clients"])
            .lines()
            .find_map(|l| l.strip_prefix("blocked_clients:"))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0)
            > 0
    };
    let renewing = common::eventually(Duration::from_secs(5), held).await;
    release.notify_one();
    let ended_in_time = tokio::time::timeout(Duration::from_secs(3), ended.recv()).await;
    server.cli(&["CLIENT", "UNPAUSE"]);
    assert!(renewing, "the renewal reached the paused server");
    assert!(
        ended_in_time.is_ok(),
        "the handler ran to its end while its claim's renewal waited for the server"
    );
    assert_eq!(first.await.unwrap().status, 201);
    // Run twice, the handler would wait at its gate again: bounded.
    let again = tokio::time::timeout(Duration::from_secs(5), send(addr, pay("rita", "k1", "{}")))
        .await
        .expect("the retry is answered from the record, not run again");
    assert!(replayed(&again), "{again:?}");
}

/// Redis: a scope's bookkeeping (its entries' sorted set and its bytes
/// counter) always has an expiry and outlives every entry it counts: a
/// claim in a fresh scope gives the set the claim's lease; a record pushes
/// both out to the retention; a set lost while a claim runs (evicted, or
/// deleted by a co-tenant) is made again with an expiry by the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_scope_bookkeeping_outlives_its_entries() {
    let env = Env::new(Kind::Redis).await;
    let server = env.server.as_ref().unwrap();
    let (app, gate, mut entered) = gated_app(env.replay_layer().await);
    let addr = serve(app).await;
    let pttl = |suffix: &str| -> i64 {
        let keys = server.cli(&["--raw", "KEYS", &format!("*{suffix}")]);
        let key = keys.lines().next().unwrap_or_default().to_owned();
        match key.is_empty() {
            true => -2,
            false => server.cli(&["PTTL", &key]).trim().parse().unwrap(),
        }
    };
    const DAY_MS: i64 = 23 * 3600 * 1000;

    let first = tokio::spawn(send(addr, pay("dana", "k1", "{}")));
    entered.recv().await.unwrap();
    let claimed = pttl(":idem-quota");
    assert!(
        claimed > 0 && claimed < DAY_MS,
        "a fresh scope's set lives as long as its claim: PTTL {claimed}"
    );
    assert_eq!(pttl(":idem-bytes"), -2, "a claim counts no bytes");
    // Lost while the claim runs: the record makes it again, with an expiry.
    let quota = server.cli(&["--raw", "KEYS", "*:idem-quota"]);
    server.cli(&["DEL", quota.trim()]);
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 201);
    for suffix in [":idem-quota", ":idem-bytes"] {
        let left = pttl(suffix);
        assert!(
            left > DAY_MS,
            "{suffix} kept for the retention: PTTL {left}"
        );
    }

    // A second entry in the same scope: both found, both kept.
    gate.permits.add_permits(1);
    assert_eq!(send(addr, pay("dana", "k2", "{}")).await.status, 201);
    for suffix in [":idem-quota", ":idem-bytes"] {
        let left = pttl(suffix);
        assert!(
            left > DAY_MS,
            "{suffix} kept for the retention: PTTL {left}"
        );
    }
    let quota = server.cli(&["--raw", "KEYS", "*:idem-quota"]);
    let members = server.cli(&["ZCARD", quota.trim()]);
    assert_eq!(members.trim(), "2", "both records counted");
}

/// The store down: 503 problem+json with `Retry-After`, handler not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_503_and_handler_not_run() {
    let mut env = Env::new(Kind::Redis).await;
    let counter = Counter::default();
    let addr = serve(app(env.replay_layer().await, counter.clone())).await;
    env.server.as_mut().unwrap().kill();
    let r = send(addr, pay("a", "k", "{}")).await;
    assert_eq!(r.status, 503);
    assert!(r.headers.get(header::RETRY_AFTER).is_some());
    assert_eq!(counter.runs(), 0);
}

/// The extractor without the layer is a 500 naming the missing layer.
#[tokio::test]
async fn key_extractor_without_layer_names_the_layer() {
    async fn h(_: IdempotencyKey) -> &'static str {
        "unreachable"
    }
    async fn opt(k: Option<IdempotencyKey>, _: HeaderMap) -> String {
        format!("{}", k.is_none())
    }
    let app = Router::new().route("/a", post(h)).route("/b", post(opt));
    let addr = serve(app).await;
    let r = send(addr, req("POST", "/a", &[("idempotency-key", "k")], "")).await;
    assert_eq!(r.status, 500);
    assert!(String::from_utf8_lossy(&r.body).contains("IdempotencyLayer"));
    let r = send(addr, req("POST", "/b", &[("idempotency-key", "k")], "")).await;
    assert_eq!(&r.body[..], b"true");
}

/// Redis unreachable while the handler finishes (the fault proxy swallows
/// every byte): the record write fails, is retried with back-off, and lands
/// once the network is back. Meanwhile the claim stands (never freed
/// early), and the first client gets its answer only after the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_record_write_is_retried_until_stored() {
    let server = common::RedisServer::start();
    let proxy = common::proxy::Proxy::start(server.port()).await;
    let backend = tower_redis_lock::RedisBackend::connect(&proxy.url())
        .await
        .expect("connect through the proxy");
    let layer = IdempotencyLayer::new(
        backend,
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
    .deadline(Duration::from_millis(100))
    .ttl(Duration::from_secs(10));
    let (app, gate, mut entered) = gated_app(layer);
    let addr = serve(app).await;

    let first = tokio::spawn(send(addr, pay("a", "k", "{}")));
    entered.recv().await.unwrap();
    proxy.blackhole(true);
    let before = proxy.chunks_up();
    gate.permits.add_permits(2);
    // Several attempts were sent into the blackhole and failed.
    assert!(
        common::eventually(Duration::from_secs(5), || proxy.chunks_up() >= before + 4).await,
        "the record write is tried again: {} chunks",
        proxy.chunks_up() - before
    );
    // The claim stands meanwhile (looked at directly, not through the proxy).
    let keys = server.cli(&["--raw", "KEYS", "*:idem"]);
    assert_eq!(keys.lines().count(), 1, "{keys}");
    assert_eq!(
        server.cli(&["HGET", keys.trim(), "s"]),
        "p",
        "still claimed"
    );
    assert!(!first.is_finished(), "the answer waits for the record");
    proxy.blackhole(false);
    proxy.close_all();
    let first = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("recorded once Redis is back")
        .unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(server.cli(&["HGET", keys.trim(), "s"]), "d", "recorded");
    let retry = send(addr, pay("a", "k", "{}")).await;
    assert!(replayed(&retry), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1, "one execution");
}

/// Four requests with one key at once, over two instances (two layers on
/// one store: for Redis two clients, as two processes would have): the
/// three duplicates wait for the first one's answer and get it.
fn four_duplicates_over_two_instances_join(kind: Kind) {
    common::run_logged(|logs| async move {
        let env = Env::new(kind).await;
        let (gate, mut entered) = Gate::new();
        let bound = Duration::from_secs(10);
        let instance = |layer: IdempotencyLayer| {
            Router::new()
                .route("/payments", post(gated).layer(layer.join_timeout(bound)))
                .with_state(gate.clone())
        };
        let a = serve(instance(env.replay_layer().await)).await;
        let b = serve(instance(env.replay_layer().await)).await;

        let first = tokio::spawn(send(a, pay("alice", "k", r#"{"amount":5}"#)));
        entered.recv().await.unwrap();
        let dups: Vec<_> = [a, b, b]
            .into_iter()
            .map(|addr| tokio::spawn(send(addr, pay("alice", "k", r#"{"amount":5}"#))))
            .collect();
        // Each duplicate logs once when it starts waiting.
        assert!(
            common::eventually(Duration::from_secs(5), || logs
                .lines_with(&["joining"])
                .len()
                >= 3)
            .await,
            "three duplicates waiting: {}",
            logs.text()
        );
        gate.permits.add_permits(4);
        let first = first.await.unwrap();
        assert_eq!(first.status, 201);
        for dup in dups {
            let dup = dup.await.unwrap();
            assert_eq!(dup.status, 201, "{dup:?}");
            assert_eq!(dup.body, first.body, "the original's answer");
            assert!(replayed(&dup));
        }
        assert_eq!(gate.runs(), 1, "one execution");
    })
}

#[test]
fn memory_four_duplicates_over_two_instances_join() {
    four_duplicates_over_two_instances_join(Kind::Memory)
}

#[test]
fn redis_four_duplicates_over_two_instances_join() {
    four_duplicates_over_two_instances_join(Kind::Redis)
}

/// A response the record's format cannot hold (1,025 values of a stored
/// header, one more than it keeps) goes to its own request whole; a
/// duplicate joined on the same instance gets what the store kept, "not
/// stored" (410), like every later retry (it was handed the whole
/// response as a replay, before).
fn a_joined_duplicate_gets_what_the_store_kept(kind: Kind) {
    common::run_logged(|logs| async move {
        async fn many_links(State(gate): State<Gate>) -> axum::response::Response {
            gate.runs.fetch_add(1, Ordering::SeqCst);
            let _ = gate.entered.send(());
            gate.permits.acquire().await.unwrap().forget();
            let mut res = (StatusCode::CREATED, "charged").into_response();
            for i in 0..1025u32 {
                res.headers_mut().append("link", i.into());
            }
            res
        }
        let env = Env::new(kind).await;
        let (gate, mut entered) = Gate::new();
        let layer = env
            .replay_layer()
            .await
            .store_header(header::LINK)
            .join_timeout(Duration::from_secs(10));
        let app = Router::new()
            .route("/payments", post(many_links).layer(layer))
            .with_state(gate.clone());
        let addr = serve(app).await;
        let first = tokio::spawn(send(addr, pay("alice", "k", "{}")));
        entered.recv().await.unwrap();
        let joined = tokio::spawn(send(addr, pay("alice", "k", "{}")));
        assert!(
            common::eventually(Duration::from_secs(5), || !logs
                .lines_with(&["joining"])
                .is_empty())
            .await,
            "the duplicate waits: {}",
            logs.text()
        );
        gate.permits.add_permits(2);
        let first = first.await.unwrap();
        assert_eq!(first.status, 201);
        assert_eq!(first.headers.get_all(header::LINK).iter().count(), 1025);
        let joined = joined.await.unwrap();
        let later = send(addr, pay("alice", "k", "{}")).await;
        assert_eq!(later.status, 410, "{:?}", later.body);
        assert_eq!(
            joined.status,
            later.status,
            "the joined duplicate was handed {} header lines, replayed: {}",
            joined.headers.len(),
            replayed(&joined)
        );
        assert_eq!(gate.runs(), 1, "one execution");
    })
}

#[test]
fn memory_a_joined_duplicate_gets_what_the_store_kept() {
    a_joined_duplicate_gets_what_the_store_kept(Kind::Memory)
}

#[test]
fn redis_a_joined_duplicate_gets_what_the_store_kept() {
    a_joined_duplicate_gets_what_the_store_kept(Kind::Redis)
}

/// A retry is the same request however it spells its path or splits its
/// cookies (a fingerprinted `Cookie` sent as one line, then as two, as
/// HTTP/2 sends it): it is replayed, not refused as a reuse of its key
/// (422 before: the key parts read the path percent-decoded and the
/// cookies joined, the fingerprint did not).
#[tokio::test]
async fn a_retry_spelled_another_way_is_replayed() {
    let (gate, _entered) = Gate::new();
    gate.permits.add_permits(100);
    let layer = IdempotencyLayer::new(
        tower_redis_lock::MemoryBackend::new(),
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
    .fingerprint_header("cookie");
    let app = Router::new()
        .route("/orders/{id}/pay", post(gated).layer(layer))
        .with_state(gate.clone());
    let addr = serve(app).await;
    let pay_at = |path: &str, cookies: &[&'static str]| {
        let mut headers = vec![("x-user-id", "alice"), ("idempotency-key", "k")];
        headers.extend(cookies.iter().map(|c| ("cookie", *c)));
        req("POST", path, &headers, "{}")
    };
    let first = send(addr, pay_at("/orders/42/pay", &["a=1; b=2"])).await;
    assert_eq!(first.status, 201);
    for (path, cookies) in [
        ("/orders/%34%32/pay", &["a=1; b=2"][..]),
        ("/orders/42/pay", &["a=1", "b=2"][..]),
    ] {
        let again = send(addr, pay_at(path, cookies)).await;
        assert_eq!(again.status, 201, "{path} {cookies:?}: {:?}", again.body);
        assert!(replayed(&again), "{path} {cookies:?}");
        assert_eq!(again.body, first.body);
    }
    assert_eq!(gate.runs(), 1);
}

/// Scripted round trips (`EVALSHA` + `EVAL`) seen by `server` so far.
fn scripted(server: &common::RedisServer) -> u64 {
    server.command_calls("evalsha") + server.command_calls("eval")
}

/// A duplicate joining on the same instance costs no round trip; one
/// joining from another instance costs its claim, and the record reaches it
/// by pub/sub.
#[test]
fn redis_join_round_trips() {
    common::run_logged(|logs| async move {
        let env = Env::new(Kind::Redis).await;
        let server = env.server();
        let (gate, mut entered) = Gate::new();
        // With a secret, a published record is authenticated and answers the
        // joiner at once (without one it is only a wake-up, and the joiner
        // reads the record: one more round trip).
        let space = tower_redis_lock::key::KeySpace::default().secret(b"join round trips");
        let instance = |layer: IdempotencyLayer| {
            Router::new()
                .route(
                    "/payments",
                    post(gated).layer(
                        layer
                            .key_space(space.clone())
                            .join_timeout(Duration::from_secs(10)),
                    ),
                )
                .with_state(gate.clone())
        };
        let a = serve(instance(env.replay_layer().await)).await;
        let b = serve(instance(env.replay_layer().await)).await;

        // Every script loaded once (a first EVALSHA of each is a NOSCRIPT
        // and an EVAL), so that what follows counts round trips only.
        gate.permits.add_permits(1);
        assert_eq!(send(a, pay("alice", "warm-up", "{}")).await.status, 201);
        entered.recv().await.unwrap();

        // Local: the duplicate on instance a.
        let first = tokio::spawn(send(a, pay("alice", "local", "{}")));
        entered.recv().await.unwrap();
        let before = scripted(server);
        let dup = tokio::spawn(send(a, pay("alice", "local", "{}")));
        assert!(
            common::eventually(Duration::from_secs(5), || logs
                .lines_with(&["joining"])
                .len()
                == 1)
            .await
        );
        gate.permits.add_permits(1);
        assert_eq!(first.await.unwrap().status, 201);
        assert!(replayed(&dup.await.unwrap()));
        let local = scripted(server) - before;
        assert_eq!(
            local,
            1,
            "the first one's record write only: a local join costs none: {}",
            logs.text()
        );

        // Remote: the duplicate on instance b, the first held for 1 s.
        let first = tokio::spawn(send(a, pay("alice", "remote", "{}")));
        entered.recv().await.unwrap();
        let before = scripted(server);
        let dup = tokio::spawn(send(b, pay("alice", "remote", "{}")));
        assert!(
            common::eventually(Duration::from_secs(5), || logs
                .lines_with(&["joining"])
                .len()
                == 2)
            .await
        );
        // A handler that takes a second: its length is what is measured.
        tokio::time::sleep(Duration::from_secs(1)).await;
        gate.permits.add_permits(1);
        assert_eq!(first.await.unwrap().status, 201);
        assert!(replayed(&dup.await.unwrap()));
        let remote = scripted(server) - before - 1;
        println!("remote join over a 1 s handler: {remote} round trip(s)");
        assert_eq!(remote, 1, "a remote join costs its claim, no more");

        // With joining on, a first request still costs claim + record, and
        // a replay one round trip.
        gate.permits.add_permits(1);
        let before = scripted(server);
        assert_eq!(send(b, pay("carol", "fresh", "{}")).await.status, 201);
        assert_eq!(
            scripted(server) - before,
            2,
            "first request: claim + record"
        );
        let before = scripted(server);
        assert!(replayed(&send(a, pay("carol", "fresh", "{}")).await));
        assert_eq!(scripted(server) - before, 1, "replay: one round trip");
        assert_eq!(gate.runs(), 4);
    })
}

/// The 409 of a duplicate in flight says when the first request is expected
/// to finish, from how long this route's recent requests took, not the
/// claim's TTL (a minute here).
async fn in_flight_retry_after_follows_recent_requests(kind: Kind) {
    let env = Env::new(kind).await;
    let layer = env.replay_layer().await.ttl(Duration::from_secs(60));
    let (app, gate, mut entered) = gated_app(layer);
    let addr = serve(app).await;
    gate.permits.add_permits(3);
    for i in 0..3 {
        assert_eq!(
            send(addr, pay("alice", &format!("fast-{i}"), "{}"))
                .await
                .status,
            201
        );
        entered.recv().await.unwrap();
    }
    let first = tokio::spawn(send(addr, pay("alice", "slow", "{}")));
    entered.recv().await.unwrap();
    let busy = send(addr, pay("alice", "slow", "{}")).await;
    assert_eq!(busy.status, 409);
    assert_eq!(busy.headers[header::RETRY_AFTER], "1", "{busy:?}");
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 201);
}

/// The key a handler passes on to a payment provider
/// (`IdempotencyKey::downstream`): the same on every instance and every
/// retry of a scoped key, different for two users' same `Idempotency-Key`.
#[tokio::test]
async fn the_downstream_key_is_stable_per_scoped_key_and_differs_between_users() {
    use tower::ServiceExt;
    async fn echo(key: IdempotencyKey) -> String {
        key.downstream().to_owned()
    }
    let app = |store: tower_redis_lock::MemoryBackend| {
        let layer =
            IdempotencyLayer::new(store, (RequestMethod, Header::trusted_identity("x-user")))
                .join_timeout(Duration::from_secs(5))
                .deadline(Duration::from_secs(5));
        Router::new().route("/pay", post(echo).layer(layer))
    };
    // Two instances (no shared records): the same request derives the same key.
    let (one, two) = (
        app(tower_redis_lock::MemoryBackend::new()),
        app(tower_redis_lock::MemoryBackend::new()),
    );
    let req = |user: &str| {
        http::Request::post("/pay")
            .header("x-user", user)
            .header("idempotency-key", "1")
            .body(axum::body::Body::from("{}"))
            .unwrap()
    };
    let body = |res: http::Response<axum::body::Body>| async move {
        String::from_utf8_lossy(
            &axum::body::to_bytes(res.into_body(), 1 << 16)
                .await
                .unwrap(),
        )
        .into_owned()
    };
    let a1 = body(one.clone().oneshot(req("alice")).await.unwrap()).await;
    let a2 = body(two.clone().oneshot(req("alice")).await.unwrap()).await;
    let b = body(one.clone().oneshot(req("bob")).await.unwrap()).await;
    assert!(a1.starts_with("trl-") && a1.len() == 36, "{a1}");
    assert_eq!(a1, a2, "stable across instances and retries");
    assert_ne!(a1, b, "two users' `Idempotency-Key: 1` differ downstream");
}
