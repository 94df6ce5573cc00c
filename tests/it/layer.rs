//! The layer's promises, run against both backends: `MemoryBackend` and a
//! real `redis-server` started per test. All traffic is real HTTP over
//! loopback.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::{get, post};
use axum::Router;
use common::{
    admission, req, send, serve, until_status, Conn, Env, Gate, Kind, RedisServer, Tracked,
};
use tower_redis_lock::key::{Header, RequestMethod, Route, UriPath};
use tower_redis_lock::{Lease, MemoryBackend, RedisBackend, RedisLockLayer};

/// A handler held at its gate until the test lets it go.
async fn gated(State(gate): State<Gate>) -> &'static str {
    gate.pass(()).await;
    "done"
}

async fn concurrent_duplicates_run_once(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let app = Router::new()
        .route(
            "/pay",
            post(gated).layer(
                env.layer((RequestMethod, Route, Header::trusted_identity("x-user-id")))
                    .await,
            ),
        )
        .with_state(gate.clone());
    let addr = serve(app).await;

    let first = tokio::spawn(send(
        addr,
        req("POST", "/pay", &[("x-user-id", "alice")], "{}"),
    ));
    entered
        .recv()
        .await
        .expect("first request reached the handler");

    const N: usize = 20;
    let dups: Vec<_> = (0..N - 1)
        .map(|_| {
            tokio::spawn(send(
                addr,
                req("POST", "/pay", &[("x-user-id", "alice")], "{}"),
            ))
        })
        .collect();
    for d in dups {
        let reply = d.await.unwrap();
        assert_eq!(
            reply.status, 409,
            "duplicate must be rejected: {:?}",
            reply.body
        );
        assert_eq!(reply.headers["content-type"], "application/problem+json");
        let retry: u64 = reply.headers["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=10).contains(&retry), "retry-after {retry}");
        assert_eq!(reply.json()["status"], 409);
    }
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(
        gate.runs.load(Ordering::SeqCst),
        1,
        "handler ran exactly once"
    );
    assert_eq!(env.held(), 0, "lease released after completion");
}

async fn different_users_and_bodies_are_admitted(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let layer = env
        .layer((RequestMethod, Route, Header::trusted_identity("x-user-id")))
        .await
        .digest_body()
        .body_limit(1024);
    let app = Router::new()
        .route("/pay", post(gated).layer(layer))
        .with_state(gate.clone());
    let addr = serve(app).await;

    let requests = [("alice", "a"), ("bob", "a"), ("alice", "b"), ("carol", "")];
    let tasks: Vec<_> = requests
        .iter()
        .map(|(user, body)| {
            tokio::spawn(send(
                addr,
                req("POST", "/pay", &[("x-user-id", user)], body),
            ))
        })
        .collect();
    // All four are inside the handler at the same time.
    for _ in 0..requests.len() {
        entered.recv().await.unwrap();
    }
    gate.permits.add_permits(requests.len());
    for t in tasks {
        assert_eq!(t.await.unwrap().status, 200);
    }
    assert_eq!(gate.runs.load(Ordering::SeqCst), 4);
}

async fn two_instances_exclude_each_other(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let key = (RequestMethod, Route, Header::trusted_identity("x-user-id"));
    let app_a = Router::new()
        .route("/pay", post(gated).layer(env.layer(key.clone()).await))
        .with_state(gate.clone());
    let app_b = Router::new()
        .route("/pay", post(gated).layer(env.layer(key).await))
        .with_state(gate.clone());
    let (a, b) = (serve(app_a).await, serve(app_b).await);

    let first = tokio::spawn(send(a, req("POST", "/pay", &[("x-user-id", "u1")], "")));
    entered.recv().await.unwrap();
    let dup = send(b, req("POST", "/pay", &[("x-user-id", "u1")], "")).await;
    assert_eq!(dup.status, 409, "instance B sees instance A's lease");
    let other = tokio::spawn(send(b, req("POST", "/pay", &[("x-user-id", "u2")], "")));
    entered.recv().await.unwrap();
    gate.permits.add_permits(2);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(other.await.unwrap().status, 200);
    // Released: B may now run u1.
    gate.permits.add_permits(1);
    assert_eq!(
        send(b, req("POST", "/pay", &[("x-user-id", "u1")], ""))
            .await
            .status,
        200
    );
    assert_eq!(gate.runs.load(Ordering::SeqCst), 3);
}

async fn sequential_repeats_on_keep_alive_never_conflict(kind: Kind) {
    let env = Env::new(kind).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/pay",
            post(move || {
                let r = r.clone();
                async move {
                    r.fetch_add(1, Ordering::SeqCst);
                    axum::Json(serde_json::json!({"ok": true}))
                }
            }),
        )
        .route(
            "/stream",
            post(|| async { axum::body::Body::from_stream(futures_stream()) }),
        )
        .route("/empty", post(|| async { http::StatusCode::NO_CONTENT }))
        // The order of release and answer is checked, not speed: a deadline
        // that a stall of the loaded CI machine never reaches.
        .layer(
            env.layer((RequestMethod, UriPath))
                .await
                .deadline(Duration::from_secs(5)),
        );
    let addr = serve(app).await;
    let mut conn = Conn::open(addr).await;
    let mut conflicts = 0;
    for path in ["/pay", "/stream", "/empty"] {
        for _ in 0..100 {
            let reply = conn.send(req("POST", path, &[], "same body")).await;
            if reply.status == 409 {
                conflicts += 1;
            }
            assert!(
                reply.status < 300 || reply.status == 409,
                "{path}: {} {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            );
        }
    }
    assert_eq!(
        conflicts, 0,
        "a completed request must never make the next one conflict"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 100);
}

/// Bodies hyper never polls: a HEAD answer (axum swaps the body for an empty
/// one), 204 and 304 with a streamed body (hyper drops it unwritten). The
/// lease must be gone before the head leaves, as for a body read whole.
async fn unpolled_bodies_release_before_the_answer(kind: Kind) {
    let env = Env::new(kind).await;
    let app = Router::new()
        .route(
            "/stream",
            get(|| async { axum::body::Body::from_stream(futures_stream()) }),
        )
        .route(
            "/no-content",
            post(|| async {
                (
                    http::StatusCode::NO_CONTENT,
                    axum::body::Body::from_stream(futures_stream()),
                )
            }),
        )
        .route(
            "/not-modified",
            get(|| async {
                (
                    http::StatusCode::NOT_MODIFIED,
                    axum::body::Body::from_stream(futures_stream()),
                )
            }),
        )
        // What is checked is the order of release and answer, not speed: a
        // deadline that a stall of the loaded CI machine never reaches (with
        // the default 200 ms, one call of these 300 was once answered 503).
        .layer(env.layer(UriPath).await.deadline(Duration::from_secs(5)));
    let addr = serve(app).await;
    let mut conn = Conn::open(addr).await;
    for (method, path, status) in [
        ("HEAD", "/stream", 200),
        ("POST", "/no-content", 204),
        ("GET", "/not-modified", 304),
    ] {
        let mut conflicts = 0;
        for _ in 0..100 {
            let reply = conn.send(req(method, path, &[], "")).await;
            if reply.status == 409 {
                conflicts += 1;
            } else {
                assert_eq!(
                    reply.status,
                    status,
                    "{method} {path}: {}",
                    String::from_utf8_lossy(&reply.body)
                );
            }
        }
        assert_eq!(
            conflicts, 0,
            "{method} {path}: a finished request made the next one conflict"
        );
    }
    assert_eq!(env.held(), 0, "no lease left behind");
}

/// `Retry-After` says when the holder is expected to finish (learned from
/// the layer's recent holds), not how long its TTL is: a 600 ms handler under
/// a 70 s TTL.
async fn retry_after_is_the_expected_remaining_hold(kind: Kind) {
    let env = Env::new(kind).await;
    let (entered_tx, mut entered) = tokio::sync::mpsc::unbounded_channel::<()>();
    let app = Router::new()
        .route(
            "/pay",
            post(move || {
                let entered = entered_tx.clone();
                async move {
                    let _ = entered.send(());
                    // The work itself: 600 ms.
                    tokio::time::sleep(Duration::from_millis(600)).await;
                    "paid"
                }
            }),
        )
        .layer(env.layer(UriPath).await.ttl(Duration::from_secs(70)));
    let addr = serve(app).await;
    let mut conn = Conn::open(addr).await;
    // A few holds to learn from.
    for _ in 0..3 {
        assert_eq!(conn.send(req("POST", "/pay", &[], "")).await.status, 200);
        entered.recv().await.unwrap();
    }
    let first = tokio::spawn(send(addr, req("POST", "/pay", &[], "")));
    entered.recv().await.expect("the first request runs");
    let dup = send(addr, req("POST", "/pay", &[], "")).await;
    assert_eq!(dup.status, 409);
    let retry: u64 = dup.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (1..=2).contains(&retry),
        "Retry-After {retry} s for a 600 ms hold under a 70 s TTL"
    );
    assert_eq!(first.await.unwrap().status, 200);
}

