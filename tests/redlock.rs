//! `RedlockBackend` on 3 and 5 real, independent `redis-server`s, with a
//! minority and then a majority of them killed.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::{eventually, free_port, req, send, serve, RedisServer};
use tower_redis_lock::backend::RedlockAcquire;
use tower_redis_lock::key::{Method, Route, TrustedHeader};
use tower_redis_lock::{
    Acquire, BackendErrorKind, LockBackend, RedisLockLayer, RedlockBackend, Token,
};

fn servers(n: usize) -> Vec<RedisServer> {
    (0..n).map(|_| RedisServer::start()).collect()
}

async fn redlock(servers: &[RedisServer]) -> RedlockBackend {
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    RedlockBackend::connect(&urls)
        .await
        .expect("connect to the redlock nodes")
}

const TTL: Duration = Duration::from_secs(30);

async fn survives_a_minority_then_fails_without_quorum(n: usize) {
    let mut nodes = servers(n);
    let (a, b) = (redlock(&nodes).await, redlock(&nodes).await);
    assert_eq!(a.quorum(), n / 2 + 1);
    let key = Bytes::from_static(b"trl:{redlock}");
    let (ta, tb) = (Token::generate(), Token::generate());

    match a.lock(&key, &ta, TTL).await.unwrap() {
        RedlockAcquire::Acquired { validity, .. } => {
            assert!(validity <= TTL - RedlockBackend::drift(TTL), "{validity:?}");
            assert!(validity > TTL - Duration::from_secs(1), "{validity:?}");
        }
        other => panic!("{other:?}"),
    }
    // All nodes got a vote (the late ones in the background at most).
    let all_set = eventually(Duration::from_secs(2), || {
        nodes.iter().all(|s| s.dbsize() == 1)
    })
    .await;
    assert!(all_set, "every node holds the key");

    // Kill a minority: the lease still excludes, and moves on release.
    let minority = (n - 1) / 2;
    for s in &mut nodes[..minority] {
        s.kill();
    }
    assert!(matches!(
        b.acquire(&key, &tb, TTL).await.unwrap(),
        Acquire::Held { retry_after: Some(d) } if d > TTL - Duration::from_secs(2)
    ));
    assert!(a.extend(&key, &ta, TTL).await.unwrap());
    assert!(a.release(&key, &ta).await.unwrap());
    assert!(matches!(
        b.acquire(&key, &tb, TTL).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    assert!(b.release(&key, &tb).await.unwrap());

    // One more down: no quorum, a clear error, nothing left behind.
    nodes[minority].kill();
    let err = a.acquire(&key, &ta, TTL).await.unwrap_err();
    assert_eq!(err.kind(), BackendErrorKind::Unavailable);
    assert!(
        err.to_string()
            .contains(&format!("quorum is {}", n / 2 + 1)),
        "{err}"
    );
    let released = eventually(Duration::from_secs(2), || {
        nodes[minority + 1..].iter().all(|s| s.dbsize() == 0)
    })
    .await;
    assert!(released, "votes of a failed acquire are given back");
}

#[tokio::test]
async fn three_nodes_survive_one_killed_not_two() {
    survives_a_minority_then_fails_without_quorum(3).await;
}

#[tokio::test]
async fn five_nodes_survive_two_killed_not_three() {
    survives_a_minority_then_fails_without_quorum(5).await;
}

#[tokio::test]
async fn partial_acquire_is_released_and_answers_held() {
    let nodes = servers(3);
    let r = redlock(&nodes).await;
    let key = "trl:{partial}";
    // Another owner holds two of the three nodes.
    for s in &nodes[..2] {
        assert_eq!(s.cli(&["SET", key, "someone-else", "PX", "20000"]), "OK");
    }
    let got = r
        .lock(&Bytes::from_static(key.as_bytes()), &Token::generate(), TTL)
        .await
        .unwrap();
    assert!(
        matches!(got, RedlockAcquire::Held { retry_after: Some(d) } if d > Duration::from_secs(15) && d <= Duration::from_secs(20)),
        "{got:?}"
    );
    let released = eventually(Duration::from_secs(2), || nodes[2].dbsize() == 0).await;
    assert!(released, "the one vote we got is given back");
    for s in &nodes[..2] {
        assert_eq!(
            s.cli(&["GET", key]),
            "someone-else",
            "others' votes untouched"
        );
    }
}

#[tokio::test]
async fn a_stalled_node_does_not_hold_up_the_quorum() {
    let nodes = servers(3);
    // A node timeout far longer than the assertion below: only the parallel
    // fan-out with an early decision can answer in time.
    let r = redlock(&nodes).await.node_timeout(Duration::from_secs(20));
    nodes[0].pause();
    let key = Bytes::from_static(b"trl:{stalled}");
    let token = Token::generate();
    let start = Instant::now();
    let got = r.lock(&key, &token, TTL).await;
    let took = start.elapsed();
    let released = r.release(&key, &token).await;
    nodes[0].resume();
    assert!(
        matches!(got, Ok(RedlockAcquire::Acquired { nodes: 2, .. })),
        "{got:?}"
    );
    assert!(released.unwrap());
    assert!(
        took < Duration::from_secs(5),
        "waited for the stalled node: {took:?}"
    );
}

#[tokio::test]
async fn connect_names_unreachable_nodes() {
    let live = RedisServer::start();
    let dead = [free_port(), free_port()];
    let urls = [
        live.url(),
        format!("redis://127.0.0.1:{}", dead[0]),
        format!("redis://127.0.0.1:{}", dead[1]),
    ];
    let err = RedlockBackend::connect(&urls).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("cannot reach a quorum (2 of 3)"), "{msg}");
    for port in dead {
        assert!(msg.contains(&port.to_string()), "{msg}");
    }
    let err = RedlockBackend::connect(&[live.url(), "nonsense".to_owned()])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("nonsense"), "{err}");
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
        let layer = RedisLockLayer::new(redlock(&nodes).await).key((
            Method,
            Route,
            TrustedHeader::new("x-user-id"),
        ));
        assert_eq!(layer.backend_name(), "redlock");
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
