//! Load harness: the layer against bare axum and a hand-written peer, in one
//! run, on loopback.
//!
//! ```text
//! cargo bench --bench load
//! ```
//!
//! Starts its own `redis-server` on a free port (never 127.0.0.1:6379) and,
//! on this process's Tokio runtime, one HTTP server per target:
//!
//! - `bare axum`: the handler alone;
//! - `peer redis-rs`: a hand-written axum `from_fn` middleware over redis-rs'
//!   `ConnectionManager` (`SET key token NX PX`, then a Lua compare-and-delete
//!   through `EVALSHA`): what people write by hand;
//! - `layer memory`: `RedisLockLayer` over `MemoryBackend`;
//! - `layer redis`: `RedisLockLayer` over `RedisBackend` (one fred client,
//!   defaults: local in-flight table, batched script calls);
//! - variants of it, throughput only: without batching
//!   (`auto_pipeline(false)`), over a pool of 4 connections, and with the
//!   opt-in `fire_and_forget()`;
//! - with `LOAD_SCALE=1`, also throughput only: the layer on a 3-master Redis
//!   Cluster (+3 replicas, `test-support/src/scale.rs`) and on `RedlockBackend`
//!   over 3 servers.
//!
//! Each is driven by the same in-process hyper client: `LOAD_CONNS`
//! keep-alive connections (default 50), a unique key per request, for
//! `LOAD_SECS` seconds (default 3) after a short warm-up, `LOAD_ROUNDS`
//! times (default 3) interleaved across targets; the median round is reported.
//! Then, per locked target, the 409 path (a key held by another instance,
//! over 1 and over 20 connections) and a duplicate storm (`STORM_CONNS`
//! concurrent identical requests against a handler that takes 100 ms,
//! `STORM_ROUNDS` times). Redis commands come from `INFO commandstats`
//! deltas; CPU per request from `/proc/self/stat` (this process: servers and
//! load generator) and `INFO cpu` (redis-server). `LOAD_ONLY=<target name>`
//! drives one target and stops (for `perf record`).
//!
//! The load generator shares the machine's cores with the servers and Redis:
//! figures are ratios measured in the same run, not absolute capacity. With
//! the defaults a run takes about 80 s on 2 cores.

#[path = "peer/mod.rs"]
mod peer;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::middleware::from_fn_with_state;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use peer::{env_or, loadavg, peer_lock, serve, Peer, TTL};
use tower_redis_lock::backend::RedlockBackend;
use tower_redis_lock::key::{RequestMethod, UriPath};
use tower_redis_lock::lock::Locker;
use tower_redis_lock::{MemoryBackend, RedisBackend, RedisLockLayer};
use tower_redis_lock_test_support::{scale, RedisServer};

const STORM_HANDLER: Duration = Duration::from_millis(100);

// ---------------------------------------------------------------- servers

/// Counts handler runs on the storm route.
#[derive(Clone, Default)]
struct Runs(Arc<AtomicU64>);

fn app(runs: Runs) -> Router {
    Router::new()
        .route("/pay/{id}", post(|| async { "ok" }))
        .route(
            "/slow/{id}",
            post(|State(runs): State<Runs>| async move {
                runs.0.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(STORM_HANDLER).await;
                "ok"
            }),
        )
        .with_state(runs)
}

struct Target {
    name: &'static str,
    addr: SocketAddr,
    runs: Runs,
    /// Which `INFO commandstats` entries the client itself sends (the rest
    /// are calls made from inside Lua scripts).
    client_cmds: &'static [&'static str],
    /// Makes the key of `POST /pay/held` held by someone else.
    hold: Option<Hold>,
    /// A variant shown for comparison: throughput only.
    variant: bool,
}

enum Hold {
    /// Another instance (own backend, own connection) holds it through the layer.
    Layer(Locker),
    /// `SET` it directly (the peer's key scheme).
    Set(String),
}

// ---------------------------------------------------------------- client