/// A chunked body of unknown length (no Content-Length).
fn futures_stream() -> impl futures_core::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send
{
    let chunks = vec![
        Ok(bytes::Bytes::from_static(b"a")),
        Ok(bytes::Bytes::from_static(b"b")),
    ];
    tokio_stream_iter(chunks)
}

fn tokio_stream_iter<T: Send + 'static>(
    items: Vec<T>,
) -> impl futures_core::Stream<Item = T> + Send {
    struct Iter<T>(std::vec::IntoIter<T>);
    impl<T> futures_core::Stream for Iter<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            std::task::Poll::Ready(self.0.next())
        }
    }
    impl<T> Unpin for Iter<T> {}
    Iter(items.into_iter())
}

async fn released_on_inner_error_disconnect_and_panic(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let app = Router::new()
        .route("/slow", post(gated))
        .route(
            "/panic",
            post(|| async {
                panic!("handler panic (expected by the test)");
                #[allow(unreachable_code)]
                ""
            }),
        )
        .with_state(gate.clone())
        .layer(env.layer((RequestMethod, UriPath)).await);
    let addr = serve(app).await;

    // Client disconnect: the request is in the handler, the client goes away.
    let pending = tokio::spawn(send(addr, req("POST", "/slow", &[], "")));
    entered.recv().await.unwrap();
    assert_eq!(env.held(), 1);
    pending.abort();
    let _ = pending.await;
    assert!(
        common::eventually(Duration::from_secs(3), || env.held() == 0).await,
        "lease released after the client disconnected"
    );
    gate.permits.add_permits(1); // let the orphaned handler finish

    // Handler panic: hyper drops the connection, the lease goes with it.
    let panicked = tokio::spawn(send(addr, req("POST", "/panic", &[], "")));
    let _ = panicked.await; // the connection is closed without a response
    assert!(
        common::eventually(Duration::from_secs(3), || env.held() == 0).await,
        "lease released after the handler panicked"
    );
    gate.permits.add_permits(1);
    assert_eq!(send(addr, req("POST", "/slow", &[], "")).await.status, 200);
}

