//! Shared test helpers: the `redis-server` harness, the wait helper and the
//! Cluster/Sentinel fixtures (re-exported from the `test-support` crate, which
//! the unit tests use too), loopback HTTP serving, a small keep-alive HTTP/1
//! client, the serial runtimes, and the `suite!` macro over both backends.
#![allow(dead_code, unreachable_pub, unused_imports, unused_macros)]

pub mod examples;
pub mod pg;
pub mod proxy;
pub mod stamp;

pub(crate) use tower_redis_lock_test_support::{
    cli, eventually, free_port, hold_port, reached_every, retry_until, scale, spawn_guarded,
    RedisServer,
};

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;

/// Serve an axum router on a loopback port.
pub async fn serve(router: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    addr
}

/// A response read to the end.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// Whether the idempotency layer replayed this answer
/// (`Idempotent-Replayed: true`).
/// How the request was admitted, as the handler's [`Lease`] tells it:
/// `"Locked"`, `"FailOpen"` (a key, not locked) or `"Skipped"` (no key).
pub fn admission(lease: &tower_redis_lock::Lease) -> &'static str {
    match (lease.is_locked(), lease.key().is_some()) {
        (true, _) => "Locked",
        (false, true) => "FailOpen",
        (false, false) => "Skipped",
    }
}

pub fn replayed(reply: &Reply) -> bool {
    reply
        .headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// A payment of `user` with `Idempotency-Key: key` to `POST /payments`.
pub fn pay(user: &str, key: &str, body: &str) -> http::Request<Full<Bytes>> {
    req(
        "POST",
        "/payments",
        &[("x-user-id", user), ("idempotency-key", key)],
        body,
    )
}

/// One keep-alive HTTP/1.1 connection.
pub struct Conn {
    sender: SendRequest<Full<Bytes>>,
}

impl Conn {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let io = hyper_util::rt::TokioIo::new(stream);
        // Room for answers with more header lines than hyper's default 100
        // (a test sends the server past its record's 1,024).
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .max_headers(4096)
            .handshake(io)
            .await
            .unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Self { sender }
    }

    pub async fn send(&mut self, req: http::Request<Full<Bytes>>) -> Reply {
        self.sender.ready().await.expect("connection ready");
        let res = self.sender.send_request(req).await.expect("response");
        let (parts, body) = res.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Reply {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
        }
    }
}

/// One request on a fresh connection.
pub async fn send(addr: SocketAddr, req: http::Request<Full<Bytes>>) -> Reply {
    Conn::open(addr).await.send(req).await
}

/// One request on a fresh connection, or why there was no answer (refused,
/// reset, cut off mid-answer: the server died).
pub async fn try_send(addr: SocketAddr, req: http::Request<Full<Bytes>>) -> Result<Reply, String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let io = hyper_util::rt::TokioIo::new(stream);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let res = sender
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let (parts, body) = res.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok(Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    })
}

/// Build a request.
pub fn req(
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> http::Request<Full<Bytes>> {
    let mut b = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "localhost");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .unwrap()
}

/// Resident set size of this process in KiB (Linux `/proc/self/status`).
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .expect("VmRSS in /proc/self/status")
}

/// Log lines captured from `tower_redis_lock` (debug and up), no colours.
#[derive(Clone, Default)]
pub struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Logs {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Lines containing every one of `needles`.
    pub fn lines_with(&self, needles: &[&str]) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .map(str::to_owned)
            .collect()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run `f` on a fresh multi-thread runtime (2 workers) whose threads all log
/// `tower_redis_lock` events into the returned [`Logs`] (no global
/// subscriber, so tests do not see each other's lines). Tests run through
/// this one at a time: fault timings are asserted, and a neighbour's load
/// must not eat the margin.
pub fn run_logged<F, Fut>(f: F) -> Fut::Output
where
    F: FnOnce(Logs) -> Fut,
    Fut: std::future::Future,
{
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("tower_redis_lock=debug"))
        .with_ansi(false)
        .with_writer(logs.clone())
        .finish();
    let dispatch = tracing::Dispatch::new(subscriber);
    let rt = runtime(Some(dispatch.clone()));
    tracing::dispatcher::with_default(&dispatch, || rt.block_on(f(logs)))
}

