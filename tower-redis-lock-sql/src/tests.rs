//! The SQL stores on real databases: the shared store suite, then what the
//! application's transaction keeps (its isolation, its lock waits), joins
//! under SERIALIZABLE, a serialization failure at commit, and a handler
//! that ends its own transaction. PostgreSQL on 127.0.0.1:5432 (a database
//! per test), SQLite in a temporary file.

#![cfg(feature = "sqlx-postgres")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;

use tower_redis_lock::key::{Header, RequestMethod};
use tower_redis_lock::IdempotencyLayer;

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
use crate::SqliteBackend;
use crate::SqlxPostgresBackend;
use crate::SqlxTransaction;

async fn charges(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The layer of these tests. Its deadline is seconds, not the default
/// 200 ms: a fresh pool's first claim (connect, then each statement
/// prepared once) took longer than that on a machine busy with the other
/// tests' `CREATE DATABASE`s, and answered 503 where a test asked about the
/// protocol, not the deadline.
fn layer<S: tower_redis_lock::backend::IdempotencyBackend>(store: S) -> IdempotencyLayer {
    IdempotencyLayer::new(store, (RequestMethod, Header::trusted_identity("x-user")))
        .join_timeout(Duration::from_secs(5))
        .deadline(Duration::from_secs(5))
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

/// `attempts` requests with `key`, each answered the key's final 500
/// `transaction-ended`.
async fn answered_final(app: &Router, key: &str, attempts: usize) {
    for attempt in 0..attempts {
        let (status, body) = send(app, key).await;
        assert_eq!(
            status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "attempt {attempt}: {body}"
        );
        assert!(
            body.contains("transaction-ended"),
            "attempt {attempt}: {body}"
        );
    }
}

#[tokio::test]
async fn the_sqlx_postgres_store_passes_the_store_suite() {
    let db = Pg::create(&[]).await;
    let (store, _pool) = db.store().await;
    tower_redis_lock::backend::Suite::idempotency_backend(&store).await;
}

#[tokio::test]
async fn drain_waits_for_the_open_claims_of_the_sqlx_postgres_store() {
    let db = Pg::create(&[]).await;
    let (store, _pool) = db.store().await;
    crate::drain_checks::drain_waits_for_open_claims(&store).await;
}

#[tokio::test]
async fn rows_a_co_tenant_writes_are_untrusted_by_the_sqlx_postgres_store() {
    let db = Pg::create(&[]).await;
    let (store, pool) = db.store().await;
    crate::untrusted_rows::co_tenant_rows_are_untrusted(&store, |k, state| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO trl_idempotency VALUES \
                 ($1, $2, '\\x00', 'fp', $3, NULL, now() + interval '1 hour')",
            )
            .bind(&k.entry()[..])
            .bind(&k.scope()[..])
            .bind(state)
            .execute(&pool)
            .await
            .unwrap();
        }
    })
    .await;
}

/// A PostgreSQL client as a test's handler uses it: each test body below
/// runs once per adapter (`per_adapter!`).
trait PgClient: Send + Sync + 'static {
    type Store: tower_redis_lock::backend::IdempotencyBackend + Clone;
    /// The handler's transaction extractor.
    type Tx: axum::extract::FromRequestParts<()> + Send + Sync + 'static;
    /// A migrated store on a pool of its own (one "instance").
    fn store(db: &Pg) -> impl std::future::Future<Output = Self::Store> + Send;
    fn lock_wait(store: Self::Store, wait: Duration) -> Self::Store;
    fn isolation(store: Self::Store, level: crate::Isolation) -> Self::Store;
    fn sweep(store: &Self::Store) -> impl std::future::Future<Output = u64> + Send;
    /// `sql` as one simple query (`;`-separated statements) in the
    /// request's transaction.
    fn batch(tx: &Self::Tx, sql: &str) -> impl std::future::Future<Output = ()> + Send;
    /// The first column of the first row of `sql`, a text.
    fn text(tx: &Self::Tx, sql: &str) -> impl std::future::Future<Output = String> + Send;
    /// `sql` as one simple query in the request's transaction, which must
    /// fail (the handler goes on).
    fn fails(tx: &Self::Tx, sql: &str) -> impl std::future::Future<Output = ()> + Send;
    /// Ask for the connection a second time while holding a guard, in the
    /// same task: the error, or `None` when it did not answer in 10 s.
    fn again_while_held(tx: &Self::Tx) -> impl std::future::Future<Output = Option<String>> + Send;
}

