//! Waiting instead of 409 (`RedisLockLayer::wait`), over real HTTP on
//! loopback, on memory and on `redis-server`s of the tests' own, one
//! instance and two: requests of one key run one at a time in arrival order
//! and each starts right after the previous one's end; a short bound still
//! answers 409; a waiter whose client hangs up leaves and passes its turn;
//! a ledger's debits over two instances are exact; a waited request costs
//! at most 4 Redis commands more than a plain one when it hears one release
//! (renewal and the back-off cost more: see `RedisLockLayer::wait`).

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use common::{eventually, req, send, serve, stamp, Env, Kind, RedisServer};
use tokio::time::Instant;
use tower_redis_lock::key::{Header, RequestMethod, Route};
use tower_redis_lock::{RedisBackend, RedisLockLayer};

/// What the quickstart's `/stats` counts, shared by every instance of a
/// test (so `max_concurrent` is across the fleet), and each run's span.
#[derive(Default)]
struct Runs {
    executions: AtomicU64,
    running: AtomicU64,
    max_concurrent: AtomicU64,
    /// (instance, arrival number, start, end) of each run.
    spans: Mutex<Vec<(u8, u64, Instant, Instant)>>,
    /// Arrivals per instance, numbered by the outer layer.
    arrivals: [AtomicU64; 2],
}

#[derive(Clone)]
struct App {
    runs: Arc<Runs>,
    instance: u8,
    hold: Duration,
}

/// The arrival number an outer layer gave a request.
#[derive(Clone, Copy)]
struct Arrival(u64);

async fn pay(State(app): State<App>, arrival: axum::Extension<Arrival>) -> &'static str {
    let r = &app.runs;
    r.executions.fetch_add(1, Ordering::SeqCst);
    let now = r.running.fetch_add(1, Ordering::SeqCst) + 1;
    r.max_concurrent.fetch_max(now, Ordering::SeqCst);
    let start = Instant::now();
    tokio::time::sleep(app.hold).await;
    let end = Instant::now();
    r.running.fetch_sub(1, Ordering::SeqCst);
    r.spans
        .lock()
        .unwrap()
        .push((app.instance, arrival.0 .0, start, end));
    "paid"
}

async fn stats(State(app): State<App>) -> Json<serde_json::Value> {
    let r = &app.runs;
    Json(serde_json::json!({
        "executions": r.executions.load(Ordering::SeqCst),
        "max_concurrent": r.max_concurrent.load(Ordering::SeqCst),
    }))
}

/// The quickstart's shape: `POST /pay` locked on method + route + user,
/// `GET /stats`; an outer layer numbers arrivals per instance.
async fn instance(
    layer: RedisLockLayer,
    runs: Arc<Runs>,
    instance: u8,
    hold: Duration,
) -> SocketAddr {
    let app = App {
        runs: runs.clone(),
        instance,
        hold,
    };
    let router = Router::new()
        .route("/pay", post(pay).layer(layer))
        .route("/stats", get(stats))
        .with_state(app)
        .layer(axum::middleware::from_fn(
            move |mut req: axum::extract::Request, next: axum::middleware::Next| {
                let runs = runs.clone();
                async move {
                    if req.uri().path() == "/pay" {
                        let n = runs.arrivals[instance as usize].fetch_add(1, Ordering::SeqCst);
                        req.extensions_mut().insert(Arrival(n));
                    }
                    next.run(req).await
                }
            },
        ));
    serve(router).await
}