/// Like [`run_logged`] without capturing logs (for memory measurements).
pub fn run<F, Fut>(f: F) -> Fut::Output
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future,
{
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    runtime(None).block_on(f())
}

fn runtime(dispatch: Option<tracing::Dispatch>) -> tokio::runtime::Runtime {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(2).enable_all();
    if let Some(dispatch) = dispatch {
        builder.on_thread_start(move || {
            // Stays the default for the life of this runtime thread.
            std::mem::forget(tracing::dispatcher::set_default(&dispatch));
        });
    }
    builder.build().expect("tokio runtime")
}

/// Send requests built by `make` until one answers `status`, or `within`
/// passes; returns how long it took.
pub async fn until_status(
    addr: SocketAddr,
    status: u16,
    within: Duration,
    mut make: impl FnMut() -> http::Request<Full<Bytes>>,
) -> Option<Duration> {
    let attempt = || {
        let req = make();
        async move {
            let got = send(addr, req).await.status;
            if got == status {
                Ok(())
            } else {
                Err(got)
            }
        }
    };
    retry_until(within, Duration::from_millis(20), attempt)
        .await
        .ok()
        .map(|(took, ())| took)
}

// ---- one suite, two backends -------------------------------------------------

/// `suite!(a, b)` runs each `async fn a(kind: Kind)` twice: as `memory::a`
/// against `MemoryBackend` and as `redis::a` against a `redis-server` of its
/// own. Needs `#[macro_use] mod common;`.
macro_rules! suite {
    ($($name:ident),+ $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(crate::common::Kind::Memory).await
                }
            )+
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(crate::common::Kind::Redis).await
                }
            )+
        }
    };
}

/// Which store a suite test runs against.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Memory,
    Redis,
}

/// A store for one test: a `MemoryBackend` table, or a `redis-server` of its
/// own (kept alive as long as the `Env`).
pub struct Env {
    pub kind: Kind,
    pub server: Option<RedisServer>,
    pub memory: tower_redis_lock::MemoryBackend,
    /// The lock backend handed out for the memory kind: `memory`, with
    /// every acquired key remembered so [`Env::held`] can look them up.
    pub tracked: Tracked<tower_redis_lock::MemoryBackend>,
}

impl Env {
    pub async fn new(kind: Kind) -> Self {
        let memory = tower_redis_lock::MemoryBackend::new();
        Self {
            kind,
            server: matches!(kind, Kind::Redis).then(RedisServer::start),
            tracked: Tracked::new(memory.clone()),
            memory,
        }
    }

    /// The test's Redis server (panics for the memory kind).
    pub fn server(&self) -> &RedisServer {
        self.server.as_ref().expect("a Redis env")
    }

    /// A new client onto the test's Redis: what a second instance would have.
    pub async fn redis(&self) -> tower_redis_lock::RedisBackend {
        tower_redis_lock::RedisBackend::connect(&self.server().url())
            .await
            .expect("connect to test redis")
    }

    /// A new backend handle onto the same store (a second client for Redis,
    /// a clone of the (tracked) table for memory).
    pub async fn backend(&self) -> std::sync::Arc<dyn tower_redis_lock::backend::LockBackend> {
        match self.kind {
            Kind::Memory => std::sync::Arc::new(self.tracked.clone()),
            Kind::Redis => std::sync::Arc::new(self.redis().await),
        }
    }

    /// A lock layer keyed by `key` over a new backend handle.
    pub async fn layer(
        &self,
        key: impl tower_redis_lock::key::KeyPart,
    ) -> tower_redis_lock::RedisLockLayer {
        tower_redis_lock::RedisLockLayer::new(self.backend().await, key)
    }