/// What a second ask answered within 10 s, if it did.
async fn answered_within_10s<
    T,
    F: std::future::Future<Output = Result<T, tower_redis_lock::backend::BackendError>>,
>(
    ask: F,
) -> Option<String> {
    match tokio::time::timeout(Duration::from_secs(10), ask).await {
        Ok(Ok(_)) => Some("a second guard".to_owned()),
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => None,
    }
}

/// PostgreSQL through sqlx.
struct SqlxPg;

impl PgClient for SqlxPg {
    type Store = SqlxPostgresBackend;
    type Tx = SqlxTransaction<sqlx::Postgres>;
    async fn store(db: &Pg) -> Self::Store {
        db.store().await.0
    }
    fn lock_wait(store: Self::Store, wait: Duration) -> Self::Store {
        store.lock_wait(wait)
    }
    fn isolation(store: Self::Store, level: crate::Isolation) -> Self::Store {
        store.isolation(level)
    }
    async fn sweep(store: &Self::Store) -> u64 {
        store.sweep().await.unwrap()
    }
    async fn batch(tx: &Self::Tx, sql: &str) {
        let mut c = tx.conn().await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut *c)
            .await
            .unwrap();
    }
    async fn text(tx: &Self::Tx, sql: &str) -> String {
        let mut c = tx.conn().await.unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&mut *c)
            .await
            .unwrap()
    }
    async fn fails(tx: &Self::Tx, sql: &str) {
        let mut c = tx.conn().await.unwrap();
        let done = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut *c)
            .await;
        assert!(done.is_err(), "{sql} was meant to fail");
    }
    async fn again_while_held(tx: &Self::Tx) -> Option<String> {
        let _held = tx.conn().await.unwrap();
        answered_within_10s(tx.conn()).await
    }
}

/// PostgreSQL through tokio-postgres (deadpool-postgres).
#[cfg(feature = "postgres")]
struct TokioPg;

#[cfg(feature = "postgres")]
impl PgClient for TokioPg {
    type Store = crate::PostgresBackend;
    type Tx = crate::PgTransaction;
    async fn store(db: &Pg) -> Self::Store {
        db.store().await; // the tables
        let config: tokio_postgres::Config = db.url().parse().unwrap();
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        let pool = deadpool_postgres::Pool::builder(manager)
            .max_size(16)
            .build()
            .unwrap();
        let store = crate::PostgresBackend::new(pool);
        store.migrate().await.expect("migrate");
        store
    }
    fn lock_wait(store: Self::Store, wait: Duration) -> Self::Store {
        store.lock_wait(wait)
    }
    fn isolation(store: Self::Store, level: crate::Isolation) -> Self::Store {
        store.isolation(level)
    }
    async fn sweep(store: &Self::Store) -> u64 {
        store.sweep().await.unwrap()
    }
    async fn batch(tx: &Self::Tx, sql: &str) {
        tx.client().await.unwrap().batch_execute(sql).await.unwrap();
    }
    async fn text(tx: &Self::Tx, sql: &str) -> String {
        let db = tx.client().await.unwrap();
        db.query_one(sql, &[]).await.unwrap().get(0)
    }
    async fn again_while_held(tx: &Self::Tx) -> Option<String> {
        let _held = tx.client().await.unwrap();
        answered_within_10s(tx.client()).await
    }
    async fn fails(tx: &Self::Tx, sql: &str) {
        let done = tx.client().await.unwrap().batch_execute(sql).await;
        assert!(done.is_err(), "{sql} was meant to fail");
    }
}

