//! `RedlockBackend` on real, independent `redis-server`s, through the public
//! API. The checks that need the crate-private detail (the validity of a
//! lease, the votes counted, the quorum, the error kind: 3 and 5 nodes with a
//! minority and then a majority killed, a stalled node) are unit tests in
//! `src/backend/redlock/tests.rs`.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::{eventually, hold_port, reached_every, req, send, serve, RedisServer};
use tower_redis_lock::backend::contract::{Acquire, BackendFuture, Token};
use tower_redis_lock::backend::{Backend, LockBackend, RedlockBackend};
use tower_redis_lock::key::{Header, RequestMethod, Route};
use tower_redis_lock::RedisLockLayer;

fn servers(n: usize) -> Vec<RedisServer> {
    (0..n).map(|_| RedisServer::start()).collect()
}

/// Connected to every node: `connect` returns once a quorum is, so a probe
/// lease is taken and seen on every server before the test begins.
async fn redlock(servers: &[RedisServer]) -> RedlockBackend {
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    let r = RedlockBackend::connect(&urls)
        .await
        .expect("connect to the redlock nodes");
    let token = Token::generate();
    let probe = format!("trl:{{probe}}:{}", String::from_utf8_lossy(&token.to_hex()));
    let _ = r.acquire(&Bytes::from(probe.clone()), &token, TTL).await;
    let everywhere = reached_every(servers, &probe, Duration::from_secs(5)).await;
    assert!(everywhere, "every node took the probe lease");
    r
}

const TTL: Duration = Duration::from_secs(30);

#[tokio::test]
async fn partial_acquire_is_released_and_answers_held() {
    let nodes = servers(3);
    let r = redlock(&nodes).await;
    let key = "trl:{partial}";
    // Another owner (an instance with the same TTL) holds two of the three
    // nodes: its token tells how long it has left.
    let theirs = Token::generate().to_hex();
    let theirs = std::str::from_utf8(&theirs).unwrap();
    for s in &nodes[..2] {
        assert_eq!(s.cli(&["SET", key, theirs, "PX", "30000"]), "OK");
    }
    let got = r
        .acquire(&Bytes::from_static(key.as_bytes()), &Token::generate(), TTL)
        .await
        .unwrap();
    assert!(
        matches!(got, Acquire::Held { retry_after: Some(d) } if d > Duration::from_secs(25) && d <= TTL),
        "{got:?}"
    );
    let released = eventually(Duration::from_secs(2), || nodes[2].dbsize() == 0).await;
    assert!(released, "the one vote we got is given back");
    for s in &nodes[..2] {
        assert_eq!(s.cli(&["GET", key]), theirs, "others' votes untouched");
    }
}

#[tokio::test]
async fn connect_names_unreachable_nodes() {
    let live = RedisServer::start();
    // Ports held (bound, never listening) for the whole test: a connection
    // to them is refused, and no server another test starts can take one.
    let held: Vec<_> = (0..2)
        .map(|_| hold_port(0).expect("a loopback port"))
        .collect();
    let dead: Vec<u16> = held
        .iter()
        .map(|s| s.local_addr().unwrap().port())
        .collect();
    let urls = [
        live.url(),
        format!("redis://127.0.0.1:{}", dead[0]),
        format!("redis://127.0.0.1:{}", dead[1]),
    ];
    let err = RedlockBackend::connect(&urls).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("cannot reach a quorum (2 of 3)"), "{msg}");
    for port in &dead {
        assert!(msg.contains(&port.to_string()), "{msg}");
    }
    let err = RedlockBackend::connect(&[live.url(), "nonsense".to_owned()])
        .await
        .unwrap_err();
    // Named by its place; a URL that does not parse is never echoed (it may
    // hold a password anywhere).
    let msg = err.to_string();
    assert!(msg.contains("redlock node 2 of 2"), "{msg}");
    assert!(msg.contains("cannot parse Redis URL"), "{msg}");
}

use common::Gate;

/// A handler held at its gate until the test lets it go.
async fn gated(State(gate): State<Gate>) -> &'static str {
    gate.pass(()).await;
    "done"
}