fn lock_layer(
    backend: impl tower_redis_lock::backend::LockBackend,
    wait_ms: u64,
) -> RedisLockLayer {
    RedisLockLayer::new(
        backend,
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
    .ttl(Duration::from_secs(70))
    .wait(Duration::from_millis(wait_ms))
}

fn click() -> http::Request<http_body_util::Full<bytes::Bytes>> {
    req("POST", "/pay", &[("x-user-id", "alice")], "{}")
}

/// Send a click to each address in turn, each once the previous one is in,
/// so arrival order is known: the first holding the lease, each later one
/// waiting for it (`counts` gives `acquired` and `waited`, summed over the
/// instances). Not `acquired + waited > i`: a waiter counts in both once
/// its turn came, which would let a click go before the previous one had
/// arrived.
async fn clicks(
    addrs: &[SocketAddr],
    n: usize,
    counts: impl Fn() -> (u64, u64),
) -> Vec<tokio::task::JoinHandle<u16>> {
    let mut sent = Vec::new();
    for i in 0..n {
        let addr = addrs[i % addrs.len()];
        sent.push(tokio::spawn(
            async move { send(addr, click()).await.status },
        ));
        assert!(
            eventually(Duration::from_secs(5), || arrived(i as u64, counts())).await,
            "click {i} never arrived"
        );
    }
    sent
}

/// Whether click `i` is in, from (`acquired`, `waited`): the first holds
/// the lease, each later one waits for it.
fn arrived(i: u64, (acquired, waited): (u64, u64)) -> bool {
    match i {
        0 => acquired >= 1,
        _ => waited >= i,
    }
}

/// The gaps between each run's end and the next one's start.
fn gaps(runs: &Runs) -> Vec<Duration> {
    let mut spans = runs.spans.lock().unwrap().clone();
    spans.sort_by_key(|s| s.2);
    spans
        .windows(2)
        .map(|w| w[1].2.saturating_duration_since(w[0].3))
        .collect()
}

/// No two runs overlap.
fn assert_no_overlap(runs: &Runs) {
    let mut spans = runs.spans.lock().unwrap().clone();
    spans.sort_by_key(|s| s.2);
    for w in spans.windows(2) {
        assert!(w[1].2 >= w[0].3, "runs overlap: {:?} and {:?}", w[0], w[1]);
    }
}

/// Per instance, runs started in arrival order.
fn assert_arrival_order(runs: &Runs) {
    let mut spans = runs.spans.lock().unwrap().clone();
    spans.sort_by_key(|s| s.2);
    for inst in 0..2u8 {
        let order: Vec<u64> = spans.iter().filter(|s| s.0 == inst).map(|s| s.1).collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(order, sorted, "instance {inst} ran out of arrival order");
    }
}

async fn stats_of(addr: SocketAddr) -> serde_json::Value {
    send(addr, req("GET", "/stats", &[], "")).await.json()
}

/// `LOCK_WAIT_MS=2000`, a 200 ms handler, three concurrent clicks on one
/// instance: all 200, three executions never overlapping, each starting
/// within 50 ms of the previous one's end.
async fn three_clicks_run_in_turn(kind: Kind) {
    let env = Env::new(kind).await;
    let runs = Arc::new(Runs::default());
    let layer = lock_layer(env.backend().await, 2000);
    let addr = instance(layer.clone(), runs.clone(), 0, Duration::from_millis(200)).await;
    let sent = clicks(&[addr], 3, || {
        (layer.stats().acquired, layer.stats().waited)
    })
    .await;
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
    let stats = stats_of(addr).await;
    assert_eq!(stats["executions"], 3);
    assert_eq!(stats["max_concurrent"], 1);
    assert_no_overlap(&runs);
    assert_arrival_order(&runs);
    let gaps = gaps(&runs);
    assert!(
        gaps.iter().all(|g| *g < Duration::from_millis(50)),
        "each run starts within 50 ms of the previous end: {gaps:?}"
    );
    let s = layer.stats();
    assert_eq!(
        (s.acquired, s.waited, s.waited_conflict, s.conflict),
        (3, 2, 0, 0)
    );
    assert_eq!(env.held(), 0, "no lease left behind");
}

/// `LOCK_WAIT_MS=300`: the second waits 200 ms and runs; the third would
/// wait 400 ms and answers 409 at its bound.
async fn a_short_bound_still_answers_409(kind: Kind) {
    let env = Env::new(kind).await;
    let runs = Arc::new(Runs::default());
    let layer = lock_layer(env.backend().await, 300);
    let addr = instance(layer.clone(), runs.clone(), 0, Duration::from_millis(200)).await;
    let sent = clicks(&[addr], 3, || {
        (layer.stats().acquired, layer.stats().waited)
    })
    .await;
    let mut statuses = Vec::new();
    for s in sent {
        statuses.push(s.await.unwrap());
    }
    assert_eq!(statuses, [200, 200, 409]);
    assert_eq!(stats_of(addr).await["executions"], 2);
    let s = layer.stats();
    assert_eq!((s.waited, s.waited_conflict, s.conflict), (2, 1, 1));
}

/// A waiter whose client hangs up is gone from the queue at once, and the
/// next waiter gets its turn when the holder ends: the hung-up request
/// never runs.
async fn a_waiter_that_hangs_up_passes_its_turn(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = common::Gate::new();
    let layer = lock_layer(env.backend().await, 5000);
    // Counts request futures the server dropped before they answered.
    let dropped = Arc::new(AtomicU64::new(0));
    struct Dropped(Arc<AtomicU64>, bool);
    impl Drop for Dropped {
        fn drop(&mut self) {
            if !self.1 {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    let router = Router::new()
        .route(
            "/pay",
            post(|State(gate): State<common::Gate>| async move {
                gate.pass(()).await;
                "paid"
            }),
        )
        .with_state(gate.clone())
        .layer(layer.clone())
        .layer(axum::middleware::from_fn({
            let dropped = dropped.clone();
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let guard = Dropped(dropped.clone(), false);
                async move {
                    let mut guard = guard;
                    let res = next.run(req).await;
                    guard.1 = true;
                    res
                }
            }
        }));
    let addr = serve(router).await;
    let holder = tokio::spawn(async move { send(addr, click()).await.status });
    entered.recv().await.unwrap();
    // A client on a bare socket, so that hanging up closes the connection.
    let mut leaver = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(
        &mut leaver,
        b"POST /pay HTTP/1.1\r\nhost: x\r\nx-user-id: alice\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await
    .unwrap();
    assert!(eventually(Duration::from_secs(5), || layer.stats().waited == 1).await);
    let next = tokio::spawn(async move { send(addr, click()).await.status });
    assert!(eventually(Duration::from_secs(5), || layer.stats().waited == 2).await);
    // The first waiter's client hangs up; the server drops its request.
    drop(leaver);
    assert!(
        eventually(Duration::from_secs(5), || dropped.load(Ordering::SeqCst)
            == 1)
        .await,
        "the server never dropped the hung-up request"
    );
    gate.permits.add_permits(2);
    assert_eq!(holder.await.unwrap(), 200);
    assert_eq!(next.await.unwrap(), 200);
    assert_eq!(gate.runs(), 2, "the hung-up request never ran");
    let s = layer.stats();
    assert_eq!((s.acquired, s.waited, s.waited_conflict), (2, 2, 0));
    assert_eq!(env.held(), 0);
}

suite!(
    three_clicks_run_in_turn,
    a_short_bound_still_answers_409,
    a_waiter_that_hangs_up_passes_its_turn,
);

/// Lease commands Redis ran so far: scripts (an `EVALSHA` refused with
/// `NOSCRIPT` and sent again as `EVAL`, once per script and server, counts
/// once), subscriptions.
fn commands(server: &RedisServer) -> [u64; 3] {
    let info = server.cli(&["INFO", "commandstats"]);
    let failed = info
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
        .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("failed_calls=")))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .unwrap_or(0);
    [
        server.command_calls("evalsha") - failed + server.command_calls("eval"),
        server.command_calls("ssubscribe"),
        server.command_calls("sunsubscribe"),
    ]
}

/// Two instances (two clients) on one Redis, three clicks alternating
/// between them: all 200, three executions never overlapping, each
/// starting within 100 ms of the previous one's end; a waited request cost
/// at most 4 commands more than a plain one (acquire and release), and no
/// subscription is left once nobody waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_clicks_over_two_instances_run_in_turn() {
    let server = RedisServer::start();
    let runs = Arc::new(Runs::default());
    let a = lock_layer(RedisBackend::connect(&server.url()).await.unwrap(), 2000);
    let b = lock_layer(RedisBackend::connect(&server.url()).await.unwrap(), 2000);
    let addr_a = instance(a.clone(), runs.clone(), 0, Duration::from_millis(200)).await;
    let addr_b = instance(b.clone(), runs.clone(), 1, Duration::from_millis(200)).await;
    let before = commands(&server);
    let counts = || {
        let (a, b) = (a.stats(), b.stats());
        (a.acquired + b.acquired, a.waited + b.waited)
    };
    let sent = clicks(&[addr_a, addr_b], 3, counts).await;
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
    let stats = stats_of(addr_a).await;
    assert_eq!(stats["executions"], 3);
    assert_eq!(stats["max_concurrent"], 1);
    assert_no_overlap(&runs);
    let gaps = gaps(&runs);
    assert!(
        gaps.iter().all(|g| *g < Duration::from_millis(100)),
        "each run starts within 100 ms of the previous end: {gaps:?}"
    );
    let waited = a.stats().waited + b.stats().waited;
    assert_eq!(waited, 2);
    // Unsubscribed once nobody waits.
    assert!(
        eventually(Duration::from_secs(5), || {
            server.cli(&["PUBSUB", "SHARDCHANNELS"]).trim().is_empty()
        })
        .await,
        "a subscription outlived its waiters: {}",
        server.cli(&["PUBSUB", "SHARDCHANNELS"])
    );
    let after = commands(&server);
    let [scripts, subs, unsubs] = [0, 1, 2].map(|i| after[i] - before[i]);
    let extra = scripts + subs + unsubs - 2 * 3;
    eprintln!(
        "two instances, 3 clicks, {waited} waited: {scripts} scripts, {subs} SSUBSCRIBE, {unsubs} SUNSUBSCRIBE: {extra} commands beyond acquire + release"
    );
    assert!(
        extra <= 4 * waited,
        "{extra} commands beyond acquire + release for {waited} waited requests"
    );
}

/// The token a waiter finally takes the lease with says when it took it,
/// not when the request arrived: a refused acquire reads the holder's time
/// left from its token's issue time (`Token::generate`), so a lease won
/// after a long wait must not look as old as the wait. One instance, an
/// 800 ms holder, one waiter; the waiter's lease, read back from Redis
/// while it runs, was issued after the waiter was seen waiting (it arrived
/// before that) and after the holder had run most of its 800 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waited_lease_is_stamped_when_taken() {
    let server = RedisServer::start();
    let runs = Arc::new(Runs::default());
    let layer = lock_layer(RedisBackend::connect(&server.url()).await.unwrap(), 5000);
    let addr = instance(layer.clone(), runs.clone(), 0, Duration::from_millis(800)).await;
    let sent = clicks(&[addr], 2, || {
        (layer.stats().acquired, layer.stats().waited)
    })
    .await;
    let seen_waiting_ms = stamp::wall_ms();
    assert!(
        eventually(Duration::from_secs(10), || {
            runs.executions.load(Ordering::SeqCst) == 2
        })
        .await,
        "the waiter never ran"
    );
    // The one lease key on this server: the value that is a token.
    let keys = server.cli(&["KEYS", "*"]);
    let tokens: Vec<String> = keys
        .lines()
        .map(|k| server.cli(&["GET", k.trim()]).trim().to_owned())
        .filter(|v| v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit()))
        .collect();
    assert_eq!(tokens.len(), 1, "keys {keys:?}, tokens {tokens:?}");
    let issued = stamp::issued_ms(&tokens[0]);
    assert!(
        issued >= seen_waiting_ms + 100,
        "the waiter's lease was issued at {issued} ms, before it was seen waiting ({seen_waiting_ms} ms) + 100 ms"
    );
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
}

