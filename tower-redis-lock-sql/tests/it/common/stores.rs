//! The three SQL stores behind one face, so that one test body runs against
//! each (`PostgresBackend`, `SqlxPostgresBackend`, `SqliteBackend`): a
//! database of the test's own (PostgreSQL) or a file of its own (SQLite),
//! the store on a pool made as the test says, a connection beside it for
//! set-up and checks, the statements a handler runs on the request's
//! transaction whichever store opened it, and the answers summed up in a
//! line a failed assertion prints.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use http::Extensions;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::AssertSqlSafe;
use tower_redis_lock::key::{Header, RequestMethod, Route};
use tower_redis_lock::IdempotencyLayer;
use tower_redis_lock_sql::{
    PgTransaction, PostgresBackend, SqliteBackend, SqlxPostgresBackend, SqlxTransaction,
};

use super::pg::{pg_connect, Database};

use super::{free_port, replayed, req, Reply};

/// Which store a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `PostgresBackend` (tokio-postgres, deadpool).
    Postgres,
    /// `SqlxPostgresBackend`.
    Sqlx,
    /// `SqliteBackend`.
    Sqlite,
}

/// How the store's pool is made; the default is the clients' defaults.
#[derive(Clone, Debug, Default)]
pub struct Pools {
    /// PostgreSQL: connect through this address (a fault proxy) instead of
    /// 127.0.0.1:5432.
    pub via: Option<SocketAddr>,
    /// PostgreSQL: server settings of every pooled connection (`options=-c
    /// name=value`).
    pub settings: Vec<(&'static str, &'static str)>,
    /// SQLite: the pool's `busy_timeout` (sqlx's default, 5 s, otherwise).
    pub busy_timeout: Option<Duration>,
    /// PostgreSQL stores: `.commit_timeout(..)`.
    pub commit_timeout: Option<Duration>,
}

/// A store of one of the three kinds.
#[derive(Clone, Debug)]
pub enum Store {
    Postgres(PostgresBackend),
    Sqlx(SqlxPostgresBackend),
    Sqlite(SqliteBackend),
}

/// The idempotency key of every test route: method, route template and the
/// caller (`x-user-id`), like the example's.
pub fn layer(store: &Store) -> IdempotencyLayer {
    let key = (RequestMethod, Route, Header::trusted_identity("x-user-id"));
    match store {
        Store::Postgres(s) => IdempotencyLayer::new(s.clone(), key),
        Store::Sqlx(s) => IdempotencyLayer::new(s.clone(), key),
        Store::Sqlite(s) => IdempotencyLayer::new(s.clone(), key),
    }
}

/// A connection beside the store, for set-up and checks.
enum Side {
    Pg(tokio_postgres::Client),
    Lite(sqlx::SqlitePool),
}

/// A test's own database of one kind, and a connection to it.
pub struct Env {
    pub kind: Kind,
    /// The database this test created and drops (none when attached).
    _owned: Option<Database>,
    /// PostgreSQL: the database's name.
    name: String,
    file: Option<PathBuf>,
    side: Side,
}

fn sqlite_options(file: &std::path::Path) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(file)
        .create_if_missing(true)
}

impl Env {
    /// A fresh database (PostgreSQL) or file (SQLite).
    pub async fn new(kind: Kind) -> Self {
        match kind {
            Kind::Postgres | Kind::Sqlx => {
                let db = Database::create().await;
                let mut env = Self::attach(kind, db.name()).await;
                env._owned = Some(db);
                env
            }
            Kind::Sqlite => {
                let dir = std::env::temp_dir().join(format!("trl-sql-it-{}", std::process::id()));
                std::fs::create_dir_all(&dir).unwrap();
                let file = dir.join(format!("t-{}.db", free_port()));
                Self::attach(kind, &file.to_string_lossy()).await
            }
        }
    }

