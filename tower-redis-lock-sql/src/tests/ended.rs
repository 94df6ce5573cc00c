//! How a request ends when its handler ends the request's transaction
//! itself and then answers what the layer does not record (a 429), and
//! SQLite's own rollbacks: the key is final when something committed, and
//! free when nothing did.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Extension, Router};
use http::StatusCode;

#[cfg(feature = "postgres")]
use super::TokioPg;
use super::{answered_final, charges, layer, send, Pg, PgClient, SqlxPg};

type Calls = Arc<AtomicUsize>;

/// What a handler runs in the request's transaction before it answers 429.
#[derive(Clone, Copy)]
struct Charge(&'static str);

/// Charges as told (ending the transaction itself), then answers 429 (not
/// recorded by default).
async fn charge_then_429<C: PgClient>(
    Extension(calls): Extension<Calls>,
    Extension(Charge(sql)): Extension<Charge>,
    tx: C::Tx,
) -> axum::response::Response {
    calls.fetch_add(1, Ordering::SeqCst);
    C::batch(&tx, sql).await;
    StatusCode::TOO_MANY_REQUESTS.into_response()
}

/// Three requests with one key to a handler that charges by `sql`, behind
/// `layer`: each answered the key's final answer, the handler run and
/// charged once.
async fn charged_once<C: PgClient>(
    layer: tower_redis_lock::IdempotencyLayer,
    pool: &sqlx::PgPool,
    sql: &'static str,
) {
    let calls = Calls::default();
    let app = Router::new()
        .route("/pay", post(charge_then_429::<C>).layer(layer))
        .layer(Extension(calls.clone()))
        .layer(Extension(Charge(sql)));
    answered_final(&app, "charged-once", 3).await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(charges(pool).await, 1, "charged once");
}

/// Charges and commits the request's transaction itself.
const COMMITS: &str = "INSERT INTO charges VALUES ('c'); COMMIT";

async fn a_handler_that_commits_then_answers_429_never_runs_again<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::store(&db).await;
    let pool = db.pool(2).await;
    charged_once::<C>(layer(store), &pool, COMMITS).await;
}

/// Charges and answers 200 at its first call; at a later one rolls the
/// claim's transaction back, charges in autocommit and answers 429.
async fn charge_then_rollback_and_429<C: PgClient>(
    Extension(calls): Extension<Calls>,
    tx: C::Tx,
) -> axum::response::Response {
    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
        C::batch(&tx, "INSERT INTO charges VALUES ('e')").await;
        return StatusCode::OK.into_response();
    }
    C::batch(&tx, "ROLLBACK; INSERT INTO charges VALUES ('e')").await;
    StatusCode::TOO_MANY_REQUESTS.into_response()
}

/// A key used again after its record's retention, before the sweep took
/// the expired row: the new claim takes the row over inside its
/// transaction, and its handler rolls that back and charges itself. The
/// key is made final all the same (the end mark matched only our own or a
/// claim row, and the rolled-back take-over left the expired record
/// there: the mark changed nothing, and the next retry charged again).
async fn a_key_made_final_over_an_expired_record_is_final<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::store(&db).await;
    let pool = db.pool(2).await;
    let calls = Calls::default();
    let app = |layer| {
        Router::new()
            .route("/pay", post(charge_then_rollback_and_429::<C>).layer(layer))
            .layer(Extension(calls.clone()))
    };
    // The first use's record is kept 1 ms; the second use keeps its key
    // final for the default retention (a key made final without a record
    // stays final as long as a record would).
    let short = app(layer(store.clone()).retention(std::time::Duration::from_millis(1)));
    assert_eq!(send(&short, "again").await.0, StatusCode::OK);
    // The record's 1 ms retention passes (the sweep runs at most every 5 s).
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    answered_final(&app(layer(store)), "again", 3).await;
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the second use ran once");
    assert_eq!(charges(&pool).await, 2);
}

/// A key made final without a record (its handler committed itself, then
/// answered 429) stays final as long as the layer keeps records, not a
/// fixed day: with a week's retention a retry on the second day would have
/// charged again.
async fn a_key_made_final_stays_final_for_the_layers_retention<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::store(&db).await;
    let pool = db.pool(2).await;
    let week = std::time::Duration::from_secs(7 * 24 * 3600);
    charged_once::<C>(layer(store).retention(week), &pool, COMMITS).await;
    let left: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM (max(expires_at) - now()))::float8 FROM trl_idempotency",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        left > (week.as_secs() - 3600) as f64,
        "final for {left} s, not the week's retention"
    );
}