#[tokio::test]
async fn two_layer_instances_exclude_with_a_node_down() {
    let mut nodes = servers(3);
    let (gate, mut entered) = Gate::new();
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let backend = redlock(&nodes).await;
        assert_eq!(backend.name(), "redlock");
        let layer = RedisLockLayer::new(
            backend,
            (RequestMethod, Route, Header::trusted_identity("x-user-id")),
        );
        let app = Router::new()
            .route("/pay", post(gated).layer(layer))
            .with_state(gate.clone());
        addrs.push(serve(app).await);
    }
    nodes[2].kill();
    let pay = || req("POST", "/pay", &[("x-user-id", "alice")], "{}");
    let first = tokio::spawn(send(addrs[0], pay()));
    tokio::time::timeout(Duration::from_secs(5), entered.recv())
        .await
        .expect("first request in the handler")
        .unwrap();
    let dup = send(addrs[1], pay()).await;
    assert_eq!(dup.status, 409);
    assert!(dup.headers.contains_key("retry-after"));
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 200);
    assert!(
        nodes[..2].iter().all(|s| s.dbsize() == 0),
        "released on the live nodes"
    );
    gate.permits.add_permits(1);
    assert_eq!(send(addrs[1], pay()).await.status, 200);
    assert_eq!(gate.runs.load(Ordering::SeqCst), 2);
}

/// A node that takes `delay` to answer an acquire (a far or busy primary).
#[derive(Debug, Clone)]
struct Slow {
    inner: tower_redis_lock::MemoryBackend,
    delay: Duration,
}

impl LockBackend for Slow {
    fn acquire(
        &self,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
    ) -> tower_redis_lock::backend::contract::BackendFuture<Acquire> {
        let (this, key, token) = (self.clone(), key.clone(), *token);
        BackendFuture::new(async move {
            tokio::time::sleep(this.delay).await;
            this.inner.acquire(&key, &token, ttl).await
        })
    }
    fn release(
        &self,
        key: &Bytes,
        token: &Token,
    ) -> tower_redis_lock::backend::contract::BackendFuture<bool> {
        self.inner.release(key, token)
    }
    fn extend(
        &self,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
    ) -> tower_redis_lock::backend::contract::BackendFuture<bool> {
        self.inner.extend(key, token, ttl)
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquire(key, token, ttl)
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.release(key, token)
    }

    fn watch(
        &self,
        _key: &Bytes,
    ) -> Option<BackendFuture<tower_redis_lock::backend::contract::Watch>> {
        None
    }
    fn native_calls(&self) -> Option<u64> {
        None
    }
}

impl Backend for Slow {
    fn name(&self) -> &'static str {
        "slow"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

/// The lease a handler sees counts only the Redlock validity (TTL minus the
/// time the quorum took minus the drift), not the whole TTL.
#[tokio::test]
async fn lease_remaining_is_the_redlock_validity() {
    let delay = Duration::from_millis(300);
    let ttl = Duration::from_secs(1);
    let nodes = (0..3).map(|_| Slow {
        inner: tower_redis_lock::MemoryBackend::new(),
        delay,
    });
    let backend = RedlockBackend::new(nodes)
        .unwrap()
        .node_timeout(Duration::from_secs(2));
    let app =
        Router::new().route(
            "/pay",
            post(|lease: tower_redis_lock::Lease| async move {
                lease.remaining().as_millis().to_string()
            })
            .layer(
                RedisLockLayer::new(backend, Route)
                    .ttl(ttl)
                    .deadline(Duration::from_secs(2)),
            ),
        );
    let addr = serve(app).await;
    let reply = send(addr, req("POST", "/pay", &[], "")).await;
    assert_eq!(reply.status, 200);
    let remaining: u64 = std::str::from_utf8(&reply.body).unwrap().parse().unwrap();
    // Drift allowance: 1 % of the TTL plus 2 ms.
    let drift = ttl / 100 + Duration::from_millis(2);
    let most = (ttl - delay - drift).as_millis() as u64;
    assert!(
        remaining <= most,
        "Lease::remaining {remaining} ms, validity at most {most} ms"
    );
}
