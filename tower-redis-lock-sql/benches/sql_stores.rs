//! The SQL stores against their targets: SQLite payments per second through
//! `IdempotencyLayer` + `SqliteBackend`, and how fast `sweep()` deletes
//! expired rows on sqlx-PostgreSQL and on SQLite. Prints one Markdown table
//! (the figures, the targets, met / not met) for BENCHMARKS.md.
//!
//! ```text
//! cargo bench -p tower-redis-lock-sql --features sqlx-sqlite,sqlx-postgres --bench sql_stores
//! SQL_BENCH_ROWS=10000 SQL_BENCH_SECS=60 cargo bench -p tower-redis-lock-sql --features sqlx-sqlite,sqlx-postgres --bench sql_stores
//! ```
//!
//! (`--features`: the bench needs `sqlx-sqlite` and `sqlx-postgres`;
//! `--all-features` does as well.)
//!
//! - **Payments** (SQLite in WAL, `synchronous = NORMAL`, a temporary file):
//!   an axum app whose handler inserts one row into `charges` in the
//!   request's transaction, over distinct keys. *Wait then write*: the
//!   handler waits 200 ms, then writes (300 payments, 30 clients; target
//!   ≥ 50 payments/s, the bound is 30 / 0.2 s = 150). *Write first*: the
//!   handler writes, then waits 200 ms (20 payments, 10 clients), holding
//!   SQLite's one write lock the whole time: a figure, no target.
//! - **Sweep**: `SQL_BENCH_ROWS` (default 50,000) expired rows put straight
//!   into the store's table, then `sweep()` until they are gone. Target: the
//!   sweep keeps up with ≥ 1,000 new keys/s (rows deleted per second).
//!   PostgreSQL on 127.0.0.1:5432 (user `postgres`, trust auth) in a
//!   database of the bench's own, dropped at the end, also on a panic.
//!
//! Bounded: a fixed number of payments and rows; every phase stops at
//! `SQL_BENCH_SECS` (default 120 s) and says so in the table. Exits
//! non-zero if a payment is not answered 200, a key is charged other than
//! once, or an expired row is left.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::Connection;
use tower::ServiceExt;
use tower_redis_lock::idempotency::IdempotencyKey;
use tower_redis_lock::key::{Header, RequestMethod};
use tower_redis_lock::IdempotencyLayer;
use tower_redis_lock_sql::{SqliteBackend, SqlxPostgresBackend, SqlxTransaction};

const PG_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const PG_HINT: &str = "this bench needs PostgreSQL on 127.0.0.1:5432 (user postgres, trust auth); \
     `.ci/run` starts it";

/// The handler's wait, either side of its write.
const WAIT: Duration = Duration::from_millis(200);
const PAYMENTS_TARGET: f64 = 50.0;
const SWEEP_TARGET: f64 = 1_000.0;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

fn main() {
    let rows = env_or("SQL_BENCH_ROWS", 50_000).max(1);
    let budget = Duration::from_secs(env_or("SQL_BENCH_SECS", 120).max(1));
    // Two workers, as the machines this crate targets for SQLite.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = std::env::temp_dir().join(format!("trl-sql-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let report = rt.block_on(run(&dir, rows, budget));
    let _ = std::fs::remove_dir_all(&dir);
    println!();
    println!("| what | figure | target |");
    println!("|---|---:|---|");
    let mut failed = false;
    for line in &report {
        println!("| {} | {} | {} |", line.what, line.figure, line.target);
        failed |= line.failed;
    }
    if failed {
        eprintln!("sql_stores: a check failed (see above)");
        std::process::exit(1);
    }
}

struct Line {
    what: String,
    figure: String,
    target: String,
    /// A functional check failed (not a missed target).
    failed: bool,
}

/// `n` with a comma every three digits, as BENCHMARKS.md writes figures.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "not met"
    }
}

async fn run(dir: &std::path::Path, rows: u64, budget: Duration) -> Vec<Line> {
    let mut report = Vec::new();

    let wait_then_write = payments(dir, false, 300, 30, budget).await;
    let bound = 30.0 / WAIT.as_secs_f64();
    report.push(Line {
        what: format!(
            "SQLite, distinct keys, handler waits 200 ms then writes its row, 30 clients, {} payments",
            wait_then_write.answered
        ),
        figure: format!(
            "{:.0} payments/s (bound: 30 / 0.2 s = {bound:.0}){}",
            wait_then_write.rate(),
            wait_then_write.cut_short()
        ),
        target: format!(
            "≥ {PAYMENTS_TARGET:.0} payments/s: {}",
            verdict(wait_then_write.complete() && wait_then_write.rate() >= PAYMENTS_TARGET)
        ),
        failed: wait_then_write.failed(),
    });

    let write_first = payments(dir, true, 20, 10, budget).await;
    report.push(Line {
        what: format!(
            "SQLite, distinct keys, handler writes then waits 200 ms, 10 clients, {} payments",
            write_first.answered
        ),
        figure: format!(
            "{:.1} payments/s (the write lock is held from the first write to the commit){}",
            write_first.rate(),
            write_first.cut_short()
        ),
        target: "figure only".into(),
        failed: write_first.failed(),
    });

    let pg = Pg::create().await;
    let pg_sweep = pg_sweep(&pg, rows, budget).await;
    drop(pg);
    report.push(sweep_line("sqlx PostgreSQL", &pg_sweep));

    let lite_sweep = sqlite_sweep(dir, rows, budget).await;
    report.push(sweep_line("SQLite", &lite_sweep));

    report
}

