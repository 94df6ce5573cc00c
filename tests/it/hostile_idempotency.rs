//! The idempotency layer against hostile clients and co-tenants of Redis,
//! over real HTTP on loopback against real `redis-server`s: one client
//! flooding the store, a co-tenant who can `HSET` a record or `PUBLISH` on
//! its channel. Nobody may make another user's retry run again, a forged or
//! poisoned record is never replayed and never kills a connection or the
//! subscriber, and a replay carries only the headers the layer stores.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::{pay, replayed, send, serve, RedisServer};
use http::StatusCode;
use tower_redis_lock::key::{Header, KeySpace, RequestMethod, Route};
use tower_redis_lock::{IdempotencyLayer, MemoryBackend, RedisBackend};

/// Executions of the handler, and a gate that holds it until released.
#[derive(Clone)]
struct App {
    runs: Arc<AtomicUsize>,
    gate: Arc<tokio::sync::Semaphore>,
    entered: tokio::sync::mpsc::UnboundedSender<()>,
}

/// A payment that echoes its request body (as the `payments` example echoes
/// its currency): a large body makes a large record.
async fn pay_handler(State(app): State<App>, body: Bytes) -> impl IntoResponse {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let _ = app.entered.send(());
    app.gate.acquire().await.unwrap().forget();
    (
        StatusCode::CREATED,
        [("set-cookie", "session=handler")],
        [format!("payment {n}:").into_bytes(), body.to_vec()].concat(),
    )
}

fn app(
    layer: IdempotencyLayer,
    open: bool,
) -> (Router, App, tokio::sync::mpsc::UnboundedReceiver<()>) {
    let (entered, rx) = tokio::sync::mpsc::unbounded_channel();
    let state = App {
        runs: Arc::default(),
        gate: Arc::new(tokio::sync::Semaphore::new(if open { 1 << 20 } else { 0 })),
        entered,
    };
    let router = Router::new()
        .route("/payments", post(pay_handler).layer(layer))
        .with_state(state.clone());
    (router, state, rx)
}

