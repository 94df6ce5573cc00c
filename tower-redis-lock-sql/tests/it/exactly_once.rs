//! Exactly once for database side effects: the SQL stores commit the
//! handler's charge and the idempotency record in one transaction.
//!
//! The crash test: two `examples/exactly_once.rs` processes on one fresh
//! database, clients that retry the identical request (to either instance)
//! until a final answer, and one instance killed with SIGKILL again and
//! again while its handlers sit between their charge and their answer, and
//! restarted. With `STORE=postgres` (tokio-postgres), `STORE=sqlx` (PostgreSQL
//! through sqlx) and `STORE=sqlite` (both processes on one SQLite file),
//! every key has exactly one `charges` row when its client got a 201 (none
//! otherwise), and every 201 of a key carries the same body; on SQLite
//! both processes are then killed, one restarted on the same file, and
//! every key's retry replays. The same run with `STORE=redis` (charge in
//! its own autocommit statement, records in Redis, a short claim TTL) must
//! show a key charged twice: the test has teeth.
//!
//! With a payment provider (a small server here that charges once per
//! idempotency key it receives): the handler calls it before its `INSERT`,
//! so kills land between the provider call and the commit. Sending the
//! downstream key, every key is charged once at the provider; the controls
//! send the client's raw key (two users' keys collide) and a fresh key per
//! attempt (a key charged twice).
//!
//! Then the layer's transactional behaviour in process (real PostgreSQL,
//! real HTTP over loopback): a failed commit answers 503 and keeps
//! nothing; a panic, a status `store_when` refuses and `SafeToRetry` roll
//! the handler's writes back and free the key; a handler that does not take
//! the transaction is served like on any durable store.
//!
//! Needs PostgreSQL on 127.0.0.1:5432 (see `common::pg`); an unreachable
//! PostgreSQL is a loud failure, never a skip.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::examples::example_binary;
use common::pg::{pg_connect, Database};
use common::{free_port, replayed, req, try_send, RedisServer, Reply, Rng};
use tower_redis_lock::idempotency::{IdempotencyKey, SafeToRetry};
use tower_redis_lock::key::{Header, RequestMethod, Route};
use tower_redis_lock::IdempotencyLayer;
use tower_redis_lock_sql::{PgTransaction, PostgresBackend};

/// How long each handler sits between its charge and its answer.
const DELAY_MS: u64 = 150;
/// Concurrent clients, each working through keys one after the other.
const CLIENTS: usize = 24;
/// How long new keys are started (and the instance killed): at least
/// `LOAD`, `MIN_KILLS` kills and `MIN_KEYS` keys done, at most `MAX_LOAD`.
const LOAD: Duration = Duration::from_secs(8);
const MIN_KILLS: u64 = 5;
/// Keys (each sent until its final answer) a run needs to prove anything;
/// a slow machine gets more time for them (up to `MAX_LOAD`), not a
/// failure.
const MIN_KEYS: usize = 60;
const MAX_LOAD: Duration = Duration::from_secs(20);
/// Retries end `MAX_LOAD + FINISH` after the start, loaded or not.
const FINISH: Duration = Duration::from_secs(20);
/// Uptime of the killed instance between two kills.
const KILL_AFTER_MS: (u64, u64) = (250, 550);
/// The Redis control's claim TTL: an orphaned claim expires quickly.
const REDIS_TTL_MS: u64 = 300;

/// The SQLite claim TTL: a claim a killed process left is taken over
/// after it.
const SQLITE_TTL_MS: u64 = 1_000;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[cfg_attr(not(feature = "sqlx-postgres"), allow(dead_code))] // `Sqlx`
enum Store {
    Postgres,
    Sqlx,
    Sqlite,
    Redis,
}

