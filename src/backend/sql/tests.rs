//! The SQL stores on real databases: the shared store suite, then what the
//! application's transaction keeps (its isolation, its lock waits), joins
//! under SERIALIZABLE, a serialization failure at commit, and a handler
//! that ends its own transaction. PostgreSQL on 127.0.0.1:5432 (a database
//! per test), SQLite in a temporary file.

#![cfg(all(feature = "axum", feature = "sqlx-postgres"))]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;

use crate::key::{Header, RequestMethod};
use crate::IdempotencyLayer;

const ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const HINT: &str = "these tests need PostgreSQL on 127.0.0.1:5432 (user postgres, trust auth); \
     `.ci/run` starts it";

static DATABASES: AtomicUsize = AtomicUsize::new(0);

/// A PostgreSQL database of the test's own, dropped with the guard.
struct Pg {
    name: String,
}

async fn admin() -> sqlx::PgConnection {
    use sqlx::Connection;
    sqlx::PgConnection::connect(ADMIN_URL)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {ADMIN_URL}: {e}\nHint: {HINT}"))
}

impl Pg {
    /// A database whose own settings (`ALTER DATABASE .. SET`) are `settings`.
    async fn create(settings: &[&str]) -> Self {
        let n = DATABASES.fetch_add(1, Ordering::SeqCst);
        let name = format!("trl_sql_{}_{n}", std::process::id());
        let mut admin = admin().await;
        let mut sql = vec![
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            format!("CREATE DATABASE {name}"),
        ];
        for s in settings {
            sql.push(format!("ALTER DATABASE {name} SET {s}"));
        }
        for s in sql {
            sqlx::raw_sql(sqlx::AssertSqlSafe(s.clone()))
                .execute(&mut admin)
                .await
                .unwrap_or_else(|e| panic!("{s}: {e}\nHint: {HINT}"));
        }
        Self { name }
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:5432/{}", self.name)
    }

    async fn pool(&self, size: u32) -> sqlx::PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(size)
            .connect(&self.url())
            .await
            .unwrap()
    }

    /// A migrated store on a pool of its own (one "instance"), and a table
    /// `charges (key text, n int)`.
    async fn store(&self) -> (SqlxPostgresBackend, sqlx::PgPool) {
        let pool = self.pool(16).await;
        let store = SqlxPostgresBackend::new(pool.clone());
        store.migrate().await.expect("migrate");
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS charges (key text NOT NULL); \
             CREATE TABLE IF NOT EXISTS accounts (id int PRIMARY KEY, balance int NOT NULL); \
             INSERT INTO accounts VALUES (1, 100) ON CONFLICT DO NOTHING",
        )
        .execute(&pool)
        .await
        .unwrap();
        (store, pool)
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut admin().await)
                        .await;
                })
        })
        .join();
    }
}

#[cfg(feature = "sqlx-sqlite")]
use super::SqliteBackend;
use super::SqlxPostgresBackend;
use super::SqlxTransaction;

async fn charges(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn layer<S: crate::backend::ReplayBackend>(store: S) -> IdempotencyLayer {
    IdempotencyLayer::new(store, (RequestMethod, Header::trusted_identity("x-user")))
        .join_timeout(Duration::from_secs(5))
}

fn pay_request(key: &str) -> Request<axum::body::Body> {
    Request::post("/pay")
        .header("x-user", "u1")
        .header("idempotency-key", key)
        .body(axum::body::Body::from("{}"))
        .unwrap()
}

async fn send(app: &Router, key: &str) -> (StatusCode, String) {
    let res = app.clone().oneshot(pay_request(key)).await.unwrap();
    let status = res.status();
    let body = axum::body::to_bytes(res.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&body).into_owned())
}

type PgTx = SqlxTransaction<sqlx::Postgres>;

#[tokio::test]
async fn the_sqlx_postgres_store_passes_the_store_suite() {
    let db = Pg::create(&[]).await;
    let (store, _pool) = db.store().await;
    crate::backend::Suite::replay_backend(&store).await;
}

