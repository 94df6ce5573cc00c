//! Ledger: account debits on PostgreSQL, kept right under lease expiry by
//! fencing tokens carried into the database.
//!
//! ```text
//! cargo run --example ledger                                        # in-memory lock, local PostgreSQL
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example ledger         # Redis
//! ADDR=127.0.0.1:3013 REDIS_URL=redis://127.0.0.1:6379 cargo run --example ledger  # a second instance
//! FENCING=0 cargo run --example ledger                              # without fencing, to see what goes wrong
//! ```
//!
//! - listens on `$ADDR` (default `127.0.0.1:3003`) and prints one line with
//!   the address and the backends; `DATABASE_URL` (default
//!   `postgres://postgres@127.0.0.1:5432/postgres`), `REDIS_URL` as in the
//!   quickstart (memory when unset), `LOCK_TTL_MS` (default 2000), `FENCING`
//!   (default on; `FENCING=0` turns it off);
//! - creates its tables if missing: `accounts (id, balance, fence)` and the
//!   journal `debits` (one row per applied debit: amount, balance before and
//!   after, fence);
//! - `PUT /accounts/{id}` with `{"balance": n}` creates or resets an account
//!   (the fence stays: it must never go down); `GET /accounts/{id}` answers
//!   `{"balance": n, "fence": f}`. Account ids are 1 to 64 characters of
//!   `A-Z a-z 0-9 _ -`;
//! - `POST /accounts/{id}/debit?delay_ms=N` with `{"amount": n}` is locked on
//!   method + route + the account id. With fencing, the handler first claims
//!   the row with its fence (`UPDATE accounts SET fence = $f WHERE id = $id
//!   AND fence < $f RETURNING balance`), waits `delay_ms` (default 0: the
//!   window a process pause can hit), then writes the new balance only
//!   `WHERE id = $id AND fence = $f`, with its journal row, in one
//!   statement. A handler whose fence is no longer the newest (its lease
//!   expired while it was paused and another instance took over) changes
//!   nothing and answers 409 problem+json "Lease lost". Without fencing the
//!   same handler reads and writes without the fence checks: a paused handler
//!   then overwrites a newer balance (a lost update). Insufficient funds: 422;
//!   success: 200 `{"balance": n}`;
//! - `GET /stats` answers `{"applied": N, "stale": M}`: debits written and
//!   debits refused for a lost lease, in this process;
//! - shuts down gracefully on SIGTERM or Ctrl-C.
//!
//! Try it:
//! ```text
//! curl -X PUT localhost:3003/accounts/alice -H 'content-type: application/json' -d '{"balance":100}'
//! curl -X POST 'localhost:3003/accounts/alice/debit?delay_ms=500' -H 'content-type: application/json' -d '{"amount":30}'
//! curl localhost:3003/accounts/alice
//! ```

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use tokio_postgres::{Client, NoTls, Statement};
use tower_redis_lock::key::{KeyWriter, MissingPart, RequestMethod, Route};
use tower_redis_lock::{Lease, RedisLockLayer};

const SCHEMA: &str = "
    BEGIN;
    -- Two instances starting at once must not race on CREATE TABLE.
    SELECT pg_advisory_xact_lock(7244105);
    CREATE TABLE IF NOT EXISTS accounts (
        id      text PRIMARY KEY,
        balance bigint NOT NULL,
        fence   bigint NOT NULL DEFAULT 0
    );
    CREATE TABLE IF NOT EXISTS debits (
        seq            bigserial PRIMARY KEY,
        account        text NOT NULL,
        amount         bigint NOT NULL,
        balance_before bigint NOT NULL,
        balance_after  bigint NOT NULL,
        fence          bigint
    );
    COMMIT;";

/// The prepared statements; `$1` is always the account id.
struct Sql {
    put: Statement,
    get: Statement,
    /// Fencing: take the row for fence `$2` before reading it.
    claim: Statement,
    /// No fencing: a plain read.
    read: Statement,
    /// Fencing: write only while the row still carries our fence `$3`.
    write_fenced: Statement,
    /// No fencing: write whatever happened meanwhile.
    write_plain: Statement,
}