fn layer(backend: impl tower_redis_lock::backend::IdempotencyBackend) -> IdempotencyLayer {
    IdempotencyLayer::new(
        backend,
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
}

/// A body limit set in front of the layer (`http_body_util::Limited`, as
/// tower-http's `RequestBodyLimitLayer` wraps it) cuts the body off while
/// the layer reads it: 413, nothing claimed or run.
#[tokio::test]
async fn a_body_cut_off_by_a_limit_in_front_is_413() {
    let (router, state, _entered) = app(layer(MemoryBackend::new()), true);
    let router = router.layer(axum::middleware::map_request(
        |req: axum::extract::Request| async move {
            req.map(|body| axum::body::Body::new(http_body_util::Limited::new(body, 100)))
        },
    ));
    let addr = serve(router).await;
    let reply = send(addr, pay("u1", "k1", &"x".repeat(2000))).await;
    assert_eq!(reply.status, 413);
    let kind = reply.json()["type"].as_str().unwrap_or("").to_owned();
    assert!(kind.ends_with("#payload-too-large"), "{kind}");
    assert_eq!(state.runs.load(Ordering::SeqCst), 0);
    // Nothing was claimed: the same key with a small body runs.
    assert_eq!(send(addr, pay("u1", "k1", "{}")).await.status, 201);
    assert_eq!(state.runs.load(Ordering::SeqCst), 1);
}

/// One identity floods with large distinct payments: it is held to its
/// share (429), and another user's completed payment is still replayed,
/// never run again.
async fn flood_cannot_make_another_users_retry_run_again(
    layer: IdempotencyLayer,
    server: Option<&RedisServer>,
) {
    let (router, app, _entered) = app(layer, true);
    let addr = serve(router).await;
    let victim = send(addr, pay("victim", "victim-key", "{\"amount\":500}")).await;
    assert_eq!(victim.status, 201);
    let memory_before = server.map(used_memory);

    let big = format!("{{\"currency\":\"{}\"}}", "E".repeat(60 * 1024 - 20));
    let (mut created, mut limited) = (0, 0);
    for i in 0..300 {
        let r = send(addr, pay("mallory", &format!("flood-{i}"), &big)).await;
        match r.status {
            201 => created += 1,
            429 => {
                limited += 1;
                assert!(r.headers.get("retry-after").is_some(), "{r:?}");
                assert_eq!(r.json()["status"], 429);
            }
            other => panic!("flood request answered {other}: {r:?}"),
        }
    }
    let retry = send(addr, pay("victim", "victim-key", "{\"amount\":500}")).await;
    assert!(
        replayed(&retry),
        "the victim's payment is replayed: {retry:?}"
    );
    assert_eq!(retry.body, victim.body);
    assert_eq!(
        app.runs.load(Ordering::SeqCst),
        1 + created,
        "the victim's payment ran once"
    );
    if let (Some(server), Some(before)) = (server, memory_before) {
        let grown = used_memory(server).saturating_sub(before);
        println!(
            "one identity, 300 x 60 KiB payments: {created} stored, {limited} refused (429), \
             Redis used_memory grew {} KiB",
            grown / 1024
        );
        assert!(
            grown < 3 * 1024 * 1024,
            "the flood is held to its 1 MiB share: grew {grown} bytes"
        );
    }
    assert!(limited > 0, "the flood met its quota ({created} stored)");
    assert!(created < 40, "at most its share: {created} stored");

    // Other users still pay.
    assert_eq!(send(addr, pay("carol", "c-1", "{}")).await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_flood_cannot_make_another_users_retry_run_again() {
    // A store of 8 MiB: on 0.2, a full store evicted the oldest records of
    // any user, here the victim's.
    let backend = MemoryBackend::new().idempotency_byte_limit(8 * 1024 * 1024);
    flood_cannot_make_another_users_retry_run_again(layer(backend), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_flood_cannot_make_another_users_retry_run_again() {
    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    flood_cannot_make_another_users_retry_run_again(layer(backend), Some(&server)).await;
}

fn used_memory(server: &RedisServer) -> u64 {
    let info = server.cli(&["INFO", "memory"]);
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory in INFO")
}

/// The one entry key of the payment (`prefix:{scope}:digest:idem`).
fn entry_key(server: &RedisServer) -> String {
    let keys = server.cli(&["--raw", "KEYS", "trl:{*:idem"]);
    let keys: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    keys[0].to_owned()
}

/// A record in the crate's encoding: a 200 with the given headers and body.
fn encoded(headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = vec![b'R', 1, 0, 200];
    out.extend_from_slice(&(headers.len() as u16).to_be_bytes());
    for (name, value) in headers {
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value.as_bytes());
    }
    out.extend_from_slice(body);
    out
}

/// `redis-cli -x`: the last argument from standard input, byte for byte.
fn cli_with_bytes(server: &RedisServer, args: &[&str], last: &[u8]) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new("redis-cli")
        .args(["-p", &server.port().to_string(), "-x"])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("redis-cli");
    child.stdin.take().unwrap().write_all(last).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A co-tenant overwrites a completed record (`HSET key r <bytes>`): a
/// poison that once panicked the decoder, a forged response with a cookie.
/// The retry gets a proper answer (503 problem+json for what cannot be
/// trusted), never a dropped connection, never the forgery, and the handler
/// does not run again. Without a secret a well-formed forgery cannot be told
/// apart, but it is replayed with the stored headers only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_written_by_a_co_tenant_are_untrusted() {
    let poison: &[u8] = b"R\x01\x00\xc8\x60\x01";
    let forged = encoded(
        &[
            ("content-type", "text/html"),
            ("set-cookie", "session=attacker"),
            ("x-forged", "1"),
        ],
        b"<h1>forged</h1>",
    );
    for secret in [true, false] {
        let server = RedisServer::start();
        let backend = RedisBackend::connect(&server.url()).await.unwrap();
        let mut layer = layer(backend);
        if secret {
            layer = layer.key_space(KeySpace::default().secret(b"co-tenant test -"));
        }
        let (router, app, _entered) = app(layer, true);
        let addr = serve(router).await;
        let first = send(addr, pay("alice", "k", "{}")).await;
        assert_eq!(first.status, 201);
        assert!(
            first.headers.get("set-cookie").is_some(),
            "the first client gets it"
        );
        let retry = send(addr, pay("alice", "k", "{}")).await;
        assert!(replayed(&retry));
        assert!(
            retry.headers.get("set-cookie").is_none(),
            "not a stored header"
        );
        let key = entry_key(&server);

        assert_eq!(cli_with_bytes(&server, &["HSET", &key, "r"], poison), "0");
        let r = send(addr, pay("alice", "k", "{}")).await;
        assert_eq!(r.status, 503, "secret {secret}: {r:?}");
        assert_eq!(r.headers["content-type"], "application/problem+json");

        assert_eq!(cli_with_bytes(&server, &["HSET", &key, "r"], &forged), "0");
        let r = send(addr, pay("alice", "k", "{}")).await;
        if secret {
            assert_eq!(r.status, 503, "a forgery fails authentication: {r:?}");
        } else {
            assert_eq!(r.status, 200, "{r:?}");
            assert!(r.headers.get("set-cookie").is_none(), "{r:?}");
            assert!(r.headers.get("x-forged").is_none(), "{r:?}");
            assert_eq!(r.headers["content-type"], "text/html");
        }
        assert_eq!(app.runs.load(Ordering::SeqCst), 1, "never run again");
    }
}

/// Two instances on one Redis: a duplicate waits on B while A runs. A
/// co-tenant publishes a forged record, and a poison, on the entry's
/// channel and on other `:idem` channels. B never answers with the forgery;
/// the subscriber survives, and B answers with A's real record as soon as
/// A completes, well before the join bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_publications_never_answer_a_waiting_duplicate() {
    let forged = encoded(&[("set-cookie", "session=attacker")], b"<h1>forged</h1>");
    for secret in [false, true] {
        let server = RedisServer::start();
        let bound = Duration::from_secs(8);
        let instance = || async {
            let backend = RedisBackend::connect(&server.url()).await.unwrap();
            let mut l = layer(backend).join_timeout(bound);
            if secret {
                l = l.key_space(KeySpace::default().secret(b"publish test ---"));
            }
            l
        };
        let (router_a, app_a, mut entered) = app(instance().await, false);
        let (router_b, _app_b, _) = app(instance().await, false);
        let (a, b) = (serve(router_a).await, serve(router_b).await);

        let first = tokio::spawn(send(a, pay("alice", "k", "{}")));
        entered.recv().await.unwrap();
        let dup = tokio::spawn(send(b, pay("alice", "k", "{}")));
        // B marks the entry as waited for in its claim (`w`).
        let key = entry_key(&server);
        let waiting = common::eventually(Duration::from_secs(5), || {
            server.cli(&["HGET", &key, "w"]) == "1"
        })
        .await;
        assert!(waiting, "the duplicate waits");
        for channel in [key.as_str(), "x:idem", "trl:{x}:y:idem"] {
            cli_with_bytes(&server, &["PUBLISH", channel], b"R\x01\x00\xc8\x60\x01");
            cli_with_bytes(&server, &["PUBLISH", channel], &forged);
        }
        // Given time to act on the forgery, B still waits.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!dup.is_finished(), "secret {secret}: answered by a forgery");
        let released = Instant::now();
        app_a.gate.add_permits(1);
        let first = first.await.unwrap();
        let dup = dup.await.unwrap();
        assert_eq!(first.status, 201);
        assert!(replayed(&dup), "{dup:?}");
        assert_eq!(dup.body, first.body, "A's real answer");
        assert!(dup.headers.get("set-cookie").is_none());
        assert!(
            released.elapsed() < Duration::from_secs(3),
            "answered as A completed, not at the bound: {:?}",
            released.elapsed()
        );
        assert_eq!(app_a.runs.load(Ordering::SeqCst), 1);
    }
}
