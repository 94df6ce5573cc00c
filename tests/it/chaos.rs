//! No claim outlives its request: the idempotency layer on two instances
//! behind a fault proxy in front of a real `redis-server` (AOF, `appendfsync
//! always`), with clients that retry the identical request, disconnect
//! mid-request and send duplicates, while Redis is delayed, black-holed,
//! reset, paused (`SIGSTOP`) and killed (`kill -9`, restarted on its AOF).
//!
//! The two causes of a payment blocked for a whole claim TTL each have a
//! test of their own; the chaos run then asserts, over every key, that it
//! reached a final answer soon after the faults ended, that it executed
//! exactly once, and that no claim is left behind.
//!
//! `chaos_short` runs for 8 s of faults in `cargo test`; the long run is the
//! same test with `CHAOS_SECS=120` (see CONTRIBUTING.md).

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::proxy::Proxy;
use common::{serve, RedisServer};
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_redis_lock::key::{Header, Route};
use tower_redis_lock::{IdempotencyLayer, RedisBackend};

/// Executions per idempotency key, over both instances.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<HashMap<String, usize>>>);

impl Ledger {
    fn runs(&self, key: &str) -> usize {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }
    fn total(&self) -> usize {
        self.0.lock().unwrap().values().sum()
    }
}

async fn pay(State(ledger): State<Ledger>, headers: HeaderMap) -> impl IntoResponse {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let n = {
        let mut map = ledger.0.lock().unwrap();
        let n = map.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    (StatusCode::CREATED, format!("payment {key} run {n}"))
}

async fn instance(redis_url: &str, ledger: &Ledger, ttl: Duration) -> SocketAddr {
    let backend = RedisBackend::connect(redis_url).await.expect("connect");
    let layer = IdempotencyLayer::new(backend, (Route, Header::trusted_identity("x-user-id")))
        .ttl(ttl)
        .join_timeout(Duration::from_secs(2));
    serve(
        Router::new()
            .route("/payments", post(pay).layer(layer))
            .with_state(ledger.clone()),
    )
    .await
}

/// The payment of `key`, made by the user the key names (`c3-k7`: user
/// `c3`): each client is its own user, as in production, so each has its
/// own share of the store (one user paying 1,000 times within the
/// retention would meet its quota: 429).
fn request(key: &str) -> Vec<u8> {
    let user = key.split('-').next().unwrap_or(key);
    format!(
        "POST /payments HTTP/1.1\r\nhost: x\r\nx-user-id: {user}\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
    )
    .into_bytes()
}

/// One request on a connection of its own: the status and body, or `None`
/// for a connection error or no answer within 10 s.
async fn attempt(addr: SocketAddr, key: &str) -> Option<(u16, Vec<u8>)> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        stream.write_all(&request(key)).await.ok()?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf);
        let status = text.split(' ').nth(1)?.parse().ok()?;
        let body = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        Some((status, buf[body..].to_vec()))
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .ok()
        .flatten()
}

/// Send the request and hang up `after` it was sent, before any answer.
async fn hang_up(addr: SocketAddr, key: &str, after: Duration) {
    if let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await {
        let _ = stream.write_all(&request(key)).await;
        // The fault itself: the client leaves this long after sending.
        tokio::time::sleep(after).await;
    }
}

/// Retry the identical request until a 201, for at most `within`: the time
/// it took, and the body.
async fn until_paid(addr: SocketAddr, key: &str, within: Duration) -> Option<(Duration, Vec<u8>)> {
    let paid = || async move {
        match attempt(addr, key).await {
            Some((201, body)) => Ok(body),
            _ => Err(()),
        }
    };
    common::retry_until(within, Duration::from_millis(50), paid)
        .await
        .ok()
}

/// Claims left in Redis (`s` = `p`), read past the proxy.
fn claims_left(server: &RedisServer) -> usize {
    let script = "local n = 0 for _, k in ipairs(redis.call('KEYS', 'trl:{*:idem')) do \
                  if redis.call('HGET', k, 's') == 'p' then n = n + 1 end end return n";
    server
        .cli(&["EVAL", script, "0"])
        .trim()
        .parse()
        .unwrap_or(usize::MAX)
}

/// A `redis-server`, a fault proxy in front of it, and one instance (claim
/// TTL 70 s) through the proxy, its scripts loaded by a first payment.
async fn one_instance_behind_a_proxy() -> (RedisServer, Proxy, Ledger, SocketAddr) {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await;
    let ledger = Ledger::default();
    let addr = instance(&proxy.url(), &ledger, Duration::from_secs(70)).await;
    assert!(until_paid(addr, "warm-up", Duration::from_secs(5))
        .await
        .is_some());
    (server, proxy, ledger, addr)
}