impl Sql {
    async fn prepare(db: &Client) -> Result<Self, tokio_postgres::Error> {
        Ok(Self {
            put: db
                .prepare(
                    "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
                     ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance \
                     RETURNING balance, fence",
                )
                .await?,
            get: db
                .prepare("SELECT balance, fence FROM accounts WHERE id = $1")
                .await?,
            claim: db
                .prepare(
                    "UPDATE accounts SET fence = $2 WHERE id = $1 AND fence < $2 \
                     RETURNING balance",
                )
                .await?,
            read: db
                .prepare("SELECT balance FROM accounts WHERE id = $1")
                .await?,
            write_fenced: db
                .prepare(
                    "WITH w AS (UPDATE accounts SET balance = $2 \
                                WHERE id = $1 AND fence = $3 RETURNING balance) \
                     INSERT INTO debits (account, amount, balance_before, balance_after, fence) \
                     SELECT $1, $4, $5, balance, $3 FROM w RETURNING balance_after",
                )
                .await?,
            write_plain: db
                .prepare(
                    "WITH w AS (UPDATE accounts SET balance = $2 \
                                WHERE id = $1 RETURNING balance) \
                     INSERT INTO debits (account, amount, balance_before, balance_after) \
                     SELECT $1, $3, $4, balance FROM w RETURNING balance_after",
                )
                .await?,
        })
    }
}

#[derive(Clone)]
struct App {
    db: Arc<Client>,
    sql: Arc<Sql>,
    fencing: bool,
    applied: Arc<AtomicU64>,
    stale: Arc<AtomicU64>,
}

#[derive(Deserialize)]
struct Balance {
    balance: i64,
}

#[derive(Deserialize)]
struct Debit {
    amount: i64,
}

#[derive(Deserialize)]
struct DebitParams {
    delay_ms: Option<u64>,
}

fn db_error(e: tokio_postgres::Error) -> Response {
    support::problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "Database error",
        e.to_string(),
    )
}

fn not_found(id: &str) -> Response {
    support::problem(
        StatusCode::NOT_FOUND,
        "No such account",
        format!("account {id} does not exist"),
    )
}

fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Key part: the account id, the second segment of `/accounts/{id}/debit`.
/// Ids are restricted to characters that need no percent-encoding, so one
/// account has one lock key (and so one fence counter).
fn account_id(parts: &http::request::Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
    match parts.uri.path().split('/').nth(2) {
        Some(id) if valid_id(id) => {
            key.push("account", id.as_bytes());
            Ok(())
        }
        _ => Err(MissingPart::bad_request(
            "account",
            "account ids are 1 to 64 characters of A-Z a-z 0-9 _ -",
        )),
    }
}

async fn put_account(
    State(app): State<App>,
    Path(id): Path<String>,
    Json(body): Json<Balance>,
) -> Response {
    if !valid_id(&id) {
        return support::problem(
            StatusCode::BAD_REQUEST,
            "Invalid account id",
            "account ids are 1 to 64 characters of A-Z a-z 0-9 _ -",
        );
    }
    match app.db.query_one(&app.sql.put, &[&id, &body.balance]).await {
        Ok(row) => Json(serde_json::json!({
            "balance": row.get::<_, i64>(0),
            "fence": row.get::<_, i64>(1),
        }))
        .into_response(),
        Err(e) => db_error(e),
    }
}

async fn get_account(State(app): State<App>, Path(id): Path<String>) -> Response {
    match app.db.query_opt(&app.sql.get, &[&id]).await {
        Ok(Some(row)) => Json(serde_json::json!({
            "balance": row.get::<_, i64>(0),
            "fence": row.get::<_, i64>(1),
        }))
        .into_response(),
        Ok(None) => not_found(&id),
        Err(e) => db_error(e),
    }
}