#[tokio::test]
async fn the_handler_runs_at_the_databases_isolation_and_lock_timeout() {
    let db = Pg::create(&[
        "default_transaction_isolation = 'serializable'",
        "lock_timeout = '3s'",
    ])
    .await;
    let (store, _pool) = db.store().await;
    let store = store.lock_wait(Duration::from_millis(50));
    async fn show(tx: PgTx) -> String {
        let mut c = tx.conn().await.unwrap();
        let iso: String = sqlx::query_scalar("SHOW transaction_isolation")
            .fetch_one(&mut *c)
            .await
            .unwrap();
        let lt: String = sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(&mut *c)
            .await
            .unwrap();
        format!("{iso} {lt}")
    }
    let app = Router::new().route("/pay", post(show).layer(layer(store)));
    assert_eq!(
        send(&app, "iso").await,
        (StatusCode::OK, "serializable 3s".into())
    );
}

#[tokio::test]
async fn isolation_is_set_only_when_the_store_is_told() {
    let db = Pg::create(&[]).await;
    let (store, _pool) = db.store().await;
    let store = store.isolation(super::Isolation::RepeatableRead);
    async fn show(tx: PgTx) -> String {
        let mut c = tx.conn().await.unwrap();
        sqlx::query_scalar("SHOW transaction_isolation")
            .fetch_one(&mut *c)
            .await
            .unwrap()
    }
    let app = Router::new().route("/pay", post(show).layer(layer(store)));
    assert_eq!(send(&app, "iso").await.1, "repeatable read");
}

/// A charge that takes a while: duplicates arrive while it runs.
async fn slow_charge(
    axum::extract::State(runs): axum::extract::State<Arc<AtomicUsize>>,
    tx: PgTx,
    key: crate::replay::IdempotencyKey,
) -> String {
    let n = runs.fetch_add(1, Ordering::SeqCst);
    let mut c = tx.conn().await.unwrap();
    // Read-check-write, as a balance check would.
    let _: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(&mut *c)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("INSERT INTO charges VALUES ($1)")
        .bind(key.as_str())
        .execute(&mut *c)
        .await
        .unwrap();
    format!("charged {} run {n}", key.as_str())
}

#[tokio::test]
async fn duplicates_in_flight_join_under_serializable() {
    let db = Pg::create(&["default_transaction_isolation = 'serializable'"]).await;
    let runs = Arc::new(AtomicUsize::new(0));
    // Two instances on one database.
    let mut apps = Vec::new();
    for _ in 0..2 {
        let (store, _) = db.store().await;
        apps.push(
            Router::new()
                .route("/pay", post(slow_charge).layer(layer(store)))
                .with_state(runs.clone()),
        );
    }
    let mut tasks = Vec::new();
    for i in 0..8 {
        let app = apps[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20 * i as u64)).await;
            send(&app, "join").await
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    let first = answers[0].clone();
    for a in &answers {
        assert_eq!(
            a, &first,
            "every duplicate gets the first answer: {answers:?}"
        );
    }
    assert_eq!(first.0, StatusCode::OK);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(charges(&db.pool(1).await).await, 1);
}

