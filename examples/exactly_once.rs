//! Exactly once: an idempotent `POST /payments` whose charge row and
//! idempotency record commit in one PostgreSQL transaction.
//!
//! ```text
//! cargo run --example exactly_once --features postgres                  # records in PostgreSQL
//! STORE=redis REDIS_URL=redis://127.0.0.1:6379 cargo run --example exactly_once --features postgres
//! ```
//!
//! - listens on `$ADDR` (default `127.0.0.1:3004`) and prints one line with
//!   the address and the store; `DATABASE_URL` (default
//!   `postgres://postgres@127.0.0.1:5432/postgres`); creates its table
//!   `charges (id, idempotency_key, user_id, amount)` and the store's table
//!   if missing;
//! - `STORE=postgres` (the default): `PostgresBackend`; the handler inserts
//!   its charge through the request's `PgTransaction`, so the charge and the
//!   record commit together: a process killed mid-handler leaves nothing,
//!   and the retry charges once. `STORE=redis` (with `REDIS_URL`): records in
//!   Redis, and the charge in its own autocommit statement: the control that
//!   shows the hole this closes (killed mid-handler, the charge stays, the
//!   claim expires after `CLAIM_TTL_MS`, and the retry charges again);
//! - `CLAIM_TTL_MS` (default 30000): the claim TTL of the layer;
//! - `POST /payments?delay_ms=N` with JSON `{"amount": n, "currency": "..."}`,
//!   `x-user-id` (trusted in this demo only: take the identity from your
//!   auth layer) and `Idempotency-Key`: inserts one row into `charges`,
//!   **then** waits `delay_ms` (default 200: the window a crash hits), and
//!   answers 201 JSON with the charge id; a retry gets the same 201,
//!   replayed; a duplicate in flight waits for it (up to 5 s);
//! - `GET /stats` answers `{"executions": N}`: charges this process wrote
//!   (committed or not);
//! - shuts down gracefully on SIGTERM or Ctrl-C.
//!
//! Try it:
//! ```text
//! curl -i -X POST 'localhost:3004/payments?delay_ms=2000' -H 'x-user-id: alice' \
//!   -H 'Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324' \
//!   -H 'content-type: application/json' -d '{"amount":500,"currency":"EUR"}'
//! ```
//! and kill the process (`kill -9`) before it answers: `SELECT * FROM charges`
//! shows nothing; restart it and send the same request: one charge.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deadpool_postgres::{Manager, Pool};
use serde::Deserialize;
use tower_redis_lock::backend::{LockBackend, PgTransaction, PostgresBackend};
use tower_redis_lock::key::{Header, RequestMethod, Route};
use tower_redis_lock::replay::{IdempotencyKey, SafeToRetry};
use tower_redis_lock::{IdempotencyLayer, MemoryBackend, RedisBackend};

const SCHEMA: &str = "
    BEGIN;
    SELECT pg_advisory_xact_lock(7244107);
    CREATE TABLE IF NOT EXISTS charges (
        id              text PRIMARY KEY,
        idempotency_key text NOT NULL,
        user_id         text NOT NULL,
        amount          bigint NOT NULL
    );
    COMMIT;";

const INSERT_CHARGE: &str =
    "INSERT INTO charges (id, idempotency_key, user_id, amount) VALUES ($1, $2, $3, $4)";

#[derive(Clone)]
struct App {
    /// For the autocommit charge of `STORE=redis`.
    pool: Pool,
    executions: Arc<AtomicU64>,
}

#[derive(Deserialize)]
struct PayParams {
    delay_ms: Option<u64>,
}

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
    currency: String,
}

/// A database failure: nothing was charged (the statement failed, and in
/// the transaction everything rolls back), so the key is freed.
fn db_error(e: impl std::fmt::Display) -> Response {
    (
        SafeToRetry,
        support::problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "Database error",
            e.to_string(),
        ),
    )
        .into_response()
}

