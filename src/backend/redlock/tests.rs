//! Unit tests of `redlock.rs`.

use super::*;
use crate::MemoryBackend;

/// A node that never answers.
#[derive(Debug)]
struct Dead;

impl LockBackend for Dead {
    fn acquire(&self, _: &Bytes, _: &Token, _: Duration) -> BackendFuture<Acquire> {
        BackendFuture::new(std::future::pending())
    }
    fn release(&self, _: &Bytes, _: &Token) -> BackendFuture<bool> {
        BackendFuture::new(std::future::pending())
    }
    fn extend(&self, _: &Bytes, _: &Token, _: Duration) -> BackendFuture<bool> {
        BackendFuture::new(std::future::pending())
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquire(key, token, ttl)
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.release(key, token)
    }

    fn watch(&self, _key: &Bytes) -> Option<BackendFuture<crate::backend::contract::Watch>> {
        None
    }

    fn native_calls(&self) -> Option<u64> {
        None
    }
}

impl Backend for Dead {
    fn name(&self) -> &'static str {
        "dead"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

fn nodes(live: usize, dead: usize) -> (Vec<MemoryBackend>, RedlockBackend) {
    let mem: Vec<MemoryBackend> = (0..live).map(|_| MemoryBackend::new()).collect();
    let mut all: Vec<Arc<dyn LockBackend>> = mem
        .iter()
        .map(|m| Arc::new(m.clone()) as Arc<dyn LockBackend>)
        .collect();
    all.extend((0..dead).map(|_| Arc::new(Dead) as Arc<dyn LockBackend>));
    (
        mem,
        RedlockBackend::new(all)
            .unwrap()
            .node_timeout(Duration::from_millis(30)),
    )
}

#[test]
fn quorum_is_a_majority() {
    for (n, q) in [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)] {
        let (_, r) = nodes(n, 0);
        assert_eq!(r.quorum(), q, "n={n}");
    }
    assert!(RedlockBackend::new(Vec::<MemoryBackend>::new()).is_err());
}

#[test]
fn drift_is_one_percent_plus_two_ms() {
    assert_eq!(
        RedlockBackend::drift(Duration::from_secs(10)),
        Duration::from_millis(102)
    );
}

#[test]
fn retry_after_is_when_a_quorum_is_free() {
    let ms = Duration::from_millis;
    // 5 nodes, quorum 3: one ours, holders free at 100, 300, 200 ms.
    assert_eq!(
        quorum_free_after(1, &[Some(ms(100)), Some(ms(300)), Some(ms(200))], 3),
        Some(ms(200))
    );
    // Two nodes, one held (free at 100 ms), the other erred: when it is
    // free is not known, so neither is the quorum's (100 ms would be a
    // lower bound). Four nodes, two held, two erred: the same.
    assert_eq!(quorum_free_after(0, &[Some(ms(100))], 2), None);
    assert_eq!(
        quorum_free_after(0, &[Some(ms(100)), Some(ms(200))], 3),
        None
    );
    assert_eq!(quorum_free_after(0, &[None], 2), None);
    // Our one vote is free now, but the quorum needs a holder's node whose
    // time left is unknown: unknown, not "now".
    assert_eq!(quorum_free_after(1, &[None, None], 2), None);
    assert_eq!(
        quorum_free_after(1, &[None, Some(ms(100))], 2),
        Some(ms(100))
    );
}

#[tokio::test]
async fn acquires_with_a_minority_dead_and_excludes() {
    let (mem, r) = nodes(3, 2);
    let key = Bytes::from_static(b"k");
    let (a, b) = (Token::generate(), Token::generate());
    let ttl = Duration::from_secs(10);
    match r.lock(&key, &a, ttl).await.unwrap() {
        Acquire::Acquired {
            validity: Some(validity),
            fence: None,
        } => {
            assert!(validity <= ttl - RedlockBackend::drift(ttl));
            assert!(validity > Duration::from_secs(9));
        }
        other => panic!("{other:?}"),
    }
    assert!(mem.iter().all(|m| m.len() == 1));
    assert!(matches!(
        r.acquire(&key, &b, ttl).await.unwrap(),
        Acquire::Held { retry_after: Some(d) } if d > Duration::from_secs(9)
    ));
    // The trait answer carries the validity too.
    match r.acquire(&key, &a, ttl).await.unwrap() {
        Acquire::Acquired {
            validity: Some(v), ..
        } => assert!(v <= ttl - RedlockBackend::drift(ttl), "{v:?}"),
        other => panic!("{other:?}"),
    }
    assert!(r.extend(&key, &a, ttl).await.unwrap());
    assert!(!r.extend(&key, &b, ttl).await.unwrap());
    assert!(r.release(&key, &a).await.unwrap());
    assert!(mem.iter().all(|m| m.is_empty()));
}