// ---------------------------------------------------------------- payments

struct Payments {
    asked: usize,
    /// Answered 200.
    answered: usize,
    /// Answered otherwise (each printed as it came).
    errors: usize,
    /// Rows in `charges` at the end, and distinct keys among them.
    charged: i64,
    distinct: i64,
    secs: f64,
}

impl Payments {
    fn rate(&self) -> f64 {
        self.answered as f64 / self.secs
    }
    fn complete(&self) -> bool {
        self.answered == self.asked
    }
    fn cut_short(&self) -> String {
        if self.complete() || self.errors > 0 {
            String::new()
        } else {
            format!(
                "; stopped at the time bound after {} of {}",
                self.answered, self.asked
            )
        }
    }
    /// A payment not answered 200, or a key charged other than once.
    fn failed(&self) -> bool {
        self.errors > 0 || self.charged != self.answered as i64 || self.distinct != self.charged
    }
}

async fn sqlite_pool(path: &std::path::Path) -> sqlx::SqlitePool {
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(5));
    SqlitePoolOptions::new()
        .max_connections(32)
        .connect_with(options)
        .await
        .expect("SQLite pool")
}

async fn charge(tx: &SqlxTransaction<sqlx::Sqlite>, key: &IdempotencyKey) {
    let mut c = tx.conn().await.expect("the request's transaction");
    sqlx::query("INSERT INTO charges VALUES (?1)")
        .bind(key.as_str())
        .execute(&mut *c)
        .await
        .expect("insert the charge");
}

async fn wait_then_write(tx: SqlxTransaction<sqlx::Sqlite>, key: IdempotencyKey) -> &'static str {
    tokio::time::sleep(WAIT).await;
    charge(&tx, &key).await;
    "charged"
}

async fn write_then_wait(tx: SqlxTransaction<sqlx::Sqlite>, key: IdempotencyKey) -> &'static str {
    charge(&tx, &key).await;
    tokio::time::sleep(WAIT).await;
    "charged"
}

async fn payments(
    dir: &std::path::Path,
    write_first: bool,
    n: usize,
    clients: usize,
    budget: Duration,
) -> Payments {
    let name = if write_first {
        "write-first"
    } else {
        "wait-then-write"
    };
    let pool = sqlite_pool(&dir.join(format!("{name}.db"))).await;
    let store = SqliteBackend::new(pool.clone());
    store.migrate().await.expect("migrate");
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS charges (key TEXT NOT NULL)")
        .execute(&pool)
        .await
        .expect("charges table");
    let layer = IdempotencyLayer::new(store, (RequestMethod, Header::trusted_identity("x-user")))
        .join_timeout(Duration::from_secs(5))
        .deadline(Duration::from_secs(10));
    let route = if write_first {
        post(write_then_wait)
    } else {
        post(wait_then_write)
    };
    let app = Router::new().route("/pay", route.layer(layer));

    let began = Instant::now();
    let stop = began + budget;
    let next = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (app, next, answered, errors) =
            (app.clone(), next.clone(), answered.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            // At most `n` requests in all, none started past the bound.
            while Instant::now() < stop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    return;
                }
                let req = Request::post("/pay")
                    .header("x-user", "u1")
                    .header("idempotency-key", format!("{name}-{i}"))
                    .body(axum::body::Body::from("{}"))
                    .expect("request");
                let res = app.clone().oneshot(req).await.expect("infallible");
                let status = res.status();
                let body = axum::body::to_bytes(res.into_body(), 1 << 20)
                    .await
                    .unwrap_or_default();
                if status == StatusCode::OK {
                    answered.fetch_add(1, Ordering::SeqCst);
                } else {
                    errors.fetch_add(1, Ordering::SeqCst);
                    eprintln!(
                        "payment {name}-{i}: {status} {}",
                        String::from_utf8_lossy(&body)
                    );
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    let secs = began.elapsed().as_secs_f64();
    let (charged, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT key) FROM charges")
            .fetch_one(&pool)
            .await
            .expect("count charges");
    pool.close().await;
    let p = Payments {
        asked: n,
        answered: answered.load(Ordering::SeqCst),
        errors: errors.load(Ordering::SeqCst),
        charged,
        distinct,
        secs,
    };
    if p.charged != p.answered as i64 || p.distinct != p.charged {
        eprintln!(
            "{name}: {} answered 200, {} charges over {} keys (each should be charged once)",
            p.answered, p.charged, p.distinct
        );
    }
    p
}

// ------------------------------------------------------------------- sweep

struct Sweep {
    rows: u64,
    deleted: u64,
    /// Expired rows left in the table at the end.
    left: i64,
    secs: f64,
    cut_short: bool,
}

fn sweep_line(store: &str, s: &Sweep) -> Line {
    let rate = s.deleted as f64 / s.secs;
    let cut = if s.cut_short {
        format!(
            "; stopped at the time bound after {} of {} rows",
            s.deleted, s.rows
        )
    } else {
        String::new()
    };
    Line {
        what: format!("sweep, {store}, {} expired rows", thousands(s.rows)),
        figure: format!("{:.2} s, ≈ {} rows/s{cut}", s.secs, thousands(rate as u64)),
        target: format!(
            "≥ {} new keys/s: {}",
            thousands(SWEEP_TARGET as u64),
            verdict(!s.cut_short && rate >= SWEEP_TARGET)
        ),
        failed: !s.cut_short && s.left != 0,
    }
}

/// `sweep()` until `rows` rows are deleted: at most one call per batch of
/// 1,000 and a few more, none started past the bound.
async fn sweep_until<F, Fut>(rows: u64, budget: Duration, mut sweep: F) -> (u64, f64, bool)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    let began = Instant::now();
    let mut deleted = 0;
    let mut calls = rows / 1_000 + 10;
    while deleted < rows && calls > 0 && began.elapsed() < budget {
        calls -= 1;
        let d = sweep().await;
        if d == 0 {
            eprintln!("sweep: a call deleted nothing with {deleted} of {rows} rows deleted");
            break;
        }
        deleted += d;
    }
    let secs = began.elapsed().as_secs_f64();
    (deleted, secs, deleted < rows && began.elapsed() >= budget)
}