    /// An idempotency layer keyed by `key` over a new handle onto the same
    /// store (a second client for Redis, a clone of the table for memory).
    pub async fn idempotency_layer(
        &self,
        key: impl tower_redis_lock::key::KeyPart,
    ) -> tower_redis_lock::IdempotencyLayer {
        match self.kind {
            Kind::Memory => tower_redis_lock::IdempotencyLayer::new(self.memory.clone(), key),
            Kind::Redis => tower_redis_lock::IdempotencyLayer::new(self.redis().await, key),
        }
    }

    /// Number of leases held in the store (Redis: `DBSIZE`; memory: the
    /// acquired keys that a fresh token cannot take).
    pub fn held(&self) -> usize {
        match self.kind {
            Kind::Memory => self.tracked.held(),
            Kind::Redis => self.server().dbsize(),
        }
    }
}

/// A `LockBackend` that passes every call to `inner` and remembers the keys
/// it was asked to acquire, so a test can ask which of them are held now.
/// (`MemoryBackend` has no public listing: keys never leave the process.)
#[derive(Clone, Debug)]
pub struct Tracked<B> {
    inner: B,
    keys: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<Bytes>>>,
}

impl<B: tower_redis_lock::backend::LockBackend + Clone> Tracked<B> {
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            keys: Default::default(),
        }
    }

    /// The acquired keys that are held right now, as text (`trl:{<hex>}`).
    ///
    /// Each is probed with [`probe_held`]: an acquire with a fresh token,
    /// released at once if it got through. Call it when no request races
    /// for these keys.
    pub fn held_keys(&self) -> std::collections::BTreeSet<String> {
        let keys = self.keys.lock().unwrap().clone();
        keys.into_iter()
            .filter(|key| probe_held(&self.inner, key))
            .map(|key| String::from_utf8_lossy(&key).into_owned())
            .collect()
    }

    /// Number of [`held_keys`](Self::held_keys).
    pub fn held(&self) -> usize {
        self.held_keys().len()
    }

    /// Number of distinct keys ever acquired through this backend.
    pub fn acquired_keys(&self) -> usize {
        self.keys.lock().unwrap().len()
    }
}

impl<B: tower_redis_lock::backend::LockBackend> tower_redis_lock::backend::Backend for Tracked<B> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn is_in_process(&self) -> bool {
        self.inner.is_in_process()
    }

    fn drain(&self, timeout: Duration) -> tower_redis_lock::backend::contract::BackendFuture<()> {
        self.inner.drain(timeout)
    }
}

impl<B: tower_redis_lock::backend::LockBackend + Clone> tower_redis_lock::backend::LockBackend
    for Tracked<B>
{
    fn acquire(
        &self,
        key: &Bytes,
        token: &tower_redis_lock::backend::contract::Token,
        ttl: Duration,
    ) -> tower_redis_lock::backend::contract::BackendFuture<
        tower_redis_lock::backend::contract::Acquire,
    > {
        self.keys.lock().unwrap().insert(key.clone());
        self.inner.acquire(key, token, ttl)
    }

    fn acquire_fenced(
        &self,
        key: &Bytes,
        token: &tower_redis_lock::backend::contract::Token,
        ttl: Duration,
    ) -> tower_redis_lock::backend::contract::BackendFuture<
        tower_redis_lock::backend::contract::Acquire,
    > {
        self.keys.lock().unwrap().insert(key.clone());
        self.inner.acquire_fenced(key, token, ttl)
    }

    fn release(
        &self,
        key: &Bytes,
        token: &tower_redis_lock::backend::contract::Token,
    ) -> tower_redis_lock::backend::contract::BackendFuture<bool> {
        self.inner.release(key, token)
    }

    fn extend(
        &self,
        key: &Bytes,
        token: &tower_redis_lock::backend::contract::Token,
        ttl: Duration,
    ) -> tower_redis_lock::backend::contract::BackendFuture<bool> {
        self.inner.extend(key, token, ttl)
    }

    fn watch(
        &self,
        key: &Bytes,
    ) -> Option<
        tower_redis_lock::backend::contract::BackendFuture<
            tower_redis_lock::backend::contract::Watch,
        >,
    > {
        self.inner.watch(key)
    }

    fn native_calls(&self) -> Option<u64> {
        self.inner.native_calls()
    }

    fn release_notify(
        &self,
        key: &Bytes,
        token: &tower_redis_lock::backend::contract::Token,
    ) -> tower_redis_lock::backend::contract::BackendFuture<bool> {
        self.inner.release_notify(key, token)
    }
}