    /// Another process's database: `at` is the PostgreSQL database's name,
    /// or the SQLite file's path ([`Env::at`]). Not dropped by this one.
    pub async fn attach(kind: Kind, at: &str) -> Self {
        match kind {
            Kind::Postgres | Kind::Sqlx => {
                let url = format!("postgres://postgres@127.0.0.1:5432/{at}");
                Self {
                    kind,
                    _owned: None,
                    name: at.to_owned(),
                    file: None,
                    side: Side::Pg(pg_connect(&url).await),
                }
            }
            Kind::Sqlite => {
                let file = PathBuf::from(at);
                let side = SqlitePoolOptions::new()
                    .connect_with(sqlite_options(&file))
                    .await
                    .unwrap_or_else(|e| panic!("open {}: {e}", file.display()));
                Self {
                    kind,
                    _owned: None,
                    name: String::new(),
                    file: Some(file),
                    side: Side::Lite(side),
                }
            }
        }
    }

    /// Where the database is, for [`Env::attach`] in another process.
    pub fn at(&self) -> String {
        match self.kind {
            Kind::Sqlite => self.file().to_string_lossy().into_owned(),
            _ => self.name.clone(),
        }
    }

    /// The PostgreSQL database's URL (PostgreSQL kinds only).
    pub fn pg_url(&self) -> String {
        assert!(self.kind != Kind::Sqlite, "a PostgreSQL kind");
        format!("postgres://postgres@127.0.0.1:5432/{}", self.name)
    }

    /// The SQLite file (SQLite only).
    pub fn file(&self) -> &std::path::Path {
        self.file.as_deref().expect("the SQLite kind")
    }

    /// Run `sql` (one or more statements) outside any request.
    pub async fn batch(&self, sql: &str) {
        match &self.side {
            Side::Pg(c) => c
                .batch_execute(sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}")),
            Side::Lite(p) => {
                sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
                    .execute(p)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e}"));
            }
        }
    }

    /// The one integer `sql` selects.
    pub async fn count(&self, sql: &str) -> i64 {
        match &self.side {
            Side::Pg(c) => c
                .query_one(sql, &[])
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
                .get(0),
            Side::Lite(p) => sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
                .fetch_one(p)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}")),
        }
    }

    /// Rows in `charges`.
    pub async fn charges(&self) -> i64 {
        self.count("SELECT count(*) FROM charges").await
    }

    /// The store on a pool of its own, made as `pools` says, its table
    /// migrated.
    pub async fn store(&self, pools: &Pools) -> Store {
        let store = self.unmigrated_store(pools);
        let migrated = match &store {
            Store::Postgres(s) => s.migrate().await,
            Store::Sqlx(s) => s.migrate().await,
            Store::Sqlite(s) => s.migrate().await,
        };
        migrated.unwrap_or_else(|e| panic!("{:?}: migrate: {e}", self.kind));
        store
    }

    /// The store on a pool of its own, made as `pools` says, its table
    /// left as it is (no connection is made yet).
    pub fn unmigrated_store(&self, pools: &Pools) -> Store {
        match self.kind {
            Kind::Postgres => {
                let (host, port) = pg_addr(pools.via);
                let mut config = tokio_postgres::Config::new();
                config
                    .host(&host)
                    .port(port)
                    .user("postgres")
                    .dbname(&self.name);
                if !pools.settings.is_empty() {
                    let options: Vec<String> = pools
                        .settings
                        .iter()
                        .map(|(k, v)| format!("-c {k}={v}"))
                        .collect();
                    config.options(options.join(" "));
                }
                let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
                let pool = deadpool_postgres::Pool::builder(manager)
                    .max_size(8)
                    .build()
                    .unwrap();
                let mut store = PostgresBackend::new(pool);
                if let Some(t) = pools.commit_timeout {
                    store = store.commit_timeout(t);
                }
                Store::Postgres(store)
            }
            Kind::Sqlx => {
                let (host, port) = pg_addr(pools.via);
                let options = PgConnectOptions::new()
                    .host(&host)
                    .port(port)
                    .username("postgres")
                    .database(&self.name)
                    .options(pools.settings.iter().copied());
                let pool = PgPoolOptions::new()
                    .max_connections(8)
                    .connect_lazy_with(options);
                let mut store = SqlxPostgresBackend::new(pool);
                if let Some(t) = pools.commit_timeout {
                    store = store.commit_timeout(t);
                }
                Store::Sqlx(store)
            }
            Kind::Sqlite => {
                let mut options = sqlite_options(self.file());
                if let Some(t) = pools.busy_timeout {
                    options = options.busy_timeout(t);
                }
                let pool = SqlitePoolOptions::new().connect_lazy_with(options);
                Store::Sqlite(SqliteBackend::new(pool))
            }
        }
    }
}

