//! Quickstart: one locked payment route.
//!
//! ```text
//! cargo run --example quickstart                                 # in-memory backend
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example quickstart  # Redis
//! REDIS_URL='redis-cluster://127.0.0.1:7000?node=127.0.0.1:7001' cargo run --example quickstart
//! REDIS_URL='redis-sentinel://127.0.0.1:26379?node=127.0.0.1:26380&sentinelServiceName=mymaster' \
//!     cargo run --example quickstart                              # Sentinel
//! REDLOCK_URLS=redis://10.0.0.1:6379,redis://10.0.0.2:6379,redis://10.0.0.3:6379 \
//!     cargo run --example quickstart                              # Redlock quorum
//! ```
//!
//! - listens on `$ADDR` (default `127.0.0.1:3000`) and prints one line with
//!   the address and the backend;
//! - `POST /pay?delay_ms=200` is locked on method + route + user + body
//!   digest. The user comes from the `x-user-id` header, **trusted in this
//!   demo only**: in production take identity from your auth layer
//!   (`key::Identity<T>`), or a client can lock out another user by sending
//!   their id. The handler waits `delay_ms` (default 200; `0` answers at
//!   once) and answers 200 JSON; a duplicate sent meanwhile gets 409
//!   problem+json, or, with `LOCK_WAIT_MS=2000`, waits up to 2 s for its
//!   turn and then runs (default `0`: 409 at once);
//! - `GET /stats` returns `{"executions": N, "max_concurrent": M}`: how
//!   often `/pay` ran here, and the most runs that overlapped.
//! - SIGTERM or Ctrl-C shuts it down gracefully: no new connections, the
//!   requests in flight finish (up to 30 s), their releases are delivered
//!   (`Backend::drain`), exit status 0.
//!
//! Try it: `curl -X POST -H 'x-user-id: alice' -d '{"amount":5}' localhost:3000/pay`
//! twice at once.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use tower_redis_lock::key::{Header, RequestMethod, Route};
use tower_redis_lock::RedisLockLayer;

#[derive(Clone, Default)]
struct Stats {
    executions: Arc<AtomicU64>,
    running: Arc<AtomicU64>,
    max_concurrent: Arc<AtomicU64>,
}

#[derive(Deserialize)]
struct PayParams {
    delay_ms: Option<u64>,
}

async fn pay(State(stats): State<Stats>, Query(p): Query<PayParams>) -> Json<serde_json::Value> {
    let n = stats.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let running = stats.running.fetch_add(1, Ordering::SeqCst) + 1;
    stats.max_concurrent.fetch_max(running, Ordering::SeqCst);
    let delay = p.delay_ms.unwrap_or(200).min(60_000);
    // Tokio's timer counts whole milliseconds: even `sleep(0)` waits for the
    // next tick (about 1 ms), so `?delay_ms=0` skips it and answers at once.
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    stats.running.fetch_sub(1, Ordering::SeqCst);
    Json(serde_json::json!({"status": "paid", "execution": n}))
}

async fn stats(State(stats): State<Stats>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "executions": stats.executions.load(Ordering::SeqCst),
        "max_concurrent": stats.max_concurrent.load(Ordering::SeqCst),
    }))
}

/// `LOCK_WAIT_MS`, default 0 (no waiting: 409 at once).
fn wait_ms() -> u64 {
    match std::env::var("LOCK_WAIT_MS") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            eprintln!("quickstart: LOCK_WAIT_MS must be a number of milliseconds, not {v:?}");
            std::process::exit(2)
        }),
        Err(_) => 0,
    }
}

#[tokio::main]
async fn main() {
    support::init_tracing();
    let (backend, backend_name) = support::or_exit("quickstart", support::backend_from_env().await);
    let drain = backend.clone();
    let lock = RedisLockLayer::new(
        backend,
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
    .digest_body()
    .body_limit(64 * 1024)
    .ttl(Duration::from_secs(70))
    // LOCK_WAIT_MS: wait that long for a held key instead of 409 (0: off).
    .wait(Duration::from_millis(wait_ms()));

    let app = Router::new()
        .route("/pay", post(pay).layer(lock))
        .route("/stats", get(stats))
        .with_state(Stats::default());

    let (listener, local) = support::bind("quickstart", "127.0.0.1:3000").await;
    println!("quickstart listening on http://{local} with the {backend_name} backend");
    support::serve("quickstart", listener, app, drain).await;
}
