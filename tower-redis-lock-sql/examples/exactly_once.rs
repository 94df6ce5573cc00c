//! Exactly once: an idempotent `POST /payments` whose charge row and
//! idempotency record commit in one database transaction.
//!
//! ```text
//! cargo run -p tower-redis-lock-sql --example exactly_once --features postgres    # records in PostgreSQL
//! STORE=sqlx cargo run -p tower-redis-lock-sql --example exactly_once --features postgres,sqlx-postgres
//! STORE=sqlite DATABASE_URL=sqlite:///tmp/pay.db cargo run -p tower-redis-lock-sql --example exactly_once --features postgres,sqlx-sqlite
//! STORE=redis REDIS_URL=redis://127.0.0.1:6379 cargo run -p tower-redis-lock-sql --example exactly_once --features postgres
//! ```
//!
//! - listens on `$ADDR` (default `127.0.0.1:3004`) and prints one line with
//!   the address and the store; `DATABASE_URL` (default
//!   `postgres://postgres@127.0.0.1:5432/postgres`); creates its table
//!   `charges (id, idempotency_key, user_id, amount)` and the store's table
//!   if missing;
//! - `STORE=postgres` (the default): `PostgresBackend` (tokio-postgres); the
//!   handler inserts its charge through the request's `PgTransaction`, so
//!   the charge and the record commit together: a process killed
//!   mid-handler leaves nothing, and the retry charges once. `STORE=sqlx`
//!   (feature `sqlx-postgres`): the same through sqlx
//!   (`SqlxPostgresBackend`, `SqlxTransaction<Postgres>`). `STORE=sqlite`
//!   (feature `sqlx-sqlite`) with `DATABASE_URL=sqlite://<path>`:
//!   `SqliteBackend`, the `charges` table in that file (created if missing,
//!   WAL); a claim a killed process left is taken over once its
//!   `CLAIM_TTL_MS` passed. `STORE=redis` (with `REDIS_URL`): records in
//!   Redis, and the charge in its own autocommit statement: the control that
//!   shows the hole this closes (killed mid-handler, the charge stays, the
//!   claim expires after `CLAIM_TTL_MS`, and the retry charges again);
//! - `CLAIM_TTL_MS` (default 30000): the claim TTL of the layer;
//! - `PROVIDER_URL` (optional, `http://host:port/path`): before its
//!   `INSERT`, the handler charges at this payment provider: `POST` with
//!   `Idempotency-Key: <key>` and JSON `{"amount": n, "reference":
//!   "<user>/<Idempotency-Key>"}`, and puts the provider's charge id (the
//!   `id` of its answer, as Stripe's `{"id": "ch_..", "object": "charge"}`;
//!   else a `charge` field) in its answer as `provider_charge`. The key sent is `IdempotencyKey::downstream()`: stable across
//!   every retry, different for two users' same key. **Test controls only**:
//!   `PROVIDER_KEY=raw` sends the client's own `Idempotency-Key` (two users'
//!   keys collide at the provider), `PROVIDER_KEY=fresh` a new key per
//!   attempt (a retry after a crash charges again);
//! - `POST /payments?delay_ms=N` with JSON `{"amount": n, "currency": "..."}`,
//!   `x-user-id` (trusted in this demo only: take the identity from your
//!   auth layer) and `Idempotency-Key`: inserts one row into `charges`,
//!   **then** waits `delay_ms` (default 200: the window a crash hits), and
//!   answers 201 JSON with the charge id; a retry gets the same 201,
//!   replayed; a duplicate in flight waits for it (up to 5 s);
//! - `GET /stats` answers `{"executions": N}`: charges this process wrote
//!   (committed or not);
//! - shuts down gracefully on SIGTERM or Ctrl-C (the requests in flight
//!   finish, then the store drains: a SQL store's open claims, Redis's
//!   pending releases).
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
use axum::http::Extensions;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deadpool_postgres::{Manager, Pool};
use http_body_util::BodyExt;
use serde::Deserialize;
use tower_redis_lock::backend::Backend;
use tower_redis_lock::idempotency::{IdempotencyKey, SafeToRetry};
use tower_redis_lock::key::{Header, RequestMethod, Route};
use tower_redis_lock::{IdempotencyLayer, RedisBackend};
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
use tower_redis_lock_sql::SqlxTransaction;
use tower_redis_lock_sql::{PgTransaction, PostgresBackend};

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

#[cfg(feature = "sqlx-sqlite")]
const SQLITE_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS charges (
        id              TEXT PRIMARY KEY,
        idempotency_key TEXT NOT NULL,
        user_id         TEXT NOT NULL,
        amount          INTEGER NOT NULL
    )";

