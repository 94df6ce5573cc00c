//! `RedlockBackend` on 3 and 5 real, independent `redis-server`s: the
//! checks that need the crate-private detail of [`RedlockBackend::lock`]
//! (validity, votes counted), the quorum and the error kind. The rest of the
//! Redlock tests use the public API, in `tests/it/redlock.rs`.
//!
//! Each test starts its own servers on free ports and kills them on drop; a
//! missing `redis-server` is a loud failure with the install hint.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::test_server::{eventually, RedisServer as Server};
use super::{Acquire, BackendErrorKind, LockBackend, RedlockBackend, Token};

fn servers(n: usize) -> Vec<Server> {
    (0..n).map(|_| Server::start()).collect()
}

async fn redlock(servers: &[Server]) -> RedlockBackend {
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
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
        Acquire::Acquired {
            validity: Some(validity),
            ..
        } => {
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
    assert_eq!(err.kind, BackendErrorKind::Unavailable);
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
        matches!(
            got,
            Ok(Acquire::Acquired {
                validity: Some(_),
                ..
            })
        ),
        "{got:?}"
    );
    assert!(released.unwrap());
    assert!(
        took < Duration::from_secs(5),
        "waited for the stalled node: {took:?}"
    );
}
