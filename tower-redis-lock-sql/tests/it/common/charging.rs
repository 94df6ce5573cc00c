//! A payments route for the store tests: the handler `INSERT`s the
//! request's charge through its transaction, tells the test it did, then
//! works `?work_ms=N` (a slow provider call, counted) and answers 201.
//! And the PostgreSQL schema whose `COMMIT` is slow: a deferred constraint
//! trigger that sleeps at commit.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, Request, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use tokio::sync::Notify;

use super::stores::{exec, insert_charge, key_of, Env};

/// What the handler did, for the test to count and wait on.
#[derive(Clone, Default)]
pub struct Charging {
    /// Handler runs.
    pub runs: Arc<AtomicU64>,
    /// Runs that got past their `INSERT` and started their work (the
    /// provider calls).
    pub calls: Arc<AtomicU64>,
    /// Notified when a run's `INSERT` is done.
    pub inserted: Arc<Notify>,
}

impl Charging {
    pub fn runs(&self) -> u64 {
        self.runs.load(Ordering::SeqCst)
    }

    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

#[derive(serde::Deserialize)]
struct Work {
    work_ms: Option<u64>,
}

async fn charge(
    State(app): State<Charging>,
    Query(work): Query<Work>,
    req: Request,
) -> (StatusCode, String) {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let (parts, _body) = req.into_parts();
    let key = key_of(&parts.headers);
    if let Err(e) = exec(&parts.extensions, &insert_charge(&key)).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, e);
    }
    app.inserted.notify_one();
    if let Some(ms) = work.work_ms {
        app.calls.fetch_add(1, Ordering::SeqCst);
        // The work itself (a slow provider call), not synchronisation.
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    (StatusCode::CREATED, format!("charged {key}"))
}

/// Serve `POST /w` behind `layer` on a loopback port.
pub async fn serve_charging(layer: tower_redis_lock::IdempotencyLayer) -> (SocketAddr, Charging) {
    let app = Charging::default();
    let router = Router::new()
        .route("/w", post(charge).layer(layer))
        .with_state(app.clone());
    (super::serve(router).await, app)
}

/// PostgreSQL: `charges`, whose every `COMMIT` that inserted a row sleeps
/// `knobs.commit_sleep` seconds (a deferred constraint trigger runs at
/// commit).
pub async fn slow_commit_schema(env: &Env, seconds: f64) {
    env.batch(&format!(
        "CREATE TABLE charges (k text NOT NULL); \
         CREATE TABLE knobs (commit_sleep float8 NOT NULL); \
         INSERT INTO knobs VALUES ({seconds}); \
         CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN PERFORM pg_sleep((SELECT commit_sleep FROM knobs)); RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON charges \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();"
    ))
    .await;
}

/// PostgreSQL: sessions of this database in a commit: sleeping in the
/// commit trigger, or past it but not yet done. A commit's rows become
/// visible when its session drops its transaction id, after the trigger:
/// a check that saw only the end of the sleep could read the charges of a
/// commit that then landed a moment later.
pub async fn committing(env: &Env) -> i64 {
    env.count(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() \
           AND (wait_event = 'PgSleep' \
                OR (backend_xid IS NOT NULL AND query ILIKE 'commit%'))",
    )
    .await
}

/// Poll `check` every 20 ms until it holds, at most `bound`: whether it
/// did.
pub async fn until<F, Fut>(bound: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + bound;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Send `request()` until the answer is neither 409 nor 503 (at most
/// `bound`, 100 ms apart): every answer, summed up.
pub async fn retry_while_pending<F>(addr: SocketAddr, bound: Duration, request: F) -> Vec<String>
where
    F: Fn() -> http::Request<http_body_util::Full<bytes::Bytes>>,
{
    let end = tokio::time::Instant::now() + bound;
    let mut seen = Vec::new();
    loop {
        let (s, _) = super::stores::send(addr, request()).await;
        let pending = s.starts_with("409") || s.starts_with("503");
        seen.push(s);
        if !pending || tokio::time::Instant::now() >= end {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