/// A ledger: 20 concurrent debits of one account, spread over two
/// instances on one Redis, each a read-modify-write that a concurrent one
/// would corrupt: all succeed, in arrival order per instance, the balance
/// exact, no two overlapping. The first debit holds the lease until the
/// other 19 wait, so that each is in its instance's queue before the next
/// is sent (`waited` counts it; `acquired + waited` would count a waiter
/// twice once its turn came, and let a debit go before the previous one
/// had arrived).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_debits_over_two_instances_are_exact_and_in_order() {
    let server = RedisServer::start();
    let balance = Arc::new(AtomicU64::new(1_000));
    let runs = Arc::new(Runs::default());
    let first_may_end = Arc::new(tokio::sync::Semaphore::new(0));
    let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut layers = Vec::new();
    let mut addrs = Vec::new();
    for inst in 0..2u8 {
        let layer = RedisLockLayer::new(
            RedisBackend::connect(&server.url()).await.unwrap(),
            (Route, Header::trusted_identity("x-account")),
        )
        .fencing(true)
        .wait(Duration::from_secs(10));
        let (balance, runs2) = (balance.clone(), runs.clone());
        let (gate, first) = (first_may_end.clone(), first.clone());
        let router = Router::new()
            .route(
                "/debit",
                post(move |arrival: axum::Extension<Arrival>| {
                    let (balance, runs) = (balance.clone(), runs2.clone());
                    let (gate, first) = (gate.clone(), first.clone());
                    async move {
                        if first.swap(false, Ordering::SeqCst) {
                            gate.acquire().await.expect("gate").forget();
                        }
                        let start = Instant::now();
                        let now = runs.running.fetch_add(1, Ordering::SeqCst) + 1;
                        runs.max_concurrent.fetch_max(now, Ordering::SeqCst);
                        // Read, think, write: a concurrent debit would be lost.
                        let read = balance.load(Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        balance.store(read - 7, Ordering::SeqCst);
                        runs.running.fetch_sub(1, Ordering::SeqCst);
                        let end = Instant::now();
                        runs.spans
                            .lock()
                            .unwrap()
                            .push((inst, arrival.0 .0, start, end));
                        "debited"
                    }
                }),
            )
            .layer(layer.clone())
            .layer(axum::middleware::from_fn({
                let runs = runs.clone();
                move |mut req: axum::extract::Request, next: axum::middleware::Next| {
                    let runs = runs.clone();
                    async move {
                        let n = runs.arrivals[inst as usize].fetch_add(1, Ordering::SeqCst);
                        req.extensions_mut().insert(Arrival(n));
                        next.run(req).await
                    }
                }
            }));
        addrs.push(serve(router).await);
        layers.push(layer);
    }
    let debit = || req("POST", "/debit", &[("x-account", "acct-1")], "");
    let mut sent = Vec::new();
    for i in 0..20usize {
        let addr = addrs[i % 2];
        let req = debit();
        sent.push(tokio::spawn(async move { send(addr, req).await.status }));
        // The first holds the lease; each later one waits for it.
        let counts = || {
            let sum = |f: fn(&tower_redis_lock::LockStats) -> u64| {
                layers.iter().map(|l| f(&l.stats())).sum::<u64>()
            };
            (sum(|s| s.acquired), sum(|s| s.waited))
        };
        assert!(
            eventually(Duration::from_secs(5), || arrived(i as u64, counts())).await,
            "debit {i} never arrived"
        );
    }
    first_may_end.add_permits(1);
    for s in sent {
        assert_eq!(s.await.unwrap(), 200, "every debit succeeds");
    }
    assert_eq!(
        balance.load(Ordering::SeqCst),
        1_000 - 20 * 7,
        "balance exact"
    );
    assert_eq!(runs.max_concurrent.load(Ordering::SeqCst), 1);
    assert_no_overlap(&runs);
    assert_arrival_order(&runs);
    assert_eq!(runs.spans.lock().unwrap().len(), 20);
}

