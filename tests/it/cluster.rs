//! The layer on a real Redis Cluster: 3 masters + 3 replicas on loopback,
//! started once for this test binary (see `test-support/src/scale.rs`).
//!
//! Lost-lease window on failover (shown by
//! `killed_master_loses_a_lease_it_had_not_replicated`): Redis replicates
//! asynchronously, so a lease the master acknowledged but had not yet sent
//! to its replica is gone when that replica is promoted after the master dies.
//! A second instance can then take the same key while the first still runs
//! its handler. The window is the replication lag at the moment of the crash
//! (sub-millisecond on a healthy LAN, unbounded when the link is down or
//! slow). While the slot has no master (here: `cluster-node-timeout` 1 s plus
//! the election, about 2 s measured), requests on its keys get the layer's
//! fail policy (503 by default). A manual `CLUSTER FAILOVER` waits for the
//! replica to catch up and loses nothing.

use crate::common;
use crate::common::scale;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::{req, send, serve, Conn};
use scale::{cli, key_slot, pid_of, Cluster, NodeInfo, TOPOLOGY};
use tower_redis_lock::backend::contract::{Acquire, Token};
use tower_redis_lock::backend::LockBackend;
use tower_redis_lock::key::{Header, KeySpace, RequestMethod, Route};
use tower_redis_lock::{RedisBackend, RedisLockLayer};

async fn backend(cluster: &Cluster) -> RedisBackend {
    RedisBackend::connect(&cluster.url())
        .await
        .expect("connect to the test cluster")
}

/// A key `prefix:{tag}suffix` whose slot the master `m` serves.
fn key_on(m: &NodeInfo, prefix: &str, suffix: &str) -> (Bytes, u16) {
    (0u32..)
        .map(|n| format!("{prefix}:{{{n}}}{suffix}"))
        .map(|k| {
            let slot = key_slot(k.as_bytes());
            (Bytes::from(k), slot)
        })
        .find(|(_, slot)| m.owns(*slot))
        .unwrap()
}

/// Retry `acquire` while the cluster answers errors (a slot without a
/// master), up to `within`; returns the first answer and how long it took.
async fn acquire_when_up(
    b: &RedisBackend,
    key: &Bytes,
    token: &Token,
    within: Duration,
) -> (Acquire, Duration) {
    let answered = || async {
        let acquire = b.acquire(key, token, Duration::from_secs(30));
        match tokio::time::timeout(Duration::from_millis(500), acquire).await {
            Ok(Ok(a)) => Ok(a),
            _ => Err(()),
        }
    };
    match common::retry_until(within, Duration::from_millis(50), answered).await {
        Ok((took, a)) => (a, took),
        Err(()) => panic!("no answer for {key:?} within {within:?}"),
    }
}

use common::Gate;

/// A handler held at its gate until the test lets it go.
async fn gated(State(gate): State<Gate>) -> &'static str {
    gate.pass(()).await;
    "done"
}

#[test]
fn slot_helper_agrees_with_redis() {
    let cluster = Cluster::get();
    let port = cluster.ports()[0];
    for key in ["a", "trl:{abc}", "user:{42}:x", "{}x", "x{}y{z}"] {
        let redis: u16 = cli(port, &["CLUSTER", "KEYSLOT", key]).parse().unwrap();
        assert_eq!(key_slot(key.as_bytes()), redis, "{key}");
    }
}