/// Which key the handler sends the provider (`PROVIDER_KEY`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum ProviderKey {
    /// `IdempotencyKey::downstream()`: what a real service sends.
    Downstream,
    /// Test control: the client's own `Idempotency-Key`.
    Raw,
    /// Test control: a new key per attempt.
    Fresh,
}

#[derive(Clone)]
struct App {
    /// For the autocommit charge of `STORE=redis`.
    pool: Option<Pool>,
    executions: Arc<AtomicU64>,
    /// `PROVIDER_URL`, parsed, and which key to send it.
    provider: Option<(axum::http::Uri, ProviderKey)>,
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
    extensions: Extensions,
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
    // Money moves at the provider first: a crash after this and before the
    // commit makes the retry call it again, with the same downstream key.
    let provider_charge = match &app.provider {
        Some((url, which)) => {
            let sent = match which {
                ProviderKey::Downstream => key.downstream().to_owned(),
                ProviderKey::Raw => key.as_str().to_owned(),
                ProviderKey::Fresh => format!("fresh-{}", support::random_hex::<16>()),
            };
            let reference = format!("{user}/{}", key.as_str());
            match charge_at_provider(url, &sent, payment.amount, &reference).await {
                Ok(charge) => Some(charge),
                Err(e) => return db_error(format!("payment provider: {e}")),
            }
        }
        None => None,
    };
    let id = format!("ch_{}", support::random_hex::<12>());
    if let Err(e) = insert_charge(&app, &extensions, &id, key.as_str(), &user, payment.amount).await
    {
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
            "provider_charge": provider_charge,
        })),
    )
        .into_response()
}

/// The charge row: in the request's transaction when the store gave one
/// (it commits with the record, or never), else in autocommit.
async fn insert_charge(
    app: &App,
    extensions: &Extensions,
    id: &str,
    key: &str,
    user: &str,
    amount: i64,
) -> Result<(), String> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&id, &key, &user, &amount];
    if let Some(tx) = extensions.get::<PgTransaction>() {
        let db = tx.client().await.map_err(|e| e.to_string())?;
        db.execute(INSERT_CHARGE, &params)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(());
    }
    #[cfg(feature = "sqlx-postgres")]
    if let Some(tx) = extensions.get::<SqlxTransaction<sqlx::Postgres>>() {
        let mut conn = tx.conn().await.map_err(|e| e.to_string())?;
        sqlx::query(INSERT_CHARGE)
            .bind(id)
            .bind(key)
            .bind(user)
            .bind(amount)
            .execute(&mut *conn)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(());
    }
    #[cfg(feature = "sqlx-sqlite")]
    if let Some(tx) = extensions.get::<SqlxTransaction<sqlx::Sqlite>>() {
        let mut conn = tx.conn().await.map_err(|e| e.to_string())?;
        sqlx::query(INSERT_CHARGE)
            .bind(id)
            .bind(key)
            .bind(user)
            .bind(amount)
            .execute(&mut *conn)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(());
    }
    // Autocommit on a connection of its own: stays whatever happens next.
    let pool = app.pool.as_ref().ok_or("no database for the charge")?;
    let db = pool.get().await.map_err(|e| e.to_string())?;
    db.execute(INSERT_CHARGE, &params)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// `POST url` with `Idempotency-Key: key`: the provider's charge id.
async fn charge_at_provider(
    url: &axum::http::Uri,
    key: &str,
    amount: i64,
    reference: &str,
) -> Result<String, String> {
    let authority = url.authority().ok_or("PROVIDER_URL has no host")?.clone();
    let stream = tokio::net::TcpStream::connect(authority.as_str())
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let body = serde_json::json!({"amount": amount, "reference": reference}).to_string();
    let req = axum::http::Request::post(url.path())
        .header(header::HOST, authority.as_str())
        .header("idempotency-key", key)
        .header(header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let res = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = res.status();
    let body = res
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("answered {status}"));
    }
    let answer: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    // A charge object's `id` (Stripe: `{"id": "ch_..", "object": "charge",
    // ..}`); a bare `charge` field is read too.
    answer["id"]
        .as_str()
        .or_else(|| answer["charge"].as_str())
        .map(str::to_owned)
        .ok_or_else(|| "no charge id (`id`) in its answer".to_owned())
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