/// One `#[tokio::test]` per adapter for each generic test body named.
macro_rules! per_adapter {
    ($($name:ident),* $(,)?) => {
        mod sqlx_pg {
            $(#[tokio::test]
            async fn $name() {
                super::$name::<super::SqlxPg>().await
            })*
        }
        #[cfg(feature = "postgres")]
        mod tokio_pg {
            $(#[tokio::test]
            async fn $name() {
                super::$name::<super::TokioPg>().await
            })*
        }
    };
}

/// A handler that asks for the transaction's connection again while it
/// holds a guard, in the same task, gets an error that says so (after
/// `SAME_TASK_WAIT`): before, it waited for itself for ever (its request never answered, its
/// key held for the life of the process, `drain` never done).
async fn asking_again_while_holding_the_connection_is_an_error<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::store(&db).await;
    async fn handler<C: PgClient>(tx: C::Tx) -> String {
        C::again_while_held(&tx)
            .await
            .unwrap_or_else(|| "hung".to_owned())
    }
    let app = Router::new().route("/pay", post(handler::<C>).layer(layer(store)));
    let (_, body) = send(&app, "twice").await;
    assert!(body.contains("already holds"), "{body}");
}

per_adapter!(
    asking_again_while_holding_the_connection_is_an_error,
    the_handler_runs_at_the_databases_isolation_and_lock_timeout,
    isolation_is_set_only_when_the_store_is_told,
    duplicates_in_flight_join_under_serializable,
    a_serialization_failure_at_commit_is_retryable_and_the_retry_charges_once,
    a_row_lock_held_elsewhere_waits_as_without_the_layer,
    a_handler_that_rolls_back_then_inserts_charges_once_across_retries,
    a_handler_that_commits_itself_gets_a_final_answer,
    a_charge_before_a_failed_transaction_of_the_handler_is_not_run_again,
    a_failed_statement_in_the_claims_transaction_frees_the_key,
    sweep_deletes_expired_rows_in_full_batches,
    the_longest_retention_and_lock_wait_work,
);

/// The longest settings a store takes: a retention of `Duration::MAX`
/// through the store's own API keeps the record, and a duplicate under a
/// 30-day lock wait joins the first request (PostgreSQL refused both, an
/// interval out of range and a `lock_timeout` past its 24.8-day maximum,
/// and they were answered as errors: 503).
async fn the_longest_retention_and_lock_wait_work<C: PgClient>() {
    let db = Pg::create(&[]).await;
    crate::untrusted_rows::the_longest_retention_keeps_the_record(&C::store(&db).await).await;

    // Two instances (the duplicate waits in the database, not in-process).
    let runs = Arc::new(AtomicUsize::new(0));
    let mut apps = Vec::new();
    for _ in 0..2 {
        let month = Duration::from_secs(30 * 24 * 3600);
        let store = C::lock_wait(C::store(&db).await, month);
        apps.push(
            Router::new()
                .route("/pay", post(slow_charge::<C>).layer(layer(store)))
                .layer(axum::Extension(runs.clone())),
        );
    }
    let first = tokio::spawn({
        let app = apps[0].clone();
        async move { send(&app, "long-wait").await }
    });
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let second = send(&apps[1], "long-wait").await;
    let first = first.await.unwrap();
    assert_eq!(first.0, StatusCode::OK, "{first:?}");
    assert_eq!(second, first, "the duplicate joined");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn the_handler_runs_at_the_databases_isolation_and_lock_timeout<C: PgClient>() {
    let db = Pg::create(&[
        "default_transaction_isolation = 'serializable'",
        "lock_timeout = '3s'",
    ])
    .await;
    let store = C::lock_wait(C::store(&db).await, Duration::from_millis(50));
    async fn show<C: PgClient>(tx: C::Tx) -> String {
        let iso = C::text(&tx, "SHOW transaction_isolation").await;
        let lt = C::text(&tx, "SHOW lock_timeout").await;
        format!("{iso} {lt}")
    }
    let app = Router::new().route("/pay", post(show::<C>).layer(layer(store)));
    assert_eq!(
        send(&app, "iso").await,
        (StatusCode::OK, "serializable 3s".into())
    );
}

async fn isolation_is_set_only_when_the_store_is_told<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::isolation(C::store(&db).await, crate::Isolation::RepeatableRead);
    async fn show<C: PgClient>(tx: C::Tx) -> String {
        C::text(&tx, "SHOW transaction_isolation").await
    }
    let app = Router::new().route("/pay", post(show::<C>).layer(layer(store)));
    assert_eq!(send(&app, "iso").await.1, "repeatable read");
}

