//! One Redis client: every Redis call of `RedisBackend` goes through fred as
//! the user configured it (addresses, credentials, TLS, command attempts).
//! (A URL that asks for TLS on a build without it is refused before a byte
//! is sent: `tests/no_tls.rs`.) Every test owns its `redis-server` (and,
//! where the network is the fault, a TCP proxy).

use crate::common;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::proxy::Proxy;
use common::{eventually, req, run, send, serve, Gate, RedisServer};
use fred::interfaces::ClientLike;
use fred::types::config::{Config, CredentialProvider, Server};
use fred::types::Builder;
use tokio::sync::mpsc;
use tower_redis_lock::backend::contract::{Acquire, Token};
use tower_redis_lock::backend::{LockBackend, RedlockBackend};
use tower_redis_lock::key::UriPath;
use tower_redis_lock::{RedisBackend, RedisLockLayer};

const TTL: Duration = Duration::from_secs(30);

async fn gated(State(gate): State<Gate>) -> &'static str {
    gate.pass(()).await;
    "ok"
}

/// `POST /pay` behind `layer`, its handler held at the returned gate.
async fn gated_app(layer: RedisLockLayer) -> (SocketAddr, Gate, mpsc::UnboundedReceiver<()>) {
    let (gate, entered) = Gate::new();
    let router = Router::new()
        .route("/pay", post(gated))
        .with_state(gate.clone())
        .layer(layer);
    (serve(router).await, gate, entered)
}

/// An IPv6 literal (`redis://[::1]:port`) reaches Redis for every call, the
/// lease calls included, as `127.0.0.1` does: of three concurrent requests
/// on one key, one runs and two get 409; a sequential repeat runs. (The
/// lease calls' own connection kept the brackets in the host name, so every
/// lease call failed: 503 for all.)
#[test]
fn ipv6_literal_url_locks_like_ipv4() {
    run(|| async move {
        // The harness pings 127.0.0.1; the server listens on both.
        let server = RedisServer::start_with(&["--bind", "127.0.0.1", "::1"]);
        let url = format!("redis://[::1]:{}", server.port());
        let backend = RedisBackend::connect(&url)
            .await
            .expect("connect over ::1")
            // Every duplicate asks Redis.
            .local_dedup(false);
        let (addr, gate, mut entered) = gated_app(RedisLockLayer::new(backend, UriPath)).await;

        let (status_tx, mut statuses) = mpsc::unbounded_channel();
        for _ in 0..3 {
            let status_tx = status_tx.clone();
            tokio::spawn(async move {
                let reply = send(addr, req("POST", "/pay", &[], "")).await;
                let _ = status_tx.send(reply.status);
            });
        }
        let within = Duration::from_secs(5);
        tokio::time::timeout(within, entered.recv())
            .await
            .expect("one request reaches the handler")
            .unwrap();
        // The admitted one waits at the gate: the two answers now are the
        // duplicates'.
        for _ in 0..2 {
            let status = tokio::time::timeout(within, statuses.recv())
                .await
                .expect("a duplicate is answered")
                .unwrap();
            assert_eq!(status, 409, "a duplicate over [::1]");
        }
        assert_eq!(server.dbsize(), 1, "the lease is in Redis");
        gate.permits.add_permits(1);
        let status = tokio::time::timeout(within, statuses.recv())
            .await
            .expect("the admitted request is answered")
            .unwrap();
        assert_eq!(status, 200);

        gate.permits.add_permits(1);
        let again = send(addr, req("POST", "/pay", &[], "")).await;
        assert_eq!(again.status, 200, "a sequential repeat is admitted");
        assert_eq!(gate.runs(), 2);
        assert_eq!(server.dbsize(), 0, "released");
        let clients = server.cli(&["CLIENT", "LIST"]);
        assert!(
            clients.lines().any(|l| l.contains("addr=[::1]:")),
            "the backend's connection came over ::1: {clients}"
        );
    });
}