#[tokio::test]
async fn a_serialization_failure_at_commit_is_retryable_and_the_retry_charges_once() {
    let db = Pg::create(&[]).await;
    let (store, pool) = db.store().await;
    // A deferred trigger that fails the first commit that inserts a charge
    // with 40001 (a sequence: not rolled back with the transaction).
    sqlx::raw_sql(
        "CREATE SEQUENCE attempts; \
         CREATE FUNCTION fail_first() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF nextval('attempts') = 1 THEN \
           RAISE EXCEPTION 'forced serialization failure' USING ERRCODE = '40001'; \
         END IF; RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER fail_first AFTER INSERT ON charges \
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_first();",
    )
    .execute(&pool)
    .await
    .unwrap();
    async fn charge(tx: PgTx) -> &'static str {
        let mut c = tx.conn().await.unwrap();
        sqlx::query("INSERT INTO charges VALUES ('k')")
            .execute(&mut *c)
            .await
            .unwrap();
        "charged"
    }
    let app = Router::new().route("/pay", post(charge).layer(layer(store)));
    let res = app.clone().oneshot(pay_request("ser")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(res.headers().contains_key(http::header::RETRY_AFTER));
    assert_eq!(charges(&pool).await, 0, "nothing kept");
    assert_eq!(send(&app, "ser").await, (StatusCode::OK, "charged".into()));
    assert_eq!(send(&app, "ser").await, (StatusCode::OK, "charged".into()));
    assert_eq!(charges(&pool).await, 1);
}

#[tokio::test]
async fn a_row_lock_held_elsewhere_waits_as_without_the_layer() {
    let db = Pg::create(&[]).await;
    let (store, pool) = db.store().await;
    let store = store.lock_wait(Duration::from_millis(50));
    async fn debit(tx: PgTx) -> String {
        let mut c = tx.conn().await.unwrap();
        let began = std::time::Instant::now();
        sqlx::query("UPDATE accounts SET balance = balance - 5 WHERE id = 1")
            .execute(&mut *c)
            .await
            .unwrap();
        format!("{}", began.elapsed().as_millis())
    }
    let app = Router::new().route("/pay", post(debit).layer(layer(store)));
    // Another transaction holds the account's row for 600 ms.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM accounts WHERE id = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        holder.commit().await.unwrap();
    });
    let (status, waited) = send(&app, "lock").await;
    release.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{waited}");
    let waited: u128 = waited.parse().unwrap();
    assert!(
        waited >= 400,
        "the update waited for the holder ({waited} ms), past the store's 50 ms"
    );
}

/// The finding: a handler that rolls the transaction back and then
/// charges on its own (autocommit).
async fn rollback_then_insert(tx: PgTx, key: crate::replay::IdempotencyKey) -> &'static str {
    let mut c = tx.conn().await.unwrap();
    sqlx::raw_sql("ROLLBACK").execute(&mut *c).await.unwrap();
    sqlx::query("INSERT INTO charges VALUES ($1)")
        .bind(key.as_str())
        .execute(&mut *c)
        .await
        .unwrap();
    "charged"
}

#[tokio::test]
async fn a_handler_that_rolls_back_then_inserts_charges_once_across_retries() {
    let db = Pg::create(&[]).await;
    let (store, pool) = db.store().await;
    let app = Router::new().route("/pay", post(rollback_then_insert).layer(layer(store)));
    let (status, body) = send(&app, "rb").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert!(body.contains("transaction-ended"), "{body}");
    // Retries, sequential and concurrent.
    for _ in 0..20 {
        assert_eq!(send(&app, "rb").await, (status, body.clone()));
    }
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move { send(&app, "rb").await }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().0, status);
    }
    assert_eq!(charges(&pool).await, 1, "charged once");
}

#[tokio::test]
async fn a_handler_that_commits_itself_gets_a_final_answer() {
    let db = Pg::create(&[]).await;
    let (store, pool) = db.store().await;
    async fn commit_then_insert(tx: PgTx) -> &'static str {
        let mut c = tx.conn().await.unwrap();
        sqlx::query("INSERT INTO charges VALUES ('a')")
            .execute(&mut *c)
            .await
            .unwrap();
        sqlx::raw_sql("COMMIT; BEGIN")
            .execute(&mut *c)
            .await
            .unwrap();
        sqlx::query("INSERT INTO charges VALUES ('b')")
            .execute(&mut *c)
            .await
            .unwrap();
        "charged"
    }
    let app = Router::new().route("/pay", post(commit_then_insert).layer(layer(store)));
    let (status, body) = send(&app, "cm").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    for _ in 0..5 {
        assert_eq!(send(&app, "cm").await.0, status);
    }
    assert_eq!(
        charges(&pool).await,
        1,
        "the committed part once; the rest rolled back"
    );
}