struct Conn {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Self {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let io = hyper_util::rt::TokioIo::new(stream);
        let (sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .expect("handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Self { sender }
    }

    async fn post(&mut self, path: &str) -> u16 {
        let req = http::Request::post(path)
            .header("host", "bench")
            .body(Full::new(Bytes::new()))
            .expect("request");
        self.sender.ready().await.expect("connection ready");
        let res = self.sender.send_request(req).await.expect("response");
        let status = res.status().as_u16();
        let _ = res.into_body().collect().await.expect("body");
        status
    }
}

#[derive(Default)]
struct Run {
    secs: f64,
    latencies_us: Vec<u32>,
    statuses: BTreeMap<u16, u64>,
}

impl Run {
    fn rps(&self) -> f64 {
        self.latencies_us.len() as f64 / self.secs
    }
    fn pct(&self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let i = ((self.latencies_us.len() as f64 - 1.0) * p).round() as usize;
        self.latencies_us[i] as f64 / 1000.0
    }
}

/// `conns` connections, each sending `POST /pay/{tag}-{conn}-{n}` back to back
/// for `secs`.
async fn drive(addr: SocketAddr, conns: usize, secs: f64, tag: &str) -> Run {
    let mut clients = Vec::with_capacity(conns);
    for _ in 0..conns {
        clients.push(Conn::open(addr).await);
    }
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(secs);
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(c, mut conn)| {
            let tag = tag.to_owned();
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(64 * 1024);
                let mut statuses = BTreeMap::new();
                let mut n = 0u64;
                let mut path = String::with_capacity(64);
                while Instant::now() < until {
                    use std::fmt::Write;
                    path.clear();
                    let _ = write!(path, "/pay/{tag}-{c}-{n}");
                    n += 1;
                    let t = Instant::now();
                    let status = conn.post(&path).await;
                    lat.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32);
                    *statuses.entry(status).or_insert(0u64) += 1;
                }
                (lat, statuses)
            })
        })
        .collect();
    let mut run = Run::default();
    for t in tasks {
        let (lat, statuses) = t.await.expect("client task");
        run.latencies_us.extend(lat);
        for (s, n) in statuses {
            *run.statuses.entry(s).or_insert(0) += n;
        }
    }
    run.secs = start.elapsed().as_secs_f64();
    run.latencies_us.sort_unstable();
    run
}

/// `count` requests to one path over `conns` connections.
async fn hammer(addr: SocketAddr, conns: usize, count: usize, path: &str) -> BTreeMap<u16, u64> {
    let per = count / conns;
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let mut conn = Conn::open(addr).await;
        let path = path.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut statuses = BTreeMap::new();
            for _ in 0..per {
                *statuses.entry(conn.post(&path).await).or_insert(0u64) += 1;
            }
            statuses
        }));
    }
    let mut out = BTreeMap::new();
    for t in tasks {
        for (s, n) in t.await.expect("client task") {
            *out.entry(s).or_insert(0) += n;
        }
    }
    out
}

struct Storm {
    rounds: usize,
    conns: usize,
    handler_runs: u64,
    statuses: BTreeMap<u16, u64>,
    client_cmds: u64,
    max_ms: f64,
}

/// `conns` connections fire one identical request each at the same moment,
/// `rounds` times (a fresh key per round).
async fn storm(target: &Target, redis: &RedisServer, conns: usize, rounds: usize) -> Storm {
    let mut clients = Vec::with_capacity(conns);
    for _ in 0..conns {
        clients.push(Conn::open(target.addr).await);
    }
    let before_runs = target.runs.0.load(Ordering::Relaxed);
    let before = commandstats(redis);
    let mut statuses = BTreeMap::new();
    let mut max_ms = 0f64;
    for r in 0..rounds {
        let barrier = Arc::new(tokio::sync::Barrier::new(conns));
        let path = format!("/slow/storm-{}-{r}", target.name.replace(' ', "_"));
        let tasks: Vec<_> = clients
            .drain(..)
            .map(|mut conn| {
                let barrier = barrier.clone();
                let path = path.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    let t = Instant::now();
                    let status = conn.post(&path).await;
                    (conn, status, t.elapsed())
                })
            })
            .collect();
        for t in tasks {
            let (conn, status, took) = t.await.expect("storm task");
            clients.push(conn);
            *statuses.entry(status).or_insert(0u64) += 1;
            max_ms = max_ms.max(took.as_secs_f64() * 1000.0);
        }
    }
    let after = commandstats(redis);
    Storm {
        rounds,
        conns,
        handler_runs: target.runs.0.load(Ordering::Relaxed) - before_runs,
        statuses,
        client_cmds: client_calls(&before, &after, target.client_cmds),
        max_ms,
    }
}

