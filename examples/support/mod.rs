//! Shared by the examples: pick the backend from the environment and start
//! logging. Not part of the library API.
#![allow(dead_code)]

use std::sync::Arc;

use tower_redis_lock::replay::ReplayStore;
use tower_redis_lock::{LockBackend, MemoryBackend, RedisBackend};

/// `MemoryBackend` unless `REDIS_URL` is set; then Redis through fred, in any
/// URL form fred accepts (`redis://`, `rediss://`, `redis-cluster://...`,
/// `redis-sentinel://...`). A URL that cannot be parsed or reached is an
/// error naming the problem.
pub async fn backend_from_env() -> Result<(Arc<dyn LockBackend>, String), String> {
    Ok(match redis_from_env().await? {
        Some((redis, name)) => (Arc::new(redis), name),
        None => (Arc::new(MemoryBackend::new()), "memory".to_owned()),
    })
}

/// The same choice as [`backend_from_env`], as an idempotency store.
pub async fn replay_store_from_env() -> Result<(Arc<dyn ReplayStore>, String), String> {
    Ok(match redis_from_env().await? {
        Some((redis, name)) => (Arc::new(redis), name),
        None => (Arc::new(MemoryBackend::new()), "memory".to_owned()),
    })
}

/// `Some` Redis backend when `REDIS_URL` is set (and its display name).
async fn redis_from_env() -> Result<Option<(RedisBackend, String)>, String> {
    match std::env::var("REDIS_URL") {
        Ok(url) if !url.trim().is_empty() => {
            let backend = RedisBackend::connect(url.trim())
                .await
                .map_err(|e| format!("REDIS_URL: {e}"))?;
            Ok(Some((backend, format!("redis ({})", redact(url.trim())))))
        }
        _ => Ok(None),
    }
}

/// The URL without a password, for the start-up line.
pub fn redact(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((_, host)) => format!("{scheme}://***@{host}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// `$ADDR` or the default.
pub fn addr_from_env(default: &str) -> String {
    std::env::var("ADDR").unwrap_or_else(|_| default.to_owned())
}

/// Logging at `warn` by default (no per-request lines); `RUST_LOG` overrides.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).try_init();
}