fn pg_addr(via: Option<SocketAddr>) -> (String, u16) {
    match via {
        Some(a) => (a.ip().to_string(), a.port()),
        None => ("127.0.0.1".to_owned(), 5432),
    }
}

/// Run `sql` (statements without results) on the request's transaction,
/// whichever store opened it; the database's error as text.
pub async fn exec(ext: &Extensions, sql: &str) -> Result<(), String> {
    if let Some(tx) = ext.get::<PgTransaction>() {
        let db = tx.client().await.map_err(|e| e.to_string())?;
        return db.batch_execute(sql).await.map_err(|e| e.to_string());
    }
    if let Some(tx) = ext.get::<SqlxTransaction<sqlx::Postgres>>() {
        let mut conn = tx.conn().await.map_err(|e| e.to_string())?;
        return sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&mut *conn)
            .await
            .map(drop)
            .map_err(|e| e.to_string());
    }
    if let Some(tx) = ext.get::<SqlxTransaction<sqlx::Sqlite>>() {
        let mut conn = tx.conn().await.map_err(|e| e.to_string())?;
        return sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&mut *conn)
            .await
            .map(drop)
            .map_err(|e| e.to_string());
    }
    Err("no transaction in the request: is the layer in front?".to_owned())
}

/// `INSERT` the request's charge (`charges.k` is its `Idempotency-Key`).
pub fn insert_charge(key: &str) -> String {
    format!("INSERT INTO charges (k) VALUES ('{key}')")
}

/// The idempotency key of a request (the test's handlers key their
/// charges by it).
pub fn key_of(headers: &http::HeaderMap) -> String {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// A payment: `POST /w{query}` by user `u` with `key`; the same bytes every
/// time for the same arguments.
pub fn pay(key: &str, query: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    req(
        "POST",
        &format!("/w{query}"),
        &[
            ("x-user-id", "u"),
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ],
        r#"{"amount":500}"#,
    )
}

/// One answer in a few words: the status, the problem `type`'s last part
/// for a problem+json answer, `Retry-After` when present, `replayed` for a
/// replay: `"500 transaction-ended"`, `"503 unavailable retry-after"`,
/// `"201 replayed"`, `"429"`.
pub fn summary(reply: &Reply) -> String {
    let mut s = reply.status.to_string();
    let problem = reply
        .headers
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
    if problem {
        let kind = serde_json::from_slice::<serde_json::Value>(&reply.body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .unwrap_or_default();
        let short = kind.rsplit(['#', ':', '/']).next().unwrap_or_default();
        s.push(' ');
        s.push_str(short);
    }
    if reply.headers.contains_key("retry-after") {
        s.push_str(" retry-after");
    }
    if replayed(reply) {
        s.push_str(" replayed");
    }
    s
}

/// One request on a fresh connection, summed up (`"no answer: .."` when
/// there was none).
pub async fn send(
    addr: SocketAddr,
    request: http::Request<http_body_util::Full<bytes::Bytes>>,
) -> (String, Option<Reply>) {
    match super::try_send(addr, request).await {
        Ok(r) => (summary(&r), Some(r)),
        Err(e) => (format!("no answer: {e}"), None),
    }
}

/// One test per store: `every_store!(name, |kind| body(kind));` makes
/// `name::postgres`, `name::sqlx_postgres` and `name::sqlite`, each on the
/// serial runtime (`common::run`).
macro_rules! every_store {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn postgres() {
                $crate::common::run(|| ($body)($crate::common::stores::Kind::Postgres));
            }
            #[test]
            fn sqlx_postgres() {
                $crate::common::run(|| ($body)($crate::common::stores::Kind::Sqlx));
            }
            #[test]
            fn sqlite() {
                $crate::common::run(|| ($body)($crate::common::stores::Kind::Sqlite));
            }
        }
    };
}

/// `every_store!` for the two PostgreSQL stores only.
macro_rules! pg_stores {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn postgres() {
                $crate::common::run(|| ($body)($crate::common::stores::Kind::Postgres));
            }
            #[test]
            fn sqlx_postgres() {
                $crate::common::run(|| ($body)($crate::common::stores::Kind::Sqlx));
            }
        }
    };
}

pub(crate) use {every_store, pg_stores};