/// Credentials from a fred credential provider (here a fixed user; in real
/// life a rotating token).
#[derive(Debug)]
struct FixedCredentials;

// `CredentialProvider` is an `async_trait`; written out by hand.
impl CredentialProvider for FixedCredentials {
    fn fetch<'a, 'b, 'c>(
        &'a self,
        _server: Option<&'b Server>,
    ) -> Pin<
        Box<
            dyn Future<Output = Result<(Option<String>, Option<String>), fred::error::Error>>
                + Send
                + 'c,
        >,
    >
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        Box::pin(async { Ok((Some("lockuser".to_owned()), Some("lock-pw".to_owned()))) })
    }
}

/// A fred client that logs in through a credential provider (the URL has no
/// user) takes its leases as that user: `default` may not run scripts, so a
/// lease call logged in any other way fails. (The lease calls' own
/// connection logged in with the URL's credentials, i.e. as `default`, and
/// every lease call failed with `NOPERM`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_provider_logs_the_lease_calls_in() {
    let server = RedisServer::start();
    assert_eq!(
        server.cli(&["ACL", "SETUSER", "lockuser", "on", ">lock-pw", "~*", "&*", "+@all"]),
        "OK"
    );
    assert_eq!(
        server.cli(&["ACL", "SETUSER", "default", "-@scripting"]),
        "OK"
    );
    let mut config = Config::from_url(&server.url()).unwrap();
    assert!(config.username.is_none() && config.password.is_none());
    config.credential_provider = Some(Arc::new(FixedCredentials));
    let client = Builder::from_config(config).build().unwrap();
    client.init().await.expect("the provider's user logs in");
    let backend = RedisBackend::new(client);

    for batched in [true, false] {
        let backend = backend.clone().auto_pipeline(batched).local_dedup(false);
        let key = Bytes::from(format!("trl:{{provider-{batched}}}"));
        let token = Token::generate();
        let got = backend.acquire(&key, &token, TTL).await;
        assert!(
            matches!(got, Ok(Acquire::Acquired { .. })),
            "batched {batched}: {got:?}"
        );
        let hex = token.to_hex();
        assert_eq!(
            server.cli(&["GET", std::str::from_utf8(&key).unwrap()]),
            std::str::from_utf8(&hex).unwrap()
        );
        // Several at once: a batch script.
        let others: Vec<_> = (0..8)
            .map(|i| {
                let key = Bytes::from(format!("trl:{{provider-{batched}-{i}}}"));
                let call = backend.acquire(&key, &token, TTL);
                async move { (key, call.await) }
            })
            .collect();
        for (key, got) in join_all(others).await {
            assert!(matches!(got, Ok(Acquire::Acquired { .. })), "{got:?}");
            assert!(backend.release(&key, &token).await.unwrap());
        }
        assert!(
            backend.release(&key, &token).await.unwrap(),
            "batched {batched}"
        );
    }
    assert_eq!(server.dbsize(), 0);
    // Every connection but redis-cli's own is the provider's user.
    let clients = server.cli(&["CLIENT", "LIST"]);
    assert!(
        clients
            .lines()
            .filter(|l| !l.contains("cmd=client|list"))
            .all(|l| l.contains("user=lockuser")),
        "{clients}"
    );
    assert!(clients.contains("user=lockuser"), "{clients}");
}

/// Await every future at once (they run concurrently on the runtime).
async fn join_all<F>(futures: Vec<F>) -> Vec<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        out.push(handle.await.unwrap());
    }
    out
}