/// Whether `key` is held in an in-process backend right now, through the
/// public contract: a fresh token's acquire is refused while a lease is
/// live; if it gets through, it is released at once. The backend's futures
/// must be ready on their first poll (`MemoryBackend`'s are).
pub fn probe_held(backend: &impl tower_redis_lock::backend::LockBackend, key: &Bytes) -> bool {
    use tower_redis_lock::backend::contract::{Acquire, Token};
    let probe = Token::generate();
    match ready_now(backend.acquire(key, &probe, Duration::from_secs(1))) {
        Acquire::Held { .. } => true,
        Acquire::Acquired { .. } => {
            assert!(
                ready_now(backend.release(key, &probe)),
                "the probe releases its own lease"
            );
            false
        }
        other => panic!("unexpected acquire outcome {other:?}"),
    }
}

/// The output of a backend future that is ready on its first poll.
fn ready_now<T>(fut: tower_redis_lock::backend::contract::BackendFuture<T>) -> T {
    match fut.into_ready() {
        Ok(out) => out.expect("in-process backend call"),
        Err(_) => panic!("probe_held needs an in-process backend"),
    }
}

/// A handler body that reports when it starts (sending `T`) and then waits
/// for a permit: lets a test hold a request inside the handler.
#[derive(Clone)]
pub struct Gate<T = ()> {
    pub runs: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pub entered: tokio::sync::mpsc::UnboundedSender<T>,
    pub permits: std::sync::Arc<tokio::sync::Semaphore>,
}

impl<T> Gate<T> {
    pub fn new() -> (Self, tokio::sync::mpsc::UnboundedReceiver<T>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (
            Self {
                runs: Default::default(),
                entered: tx,
                permits: std::sync::Arc::new(tokio::sync::Semaphore::new(0)),
            },
            rx,
        )
    }

    /// How often the gated handler ran.
    pub fn runs(&self) -> usize {
        self.runs.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Count the run, queue for a permit, report `value`, wait for the
    /// permit. Queued *before* reporting: the semaphore is fair, so handlers
    /// get permits in the order the test saw them enter (reporting first
    /// let a handler that was descheduled between the two be overtaken by
    /// a later one).
    pub async fn pass(&self, value: T) {
        use std::future::Future;
        self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let acquire = self.permits.acquire();
        let mut acquire = std::pin::pin!(acquire);
        // One poll registers this handler as a waiter (or takes a permit).
        let first =
            std::future::poll_fn(|cx| std::task::Poll::Ready(acquire.as_mut().poll(cx))).await;
        let _ = self.entered.send(value);
        let permit = match first {
            std::task::Poll::Ready(permit) => permit,
            std::task::Poll::Pending => acquire.await,
        };
        permit.unwrap().forget();
    }
}

/// A small xorshift generator for load tests (amounts, pacing, back-offs,
/// kill times), seeded from the clock and `salt`: each run differs, each
/// worker of a run too.
pub struct Rng(u64);

impl Rng {
    pub fn new(salt: u64) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        Self((nanos ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        lo + self.0 % (hi - lo + 1)
    }
}
