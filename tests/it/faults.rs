//! Fault injection: every test owns a `redis-server` (killed, restarted,
//! paused, put to `DEBUG SLEEP` or `CLIENT PAUSE`) and, where the network is
//! the fault, a TCP proxy between the client and Redis (`common::proxy`).
//! Each test asserts the behaviour README's "Guarantees and limits" section promises for that
//! fault. Traffic is real HTTP over loopback.

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::proxy::Proxy;
use common::{admission, req, run, run_logged, send, serve, until_status, Conn, RedisServer};
use tokio::sync::mpsc;
use tower_redis_lock::backend::contract::{Acquire, BackendFuture, Token};
use tower_redis_lock::backend::{Backend, LockBackend};
use tower_redis_lock::key::{RequestMethod, Route, UriPath};
use tower_redis_lock::lock::Renewal;
use tower_redis_lock::LockStats;
use tower_redis_lock::{Lease, RedisBackend, RedisLockLayer};

/// Documented bound: after Redis accepts connections again, requests are
/// admitted within this time (fred reconnect back-off capped at 2 s, plus
/// the connection set-up). README's "Guarantees and limits" table names the same figure.
const RECOVERY_BOUND: Duration = Duration::from_secs(3);
/// Slack over the deadline for an answer measured at the HTTP client.
const MARGIN: Duration = Duration::from_millis(300);

// ---- helpers -----------------------------------------------------------------

/// Reports its lease when it starts, then waits for a permit.
type Gate = common::Gate<Lease>;

/// A handler that reports its lease when it starts and waits for a permit.
async fn gated(State(gate): State<Gate>, lease: Lease) -> String {
    gate.pass(lease.clone()).await;
    format!("{} lost={}", admission(&lease), lease.is_lost())
}

/// Serve `gated` at `route` behind `layer`.
async fn gated_app(
    route: &str,
    layer: RedisLockLayer,
) -> (SocketAddr, Gate, mpsc::UnboundedReceiver<Lease>) {
    let (gate, entered) = Gate::new();
    let app = Router::new()
        .route(route, post(gated))
        .with_state(gate.clone())
        .layer(layer);
    (serve(app).await, gate, entered)
}

/// Serve a handler that answers "ok" at `/pay` and `/pay/{n}` behind `layer`.
async fn ok_app(layer: RedisLockLayer) -> SocketAddr {
    let ok = || async { "ok" };
    serve(
        Router::new()
            .route("/pay", post(ok))
            .route("/pay/{n}", post(ok))
            .layer(layer),
    )
    .await
}

fn post_(path: &str) -> http::Request<http_body_util::Full<Bytes>> {
    req("POST", path, &[], "")
}

async fn redis_backend(url: &str) -> RedisBackend {
    RedisBackend::connect(url)
        .await
        .expect("connect to test redis")
}

/// Records every `extend` and `release` call (with the instant it started)
/// on the way to the real backend.
#[derive(Debug)]
struct Recording {
    inner: Arc<dyn LockBackend>,
    calls: Arc<Mutex<Vec<(&'static str, Instant)>>>,
}

impl Recording {
    fn new(inner: impl LockBackend) -> Self {
        Self {
            inner: Arc::new(inner),
            calls: Arc::default(),
        }
    }

    fn log(&self, what: &'static str) {
        self.calls.lock().unwrap().push((what, Instant::now()));
    }
}

impl LockBackend for Recording {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.inner.acquire(key, token, ttl)
    }
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.log("release");
        self.inner.release(key, token)
    }
    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        self.log("extend");
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