// ---------------------------------------------------------------- cpu

/// CPU seconds used by this process (servers + client) so far.
fn self_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 (1-based), i.e. 11 and 12 here.
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds used by redis-server so far.
fn redis_cpu(redis: &RedisServer) -> f64 {
    redis
        .cli(&["INFO", "cpu"])
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            matches!(k, "used_cpu_sys" | "used_cpu_user").then(|| v.trim().parse::<f64>().ok())?
        })
        .sum()
}

// ---------------------------------------------------------------- redis stats

fn commandstats(redis: &RedisServer) -> BTreeMap<String, u64> {
    let text = redis.cli(&["INFO", "commandstats"]);
    let mut out = BTreeMap::new();
    for line in text.lines() {
        // cmdstat_set:calls=3,usec=...
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, fields)) = rest.split_once(':') else {
            continue;
        };
        let calls = fields
            .split(',')
            .find_map(|f| f.strip_prefix("calls="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        out.insert(name.to_owned(), calls);
    }
    out
}

fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "info" | "ping"))
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

fn client_calls(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    cmds: &[&str],
) -> u64 {
    let d = delta(before, after);
    cmds.iter().map(|c| d.get(*c).copied().unwrap_or(0)).sum()
}

fn per_req(d: &BTreeMap<String, u64>, n: u64) -> String {
    if d.is_empty() {
        return "-".into();
    }
    d.iter()
        .map(|(k, v)| format!("{k} {:.2}", *v as f64 / n.max(1) as f64))
        .collect::<Vec<_>>()
        .join(", ")
}

// ---------------------------------------------------------------- main

struct Row {
    name: &'static str,
    runs: Vec<Run>,
    cmds: BTreeMap<String, u64>,
    client_cmds: u64,
    requests: u64,
    cpu_self: f64,
    cpu_redis: f64,
}

impl Row {
    /// The median round by throughput.
    fn median(&self) -> &Run {
        let mut idx: Vec<usize> = (0..self.runs.len()).collect();
        idx.sort_by(|a, b| self.runs[*a].rps().total_cmp(&self.runs[*b].rps()));
        &self.runs[idx[idx.len() / 2]]
    }
}

/// CPU µs per request: (this process: servers + client, redis-server).
fn cpu_per_req(row: &Row) -> (f64, f64) {
    let reqs = row.requests.max(1) as f64;
    (row.cpu_self * 1e6 / reqs, row.cpu_redis * 1e6 / reqs)
}

fn main() {
    // Under `cargo test --benches` (or criterion-style flags), do nothing.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let conns: usize = env_or("LOAD_CONNS", 50);
    let secs: f64 = env_or("LOAD_SECS", 3.0);
    let rounds: usize = env_or("LOAD_ROUNDS", 3).max(1);
    let storm_conns: usize = env_or("STORM_CONNS", 64);
    let storm_rounds: usize = env_or("STORM_ROUNDS", 10);
    let workers: usize = env_or("LOAD_WORKERS", 2);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run(conns, secs, rounds, storm_conns, storm_rounds, workers));
}