#[tokio::test]
async fn a_majority_dead_is_unavailable() {
    let (mem, r) = nodes(2, 3);
    let key = Bytes::from_static(b"k");
    let err = r
        .acquire(&key, &Token::generate(), Duration::from_secs(10))
        .await
        .unwrap_err();
    assert_eq!(err.kind, BackendErrorKind::Unavailable);
    assert!(err.to_string().contains("quorum is 3"), "{err}");
    // The two votes we did get are given back.
    for m in &mem {
        let m = m.clone();
        let gone = async move {
            while !m.is_empty() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(2), gone)
            .await
            .expect("partial acquire released");
    }
}

#[tokio::test]
async fn partial_acquire_is_released_and_reported_held() {
    let (mem, r) = nodes(3, 0);
    let key = Bytes::from_static(b"k");
    let ttl = Duration::from_secs(10);
    let other = Token::generate();
    // Another owner holds two of three nodes.
    for m in &mem[..2] {
        m.acquire(&key, &other, ttl).await.unwrap();
    }
    let ours = Token::generate();
    let got = r.lock(&key, &ours, ttl).await.unwrap();
    assert!(
        matches!(got, Acquire::Held { retry_after: Some(d) } if d > Duration::from_secs(9)),
        "{got:?}"
    );
    // Our vote on the third node is given back.
    let third = mem[2].clone();
    tokio::time::timeout(Duration::from_secs(2), async move {
        while !third.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("partial acquire released");
    // The other owner's votes are untouched.
    assert!(mem[..2].iter().all(|m| m.len() == 1));
}

#[tokio::test]
async fn validity_used_up_is_an_error() {
    let (_, r) = nodes(1, 0);
    // drift alone (2 ms) exceeds a 1 ms TTL.
    let err = r
        .lock(
            &Bytes::from_static(b"k"),
            &Token::generate(),
            Duration::from_millis(1),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind, BackendErrorKind::Timeout);
}

/// A node whose acquire lands (sets the key) but answers an error, as a
/// reply lost after the command ran (once `wait`, if any, has a permit
/// for it); then lets two waiters on `then` go.
#[derive(Debug)]
struct LandsThenFails {
    mem: MemoryBackend,
    then: Arc<tokio::sync::Semaphore>,
    wait: Option<Arc<tokio::sync::Semaphore>>,
}

impl LockBackend for LandsThenFails {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        let (mem, then, wait) = (self.mem.clone(), self.then.clone(), self.wait.clone());
        let (key, token) = (key.clone(), *token);
        BackendFuture::new(async move {
            if let Some(wait) = wait {
                wait.acquire().await.expect("gate open").forget();
            }
            mem.try_acquire(&key, &token, ttl);
            // Enough for every node waiting on it in these tests.
            then.add_permits(2);
            Err(BackendError::new("reply lost"))
        })
    }
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.mem.release(key, token)
    }
    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        self.mem.extend(key, token, ttl)
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquire(key, token, ttl)
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.release(key, token)
    }

    fn watch(&self, _key: &Bytes) -> Option<BackendFuture<crate::backend::contract::Watch>> {
        None
    }

    fn native_calls(&self) -> Option<u64> {
        None
    }
}

impl Backend for LandsThenFails {
    fn name(&self) -> &'static str {
        "lands-then-fails"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

/// A node that answers only once `gate` has a permit for it; then lets
/// `then` go.
#[derive(Debug)]
struct Gated {
    mem: MemoryBackend,
    gate: Arc<tokio::sync::Semaphore>,
    then: Option<Arc<tokio::sync::Semaphore>>,
}

impl LockBackend for Gated {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        let (mem, gate, key, token) = (self.mem.clone(), self.gate.clone(), key.clone(), *token);
        let then = self.then.clone();
        BackendFuture::new(async move {
            gate.acquire().await.expect("gate open").forget();
            let answer = mem.try_acquire(&key, &token, ttl);
            if let Some(then) = then {
                then.add_permits(1);
            }
            Ok(answer)
        })
    }
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.mem.release(key, token)
    }
    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        self.mem.extend(key, token, ttl)
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquire(key, token, ttl)
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.release(key, token)
    }

    fn watch(&self, _key: &Bytes) -> Option<BackendFuture<crate::backend::contract::Watch>> {
        None
    }

    fn native_calls(&self) -> Option<u64> {
        None
    }
}

