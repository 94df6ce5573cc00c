//! How many Redis round trips each path costs, counted by the server itself
//! (`INFO commandstats`), over real HTTP on loopback: success = 2 (acquire,
//! release), 409 from another instance = 1, 409 for a duplicate of a lease
//! this instance holds = 0 (local in-flight table).

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use common::{req, send, serve, Conn, RedisServer};
use tokio::sync::{mpsc, Semaphore};
use tower_redis_lock::key::{RequestMethod, UriPath};
use tower_redis_lock::{RedisBackend, RedisLockLayer};

/// Calls per command (`cmdstat_evalsha` ...), including calls from inside Lua.
fn commandstats(redis: &RedisServer) -> BTreeMap<String, u64> {
    redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter_map(|l| {
            let (name, fields) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = fields.split(',').find_map(|f| f.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

/// Round trips the client made. A lone acquire is one `SET` on every
/// server (counted by its `SET`); a release is a script on the script road
/// (Redis 7: `EVALSHA`, or `EVAL` after a `NOSCRIPT`; the rest of
/// commandstats counts calls made inside the scripts, and the release
/// script runs no `SET`) and `DELIFEQ` on the native road (Valkey 9). An
/// acquire inside a script calls `SET` too, and would count twice: for
/// batches, count [`script_calls`].
fn round_trips(redis: &RedisServer) -> u64 {
    let s = commandstats(redis);
    let calls = |name: &str| s.get(name).copied().unwrap_or(0);
    script_calls(redis) + calls("set") + calls("delifeq")
}

/// Scripts the client sent (`EVALSHA`, and `EVAL` after a `NOSCRIPT`).
fn script_calls(redis: &RedisServer) -> u64 {
    let s = commandstats(redis);
    let calls = |name: &str| s.get(name).copied().unwrap_or(0);
    calls("evalsha") + calls("eval")
}

use common::Gate;

/// A backend without the local table, so that every acquire really reaches
/// Redis.
async fn backend_asking_redis(redis: &RedisServer) -> Arc<RedisBackend> {
    Arc::new(
        RedisBackend::connect(&redis.url())
            .await
            .expect("connect")
            .local_dedup(false),
    )
}

/// A handler held at its gate until the test lets it go.
async fn gated(State(gate): State<Gate>) -> &'static str {
    gate.pass(()).await;
    "done"
}

async fn app(redis: &RedisServer) -> (Router, Gate, mpsc::UnboundedReceiver<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let gate = Gate {
        runs: Arc::new(AtomicUsize::new(0)),
        entered: tx,
        permits: Arc::new(Semaphore::new(0)),
    };
    let backend = RedisBackend::connect(&redis.url()).await.expect("connect");
    let router = Router::new()
        .route("/fast/{id}", post(|| async { "ok" }))
        .route("/slow/{id}", post(gated))
        .layer(RedisLockLayer::new(backend, (RequestMethod, UriPath)))
        .with_state(gate.clone());
    (router, gate, rx)
}

#[tokio::test]
async fn success_path_costs_two_round_trips() {
    let redis = RedisServer::start();
    let (router, _, _) = app(&redis).await;
    let addr = serve(router).await;
    let mut conn = Conn::open(addr).await;
    // Warm the script cache so no NOSCRIPT fallback is counted.
    assert_eq!(
        conn.send(req("POST", "/fast/warm", &[], "")).await.status,
        200
    );

    let before = round_trips(&redis);
    const N: u64 = 50;
    for i in 0..N {
        let reply = conn.send(req("POST", &format!("/fast/{i}"), &[], "")).await;
        assert_eq!(reply.status, 200);
    }
    assert_eq!(
        round_trips(&redis) - before,
        2 * N,
        "acquire + release per request"
    );
    assert_eq!(redis.dbsize(), 0, "every lease released");
}

#[tokio::test]
async fn conflict_from_another_instance_costs_one_round_trip() {
    let redis = RedisServer::start();
    let (router_a, gate, mut entered) = app(&redis).await;
    let (router_b, _, _) = app(&redis).await; // second instance, own client
    let (a, b) = (serve(router_a).await, serve(router_b).await);
    let mut warm = Conn::open(b).await;
    assert_eq!(
        warm.send(req("POST", "/fast/warm", &[], "")).await.status,
        200
    );

    let first = tokio::spawn(send(a, req("POST", "/slow/1", &[], "")));
    entered
        .recv()
        .await
        .expect("first request reached the handler");

    let before = round_trips(&redis);
    const N: u64 = 20;
    let mut conn = Conn::open(b).await;
    for _ in 0..N {
        let reply = conn.send(req("POST", "/slow/1", &[], "")).await;
        assert_eq!(reply.status, 409);
        assert!(reply.headers.contains_key("retry-after"));
    }
    assert_eq!(
        round_trips(&redis) - before,
        N,
        "one acquire per rejected request"
    );

    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn duplicate_storm_at_one_instance_costs_no_extra_round_trip() {
    let redis = RedisServer::start();
    let (router, gate, mut entered) = app(&redis).await;
    let addr = serve(router).await;
    let mut warm = Conn::open(addr).await;
    assert_eq!(
        warm.send(req("POST", "/fast/warm", &[], "")).await.status,
        200
    );

    let before = round_trips(&redis);
    let first = tokio::spawn(send(addr, req("POST", "/slow/storm", &[], "")));
    entered
        .recv()
        .await
        .expect("first request reached the handler");
    let after_acquire = round_trips(&redis);
    assert_eq!(after_acquire - before, 1);

    const N: usize = 50;
    let dups: Vec<_> = (0..N)
        .map(|_| tokio::spawn(send(addr, req("POST", "/slow/storm", &[], ""))))
        .collect();
    for d in dups {
        let reply = d.await.unwrap();
        assert_eq!(reply.status, 409);
        let retry: u64 = reply.headers["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=10).contains(&retry), "retry-after {retry}");
    }
    assert_eq!(
        round_trips(&redis),
        after_acquire,
        "duplicates of a lease held here are answered locally"
    );

    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(
        round_trips(&redis) - before,
        2,
        "acquire + release for the whole storm"
    );
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1);

    // The local entry went with the release: the same request is admitted again.
    gate.permits.add_permits(1);
    let again = send(addr, req("POST", "/slow/storm", &[], "")).await;
    assert_eq!(again.status, 200);
    assert_eq!(gate.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn without_local_dedup_every_duplicate_asks_redis() {
    let redis = RedisServer::start();
    let backend = RedisBackend::connect(&redis.url())
        .await
        .expect("connect")
        .local_dedup(false);
    let (gate, mut entered) = Gate::new();
    let router = Router::new()
        .route("/slow/{id}", post(gated))
        .layer(RedisLockLayer::new(backend, (RequestMethod, UriPath)))
        .with_state(gate.clone());
    let addr = serve(router).await;

    let first = tokio::spawn(send(addr, req("POST", "/slow/x", &[], "")));
    entered
        .recv()
        .await
        .expect("first request reached the handler");
    let before = round_trips(&redis);
    let mut conn = Conn::open(addr).await;
    for _ in 0..5 {
        assert_eq!(conn.send(req("POST", "/slow/x", &[], "")).await.status, 409);
    }
    assert_eq!(round_trips(&redis) - before, 5);
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 200);
}

/// Concurrent operations go to Redis as one batch script call, with the same
/// outcome per operation as one script call each: one winner per key, the
/// holder's remaining time for the others, owner-only release, a key of the
/// wrong type failing alone, and `NOSCRIPT` (script cache flushed) handled.
#[tokio::test]
async fn concurrent_operations_are_batched_with_per_operation_outcomes() {
    use std::time::Duration;
    use tower_redis_lock::backend::contract::{Acquire, Token};
    use tower_redis_lock::backend::LockBackend;

    let redis = RedisServer::start();
    let backend = backend_asking_redis(&redis).await;
    let ttl = Duration::from_secs(10);
    redis.cli(&["HSET", "trl:{wrongtype}", "f", "v"]);
    redis.cli(&["SCRIPT", "FLUSH"]);
    let before = script_calls(&redis);
    let pttl = || commandstats(&redis).get("pttl").copied().unwrap_or(0);
    let pttl_before = pttl();

    let shared = bytes::Bytes::from_static(b"trl:{shared}");
    let mut tasks = Vec::new();
    for i in 0..100 {
        let (b, key, token) = (
            backend.clone(),
            bytes::Bytes::from(format!("trl:{{k{i}}}")),
            Token::generate(),
        );
        tasks.push(tokio::spawn(async move {
            (key.clone(), token, b.acquire(&key, &token, ttl).await)
        }));
    }
    for _ in 0..20 {
        let (b, key, token) = (backend.clone(), shared.clone(), Token::generate());
        tasks.push(tokio::spawn(async move {
            (key.clone(), token, b.acquire(&key, &token, ttl).await)
        }));
    }
    let bad = bytes::Bytes::from_static(b"trl:{wrongtype}");
    let wrong = {
        let b = backend.clone();
        let bad = bad.clone();
        tokio::spawn(async move { b.acquire(&bad, &Token::generate(), ttl).await })
    };

    let mut won = Vec::new();
    let mut shared_winners = 0;
    for t in tasks {
        let (key, token, result) = t.await.unwrap();
        match result.expect("no error for a string key") {
            Acquire::Acquired { .. } => {
                if key == shared {
                    shared_winners += 1;
                }
                won.push((key, token));
            }
            Acquire::Held { retry_after } => {
                assert_eq!(key, shared, "only the shared key can be held");
                let left = retry_after.expect("holder's remaining time");
                assert!(
                    left <= ttl && left > ttl - Duration::from_secs(2),
                    "{left:?}"
                );
            }
            other => panic!("unexpected acquire outcome {other:?}"),
        }
    }
    assert_eq!(shared_winners, 1, "exactly one winner for the shared key");
    assert_eq!(won.len(), 101);
    assert!(wrong.await.unwrap().is_err(), "wrong-type key fails alone");
    let calls = script_calls(&redis) - before;
    // The batch script is the script road's; on the native road fred
    // writes queued commands together, and they are counted one by one.
    assert!(
        redis.is_valkey() || calls < 20,
        "121 acquires in {calls} script calls: not batched"
    );
    // Sent as itself, a plain acquire runs no `PTTL` (a holder's time left
    // comes from its token); inside a batch the acquires of the held shared
    // key (19) do.
    let pttls = pttl() - pttl_before;
    assert!(pttls < 20, "{pttls} PTTL calls for 121 acquires");

    // A stranger cannot release; the owners can, again batched.
    assert!(!backend
        .release(&won[0].0, &Token::generate())
        .await
        .unwrap());
    let releases: Vec<_> = won
        .into_iter()
        .map(|(key, token)| {
            let b = backend.clone();
            tokio::spawn(async move { b.release(&key, &token).await })
        })
        .collect();
    for r in releases {
        assert!(r.await.unwrap().expect("release"), "owner releases");
    }
    assert_eq!(redis.dbsize(), 1, "only the wrong-type key is left");
}

/// A response body already whole in memory (axum's `String`, `Json`,
/// `Bytes` answers) is read once inside the response future, so the lease is
/// released before the response is handed to the server, which then writes
/// head and body together; a streamed body keeps the lease until its end.
#[tokio::test]
async fn in_memory_body_is_released_before_the_response_is_handed_over() {
    use http_body_util::BodyExt;
    use tower::{service_fn, ServiceExt};

    let redis = RedisServer::start();
    let backend = RedisBackend::connect(&redis.url()).await.expect("connect");
    let layer = RedisLockLayer::new(backend, (RequestMethod, UriPath));

    let whole = tower::ServiceBuilder::new()
        .layer(layer.clone())
        .service(service_fn(|_req: http::Request<axum::body::Body>| async {
            let mut res = http::Response::new(String::from("paid"));
            res.headers_mut()
                .insert("content-length", http::HeaderValue::from_static("4"));
            Ok::<_, std::convert::Infallible>(res)
        }));
    let res = whole
        .oneshot(
            http::Request::post("/whole")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    // The body holds no lease any more: it is gone from Redis already.
    assert_eq!(
        redis.dbsize(),
        0,
        "released before the response was returned"
    );
    assert_eq!(res.headers()["content-length"], "4");
    assert_eq!(http_body::Body::size_hint(res.body()).exact(), Some(4));
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "paid");

    let streamed = tower::ServiceBuilder::new()
        .layer(layer)
        .service(service_fn(|_req: http::Request<axum::body::Body>| async {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(2);
            tx.send(Ok(bytes::Bytes::from_static(b"pa"))).await.unwrap();
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                let _ = tx.send(Ok(bytes::Bytes::from_static(b"id"))).await;
            });
            let stream = stream_of(rx);
            Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::from_stream(
                stream,
            )))
        }));
    let res = streamed
        .oneshot(
            http::Request::post("/streamed")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    // The body still holds the lease: it is in Redis until the stream ends.
    assert_eq!(redis.dbsize(), 1, "a streamed body holds the lease");
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "paid");
    assert_eq!(redis.dbsize(), 0, "released before the end of the stream");
}

/// An mpsc receiver as a `Stream` (no extra dependency).
fn stream_of<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_core::Stream<Item = T> + Send {
    struct Rx<T>(tokio::sync::mpsc::Receiver<T>);
    impl<T> futures_core::Stream for Rx<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            self.0.poll_recv(cx)
        }
    }
    Rx(rx)
}