async fn debit(
    State(app): State<App>,
    Path(id): Path<String>,
    Query(params): Query<DebitParams>,
    lease: Lease,
    Json(debit): Json<Debit>,
) -> Response {
    if debit.amount <= 0 {
        return support::problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid amount",
            "the amount must be a positive integer",
        );
    }
    let fence = if app.fencing {
        match lease.fence().map(i64::try_from) {
            Some(Ok(fence)) => Some(fence),
            _ => {
                return support::problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "No fencing token",
                    "the lease carries no usable fence",
                )
            }
        }
    } else {
        None
    };

    // Read the balance; with fencing, claim the row first so that no older
    // holder can write after this point.
    let row = match fence {
        Some(f) => app.db.query_opt(&app.sql.claim, &[&id, &f]).await,
        None => app.db.query_opt(&app.sql.read, &[&id]).await,
    };
    let before: i64 = match row {
        Ok(Some(row)) => row.get(0),
        Ok(None) => {
            // No account, or (fencing) a newer fence already claimed it.
            return match app.db.query_opt(&app.sql.get, &[&id]).await {
                Ok(Some(row)) => lease_lost(&app, fence, row.get(1)),
                Ok(None) => not_found(&id),
                Err(e) => db_error(e),
            };
        }
        Err(e) => return db_error(e),
    };
    if before < debit.amount {
        return support::problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Insufficient funds",
            format!("balance {before} is below the amount {}", debit.amount),
        );
    }

    // The window a pause (GC stall, frozen VM, SIGSTOP) can hit.
    let delay = params.delay_ms.unwrap_or(0).min(60_000);
    tokio::time::sleep(Duration::from_millis(delay)).await;

    let after = before - debit.amount;
    let written = match fence {
        Some(f) => {
            app.db
                .query_opt(
                    &app.sql.write_fenced,
                    &[&id, &after, &f, &debit.amount, &before],
                )
                .await
        }
        None => {
            app.db
                .query_opt(&app.sql.write_plain, &[&id, &after, &debit.amount, &before])
                .await
        }
    };
    match written {
        Ok(Some(row)) => {
            app.applied.fetch_add(1, Ordering::SeqCst);
            Json(serde_json::json!({"balance": row.get::<_, i64>(0)})).into_response()
        }
        Ok(None) => match app.db.query_opt(&app.sql.get, &[&id]).await {
            Ok(Some(row)) => lease_lost(&app, fence, row.get(1)),
            Ok(None) => not_found(&id),
            Err(e) => db_error(e),
        },
        Err(e) => db_error(e),
    }
}

/// A newer fence holds the row: this handler's lease expired meanwhile.
fn lease_lost(app: &App, ours: Option<i64>, newest: i64) -> Response {
    app.stale.fetch_add(1, Ordering::SeqCst);
    support::problem(
        StatusCode::CONFLICT,
        "Lease lost",
        format!(
            "this request's fence {} is older than the account's fence {newest}: \
             another request took over, nothing was changed",
            ours.unwrap_or_default()
        ),
    )
}

async fn stats(State(app): State<App>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "applied": app.applied.load(Ordering::SeqCst),
        "stale": app.stale.load(Ordering::SeqCst),
    }))
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

fn settings() -> Result<(String, Duration, bool), String> {
    let database_url = env_or(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    let ttl_ms: u64 = env_or("LOCK_TTL_MS", "2000")
        .trim()
        .parse()
        .ok()
        .filter(|&ms| ms > 0)
        .ok_or("LOCK_TTL_MS must be a positive number of milliseconds")?;
    let fencing = match env_or("FENCING", "1").trim() {
        "1" | "on" | "true" => true,
        "0" | "off" | "false" => false,
        other => return Err(format!("FENCING must be 1 or 0, not {other:?}")),
    };
    Ok((database_url, Duration::from_millis(ttl_ms), fencing))
}

async fn connect_db(url: &str) -> Result<(Client, Sql), String> {
    let shown = support::redact(url);
    let (db, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(|e| format!("DATABASE_URL {shown}: {e}"))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("ledger: database connection: {e}");
        }
    });
    db.batch_execute(SCHEMA)
        .await
        .map_err(|e| format!("creating the tables: {e}"))?;
    let sql = Sql::prepare(&db)
        .await
        .map_err(|e| format!("preparing statements: {e}"))?;
    Ok((db, sql))
}

/// SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

#[tokio::main]
async fn main() {
    support::init_tracing();
    let (database_url, ttl, fencing) = support::or_exit("ledger", settings());
    let (backend, backend_name) = support::or_exit("ledger", support::backend_from_env().await);
    let (db, sql) = support::or_exit("ledger", connect_db(&database_url).await);

    let lock = RedisLockLayer::new(backend, (RequestMethod, Route, account_id))
        .ttl(ttl)
        .fencing(fencing);
    let app = App {
        db: Arc::new(db),
        sql: Arc::new(sql),
        fencing,
        applied: Arc::default(),
        stale: Arc::default(),
    };
    let router = Router::new()
        .route("/accounts/{id}", get(get_account).put(put_account))
        .route("/accounts/{id}/debit", post(debit).layer(lock))
        .route("/stats", get(stats))
        .with_state(app);

    let (listener, local) = support::bind("ledger", "127.0.0.1:3003").await;
    println!(
        "ledger listening on http://{local} with the {backend_name} lock backend and PostgreSQL ({}), \
         fencing {}, lease TTL {} ms",
        support::redact(&database_url),
        if fencing { "on" } else { "off" },
        ttl.as_millis()
    );
    if let Err(e) = axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await
    {
        eprintln!("ledger: server error: {e}");
        std::process::exit(1);
    }
}