/// How big one crash run is.
#[derive(Clone, Copy)]
struct Plan {
    clients: usize,
    load: Duration,
    min_kills: u64,
    delay_ms: u64,
    /// Every client uses the keys `k-0`, `k-1`, ... (two users' keys are
    /// the same string), instead of keys of its own.
    shared_keys: bool,
    /// `PROVIDER_KEY` for a run with a provider.
    provider: Option<&'static str>,
}

const PLAN: Plan = Plan {
    clients: CLIENTS,
    load: LOAD,
    min_kills: MIN_KILLS,
    delay_ms: DELAY_MS,
    shared_keys: false,
    provider: None,
};

impl Plan {
    fn for_store(store: Store) -> Self {
        match store {
            // One write lock: the handler holds it from its INSERT to its
            // commit, so fewer clients and a shorter window.
            Store::Sqlite => Plan {
                clients: 8,
                load: Duration::from_secs(6),
                delay_ms: 40,
                ..PLAN
            },
            Store::Sqlx => Plan {
                load: Duration::from_secs(6),
                ..PLAN
            },
            _ => PLAN,
        }
    }
}

/// One `exactly_once` process on a fixed port, killed on drop.
struct Instance {
    child: Option<Child>,
    port: u16,
}

struct Launch<'a> {
    bin: &'a Path,
    db: &'a Database,
    store: Store,
    redis: Option<&'a RedisServer>,
    /// The SQLite file (`STORE=sqlite`).
    sqlite: Option<&'a Path>,
    /// The provider's URL and `PROVIDER_KEY`.
    provider: Option<(String, &'static str)>,
}

impl Launch<'_> {
    fn spawn(&self, port: u16) -> Child {
        let mut cmd = Command::new(self.bin);
        cmd.env("ADDR", format!("127.0.0.1:{port}"))
            .env("DATABASE_URL", self.db.url())
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        match &self.provider {
            Some((url, which)) => cmd.env("PROVIDER_URL", url).env("PROVIDER_KEY", which),
            None => cmd.env_remove("PROVIDER_URL"),
        };
        match self.store {
            Store::Postgres => cmd.env("STORE", "postgres").env_remove("REDIS_URL"),
            Store::Sqlx => cmd.env("STORE", "sqlx").env_remove("REDIS_URL"),
            Store::Sqlite => cmd
                .env("STORE", "sqlite")
                .env(
                    "DATABASE_URL",
                    format!("sqlite://{}", self.sqlite.expect("a file").display()),
                )
                .env("CLAIM_TTL_MS", SQLITE_TTL_MS.to_string()),
            Store::Redis => cmd
                .env("STORE", "redis")
                .env("REDIS_URL", self.redis.expect("a redis-server").url())
                .env("CLAIM_TTL_MS", REDIS_TTL_MS.to_string()),
        };
        let mut child = cmd.spawn().expect("start the exactly_once example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.contains("listening on"),
            "exactly_once did not start (first line {line:?}); see its stderr above"
        );
        child
    }

    fn start(&self) -> Instance {
        let port = free_port();
        Instance {
            child: Some(self.spawn(port)),
            port,
        }
    }
}