#[tokio::test]
async fn two_instances_exclude_each_other() {
    let _shared = TOPOLOGY.read().await;
    let cluster = Cluster::get();
    let (gate, mut entered) = Gate::new();
    let key = (RequestMethod, Route, Header::trusted_identity("x-user-id"));
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let layer = RedisLockLayer::new(backend(cluster).await, key.clone())
            .key_space(KeySpace::new("trl-excl"));
        let app = Router::new()
            .route("/pay", post(gated).layer(layer))
            .with_state(gate.clone());
        addrs.push(serve(app).await);
    }
    let pay = || req("POST", "/pay", &[("x-user-id", "alice")], "{}");

    let first = tokio::spawn(send(addrs[0], pay()));
    tokio::time::timeout(Duration::from_secs(5), entered.recv())
        .await
        .expect("first request in the handler")
        .unwrap();
    let dup = send(addrs[1], pay()).await;
    assert_eq!(dup.status, 409, "other instance must see the lease");
    assert_eq!(dup.headers["content-type"], "application/problem+json");
    assert!(dup.headers.contains_key("retry-after"));
    // Another user is not blocked.
    let other = tokio::spawn(send(
        addrs[1],
        req("POST", "/pay", &[("x-user-id", "bob")], "{}"),
    ));
    tokio::time::timeout(Duration::from_secs(5), entered.recv())
        .await
        .expect("bob admitted")
        .unwrap();
    gate.permits.add_permits(2);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(other.await.unwrap().status, 200);
    // Released: the other instance is admitted now.
    gate.permits.add_permits(1);
    assert_eq!(send(addrs[1], pay()).await.status, 200);
    assert_eq!(gate.runs.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn distinct_keys_spread_over_all_masters() {
    let _shared = TOPOLOGY.read().await;
    let cluster = Cluster::get();
    // Keep each lease for its TTL so the keys can be counted where they live.
    let layer = RedisLockLayer::new(
        backend(cluster).await,
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
    .key_space(KeySpace::new("trl-spread"))
    .hold_until_ttl()
    .ttl(Duration::from_secs(60));
    let app = Router::new().route("/pay", post(|| async { "ok" }).layer(layer));
    let addr = serve(app).await;
    const N: usize = 300;
    let mut conn = Conn::open(addr).await;
    for i in 0..N {
        let user = format!("user-{i}");
        let reply = conn
            .send(req("POST", "/pay", &[("x-user-id", &user)], ""))
            .await;
        assert_eq!(reply.status, 200, "request {i}");
    }
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3);
    let mut per_master = Vec::new();
    for m in &masters {
        let keys = cli(m.port, &["--scan", "--pattern", "trl-spread:*"]);
        let keys: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
        for k in &keys {
            assert!(
                m.owns(key_slot(k.as_bytes())),
                "{k} is on a master that does not own its slot"
            );
            // Fixed shape: prefix, then the digest as a hash tag.
            assert!(k.starts_with("trl-spread:{") && k.ends_with('}'), "{k}");
        }
        per_master.push(keys.len());
    }
    println!("keys per master: {per_master:?}");
    assert_eq!(per_master.iter().sum::<usize>(), N, "{per_master:?}");
    // Expected N/3 = 100 each; 50 is more than 8 standard deviations away.
    assert!(
        per_master.iter().all(|&n| n >= 50),
        "keys should spread over every master: {per_master:?}"
    );
}

/// Slot migration with `CLUSTER SETSLOT MIGRATING/IMPORTING` + `MIGRATE`.
///
/// What holds: a key still on the source is served there; exclusion is never
/// broken (a redirected acquire is either correct or an error, which the layer
/// turns into its fail policy); the lease moves with its owner and TTL; once
/// the slot is handed over, `MOVED` is followed and everything works.
/// What fred 10.1.0 does with `ASK` (seen here): it sends `ASKING` to the
/// target but the command itself back to the slot's old owner, which answers
/// `ASK` again until the attempts run out; then fred ends its connection task
/// for good. `RedisBackend::connect` restarts that task, so the redirected
/// call fails (the layer answers its fail policy, 503 by default) and the
/// same client works again right after; once the hand-over is done `MOVED`
/// is followed. The test prints what each call during the migration returned.
#[tokio::test]
async fn leases_follow_a_slot_migration() {
    let _exclusive = TOPOLOGY.write().await;
    let cluster = Cluster::get();
    let b = backend(cluster).await;
    let masters = cluster.masters();
    let (src, dst) = (&masters[0], &masters[1]);
    let (k1, slot) = key_on(src, "trl-mig", ":1");
    let k2 = Bytes::from(format!(
        "{}:2",
        std::str::from_utf8(&k1[..k1.len() - 2]).unwrap()
    ));
    assert_eq!(key_slot(&k2), slot);
    let (t1, t2) = (Token::generate(), Token::generate());
    let ttl = Duration::from_secs(30);
    let short = Duration::from_millis(300);
    let acquired = Acquire::acquired(None);

    assert_eq!(b.acquire(&k1, &t1, ttl).await.unwrap(), acquired);

    // Start migrating the slot: keys still on the source are served there,
    // missing keys get `ASK` to the target.
    let slot_s = slot.to_string();
    assert_eq!(
        cli(
            dst.port,
            &["CLUSTER", "SETSLOT", &slot_s, "IMPORTING", &src.id]
        ),
        "OK"
    );
    assert_eq!(
        cli(
            src.port,
            &["CLUSTER", "SETSLOT", &slot_s, "MIGRATING", &dst.id]
        ),
        "OK"
    );
    assert!(
        matches!(
            b.acquire(&k1, &t2, ttl).await.unwrap(),
            Acquire::Held { .. }
        ),
        "k1 still held on the source"
    );
    let ask = tokio::time::timeout(short, b.acquire(&k2, &t1, ttl)).await;
    println!("acquire of a new key under ASK: {ask:?}");
    assert!(
        matches!(ask, Ok(Ok(Acquire::Acquired { .. })) | Ok(Err(_)) | Err(_)),
        "{ask:?}"
    );

    // Move k1 (with its TTL) to the target: now it is reached only via ASK.
    let dst_port = dst.port.to_string();
    let moved = cli(
        src.port,
        &[
            "MIGRATE",
            "127.0.0.1",
            &dst_port,
            "",
            "0",
            "5000",
            "KEYS",
            std::str::from_utf8(&k1).unwrap(),
        ],
    );
    assert_eq!(moved, "OK");
    assert_eq!(cluster.count_keys(src.port, "trl-mig:*"), 0);
    let during = tokio::time::timeout(short, b.acquire(&k1, &t2, ttl)).await;
    println!("acquire of a held key under ASK: {during:?}");
    assert!(
        !matches!(during, Ok(Ok(Acquire::Acquired { .. }))),
        "exclusion must hold while the slot migrates: {during:?}"
    );

    // Finish: the target owns the slot; the source answers MOVED.
    for m in cluster.masters() {
        assert_eq!(
            cli(m.port, &["CLUSTER", "SETSLOT", &slot_s, "NODE", &dst.id]),
            "OK"
        );
    }
    // The same client answers again (its connection task restarted if fred
    // had ended it), on another master's slot and on the moved one.
    let other_master = cluster
        .masters()
        .into_iter()
        .find(|m| m.id != dst.id)
        .unwrap();
    let (elsewhere, _) = key_on(&other_master, "trl-mig-else", "");
    let (there, _) = acquire_when_up(&b, &elsewhere, &t1, Duration::from_secs(5)).await;
    assert!(matches!(there, Acquire::Acquired { .. }), "{there:?}");
    assert!(b.release(&elsewhere, &t1).await.unwrap());
    let (after, took) = acquire_when_up(&b, &k1, &t2, Duration::from_secs(10)).await;
    println!("after the hand-over: {after:?} ({} ms)", took.as_millis());
    assert!(
        matches!(after, Acquire::Held { retry_after: Some(d) } if d > Duration::from_secs(20)),
        "the lease kept its owner and TTL across MIGRATE: {after:?}"
    );
    assert!(
        b.release(&k1, &t1).await.unwrap(),
        "owner releases via MOVED"
    );
    assert_eq!(b.acquire(&k1, &t2, ttl).await.unwrap(), acquired);
    assert!(b.release(&k1, &t2).await.unwrap());
    assert!(!b.release(&k1, &t1).await.unwrap(), "not the owner");
    let _ = b.release(&k2, &t1).await.unwrap();
    assert_eq!(cluster.count_keys(dst.port, "trl-mig:*"), 0);
    assert_eq!(cluster.owner(slot).id, dst.id);
    assert!(cluster.wait_stable(Duration::from_secs(10)));
}

#[tokio::test]
async fn manual_failover_keeps_leases_and_service() {
    let _exclusive = TOPOLOGY.write().await;
    let cluster = Cluster::get();
    let (a, b) = (backend(cluster).await, backend(cluster).await);
    let master = cluster.masters().remove(2);
    let replica = cluster.replica_of(&master.id);
    let (key, _) = key_on(&master, "trl-mfo", "");
    let (key2, _) = key_on(&master, "trl-mfo2", "");
    let (ta, tb) = (Token::generate(), Token::generate());
    let ttl = Duration::from_secs(30);
    assert!(matches!(
        a.acquire(&key, &ta, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));

    let start = Instant::now();
    assert_eq!(cli(replica.port, &["CLUSTER", "FAILOVER"]), "OK");
    assert!(
        common::eventually(Duration::from_secs(10), || cluster
            .masters()
            .iter()
            .any(|m| m.id == replica.id))
        .await,
        "replica was not promoted"
    );
    let (held, _) = acquire_when_up(&b, &key, &tb, Duration::from_secs(10)).await;
    assert!(
        matches!(held, Acquire::Held { .. }),
        "a manual failover keeps the lease: {held:?}"
    );
    let (fresh, _) = acquire_when_up(&b, &key2, &tb, Duration::from_secs(10)).await;
    assert!(matches!(fresh, Acquire::Acquired { .. }));
    println!(
        "manual failover: new keys admitted {} ms after CLUSTER FAILOVER",
        start.elapsed().as_millis()
    );
    assert!(a.release(&key, &ta).await.unwrap(), "owner still releases");
    assert!(b.release(&key2, &tb).await.unwrap());
    assert!(cluster.wait_stable(Duration::from_secs(10)));
}

#[tokio::test]
async fn killed_master_loses_a_lease_it_had_not_replicated() {
    let _exclusive = TOPOLOGY.write().await;
    let cluster = Cluster::get();
    let (a, b) = (backend(cluster).await, backend(cluster).await);
    let master = cluster.masters().remove(1);
    let replica = cluster.replica_of(&master.id);
    let (safe, _) = key_on(&master, "trl-kill-safe", "");
    let (lost, _) = key_on(&master, "trl-kill-lost", "");
    let (ta, tb) = (Token::generate(), Token::generate());
    let ttl = Duration::from_secs(30);

    // A lease that reached the replica before the crash.
    assert!(matches!(
        a.acquire(&safe, &ta, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    let replicated = || {
        let info = cli(master.port, &["INFO", "replication"]);
        let offset = |prefix: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(prefix))
                .and_then(|v| v.split(',').next())
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let master_off = offset("master_repl_offset:");
        let replica_off = info
            .lines()
            .find(|l| l.starts_with("slave0:"))
            .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("offset=")))
            .and_then(|v| v.parse::<u64>().ok());
        master_off.is_some() && master_off == replica_off
    };
    assert!(common::eventually(Duration::from_secs(5), replicated).await);

    // Cut replication (the replica cannot re-authenticate), then take a
    // second lease that only the master has.
    let pid = pid_of(master.port);
    assert_eq!(
        cli(master.port, &["CONFIG", "SET", "requirepass", "cut"]),
        "OK"
    );
    let authed = |args: &[&str]| {
        let mut all = vec!["-a", "cut", "--no-auth-warning"];
        all.extend_from_slice(args);
        cli(master.port, &all)
    };
    authed(&["CLIENT", "KILL", "TYPE", "replica"]);
    assert!(
        common::eventually(Duration::from_secs(5), || authed(&["INFO", "replication"])
            .contains("connected_slaves:0"))
        .await
    );
    assert!(matches!(
        a.acquire(&lost, &ta, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));

    // Crash the master; its replica takes over without the second lease.
    cluster.kill(master.port, pid);
    let crashed = Instant::now();
    assert!(
        common::eventually(Duration::from_secs(15), || cluster
            .masters()
            .iter()
            .any(|m| m.id == replica.id))
        .await,
        "replica was not promoted"
    );
    let (second, unavailable) = acquire_when_up(&b, &lost, &tb, Duration::from_secs(15)).await;
    println!(
        "killed master: slot served again {} ms after the crash",
        crashed.elapsed().as_millis()
    );
    assert!(
        matches!(second, Acquire::Acquired { .. }),
        "the unreplicated lease is lost: a second owner gets it ({second:?}, {unavailable:?})"
    );
    let (first, _) = acquire_when_up(&b, &safe, &tb, Duration::from_secs(5)).await;
    assert!(
        matches!(first, Acquire::Held { .. }),
        "the replicated lease survives"
    );
    assert!(
        !a.release(&lost, &ta).await.unwrap(),
        "the first owner learns at release that it had lost the lease"
    );
    assert!(b.release(&lost, &tb).await.unwrap());
    assert!(a.release(&safe, &ta).await.unwrap());

    // Bring the old master back: it rejoins as a replica.
    cluster.restart(master.port);
    assert!(
        cluster.wait_stable(Duration::from_secs(20)),
        "cluster did not heal: {}",
        cli(replica.port, &["CLUSTER", "NODES"])
    );
}

/// The native-command probe asks every node of the cluster: on a Valkey 9
/// cluster (`TRL_TEST_SERVER=valkey`) lease calls take the native road, and
/// each master releases its own keys with `DELIFEQ`; on Redis 7, scripts.
#[tokio::test]
async fn the_native_probe_asks_every_node() {
    // Alone on the cluster: it counts each master's `DELIFEQ`s, which
    // another test's releases on the same masters would add to.
    let _exclusive = TOPOLOGY.write().await;
    let cluster = Cluster::get();
    let b = backend(cluster).await.local_dedup(false);
    let valkey = cli(cluster.ports()[0], &["INFO", "server"]).contains("server_name:valkey");
    assert_eq!(b.native_calls().is_some(), valkey, "native road iff Valkey");
    let delifeqs = |port: u16| -> u64 {
        cli(port, &["INFO", "commandstats"])
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_delifeq:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    for m in cluster.masters() {
        let (key, _) = key_on(&m, "trl-native", "");
        let token = Token::generate();
        let before = delifeqs(m.port);
        // One call, not `acquire_when_up`: the topology is stable here, and
        // a retry after a slow first answer (a loaded machine) would find
        // the first attempt's lease and answer `Held`.
        let got = tokio::time::timeout(
            Duration::from_secs(10),
            b.acquire(&key, &token, Duration::from_secs(30)),
        )
        .await
        .expect("an answer within 10 s")
        .expect("the acquire succeeds");
        assert!(
            matches!(got, Acquire::Acquired { .. }),
            "node {}: {got:?}",
            m.port
        );
        assert!(b.release(&key, &token).await.unwrap(), "node {}", m.port);
        let expected = if valkey { before + 1 } else { 0 };
        assert_eq!(
            delifeqs(m.port),
            expected,
            "node {}; native calls so far: {:?}",
            m.port,
            b.native_calls()
        );
    }
}