#[tokio::test]
async fn sweep_deletes_expired_rows_in_full_batches() {
    let db = Pg::create(&[]).await;
    let (store, pool) = db.store().await;
    let n = 50_000;
    sqlx::query(
        "INSERT INTO trl_idempotency SELECT decode(lpad(to_hex(g), 16, '0'), 'hex'), '\\x00', '\\x00', \
         '\\x00', 1, '\\x00', now() - interval '1 minute' FROM generate_series(1, $1) g",
    )
    .bind(n)
    .execute(&pool)
    .await
    .unwrap();
    let began = std::time::Instant::now();
    let mut deleted = 0;
    while deleted < n as u64 {
        let d = store.sweep().await.unwrap();
        assert!(d > 0);
        deleted += d;
    }
    let secs = began.elapsed().as_secs_f64();
    eprintln!(
        "sweep (sqlx-postgres): {deleted} expired rows in {:.2} s = {:.0} rows/s",
        secs,
        deleted as f64 / secs
    );
    assert!(deleted as f64 / secs >= 1_000.0);
}

#[cfg(feature = "sqlx-sqlite")]
mod sqlite {
    use super::*;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

    type LiteTx = SqlxTransaction<sqlx::Sqlite>;

    pub(super) async fn pool(path: &std::path::Path) -> sqlx::SqlitePool {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5));
        SqlitePoolOptions::new()
            .max_connections(32)
            .connect_with(options)
            .await
            .unwrap()
    }

    pub(super) fn temp_db(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("trl-sqlite-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.db"));
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
        path
    }

    async fn store(name: &str) -> (SqliteBackend, sqlx::SqlitePool) {
        let pool = pool(&temp_db(name)).await;
        let store = SqliteBackend::new(pool.clone());
        store.migrate().await.unwrap();
        sqlx::raw_sql("CREATE TABLE IF NOT EXISTS charges (key TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        (store, pool)
    }

    async fn lite_charges(pool: &sqlx::SqlitePool) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM charges")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn the_sqlite_store_passes_the_store_suite() {
        let (store, _pool) = store("suite").await;
        crate::backend::Suite::replay_backend(&store).await;
    }

    #[tokio::test]
    async fn a_handler_that_rolls_back_then_inserts_charges_once_on_sqlite() {
        let (store, pool) = store("rollback").await;
        async fn handler(tx: LiteTx, key: crate::replay::IdempotencyKey) -> &'static str {
            let mut c = tx.conn().await.unwrap();
            sqlx::raw_sql("ROLLBACK").execute(&mut *c).await.unwrap();
            sqlx::query("INSERT INTO charges VALUES (?1)")
                .bind(key.as_str())
                .execute(&mut *c)
                .await
                .unwrap();
            "charged"
        }
        let app = Router::new().route("/pay", post(handler).layer(layer(store)));
        let (status, body) = send(&app, "rb").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
        assert!(body.contains("transaction-ended"), "{body}");
        for _ in 0..20 {
            assert_eq!(send(&app, "rb").await.0, status);
        }
        assert_eq!(lite_charges(&pool).await, 1);
    }

    async fn payments_per_second(write_first: bool) -> f64 {
        let (store, pool) = store(if write_first { "tput-w" } else { "tput" }).await;
        async fn wait_then_write(tx: LiteTx, key: crate::replay::IdempotencyKey) -> &'static str {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut c = tx.conn().await.unwrap();
            sqlx::query("INSERT INTO charges VALUES (?1)")
                .bind(key.as_str())
                .execute(&mut *c)
                .await
                .unwrap();
            "charged"
        }
        async fn write_then_wait(tx: LiteTx, key: crate::replay::IdempotencyKey) -> &'static str {
            let mut c = tx.conn().await.unwrap();
            sqlx::query("INSERT INTO charges VALUES (?1)")
                .bind(key.as_str())
                .execute(&mut *c)
                .await
                .unwrap();
            drop(c);
            tokio::time::sleep(Duration::from_millis(200)).await;
            "charged"
        }
        let route = match write_first {
            false => post(wait_then_write),
            true => post(write_then_wait),
        };
        let app = Router::new().route(
            "/pay",
            route.layer(layer(store).deadline(Duration::from_secs(10))),
        );
        let (n, concurrency) = if write_first { (20, 10) } else { (300, 30) };
        let began = std::time::Instant::now();
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..concurrency {
            let (app, next) = (app.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        return;
                    }
                    let (status, body) = send(&app, &format!("key-{i}")).await;
                    assert_eq!(status, StatusCode::OK, "{body}");
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let rate = n as f64 / began.elapsed().as_secs_f64();
        assert_eq!(lite_charges(&pool).await, n as i64);
        rate
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_throughput_over_distinct_keys() {
        let rate = payments_per_second(false).await;
        let write_first = payments_per_second(true).await;
        eprintln!(
            "sqlite: {rate:.0} payments/s (handler waits 200 ms, then writes; 30 clients); \
             {write_first:.1} payments/s (handler writes, then waits 200 ms; 10 clients)"
        );
        assert!(rate >= 50.0, "{rate:.0} payments/s");
    }

    #[tokio::test]
    async fn sqlite_sweep_deletes_expired_rows_in_full_batches() {
        let (store, pool) = store("sweep").await;
        let n: i64 = 50_000;
        sqlx::query(
            "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < ?1) \
             INSERT INTO trl_idempotency SELECT CAST(i AS BLOB), x'00', x'00', x'00', 1, x'00', 1 FROM g",
        )
        .bind(n)
        .execute(&pool)
        .await
        .unwrap();
        let began = std::time::Instant::now();
        let mut deleted = 0;
        while deleted < n as u64 {
            let d = store.sweep().await.unwrap();
            assert!(d > 0);
            deleted += d;
        }
        let secs = began.elapsed().as_secs_f64();
        eprintln!(
            "sweep (sqlite): {deleted} expired rows in {secs:.2} s = {:.0} rows/s",
            deleted as f64 / secs
        );
        assert!(deleted as f64 / secs >= 1_000.0);
    }
}