/// A PostgreSQL database of the bench's own, dropped with the guard.
struct Pg {
    name: String,
}

async fn admin() -> sqlx::PgConnection {
    sqlx::PgConnection::connect(PG_ADMIN_URL)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {PG_ADMIN_URL}: {e}\nHint: {PG_HINT}"))
}

impl Pg {
    async fn create() -> Self {
        let name = format!("trl_bench_{}", std::process::id());
        let mut admin = admin().await;
        for sql in [
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            format!("CREATE DATABASE {name}"),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
                .execute(&mut admin)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}\nHint: {PG_HINT}"));
        }
        Self { name }
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:5432/{}", self.name)
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        // On a thread of its own: Drop runs inside the bench's runtime.
        let name = self.name.clone();
        let dropped = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(async {
                    let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut admin().await)
                        .await
                        .map(|_| ())
                })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("sql_stores: could not drop database {}", self.name);
        }
    }
}

async fn pg_sweep(db: &Pg, rows: u64, budget: Duration) -> Sweep {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&db.url())
        .await
        .unwrap_or_else(|e| panic!("{}: {e}\nHint: {PG_HINT}", db.url()));
    let store = SqlxPostgresBackend::new(pool.clone());
    store.migrate().await.expect("migrate");
    // The table's columns are crate-private (`src/backend/sql/pg_sql.rs`,
    // `SCHEMA`): entry, scope, token, fingerprint, state (1 = recorded),
    // record, expires_at. Plain SQL here fills it with expired records.
    sqlx::query(
        "INSERT INTO trl_idempotency \
         SELECT decode(lpad(to_hex(g), 16, '0'), 'hex'), '\\x00', '\\x00', '\\x00', 1, '\\x00', \
                now() - interval '1 minute' \
         FROM generate_series(1, $1) g",
    )
    .bind(rows as i64)
    .execute(&pool)
    .await
    .expect("insert expired rows");
    let (deleted, secs, cut_short) = sweep_until(rows, budget, || async {
        store.sweep().await.expect("sweep")
    })
    .await;
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trl_idempotency WHERE expires_at < now()")
            .fetch_one(&pool)
            .await
            .expect("count rows");
    pool.close().await;
    Sweep {
        rows,
        deleted,
        left,
        secs,
        cut_short,
    }
}

async fn sqlite_sweep(dir: &std::path::Path, rows: u64, budget: Duration) -> Sweep {
    let pool = sqlite_pool(&dir.join("sweep.db")).await;
    let store = SqliteBackend::new(pool.clone());
    store.migrate().await.expect("migrate");
    // The table's columns are crate-private (`src/backend/sql/sqlite.rs`,
    // `SCHEMA`; `expires_at` in Unix milliseconds). Plain SQL here fills it
    // with records that expired in 1970.
    sqlx::query(
        "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < ?1) \
         INSERT INTO trl_idempotency \
         SELECT CAST(i AS BLOB), x'00', x'00', x'00', 1, x'00', 1 FROM g",
    )
    .bind(rows as i64)
    .execute(&pool)
    .await
    .expect("insert expired rows");
    let (deleted, secs, cut_short) = sweep_until(rows, budget, || async {
        store.sweep().await.expect("sweep")
    })
    .await;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM trl_idempotency WHERE expires_at = 1")
        .fetch_one(&pool)
        .await
        .expect("count rows");
    pool.close().await;
    Sweep {
        rows,
        deleted,
        left,
        secs,
        cut_short,
    }
}