impl Backend for Gated {
    fn name(&self) -> &'static str {
        "gated"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

async fn until_empty(m: &MemoryBackend) -> bool {
    let m = m.clone();
    tokio::time::timeout(Duration::from_secs(2), async move {
        while !m.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .is_ok()
}

#[tokio::test]
async fn the_vote_of_a_node_that_answered_an_error_is_given_back() {
    let key = Bytes::from_static(b"k");
    let ttl = Duration::from_secs(10);
    let other = Token::generate();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let failing = MemoryBackend::new();
    let held: Vec<MemoryBackend> = (0..2).map(|_| MemoryBackend::new()).collect();
    for m in &held {
        m.try_acquire(&key, &other, ttl);
    }
    let mut all: Vec<Arc<dyn LockBackend>> = vec![Arc::new(LandsThenFails {
        mem: failing.clone(),
        then: gate.clone(),
        wait: None,
    })];
    // The holders answer after the failing node did, so its error is
    // counted before the outcome is settled.
    all.extend(held.iter().map(|m| {
        Arc::new(Gated {
            mem: m.clone(),
            gate: gate.clone(),
            then: None,
        }) as Arc<dyn LockBackend>
    }));
    let r = RedlockBackend::new(all)
        .unwrap()
        .node_timeout(Duration::from_secs(1));
    let got = r.lock(&key, &Token::generate(), ttl).await.unwrap();
    assert!(matches!(got, Acquire::Held { .. }), "{got:?}");
    assert!(
        until_empty(&failing).await,
        "the key our acquire set on the node that answered an error is released"
    );
    assert!(
        held.iter().all(|m| m.len() == 1),
        "the holder keeps its votes"
    );
}

#[tokio::test]
async fn quorum_lost_through_errors_is_unavailable_not_held() {
    let key = Bytes::from_static(b"k");
    let ttl = Duration::from_secs(10);
    // The holder answers first, then the failing nodes, one by one.
    let (first, second) = (
        Arc::new(tokio::sync::Semaphore::new(0)),
        Arc::new(tokio::sync::Semaphore::new(0)),
    );
    let failing: Vec<MemoryBackend> = (0..2).map(|_| MemoryBackend::new()).collect();
    let holder = MemoryBackend::new();
    holder.try_acquire(&key, &Token::generate(), ttl);
    let mut all: Vec<Arc<dyn LockBackend>> = vec![Arc::new(Gated {
        mem: holder.clone(),
        gate: Arc::new(tokio::sync::Semaphore::new(1)),
        then: Some(first.clone()),
    })];
    all.push(Arc::new(LandsThenFails {
        mem: failing[0].clone(),
        then: second.clone(),
        wait: Some(first.clone()),
    }));
    all.push(Arc::new(LandsThenFails {
        mem: failing[1].clone(),
        then: Arc::new(tokio::sync::Semaphore::new(0)),
        wait: Some(second),
    }));
    let r = RedlockBackend::new(all)
        .unwrap()
        .node_timeout(Duration::from_secs(1));
    // One holder of three cannot block a quorum of two: the errors did.
    let err = r.lock(&key, &Token::generate(), ttl).await.unwrap_err();
    assert_eq!(err.kind, BackendErrorKind::Unavailable, "{err}");
    for m in &failing {
        assert!(until_empty(m).await, "votes given back");
    }
}

/// `RedlockBackend` on 3 and 5 real, independent `redis-server`s: the
/// checks that need the crate-private detail of [`RedlockBackend::lock`]
/// (validity, votes counted), the quorum and the error kind. The rest of the
/// Redlock tests use the public API, in `tests/it/redlock.rs`.
///
/// Each test starts its own servers on free ports and kills them on drop; a
/// missing `redis-server` is a loud failure with the install hint.
#[cfg(feature = "redis")]
mod servers {
    use std::time::{Duration, Instant};

    use bytes::Bytes;

    use crate::backend::{Acquire, BackendErrorKind, LockBackend, RedlockBackend, Token};
    use tower_redis_lock_test_support::{eventually, reached_every, RedisServer as Server};

    fn servers(n: usize) -> Vec<Server> {
        (0..n).map(|_| Server::start()).collect()
    }

    /// Connected to every node: `connect` returns once a quorum is, so a
    /// probe lease is taken and seen on every server (a command queued for
    /// a node still connecting lands once it is) before the test begins.
    async fn redlock(servers: &[Server]) -> RedlockBackend {
        let urls: Vec<String> = servers.iter().map(Server::url).collect();
        let r = RedlockBackend::connect(&urls)
            .await
            .expect("connect to the redlock nodes");
        let token = Token::generate();
        let probe = format!("trl:{{probe}}:{}", String::from_utf8_lossy(&token.to_hex()));
        let _ = r.lock(&Bytes::from(probe.clone()), &token, TTL).await;
        let everywhere = reached_every(servers, &probe, Duration::from_secs(5)).await;
        assert!(everywhere, "every node took the probe lease");
        r
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
    async fn connect_returns_once_a_quorum_connected() {
        let nodes = servers(3);
        // Stopped before the connect: the kernel accepts its connection, the
        // server never answers it (the old connect waited its 3 s bound).
        nodes[2].pause();
        let urls: Vec<String> = nodes.iter().map(Server::url).collect();
        let start = Instant::now();
        let connected = RedlockBackend::connect(&urls).await;
        let took = start.elapsed();
        let r = connected.expect("a quorum of nodes answers");
        assert!(
            took < Duration::from_secs(2),
            "waited for the stopped node before returning: {took:?}"
        );
        let key = Bytes::from_static(b"trl:{connect-quorum}");
        let token = Token::generate();
        let got = r.lock(&key, &token, TTL).await;
        assert!(matches!(got, Ok(Acquire::Acquired { .. })), "{got:?}");
        assert!(r.release(&key, &token).await.unwrap());
        nodes[2].resume();
    }

    /// With every node up, the start names no node as missing (the wait
    /// ends at the first quorum; the others are up by then or soon after).
    #[test]
    fn a_healthy_start_warns_of_no_missing_node() {
        use crate::backend::redis::connect::tests::eviction::run_logged;
        let nodes = servers(3);
        run_logged(|logs| async move {
            let r = redlock(&nodes).await;
            let key = Bytes::from_static(b"trl:{healthy-start}");
            let token = Token::generate();
            assert!(matches!(
                r.lock(&key, &token, TTL).await,
                Ok(Acquire::Acquired { .. })
            ));
            assert!(r.release(&key, &token).await.unwrap());
            assert_eq!(
                logs.lines_with(&["not all nodes"]),
                0,
                "a healthy start warned"
            );
        });
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
}

/// A release handed to a task before `drain` (a lease guard dropped at
/// shutdown hands its release to a task that has not run yet) is waited
/// for: a node counts a release only once it is sent to it.
#[tokio::test]
async fn drain_waits_for_a_release_not_yet_sent() {
    let (mem, redlock) = nodes(3, 0);
    let key = Bytes::from_static(b"drained");
    let token = Token::generate();
    let ttl = Duration::from_secs(30);
    let got = redlock.acquire(&key, &token, ttl).await.unwrap();
    assert!(matches!(got, Acquire::Acquired { .. }), "{got:?}");
    drop(redlock.release(&key, &token));
    redlock.drain(Duration::from_secs(5)).await.unwrap();
    for (i, node) in mem.iter().enumerate() {
        let other = node.try_acquire(&key, &Token::generate(), ttl);
        assert!(
            matches!(other, Acquire::Acquired { .. }),
            "node {i} still holds the lease after drain: {other:?}"
        );
    }
}

#[tokio::test]
async fn drain_takes_the_longest_timeout() {
    let (_, redlock) = nodes(3, 0);
    redlock.drain(Duration::MAX).await.unwrap();
}

/// A renewal that one node holding the lease could not answer (a node
/// that never answers, standing for one paused past the node timeout),
/// with a quorum of the others split yes and no: not known, an error,
/// never "not ours" (`Ok(false)` before, which made the watchdog give the
/// lease up though two nodes of three may still hold it).
#[tokio::test]
async fn a_node_that_failed_is_no_no() {
    let a = MemoryBackend::new();
    let c = MemoryBackend::new();
    let all: Vec<Arc<dyn LockBackend>> =
        vec![Arc::new(a.clone()), Arc::new(Dead), Arc::new(c.clone())];
    let r = RedlockBackend::new(all)
        .unwrap()
        .node_timeout(Duration::from_millis(30));
    let (key, token) = (Bytes::from_static(b"k"), Token::generate());
    a.try_acquire(&key, &token, Duration::from_secs(10));
    let extended = r.extend(&key, &token, Duration::from_secs(10)).await;
    assert!(extended.is_err(), "{extended:?}");
    // Two nodes of three saying no is a "no".
    let d = MemoryBackend::new();
    let all: Vec<Arc<dyn LockBackend>> = vec![Arc::new(c), Arc::new(d), Arc::new(Dead)];
    let r = RedlockBackend::new(all)
        .unwrap()
        .node_timeout(Duration::from_millis(30));
    assert!(!r
        .extend(&key, &token, Duration::from_secs(10))
        .await
        .unwrap());
}