impl Instance {
    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// SIGKILL (`Child::kill` on Unix): no shutdown, no last word.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start again on the same port (a few tries: the port is free once
    /// the killed process is reaped).
    fn restart(&mut self, launch: &Launch<'_>) {
        self.child = Some(launch.spawn(self.port));
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What one key's client saw.
#[derive(Debug, Default)]
struct KeyOutcome {
    /// The body of its 201, if it got one.
    created: Option<bytes::Bytes>,
    /// Answers that were neither 201 nor a reason to retry.
    other: Vec<(u16, String)>,
}

#[derive(Default)]
struct Tally {
    keys: BTreeMap<String, KeyOutcome>,
    attempts: u64,
    /// Requests sent that got no answer: the instance died under them.
    interrupted: u64,
    /// Connections refused (the instance was down).
    refused: u64,
    /// 409 and 503 answers (retried).
    retried: u64,
}

fn payment(
    user: &str,
    key: &str,
    delay_ms: u64,
) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    req(
        "POST",
        &format!("/payments?delay_ms={delay_ms}"),
        &[
            ("x-user-id", user),
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ],
        r#"{"amount":500,"currency":"EUR"}"#,
    )
}

/// Start keys until `stop`; retry each, to either instance, until a final
/// answer or `finish_by`.
/// A key's reference, as `charges` and the provider see it: `user/key`.
fn reference(user: &str, key: &str) -> String {
    format!("{user}/{key}")
}

async fn client(
    id: usize,
    plan: Plan,
    addrs: [SocketAddr; 2],
    stop: Arc<AtomicBool>,
    done: Arc<AtomicUsize>,
    finish_by: Instant,
) -> Tally {
    let mut rng = Rng::new(id as u64);
    let mut tally = Tally::default();
    let user = format!("user-{id}");
    for n in 0.. {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let key = match plan.shared_keys {
            true => format!("k-{n}"),
            false => format!("k-{id}-{n}"),
        };
        let mut outcome = KeyOutcome::default();
        while Instant::now() < finish_by {
            let addr = addrs[rng.range(0, 1) as usize];
            tally.attempts += 1;
            match try_send(addr, payment(&user, &key, plan.delay_ms)).await {
                Ok(r) if r.status == 201 => {
                    outcome.created = Some(r.body);
                    break;
                }
                Ok(r) if matches!(r.status, 409 | 503) => tally.retried += 1,
                Ok(r) => {
                    outcome
                        .other
                        .push((r.status, String::from_utf8_lossy(&r.body).into_owned()));
                    break;
                }
                Err(e) if e.starts_with("connect:") => tally.refused += 1,
                Err(_) => tally.interrupted += 1,
            }
            // Pacing between retries, not synchronisation.
            tokio::time::sleep(Duration::from_millis(rng.range(10, 40))).await;
        }
        tally.keys.insert(reference(&user, &key), outcome);
        done.fetch_add(1, Ordering::SeqCst);
    }
    tally
}

struct Run {
    tally: Tally,
    kills: u64,
    /// Charge rows per reference (`user/key`), and their ids.
    charges: HashMap<String, Vec<String>>,
    /// The provider's charges, per reference the request carried.
    provider: HashMap<String, usize>,
    /// 201 bodies of a retry after the run (replays), per key.
    replays: HashMap<String, Reply>,
    elapsed: Duration,
}

impl Run {
    fn total_charges(&self) -> usize {
        self.charges.values().map(Vec::len).sum()
    }

    fn duplicated(&self) -> usize {
        self.charges.values().filter(|ids| ids.len() > 1).count()
    }

    fn provider_charges(&self) -> usize {
        self.provider.values().sum()
    }