async fn released_on_inner_service_error(kind: Kind) {
    use tower::{service_fn, Service, ServiceExt};
    let env = Env::new(kind).await;
    let layer = env.layer((RequestMethod, Route)).await;
    let mut svc = tower::ServiceBuilder::new()
        .layer(layer)
        .service(service_fn(|_req: http::Request<axum::body::Body>| async {
            Err::<http::Response<String>, _>(std::io::Error::other("boom"))
        }));
    let req = || {
        http::Request::post("/x")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let err = svc.ready().await.unwrap().call(req()).await.unwrap_err();
    assert_eq!(err.to_string(), "boom");
    // The error is returned only after the release finished.
    assert_eq!(env.held(), 0);
    assert!(svc.ready().await.unwrap().call(req()).await.is_err());
}

async fn body_dropped_early_releases(kind: Kind) {
    use tower::{service_fn, ServiceExt};
    let env = Env::new(kind).await;
    let layer = env.layer((RequestMethod, Route)).await;
    let svc = tower::ServiceBuilder::new()
        .layer(layer)
        .service(service_fn(|_req: http::Request<axum::body::Body>| async {
            // Streamed (two chunks): a body already whole in memory is
            // released before the response is handed over.
            let body = axum::body::Body::from_stream(futures_stream());
            Ok::<_, std::convert::Infallible>(http::Response::new(body))
        }));
    let res = svc
        .clone()
        .oneshot(
            http::Request::post("/x")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(env.held(), 1, "the response body holds the lease");
    drop(res);
    assert!(common::eventually(Duration::from_secs(3), || env.held() == 0).await);
}

async fn per_route_config_and_debounce(kind: Kind) {
    let env = Env::new(kind).await;
    let debounce = env
        .layer((RequestMethod, Route))
        .await
        .ttl(Duration::from_millis(400))
        .hold_until_ttl();
    let normal = env
        .layer((RequestMethod, UriPath))
        .await
        .ttl(Duration::from_secs(5));
    let app = Router::new()
        .route("/submit", post(|| async { "ok" }).layer(debounce))
        .route(
            "/order/{id}",
            post(|lease: Lease| async move { lease.key().unwrap().to_string() }).layer(normal),
        );
    let addr = serve(app).await;

    assert_eq!(
        send(addr, req("POST", "/submit", &[], "")).await.status,
        200
    );
    let started = Instant::now();
    assert_eq!(
        send(addr, req("POST", "/submit", &[], "")).await.status,
        409,
        "debounced"
    );
    // After the debounce window the route admits again.
    let left = Duration::from_secs(3).saturating_sub(started.elapsed());
    let admitted = until_status(addr, 200, left, || req("POST", "/submit", &[], "")).await;
    assert!(admitted.is_some(), "debounce lease expired after its TTL");

    // The other route keys on the concrete path: two ids, two keys.
    let a = send(addr, req("POST", "/order/1", &[], "")).await;
    let b = send(addr, req("POST", "/order/2", &[], "")).await;
    assert_eq!((a.status, b.status), (200, 200));
    assert_ne!(a.body, b.body);
}

async fn body_digest_passes_identical_bytes_and_limits(kind: Kind) {
    let env = Env::new(kind).await;
    let layer = env
        .layer((RequestMethod, Route))
        .await
        .digest_body()
        .body_limit(1024);
    let app = Router::new()
        .route("/echo", post(|body: bytes::Bytes| async move { body }))
        .layer(layer);
    let addr = serve(app).await;

    let payload: String = (0..1000)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let reply = send(addr, req("POST", "/echo", &[], &payload)).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.body,
        payload.as_bytes(),
        "handler got the body byte for byte"
    );

    let big = "x".repeat(1025);
    let reply = send(addr, req("POST", "/echo", &[], &big)).await;
    assert_eq!(reply.status, 413);
    assert_eq!(reply.headers["content-type"], "application/problem+json");
    assert_eq!(env.held(), 0, "no lease taken for a rejected body");
}

async fn missing_identity_rejects_or_skips(kind: Kind) {
    let env = Env::new(kind).await;
    let strict = env
        .layer((RequestMethod, Route, Header::trusted_identity("x-user-id")))
        .await;
    let lenient = strict.clone().skip_missing_part();
    let app = Router::new()
        .route("/strict", post(|| async { "ok" }).layer(strict))
        .route(
            "/lenient",
            post(|lease: Lease| async move { admission(&lease).to_owned() }).layer(lenient),
        );
    let addr = serve(app).await;
    let r = send(addr, req("POST", "/strict", &[], "")).await;
    assert_eq!(r.status, 401);
    assert!(r.json()["detail"].as_str().unwrap().contains("x-user-id"));
    let r = send(addr, req("POST", "/lenient", &[], "")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, "Skipped");
}

/// The `LockBackend` contract, straight against the backend.
async fn backend_contract(kind: Kind) {
    use tower_redis_lock::backend::contract::{Acquire, Token};
    let env = Env::new(kind).await;
    let b = env.backend().await;
    let key = bytes::Bytes::from_static(b"trl:{contract}");
    let (mine, theirs) = (Token::generate(), Token::generate());
    let ttl = Duration::from_secs(5);
    assert_eq!(
        b.acquire(&key, &mine, ttl).await.unwrap(),
        Acquire::acquired(None)
    );
    // A re-sent acquire (lost reply) finds our own token: still acquired.
    assert_eq!(
        b.acquire(&key, &mine, ttl).await.unwrap(),
        Acquire::acquired(None)
    );
    match b.acquire(&key, &theirs, ttl).await.unwrap() {
        Acquire::Held {
            retry_after: Some(left),
        } => {
            assert!(left <= ttl && left > Duration::from_secs(4), "{left:?}")
        }
        other => panic!("expected Held with the remaining time, got {other:?}"),
    }
    assert!(
        !b.release(&key, &theirs).await.unwrap(),
        "only the owner releases"
    );
    assert!(
        !b.extend(&key, &theirs, ttl).await.unwrap(),
        "only the owner extends"
    );
    assert!(b
        .extend(&key, &mine, Duration::from_secs(60))
        .await
        .unwrap());
    if let Some(server) = &env.server {
        let pttl: i64 = server.cli(&["PTTL", "trl:{contract}"]).parse().unwrap();
        assert!(pttl > 5_000, "extended: {pttl}");
        // Scripts flushed (restart, failover): EVALSHA answers NOSCRIPT and
        // the backend falls back to EVAL.
        assert_eq!(server.cli(&["SCRIPT", "FLUSH"]), "OK");
    }
    assert!(b.release(&key, &mine).await.unwrap());
    assert!(
        !b.release(&key, &mine).await.unwrap(),
        "second release is a no-op"
    );
    assert_eq!(
        b.acquire(&key, &theirs, ttl).await.unwrap(),
        Acquire::acquired(None)
    );
    assert_eq!(env.held(), 1);
}

suite!(
    backend_contract,
    concurrent_duplicates_run_once,
    different_users_and_bodies_are_admitted,
    two_instances_exclude_each_other,
    sequential_repeats_on_keep_alive_never_conflict,
    unpolled_bodies_release_before_the_answer,
    retry_after_is_the_expected_remaining_hold,
    released_on_inner_error_disconnect_and_panic,
    released_on_inner_service_error,
    body_dropped_early_releases,
    per_route_config_and_debounce,
    body_digest_passes_identical_bytes_and_limits,
    missing_identity_rejects_or_skips,
);

// ---- Redis-only: the server goes away --------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_gives_503_within_deadline_then_recovers() {
    let mut server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let deadline = Duration::from_millis(150);
    let app = Router::new()
        .route("/pay", post(|| async { "ok" }))
        .route(
            "/open",
            post(|lease: Lease| async move { admission(&lease).to_owned() }),
        )
        .layer(RedisLockLayer::new(backend.clone(), (RequestMethod, UriPath)).deadline(deadline));
    let open_app = Router::new()
        .route(
            "/open",
            post(|lease: Lease| async move { admission(&lease).to_owned() }),
        )
        .layer(
            RedisLockLayer::new(backend, (RequestMethod, Route))
                .deadline(deadline)
                .fail_open(),
        );
    let addr = serve(app).await;
    let open_addr = serve(open_app).await;
    assert_eq!(send(addr, req("POST", "/pay", &[], "")).await.status, 200);

    server.kill();
    for _ in 0..5 {
        let started = Instant::now();
        let r = send(addr, req("POST", "/pay", &[], "")).await;
        let took = started.elapsed();
        assert_eq!(r.status, 503);
        assert_eq!(r.headers["retry-after"], "1");
        assert_eq!(r.headers["content-type"], "application/problem+json");
        assert!(
            took < deadline + Duration::from_millis(300),
            "answered in {took:?}"
        );
    }
    let r = send(open_addr, req("POST", "/open", &[], "")).await;
    assert_eq!(
        (r.status, &r.body[..]),
        (200, &b"FailOpen"[..]),
        "fail-open runs unlocked"
    );

    server.restart();
    let started = Instant::now();
    let recovered = until_status(addr, 200, Duration::from_secs(10), || {
        req("POST", "/pay", &[], "")
    })
    .await;
    if recovered.is_none() {
        // Say what stands in the way: the layer's last answer, and the
        // connections the restarted server sees.
        let last = send(addr, req("POST", "/pay", &[], "")).await;
        let clients = server.cli(&["CLIENT", "LIST"]);
        panic!(
            "admitted again after Redis restarted: still {} {} after {:?}; the server's clients:\n{clients}",
            last.status,
            String::from_utf8_lossy(&last.body),
            started.elapsed(),
        );
    }
    println!("recovered {:?} after restart", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_during_request_still_answers() {
    let mut server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let (gate, mut entered) = Gate::new();
    let app = Router::new()
        .route("/pay", post(gated))
        .with_state(gate.clone())
        .layer(
            RedisLockLayer::new(backend, (RequestMethod, Route))
                .deadline(Duration::from_millis(150)),
        );
    let addr = serve(app).await;
    let inflight = tokio::spawn(send(addr, req("POST", "/pay", &[], "")));
    entered.recv().await.unwrap();
    server.kill();
    gate.permits.add_permits(1);
    let started = Instant::now();
    let reply = inflight.await.unwrap();
    assert_eq!(reply.status, 200, "the admitted request keeps its response");
    assert_eq!(reply.body, "done");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "release failure bounded by the deadline"
    );
    let r = send(addr, req("POST", "/pay", &[], "")).await;
    assert_eq!(r.status, 503);
}

#[tokio::test]
async fn lease_extractor_without_layer_names_the_layer() {
    let app = Router::new().route("/", get(|_: Lease| async { "never" }));
    let addr = serve(app).await;
    let r = send(addr, req("GET", "/", &[], "")).await;
    assert_eq!(r.status, 500);
    assert!(String::from_utf8_lossy(&r.body).contains("RedisLockLayer"));
}

// ---- Wiring: route_layer, plain hyper, extractors, custom answers ----------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_layer_uses_the_route_template() {
    let backend = Tracked::new(MemoryBackend::new());
    let (gate, mut entered) = Gate::new();
    let app = Router::new()
        .route("/orders/{id}", post(gated))
        .route_layer(RedisLockLayer::new(backend.clone(), (RequestMethod, Route)))
        .with_state(gate.clone());
    let addr = serve(app).await;
    let first = tokio::spawn(send(addr, req("POST", "/orders/1", &[], "")));
    entered.recv().await.unwrap();
    // Same template, other id: the same key (Route is the template).
    assert_eq!(
        send(addr, req("POST", "/orders/2", &[], "")).await.status,
        409
    );
    // route_layer does not run for unmatched paths: 404, not a lock.
    assert_eq!(send(addr, req("POST", "/nope", &[], "")).await.status, 404);
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(
        backend.acquired_keys(),
        1,
        "one key for both ids, none for the unmatched path"
    );
    assert_eq!(backend.held(), 0, "released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_hyper_service_with_incoming_bodies() {
    use http_body_util::{BodyExt, Full};
    use hyper::body::Incoming;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::server::conn::auto;
    use hyper_util::service::TowerToHyperService;

    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let (gate, mut entered) = Gate::new();
    let g = gate.clone();
    let handler = tower::service_fn(move |req: http::Request<Incoming>| {
        let g = g.clone();
        async move {
            let body = req.into_body().collect().await?.to_bytes();
            g.runs.fetch_add(1, Ordering::SeqCst);
            let _ = g.entered.send(());
            g.permits.acquire().await.unwrap().forget();
            Ok::<_, hyper::Error>(http::Response::new(Full::new(body)))
        }
    });
    let svc = tower::ServiceBuilder::new()
        // `Incoming` cannot be rebuilt from bytes, so the layer cannot
        // buffer it: stream it to the handler (map it to axum's `Body` to
        // keep the default, a lease only once the body is in).
        .layer(
            RedisLockLayer::new(
                backend,
                (
                    RequestMethod,
                    UriPath,
                    Header::trusted_identity("x-user-id"),
                ),
            )
            .stream_body(),
        )
        .service(handler);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let svc = TowerToHyperService::new(svc.clone());
            tokio::spawn(async move {
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });

    let first = tokio::spawn(send(
        addr,
        req("POST", "/h", &[("x-user-id", "a")], "hello"),
    ));
    entered.recv().await.unwrap();
    assert_eq!(
        send(addr, req("POST", "/h", &[("x-user-id", "a")], "hello"))
            .await
            .status,
        409
    );
    gate.permits.add_permits(1);
    let reply = first.await.unwrap();
    assert_eq!((reply.status, &reply.body[..]), (200, &b"hello"[..]));
    gate.permits.add_permits(1);
    assert_eq!(
        send(addr, req("POST", "/h", &[("x-user-id", "a")], "again"))
            .await
            .status,
        200
    );
    assert_eq!(gate.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_guard_extractor_and_locker() {
    use tower_redis_lock::lock::{LockGuard, Locker};

    #[derive(Clone)]
    struct AppState {
        locker: Locker,
        gate: Gate,
    }
    impl axum::extract::FromRef<AppState> for Locker {
        fn from_ref(s: &AppState) -> Locker {
            s.locker.clone()
        }
    }
    async fn handler(State(s): State<AppState>, guard: LockGuard) -> String {
        assert!(guard.lease().is_locked());
        let remaining = guard.lease().remaining();
        s.gate.runs.fetch_add(1, Ordering::SeqCst);
        let _ = s.gate.entered.send(());
        s.gate.permits.acquire().await.unwrap().forget();
        assert!(guard.release().await, "still ours at the end");
        format!("{}", remaining.as_millis())
    }

    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let locker = RedisLockLayer::new(
        backend,
        (
            RequestMethod,
            UriPath,
            Header::trusted_identity("x-user-id"),
        ),
    )
    .ttl(Duration::from_secs(5))
    .locker();
    let (gate, mut entered) = Gate::new();
    let app = Router::new()
        .route("/x", post(handler))
        .with_state(AppState {
            locker: locker.clone(),
            gate: gate.clone(),
        });
    let addr = serve(app).await;

    let first = tokio::spawn(send(addr, req("POST", "/x", &[("x-user-id", "a")], "")));
    entered.recv().await.unwrap();
    let dup = send(addr, req("POST", "/x", &[("x-user-id", "a")], "")).await;
    assert_eq!(dup.status, 409);
    assert_eq!(dup.headers["content-type"], "application/problem+json");
    let anon = send(addr, req("POST", "/x", &[], "")).await;
    assert_eq!(anon.status, 401);
    gate.permits.add_permits(1);
    let ok = first.await.unwrap();
    assert_eq!(ok.status, 200);
    let remaining: u64 = String::from_utf8_lossy(&ok.body).parse().unwrap();
    assert!(
        remaining > 4000 && remaining <= 5000,
        "remaining {remaining} ms"
    );
    assert_eq!(server.dbsize(), 0, "released by the handler");

    // Locker with a key built from parsed data.
    let key = locker.key_with(|k| k.push("order", b"42"));
    let guard = locker.lock(key).await.unwrap();
    let err = locker.lock(key).await.unwrap_err();
    assert_eq!(err.status(), 409);
    drop(guard);
    assert!(common::eventually(Duration::from_secs(3), || server.dbsize() == 0).await);
    assert!(locker.lock(key).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_rejection_response() {
    let backend = MemoryBackend::new();
    let (gate, mut entered) = Gate::new();
    let layer = RedisLockLayer::new(backend, (RequestMethod, Route)).on_rejection(|r| {
        (
            http::StatusCode::TOO_MANY_REQUESTS,
            format!("custom {}", r.kind()),
        )
    });
    let app = Router::new()
        .route("/x", post(gated).layer(layer))
        .with_state(gate.clone());
    let addr = serve(app).await;
    let first = tokio::spawn(send(addr, req("POST", "/x", &[], "")));
    entered.recv().await.unwrap();
    let r = send(addr, req("POST", "/x", &[], "")).await;
    assert_eq!((r.status, &r.body[..]), (429, &b"custom conflict"[..]));
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_bytes_and_large_headers_are_answered_not_panicked() {
    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/x",
            post(move || {
                let r = r.clone();
                async move {
                    r.fetch_add(1, Ordering::SeqCst);
                    "ok"
                }
            }),
        )
        .layer(
            RedisLockLayer::new(
                backend,
                (RequestMethod, Route, Header::trusted_identity("x-user-id")),
            )
            .digest_body()
            .body_limit(256),
        );
    let addr = serve(app).await;

    // Non-UTF-8 identity with braces, a colon and a tab (the bytes hyper lets through).
    let odd = http::HeaderValue::from_bytes(b"\xff\xfe{slot}:\t caf\xe9").unwrap();
    let mut request = req("POST", "/x", &[], "{\"a\":\"\\u0000\"}");
    request.headers_mut().insert("x-user-id", odd);
    assert_eq!(send(addr, request).await.status, 200);
    // The stored key never contains the raw value: only prefix:{hex}.
    let keys_seen = server.cli(&["--scan"]);
    assert!(keys_seen.is_empty(), "released: {keys_seen}");

    // A 100 KiB identity header is hashed like any other (hyper's own limit
    // answers anything larger with 431 before the layer runs).
    let big = "u".repeat(100 * 1024);
    let r = send(addr, req("POST", "/x", &[("x-user-id", &big)], "")).await;
    assert!(r.status == 200 || r.status == 431, "status {}", r.status);

    // Body over the digest limit: 413 problem+json, handler not run.
    let before = runs.load(Ordering::SeqCst);
    let r = send(
        addr,
        req("POST", "/x", &[("x-user-id", "a")], &"z".repeat(300)),
    )
    .await;
    assert_eq!(r.status, 413);
    assert_eq!(runs.load(Ordering::SeqCst), before);
}