#[tokio::test]
async fn the_downstream_key_is_stable_per_scoped_key_and_differs_between_users() {
    async fn echo(key: crate::replay::IdempotencyKey) -> String {
        key.downstream().to_owned()
    }
    let app =
        |store: crate::MemoryBackend| Router::new().route("/pay", post(echo).layer(layer(store)));
    // Two instances (no shared records): the same request derives the same key.
    let (one, two) = (
        app(crate::MemoryBackend::new()),
        app(crate::MemoryBackend::new()),
    );
    let req = |user: &str| {
        Request::post("/pay")
            .header("x-user", user)
            .header("idempotency-key", "1")
            .body(axum::body::Body::from("{}"))
            .unwrap()
    };
    let body = |res: http::Response<axum::body::Body>| async move {
        String::from_utf8_lossy(
            &axum::body::to_bytes(res.into_body(), 1 << 16)
                .await
                .unwrap(),
        )
        .into_owned()
    };
    let a1 = body(one.clone().oneshot(req("alice")).await.unwrap()).await;
    let a2 = body(two.clone().oneshot(req("alice")).await.unwrap()).await;
    let b = body(one.clone().oneshot(req("bob")).await.unwrap()).await;
    assert!(a1.starts_with("trl-") && a1.len() == 36, "{a1}");
    assert_eq!(a1, a2, "stable across instances and retries");
    assert_ne!(a1, b, "two users' `Idempotency-Key: 1` differ downstream");
}
