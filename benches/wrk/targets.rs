//! The targets: what each serves, and each in a process of its own over a
//! fresh server of its own. The quickstart is its own binary
//! (`examples/quickstart.rs`, built here in the bench profile); the others
//! are this bench's binary started again with `--serve <target> <url>`,
//! serving the quickstart's handler as the quickstart serves it.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::middleware::{from_fn, from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tower_redis_lock::key::{Header, RequestMethod, Route};
use tower_redis_lock::{IdempotencyLayer, MemoryBackend, RedisBackend, RedisLockLayer};
use tower_redis_lock_test_support::RedisServer;

use crate::peer::{peer_lock, Peer};
use crate::peer_fred::{fred_peer_lock, FredPeer};
use crate::server::Kind;

/// A target of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Id {
    /// The quickstart's handler alone.
    Bare,
    /// The hand-written peer middleware (redis-rs) on the same handler.
    Peer,
    /// The same peer middleware written over fred.
    PeerFred,
    /// The quickstart binary as it is, over `REDIS_URL`.
    Quickstart,
    /// `IdempotencyLayer` over `RedisBackend::connect`, on the same handler.
    Idempotency,
    /// The quickstart's lock layer over `MemoryBackend` (`WRK_TARGETS` only).
    Memory,
    /// The quickstart's lock layer over `connect_pool(url, 4)` (`WRK_TARGETS` only).
    Pool,
}

impl Id {
    pub const ALL: [Id; 7] = [
        Id::Bare,
        Id::Peer,
        Id::PeerFred,
        Id::Quickstart,
        Id::Idempotency,
        Id::Memory,
        Id::Pool,
    ];

    /// Its name in `WRK_TARGETS` and `--serve`.
    pub fn key(self) -> &'static str {
        match self {
            Id::Bare => "bare",
            Id::Peer => "peer",
            Id::PeerFred => "peer-fred",
            Id::Quickstart => "quickstart",
            Id::Idempotency => "idempotency",
            Id::Memory => "memory",
            Id::Pool => "pool",
        }
    }

    /// Its name in the tables.
    pub fn name(self) -> &'static str {
        match self {
            Id::Bare => "bare axum",
            Id::Peer => "peer redis-rs",
            Id::PeerFred => "peer fred",
            Id::Quickstart => "quickstart",
            Id::Idempotency => "idempotency redis",
            Id::Memory => "layer memory",
            Id::Pool => "layer redis pool(4)",
        }
    }

    fn needs_server(self) -> bool {
        !matches!(self, Id::Bare | Id::Memory)
    }

    pub fn from_key(key: &str) -> Id {
        Id::ALL
            .into_iter()
            .find(|id| id.key() == key.trim())
            .unwrap_or_else(|| {
                let all: Vec<_> = Id::ALL.iter().map(|id| id.key()).collect();
                panic!("unknown target {key:?}: one of {all:?}")
            })
    }

    /// `WRK_TARGETS` (comma-separated keys), default
    /// `bare,peer,peer-fred,quickstart,idempotency,memory`.
    pub fn from_env() -> Vec<Id> {
        std::env::var("WRK_TARGETS")
            .unwrap_or_else(|_| "bare,peer,peer-fred,quickstart,idempotency,memory".into())
            .split(',')
            .filter(|k| !k.trim().is_empty())
            .map(Id::from_key)
            .collect()
    }
}

// ------------------------------------------------ the quickstart's handler

/// `examples/quickstart.rs`'s state, as is.
#[derive(Clone, Default)]
struct Stats {
    executions: Arc<AtomicU64>,
    running: Arc<AtomicU64>,
    max_concurrent: Arc<AtomicU64>,
}

#[derive(serde::Deserialize)]
struct PayParams {
    delay_ms: Option<u64>,
}

