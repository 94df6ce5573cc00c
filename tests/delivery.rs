//! Releases are delivered: a request that ended has its release sent whatever
//! its caller's deadline and whatever else was batched with it; a batch that
//! gets no answer does not freeze the backend; a late acquire's cleanup
//! cannot overtake it; a graceful shutdown leaves no lease behind. Every test
//! owns its `redis-server` (and, where the network is the fault, a TCP proxy).

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::proxy::Proxy;
use common::{eventually, req, run, send, serve, until_status, RedisServer};
use tokio::sync::mpsc;
use tower_redis_lock::backend::{Acquire, LockBackend, Token};
use tower_redis_lock::key::UriPath;
use tower_redis_lock::{RedisBackend, RedisLockLayer};

type Gate = common::Gate<()>;

async fn gated(State(gate): State<Gate>) -> &'static str {
    gate.pass(()).await;
    "ok"
}

/// `/pay/{n}` runs `gated`; `/probe/{n}` answers at once; both behind `layer`.
async fn app(layer: RedisLockLayer) -> (SocketAddr, Gate, mpsc::UnboundedReceiver<()>) {
    let (gate, entered) = Gate::new();
    let router = Router::new()
        .route("/pay/{n}", post(gated))
        .route("/probe/{n}", post(|| async { "ok" }))
        .with_state(gate.clone())
        .layer(layer);
    (serve(router).await, gate, entered)
}

fn post_(path: &str) -> http::Request<http_body_util::Full<Bytes>> {
    req("POST", path, &[], "")
}

fn key(n: u8) -> Bytes {
    Bytes::from(format!("trl:{{delivery-{n}}}"))
}

/// Redis stalls (`DEBUG SLEEP 2`, as a fork or a slow command does) while an
/// acquire is on the wire and another request finishes: that request's
/// release waits behind the stalled batch and its 200 ms deadline passes. It
/// must still be sent: once Redis answers again no key is left, and the same
/// request is admitted (on main the batcher dropped the release, the key
/// stayed for the 70 s TTL and the repeat got 409).
#[test]
fn release_behind_a_stalled_batch_is_delivered() {
    run(|| async move {
        let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
        let backend = RedisBackend::connect(&server.url()).await.unwrap();
        let layer = RedisLockLayer::new(backend, UriPath)
            .ttl(Duration::from_secs(70))
            .deadline(Duration::from_millis(200));
        let (addr, gate, mut entered) = app(layer).await;

        let first = tokio::spawn(async move { send(addr, post_("/pay/1")).await.status });
        entered.recv().await.unwrap();
        assert_eq!(server.dbsize(), 1);

        let sleeper = server.debug_sleep(2.0);
        // The first 503 shows the stall began, with that probe's acquire in flight.
        until_status(addr, 503, Duration::from_secs(2), || post_("/probe/1"))
            .await
            .expect("redis stalled");
        gate.permits.add_permits(1);
        // The response waits at most the deadline for its release.
        assert_eq!(first.await.unwrap(), 200);
        assert_eq!(sleeper.join().unwrap(), "OK");

        assert!(
            eventually(Duration::from_secs(3), || server.dbsize() == 0).await,
            "keys left after the stall: {}",
            server.cli(&["KEYS", "*"])
        );
        gate.permits.add_permits(1);
        assert_eq!(send(addr, post_("/pay/1")).await.status, 200);
    });
}

/// Under `maxmemory` with `noeviction`, the acquire (a `SET`) of one request
/// fails with OOM; a release batched after it in the same script call still
/// runs, in that same call (on main `redis.call` aborted the whole batch
/// script and the release failed with it).
#[test]
fn oom_acquire_does_not_block_a_batched_release() {
    run(|| async move {
        let server = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
        let proxy = Proxy::start(server.port()).await;
        let backend = RedisBackend::connect(&proxy.url())
            .await
            .unwrap()
            .local_dedup(false);
        let ttl = Duration::from_secs(70);
        let (held, late, oom) = (Token::generate(), Token::generate(), Token::generate());
        assert!(matches!(
            backend.acquire(&key(1), &held, ttl).await.unwrap(),
            Acquire::Acquired { .. }
        ));
        assert_eq!(server.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
        let calls_before = server.command_calls("evalsha");

        // Hold the batcher: one acquire in flight while Redis is stopped.
        server.pause();
        let sent = proxy.chunks_up();
        let in_flight = {
            let backend = backend.clone();
            tokio::spawn(async move { backend.acquire(&key(2), &late, ttl).await })
        };
        assert!(eventually(Duration::from_secs(2), || proxy.chunks_up() > sent).await);
        // Queue an acquire and then a release: they go out together.
        let mut acquire = backend.acquire(&key(3), &oom, ttl);
        tokio::select! {
            biased;
            _ = &mut acquire => panic!("answered while Redis is stopped"),
            () = std::future::ready(()) => {}
        }
        let mut release = backend.release(&key(1), &held);
        tokio::select! {
            biased;
            _ = &mut release => panic!("answered while Redis is stopped"),
            () = std::future::ready(()) => {}
        }
        server.resume();

        assert!(in_flight.await.unwrap().is_err(), "OOM");
        assert!(acquire.await.is_err(), "OOM");
        assert!(
            release.await.unwrap(),
            "the release ran in spite of the OOM"
        );
        assert_eq!(server.dbsize(), 0);
        // Two script calls: the lone acquire and the batch; no retry.
        assert_eq!(server.command_calls("evalsha") - calls_before, 2);
    });
}