/// An acquire sent again with its own token (fred re-sends a command whose
/// reply a lost connection swallowed) is *acquired* and pushes the expiry
/// out, whether it goes out alone (the acquire script) or inside a batch;
/// another token on the same key is *held* with the holder's remaining time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_again_with_own_token_is_acquired_and_extends_alone_and_batched() {
    use std::time::Duration;
    use tower_redis_lock::backend::contract::{Acquire, Token};
    use tower_redis_lock::backend::LockBackend;

    let redis = RedisServer::start();
    let backend = backend_asking_redis(&redis).await;
    let ttl = Duration::from_secs(10);
    let pttl = |key: &str| -> i64 { redis.cli(&["PTTL", key]).trim().parse().expect("PTTL") };

    // Alone: nothing else in flight.
    let key = bytes::Bytes::from_static(b"trl:{alone}");
    let token = Token::generate();
    let first = backend.acquire(&key, &token, ttl).await.expect("acquire");
    assert!(matches!(first, Acquire::Acquired { .. }), "{first:?}");
    redis.cli(&["PEXPIRE", "trl:{alone}", "300"]);
    let again = backend.acquire(&key, &token, ttl).await.expect("again");
    assert!(matches!(again, Acquire::Acquired { .. }), "{again:?}");
    assert!(pttl("trl:{alone}") > 5_000, "expiry pushed out");
    let other = backend
        .acquire(&key, &Token::generate(), ttl)
        .await
        .expect("other");
    match other {
        Acquire::Held { retry_after } => {
            let left = retry_after.expect("holder's remaining time");
            assert!(left > Duration::from_secs(5) && left <= ttl, "{left:?}");
        }
        acquired => panic!("another token must be held out: {acquired:?}"),
    }

    // In a batch: the same re-sent acquire among 40 others at once.
    let key = bytes::Bytes::from_static(b"trl:{batched}");
    let token = Token::generate();
    let first = backend.acquire(&key, &token, ttl).await.expect("acquire");
    assert!(matches!(first, Acquire::Acquired { .. }), "{first:?}");
    redis.cli(&["PEXPIRE", "trl:{batched}", "300"]);
    let trips_before = script_calls(&redis);
    // Redis stopped while the calls are queued: whatever went out first
    // waits for its answer, and the rest queue behind it into a batch,
    // however fast the batching task is.
    redis.pause();
    let mut calls = Vec::new();
    for i in 0..40 {
        let other_key = bytes::Bytes::from(format!("trl:{{other{i}}}"));
        calls.push(backend.acquire(&other_key, &Token::generate(), ttl));
        if i == 20 {
            calls.push(backend.acquire(&key, &token, ttl));
            calls.push(backend.acquire(&key, &Token::generate(), ttl));
        }
    }
    redis.resume();
    // Each call was queued when it was made; awaiting them in turn waits
    // for batches already on their way.
    let mut results = Vec::new();
    for call in calls {
        results.push(call.await);
    }
    let trips = script_calls(&redis) - trips_before;
    // As above: batches are the script road's.
    assert!(
        redis.is_valkey() || trips < 42,
        "the 42 acquires went out in batches ({trips} round trips)"
    );
    for (i, r) in results.iter().enumerate() {
        let r = r.as_ref().expect("no error");
        match i {
            22 => assert!(
                matches!(
                    r,
                    Acquire::Held {
                        retry_after: Some(_)
                    }
                ),
                "{r:?}"
            ),
            _ => assert!(matches!(r, Acquire::Acquired { .. }), "call {i}: {r:?}"),
        }
    }
    assert!(
        pttl("trl:{batched}") > 5_000,
        "expiry pushed out inside a batch"
    );
}