/// The end mark of a key whose handler charged outside the claim's
/// transaction fails once with `lock_not_available` (a trigger stands for
/// a role's `lock_timeout` passing while the sweep holds the row). It is
/// tried again under the hold: the hold is not let go of at the first
/// error, which left the key free with nothing committed for it, and the
/// retry charged again.
async fn an_end_mark_that_fails_once_is_written_under_the_hold<C: PgClient>() {
    let db = Pg::create(&[]).await;
    let store = C::store(&db).await;
    let pool = db.pool(2).await;
    sqlx::raw_sql(
        "CREATE SEQUENCE end_fails; \
         CREATE FUNCTION fail_first_end() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.state = 2 AND nextval('end_fails') = 1 THEN \
         RAISE EXCEPTION 'the first end mark fails' USING ERRCODE = '55P03'; END IF; RETURN NEW; END $$; \
         CREATE TRIGGER fail_first_end BEFORE INSERT OR UPDATE ON trl_idempotency \
         FOR EACH ROW EXECUTE FUNCTION fail_first_end();",
    )
    .execute(&pool)
    .await
    .unwrap();
    charged_once::<C>(
        layer(store),
        &pool,
        "ROLLBACK; INSERT INTO charges VALUES ('r')",
    )
    .await;
}

per_adapter!(
    an_end_mark_that_fails_once_is_written_under_the_hold,
    a_handler_that_commits_then_answers_429_never_runs_again,
    a_key_made_final_over_an_expired_record_is_final,
    a_key_made_final_stays_final_for_the_layers_retention,
);

#[cfg(feature = "sqlx-sqlite")]
mod sqlite {
    use super::*;
    use crate::SqlxTransaction;

    type LiteTx = SqlxTransaction<sqlx::Sqlite>;

    async fn count(pool: &sqlx::SqlitePool) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM charges")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    /// Charges, commits the request's transaction itself, answers 429.
    async fn commits_then_429(Extension(calls): Extension<Calls>, tx: LiteTx) -> StatusCode {
        calls.fetch_add(1, Ordering::SeqCst);
        let mut c = tx.conn().await.unwrap();
        sqlx::raw_sql(COMMITS).execute(&mut *c).await.unwrap();
        StatusCode::TOO_MANY_REQUESTS
    }

    /// Three requests with one key to [`commits_then_429`] behind `layer`:
    /// each answered the key's final answer, charged once.
    async fn charged_once_on_sqlite(
        layer: tower_redis_lock::IdempotencyLayer,
        pool: &sqlx::SqlitePool,
    ) {
        let calls = Calls::default();
        let app = Router::new()
            .route("/pay", post(commits_then_429).layer(layer))
            .layer(Extension(calls.clone()));
        answered_final(&app, "c429", 3).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
        assert_eq!(count(pool).await, 1, "charged once");
    }

    #[tokio::test]
    async fn a_handler_that_commits_then_answers_429_never_runs_again_on_sqlite() {
        let (store, pool) = super::super::sqlite::store("commit-429").await;
        charged_once_on_sqlite(layer(store), &pool).await;
    }

    /// As on PostgreSQL: a key made final without a record stays final for
    /// the layer's retention.
    #[tokio::test]
    async fn a_key_made_final_stays_final_for_the_layers_retention_on_sqlite() {
        let (store, pool) = super::super::sqlite::store("final-week").await;
        let week = std::time::Duration::from_secs(7 * 24 * 3600);
        charged_once_on_sqlite(layer(store).retention(week), &pool).await;
        let expires: i64 = sqlx::query_scalar("SELECT max(expires_at) FROM trl_idempotency")
            .fetch_one(&pool)
            .await
            .unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        let left = expires - now;
        assert!(
            left > (week.as_millis() as i64) - 3_600_000,
            "final for {left} ms, not the week's retention"
        );
    }

    /// Tells a handler when to go on.
    #[derive(Clone, Default)]
    struct Gate {
        entered: Arc<tokio::sync::Notify>,
        go: Arc<tokio::sync::Notify>,
    }