/// A charge that takes a while: duplicates arrive while it runs.
async fn slow_charge<C: PgClient>(
    axum::Extension(runs): axum::Extension<Arc<AtomicUsize>>,
    tx: C::Tx,
    key: tower_redis_lock::idempotency::IdempotencyKey,
) -> String {
    let n = runs.fetch_add(1, Ordering::SeqCst);
    // Read-check-write, as a balance check would.
    C::text(&tx, "SELECT count(*)::text FROM charges").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    C::batch(
        &tx,
        &format!("INSERT INTO charges VALUES ('{}')", key.as_str()),
    )
    .await;
    format!("charged {} run {n}", key.as_str())
}

async fn duplicates_in_flight_join_under_serializable<C: PgClient>() {
    let db = Pg::create(&["default_transaction_isolation = 'serializable'"]).await;
    let runs = Arc::new(AtomicUsize::new(0));
    // Two instances on one database.
    let mut apps = Vec::new();
    for _ in 0..2 {
        let store = C::store(&db).await;
        apps.push(
            Router::new()
                .route("/pay", post(slow_charge::<C>).layer(layer(store)))
                .layer(axum::Extension(runs.clone())),
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

async fn a_serialization_failure_at_commit_is_retryable_and_the_retry_charges_once<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::store(&db).await;
    let pool = db.pool(2).await;
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
    async fn charge<C: PgClient>(tx: C::Tx) -> &'static str {
        C::batch(&tx, "INSERT INTO charges VALUES ('k')").await;
        "charged"
    }
    let app = Router::new().route("/pay", post(charge::<C>).layer(layer(store)));
    let res = app.clone().oneshot(pay_request("ser")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(res.headers().contains_key(http::header::RETRY_AFTER));
    assert_eq!(charges(&pool).await, 0, "nothing kept");
    assert_eq!(send(&app, "ser").await, (StatusCode::OK, "charged".into()));
    assert_eq!(send(&app, "ser").await, (StatusCode::OK, "charged".into()));
    assert_eq!(charges(&pool).await, 1);
}

async fn a_row_lock_held_elsewhere_waits_as_without_the_layer<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::lock_wait(C::store(&db).await, Duration::from_millis(50));
    let pool = db.pool(2).await;
    async fn debit<C: PgClient>(tx: C::Tx) -> String {
        C::batch(
            &tx,
            "UPDATE accounts SET balance = balance - 5 WHERE id = 1",
        )
        .await;
        C::text(&tx, "SELECT balance::text FROM accounts WHERE id = 1").await
    }
    let app = Router::new().route("/pay", post(debit::<C>).layer(layer(store)));
    // Another transaction holds the account's row for 600 ms (12 times the
    // store's 50 ms) and sets the balance to 1000.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("UPDATE accounts SET balance = 1000 WHERE id = 1")
        .execute(&mut *holder)
        .await
        .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        holder.commit().await.unwrap();
    });
    let (status, balance) = send(&app, "lock").await;
    release.await.unwrap();
    // The debit ran on the holder's committed 1000: it waited for the row
    // lock (the store's 50 ms would have failed it), not a timed check.
    assert_eq!(
        (status, balance.as_str()),
        (StatusCode::OK, "995"),
        "the update waited for the holder"
    );
}