#[cfg(feature = "sqlx-postgres")]
async fn sqlx_pg_from_env() -> Result<sqlx::PgPool, String> {
    let url = env_or(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(32)
        .connect(&url)
        .await
        .map_err(|e| format!("DATABASE_URL: cannot connect: {e}"))?;
    sqlx::raw_sql(SCHEMA)
        .execute(&pool)
        .await
        .map_err(|e| format!("creating the charges table: {e}"))?;
    Ok(pool)
}

#[cfg(feature = "sqlx-sqlite")]
async fn sqlite_from_env() -> Result<sqlx::SqlitePool, String> {
    use std::str::FromStr;
    let url = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| u.starts_with("sqlite:"))
        .ok_or("STORE=sqlite needs DATABASE_URL=sqlite://<path>")?;
    let options = sqlx::sqlite::SqliteConnectOptions::from_str(&url)
        .map_err(|e| format!("DATABASE_URL: {e}"))?
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(5));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(32)
        .connect_with(options)
        .await
        .map_err(|e| format!("DATABASE_URL: cannot open: {e}"))?;
    sqlx::raw_sql(SQLITE_SCHEMA)
        .execute(&pool)
        .await
        .map_err(|e| format!("creating the charges table: {e}"))?;
    Ok(pool)
}

fn provider_from_env() -> Result<Option<(axum::http::Uri, ProviderKey)>, String> {
    let Ok(url) = std::env::var("PROVIDER_URL") else {
        return Ok(None);
    };
    let url: axum::http::Uri = url
        .trim()
        .parse()
        .map_err(|e| format!("PROVIDER_URL: {e}"))?;
    let which = match env_or("PROVIDER_KEY", "downstream").as_str() {
        "downstream" => ProviderKey::Downstream,
        "raw" => ProviderKey::Raw,
        "fresh" => ProviderKey::Fresh,
        other => {
            return Err(format!(
                "PROVIDER_KEY: `{other}`: expected `downstream`, `raw` or `fresh`"
            ))
        }
    };
    Ok(Some((url, which)))
}

#[tokio::main]
async fn main() {
    support::init_tracing();
    let ttl = env_or("CLAIM_TTL_MS", "30000");
    let ttl = Duration::from_millis(support::or_exit(
        "exactly_once",
        ttl.parse::<u64>().map_err(|e| format!("CLAIM_TTL_MS: {e}")),
    ));
    let provider = support::or_exit("exactly_once", provider_from_env());
    let parts = (RequestMethod, Route, Header::trusted_identity("x-user-id"));
    let migrated = |r: Result<(), tower_redis_lock::backend::BackendError>| {
        support::or_exit("exactly_once", r.map_err(|e| e.to_string()))
    };
    let store = env_or("STORE", "postgres");
    let (layer, drain, store_name, pool): (
        IdempotencyLayer,
        Arc<dyn Backend>,
        String,
        Option<Pool>,
    ) = match store.as_str() {
        "postgres" => {
            let pool = support::or_exit("exactly_once", pool_from_env().await);
            let store = PostgresBackend::new(pool.clone());
            migrated(store.migrate().await);
            let name = "postgres (records in the handler's transaction)".to_owned();
            (
                IdempotencyLayer::new(store.clone(), parts),
                Arc::new(store),
                name,
                Some(pool),
            )
        }
        #[cfg(feature = "sqlx-postgres")]
        "sqlx" => {
            let pool = support::or_exit("exactly_once", sqlx_pg_from_env().await);
            let store = tower_redis_lock_sql::SqlxPostgresBackend::new(pool);
            migrated(store.migrate().await);
            let name = "sqlx postgres (records in the handler's transaction)".to_owned();
            (
                IdempotencyLayer::new(store.clone(), parts),
                Arc::new(store),
                name,
                None,
            )
        }
        #[cfg(feature = "sqlx-sqlite")]
        "sqlite" => {
            let pool = support::or_exit("exactly_once", sqlite_from_env().await);
            let store = tower_redis_lock_sql::SqliteBackend::new(pool);
            migrated(store.migrate().await);
            let name = "sqlite (records in the handler's transaction)".to_owned();
            (
                IdempotencyLayer::new(store.clone(), parts),
                Arc::new(store),
                name,
                None,
            )
        }
        "redis" => {
            let pool = support::or_exit("exactly_once", pool_from_env().await);
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
                Some(pool),
            )
        }
        other => support::or_exit(
            "exactly_once",
            Err(format!(
                "STORE: `{other}`: expected `postgres`, `sqlx` (feature sqlx-postgres), \
                 `sqlite` (feature sqlx-sqlite) or `redis`"
            )),
        ),
    };
    let idempotency = layer.ttl(ttl).join_timeout(Duration::from_secs(5));
    let app = Router::new()
        .route("/payments", post(create_payment).layer(idempotency))
        .route("/stats", get(stats))
        .with_state(App {
            pool,
            executions: Arc::default(),
            provider,
        });

    let (listener, local) = support::bind("exactly_once", "127.0.0.1:3004").await;
    println!("exactly_once listening on http://{local} with the {store_name} store");
    support::serve("exactly_once", listener, app, drain).await;
}
