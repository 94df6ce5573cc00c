//! The tokio-postgres store on a real database of its own (created on
//! 127.0.0.1:5432, dropped at the end): the public store suite
//! (`backend::Suite`), then what only a transactional store does, through
//! the store's calls. The handler-level tests of the transaction's
//! semantics run one body per PostgreSQL adapter, in `sql/tests.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;

use deadpool_postgres::Pool;

use tower_redis_lock::backend::contract::{Claim, EntryKey, Token};
use tower_redis_lock::backend::{IdempotencyBackend, Suite};

use super::*;
use crate::pg_sql::SWEEP;
use crate::protocol::SWEEP_BATCH;

const ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const HINT: &str = "these tests need PostgreSQL on 127.0.0.1:5432 (user postgres, trust auth); \
     `.ci/run` starts it";

/// A database of the test's own, dropped (`WITH (FORCE)`) with the guard.
pub(crate) struct TestDatabase {
    name: String,
}

static DATABASES: AtomicUsize = AtomicUsize::new(0);

async fn admin() -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(ADMIN_URL, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {ADMIN_URL}: {e}\nHint: {HINT}"));
    tokio::spawn(conn);
    client
}

impl TestDatabase {
    pub(crate) async fn create() -> Self {
        let n = DATABASES.fetch_add(1, Ordering::SeqCst);
        let name = format!("trl_store_{}_{n}", std::process::id());
        let admin = admin().await;
        // Two calls: neither statement runs inside a transaction block.
        for sql in [
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            format!("CREATE DATABASE {name}"),
        ] {
            admin
                .batch_execute(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e:?}\nHint: {HINT}"));
        }
        Self { name }
    }

    /// A pool of `size` connections on this database.
    pub(crate) fn pool(&self, size: usize) -> Pool {
        let config: tokio_postgres::Config =
            format!("postgres://postgres@127.0.0.1:5432/{}", self.name)
                .parse()
                .unwrap();
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        Pool::builder(manager).max_size(size).build().unwrap()
    }

    /// A migrated store on a pool of its own: one "instance".
    pub(crate) async fn store(&self) -> PostgresBackend {
        let store = PostgresBackend::new(self.pool(16));
        store.migrate().await.expect("migrate");
        store
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        // A thread of its own: Drop may run inside the test's runtime.
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    admin()
                        .await
                        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .await
                })
        })
        .join();
    }
}

use crate::untrusted_rows::entry as key;

const LEASE: Duration = Duration::from_secs(10);
const ROOMY: (u64, u64) = (1_000, 1 << 30);

async fn claim(store: &PostgresBackend, key: &EntryKey, token: &Token, fp: &[u8]) -> Claim {
    store
        .claim(key, token, fp, &ClaimTerms::new(LEASE, ROOMY.0, ROOMY.1))
        .await
        .expect("claim answered")
}

/// The transaction the store hands the handler, as the layer would.
fn transaction(store: &PostgresBackend, key: &EntryKey, token: &Token) -> PgTransaction {
    let mut ext = http::Extensions::new();
    store.claimed(key, token, &mut ext);
    ext.get::<PgTransaction>()
        .cloned()
        .expect("a claimed request gets its transaction")
}