/// A claim re-sent by fred after a reconnect lands after its request
/// answered 503 (the deadline passed inside a black-hole). It is taken back
/// (delivered, retried, and a tombstone makes a later landing claim
/// nothing), so the retry runs at once instead of waiting out the claim's
/// 70 s TTL with 409s.
#[test]
fn a_claim_that_lands_after_its_503_is_taken_back() {
    common::run_logged(|logs| async move {
        let (server, proxy, ledger, addr) = one_instance_behind_a_proxy().await;

        proxy.blackhole(true);
        let (status, _) = attempt(addr, "k").await.expect("an answer");
        assert_eq!(status, 503, "the claim missed its deadline");
        // The black-hole lasts 1.5 s in all, longer than any single attempt
        // to take the claim back; then it ends, its connections are reset
        // (they lost bytes), and fred re-sends what was in flight.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        proxy.blackhole(false);
        proxy.close_all();
        let (took, body) = until_paid(addr, "k", Duration::from_secs(10))
            .await
            .expect("paid within 10 s, not after the 70 s TTL");
        println!("paid {took:?} after the black-hole");
        assert!(took < Duration::from_secs(5), "{took:?}: {}", logs.text());
        assert_eq!(ledger.runs("k"), 1);
        assert!(String::from_utf8_lossy(&body).contains("run 1"));
        assert!(
            common::eventually(Duration::from_secs(5), || claims_left(&server) == 0).await,
            "no claim left"
        );
    })
}

/// A client that leaves while its claim is on its way to Redis (150 ms of
/// latency, the client gone after 50 ms): the claim is taken back, so the
/// retry runs at once; before, the claim stayed for its TTL and the handler
/// never ran.
#[test]
fn a_client_that_leaves_during_the_claim_leaves_no_claim() {
    common::run_logged(|logs| async move {
        let (server, proxy, ledger, addr) = one_instance_behind_a_proxy().await;

        proxy.delay_up(Duration::from_millis(150));
        hang_up(addr, "k", Duration::from_millis(50)).await;
        // The claim and its abandon both pass the delay.
        let gone = common::eventually(Duration::from_secs(5), || {
            logs.lines_with(&["abandoning"]).len() == 1 && claims_left(&server) == 0
        })
        .await;
        assert!(gone, "the claim was taken back: {}", logs.text());
        proxy.delay_up(Duration::ZERO);
        let (took, _) = until_paid(addr, "k", Duration::from_secs(10))
            .await
            .expect("paid within 10 s");
        assert!(took < Duration::from_secs(1), "{took:?}");
        assert_eq!(
            ledger.runs("k"),
            1,
            "the first never ran; the retry did, once"
        );
    })
}

/// A handler held at its gate, then counted in the ledger.
async fn gated_pay(
    State((ledger, gate)): State<(Ledger, common::Gate)>,
    headers: HeaderMap,
) -> impl IntoResponse {
    gate.pass(()).await;
    pay(State(ledger), headers).await
}

/// A retry whose claim is stuck in fred's queue by an outage, and that
/// gave up (503), never lands once Redis is back. Here the first request's
/// handler still ran through the outage, which outlasted its claim: had
/// the retry's claim landed then, it would have taken the key, the first
/// request's record would have been refused ("not our claim"), and the
/// next retry would have paid a second time. Its claim is dropped
/// instead, the first request's record is written over its lapsed claim,
/// and the next retry replays it.
#[test]
fn a_claim_given_up_in_an_outage_never_lands() {
    common::run_logged(|logs| async move {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let ledger = Ledger::default();
        let (gate, mut entered) = common::Gate::new();
        let backend = RedisBackend::connect(&proxy.url()).await.expect("connect");
        let ttl = Duration::from_secs(2);
        let layer =
            IdempotencyLayer::new(backend, (Route, Header::trusted_identity("x-user-id"))).ttl(ttl);
        let addr = serve(
            Router::new()
                .route("/payments", post(gated_pay).layer(layer.clone()))
                .with_state((ledger.clone(), gate.clone())),
        )
        .await;
        gate.permits.add_permits(1);
        assert!(until_paid(addr, "warm-up", Duration::from_secs(5))
            .await
            .is_some());
        entered.recv().await.expect("the warm-up ran");

        let first = tokio::spawn(attempt(addr, "k"));
        entered.recv().await.expect("the first request runs");
        let claimed = Instant::now();
        proxy.blackhole(true);
        let (status, _) = attempt(addr, "k").await.expect("an answer");
        assert_eq!(status, 503, "the retry's claim missed its deadline");
        assert_eq!(layer.stats().round_trip_timeouts, 1, "counted as missed");
        // The handler ends inside the outage; its record cannot be written.
        gate.permits.add_permits(1);
        let _ = first.await;
        // The outage outlasts the first request's claim (the store's own
        // clock: nothing to wait on but the time), then its connections
        // are reset and fred sends again what it still holds.
        tokio::time::sleep(
            (claimed + ttl + Duration::from_millis(500)).saturating_duration_since(Instant::now()),
        )
        .await;
        proxy.blackhole(false);
        proxy.close_all();
        // A second run, if any, is let through, to be counted.
        gate.permits.add_permits(8);
        let (_, body) = until_paid(addr, "k", Duration::from_secs(10))
            .await
            .expect("paid");
        assert_eq!(ledger.runs("k"), 1, "paid twice: {}", logs.text());
        assert!(String::from_utf8_lossy(&body).contains("run 1"));
    })
}