/// The finding: a handler that rolls the transaction back and then
/// charges on its own (autocommit).
async fn rollback_then_insert<C: PgClient>(
    tx: C::Tx,
    key: tower_redis_lock::idempotency::IdempotencyKey,
) -> &'static str {
    C::batch(&tx, "ROLLBACK").await;
    C::batch(
        &tx,
        &format!("INSERT INTO charges VALUES ('{}')", key.as_str()),
    )
    .await;
    "charged"
}

async fn a_handler_that_rolls_back_then_inserts_charges_once_across_retries<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::store(&db).await;
    let pool = db.pool(2).await;
    let app = Router::new().route("/pay", post(rollback_then_insert::<C>).layer(layer(store)));
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

async fn a_handler_that_commits_itself_gets_a_final_answer<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::store(&db).await;
    let pool = db.pool(2).await;
    async fn commit_then_insert<C: PgClient>(tx: C::Tx) -> &'static str {
        C::batch(&tx, "INSERT INTO charges VALUES ('a')").await;
        C::batch(&tx, "COMMIT; BEGIN").await;
        C::batch(&tx, "INSERT INTO charges VALUES ('b')").await;
        "charged"
    }
    let app = Router::new().route("/pay", post(commit_then_insert::<C>).layer(layer(store)));
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

/// A database of its own, and `/pay` answered by `handler` under its
/// store's layer, with a call counter and `status` for the handler (as
/// extensions): the database (dropped with the test), a pool on it, the
/// counter and the app.
async fn pay_app<C: PgClient>(
    handler: axum::routing::MethodRouter,
    status: StatusCode,
) -> (Pg, sqlx::PgPool, Arc<AtomicUsize>, Router) {
    let db = Pg::create(&[]).await;
    let store = C::store(&db).await;
    let pool = db.pool(2).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/pay", handler.layer(layer(store)))
        .layer(axum::Extension(calls.clone()))
        .layer(axum::Extension(status));
    (db, pool, calls, app)
}

/// Rolls the claim's transaction back, charges on its own (autocommit),
/// opens a transaction of its own in which a statement fails, then answers
/// `status`: the store finds a failed transaction at the end, but not the
/// one its claim opened.
async fn charge_then_fail_in_a_new_transaction<C: PgClient>(
    axum::Extension(calls): axum::Extension<Arc<AtomicUsize>>,
    axum::Extension(status): axum::Extension<StatusCode>,
    tx: C::Tx,
) -> StatusCode {
    calls.fetch_add(1, Ordering::SeqCst);
    C::batch(&tx, "ROLLBACK").await;
    C::batch(&tx, "INSERT INTO charges VALUES ('c')").await;
    C::batch(&tx, "BEGIN").await;
    C::fails(&tx, "SELECT 1/0").await;
    status
}

async fn a_charge_before_a_failed_transaction_of_the_handler_is_not_run_again<C: PgClient>() {
    // 200: the record is written into the failed transaction; 500: the
    // claim is abandoned. Either way the charge committed.
    for status in [StatusCode::OK, StatusCode::INTERNAL_SERVER_ERROR] {
        let handler = post(charge_then_fail_in_a_new_transaction::<C>);
        let (_db, pool, calls, app) = pay_app::<C>(handler, status).await;
        answered_final(&app, "fail-after", 4).await;
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "{status}: the handler ran once"
        );
        assert_eq!(charges(&pool).await, 1, "{status}: charged once");
    }
}

/// Charges in the claim's transaction; the first time, a statement then
/// fails in it and the handler answers `status` all the same.
async fn charge_then_fail_the_first_time<C: PgClient>(
    axum::Extension(calls): axum::Extension<Arc<AtomicUsize>>,
    axum::Extension(status): axum::Extension<StatusCode>,
    tx: C::Tx,
) -> StatusCode {
    C::batch(&tx, "INSERT INTO charges VALUES ('c')").await;
    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
        C::fails(&tx, "SELECT 1/0").await;
        return status;
    }
    StatusCode::OK
}