async fn charges(pool: &Pool) -> i64 {
    let c = pool.get().await.unwrap();
    c.query_one("SELECT count(*) FROM charges", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn the_postgres_store_passes() {
    let db = TestDatabase::create().await;
    let store = db.store().await;
    Suite::idempotency_backend(&store).await;
}

#[tokio::test]
async fn drain_waits_for_the_open_claims_of_the_postgres_store() {
    let db = TestDatabase::create().await;
    let store = db.store().await;
    crate::drain_checks::drain_waits_for_open_claims(&store).await;
}

#[tokio::test]
async fn a_duplicate_on_another_instance_waits_for_the_commit_and_reads_the_record() {
    let db = TestDatabase::create().await;
    let (one, two) = (
        db.store().await,
        db.store().await.lock_wait(Duration::from_secs(5)),
    );
    let k = key("wait");
    let (a, b) = (Token::generate(), Token::generate());
    assert_eq!(claim(&one, &k, &a, b"fp").await, Claim::Claimed);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let waiter = {
        let (two, k) = (two.clone(), k.clone());
        tokio::spawn(async move {
            let _ = started_tx.send(());
            claim(&two, &k, &b, b"fp").await
        })
    };
    started_rx.await.unwrap();
    // The duplicate is blocked on the first transaction's row lock until
    // it commits: it cannot have answered yet, whatever the timing.
    let record = Bytes::from_static(b"sealed");
    assert!(!waiter.is_finished());
    assert!(one.complete(&k, &a, b"fp", &record, LEASE).await.unwrap());
    assert_eq!(waiter.await.unwrap(), Claim::Done(record));
}

#[tokio::test]
async fn past_the_lock_wait_a_duplicate_is_in_flight_and_a_mismatch_shows_after_the_commit() {
    let db = TestDatabase::create().await;
    let (one, two) = (
        db.store().await,
        db.store().await.lock_wait(Duration::from_millis(20)),
    );
    let k = key("busy");
    let (a, b) = (Token::generate(), Token::generate());
    assert_eq!(claim(&one, &k, &a, b"fp").await, Claim::Claimed);
    assert_eq!(
        claim(&two, &k, &b, b"other").await,
        Claim::InFlight { retry_after: None },
        "another instance cannot see the fingerprint of a claim in flight"
    );
    assert!(one
        .complete(&k, &a, b"fp", &Bytes::from_static(b"r"), LEASE)
        .await
        .unwrap());
    assert_eq!(claim(&two, &k, &b, b"other").await, Claim::Mismatch);
}

#[tokio::test]
async fn the_handlers_writes_commit_with_the_record_and_roll_back_with_an_abandon() {
    let db = TestDatabase::create().await;
    let store = db.store().await;
    let pool = db.pool(2);
    pool.get()
        .await
        .unwrap()
        .batch_execute("CREATE TABLE charges (k text PRIMARY KEY)")
        .await
        .unwrap();
    let (kept, freed) = (key("kept"), key("freed"));
    let (a, b) = (Token::generate(), Token::generate());
    for (k, t, name) in [(&kept, &a, "kept"), (&freed, &b, "freed")] {
        assert_eq!(claim(&store, k, t, b"fp").await, Claim::Claimed);
        let tx = transaction(&store, k, t);
        let db = tx.client().await.unwrap();
        db.execute("INSERT INTO charges VALUES ($1)", &[&name])
            .await
            .unwrap();
    }
    assert_eq!(charges(&pool).await, 0, "nothing visible before the commit");
    assert!(store
        .complete(&kept, &a, b"fp", &Bytes::from_static(b"r"), LEASE)
        .await
        .unwrap());
    assert!(store.abandon(&freed, &b, LEASE).await.unwrap());
    let c = pool.get().await.unwrap();
    let rows: Vec<String> = c
        .query("SELECT k FROM charges", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(rows, ["kept"], "the abandoned request's write rolled back");
    // A handle kept past the end of its request finds its transaction over.
    assert!(transaction_after_end(&store, &kept, &a).is_none());
    // The freed key is free for the next request, whatever its fingerprint.
    assert_eq!(
        claim(&store, &freed, &Token::generate(), b"x").await,
        Claim::Claimed
    );
}

fn transaction_after_end(
    store: &PostgresBackend,
    k: &EntryKey,
    t: &Token,
) -> Option<PgTransaction> {
    let mut ext = http::Extensions::new();
    store.claimed(k, t, &mut ext);
    ext.get::<PgTransaction>().cloned()
}

#[tokio::test]
async fn a_claim_whose_connection_dies_leaves_nothing() {
    let db = TestDatabase::create().await;
    let other = db.store().await.lock_wait(Duration::from_secs(5));
    let pool = db.pool(2);
    pool.get()
        .await
        .unwrap()
        .batch_execute("CREATE TABLE charges (k text PRIMARY KEY)")
        .await
        .unwrap();
    let k = key("crash");
    {
        // An instance that claims, writes, and dies before its commit: its
        // store (and so its connections) dropped, as a killed process's.
        let doomed = db.store().await;
        let t = Token::generate();
        assert_eq!(claim(&doomed, &k, &t, b"fp").await, Claim::Claimed);
        let tx = transaction(&doomed, &k, &t);
        tx.client()
            .await
            .unwrap()
            .execute("INSERT INTO charges VALUES ('doomed')", &[])
            .await
            .unwrap();
        drop(tx);
        drop(doomed);
    }
    assert_eq!(
        claim(&other, &k, &Token::generate(), b"fp").await,
        Claim::Claimed,
        "the retry runs on a clean slate"
    );
    assert_eq!(charges(&pool).await, 0);
}

#[tokio::test]
async fn rows_read_back_are_untrusted() {
    let db = TestDatabase::create().await;
    let store = db.store().await;
    let pool = db.pool(2);
    crate::untrusted_rows::co_tenant_rows_are_untrusted(&store, |k, state| {
        let pool = pool.clone();
        async move {
            let c = pool.get().await.unwrap();
            c.execute(
                "INSERT INTO trl_idempotency VALUES ($1, $2, '\\x00', 'fp', $3, NULL, now() + interval '1 hour')",
                &[&&k.entry()[..], &&k.scope()[..], &state],
            )
            .await
            .unwrap();
        }
    })
    .await;
}

#[tokio::test]
async fn expired_records_are_taken_over_and_swept_in_bounded_batches() {
    let db = TestDatabase::create().await;
    let store = db.store().await;
    let pool = db.pool(2);
    let c = pool.get().await.unwrap();
    let k = key("expired");
    let t = Token::generate();
    assert_eq!(claim(&store, &k, &t, b"fp").await, Claim::Claimed);
    assert!(store
        .complete(
            &k,
            &t,
            b"fp",
            &Bytes::from_static(b"old"),
            Duration::from_millis(1)
        )
        .await
        .unwrap());
    // Past its retention: the next request claims it afresh.
    c.execute(
        "UPDATE trl_idempotency SET expires_at = now() - interval '1 second'",
        &[],
    )
    .await
    .unwrap();
    let t2 = Token::generate();
    assert_eq!(claim(&store, &k, &t2, b"new").await, Claim::Claimed);
    assert!(store
        .complete(&k, &t2, b"fp", &Bytes::from_static(b"new"), LEASE)
        .await
        .unwrap());
    // The sweep: one batch deletes at most SWEEP_BATCH rows ...
    c.batch_execute(&format!(
        "INSERT INTO trl_idempotency SELECT ('x' || g)::bytea, 's', 't', 'f', 1, 'r', now() - interval '1 second' \
         FROM generate_series(1, {}) g",
        SWEEP_BATCH + 10
    ))
    .await
    .unwrap();
    let deleted = c.execute(SWEEP, &[&SWEEP_BATCH]).await.unwrap();
    assert_eq!(deleted, SWEEP_BATCH as u64);
    let left: i64 = c
        .query_one(
            "SELECT count(*) FROM trl_idempotency WHERE expires_at < now()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 10);
    // ... and a sweep runs batches until one comes back short.
    assert_eq!(store.sweep().await.unwrap(), 10);
}

#[tokio::test]
async fn migrate_beside_a_claim_in_flight_does_not_wait_for_it() {
    let db = TestDatabase::create().await;
    let busy = db.store().await;
    let k = key("busy-table");
    let t = Token::generate();
    assert_eq!(claim(&busy, &k, &t, b"fp").await, Claim::Claimed);
    // A new instance starting while the claim's transaction is open: a
    // table lock would wait for it (forever here, nothing completes it).
    let starting = PostgresBackend::new(db.pool(2));
    let migrated = tokio::time::timeout(Duration::from_secs(5), starting.migrate()).await;
    assert!(matches!(migrated, Ok(Ok(()))), "{migrated:?}");
    assert!(busy
        .complete(&k, &t, b"fp", &Bytes::from_static(b"r"), LEASE)
        .await
        .unwrap());
}