    fn report(&self, store: Store) {
        let created = self
            .tally
            .keys
            .values()
            .filter(|k| k.created.is_some())
            .count();
        println!(
            "exactly once, {store:?} store: {} keys ({created} answered 201), {} kills of one \
             instance ({} requests cut off by a kill, {} connections refused, {} answers \
             409/503 retried, {} attempts), \
             {} charge rows, {} keys charged more than once; {:.1} s",
            self.tally.keys.len(),
            self.kills,
            self.tally.interrupted,
            self.tally.refused,
            self.tally.retried,
            self.tally.attempts,
            self.total_charges(),
            self.duplicated(),
            self.elapsed.as_secs_f64(),
        );
        if !self.provider.is_empty() {
            println!(
                "  provider: {} charges for {} references; {} references charged more than \
                 once, {} keys with no charge of their own",
                self.provider_charges(),
                self.provider.len(),
                self.provider.values().filter(|n| **n > 1).count(),
                self.tally
                    .keys
                    .keys()
                    .filter(|k| !self.provider.contains_key(*k))
                    .count(),
            );
        }
    }
}

/// The payment provider: charges once per idempotency key it receives
/// (a repeat gets the first charge back), and counts its charges per the
/// reference the request carried.
#[derive(Clone, Default)]
struct Provider {
    by_key: Arc<std::sync::Mutex<HashMap<String, String>>>,
    charges: Arc<std::sync::Mutex<HashMap<String, usize>>>,
}

async fn provider_charge(
    State(p): State<Provider>,
    headers: http::HeaderMap,
    axum::Json(body): axum::Json<serde_json::Value>,
) -> axum::Json<serde_json::Value> {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let reference = body["reference"].as_str().unwrap_or_default().to_owned();
    let mut by_key = p.by_key.lock().unwrap();
    let n = by_key.len();
    let charge = by_key
        .entry(key)
        .or_insert_with(|| {
            *p.charges.lock().unwrap().entry(reference).or_default() += 1;
            format!("pc_{n}")
        })
        .clone();
    axum::Json(serde_json::json!({ "charge": charge }))
}

async fn crash_run(store: Store, plan: Plan) -> Run {
    let started = Instant::now();
    let bin: PathBuf = example_binary("exactly_once");
    let db = Database::create().await;
    let redis = (store == Store::Redis).then(RedisServer::start);
    let dir = std::env::temp_dir().join(format!("trl-exactly-once-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("pay-{}.db", free_port()));
    let provider = Provider::default();
    let provider_url = match plan.provider {
        Some(which) => {
            let addr = common::serve(
                Router::new()
                    .route("/charge", post(provider_charge))
                    .with_state(provider.clone()),
            )
            .await;
            Some((format!("http://{addr}/charge"), which))
        }
        None => None,
    };
    let launch = Launch {
        bin: &bin,
        db: &db,
        store,
        redis: redis.as_ref(),
        sqlite: (store == Store::Sqlite).then_some(file.as_path()),
        provider: provider_url,
    };
    let mut killed = launch.start();
    let steady = launch.start();
    let addrs = [killed.addr(), steady.addr()];

    let load_from = Instant::now();
    let finish_by = load_from + MAX_LOAD + FINISH;
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..plan.clients)
        .map(|i| {
            let (stop, done) = (stop.clone(), done.clone());
            tokio::spawn(client(i, plan, addrs, stop, done, finish_by))
        })
        .collect();

    let mut rng = Rng::new(u64::MAX);
    let mut kills = 0;
    while (load_from.elapsed() < plan.load
        || kills < plan.min_kills
        || done.load(Ordering::SeqCst) < MIN_KEYS)
        && load_from.elapsed() < MAX_LOAD
    {
        tokio::time::sleep(Duration::from_millis(
            rng.range(KILL_AFTER_MS.0, KILL_AFTER_MS.1),
        ))
        .await;
        killed.kill();
        kills += 1;
        // Restart (blocking: it waits for the start-up line).
        tokio::task::block_in_place(|| killed.restart(&launch));
    }
    stop.store(true, Ordering::SeqCst);

    let mut tally = Tally::default();
    for c in clients {
        let t = tokio::time::timeout_at((finish_by + Duration::from_secs(10)).into(), c)
            .await
            .expect("clients finish within their bound")
            .expect("client panicked");
        tally.keys.extend(t.keys);
        tally.attempts += t.attempts;
        tally.interrupted += t.interrupted;
        tally.refused += t.refused;
        tally.retried += t.retried;
    }

    // SQLite, one machine: both processes die, one restarts on the same
    // file, and every retry below must replay from it.
    let mut steady = steady;
    if store == Store::Sqlite {
        killed.kill();
        steady.kill();
        tokio::task::block_in_place(|| steady.restart(&launch));
    }
    // Every 201 again, from the instance that was never killed (on SQLite,
    // the restarted one): a replay.
    let mut replays = HashMap::new();
    for (reference, outcome) in &tally.keys {
        if outcome.created.is_some() {
            let (user, key) = reference.split_once('/').unwrap();
            let r = try_send(steady.addr(), payment(user, key, plan.delay_ms))
                .await
                .expect("the steady instance answers");
            replays.insert(reference.clone(), r);
        }
    }

    let mut charges: HashMap<String, Vec<String>> = HashMap::new();
    let sql = "SELECT user_id || '/' || idempotency_key, id FROM charges";
    if store == Store::Sqlite {
        charges_in_sqlite(&file, sql, &mut charges).await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
        }
    } else {
        let pg = pg_connect(&db.url()).await;
        for row in pg.query(sql, &[]).await.unwrap() {
            charges.entry(row.get(0)).or_default().push(row.get(1));
        }
    }
    drop(killed);
    drop(steady);
    let provider = provider.charges.lock().unwrap().clone();
    Run {
        tally,
        kills,
        charges,
        provider,
        replays,
        elapsed: started.elapsed(),
    }
}

#[cfg(feature = "sqlx-sqlite")]
async fn charges_in_sqlite(file: &Path, sql: &str, charges: &mut HashMap<String, Vec<String>>) {
    use sqlx::Row;
    let url = format!("sqlite://{}", file.display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    for row in sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_all(&pool)
        .await
        .unwrap()
    {
        charges.entry(row.get(0)).or_default().push(row.get(1));
    }
    pool.close().await;
}

#[cfg(not(feature = "sqlx-sqlite"))]
async fn charges_in_sqlite(_: &Path, _: &str, _: &mut HashMap<String, Vec<String>>) {
    unreachable!("STORE=sqlite runs with the feature sqlx-sqlite only")
}

/// Every key answered 201 once, charged once, and replayed after.
fn assert_exactly_once(run: &Run, plan: Plan) {
    let t = &run.tally;
    assert!(run.kills >= plan.min_kills, "only {} kills", run.kills);
    assert!(
        t.interrupted >= 3,
        "only {} requests were cut off by a kill: the kills missed the handlers",
        t.interrupted
    );
    assert!(
        t.keys.len() >= MIN_KEYS,
        "too few keys to prove anything in {:?}: {}",
        MAX_LOAD,
        t.keys.len()
    );
    for (key, outcome) in &t.keys {
        assert!(
            outcome.other.is_empty(),
            "{key}: unexpected answers {:?}",
            outcome.other
        );
        let rows = run.charges.get(key).map_or(&[][..], Vec::as_slice);
        let Some(body) = &outcome.created else {
            panic!(
                "{key}: no final answer by the deadline ({} charge rows)",
                rows.len()
            );
        };
        assert_eq!(
            rows.len(),
            1,
            "{key}: answered 201, charged {} times",
            rows.len()
        );
        let answered: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(
            answered["id"],
            rows[0].as_str(),
            "{key}: the 201 names its charge"
        );
        let replay = &run.replays[key];
        assert_eq!(replay.status, 201, "{key}: {:?}", replay.body);
        assert!(replayed(replay), "{key}: the retry was replayed");
        assert_eq!(&replay.body, body, "{key}: every 201 carries the same body");
    }
    let stray: Vec<_> = run
        .charges
        .keys()
        .filter(|k| !t.keys.contains_key(*k))
        .collect();
    assert!(
        stray.is_empty(),
        "charges for keys no client sent: {stray:?}"
    );
}

#[test]
fn killed_mid_handler_the_postgres_store_charges_every_key_exactly_once() {
    let plan = Plan::for_store(Store::Postgres);
    let run = common::run(|| crash_run(Store::Postgres, plan));
    run.report(Store::Postgres);
    assert_exactly_once(&run, plan);
}

#[cfg(feature = "sqlx-postgres")]
#[test]
fn killed_mid_handler_the_sqlx_postgres_store_charges_every_key_exactly_once() {
    let plan = Plan::for_store(Store::Sqlx);
    let run = common::run(|| crash_run(Store::Sqlx, plan));
    run.report(Store::Sqlx);
    assert_exactly_once(&run, plan);
}

#[cfg(feature = "sqlx-sqlite")]
#[test]
fn killed_mid_handler_the_sqlite_store_charges_every_key_exactly_once_and_replays_after_a_restart()
{
    let plan = Plan::for_store(Store::Sqlite);
    let run = common::run(|| crash_run(Store::Sqlite, plan));
    run.report(Store::Sqlite);
    assert_exactly_once(&run, plan);
}

/// A provider run: shared key strings across users, kills between the
/// provider call and the commit.
#[cfg(feature = "sqlx-postgres")]
fn provider_run(which: &'static str) -> Run {
    let plan = Plan {
        load: Duration::from_secs(5),
        shared_keys: true,
        provider: Some(which),
        ..Plan::for_store(Store::Sqlx)
    };
    let run = common::run(|| crash_run(Store::Sqlx, plan));
    println!("provider key: {which}");
    run.report(Store::Sqlx);
    assert!(run.kills >= plan.min_kills, "only {} kills", run.kills);
    run
}

#[cfg(feature = "sqlx-postgres")]
#[test]
fn with_the_downstream_key_every_key_is_charged_once_at_the_provider() {
    let run = provider_run("downstream");
    assert_exactly_once(
        &run,
        Plan {
            min_kills: 0,
            ..PLAN
        },
    );
    for key in run.tally.keys.keys() {
        assert_eq!(
            run.provider.get(key).copied().unwrap_or(0),
            1,
            "{key}: charged at the provider once"
        );
    }
    assert_eq!(run.provider_charges(), run.tally.keys.len());
}

#[cfg(feature = "sqlx-postgres")]
#[test]
fn the_provider_controls_collide_on_the_raw_key_and_double_charge_on_a_fresh_key() {
    // The client's raw key: two users' `k-0` are one charge at the provider.
    let raw = provider_run("raw");
    let uncharged = raw
        .tally
        .keys
        .keys()
        .filter(|k| !raw.provider.contains_key(*k))
        .count();
    assert!(
        uncharged >= 1,
        "no two users' keys collided at the provider: the control has no teeth"
    );
    // A fresh key per attempt: a retry after a kill charges again.
    let fresh = provider_run("fresh");
    assert!(
        fresh.provider.values().any(|n| *n > 1),
        "no key charged twice at the provider in {} kills",
        fresh.kills
    );
}

#[test]
fn killed_mid_handler_the_redis_control_charges_a_key_twice() {
    let run = common::run(|| crash_run(Store::Redis, PLAN));
    run.report(Store::Redis);
    assert!(run.kills >= MIN_KILLS, "only {} kills", run.kills);
    assert!(
        run.duplicated() >= 1,
        "no key charged twice in {} kills: the crash test could not have caught one",
        run.kills
    );
}

// ---- the layer over a transactional store, in process ---------------------

async fn pool(db: &Database, size: usize) -> deadpool_postgres::Pool {
    let config: tokio_postgres::Config = db.url().parse().unwrap();
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    deadpool_postgres::Pool::builder(manager)
        .max_size(size)
        .build()
        .unwrap()
}

/// How the handler ends once it wrote its row.
#[derive(serde::Deserialize)]
struct Ending {
    end: String,
}

/// A handler that writes one row through the request's transaction (or on
/// its own connection when there is none), then ends as `?end=` says.
async fn write_then(
    State(app): axum::extract::State<InProcess>,
    axum::extract::Query(ending): axum::extract::Query<Ending>,
    key: IdempotencyKey,
    tx: Option<PgTransaction>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    app.runs.fetch_add(1, Ordering::SeqCst);
    let sql = "INSERT INTO writes (k) VALUES ($1)";
    match &tx {
        Some(tx) => {
            let db = tx.client().await.unwrap();
            db.execute(sql, &[&key.as_str()]).await.unwrap();
            if ending.end == "deferred-violation" {
                // Fails only at COMMIT (a deferred unique constraint).
                db.execute(sql, &[&key.as_str()]).await.unwrap();
            }
        }
        None => {
            let db = app.pool.get().await.unwrap();
            db.execute(sql, &[&key.as_str()]).await.unwrap();
        }
    }
    match ending.end.as_str() {
        "panic" => panic!("the handler fails after its write"),
        "conflict" => (StatusCode::CONFLICT, "refused by store_when").into_response(),
        "safe" => (
            StatusCode::SERVICE_UNAVAILABLE,
            SafeToRetry,
            "nothing happened",
        )
            .into_response(),
        _ => (StatusCode::CREATED, "written").into_response(),
    }
}

use axum::extract::State;

#[derive(Clone)]
struct InProcess {
    pool: deadpool_postgres::Pool,
    runs: Arc<AtomicU64>,
}

async fn rows(pool: &deadpool_postgres::Pool, key: &str) -> i64 {
    pool.get()
        .await
        .unwrap()
        .query_one("SELECT count(*) FROM writes WHERE k = $1", &[&key])
        .await
        .unwrap()
        .get(0)
}

fn call(end: &str, key: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    req(
        "POST",
        &format!("/w?end={end}"),
        &[("x-user-id", "u"), ("idempotency-key", key)],
        "{}",
    )
}

#[test]
fn the_transaction_commits_with_the_record_or_not_at_all() {
    common::run(|| async {
        let db = Database::create().await;
        let pool = pool(&db, 8).await;
        pool.get()
            .await
            .unwrap()
            .batch_execute(
                "CREATE TABLE writes (k text, \
                 CONSTRAINT once UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)",
            )
            .await
            .unwrap();
        let store = PostgresBackend::new(pool.clone());
        store.migrate().await.unwrap();
        let app = InProcess {
            pool: pool.clone(),
            runs: Arc::default(),
        };
        let layer = IdempotencyLayer::new(
            store,
            (RequestMethod, Route, Header::trusted_identity("x-user-id")),
        );
        let router = Router::new()
            .route("/w", post(write_then).layer(layer))
            .with_state(app.clone());
        let addr = common::serve(router).await;
        let send = |end: &'static str, key: &'static str| async move {
            try_send(addr, call(end, key)).await.expect("an answer")
        };

        // Committed with its record: one row, and the retry replays.
        assert_eq!(send("ok", "a").await.status, 201);
        let again = send("ok", "a").await;
        assert!(again.status == 201 && replayed(&again));
        assert_eq!(rows(&pool, "a").await, 1);

        // The commit fails: never the handler's 201; nothing kept; the key
        // is free (the retry runs, and here fails the same way).
        let failed = send("deferred-violation", "b").await;
        assert_eq!(failed.status, 503, "{:?}", failed.body);
        assert!(failed.headers.contains_key("retry-after"));
        assert_eq!(rows(&pool, "b").await, 0);

        // A panic, a status store_when refuses, SafeToRetry: rolled back,
        // the key freed, and the retry runs for real.
        for (end, key, status) in [
            ("panic", "c", 500),
            ("conflict", "d", 409),
            ("safe", "e", 503),
        ] {
            let runs = app.runs.load(Ordering::SeqCst);
            assert_eq!(send(end, key).await.status, status, "{end}");
            assert_eq!(rows(&pool, key).await, 0, "{end}: its write rolled back");
            let retry = send("ok", key).await;
            assert_eq!(retry.status, 201, "{end}: the key is free");
            assert!(!replayed(&retry));
            assert_eq!(app.runs.load(Ordering::SeqCst), runs + 2);
            assert_eq!(rows(&pool, key).await, 1);
        }
    });
}

#[test]
fn a_handler_without_the_transaction_is_served_like_on_any_durable_store() {
    common::run(|| async {
        let db = Database::create().await;
        let pool = pool(&db, 8).await;
        pool.get()
            .await
            .unwrap()
            .batch_execute("CREATE TABLE writes (k text)")
            .await
            .unwrap();
        let store = PostgresBackend::new(pool.clone());
        store.migrate().await.unwrap();
        let runs = Arc::new(AtomicU64::new(0));
        let r = runs.clone();
        let layer = IdempotencyLayer::new(
            store,
            (RequestMethod, Route, Header::trusted_identity("x-user-id")),
        );
        let router = Router::new().route(
            "/w",
            post(move || {
                let r = r.clone();
                async move {
                    r.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, "made")
                }
            })
            .layer(layer),
        );
        let addr = common::serve(router).await;
        let first = try_send(addr, call("ok", "k")).await.unwrap();
        let second = try_send(addr, call("ok", "k")).await.unwrap();
        assert_eq!((first.status, second.status), (201, 201));
        assert!(!replayed(&first) && replayed(&second));
        assert_eq!(first.body, second.body);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let other = try_send(
            addr,
            req(
                "POST",
                "/w?end=x",
                &[("x-user-id", "u"), ("idempotency-key", "k")],
                "{}",
            ),
        )
        .await
        .unwrap();
        assert_eq!(other.status, 422, "same key, other query: a mismatch");
    });
}

/// Sessions on this database waiting for a lock another transaction holds
/// (`pg_locks` is cluster-wide, and a row lock's wait names no database).
async fn lock_waits(pool: &deadpool_postgres::Pool) -> i64 {
    pool.get()
        .await
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[test]
fn a_duplicate_on_another_instance_waits_on_the_transaction_then_replays() {
    common::run(|| async {
        let db = Database::create().await;
        let pool = pool(&db, 8).await;
        PostgresBackend::new(pool.clone()).migrate().await.unwrap();
        // The first request's handler holds until the test lets it go.
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let runs = Arc::new(AtomicU64::new(0));
        let instance = |join: Duration| {
            let (gate, runs) = (gate.clone(), runs.clone());
            let store = PostgresBackend::new(pool.clone());
            let layer = IdempotencyLayer::new(
                store,
                (RequestMethod, Route, Header::trusted_identity("x-user-id")),
            )
            .join_timeout(join);
            Router::new().route(
                "/w",
                post(move || {
                    let (gate, runs) = (gate.clone(), runs.clone());
                    async move {
                        let n = runs.fetch_add(1, Ordering::SeqCst);
                        let _ = gate.acquire().await.unwrap();
                        (StatusCode::CREATED, format!("run {n}"))
                    }
                })
                .layer(layer),
            )
        };
        let first = common::serve(instance(Duration::ZERO)).await;
        let patient = common::serve(instance(Duration::from_secs(10))).await;
        let hasty = common::serve(instance(Duration::from_millis(300))).await;

        let original = tokio::spawn(try_send(first, call("ok", "k")));
        assert!(
            common::eventually(Duration::from_secs(5), || runs.load(Ordering::SeqCst) == 1).await,
            "the first request runs"
        );
        // Past its join bound, a duplicate elsewhere gets 409 (never runs).
        let refused = try_send(hasty, call("ok", "k")).await.unwrap();
        assert_eq!(refused.status, 409, "{:?}", refused.body);
        // A patient one waits, on the first transaction's row lock.
        let joined = tokio::spawn(try_send(patient, call("ok", "k")));
        let waiting =
            common::retry_until(Duration::from_secs(5), Duration::from_millis(5), || async {
                if lock_waits(&pool).await > 0 {
                    Ok(())
                } else {
                    Err(())
                }
            })
            .await;
        assert!(
            waiting.is_ok(),
            "the duplicate waits on the first transaction's lock"
        );
        gate.add_permits(1);
        let original = original.await.unwrap().unwrap();
        let joined = joined.await.unwrap().unwrap();
        assert_eq!((original.status, joined.status), (201, 201));
        assert!(replayed(&joined) && !replayed(&original));
        assert_eq!(joined.body, original.body);
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    });
}