/// `examples/quickstart.rs`'s `pay`, as is: count, sleep `delay_ms`
/// unless it is 0 (the load asks 0), answer JSON.
async fn pay(State(stats): State<Stats>, Query(p): Query<PayParams>) -> Json<serde_json::Value> {
    let n = stats.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let running = stats.running.fetch_add(1, Ordering::SeqCst) + 1;
    stats.max_concurrent.fetch_max(running, Ordering::SeqCst);
    let delay = p.delay_ms.unwrap_or(200).min(60_000);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    stats.running.fetch_sub(1, Ordering::SeqCst);
    Json(serde_json::json!({"status": "paid", "execution": n}))
}

/// `examples/quickstart.rs`'s `stats`, as is.
async fn stats(State(stats): State<Stats>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "executions": stats.executions.load(Ordering::SeqCst),
        "max_concurrent": stats.max_concurrent.load(Ordering::SeqCst),
    }))
}

/// The quickstart's lock layer settings on `backend`.
fn quickstart_lock(backend: impl tower_redis_lock::backend::LockBackend) -> RedisLockLayer {
    RedisLockLayer::new(
        backend,
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
    .digest_body()
    .body_limit(64 * 1024)
    .ttl(Duration::from_secs(70))
}

/// `WRK_BASELINES_READ_BODY=1`: the baselines (bare, peer, peer-fred)
/// read each request's body whole and hash it, as the quickstart's layer
/// does before its acquire (`digest_body`, `body_limit(64 KiB)`), so the
/// comparison holds the body's cost on both sides.
pub fn baselines_read_body() -> bool {
    std::env::var("WRK_BASELINES_READ_BODY").is_ok_and(|v| v.trim() == "1")
}

/// The baselines' body reader (see [`baselines_read_body`]): the body read
/// whole within 64 KiB and hashed with BLAKE3, then handed on unchanged.
async fn read_and_digest_body(req: axum::extract::Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 64 * 1024).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    std::hint::black_box(blake3::hash(&bytes));
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

/// The router of a target served by this binary, over the server at `url`:
/// the quickstart's routes, its middleware on `/pay` only.
async fn router_of(id: Id, url: &str) -> Router {
    let pay = post(pay);
    let reads_body = baselines_read_body() && matches!(id, Id::Bare | Id::Peer | Id::PeerFred);
    let pay = match id {
        Id::Bare => pay,
        Id::Peer => {
            let client = redis_rs::Client::open(url).expect("redis-rs client");
            let con = client
                .get_connection_manager()
                .await
                .expect("redis-rs connection manager");
            pay.layer(from_fn_with_state(Peer::new(con), peer_lock))
        }
        Id::PeerFred => pay.layer(from_fn_with_state(
            FredPeer::connect(url).await,
            fred_peer_lock,
        )),
        Id::Memory => pay.layer(quickstart_lock(MemoryBackend::new())),
        Id::Pool => {
            let pool = RedisBackend::connect_pool(url, 4).await.expect("fred pool");
            pay.layer(quickstart_lock(pool))
        }
        // Every request a first one: its own `Idempotency-Key` and its own
        // scope (the user), so no scope reaches its quota. The settings of
        // `examples/payments.rs`.
        Id::Idempotency => {
            let backend = RedisBackend::connect(url).await.expect("fred backend");
            pay.layer(
                IdempotencyLayer::new(
                    backend,
                    (RequestMethod, Route, Header::trusted_identity("x-user-id")),
                )
                .ttl(Duration::from_secs(70))
                .join_timeout(Duration::from_secs(5)),
            )
        }
        Id::Quickstart => panic!("the quickstart is served by its own binary"),
    };
    // Outermost: the body is read before the peer's lock, as the layer
    // reads it before its acquire.
    let pay = if reads_body {
        pay.layer(from_fn(read_and_digest_body))
    } else {
        pay
    };
    Router::new()
        .route("/pay", pay)
        .route("/stats", get(stats))
        .with_state(Stats::default())
}

/// `--serve <target> [<url>]`: serves one target, over the server at the URL
/// or a redis-server of its own, as the quickstart serves (`axum::serve`,
/// no socket options); prints `<target> listening on http://<addr> ...`,
/// then for each line on stdin the allocations so far (`ALLOCS <n>`), until
/// stdin closes. For the bench's runs and for a profiler (`perf record -p`).
pub fn serve_main(args: &[String]) {
    let id = Id::from_key(args.first().map_or("peer", String::as_str));
    let workers: usize = crate::peer::env_or("WRK_WORKERS", 2);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime");
    let own = match args.get(1) {
        Some(_) => None,
        None => Some(RedisServer::start()),
    };
    let url = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| own.as_ref().map(RedisServer::url).unwrap_or_default());
    let addr = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let router = router_of(id, &url).await;
        tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
        addr
    });
    println!(
        "{} listening on http://{addr} (redis-server pid {})",
        id.name(),
        own.as_ref().and_then(RedisServer::pid).unwrap_or(0)
    );
    for line in std::io::stdin().lock().lines() {
        if line.is_err() {
            break;
        }
        println!("ALLOCS {}", crate::alloc::allocations());
    }
    drop(rt);
}