async fn run(
    conns: usize,
    secs: f64,
    rounds: usize,
    storm_conns: usize,
    storm_rounds: usize,
    workers: usize,
) {
    let started = Instant::now();
    let redis = RedisServer::start();
    let url = redis.url();
    println!(
        "load: {conns} connections, {secs} s x {rounds} rounds per target, \
         {workers} Tokio workers shared by servers and client; redis-server on port {}; \
         load average at start {}",
        redis.port(),
        loadavg()
    );

    // bare axum
    let bare_runs = Runs::default();
    let bare = Target {
        name: "bare axum",
        addr: serve(app(bare_runs.clone())).await,
        runs: bare_runs,
        client_cmds: &[],
        hold: None,
        variant: false,
    };

    // the peer
    let peer_runs = Runs::default();
    let client = redis_rs::Client::open(url.as_str()).expect("redis-rs client");
    let con = client
        .get_connection_manager()
        .await
        .expect("redis-rs connection manager");
    let peer_state = Peer::new(con);
    let peer = Target {
        name: "peer redis-rs",
        addr: serve(app(peer_runs.clone()).layer(from_fn_with_state(peer_state, peer_lock))).await,
        runs: peer_runs,
        client_cmds: &["set", "evalsha", "eval"],
        hold: Some(Hold::Set("peer:POST:/pay/held".into())),
        variant: false,
    };

    // the layer in memory
    let mem_runs = Runs::default();
    let mem_layer = RedisLockLayer::new(MemoryBackend::new(), (RequestMethod, UriPath)).ttl(TTL);
    let mem = Target {
        name: "layer memory",
        addr: serve(app(mem_runs.clone()).layer(mem_layer.clone())).await,
        runs: mem_runs,
        client_cmds: &[],
        hold: Some(Hold::Layer(mem_layer.locker())),
        variant: false,
    };

    // the layer on Redis; the 409 holder is another instance (own client)
    let layer_runs = Runs::default();
    let backend = RedisBackend::connect(&url).await.expect("fred backend");
    let other = RedisBackend::connect(&url).await.expect("fred backend");
    let ours = Target {
        name: "layer redis",
        addr: serve(
            app(layer_runs.clone())
                .layer(RedisLockLayer::new(backend, (RequestMethod, UriPath)).ttl(TTL)),
        )
        .await,
        runs: layer_runs,
        client_cmds: &["evalsha", "eval"],
        hold: Some(Hold::Layer(
            RedisLockLayer::new(other, (RequestMethod, UriPath))
                .ttl(TTL)
                .locker(),
        )),
        variant: false,
    };

    // Variants: what batching buys, and the opt-in release that does not wait.
    let unbatched_runs = Runs::default();
    let unbatched = RedisBackend::connect(&url)
        .await
        .expect("fred backend")
        .auto_pipeline(false);
    let unbatched = Target {
        name: "layer redis, auto_pipeline(false)",
        addr: serve(
            app(unbatched_runs.clone())
                .layer(RedisLockLayer::new(unbatched, (RequestMethod, UriPath)).ttl(TTL)),
        )
        .await,
        runs: unbatched_runs,
        client_cmds: &["evalsha", "eval"],
        hold: None,
        variant: true,
    };
    let faf_runs = Runs::default();
    let faf = RedisBackend::connect(&url).await.expect("fred backend");
    let faf = Target {
        name: "layer redis, fire_and_forget()",
        addr: serve(
            app(faf_runs.clone()).layer(
                RedisLockLayer::new(faf, (RequestMethod, UriPath))
                    .ttl(TTL)
                    .fire_and_forget(),
            ),
        )
        .await,
        runs: faf_runs,
        client_cmds: &["evalsha", "eval"],
        hold: None,
        variant: true,
    };

    let pool_runs = Runs::default();
    let pool = RedisBackend::connect_pool(&url, 4)
        .await
        .expect("fred pool");
    let pool = Target {
        name: "layer redis, connect_pool(4)",
        addr: serve(
            app(pool_runs.clone())
                .layer(RedisLockLayer::new(pool, (RequestMethod, UriPath)).ttl(TTL)),
        )
        .await,
        runs: pool_runs,
        client_cmds: &["evalsha", "eval"],
        hold: None,
        variant: true,
    };

    let mut targets = vec![bare, peer, mem, ours, unbatched, pool, faf];
    // Scale-out variants (opt-in, `LOAD_SCALE=1`): the layer on a 3-master
    // Redis Cluster (+3 replicas) and on Redlock over 3 servers. Throughput
    // only; the Redis CPU and command columns count the single server above,
    // not these.
    let mut _scale_nodes: Vec<RedisServer> = Vec::new();
    if std::env::var("LOAD_SCALE").is_ok_and(|v| v == "1") {
        let cluster = scale::Cluster::get();
        let runs = Runs::default();
        let backend = RedisBackend::connect(&cluster.url())
            .await
            .expect("cluster backend");
        targets.push(Target {
            name: "layer redis-cluster (3 masters)",
            addr: serve(
                app(runs.clone())
                    .layer(RedisLockLayer::new(backend, (RequestMethod, UriPath)).ttl(TTL)),
            )
            .await,
            runs,
            client_cmds: &[],
            hold: None,
            variant: true,
        });
        _scale_nodes = (0..3).map(|_| RedisServer::start()).collect();
        let urls: Vec<String> = _scale_nodes.iter().map(|s| s.url()).collect();
        let backend = RedlockBackend::connect(&urls)
            .await
            .expect("redlock backend");
        let runs = Runs::default();
        targets.push(Target {
            name: "layer redlock (3 servers)",
            addr: serve(
                app(runs.clone())
                    .layer(RedisLockLayer::new(backend, (RequestMethod, UriPath)).ttl(TTL)),
            )
            .await,
            runs,
            client_cmds: &[],
            hold: None,
            variant: true,
        });
    }
    let mut rows: Vec<Row> = targets
        .iter()
        .map(|t| Row {
            name: t.name,
            runs: Vec::new(),
            cmds: BTreeMap::new(),
            client_cmds: 0,
            requests: 0,
            cpu_self: 0.0,
            cpu_redis: 0.0,
        })
        .collect();

    // Throughput: interleave rounds so drift in machine load hits all alike.
    // `LOAD_ONLY=<target name>` drives only that target (for profiling) and stops.
    let only = std::env::var("LOAD_ONLY").ok();
    for round in 0..rounds {
        for (t, row) in targets.iter().zip(rows.iter_mut()) {
            if only.as_deref().is_some_and(|o| t.name != o) {
                continue;
            }
            let tag = format!("w{round}");
            let _ = drive(t.addr, conns, 0.5, &tag).await; // warm-up
            let before = commandstats(&redis);
            let (cpu0, rcpu0) = (self_cpu(), redis_cpu(&redis));
            let run = drive(t.addr, conns, secs, &format!("r{round}")).await;
            let (cpu1, rcpu1) = (self_cpu(), redis_cpu(&redis));
            let after = commandstats(&redis);
            row.cpu_self += cpu1 - cpu0;
            row.cpu_redis += rcpu1 - rcpu0;
            for (k, v) in delta(&before, &after) {
                *row.cmds.entry(k).or_insert(0) += v;
            }
            row.client_cmds += client_calls(&before, &after, t.client_cmds);
            row.requests += run.latencies_us.len() as u64;
            let bad: u64 = run
                .statuses
                .iter()
                .filter(|(s, _)| **s != 200)
                .map(|(_, n)| n)
                .sum();
            assert_eq!(
                bad, 0,
                "{}: non-200 answers under unique keys: {:?}",
                t.name, run.statuses
            );
            eprintln!(
                "  round {round} {:<40} {:>9.0} req/s  p99 {:.2} ms",
                t.name,
                run.rps(),
                run.pct(0.99)
            );
            row.runs.push(run);
        }
    }

    if let Some(only) = only {
        for row in rows.iter().filter(|r| r.name == only) {
            let m = row.median();
            println!(
                "{}: {:.0} req/s, p99 {:.2} ms, CPU µs/req {:.1} (process) {:.1} (redis)",
                row.name,
                m.rps(),
                m.pct(0.99),
                row.cpu_self * 1e6 / row.requests.max(1) as f64,
                row.cpu_redis * 1e6 / row.requests.max(1) as f64
            );
        }
        return;
    }
    let bare_rps = rows[0].median().rps();
    let bare_p99 = rows[0].median().pct(0.99);
    let peer_rps = rows[1].median().rps();
    let peer_p99 = rows[1].median().pct(0.99);
    let (bare_cpu, peer_cpu) = (cpu_per_req(&rows[0]), cpu_per_req(&rows[1]));
    println!();
    println!("### Throughput: unique key per request, {conns} connections, median of {rounds} x {secs} s");
    println!();
    println!("| target | req/s | p50 ms | p99 ms | p99.9 ms | req/s vs bare | req/s vs peer | p99 vs peer | CPU µs/req (process + redis) | CPU capacity vs bare | CPU capacity vs peer | EVALSHA/EVAL/SET sent per req | Redis calls/req (incl. inside Lua) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for row in &rows {
        let m = row.median();
        let trips = if row.client_cmds == 0 && row.cmds.is_empty() {
            "0".to_owned()
        } else {
            format!("{:.2}", row.client_cmds as f64 / row.requests.max(1) as f64)
        };
        let cpu = cpu_per_req(row);
        println!(
            "| {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2}x | {:.2}x | {:.2}x | {:.1} + {:.1} | {:.2}x | {:.2}x | {} | {} |",
            row.name,
            m.rps(),
            m.pct(0.50),
            m.pct(0.99),
            m.pct(0.999),
            m.rps() / bare_rps,
            m.rps() / peer_rps,
            m.pct(0.99) / peer_p99,
            cpu.0,
            cpu.1,
            (bare_cpu.0 + bare_cpu.1) / (cpu.0 + cpu.1),
            (peer_cpu.0 + peer_cpu.1) / (cpu.0 + cpu.1),
            trips,
            per_req(&row.cmds, row.requests),
        );
    }
    let _ = bare_p99;

    // The 409 path: the key is held by someone else.
    println!();
    println!("### 409 path: `POST /pay/held` while another instance holds the key");
    println!();
    println!(
        "| target | connections | requests | statuses | Redis round trips/req | Redis calls/req |"
    );
    println!("|---|---:|---:|---|---:|---|");
    let conflict_n = 4_000usize;
    let _guards: Vec<_> = {
        let mut guards = Vec::new();
        for t in &targets {
            match &t.hold {
                None => {}
                Some(Hold::Set(key)) => {
                    redis.cli(&["SET", key, "someone-else", "PX", "60000"]);
                }
                Some(Hold::Layer(locker)) => {
                    let req = http::Request::post("/pay/held").body(()).expect("req");
                    let (parts, ()) = req.into_parts();
                    let key = locker.key_for(&parts).expect("key");
                    guards.push(locker.lock(key).await.expect("hold the key"));
                }
            }
        }
        guards
    };
    for t in targets.iter().filter(|t| t.hold.is_some()) {
        // One connection: every request asks on its own. Twenty: requests for
        // the same key that overlap share the in-flight acquire.
        for (c, n) in [(1usize, 2_000usize), (20, conflict_n)] {
            let before = commandstats(&redis);
            let statuses = hammer(t.addr, c, n, "/pay/held").await;
            let after = commandstats(&redis);
            let n: u64 = statuses.values().sum();
            let d = delta(&before, &after);
            println!(
                "| {} | {} | {} | {:?} | {:.2} | {} |",
                t.name,
                c,
                n,
                statuses,
                client_calls(&before, &after, t.client_cmds) as f64 / n as f64,
                per_req(&d, n)
            );
        }
    }

    // Duplicate storms.
    println!();
    println!(
        "### Duplicate storm: {storm_conns} identical concurrent requests, handler takes {} ms, {storm_rounds} rounds",
        STORM_HANDLER.as_millis()
    );
    println!();
    println!("| target | handler runs/round | statuses (all rounds) | Redis round trips/storm | slowest answer ms |");
    println!("|---|---:|---|---:|---:|");
    for t in targets.iter().filter(|t| !t.variant) {
        let s = storm(t, &redis, storm_conns, storm_rounds).await;
        println!(
            "| {} | {:.2} | {:?} | {:.2} | {:.1} |",
            t.name,
            s.handler_runs as f64 / s.rounds as f64,
            s.statuses,
            s.client_cmds as f64 / s.rounds as f64,
            s.max_ms,
        );
        let _ = s.conns;
    }

    println!();
    println!(
        "run took {:.0} s; load average at end {}; machine: {} cores ({}), load generator in the same process",
        started.elapsed().as_secs_f64(),
        loadavg(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model(),
    );
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}