/// The quickstart example itself (the built binary), started with
/// `LOCK_WAIT_MS` on `redis_url` (memory without one); its address.
fn start_quickstart(wait_ms: u64, redis_url: Option<&str>) -> (std::process::Child, SocketAddr) {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new(crate::common::examples::example_binary("quickstart"));
    cmd.env("ADDR", "127.0.0.1:0")
        .env("LOCK_WAIT_MS", wait_ms.to_string())
        .env_remove("REDLOCK_URLS")
        .env_remove("REDIS_URL")
        .stdout(std::process::Stdio::piped());
    if let Some(url) = redis_url {
        cmd.env("REDIS_URL", url);
    }
    let mut child = cmd.spawn().expect("start the quickstart example");
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .parse()
        .unwrap();
    (child, addr)
}

/// Three concurrent clicks on the quickstart (200 ms handler), spread over
/// `addrs`; their statuses, sorted.
async fn three_quickstart_clicks(addrs: &[SocketAddr]) -> Vec<u16> {
    let sent: Vec<_> = (0..3)
        .map(|i| {
            let addr = addrs[i % addrs.len()];
            tokio::spawn(async move { send(addr, click()).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for s in sent {
        statuses.push(s.await.unwrap());
    }
    statuses.sort_unstable();
    statuses
}

/// The quickstart with `LOCK_WAIT_MS=2000`: three concurrent clicks all
/// answer 200, `/stats` says 3 executions, never 2 at once; with
/// `LOCK_WAIT_MS=300` one of the three answers 409. On memory, then on two
/// instances sharing one Redis.
#[test]
fn the_quickstart_waits_with_lock_wait_ms() {
    let _binary = crate::common::examples::example_binary("quickstart");
    common::run(|| async move {
        // One instance, memory.
        let (mut child, addr) = start_quickstart(2000, None);
        assert_eq!(three_quickstart_clicks(&[addr]).await, [200, 200, 200]);
        let stats = stats_of(addr).await;
        assert_eq!(
            (
                stats["executions"].as_u64(),
                stats["max_concurrent"].as_u64()
            ),
            (Some(3), Some(1))
        );
        child.kill().unwrap();
        child.wait().unwrap();

        let (mut child, addr) = start_quickstart(300, None);
        assert_eq!(three_quickstart_clicks(&[addr]).await, [200, 200, 409]);
        assert_eq!(stats_of(addr).await["executions"], 2);
        child.kill().unwrap();
        child.wait().unwrap();

        // Two instances on one Redis.
        let server = RedisServer::start();
        let (mut a, addr_a) = start_quickstart(2000, Some(&server.url()));
        let (mut b, addr_b) = start_quickstart(2000, Some(&server.url()));
        assert_eq!(
            three_quickstart_clicks(&[addr_a, addr_b]).await,
            [200, 200, 200]
        );
        let (sa, sb) = (stats_of(addr_a).await, stats_of(addr_b).await);
        let total = sa["executions"].as_u64().unwrap() + sb["executions"].as_u64().unwrap();
        assert_eq!(total, 3);
        assert!(
            sa["max_concurrent"].as_u64().unwrap() <= 1
                && sb["max_concurrent"].as_u64().unwrap() <= 1
        );
        for child in [&mut a, &mut b] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    });
}

/// Scripts and subscriptions run on every master of the test cluster.
fn cluster_commands(cluster: &common::scale::Cluster) -> u64 {
    cluster
        .masters()
        .iter()
        .map(|m| {
            let info = common::scale::cli(m.port, &["INFO", "commandstats"]);
            let stat = |name: &str, field: &str| -> u64 {
                info.lines()
                    .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:")))
                    .and_then(|l| l.split(',').find_map(|f| f.strip_prefix(field)))
                    .and_then(|n| n.trim().parse().ok())
                    .unwrap_or(0)
            };
            stat("evalsha", "calls=") - stat("evalsha", "failed_calls=")
                + stat("eval", "calls=")
                + stat("ssubscribe", "calls=")
                + stat("sunsubscribe", "calls=")
        })
        .sum()
}

/// On a Redis Cluster (3 masters): two instances, three users whose keys
/// live in different slots, three clicks each alternating between the
/// instances: all 200, never overlapping, and woken by the release through
/// sharded pub/sub in the key's slot (a waiter that fell back to the
/// back-off would look several times during a 200 ms hold: at most 4
/// commands more per waited request says it did not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_clicks_over_two_instances_on_a_cluster() {
    let _shared = common::scale::TOPOLOGY.read().await;
    let cluster = common::scale::Cluster::get();
    for user in ["alice", "bob", "carol"] {
        let runs = Arc::new(Runs::default());
        let layer = || async {
            lock_layer(RedisBackend::connect(&cluster.url()).await.unwrap(), 2000)
                .key_space(tower_redis_lock::key::KeySpace::new("trl-wait"))
        };
        let (a, b) = (layer().await, layer().await);
        let addr_a = instance(a.clone(), runs.clone(), 0, Duration::from_millis(200)).await;
        let addr_b = instance(b.clone(), runs.clone(), 1, Duration::from_millis(200)).await;
        let before = cluster_commands(cluster);
        let mut sent = Vec::new();
        for i in 0..3u64 {
            let addr = [addr_a, addr_b][i as usize % 2];
            let r = req("POST", "/pay", &[("x-user-id", user)], "{}");
            sent.push(tokio::spawn(async move { send(addr, r).await.status }));
            let counts = || {
                let (a, b) = (a.stats(), b.stats());
                (a.acquired + b.acquired, a.waited + b.waited)
            };
            assert!(eventually(Duration::from_secs(5), || arrived(i, counts())).await);
        }
        for s in sent {
            assert_eq!(s.await.unwrap(), 200, "{user}");
        }
        assert_eq!(runs.executions.load(Ordering::SeqCst), 3);
        assert_eq!(runs.max_concurrent.load(Ordering::SeqCst), 1);
        assert_no_overlap(&runs);
        let waited = a.stats().waited + b.stats().waited;
        assert_eq!(waited, 2);
        // The last unsubscribe is sent after its waiter took the lease.
        let settled = eventually(Duration::from_secs(5), || {
            cluster_commands(cluster) - before >= 2 * 3 + 2
        })
        .await;
        assert!(settled);
        let extra = cluster_commands(cluster) - before - 2 * 3;
        assert!(
            extra <= 4 * waited,
            "{user}: {extra} commands beyond acquire + release for {waited} waited requests"
        );
    }
}

/// A URL of `server` for a user allowed every command and key, and no
/// channel.
fn channelless_user(server: &RedisServer) -> String {
    server.cli(&[
        "ACL",
        "SETUSER",
        "app",
        "on",
        ">secret-pw",
        "~*",
        "+@all",
        "resetchannels",
    ]);
    format!("redis://app:secret-pw@127.0.0.1:{}", server.port())
}

/// A Redis user whose ACL grants no pub/sub channel (`resetchannels`, the
/// default for new users in Redis 7): subscribing is refused, the release's
/// publication too (a `pcall`), and waiters fall back to the back-off; the
/// three clicks over two instances still all run, in turn, within the
/// bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_channel_permissions_waiters_fall_back_to_the_back_off() {
    let server = RedisServer::start();
    let url = channelless_user(&server);
    let runs = Arc::new(Runs::default());
    let a = lock_layer(RedisBackend::connect(&url).await.unwrap(), 2000);
    let b = lock_layer(RedisBackend::connect(&url).await.unwrap(), 2000);
    let addr_a = instance(a.clone(), runs.clone(), 0, Duration::from_millis(200)).await;
    let addr_b = instance(b.clone(), runs.clone(), 1, Duration::from_millis(200)).await;
    let counts = || {
        let (a, b) = (a.stats(), b.stats());
        (a.acquired + b.acquired, a.waited + b.waited)
    };
    let sent = clicks(&[addr_a, addr_b], 3, counts).await;
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
    assert_eq!(runs.executions.load(Ordering::SeqCst), 3);
    assert_eq!(runs.max_concurrent.load(Ordering::SeqCst), 1);
    assert_no_overlap(&runs);
    assert!(server.cli(&["PUBSUB", "SHARDCHANNELS"]).trim().is_empty());
}

/// Two watches of one key taken before its subscription was answered:
/// when the server refuses the subscription, neither reads as live (the
/// second did, with nothing subscribed behind it: its waiter slept until
/// the holder's expiry instead of looking for the lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_subscription_leaves_no_watch_live() {
    use tower_redis_lock::backend::LockBackend;
    let server = RedisServer::start();
    let backend = RedisBackend::connect(&channelless_user(&server))
        .await
        .unwrap();
    let key = bytes::Bytes::from_static(b"refused-watch");
    let first = backend.watch(&key).expect("a Redis backend watches");
    let second = backend.watch(&key).expect("a Redis backend watches");
    assert!(first.await.is_err(), "the subscription is refused");
    if let Ok(watch) = second.await {
        assert!(
            !watch.is_live(),
            "a watch with no subscription behind it reads as live"
        );
    }
}

/// A waiter's look that the local in-flight table answers with another
/// request's acquire, sent before anyone here watched the key (so without
/// the mark that makes a release publish), still leaves the mark: the
/// holder's release wakes the waiter (before, nothing was published and
/// the waiter slept until the holder's expiry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_answered_by_an_unmarked_acquire_still_marks_the_key() {
    use tower_redis_lock::backend::contract::{Acquire, Token};
    use tower_redis_lock::backend::LockBackend;
    let server = RedisServer::start();
    let holder = RedisBackend::connect(&server.url()).await.unwrap();
    let here = RedisBackend::connect(&server.url()).await.unwrap();
    let key = bytes::Bytes::from_static(b"unmarked-leader");
    let ttl = Duration::from_secs(10);
    let held = Token::generate();
    let taken = holder.acquire(&key, &held, ttl).await.unwrap();
    assert!(matches!(taken, Acquire::Acquired { .. }), "{taken:?}");

    // Writes wait: the first acquire here stays in flight, unmarked, while
    // a waiter starts watching and looks.
    assert_eq!(server.cli(&["CLIENT", "PAUSE", "500", "WRITE"]), "OK");
    // Asked now (a backend call is sent when made, not when first polled),
    // and answered on a task of its own.
    let leader = tokio::spawn(here.acquire(&key, &Token::generate(), ttl));
    // The key is watched from here on (the subscription is answered
    // later), and the look is asked while the first acquire is in flight.
    let watching = here.watch(&key).expect("Redis watches");
    let look = here.acquire(&key, &Token::generate(), ttl).await.unwrap();
    let watch = watching.await.unwrap();
    let seen = watch.count();
    assert!(matches!(look, Acquire::Held { .. }), "{look:?}");
    assert!(matches!(leader.await.unwrap(), Ok(Acquire::Held { .. })));

    assert!(holder.release_notify(&key, &held).await.unwrap());
    let woken = tokio::time::timeout(Duration::from_secs(2), watch.changed_from(seen)).await;
    assert!(
        matches!(woken, Ok(true)),
        "the release woke no waiter: {woken:?}"
    );
}