/// Builds the quickstart in the bench profile (`cargo build --profile bench
/// --example quickstart`, next to this binary) unless `WRK_QUICKSTART`
/// names a binary; its path.
pub fn quickstart_binary(target_dir: &Path) -> PathBuf {
    if let Ok(path) = std::env::var("WRK_QUICKSTART") {
        return PathBuf::from(path);
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    eprintln!("building the quickstart: cargo build --profile bench --example quickstart");
    let status = Command::new(option_env!("CARGO").unwrap_or("cargo"))
        .args(["build", "--profile", "bench", "--example", "quickstart"])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir)
        .status()
        .expect("run cargo build");
    assert!(status.success(), "cargo build --example quickstart failed");
    target_dir.join("release/examples/quickstart")
}

/// A target running in a process of its own over a server of its own; both
/// killed on drop.
pub struct Running {
    pub id: Id,
    pub addr: SocketAddr,
    pub pid: u32,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// `None` for the targets that use no Redis.
    pub server: Option<RedisServer>,
}

impl Running {
    /// Starts a fresh server of `kind` (if the target uses one) and the
    /// target over it, with `workers` Tokio workers.
    pub fn start(id: Id, kind: Kind, quickstart: Option<&Path>, workers: usize) -> Running {
        let server = id.needs_server().then(|| kind.start());
        let url = server.as_ref().map(RedisServer::url).unwrap_or_default();
        let mut cmd = match id {
            Id::Quickstart => {
                let mut cmd = Command::new(quickstart.expect("the quickstart binary"));
                cmd.env("REDIS_URL", &url)
                    .env("ADDR", "127.0.0.1:0")
                    .env_remove("REDLOCK_URLS")
                    .env_remove("LOCK_WAIT_MS")
                    .env_remove("RUST_LOG");
                cmd
            }
            _ => {
                let mut cmd = Command::new(std::env::current_exe().expect("own path"));
                cmd.args(["--serve", id.key(), &url]);
                cmd
            }
        };
        // `#[tokio::main]` reads TOKIO_WORKER_THREADS; `--serve` WRK_WORKERS.
        let mut child = cmd
            .env("TOKIO_WORKER_THREADS", workers.to_string())
            .env("WRK_WORKERS", workers.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start the {} process: {e}", id.name()));
        let stdin = child.stdin.take().expect("its stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("its stdout"));
        let mut line = String::new();
        let _ = stdout.read_line(&mut line);
        let addr = line
            .split_once("http://")
            .and_then(|(_, rest)| rest.split([' ', '/', '\n']).next())
            .and_then(|addr| addr.parse().ok())
            .unwrap_or_else(|| panic!("no address from the {} process: {line:?}", id.name()));
        let pid = child.id();
        Running {
            id,
            addr,
            pid,
            child,
            stdin,
            stdout,
            server,
        }
    }

    /// The process's allocations so far; `None` for the quickstart binary
    /// (no counting allocator).
    pub fn allocations(&mut self) -> Option<u64> {
        if self.id == Id::Quickstart {
            return None;
        }
        writeln!(self.stdin).ok()?;
        self.stdin.flush().ok()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line).ok()?;
        line.trim().strip_prefix("ALLOCS ")?.parse().ok()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Then `server` drops: its redis-server is killed too.
    }
}