/// Redlock's nodes never re-send a command (`max_command_attempts = 1`, as
/// its docs say): node 0, behind a proxy that drops the reply to an acquire
/// and closes the connection, ran that acquire once. (The lease calls' own
/// connection re-sent it, up to 3 times, whatever fred was told.)
#[test]
fn redlock_node_runs_a_command_once_when_its_reply_is_lost() {
    run(|| async move {
        let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
        let mut proxies = Vec::new();
        for node in &nodes {
            proxies.push(Proxy::start(node.port()).await);
        }
        let proxy = &proxies[0];
        let urls: Vec<String> = proxies.iter().map(Proxy::url).collect();
        let redlock = RedlockBackend::connect(&urls)
            .await
            .unwrap()
            // Node 0's answers are waited for, not given up on.
            .node_timeout(Duration::from_secs(5));
        // Load the scripts on every node. Nodes 1 and 2 answer late, so the
        // quorum of each warm-up call includes node 0: when it returns, no
        // reply of node 0 is still on its way (else the reply dropped below
        // could be the warm-up release's, and the acquire never sent).
        for other in &proxies[1..] {
            other.delay_down(Duration::from_millis(200));
        }
        let token = Token::generate();
        let warm = Bytes::from_static(b"trl:{warm}");
        assert!(matches!(
            redlock.acquire(&warm, &token, TTL).await.unwrap(),
            Acquire::Acquired { .. }
        ));
        assert!(redlock.release(&warm, &token).await.unwrap());
        assert!(eventually(Duration::from_secs(3), || nodes[0].dbsize() == 0).await);
        for other in &proxies[1..] {
            other.delay_down(Duration::ZERO);
        }
        assert_eq!(nodes[0].cli(&["CONFIG", "RESETSTAT"]), "OK");

        proxy.drop_next_reply();
        let lost = Bytes::from_static(b"trl:{lost}");
        // A quorum from nodes 1 and 2.
        assert!(matches!(
            redlock.acquire(&lost, &token, TTL).await.unwrap(),
            Acquire::Acquired { .. }
        ));
        assert!(eventually(Duration::from_secs(3), || proxy.dropped_replies() == 1).await);
        // A later call on node 0 goes out behind anything re-sent there
        // (one connection): once it ran, a re-send would have too.
        let probe = Bytes::from_static(b"trl:{probe}");
        assert!(matches!(
            redlock.acquire(&probe, &token, TTL).await.unwrap(),
            Acquire::Acquired { .. }
        ));
        assert!(
            eventually(Duration::from_secs(5), || {
                nodes[0].cli(&["EXISTS", "trl:{probe}"]) == "1"
            })
            .await,
            "the probe reached node 0"
        );
        assert_eq!(nodes[0].cli(&["EXISTS", "trl:{lost}"]), "1", "it ran there");
        // An acquire is one `SET` (with a `PTTL` whose reply may be the one
        // lost), sent as itself or, batched, from the script.
        let acquires = |node: &RedisServer| node.command_calls("set");
        assert_eq!(
            acquires(&nodes[0]),
            2,
            "node 0 ran the lost acquire once and the probe once"
        );
    });
}