async fn create_payment(
    State(app): State<App>,
    Query(p): Query<PayParams>,
    key: IdempotencyKey,
    tx: Option<PgTransaction>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let payment: NewPayment = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => {
            return support::problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid payment",
                format!("expected {{\"amount\": n, \"currency\": \"...\"}}: {e}"),
            )
        }
    };
    let user = headers
        .get("x-user-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let id = format!("ch_{}", support::random_hex::<12>());
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
        [&id, &key.as_str(), &user, &payment.amount];
    let charged = match &tx {
        // In the request's transaction: commits with the record, or never.
        Some(tx) => match tx.client().await {
            Ok(db) => db
                .execute(INSERT_CHARGE, &params)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        },
        // Autocommit on a connection of its own: stays whatever happens next.
        None => match app.pool.get().await {
            Ok(db) => db
                .execute(INSERT_CHARGE, &params)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        },
    };
    if let Err(e) = charged {
        return db_error(e);
    }
    app.executions.fetch_add(1, Ordering::SeqCst);
    // The window a crash hits: charged, not yet answered.
    let delay = p.delay_ms.unwrap_or(200).min(60_000);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{id}"))],
        Json(serde_json::json!({
            "id": id,
            "amount": payment.amount,
            "currency": payment.currency,
            "status": "succeeded",
            "idempotency_key": key.as_str(),
        })),
    )
        .into_response()
}

async fn stats(State(app): State<App>) -> Json<serde_json::Value> {
    Json(serde_json::json!({"executions": app.executions.load(Ordering::SeqCst)}))
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// An error and its causes, `: `-separated (the pool's error alone says
/// only "error connecting to server").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

async fn pool_from_env() -> Result<Pool, String> {
    let url = env_or(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    let config: tokio_postgres::Config = url
        .parse()
        .map_err(|e| format!("DATABASE_URL: cannot parse it: {e}"))?;
    let manager = Manager::new(config, tokio_postgres::NoTls);
    let pool = Pool::builder(manager)
        .max_size(32)
        .build()
        .map_err(|e| format!("DATABASE_URL: {e}"))?;
    let db = pool
        .get()
        .await
        .map_err(|e| format!("DATABASE_URL: cannot connect: {}", chain(&e)))?;
    db.batch_execute(SCHEMA)
        .await
        .map_err(|e| format!("creating the charges table: {e}"))?;
    Ok(pool)
}

#[tokio::main]
async fn main() {
    support::init_tracing();
    let pool = support::or_exit("exactly_once", pool_from_env().await);
    let ttl = env_or("CLAIM_TTL_MS", "30000");
    let ttl = Duration::from_millis(support::or_exit(
        "exactly_once",
        ttl.parse::<u64>().map_err(|e| format!("CLAIM_TTL_MS: {e}")),
    ));
    let parts = (RequestMethod, Route, Header::trusted_identity("x-user-id"));
    let (layer, drain, store_name): (IdempotencyLayer, Arc<dyn LockBackend>, String) =
        match env_or("STORE", "postgres").as_str() {
            "postgres" => {
                let store = PostgresBackend::new(pool.clone());
                support::or_exit(
                    "exactly_once",
                    store.migrate().await.map_err(|e| e.to_string()),
                );
                let name = "postgres (records in the handler's transaction)".to_owned();
                (
                    IdempotencyLayer::new(store, parts),
                    Arc::new(MemoryBackend::new()),
                    name,
                )
            }
            "redis" => {
                let url = env_or("REDIS_URL", "redis://127.0.0.1:6379");
                let redis = support::or_exit(
                    "exactly_once",
                    RedisBackend::connect(url.trim())
                        .await
                        .map_err(|e| format!("REDIS_URL: {e}")),
                );
                let name = format!(
                    "redis ({}; charges in autocommit)",
                    support::redact(url.trim())
                );
                (
                    IdempotencyLayer::new(redis.clone(), parts),
                    Arc::new(redis),
                    name,
                )
            }
            other => support::or_exit(
                "exactly_once",
                Err(format!("STORE: `{other}`: expected `postgres` or `redis`")),
            ),
        };
    let idempotency = layer.ttl(ttl).join_timeout(Duration::from_secs(5));
    let app = Router::new()
        .route("/payments", post(create_payment).layer(idempotency))
        .route("/stats", get(stats))
        .with_state(App {
            pool,
            executions: Arc::default(),
        });

    let (listener, local) = support::bind("exactly_once", "127.0.0.1:3004").await;
    println!("exactly_once listening on http://{local} with the {store_name} store");
    support::serve("exactly_once", listener, app, drain).await;
}
