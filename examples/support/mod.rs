//! Shared by the examples: pick the backend from the environment, start
//! logging, serve with a graceful shutdown. Not part of the library API.
#![allow(dead_code)]

use std::sync::Arc;

use tower_redis_lock::backend::{Backend, LockBackend, RedlockBackend};
use tower_redis_lock::key::KeyPart;
use tower_redis_lock::{IdempotencyLayer, MemoryBackend, RedisBackend};

/// `MemoryBackend` unless one of these is set:
///
/// - `REDIS_URL`: Redis through fred, in any URL form fred accepts
///   (`redis://`, `rediss://`, `redis-cluster://host:port?node=host:port`,
///   `redis-sentinel://host:port?node=host:port&sentinelServiceName=name`);
/// - `REDLOCK_URLS`: a comma-separated list of `redis://` URLs of independent
///   primaries, used as a Redlock quorum (`RedlockBackend`).
///
/// A URL that cannot be parsed or reached is an error naming the problem.
pub async fn backend_from_env() -> Result<(Arc<dyn LockBackend>, String), String> {
    if let Some((redlock, name)) = redlock_from_env().await? {
        return Ok((Arc::new(redlock), name));
    }
    Ok(match redis_from_env().await? {
        Some((redis, name)) => (Arc::new(redis), name),
        None => (Arc::new(MemoryBackend::new()), "memory".to_owned()),
    })
}

/// Where an idempotency layer stores its responses: Redis or memory.
pub enum ReplayStore {
    Memory(MemoryBackend),
    Redis(RedisBackend),
}

impl ReplayStore {
    /// The same store as a lock backend (for the drain at shutdown).
    pub fn backend(&self) -> Arc<dyn LockBackend> {
        match self {
            Self::Memory(memory) => Arc::new(memory.clone()),
            Self::Redis(redis) => Arc::new(redis.clone()),
        }
    }

    /// `IdempotencyLayer::new` over this store, keyed by `key`.
    pub fn idempotency_layer(self, key: impl KeyPart) -> IdempotencyLayer {
        match self {
            Self::Memory(memory) => IdempotencyLayer::new(memory, key),
            Self::Redis(redis) => IdempotencyLayer::new(redis, key),
        }
    }
}

/// The same choice as [`backend_from_env`], as an idempotency store
/// (`REDIS_URL` or memory: Redlock keeps no stored responses).
pub async fn replay_store_from_env() -> Result<(ReplayStore, String), String> {
    Ok(match redis_from_env().await? {
        Some((redis, name)) => (ReplayStore::Redis(redis), name),
        None => (
            ReplayStore::Memory(MemoryBackend::new()),
            "memory".to_owned(),
        ),
    })
}

/// `2 * N` lowercase hex digits from the operating system's random source.
pub fn random_hex<const N: usize>() -> String {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).expect("the OS random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn non_empty_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `Some` Redis backend when `REDIS_URL` is set (and its display name).
async fn redis_from_env() -> Result<Option<(RedisBackend, String)>, String> {
    match non_empty_env("REDIS_URL") {
        Some(url) => {
            let backend = RedisBackend::connect(url.trim())
                .await
                .map_err(|e| format!("REDIS_URL: {e}"))?;
            Ok(Some((backend, format!("redis ({})", redact(url.trim())))))
        }
        None => Ok(None),
    }
}

/// `Some` Redlock backend when `REDLOCK_URLS` is set; an error if
/// `REDIS_URL` is set as well.
async fn redlock_from_env() -> Result<Option<(RedlockBackend, String)>, String> {
    let Some(list) = non_empty_env("REDLOCK_URLS") else {
        return Ok(None);
    };
    if non_empty_env("REDIS_URL").is_some() {
        return Err("set REDIS_URL or REDLOCK_URLS, not both".to_owned());
    }
    let urls: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    let backend = RedlockBackend::connect(&urls)
        .await
        .map_err(|e| format!("REDLOCK_URLS: {e}"))?;
    let shown: Vec<String> = urls.iter().map(|u| redact(u)).collect();
    let name = format!(
        "redlock, quorum {} of {} ({})",
        urls.len() / 2 + 1,
        urls.len(),
        shown.join(", ")
    );
    Ok(Some((backend, name)))
}

/// `$ADDR` or the default.
pub fn addr_from_env(default: &str) -> String {
    std::env::var("ADDR").unwrap_or_else(|_| default.to_owned())
}

/// Logging at `warn` by default (no per-request lines); `RUST_LOG` overrides.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Logs go to stderr: stdout carries only the one start-up line.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// The value, or exit with status 2 and `example: error` on stderr (a start-up
/// problem the user must fix: bad URL, unreachable Redis, port taken).
pub fn or_exit<T>(example: &str, result: Result<T, String>) -> T {
    result.unwrap_or_else(|e| {
        eprintln!("{example}: {e}");
        std::process::exit(2);
    })
}

/// Listen on `$ADDR` (or `default`); returns the listener and the address it
/// really got (`127.0.0.1:0` picks a free port). Exits 2 if it cannot bind.
pub async fn bind(example: &str, default: &str) -> (tokio::net::TcpListener, String) {
    let addr = addr_from_env(default);
    let listener = or_exit(
        example,
        tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}")),
    );
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or(addr);
    (listener, local)
}

/// How long a graceful shutdown waits for requests still running.
const GRACE: std::time::Duration = std::time::Duration::from_secs(30);
/// How long it then waits for the releases still on their way to Redis.
const DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Serve `app` until SIGTERM or Ctrl-C, then shut down gracefully: stop
/// accepting, let the requests in flight finish (up to 30 s), and wait (up
/// to 5 s) for `backend` to deliver every pending release, so no lease
/// outlives the process. Exits 1 on a server error.
pub async fn serve(
    example: &str,
    listener: tokio::net::TcpListener,
    app: axum::Router,
    backend: Arc<dyn LockBackend>,
) {
    let (signalled, mut stopping) = tokio::sync::watch::channel(false);
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        shutdown_signal().await;
        let _ = signalled.send(true);
    });
    let grace = async {
        let _ = stopping.wait_for(|stop| *stop).await;
        tokio::time::sleep(GRACE).await;
    };
    tokio::select! {
        result = std::future::IntoFuture::into_future(server) => {
            if let Err(e) = result {
                eprintln!("{example}: server error: {e}");
                std::process::exit(1);
            }
        }
        () = grace => eprintln!("{example}: requests still running after {} s; stopping anyway", GRACE.as_secs()),
    }
    match backend.drain(DRAIN).await {
        Ok(()) => eprintln!("{example}: shut down; every release delivered"),
        Err(e) => eprintln!("{example}: shut down; {e}"),
    }
}

/// Resolves on Ctrl-C (SIGINT) or, on Unix, SIGTERM (what `kill`, systemd,
/// Docker and Kubernetes send).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

/// A URL as these examples print it: its scheme and host part only. The user,
/// the password (which may itself hold `@`, `/` or `?`) and the query (where
/// `sentinelPassword=` lives) are dropped; a string without `scheme://` is
/// not shown at all.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "***".to_owned();
    };
    // Everything up to the last `@` is userinfo, whatever it holds.
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let host = host.split(['?', '#']).next().unwrap_or_default();
    format!("{scheme}://{host}")
}

/// An RFC 9457 problem answer.
pub fn problem(
    status: http::StatusCode,
    title: &str,
    detail: impl Into<String>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let body = serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail.into(),
    });
    (
        status,
        [(http::header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}