async fn a_failed_statement_in_the_claims_transaction_frees_the_key<C: PgClient>() {
    for status in [StatusCode::OK, StatusCode::INTERNAL_SERVER_ERROR] {
        let handler = post(charge_then_fail_the_first_time::<C>);
        let (_db, pool, calls, app) = pay_app::<C>(handler, status).await;
        let (first, body) = send(&app, "fail-in").await;
        assert_ne!(first, StatusCode::OK, "{status}: {body}");
        assert!(!body.contains("transaction-ended"), "{status}: {body}");
        assert_eq!(charges(&pool).await, 0, "{status}: rolled back");
        let (again, body) = send(&app, "fail-in").await;
        assert_eq!(again, StatusCode::OK, "{status}: the retry ran: {body}");
        assert_eq!(calls.load(Ordering::SeqCst), 2, "{status}");
        assert_eq!(charges(&pool).await, 1, "{status}: charged once");
    }
}

async fn sweep_deletes_expired_rows_in_full_batches<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::store(&db).await;
    let pool = db.pool(2).await;
    // 5 full batches of expired rows, and live rows the sweep keeps. How
    // fast: `benches/sql_stores.rs`.
    let (n, live): (i64, i64) = (5_000, 100);
    sqlx::query(
        "INSERT INTO trl_idempotency SELECT decode(lpad(to_hex(g), 16, '0'), 'hex'), '\\x00', '\\x00', \
         '\\x00', 1, '\\x00', \
         CASE WHEN g <= $1 THEN now() - interval '1 minute' ELSE now() + interval '1 hour' END \
         FROM generate_series(1, $1 + $2) g",
    )
    .bind(n)
    .bind(live)
    .execute(&pool)
    .await
    .unwrap();
    let mut deleted = 0;
    for _ in 0..n / 1_000 + 1 {
        if deleted >= n as u64 {
            break;
        }
        let d = C::sweep(&store).await;
        assert!(d > 0, "a sweep with expired rows left deletes some");
        deleted += d;
    }
    assert_eq!(deleted, n as u64, "every expired row, nothing else");
    let (expired, kept): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE expires_at <= now()), \
                count(*) FILTER (WHERE expires_at > now()) FROM trl_idempotency",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((expired, kept), (0, live));
    assert_eq!(C::sweep(&store).await, 0, "nothing left to sweep");
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

    /// Where [`temp_db`] keeps the database `name`.
    pub(super) fn path_of(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("trl-sqlite-{}", std::process::id()));
        dir.join(format!("{name}.db"))
    }

    pub(super) fn temp_db(name: &str) -> std::path::PathBuf {
        let path = path_of(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
        path
    }

    pub(super) async fn store(name: &str) -> (SqliteBackend, sqlx::SqlitePool) {
        let pool = pool(&temp_db(name)).await;
        let store = SqliteBackend::new(pool.clone());
        store.migrate().await.unwrap();
        sqlx::raw_sql("CREATE TABLE IF NOT EXISTS charges (key TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        (store, pool)
    }

    /// As on PostgreSQL: a second `conn()` while a guard is held in the
    /// same task is an error.
    #[tokio::test]
    async fn asking_again_while_holding_the_connection_is_an_error_on_sqlite() {
        let (store, _pool) = store("twice").await;
        async fn handler(tx: LiteTx) -> String {
            let _held = tx.conn().await.unwrap();
            answered_within_10s(tx.conn())
                .await
                .unwrap_or_else(|| "hung".to_owned())
        }
        let app = Router::new().route("/pay", post(handler).layer(layer(store)));
        let (_, body) = send(&app, "twice").await;
        assert!(body.contains("already holds"), "{body}");
    }

    /// Two futures of one task that each use the connection in turn
    /// (`join!`) still share it: the second waits for the first's guard.
    #[tokio::test]
    async fn two_futures_of_one_task_take_the_connection_in_turn() {
        let (store, pool) = store("joined-uses").await;
        async fn charge(tx: &LiteTx) {
            let mut c = tx.conn().await.unwrap();
            sqlx::raw_sql("INSERT INTO charges VALUES ('j')")
                .execute(&mut *c)
                .await
                .unwrap();
            tokio::task::yield_now().await;
        }
        async fn handler(tx: LiteTx) -> StatusCode {
            tokio::join!(charge(&tx), charge(&tx));
            StatusCode::CREATED
        }
        let app = Router::new().route("/pay", post(handler).layer(layer(store)));
        assert_eq!(send(&app, "joined").await.0, StatusCode::CREATED);
        assert_eq!(lite_charges(&pool).await, 2);
    }

    async fn lite_charges(pool: &sqlx::SqlitePool) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM charges")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    /// A `COMMIT` that fails after SQLite ended the transaction itself (a
    /// full disk, an I/O error; here a `ROLLBACK` sent before it) leaves
    /// sqlx counting a transaction: that connection is closed, not pooled
    /// (the pool's one connection came back still in a transaction, before,
    /// and the next claim's `BEGIN` would have been a savepoint in it).
    #[tokio::test]
    async fn a_connection_whose_commit_failed_is_not_pooled_again() {
        use crate::adapter::{Adapter, Committed};
        use crate::sqlite::SqlxSqlite;
        use sqlx::Connection;
        use sqlx_core::transaction::TransactionManager;
        let options = SqliteConnectOptions::new()
            .filename(temp_db("commit-failed"))
            .create_if_missing(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap();
        let mut conn = crate::sqlx_conn::SqlxConn::new(pool.acquire().await.unwrap());
        <sqlx::Sqlite as sqlx::Database>::TransactionManager::begin(conn.get(), None)
            .await
            .unwrap();
        sqlx::raw_sql("ROLLBACK").execute(conn.get()).await.unwrap();
        let committed = SqlxSqlite::commit(&mut conn).await.unwrap();
        assert!(matches!(committed, Committed::Refused));
        SqlxSqlite::release(conn);
        let next = pool.acquire().await.unwrap();
        assert!(!next.is_in_transaction(), "the pool's connection is clean");
    }

    #[tokio::test]
    async fn rows_a_co_tenant_writes_are_untrusted_by_the_sqlite_store() {
        let (store, pool) = store("co-tenant").await;
        crate::untrusted_rows::co_tenant_rows_are_untrusted(&store, |k, state| {
            let pool = pool.clone();
            async move { co_tenant_row(&pool, &k, i64::from(state), None).await }
        })
        .await;
    }

    /// A row a co-tenant wrote: token `\x00`, fingerprint `fp`, an hour to
    /// live.
    async fn co_tenant_row(
        pool: &sqlx::SqlitePool,
        k: &tower_redis_lock::backend::contract::EntryKey,
        state: i64,
        record: Option<&[u8]>,
    ) {
        let in_an_hour = crate::protocol::now_ms() + 3_600_000;
        sqlx::query("INSERT INTO trl_idempotency VALUES (?1, ?2, x'00', x'6670', ?3, ?4, ?5)")
            .bind(&k.entry()[..])
            .bind(&k.scope()[..])
            .bind(state)
            .bind(record)
            .bind(in_an_hour)
            .execute(pool)
            .await
            .unwrap();
    }

    /// SQLite keeps any integer in the state column: a co-tenant's state
    /// past a 16-bit one (65536, 65537) is a malformed row, not the state
    /// its low bits name (0 in flight, 1 done).
    #[tokio::test]
    async fn a_state_past_sixteen_bits_is_untrusted_by_the_sqlite_store() {
        use tower_redis_lock::backend::contract::Token;
        use tower_redis_lock::backend::IdempotencyBackend;
        let (store, pool) = store("co-tenant-wide").await;
        for state in [65_536i64, 65_537, -65_535] {
            let k = crate::untrusted_rows::entry("wide-state");
            co_tenant_row(&pool, &k, state, Some(b"\x00")).await;
            let got = store
                .claim(
                    &k,
                    &Token::generate(),
                    b"fp",
                    &tower_redis_lock::backend::ClaimTerms::new(
                        Duration::from_secs(10),
                        1_000,
                        1 << 30,
                    ),
                )
                .await;
            assert!(
                got.is_err(),
                "state {state}: an error, not an answer: {got:?}"
            );
        }
    }

    /// A retention as long as it gets (`Duration::MAX`, "keep it for
    /// ever") keeps the record: no overflow of its expiry (a panic, or an
    /// expiry wrapped into the past: the record born expired).
    #[tokio::test]
    async fn the_longest_retention_keeps_the_record_on_the_sqlite_store() {
        let (store, _pool) = store("long-retention").await;
        crate::untrusted_rows::the_longest_retention_keeps_the_record(&store).await;
    }

    #[tokio::test]
    async fn drain_waits_for_the_open_claims_of_the_sqlite_store() {
        let (store, _pool) = store("drain").await;
        crate::drain_checks::drain_waits_for_open_claims(&store).await;
    }

    #[tokio::test]
    async fn the_sqlite_store_passes_the_store_suite() {
        let (store, _pool) = store("suite").await;
        tower_redis_lock::backend::Suite::idempotency_backend(&store).await;
    }

    #[tokio::test]
    async fn a_handler_that_rolls_back_then_inserts_charges_once_on_sqlite() {
        let (store, pool) = store("rollback").await;
        async fn handler(
            tx: LiteTx,
            key: tower_redis_lock::idempotency::IdempotencyKey,
        ) -> &'static str {
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

    async fn concurrent_payments(write_first: bool) {
        let (store, pool) = store(if write_first { "tput-w" } else { "tput" }).await;
        async fn wait_then_write(
            tx: LiteTx,
            key: tower_redis_lock::idempotency::IdempotencyKey,
        ) -> &'static str {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut c = tx.conn().await.unwrap();
            sqlx::query("INSERT INTO charges VALUES (?1)")
                .bind(key.as_str())
                .execute(&mut *c)
                .await
                .unwrap();
            "charged"
        }
        async fn write_then_wait(
            tx: LiteTx,
            key: tower_redis_lock::idempotency::IdempotencyKey,
        ) -> &'static str {
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
        let (n, concurrency) = if write_first { (10, 5) } else { (60, 30) };
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
        let (charged, keys): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT key) FROM charges")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(
            (charged, keys),
            (n as i64, n as i64),
            "each key charged once"
        );
    }

    /// Concurrent payments over distinct keys, the handler's wait before or
    /// after its write: every one answered 200 and charged once. How many
    /// per second: `benches/sql_stores.rs`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_concurrent_payments_over_distinct_keys_are_each_charged_once() {
        concurrent_payments(false).await;
        concurrent_payments(true).await;
    }

    #[tokio::test]
    async fn sqlite_sweep_deletes_expired_rows_in_full_batches() {
        let (store, pool) = store("sweep").await;
        // 5 full batches of expired rows (`expires_at` 1 ms after the
        // epoch), and live rows an hour ahead the sweep keeps. How fast:
        // `benches/sql_stores.rs`.
        let (n, live): (i64, i64) = (5_000, 100);
        let ahead = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
            + 3_600_000;
        sqlx::query(
            "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < ?1 + ?2) \
             INSERT INTO trl_idempotency SELECT CAST(i AS BLOB), x'00', x'00', x'00', 1, x'00', \
             CASE WHEN i <= ?1 THEN 1 ELSE ?3 END FROM g",
        )
        .bind(n)
        .bind(live)
        .bind(ahead)
        .execute(&pool)
        .await
        .unwrap();
        let mut deleted = 0;
        for _ in 0..n / 1_000 + 1 {
            if deleted >= n as u64 {
                break;
            }
            let d = store.sweep().await.unwrap();
            assert!(d > 0, "a sweep with expired rows left deletes some");
            deleted += d;
        }
        assert_eq!(deleted, n as u64, "every expired row, nothing else");
        let (expired, kept): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE expires_at = 1), \
                    count(*) FILTER (WHERE expires_at = ?1) FROM trl_idempotency",
        )
        .bind(ahead)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((expired, kept), (0, live));
        assert_eq!(store.sweep().await.unwrap(), 0, "nothing left to sweep");
    }
}

mod ended;