impl Backend for Recording {
    fn name(&self) -> &'static str {
        "recording"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

/// Starts of `extend` calls after the first `release` call.
fn extends_after_release(calls: &[(&'static str, Instant)]) -> usize {
    let Some(released) = calls.iter().find(|(w, _)| *w == "release").map(|c| c.1) else {
        return 0;
    };
    calls
        .iter()
        .filter(|(w, at)| *w == "extend" && *at >= released)
        .count()
}

// ---- Redis down at start-up ---------------------------------------------------

/// The app starts while Redis is down (`connect_lazy`); fail-closed answers
/// 503 and fail-open runs unlocked within the deadline; once Redis comes up,
/// requests are admitted within `RECOVERY_BOUND`, and the eviction-policy
/// check (which could not run at start) runs then, once.
#[test]
fn redis_down_at_startup_then_recovers() {
    run_logged(|logs| async move {
        let mut server = RedisServer::start_with(&["--maxmemory-policy", "volatile-lru"]);
        server.kill(); // the port is known, nothing listens on it
        let backend = RedisBackend::connect_lazy(&server.url()).expect("lazy connect never waits");
        let deadline = Duration::from_millis(150);
        let closed =
            RedisLockLayer::new(backend.clone(), (RequestMethod, UriPath)).deadline(deadline);
        let open = closed.clone().fail_open();
        let (closed_counters, open_counters) = (closed.clone(), open.clone()); // clones share the counters
        let status = |lease: Lease| async move { admission(&lease).to_owned() };
        let app = Router::new()
            .route("/closed", post(status).layer(closed))
            .route("/open", post(status).layer(open));
        let addr = serve(app).await;

        for _ in 0..3 {
            let started = Instant::now();
            let r = send(addr, post_("/closed")).await;
            assert_eq!(r.status, 503, "fail-closed while Redis is down");
            assert_eq!(r.headers["retry-after"], "1");
            assert!(
                started.elapsed() < deadline + MARGIN,
                "{:?}",
                started.elapsed()
            );
            let r = send(addr, post_("/open")).await;
            assert_eq!((r.status, &r.body[..]), (200, &b"FailOpen"[..]));
        }
        assert!(closed_counters.stats().backend_error >= 3);
        assert!(open_counters.stats().fail_open >= 3);
        assert!(!logs.lines_with(&["outcome=\"backend_error\""]).is_empty());

        server.restart();
        let took = until_status(addr, 200, Duration::from_secs(10), || post_("/closed"))
            .await
            .expect("admitted once Redis is up");
        println!("admitted {took:?} after Redis came up");
        assert!(took < RECOVERY_BOUND, "admitted after {took:?}");
        let r = send(addr, post_("/open")).await;
        assert_eq!(r.body, "Locked", "fail-open layer locks again");
        // The eviction-policy check ran once the first acquire got through.
        let warned = || {
            logs.lines_with(&["WARN", "maxmemory_policy=volatile-lru"])
                .len()
        };
        assert!(common::eventually(Duration::from_secs(2), || warned() == 1).await);
        // Late acquires queued during the outage were cleaned up or expired.
        assert!(common::eventually(Duration::from_secs(3), || server.dbsize() == 0).await);
    });
}

// ---- Redis killed mid-request ------------------------------------------------

/// A stream body fed by the test, chunk by chunk.
struct Feed(mpsc::UnboundedReceiver<Bytes>);

impl futures_core::Stream for Feed {
    type Item = Result<Bytes, std::io::Error>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|c| c.map(Ok))
    }
}

/// Redis dies while an admitted request runs (in the handler, and while its
/// body streams): the client still gets its whole 200 response, the failed
/// release is logged as `release_failed` with the key digest and counted,
/// never turned into a 500; new requests get 503.
#[test]
fn redis_killed_mid_request_keeps_response_and_logs_release() {
    run_logged(|logs| async move {
        let mut server = RedisServer::start();
        let backend = redis_backend(&server.url()).await;
        let deadline = Duration::from_millis(150);
        let layer = RedisLockLayer::new(backend, (RequestMethod, UriPath)).deadline(deadline);
        let counters = layer.clone(); // a clone shares the counters
        let (gate, mut entered) = Gate::new();
        let (feed_tx, feed_rx) = mpsc::unbounded_channel::<mpsc::UnboundedReceiver<Bytes>>();
        let feed_rx = Arc::new(tokio::sync::Mutex::new(feed_rx));
        let stream_gate = gate.clone();
        let app = Router::new()
            .route("/pay", post(gated))
            .route(
                "/stream",
                post(move |lease: Lease| {
                    let feed_rx = feed_rx.clone();
                    let gate = stream_gate.clone();
                    async move {
                        let rx = feed_rx.lock().await.recv().await.unwrap();
                        let _ = gate.entered.send(lease);
                        axum::body::Body::from_stream(Feed(rx))
                    }
                }),
            )
            .route("/ok", post(|| async { "ok" }))
            .with_state(gate.clone())
            .layer(layer);
        let addr = serve(app).await;

        // 1. Killed while the handler runs.
        let inflight = tokio::spawn(send(addr, post_("/pay")));
        let lease = entered.recv().await.unwrap();
        let digest = lease.key().unwrap().to_string();
        server.kill();
        gate.permits.add_permits(1);
        let started = Instant::now();
        let reply = inflight.await.unwrap();
        assert_eq!(reply.status, 200, "the admitted request keeps its response");
        assert_eq!(reply.body, "Locked lost=false");
        assert!(
            started.elapsed() < deadline + MARGIN,
            "release bounded by the deadline"
        );
        assert_eq!(counters.stats().release_failed, 1);
        let logged = logs.lines_with(&["outcome=\"release_failed\"", &digest]);
        assert_eq!(
            logged.len(),
            1,
            "release failure logged once with the digest: {logged:?}"
        );
        assert!(logged[0].contains("WARN"));
        assert_eq!(send(addr, post_("/pay")).await.status, 503);

        // 2. Killed while the response body streams.
        server.restart();
        until_status(addr, 200, Duration::from_secs(10), || post_("/ok"))
            .await
            .expect("admitted again after restart");
        let (chunks, rx) = mpsc::unbounded_channel();
        feed_tx.send(rx).unwrap();
        let inflight = tokio::spawn(send(addr, post_("/stream")));
        entered.recv().await.unwrap();
        chunks.send(Bytes::from_static(b"first,")).unwrap();
        server.kill();
        chunks.send(Bytes::from_static(b"second")).unwrap();
        drop(chunks);
        let reply = inflight.await.unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.body, "first,second", "the body arrives whole");
        assert_eq!(counters.stats().release_failed, 2);
        assert!(
            logs.lines_with(&["ERROR"]).is_empty(),
            "a failed release is a warning, not an error: {}",
            logs.text()
        );
    });
}

// ---- Redis restarted -----------------------------------------------------------

/// Redis restarts (no persistence) while a request holds a renewed lease:
/// during the outage a duplicate at this instance gets 409 from the local
/// in-flight table; after the restart the lease is
/// gone (the documented limit), the watchdog reports it to the handler
/// (`Lease::is_lost`), and requests are admitted within `RECOVERY_BOUND`.
#[test]
fn redis_restarted_admits_within_bound_and_reports_lost_lease() {
    run_logged(|logs| async move {
        let mut server = RedisServer::start();
        let backend = redis_backend(&server.url()).await;
        let layer = RedisLockLayer::new(backend, (RequestMethod, UriPath))
            .deadline(Duration::from_millis(150))
            .ttl(Duration::from_millis(900))
            .renew(Renewal::new());
        let counters = layer.clone(); // a clone shares the counters
        let (addr, gate, mut entered) = gated_app("/pay", layer).await;

        let first = tokio::spawn(send(addr, post_("/pay")));
        let lease = entered.recv().await.unwrap();
        server.kill();
        // This instance still holds the lease in its local in-flight table,
        // so a duplicate here is answered 409 without asking (dead) Redis.
        assert_eq!(send(addr, post_("/pay")).await.status, 409);
        server.restart();
        let restarted = Instant::now();
        tokio::time::timeout(Duration::from_secs(5), lease.lost())
            .await
            .expect("the watchdog noticed the lease is gone");
        assert!(lease.is_lost());
        gate.permits.add_permits(1);
        // One permit for the first request, one for the re-admitted duplicate.
        gate.permits.add_permits(1);
        until_status(addr, 200, Duration::from_secs(10), || post_("/pay"))
            .await
            .expect("admitted after the restart");
        let took = restarted.elapsed();
        println!("admitted {took:?} after the restart");
        assert!(took < RECOVERY_BOUND, "admitted after {took:?}");
        let first = first.await.unwrap();
        assert_eq!(
            (first.status, &first.body[..]),
            (200, &b"Locked lost=true"[..])
        );
        assert!(counters.stats().lease_lost >= 1);
        assert!(!logs.lines_with(&["outcome=\"lease_lost\""]).is_empty());
    });
}

// ---- Redis hung ------------------------------------------------------------------

/// `DEBUG SLEEP` and `SIGSTOP` hang the server longer than the deadline:
/// every acquire gives up within deadline + margin (503, fail-closed).
#[test]
fn hung_redis_acquire_gives_up_within_deadline() {
    run_logged(|_logs| async move {
        let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
        let backend = redis_backend(&server.url()).await;
        let deadline = Duration::from_millis(200);
        let layer = RedisLockLayer::new(backend, (RequestMethod, UriPath)).deadline(deadline);
        let counters = layer.clone(); // a clone shares the counters
        let addr = ok_app(layer).await;
        assert_eq!(send(addr, post_("/pay/0")).await.status, 200);

        for hang in ["debug sleep", "sigstop"] {
            let sleeper = match hang {
                "debug sleep" => Some(server.debug_sleep(2.0)),
                _ => {
                    server.pause();
                    None
                }
            };
            // The first 503 shows the hang began (DEBUG SLEEP starts on its own time).
            until_status(addr, 503, Duration::from_secs(2), || post_("/pay/probe"))
                .await
                .expect("server hung");
            let tasks: Vec<_> = (0..20)
                .map(|i| {
                    tokio::spawn(async move {
                        let started = Instant::now();
                        let r = send(addr, post_(&format!("/pay/{i}"))).await;
                        (r.status, started.elapsed())
                    })
                })
                .collect();
            for t in tasks {
                let (status, took) = t.await.unwrap();
                assert_eq!(status, 503, "{hang}");
                assert!(took < deadline + MARGIN, "{hang}: answered after {took:?}");
            }
            match sleeper {
                Some(t) => assert_eq!(t.join().unwrap(), "OK"),
                None => server.resume(),
            }
            until_status(addr, 200, RECOVERY_BOUND, || post_("/pay/0"))
                .await
                .expect("admitted after the hang");
        }
        assert!(counters.stats().round_trip_timeouts >= 40);
        assert!(common::eventually(Duration::from_secs(3), || server.dbsize() == 0).await);
    });
}