    /// A claim whose lease lapsed before its handler first used the
    /// transaction (its renewals refused for a whole TTL, or its process
    /// frozen; here the row's expiry is moved back by hand) was taken over
    /// by a request on another instance, which charged. The first
    /// handler's `conn()` then fails: it cannot charge and commit itself
    /// a second time.
    #[tokio::test]
    async fn a_claim_taken_over_before_its_handler_used_the_transaction_cannot_charge() {
        use crate::SqliteBackend;
        async fn late_self_commit(Extension(gate): Extension<Gate>, tx: LiteTx) -> StatusCode {
            gate.entered.notify_one();
            gate.go.notified().await;
            let Ok(mut c) = tx.conn().await else {
                return StatusCode::SERVICE_UNAVAILABLE;
            };
            sqlx::raw_sql("INSERT INTO charges VALUES ('t'); COMMIT")
                .execute(&mut *c)
                .await
                .unwrap();
            StatusCode::CREATED
        }
        async fn charge(tx: LiteTx) -> StatusCode {
            let mut c = tx.conn().await.unwrap();
            sqlx::raw_sql("INSERT INTO charges VALUES ('t')")
                .execute(&mut *c)
                .await
                .unwrap();
            StatusCode::CREATED
        }
        // Two instances over one database file.
        let (store_a, pool) = super::super::sqlite::store("taken-over").await;
        let path = super::super::sqlite::path_of("taken-over");
        let store_b = SqliteBackend::new(super::super::sqlite::pool(&path).await);
        let gate = Gate::default();
        let app_a = Router::new()
            .route("/pay", post(late_self_commit).layer(layer(store_a)))
            .layer(Extension(gate.clone()));
        let app_b = Router::new().route("/pay", post(charge).layer(layer(store_b)));

        let a = tokio::spawn({
            let app_a = app_a.clone();
            async move { send(&app_a, "taken").await }
        });
        gate.entered.notified().await;
        sqlx::query("UPDATE trl_idempotency SET expires_at = 0")
            .execute(&pool)
            .await
            .unwrap();
        let (status, body) = send(&app_b, "taken").await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "the other instance took it over: {body}"
        );
        gate.go.notify_one();
        let (status, body) = a.await.unwrap();
        assert_ne!(status, StatusCode::CREATED, "{body}");
        assert_eq!(count(&pool).await, 1, "charged once");
    }

    /// A handler that ends the transaction itself, charges in autocommit
    /// and answers `answer`, while another connection holds SQLite's write
    /// lock past the pool's `busy_timeout`: making the key final (its
    /// final record for a 200, its end mark for a 429 that is not stored)
    /// is refused (busy) at first, and lands once the lock is free, before
    /// the claim's hold lapses. Then no retry runs again.
    async fn the_key_is_made_final_once_the_database_is_free(name: &str, answer: StatusCode) {
        use std::time::Duration;
        let (store, pool, options) = busy_prone(name).await;
        sqlx::raw_sql("CREATE TABLE charges (key TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        #[derive(Clone)]
        struct Blocker(sqlx::sqlite::SqliteConnectOptions, Calls, StatusCode);
        async fn handler(Extension(blocker): Extension<Blocker>, tx: LiteTx) -> StatusCode {
            blocker.1.fetch_add(1, Ordering::SeqCst);
            let mut c = tx.conn().await.unwrap();
            sqlx::raw_sql("ROLLBACK; INSERT INTO charges VALUES ('b')")
                .execute(&mut *c)
                .await
                .unwrap();
            drop(c);
            let _done = another_writer_for_1s(&blocker.0).await;
            blocker.2
        }
        let calls = Calls::default();
        let app = Router::new()
            .route(
                "/pay",
                post(handler).layer(layer(store).ttl(Duration::from_secs(3))),
            )
            .layer(Extension(Blocker(options, calls.clone(), answer)));
        answered_final(&app, "busy", 1).await;
        // Past the claim's hold: a retry is answered the final record.
        tokio::time::sleep(Duration::from_millis(3_500)).await;
        answered_final(&app, "busy", 1).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
        assert_eq!(count(&pool).await, 1, "charged once");
    }

    /// A store on a database of its own whose pool gives up on the write
    /// lock after 100 ms (SQLite's `busy_timeout`), the pool, and the
    /// options that open another connection to it.
    async fn busy_prone(
        name: &str,
    ) -> (
        crate::SqliteBackend,
        sqlx::SqlitePool,
        sqlx::sqlite::SqliteConnectOptions,
    ) {
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(super::super::sqlite::temp_db(name))
            .create_if_missing(true)
            .busy_timeout(std::time::Duration::from_millis(100));
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_with(options.clone())
            .await
            .unwrap();
        let store = crate::SqliteBackend::new(pool.clone());
        store.migrate().await.unwrap();
        (store, pool, options)
    }

    /// Another writer holds the write lock of the database `options` open
    /// for 1 s, from when this returns: the receiver hears when it let go.
    async fn another_writer_for_1s(
        options: &sqlx::sqlite::SqliteConnectOptions,
    ) -> tokio::sync::oneshot::Receiver<()> {
        use sqlx::Connection;
        let (locked, held) = tokio::sync::oneshot::channel();
        let (done, finished) = tokio::sync::oneshot::channel();
        let options = options.clone();
        tokio::spawn(async move {
            let mut other = sqlx::SqliteConnection::connect_with(&options)
                .await
                .unwrap();
            sqlx::raw_sql("BEGIN IMMEDIATE")
                .execute(&mut other)
                .await
                .unwrap();
            let _ = locked.send(());
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            sqlx::raw_sql("COMMIT").execute(&mut other).await.unwrap();
            let _ = done.send(());
        });
        held.await.unwrap();
        finished
    }

    /// A claim freed while another writer holds SQLite's write lock (the
    /// handler answered 429, not kept): its row's delete fails busy. It is
    /// tried again once the lock is free, so a retry runs then, not 409
    /// until the claim's lease ends (10 s here) after the client was told
    /// it may retry.
    #[tokio::test]
    async fn a_claim_freed_while_the_database_is_busy_is_freed_once_it_is_free() {
        use std::time::{Duration, Instant};
        let (store, _pool, options) = busy_prone("unhold-busy").await;
        type Done = Arc<tokio::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>>;
        #[derive(Clone)]
        struct Blocker(sqlx::sqlite::SqliteConnectOptions, Calls, Done);
        async fn handler(Extension(blocker): Extension<Blocker>) -> StatusCode {
            if blocker.1.fetch_add(1, Ordering::SeqCst) == 0 {
                *blocker.2.lock().await = Some(another_writer_for_1s(&blocker.0).await);
            }
            StatusCode::TOO_MANY_REQUESTS
        }
        let calls = Calls::default();
        let done = Done::default();
        let app = Router::new()
            .route(
                "/pay",
                post(handler).layer(layer(store).ttl(Duration::from_secs(10))),
            )
            .layer(Extension(Blocker(options, calls.clone(), done.clone())));
        assert_eq!(send(&app, "freed").await.0, StatusCode::TOO_MANY_REQUESTS);
        let finished = done.lock().await.take().expect("the blocker started");
        finished.await.unwrap();
        let free_again = Instant::now();
        let mut status = StatusCode::CONFLICT;
        while status == StatusCode::CONFLICT && free_again.elapsed() < Duration::from_secs(5) {
            status = send(&app, "freed").await.0;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "the retry ran");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_final_record_refused_while_the_database_is_busy_is_written_later() {
        the_key_is_made_final_once_the_database_is_free("final-busy", StatusCode::OK).await;
    }

    #[tokio::test]
    async fn an_end_mark_refused_while_the_database_is_busy_is_written_later() {
        let answer = StatusCode::TOO_MANY_REQUESTS;
        the_key_is_made_final_once_the_database_is_free("end-busy", answer).await;
    }

    /// A handler that rolls the transaction back, opens one of its own,
    /// writes in it, and answers 429 (not stored): nothing committed, the
    /// key is freed at once and the retry runs (the claim row's delete ran
    /// inside the handler's open transaction and was undone with it: the
    /// retry was answered 409 for the claim's TTL, before).
    #[tokio::test]
    async fn a_handlers_own_uncommitted_transaction_does_not_keep_the_key() {
        let (store, pool) = super::super::sqlite::store("own-open").await;
        async fn handler(Extension(calls): Extension<Calls>, tx: LiteTx) -> StatusCode {
            let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
            let mut c = tx.conn().await.unwrap();
            if first {
                sqlx::raw_sql("ROLLBACK; BEGIN; INSERT INTO charges VALUES ('o')")
                    .execute(&mut *c)
                    .await
                    .unwrap();
                return StatusCode::TOO_MANY_REQUESTS;
            }
            sqlx::query("INSERT INTO charges VALUES ('o')")
                .execute(&mut *c)
                .await
                .unwrap();
            StatusCode::CREATED
        }
        let calls = Calls::default();
        let app = Router::new()
            .route(
                "/pay",
                post(handler).layer(layer(store).join_timeout(std::time::Duration::ZERO)),
            )
            .layer(Extension(calls.clone()));
        let (status, body) = send(&app, "own").await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
        let (status, body) = send(&app, "own").await;
        assert_eq!(status, StatusCode::CREATED, "the retry runs: {body}");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(count(&pool).await, 1, "the first run's write was undone");
    }

    /// A handler that keeps its `conn()` guard past its answer (here in a
    /// task; a streamed response body can hold it too): the request cannot
    /// commit, and is answered 503 `outcome-unknown` within the store's
    /// commit timeout (it was never answered, before); once the guard is
    /// dropped its transaction is rolled back, the key is freed, and the
    /// retry runs and charges once.
    #[tokio::test]
    async fn a_guard_kept_past_the_answer_is_answered_then_rolled_back() {
        use std::time::Duration;
        #[derive(Clone, Default)]
        struct Keep(Arc<std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>>);
        let (store, pool) = super::super::sqlite::store("guard-kept").await;
        let store = store.commit_timeout(Duration::from_millis(300));
        async fn handler(Extension(keep): Extension<Keep>, tx: LiteTx) -> StatusCode {
            let mut c = tx.conn().await.unwrap();
            sqlx::query("INSERT INTO charges VALUES ('g')")
                .execute(&mut *c)
                .await
                .unwrap();
            if let Some(until) = keep.0.lock().unwrap().take() {
                tokio::spawn(async move {
                    let _ = until.await;
                    drop(c);
                });
            }
            StatusCode::CREATED
        }
        let (let_go, until) = tokio::sync::oneshot::channel();
        let keep = Keep(Arc::new(std::sync::Mutex::new(Some(until))));
        let app = Router::new()
            .route(
                "/pay",
                post(handler).layer(layer(store).join_timeout(Duration::ZERO)),
            )
            .layer(Extension(keep));
        let first = tokio::time::timeout(Duration::from_secs(10), send(&app, "kept")).await;
        let (status, body) = first.expect("answered, not left waiting");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body.contains("outcome-unknown"), "{body}");
        let _ = let_go.send(());
        let mut answers = Vec::new();
        for _ in 0..50 {
            let (status, _) = send(&app, "kept").await;
            answers.push(status.as_u16());
            if status == StatusCode::CREATED {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(answers.last(), Some(&201), "the retry runs: {answers:?}");
        assert_eq!(count(&pool).await, 1, "charged once");
    }

    /// SQLite rolls the transaction back itself (`RAISE(ROLLBACK)` in a
    /// trigger): nothing committed, so the key is freed (503, like
    /// PostgreSQL's aborted transaction) and the retry runs.
    #[tokio::test]
    async fn sqlites_own_rollback_frees_the_key_and_the_retry_runs() {
        let (store, pool) = super::super::sqlite::store("raise-rollback").await;
        sqlx::raw_sql(
            "CREATE TABLE fuse (armed INTEGER NOT NULL); INSERT INTO fuse VALUES (1);
             CREATE TRIGGER refuse BEFORE INSERT ON charges
               WHEN (SELECT armed FROM fuse) = 1
               BEGIN SELECT RAISE(ROLLBACK, 'refused'); END;",
        )
        .execute(&pool)
        .await
        .unwrap();
        async fn handler(Extension(calls): Extension<Calls>, tx: LiteTx) -> StatusCode {
            calls.fetch_add(1, Ordering::SeqCst);
            let mut c = tx.conn().await.unwrap();
            match sqlx::query("INSERT INTO charges VALUES ('r')")
                .execute(&mut *c)
                .await
            {
                Ok(_) => StatusCode::CREATED,
                Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
            }
        }
        let calls = Calls::default();
        let app = Router::new()
            .route("/pay", post(handler).layer(layer(store)))
            .layer(Extension(calls.clone()));
        let (status, body) = send(&app, "rr").await;
        assert_ne!(status, StatusCode::CREATED, "{body}");
        assert!(!body.contains("transaction-ended"), "not final: {body}");
        sqlx::query("UPDATE fuse SET armed = 0")
            .execute(&pool)
            .await
            .unwrap();
        let (status, body) = send(&app, "rr").await;
        assert_eq!(status, StatusCode::CREATED, "the retry runs: {body}");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(count(&pool).await, 1);
    }
}