/// On a pool, a release never overtakes its own acquire: with Redis stopped,
/// acquires on many keys are queued (spread over the pool's connections),
/// each followed at once by its release (a request given up while its
/// acquire was on its way); once Redis runs again, every release finds its
/// acquire's token and no key is left. Batched and unbatched.
#[test]
fn releases_follow_their_acquires_on_a_pool() {
    run(|| async move {
        const KEYS: usize = 64;
        const POOL: usize = 4;
        for batched in [true, false] {
            let server = RedisServer::start();
            let backend = RedisBackend::connect_pool(&server.url(), POOL)
                .await
                .unwrap()
                .auto_pipeline(batched)
                .local_dedup(false);
            // Load the scripts (a `NOSCRIPT` answer sends the call again).
            let token = Token::generate();
            let warm: Vec<_> = (0..8)
                .map(|i| Bytes::from(format!("trl:{{warm-{i}}}")))
                .collect();
            let acquires: Vec<_> = warm
                .iter()
                .map(|k| backend.acquire(k, &token, TTL))
                .collect();
            for a in acquires {
                a.await.unwrap();
            }
            let releases: Vec<_> = warm.iter().map(|k| backend.release(k, &token)).collect();
            for r in releases {
                assert!(r.await.unwrap());
            }
            let clients = server.cli(&["CLIENT", "LIST"]);
            assert!(
                clients.lines().count() > POOL,
                "{POOL} pool connections and redis-cli: {clients}"
            );

            server.pause();
            let mut calls = Vec::with_capacity(KEYS);
            for i in 0..KEYS {
                let key = Bytes::from(format!("trl:{{pool-order-{i}}}"));
                let token = Token::generate();
                // Polled once: its command is on its way (queued on its
                // connection), and the release is made behind it.
                let mut acquire = backend.acquire(&key, &token, TTL);
                tokio::select! {
                    biased;
                    got = &mut acquire => panic!("answered while Redis is stopped: {got:?}"),
                    () = std::future::ready(()) => {}
                }
                let mut release = backend.release(&key, &token);
                tokio::select! {
                    biased;
                    got = &mut release => panic!("answered while Redis is stopped: {got:?}"),
                    () = std::future::ready(()) => {}
                }
                calls.push((key, acquire, release));
            }
            server.resume();
            let mut overtaken = Vec::new();
            for (key, acquire, release) in calls {
                let (acquired, released) = tokio::join!(acquire, release);
                assert!(
                    matches!(acquired, Ok(Acquire::Acquired { .. })),
                    "batched {batched}: {acquired:?}"
                );
                if !released.unwrap() {
                    overtaken.push(key);
                }
            }
            assert!(
                overtaken.is_empty(),
                "batched {batched}: releases that ran before their acquire: {overtaken:?}"
            );
            assert_eq!(server.dbsize(), 0, "batched {batched}: no key left");
        }
    });
}

/// The connections this server has open to clients other than `redis-cli`
/// itself (which asks).
fn clients_connected(server: &RedisServer) -> usize {
    server
        .cli(&["CLIENT", "LIST"])
        .lines()
        .filter(|l| l.contains("addr=") && !l.contains("cmd=client"))
        .count()
}

/// A backend built by `connect*` closes the connections it opened once its
/// last clone is dropped (and every release on its way delivered): before,
/// fred's connection task and the supervisor that restarts it lived as long
/// as the runtime, and a lazy backend kept dialing. A client built by the
/// user is the user's, and stays open.
#[test]
fn a_backend_that_opened_its_connections_closes_them_when_dropped() {
    run(|| async move {
        let redis = RedisServer::start();
        let idle = clients_connected(&redis);

        let single = RedisBackend::connect(&redis.url()).await.expect("connect");
        let pool = RedisBackend::connect_pool(&redis.url(), 3)
            .await
            .expect("connect");
        let lazy = RedisBackend::connect_lazy(&redis.url()).expect("connect");
        assert!(eventually(Duration::from_secs(5), || lazy.clients()[0].is_connected()).await);
        let key = Bytes::from_static(b"lifecycle");
        let token = Token::generate();
        for backend in [&single, &pool, &lazy] {
            let taken = backend.acquire(&key, &token, TTL).await;
            assert!(matches!(taken, Ok(Acquire::Acquired { .. })), "{taken:?}");
            assert!(matches!(backend.release(&key, &token).await, Ok(true)));
        }
        assert_eq!(clients_connected(&redis), idle + 5);
        let clone = single.clone();
        drop(single);
        assert_eq!(clients_connected(&redis), idle + 5, "a clone keeps it");
        drop((clone, pool, lazy));
        let closed = eventually(Duration::from_secs(5), || clients_connected(&redis) == idle).await;
        assert!(
            closed,
            "{} connections left",
            clients_connected(&redis) - idle
        );

        // A client the user built and gave is left as it is.
        let client = Builder::from_config(Config::from_url(&redis.url()).unwrap())
            .build()
            .unwrap();
        client.init().await.expect("connect");
        drop(RedisBackend::new(client.clone()));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(client.is_connected(), "the user's client is the user's");
        assert_eq!(clients_connected(&redis), idle + 1);
    })
}