/// A small deterministic generator (no dependency, same run every time).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[derive(Default)]
struct Faults {
    by_kind: Mutex<HashMap<&'static str, usize>>,
}

impl Faults {
    fn count(&self, kind: &'static str) {
        *self.by_kind.lock().unwrap().entry(kind).or_default() += 1;
    }
}

#[test]
fn chaos_short() {
    let secs: u64 = std::env::var("CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    common::run(|| async move {
        let mut server =
            RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
        let proxy = Arc::new(Proxy::start(server.port()).await);
        let ledger = Ledger::default();
        let ttl = Duration::from_secs(30);
        let a = instance(&proxy.url(), &ledger, ttl).await;
        let b = instance(&proxy.url(), &ledger, ttl).await;
        let faults_end = Instant::now() + Duration::from_secs(secs);
        let faults = Arc::new(Faults::default());
        let answered = Arc::new(Mutex::new(HashMap::<String, (Vec<u8>, Duration)>::new()));
        let unfinished = Arc::new(AtomicUsize::new(0));
        // Every answer the clients got, by status (0: no answer).
        let statuses = Arc::new(Mutex::new(std::collections::BTreeMap::<u16, usize>::new()));

        // Clients: each pays its keys one after another, retrying the
        // identical request on anything but a 201, sometimes hanging up
        // mid-request first or sending a duplicate to the other instance.
        let mut clients = Vec::new();
        for c in 0..6u64 {
            let (answered, unfinished) = (answered.clone(), unfinished.clone());
            let statuses = statuses.clone();
            clients.push(tokio::spawn(async move {
                let mut rng = Lcg(c + 1);
                let mut n = 0;
                while Instant::now() < faults_end {
                    let key = format!("c{c}-k{n}");
                    n += 1;
                    let started = Instant::now();
                    let pick = |rng: &mut Lcg| if rng.next(2) == 0 { a } else { b };
                    if rng.next(4) == 0 {
                        let after = Duration::from_millis(rng.next(300));
                        hang_up(pick(&mut rng), &key, after).await;
                    }
                    let dup = (rng.next(3) == 0).then(|| {
                        let (addr, key) = (pick(&mut rng), key.clone());
                        tokio::spawn(async move { attempt(addr, &key).await })
                    });
                    // Bounded: the faults' length plus 15 s.
                    let bound = faults_end + Duration::from_secs(15);
                    let mut paid = None;
                    let mut last = None;
                    while Instant::now() < bound {
                        let got = attempt(pick(&mut rng), &key).await;
                        *statuses
                            .lock()
                            .unwrap()
                            .entry(got.as_ref().map_or(0, |(status, _)| *status))
                            .or_default() += 1;
                        match got {
                            Some((201, body)) => {
                                paid = Some(body);
                                break;
                            }
                            other => {
                                last = Some(other.map(|(status, body)| {
                                    (status, String::from_utf8_lossy(&body).into_owned())
                                }))
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(50 + rng.next(100))).await;
                    }
                    if let Some(dup) = dup {
                        if let Ok(Some((201, body))) = dup.await {
                            if let Some(paid) = &paid {
                                assert_eq!(&body, paid, "{key}: a duplicate got another answer");
                            }
                        }
                    }
                    match paid {
                        Some(body) => {
                            answered
                                .lock()
                                .unwrap()
                                .insert(key, (body, started.elapsed()));
                        }
                        None => {
                            eprintln!("{key}: no 201; last answer {last:?}");
                            unfinished.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            }));
        }

        // Faults, one after another, with calm between them.
        let mut rng = Lcg(99);
        while Instant::now() + Duration::from_secs(2) < faults_end {
            tokio::time::sleep(Duration::from_millis(300 + rng.next(500))).await;
            match rng.next(5) {
                0 => {
                    faults.count("latency");
                    proxy.delay_up(Duration::from_millis(150 + rng.next(300)));
                    tokio::time::sleep(Duration::from_millis(1000)).await;
                    proxy.delay_up(Duration::ZERO);
                }
                1 => {
                    faults.count("black-hole");
                    proxy.blackhole(true);
                    tokio::time::sleep(Duration::from_millis(1000 + rng.next(1000))).await;
                    proxy.blackhole(false);
                    proxy.close_all();
                }
                2 => {
                    faults.count("reset");
                    proxy.close_all();
                }
                3 => {
                    faults.count("sigstop");
                    server.pause();
                    tokio::time::sleep(Duration::from_millis(500 + rng.next(1000))).await;
                    server.resume();
                }
                _ => {
                    faults.count("kill-9");
                    server.kill();
                    server.restart();
                }
            }
        }
        let calm = Instant::now();
        for client in clients {
            client.await.unwrap();
        }
        let answered = std::mem::take(&mut *answered.lock().unwrap());
        let longest = answered.values().map(|(_, d)| *d).max().unwrap_or_default();
        println!(
            "chaos {secs} s: {} keys paid, {} unfinished, {} executions, answers by status \
             (0: none) {:?}, faults {:?}, \
             longest time to a 201 {longest:?}, clients done {:?} after the faults",
            answered.len(),
            unfinished.load(Ordering::SeqCst),
            ledger.total(),
            statuses.lock().unwrap(),
            faults.by_kind.lock().unwrap(),
            calm.elapsed(),
        );
        assert_eq!(
            unfinished.load(Ordering::SeqCst),
            0,
            "every key got its 201"
        );
        // No key waits out a claim's 30 s TTL: each is paid within a few
        // faults' length, and every client is done soon after the last one.
        assert!(
            longest < Duration::from_secs(12),
            "longest time to a 201: {longest:?}"
        );
        assert!(
            calm.elapsed() < Duration::from_secs(8),
            "clients done {:?} after the faults",
            calm.elapsed()
        );
        assert!(
            answered.len() >= 12,
            "the run did work: {} keys",
            answered.len()
        );
        for (key, (body, _)) in answered.iter() {
            assert_eq!(ledger.runs(key), 1, "{key} executed once");
            assert!(String::from_utf8_lossy(body).ends_with("run 1"), "{key}");
        }
        assert_eq!(
            ledger.total(),
            answered.len(),
            "executions = keys answered 201"
        );
        assert!(
            common::eventually(Duration::from_secs(5), || claims_left(&server) == 0).await,
            "no claim outlives its request: {} left",
            claims_left(&server)
        );
    })
}

/// `drain` on the backend waits for a claim still being taken back: while
/// Redis is unreachable it reports the claim as on its way; once Redis is
/// back it returns, and no claim is left.
#[test]
fn drain_waits_for_claims_being_taken_back() {
    common::run(|| async move {
        use tower_redis_lock::backend::Backend;
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let backend = RedisBackend::connect(&proxy.url()).await.expect("connect");
        let ledger = Ledger::default();
        let layer = IdempotencyLayer::new(
            backend.clone(),
            (Route, Header::trusted_identity("x-user-id")),
        )
        .ttl(Duration::from_secs(30));
        let addr = serve(
            Router::new()
                .route("/payments", post(pay).layer(layer))
                .with_state(ledger.clone()),
        )
        .await;
        assert!(until_paid(addr, "warm-up", Duration::from_secs(5))
            .await
            .is_some());
        proxy.blackhole(true);
        assert_eq!(attempt(addr, "k").await.map(|r| r.0), Some(503));
        let err = backend
            .drain(Duration::from_millis(300))
            .await
            .expect_err("the claim is still on its way");
        assert!(err.to_string().contains("claim"), "{err}");
        proxy.blackhole(false);
        proxy.close_all();
        backend
            .drain(Duration::from_secs(10))
            .await
            .expect("drained once Redis is back");
        assert_eq!(claims_left(&server), 0);
        assert_eq!(ledger.runs("k"), 0);
    })
}