/// 1,000 concurrent requests during a hang (`CLIENT PAUSE ALL`, longer than
/// the deadline) are all answered 503 and the layer answers each within
/// deadline + margin (measured by a middleware around it; the client-side
/// figure also counts 1,000 connections' HTTP work on 2 shared cores and gets
/// a looser bound); the acquires that land late are cleaned up; later bursts
/// leave the runtime's live task count and the RSS where the first left them.
#[test]
fn hung_redis_1000_concurrent_requests_bounded_without_leaks() {
    run(|| async move {
        const N: usize = 1000;
        let server = RedisServer::start();
        let backend = redis_backend(&server.url()).await;
        let deadline = Duration::from_millis(200);
        let layer = RedisLockLayer::new(backend, (RequestMethod, UriPath)).deadline(deadline);
        let counters = layer.clone(); // a clone shares the counters
                                      // The slowest answer of the layer, measured right outside it.
        let layer_max_us = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let m = layer_max_us.clone();
        let timing = axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let m = m.clone();
                async move {
                    let t = Instant::now();
                    let res = next.run(req).await;
                    m.fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                    res
                }
            },
        );
        let app = Router::new()
            .route("/pay/{n}", post(|| async { "ok" }))
            .layer(layer)
            .layer(timing);
        let addr = serve(app).await;
        let metrics = tokio::runtime::Handle::current().metrics();

        let mut conns = Vec::with_capacity(N);
        for _ in 0..N {
            conns.push(Conn::open(addr).await);
        }
        let mut first_slowest = Duration::ZERO;
        let mut after = Vec::new();
        for round in 0..3 {
            // Every connection is warm and idle; the server is healthy.
            for (i, c) in conns.iter_mut().enumerate().take(5) {
                assert_eq!(c.send(post_(&format!("/pay/{i}"))).await.status, 200);
            }
            assert_eq!(server.cli(&["CLIENT", "PAUSE", "1500", "ALL"]), "OK");
            layer_max_us.store(0, Ordering::Relaxed);
            let started = Instant::now();
            let tasks: Vec<_> = conns
                .drain(..)
                .enumerate()
                .map(|(i, mut c)| {
                    tokio::spawn(async move {
                        let r = c.send(post_(&format!("/pay/{i}"))).await;
                        (c, r.status, started.elapsed())
                    })
                })
                .collect();
            let mut slowest = Duration::ZERO;
            for t in tasks {
                let (c, status, took) = t.await.unwrap();
                assert_eq!(status, 503);
                slowest = slowest.max(took);
                conns.push(c);
            }
            let layer_slowest = Duration::from_micros(layer_max_us.load(Ordering::Relaxed));
            println!(
                "round {round}: {N} answers; slowest at the layer {layer_slowest:?}, \
                 at the client {slowest:?} (deadline {deadline:?})"
            );
            assert!(
                layer_slowest < deadline + Duration::from_millis(800),
                "slowest answer of the layer {layer_slowest:?}"
            );
            assert!(
                slowest < deadline + Duration::from_secs(2),
                "slowest answer at the client {slowest:?}"
            );
            if round == 0 {
                first_slowest = slowest;
            }
            // The pause ends; late acquires land and their cleanups delete them.
            assert!(
                common::eventually(Duration::from_secs(5), || server.dbsize() == 0).await,
                "late acquires cleaned up"
            );
            // Cleanup tasks finish (each bounded by max(deadline, 1 s)).
            let settled = tokio::time::timeout(Duration::from_secs(5), async {
                let mut last = usize::MAX;
                loop {
                    let now = metrics.num_alive_tasks();
                    if now == last {
                        return now;
                    }
                    last = now;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
            .await
            .expect("task count settles");
            after.push((settled, common::rss_kib()));
        }
        // Burst 1 warms allocator pools and connection buffers; compare the
        // later bursts with it.
        let ((tasks0, rss0), (tasks1, rss1)) = (after[0], after[2]);
        println!("after each burst (tasks, RSS KiB): {after:?}; first slowest {first_slowest:?}");
        assert!(
            tasks1 <= tasks0 + 10,
            "live tasks grew from {tasks0} to {tasks1}"
        );
        assert!(
            rss1 <= rss0 + 8 * 1024,
            "RSS grew from {rss0} KiB to {rss1} KiB"
        );
        assert!(counters.stats().round_trip_timeouts >= 3 * N as u64);
    });
}

/// A network partition (the proxy swallows every byte, connections stay
/// open, nothing errors): acquires give up within deadline + margin; once
/// the proxy cuts the dead connections, fred reconnects and requests are
/// admitted within `RECOVERY_BOUND`; whatever was re-sent is cleaned up.
#[test]
fn network_blackhole_gives_up_within_deadline_then_recovers() {
    run_logged(|_logs| async move {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let deadline = Duration::from_millis(150);
        let layer =
            RedisLockLayer::new(redis_backend(&proxy.url()).await, (RequestMethod, UriPath))
                .deadline(deadline);
        let addr = ok_app(layer).await;
        assert_eq!(send(addr, post_("/pay/0")).await.status, 200);

        proxy.blackhole(true);
        for i in 0..5 {
            let started = Instant::now();
            let r = send(addr, post_(&format!("/pay/{i}"))).await;
            assert_eq!(r.status, 503);
            assert!(
                started.elapsed() < deadline + MARGIN,
                "{:?}",
                started.elapsed()
            );
        }
        proxy.blackhole(false);
        proxy.close_all();
        let cut = Instant::now();
        until_status(addr, 200, Duration::from_secs(10), || post_("/pay/0"))
            .await
            .expect("admitted after the partition");
        let took = cut.elapsed();
        println!("admitted {took:?} after the connections were cut");
        assert!(took < RECOVERY_BOUND, "admitted after {took:?}");
        assert!(common::eventually(Duration::from_secs(3), || server.dbsize() == 0).await);
    });
}

/// `batch_timeout(Duration::ZERO)` (fred's spelling of "no timeout") is
/// raised to the floor of 10 ms, not taken as a bound of nothing, which
/// gave up on lease calls at the watch's first tick (through the proxy, 0,
/// 0, 0 and 1 of ten acquires answered in four runs). The backend says its
/// bound; and most of ten acquires take the lease (not all need to: a
/// loaded machine may keep one past 10 ms).
#[test]
fn a_zero_batch_timeout_is_raised_to_a_floor() {
    run(|| async {
        let server = RedisServer::start();
        // Through the test proxy (one hop more, no delay): a zero bound
        // gives up before any answer can come back.
        let proxy = Proxy::start(server.port()).await;
        let backend = redis_backend(&proxy.url())
            .await
            .batch_timeout(Duration::ZERO);
        let shown = format!("{backend:?}");
        assert!(shown.contains("batch_timeout: 10ms"), "{shown}");
        let ttl = Duration::from_secs(5);
        let mut taken = 0;
        for i in 0..10 {
            let key = Bytes::from(format!("zero-timeout:{i}"));
            let token = Token::generate();
            match backend.acquire(&key, &token, ttl).await {
                Ok(Acquire::Acquired { .. }) => taken += 1,
                Err(e) if e.is_timeout() => continue,
                other => panic!("acquire {i}: {other:?}"),
            }
            // Not asserted: on a loaded machine a release may be given up
            // and sent again, and then answer "not ours".
            let _ = backend.release(&key, &token).await;
        }
        assert!(
            taken >= 5,
            "{taken} of ten acquires answered within the bound"
        );
    });
}

/// Whether `key` is acquired within `limit`, asked again while it is not
/// (each attempt bounded by 1 s). One token throughout: an attempt given
/// up on may still land, and a re-sent acquire with the holder's token
/// counts as acquired.
async fn acquired_within(
    backend: &RedisBackend,
    key: &Bytes,
    ttl: Duration,
    limit: Duration,
) -> bool {
    let (token, started) = (Token::generate(), Instant::now());
    loop {
        let attempt =
            tokio::time::timeout(Duration::from_secs(1), backend.acquire(key, &token, ttl)).await;
        if let Ok(Ok(Acquire::Acquired { .. })) = attempt {
            return true;
        }
        if started.elapsed() >= limit {
            return false;
        }
    }
}

/// A client built without a reconnect policy (fred's default, as the
/// `RedisBackend::new` example builds one) cannot have its connection
/// replaced: fred ends the connection's task for good when asked to
/// reconnect without a policy. A lease call the batch timeout gave up on
/// must not ask it to: once Redis answers promptly again, the next call is
/// answered and the client is still connected.
#[test]
fn a_client_without_a_reconnect_policy_outlives_a_slow_reply() {
    run(|| async {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let config = fred::types::config::Config::from_url(&proxy.url()).expect("url");
        let client = fred::types::Builder::from_config(config)
            .build()
            .expect("client");
        fred::interfaces::ClientLike::init(&client)
            .await
            .expect("connect");
        let backend = RedisBackend::new(client.clone()).batch_timeout(Duration::from_millis(50));
        let ttl = Duration::from_secs(5);
        let key = |i: u32| Bytes::from(format!("no-policy:{i}"));
        let first = backend.acquire(&key(1), &Token::generate(), ttl).await;
        assert!(matches!(first, Ok(Acquire::Acquired { .. })), "{first:?}");
        proxy.delay_down(Duration::from_millis(300));
        let slow = backend.acquire(&key(2), &Token::generate(), ttl).await;
        assert!(
            slow.as_ref().is_err_and(|e| e.is_timeout()),
            "given up after the batch timeout: {slow:?}"
        );
        proxy.delay_down(Duration::ZERO);
        // The late reply drains within 300 ms; then calls are answered.
        let answered = acquired_within(&backend, &key(3), ttl, Duration::from_secs(3)).await;
        assert!(
            answered,
            "no lease call answered within 3 s of the slow reply"
        );
        assert!(
            fred::interfaces::ClientLike::is_connected(&client),
            "the client is still connected"
        );
    });
}

/// An outage abandons a call every batch timeout (the direct call first,
/// then the lane's batches). Each used to ask fred for a reconnection of
/// its own, queued behind the one stuck on the black hole and replayed one
/// after another once Redis answered again, each a new connection. The
/// connection is replaced once at a time, however many calls give up.
#[test]
fn an_outage_replaces_the_connection_once_at_a_time() {
    run(|| async {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let backend = redis_backend(&proxy.url())
            .await
            .batch_timeout(Duration::from_millis(100));
        let ttl = Duration::from_secs(5);
        let first = backend
            .acquire(&Bytes::from_static(b"outage:0"), &Token::generate(), ttl)
            .await;
        assert!(matches!(first, Ok(Acquire::Acquired { .. })), "{first:?}");
        proxy.blackhole(true);
        // 1.5 s of calls, one every 20 ms, each given up on.
        let mut calls = tokio::task::JoinSet::new();
        for i in 1..=75u32 {
            let backend = backend.clone();
            calls.spawn(async move {
                let key = Bytes::from(format!("outage:{i}"));
                let _ = backend.acquire(&key, &Token::generate(), ttl).await;
            });
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        while calls.join_next().await.is_some() {}
        let before = proxy.accepted();
        proxy.blackhole(false);
        proxy.close_all();
        // Answered again once the connection is replaced.
        let back = Bytes::from_static(b"outage:back");
        let answered = acquired_within(&backend, &back, ttl, Duration::from_secs(10)).await;
        assert!(answered, "not answered again within 10 s");
        // What fred still had queued runs now: watch the connections made
        // for two more seconds of calls.
        for i in 0..100u32 {
            let key = Bytes::from(format!("outage:after:{i}"));
            let _ = tokio::time::timeout(
                Duration::from_millis(200),
                backend.acquire(&key, &Token::generate(), ttl),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let made = proxy.accepted() - before;
        assert!(made <= 3, "{made} connections made after the outage");
    });
}

/// With a batch timeout longer than a release's attempt used to be (2 s),
/// a slow Redis made the release's delivery give up on an attempt still
/// waiting for its answer and send another: every attempt ran on the
/// server, one more copy at every retry. An attempt now waits past the
/// dispatch's own bound, so a slow release runs once.
#[test]
fn a_slow_release_is_sent_once_under_a_long_batch_timeout() {
    run(|| async {
        let server = RedisServer::start();
        let backend = redis_backend(&server.url())
            .await
            .batch_timeout(Duration::from_secs(4));
        let (key, token) = (Bytes::from_static(b"slow-release"), Token::generate());
        let ttl = Duration::from_secs(30);
        let got = backend.acquire(&key, &token, ttl).await;
        assert!(matches!(got, Ok(Acquire::Acquired { .. })), "{got:?}");
        let calls = || -> u64 {
            server
                .cli(&["INFO", "commandstats"])
                .lines()
                .filter(|l| {
                    ["cmdstat_evalsha:", "cmdstat_eval:", "cmdstat_delifeq:"]
                        .iter()
                        .any(|c| l.starts_with(c))
                })
                .filter_map(|l| l.split(['=', ',']).nth(1)?.parse::<u64>().ok())
                .sum()
        };
        let before = calls();
        // Redis answers nothing for 2.6 s (the release waits in it).
        assert_eq!(server.cli(&["CLIENT", "PAUSE", "2600", "ALL"]), "OK");
        let released = backend.release(&key, &token).await;
        assert!(matches!(released, Ok(true)), "{released:?}");
        // Any copy sent meanwhile has run by the time this is answered.
        let probe = Bytes::from_static(b"slow-release:probe");
        let answered = acquired_within(&backend, &probe, ttl, Duration::from_secs(10)).await;
        assert!(answered, "answered again");
        let sent = calls() - before;
        assert!(
            sent <= 2,
            "{sent} scripts or DELIFEQs for one release (and one probe acquire)"
        );
    });
}

// ---- Reply lost, command re-sent ------------------------------------------------

/// The proxy swallows the acquire's reply and closes the connection: the
/// script ran on the server, fred reconnects and re-sends it, and the
/// original request still acquires (finding its own token counts as
/// acquired; with fencing, the same fence, not a new one).
#[test]
fn reply_lost_and_resent_still_acquires() {
    run_logged(|_logs| async move {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let backend = redis_backend(&proxy.url()).await;
        let layer = RedisLockLayer::new(backend, (RequestMethod, UriPath))
            .deadline(Duration::from_secs(2))
            .fencing(true);
        let counters = layer.clone(); // a clone shares the counters
        let runs = Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        let app = Router::new()
            .route(
                "/pay",
                post(move |lease: Lease| {
                    let r = r.clone();
                    async move {
                        r.fetch_add(1, Ordering::SeqCst);
                        format!("{} fence={:?}", admission(&lease), lease.fence())
                    }
                }),
            )
            .layer(layer);
        let addr = serve(app).await;
        // Warm up: the scripts are cached on the server.
        let fence_of = |body: &[u8]| -> u64 {
            let body = String::from_utf8_lossy(body);
            let f = body
                .strip_prefix("Locked fence=Some(")
                .and_then(|b| b.strip_suffix(')'));
            f.and_then(|f| f.parse().ok())
                .unwrap_or_else(|| panic!("no fence in {body:?}"))
        };
        let r = send(addr, post_("/pay")).await;
        let warm = fence_of(&r.body);
        // Acquires (fenced: always a script) and releases (a script, or
        // `DELIFEQ` where the server has it).
        let sent = || server.command_calls("evalsha") + server.command_calls("delifeq");
        let calls_before = sent();
        let issued_before = server.command_calls("time");
        let accepted_before = proxy.accepted();

        proxy.drop_next_reply();
        let r = send(addr, post_("/pay")).await;
        assert_eq!(r.status, 200, "no self-conflict: {:?}", r.body);
        let fence = fence_of(&r.body);
        assert!(fence > warm, "{fence} after {warm}");
        // The script reads the clock (`TIME`) only to issue a new fence: the
        // re-sent acquire found its own lease and kept the fence it had.
        assert_eq!(
            server.command_calls("time") - issued_before,
            1,
            "the re-sent acquire keeps its fence"
        );
        assert_eq!(proxy.dropped_replies(), 1);
        assert!(proxy.accepted() > accepted_before, "fred reconnected");
        assert_eq!(sent() - calls_before, 3, "acquire sent twice, release once");
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        assert_eq!(server.dbsize(), 1, "only the fence counter is left");
        let s = counters.stats();
        assert_eq!((s.acquired, s.conflict, s.released), (2, 0, 2));
    });
}

/// A plain acquire whose reply is lost finds its own token when fred sends
/// it again; its caller stopped waiting before that answer and sent its
/// cleanup release at once (as the layer does past its deadline). Nothing
/// the acquire would send after that answer (the script that pushes the
/// expiry out, or `SET … IFEQ` and a new acquire on Valkey 9) may land
/// behind the release: it would take the lease again, for nobody, for its
/// whole TTL. Looked at until the call's own bound (the batch timeout, 1 s)
/// has passed.
#[test]
fn resent_acquire_of_a_caller_gone_sends_nothing_after_its_answer() {
    run(|| async move {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let backend = redis_backend(&proxy.url()).await.local_dedup(false);
        let ttl = Duration::from_secs(30);
        // Warm: on Redis 7 the release script in the server's cache (on
        // Valkey 9 the release is `DELIFEQ`, no script).
        let warm = (Bytes::from_static(b"trl:{resent-warm}"), Token::generate());
        backend.acquire(&warm.0, &warm.1, ttl).await.unwrap();
        assert!(backend.release(&warm.0, &warm.1).await.unwrap());
        let sets_before = server.command_calls("set");

        let (key, token) = (Bytes::from_static(b"trl:{resent-gone}"), Token::generate());
        proxy.drop_next_reply();
        let acquire = backend.acquire(&key, &token, ttl);
        assert!(
            common::eventually(Duration::from_secs(2), || proxy.dropped_replies() == 1).await,
            "the acquire's reply was swallowed"
        );
        // The caller gives up, and its cleanup follows the acquire.
        drop(acquire);
        let cleanup = backend.release(&key, &token);
        let cleaned = tokio::time::timeout(Duration::from_secs(3), cleanup).await;
        assert!(
            matches!(cleaned, Ok(Ok(_))),
            "the cleanup release was answered: {cleaned:?}"
        );
        assert!(
            common::eventually(Duration::from_secs(3), || {
                server.command_calls("set") >= sets_before + 2
            })
            .await,
            "the acquire was sent again after the reconnection"
        );
        stays_free(&server, "trl:{resent-gone}").await;
    });
}

/// `key`, released by its caller's cleanup, is not taken again by anything
/// its acquire still had on its way: looked at for 1.5 s (past the call's
/// own bound, the batch timeout of 1 s).
async fn stays_free(server: &RedisServer, key: &str) {
    let taken_again =
        common::eventually(Duration::from_millis(1500), || server.dbsize() != 0).await;
    assert!(
        !taken_again,
        "the lease was taken again after its cleanup: PTTL {}",
        server.cli(&["PTTL", key])
    );
}

/// An acquire sent alone as its script whose server lost the script
/// (`NOSCRIPT`: a restart, a failover, `SCRIPT FLUSH`) sends it again as
/// `EVAL` after that reply; its caller stopped waiting before the reply and
/// sent its cleanup release at once. The `EVAL` would land after the
/// release and take the lease for nobody, for its whole TTL: it is not sent.
/// The scripts everywhere (`native_commands(false)`), the release's script
/// loaded and the acquire's not, replies held back 300 ms by the proxy so
/// that the cleanup is on its way before the `NOSCRIPT` comes back.
#[test]
fn acquire_of_a_caller_gone_sends_no_eval_after_noscript() {
    run(|| async move {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let backend = redis_backend(&proxy.url())
            .await
            .local_dedup(false)
            .native_commands(false);
        let ttl = Duration::from_secs(30);
        assert_eq!(server.cli(&["SCRIPT", "FLUSH"]), "OK");
        // The release's script in the server's cache (a release of a free
        // key: `NOSCRIPT`, then `EVAL`), the acquire's not.
        let other = (
            Bytes::from_static(b"trl:{noscript-warm}"),
            Token::generate(),
        );
        assert!(!backend.release(&other.0, &other.1).await.unwrap());
        let evals_before = server.command_calls("eval");

        let (key, token) = (
            Bytes::from_static(b"trl:{noscript-gone}"),
            Token::generate(),
        );
        proxy.delay_down(Duration::from_millis(300));
        let acquire = backend.acquire(&key, &token, ttl);
        // The caller gives up, and its cleanup follows the acquire.
        drop(acquire);
        let cleanup = backend.release(&key, &token);
        let cleaned = tokio::time::timeout(Duration::from_secs(3), cleanup).await;
        assert!(
            matches!(cleaned, Ok(Ok(false))),
            "the cleanup release ran, on a free key: {cleaned:?}"
        );
        proxy.delay_down(Duration::ZERO);
        stays_free(&server, "trl:{noscript-gone}").await;
        assert_eq!(
            server.command_calls("eval"),
            evals_before,
            "no EVAL after the acquire's NOSCRIPT"
        );
    });
}

// ---- SCRIPT FLUSH ---------------------------------------------------------------

/// `SCRIPT FLUSH` between acquire and release: the release gets `NOSCRIPT`,
/// falls back to `EVAL`, and still frees the key before the response ends.
#[test]
fn script_flush_between_acquire_and_release() {
    run_logged(|_logs| async move {
        let server = RedisServer::start();
        let layer =
            RedisLockLayer::new(redis_backend(&server.url()).await, (RequestMethod, UriPath));
        let counters = layer.clone(); // a clone shares the counters
        let (addr, gate, mut entered) = gated_app("/pay", layer).await;

        let inflight = tokio::spawn(send(addr, post_("/pay")));
        entered.recv().await.unwrap();
        assert_eq!(server.dbsize(), 1);
        assert_eq!(server.cli(&["SCRIPT", "FLUSH"]), "OK");
        let evals = server.command_calls("eval");
        let delifeqs = server.command_calls("delifeq");
        gate.permits.add_permits(1);
        assert_eq!(inflight.await.unwrap().status, 200);
        assert_eq!(server.dbsize(), 0, "released before the response ended");
        if server.is_valkey() {
            // Native release: no script to miss.
            assert_eq!(server.command_calls("delifeq"), delifeqs + 1, "DELIFEQ");
        } else {
            assert_eq!(server.command_calls("eval"), evals + 1, "NOSCRIPT fallback");
        }
        let s = counters.stats();
        assert_eq!((s.released, s.lease_lost, s.release_failed), (1, 0, 0));
        gate.permits.add_permits(1);
        assert_eq!(send(addr, post_("/pay")).await.status, 200);
    });
}

// ---- Eviction policy ---------------------------------------------------------------

/// At connect, a `maxmemory-policy` other than `noeviction` is warned about
/// once; an ACL user without `CONFIG` gets no warning (a debug line says
/// the policy could not be read) and a working lock. (The check's own
/// result, crate-private `EvictionPolicy`, is asserted by the unit tests in
/// `src/backend/redis/connect/tests.rs`.)
#[test]
fn eviction_policy_warned_once_and_config_acl_tolerated() {
    run_logged(|logs| async move {
        let server = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
        let backend = redis_backend(&server.url()).await;
        let warned = logs.lines_with(&["WARN", "maxmemory_policy=allkeys-lru"]);
        assert_eq!(warned.len(), 1, "warned at connect: {warned:?}");
        // Traffic over the same backend does not check (or warn) again.
        let addr = ok_app(RedisLockLayer::new(backend, (RequestMethod, Route))).await;
        for _ in 0..3 {
            assert_eq!(send(addr, post_("/pay")).await.status, 200);
        }
        let warned = logs.lines_with(&["WARN", "maxmemory_policy=allkeys-lru"]);
        assert_eq!(warned.len(), 1, "warned once: {warned:?}");

        assert_eq!(
            server.cli(&["ACL", "SETUSER", "app", "on", ">s3cret", "~*", "+@all", "-config"]),
            "OK"
        );
        let limited =
            redis_backend(&format!("redis://app:s3cret@127.0.0.1:{}", server.port())).await;
        assert_eq!(
            logs.lines_with(&["DEBUG", "cannot read maxmemory-policy"])
                .len(),
            1,
            "CONFIG denied: the policy is unknown, said at debug level: {}",
            logs.text()
        );
        assert_eq!(logs.lines_with(&["WARN", "maxmemory_policy"]).len(), 1);
        let addr = ok_app(RedisLockLayer::new(limited, (RequestMethod, Route))).await;
        assert_eq!(send(addr, post_("/pay")).await.status, 200);

        let fine = RedisServer::start();
        let backend = redis_backend(&fine.url()).await;
        let addr = ok_app(RedisLockLayer::new(backend, (RequestMethod, Route))).await;
        assert_eq!(send(addr, post_("/pay")).await.status, 200);
        assert_eq!(logs.lines_with(&["WARN", "maxmemory_policy"]).len(), 1);
        assert_eq!(
            logs.lines_with(&["cannot read maxmemory-policy"]).len(),
            1,
            "noeviction was read"
        );
    });
}

// ---- A late acquire --------------------------------------------------------------

/// The proxy delays the acquire (first the command, then its reply) past the
/// deadline: the request gets 503, the acquire still takes the key on the
/// server, and the best-effort release with our token removes it long before
/// its 30 s TTL, so another instance is admitted.
#[test]
fn late_acquire_after_deadline_is_cleaned_up() {
    run_logged(|_logs| async move {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let deadline = Duration::from_millis(300);
        let slow = RedisLockLayer::new(redis_backend(&proxy.url()).await, (RequestMethod, Route))
            .deadline(deadline)
            .ttl(Duration::from_secs(30));
        let counters = slow.clone(); // a clone shares the counters
        let direct =
            RedisLockLayer::new(redis_backend(&server.url()).await, (RequestMethod, Route))
                .ttl(Duration::from_secs(30));
        let slow_addr = ok_app(slow).await;
        let direct_addr = ok_app(direct).await;

        // Scripts cached on the server (else the late EVALSHA meets NOSCRIPT and
        // its EVAL fallback dies with the abandoned future: nothing lands).
        assert_eq!(send(slow_addr, post_("/pay")).await.status, 200);
        for delayed in ["command", "reply"] {
            let delay = Duration::from_millis(700);
            match delayed {
                "command" => proxy.delay_up(delay),
                _ => proxy.delay_down(delay),
            }
            let started = Instant::now();
            let request = tokio::spawn(async move {
                let r = send(slow_addr, post_("/pay")).await;
                (r.status, started.elapsed())
            });
            assert!(
                common::eventually(Duration::from_secs(2), || server.dbsize() == 1).await,
                "{delayed} delayed: the acquire landed"
            );
            let (status, took) = request.await.unwrap();
            assert_eq!(status, 503, "{delayed} delayed");
            assert!(
                took < deadline + MARGIN,
                "{delayed} delayed: answered after {took:?}"
            );
            assert!(
                common::eventually(Duration::from_secs(2), || server.dbsize() == 0).await,
                "{delayed} delayed: the late lease was released with our token"
            );
            println!(
                "{delayed} delayed: late lease gone {:?} after the request (TTL 30 s)",
                started.elapsed()
            );
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "well before the TTL"
            );
            assert_eq!(send(direct_addr, post_("/pay")).await.status, 200);
            proxy.delay_up(Duration::ZERO);
            proxy.delay_down(Duration::ZERO);
        }
        assert_eq!(counters.stats().round_trip_timeouts, 2);
    });
}

/// The client disconnects while its acquire is still on the way (the proxy
/// delays commands; the deadline is long): the dropped request future sends
/// the same best-effort release, so the lease that lands later is removed
/// long before its 30 s TTL.
#[test]
fn client_gone_during_acquire_is_cleaned_up() {
    run_logged(|_logs| async move {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let layer = RedisLockLayer::new(redis_backend(&proxy.url()).await, (RequestMethod, Route))
            .deadline(Duration::from_secs(5))
            .ttl(Duration::from_secs(30));
        let counters = layer.clone(); // a clone shares the counters
        let addr = ok_app(layer).await;
        assert_eq!(send(addr, post_("/pay")).await.status, 200); // scripts cached

        proxy.delay_up(Duration::from_millis(500));
        let before = proxy.chunks_up();
        // A lone acquire is a `SET` (with `PTTL`) on every server; a
        // script's `SET` is counted too.
        let acquires = || server.command_calls("set");
        let acquired_before = acquires();
        let pending = tokio::spawn(send(addr, post_("/pay")));
        assert!(
            common::eventually(Duration::from_secs(2), || proxy.chunks_up() > before).await,
            "the acquire is on its way"
        );
        pending.abort();
        let _ = pending.await;
        let gone = Instant::now();
        // On the native road the release follows its acquire on the wire at
        // once: the lease may come and go between two looks.
        assert!(
            common::eventually(Duration::from_secs(2), || {
                server.dbsize() == 1 || acquires() > acquired_before
            })
            .await,
            "the acquire landed after the client left"
        );
        assert!(
            common::eventually(Duration::from_secs(3), || server.dbsize() == 0).await,
            "and was released with our token"
        );
        println!(
            "orphaned lease gone {:?} after the client left",
            gone.elapsed()
        );
        let s = counters.stats();
        assert_eq!(
            (s.acquired, s.round_trips),
            (1, 1),
            "the orphaned acquire never completed"
        );
    });
}

// ---- Lease renewal ------------------------------------------------------------------

/// With renewal, a handler that runs for 3 TTLs keeps its lease (a duplicate
/// is still refused at the end); renewal stops with the request: no `extend`
/// starts after the release, neither on completion nor on client disconnect.
#[test]
fn renewal_keeps_long_handler_exclusive_and_stops_at_release() {
    run_logged(|_logs| async move {
        let server = RedisServer::start();
        let recording = Recording::new(redis_backend(&server.url()).await);
        let calls = recording.calls.clone();
        let ttl = Duration::from_millis(500);
        let layer = RedisLockLayer::new(recording, (RequestMethod, UriPath))
            .ttl(ttl)
            .renew(Renewal::new());
        let counters = layer.clone(); // a clone shares the counters
        let (addr, gate, mut entered) = gated_app("/pay", layer).await;

        let first = tokio::spawn(send(addr, post_("/pay")));
        let lease = entered.recv().await.unwrap();
        tokio::time::sleep(ttl * 3).await; // the time passing is what is tested
        assert_eq!(
            send(addr, post_("/pay")).await.status,
            409,
            "still held after 3 TTLs"
        );
        assert!(lease.renewals() >= 5, "renewed {} times", lease.renewals());
        assert!(
            lease.remaining() > Duration::ZERO,
            "counted from the last renewal"
        );
        gate.permits.add_permits(1);
        assert_eq!(first.await.unwrap().body, "Locked lost=false");
        tokio::time::sleep(ttl * 2).await; // several renewal intervals
        assert_eq!(extends_after_release(&calls.lock().unwrap()), 0);
        assert_eq!(server.dbsize(), 0);

        // Client disconnect: the guard is dropped, the watchdog with it.
        calls.lock().unwrap().clear();
        let pending = tokio::spawn(send(addr, post_("/pay")));
        entered.recv().await.unwrap();
        tokio::time::sleep(ttl).await;
        pending.abort();
        let _ = pending.await;
        assert!(common::eventually(Duration::from_secs(2), || server.dbsize() == 0).await);
        tokio::time::sleep(ttl * 2).await;
        let log = calls.lock().unwrap().clone();
        assert!(
            log.iter().any(|(w, _)| *w == "extend"),
            "renewed while running"
        );
        assert_eq!(extends_after_release(&log), 0, "no renewal after release");
        gate.permits.add_permits(1);
        let s = counters.stats();
        assert!(s.renewed >= 6 && s.lease_lost == 0, "{s:?}");
    });
}

/// Renewal is capped: after `max_renewals` the lease expires a TTL after the
/// last renewal, the handler sees `is_lost()`, and a duplicate is admitted.
#[test]
fn renewal_cap_then_lease_expires_and_handler_sees_it() {
    run_logged(|_logs| async move {
        let server = RedisServer::start();
        let ttl = Duration::from_millis(300);
        let layer =
            RedisLockLayer::new(redis_backend(&server.url()).await, (RequestMethod, UriPath))
                .ttl(ttl)
                .renew(Renewal::new().max_renewals(2));
        let counters = layer.clone(); // a clone shares the counters
        let (addr, gate, mut entered) = gated_app("/pay", layer).await;

        let started = Instant::now();
        let first = tokio::spawn(send(addr, post_("/pay")));
        let lease = entered.recv().await.unwrap();
        tokio::time::timeout(Duration::from_secs(3), lease.lost())
            .await
            .expect("lease reported lost after the cap");
        let at = started.elapsed();
        // 2 renewals at ttl/3 intervals, then one TTL: about 500 ms.
        assert!(at >= ttl && at < ttl * 4, "lost after {at:?}");
        assert_eq!(lease.renewals(), 2);
        assert_eq!(lease.remaining(), Duration::ZERO);
        // One permit for the first request, one for the admitted duplicate.
        gate.permits.add_permits(2);
        assert!(
            until_status(addr, 200, Duration::from_secs(2), || post_("/pay"))
                .await
                .is_some(),
            "a duplicate is admitted once the lease expired"
        );
        assert_eq!(first.await.unwrap().body, "Locked lost=true");
        let s = counters.stats();
        assert_eq!(s.renewed, 2);
        assert!(s.lease_lost >= 1);
    });
}

/// Another holder takes the key (here: it is deleted and re-set with a
/// foreign token): the next renewal finds it gone, the handler sees it, and
/// a `lease_lost` warning names the digest.
#[test]
fn renewal_finds_lease_taken_over() {
    run_logged(|logs| async move {
        let server = RedisServer::start();
        let ttl = Duration::from_millis(600);
        let layer =
            RedisLockLayer::new(redis_backend(&server.url()).await, (RequestMethod, UriPath))
                .ttl(ttl)
                .renew(Renewal::new());
        let counters = layer.clone(); // a clone shares the counters
        let (addr, gate, mut entered) = gated_app("/pay", layer).await;

        let first = tokio::spawn(send(addr, post_("/pay")));
        let lease = entered.recv().await.unwrap();
        let digest = lease.key().unwrap().to_string();
        let key = format!("trl:{{{digest}}}");
        assert_eq!(
            server.cli(&["SET", &key, "someone-else", "PX", "5000"]),
            "OK"
        );
        tokio::time::timeout(Duration::from_secs(2), lease.lost())
            .await
            .expect("the watchdog saw the lease taken");
        gate.permits.add_permits(1);
        assert_eq!(first.await.unwrap().body, "Locked lost=true");
        assert_eq!(
            server.cli(&["GET", &key]),
            "someone-else",
            "never deletes a foreign lease"
        );
        assert!(counters.stats().lease_lost >= 1);
        let lines = logs.lines_with(&["WARN", "outcome=\"lease_lost\"", &digest]);
        assert!(!lines.is_empty(), "{}", logs.text());
    });
}

// ---- Fencing tokens -------------------------------------------------------------------

/// Fencing tokens strictly increase per key across holders and instances,
/// are issued in the acquire's round trip (`prefix:{digest}:fence`, same
/// hash tag, a counter that expires with its lease), and are absent when
/// fencing is off.
#[test]
fn fencing_tokens_only_grow_across_instances() {
    run_logged(|_logs| async move {
        let server = RedisServer::start();
        let handler =
            |lease: Lease| async move { format!("{}", lease.fence().map_or(-1, |f| f as i64)) };
        let a = serve(
            Router::new().route("/pay/{n}", post(handler)).layer(
                RedisLockLayer::new(redis_backend(&server.url()).await, (RequestMethod, UriPath))
                    .fencing(true),
            ),
        )
        .await;
        let b = serve(
            Router::new().route("/pay/{n}", post(handler)).layer(
                RedisLockLayer::new(redis_backend(&server.url()).await, (RequestMethod, UriPath))
                    .fencing(true),
            ),
        )
        .await;
        let plain = serve(Router::new().route("/pay/{n}", post(handler)).layer(
            RedisLockLayer::new(redis_backend(&server.url()).await, (RequestMethod, UriPath)),
        ))
        .await;
        let mut seen = Vec::new();
        for i in 0..6 {
            let addr = if i % 2 == 0 { a } else { b };
            let r = send(addr, post_("/pay/1")).await;
            seen.push(String::from_utf8_lossy(&r.body).parse::<i64>().unwrap());
        }
        assert!(
            seen.windows(2).all(|w| 0 < w[0] && w[0] < w[1]),
            "strictly increasing: {seen:?}"
        );
        let other: i64 = String::from_utf8_lossy(&send(a, post_("/pay/2")).await.body)
            .parse()
            .unwrap();
        assert!(other > 0, "per key, fenced too: {other}");
        assert_eq!(
            send(plain, post_("/pay/1")).await.body,
            "-1",
            "off by default"
        );
        let keys = server.cli(&["KEYS", "*"]);
        let fence_keys: Vec<_> = keys.lines().filter(|k| k.ends_with("}:fence")).collect();
        assert_eq!(fence_keys.len(), 2, "{keys}");
        assert!(fence_keys.iter().all(|k| k.starts_with("trl:{")));
        for k in fence_keys {
            let pttl: i64 = server.cli(&["PTTL", k]).parse().unwrap();
            assert!(pttl > 0, "{k} expires with its lease (PTTL {pttl})");
        }
    });
}

// ---- Observability -----------------------------------------------------------------

/// Events carry the key digest and an `outcome` (never the raw key
/// material) and `layer.stats()` counts the same outcomes.
#[test]
fn events_name_digest_and_outcome_never_raw_data() {
    run_logged(|logs| async move {
        let layer = RedisLockLayer::new(
            tower_redis_lock::MemoryBackend::new(),
            (RequestMethod, UriPath),
        )
        .renew(Renewal::new());
        let counters = layer.clone(); // a clone shares the counters
        let (addr, gate, mut entered) = gated_app("/pay/{secret}", layer).await;
        let first = tokio::spawn(send(addr, post_("/pay/alice-card-4111")));
        let lease = entered.recv().await.unwrap();
        assert_eq!(send(addr, post_("/pay/alice-card-4111")).await.status, 409);
        gate.permits.add_permits(1);
        assert_eq!(first.await.unwrap().status, 200);
        let digest = lease.key().unwrap().to_string();
        for outcome in ["acquired", "conflict", "released"] {
            let lines = logs.lines_with(&[&format!("outcome=\"{outcome}\""), &digest]);
            assert_eq!(lines.len(), 1, "{outcome}: {}", logs.text());
            if outcome != "released" {
                // Emitted inside the `lock` span, which names the digest
                // too (and the layer's label, `lock` by default).
                assert!(
                    lines[0].contains(&format!("lock{{key={digest} layer=\"lock\"}}")),
                    "{}",
                    lines[0]
                );
            }
            if outcome != "conflict" {
                assert!(lines[0].contains("latency_us="), "{}", lines[0]);
            }
        }
        assert!(
            !logs.text().contains("alice-card-4111"),
            "raw key material logged"
        );
        let s: LockStats = counters.stats();
        assert_eq!((s.acquired, s.conflict, s.released), (1, 1, 1));
        assert!(s.mean_round_trip().is_some());
    });
}
