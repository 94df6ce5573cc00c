//! Every way a handler can end the request's transaction itself, or lose
//! it, then answer something the layer does not record, on each SQL store
//! over real HTTP (real PostgreSQL, real SQLite files).
//!
//! - The handler `INSERT`s a charge through its transaction, runs `COMMIT`
//!   itself on that connection, then answers 429 (not recorded by default),
//!   `SafeToRetry`, a service error, or panics: its charge is committed, so
//!   the key is final: 500 problem+json `transaction-ended` now, for the
//!   same request twice more and once more after the claim's TTL, the
//!   handler run once, one charge.
//! - PostgreSQL: the handler `ROLLBACK`s, writes its charge in autocommit,
//!   then answers 429: the same.
//! - Every store: the handler `ROLLBACK`s and writes nothing after, then
//!   answers 429: nothing committed, the key is free and the retry runs.
//! - SQLite: a rollback the handler did not ask for (a trigger's
//!   `RAISE(ROLLBACK, ..)`): the handler's statement fails and it answers
//!   500; nothing committed, so 503 problem+json (as PostgreSQL answers a
//!   transaction that failed), the key freed, and the retry on a fixed
//!   table runs and answers 201.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::error_handling::HandleErrorLayer;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use common::charging::serve_charging;
use common::stores::{
    every_store, exec, insert_charge, key_of, layer, pay, pg_stores, send, Env, Kind, Pools,
};
use tower::ServiceBuilder;
use tower_redis_lock::idempotency::SafeToRetry;

/// The layer's claim TTL in these tests: short, so that the test can wait
/// it out and see that nothing changes.
const TTL: Duration = Duration::from_millis(1_000);

/// What the handler does to the transaction after its `INSERT`.
#[derive(Clone, Copy, Debug)]
enum Before {
    /// `COMMIT` on the transaction's connection.
    Commit,
    /// `ROLLBACK`, then the charge again in autocommit on that connection.
    RollbackThenWrite,
    /// `ROLLBACK`, and nothing after.
    Rollback,
}

/// How the handler then answers.
#[derive(Clone, Copy, Debug)]
enum End {
    TooMany,
    SafeToRetry,
    ServiceError,
    Panic,
}

#[derive(Clone)]
struct App {
    runs: Arc<AtomicU64>,
    before: Before,
    end: End,
}

/// The handler's work, shared by the axum handler and the service: the
/// number of this run (0 the first).
async fn work(app: &App, req: Request) -> Result<u64, String> {
    let n = app.runs.fetch_add(1, Ordering::SeqCst);
    let (parts, _body) = req.into_parts();
    let key = key_of(&parts.headers);
    let ext = &parts.extensions;
    exec(ext, &insert_charge(&key)).await?;
    if n > 0 {
        // A retry that runs: an ordinary, successful handler.
        return Ok(n);
    }
    match app.before {
        Before::Commit => exec(ext, "COMMIT").await?,
        Before::RollbackThenWrite => {
            exec(ext, "ROLLBACK").await?;
            exec(ext, &insert_charge(&key)).await?;
        }
        Before::Rollback => exec(ext, "ROLLBACK").await?,
    }
    Ok(n)
}

async fn handler(State(app): State<App>, req: Request) -> Response {
    match work(&app, req).await {
        Ok(0) => match app.end {
            End::TooMany => (StatusCode::TOO_MANY_REQUESTS, "slow down").into_response(),
            End::SafeToRetry => (
                StatusCode::SERVICE_UNAVAILABLE,
                SafeToRetry,
                "nothing happened (says the handler)",
            )
                .into_response(),
            End::Panic => panic!("the handler fails after its own COMMIT"),
            End::ServiceError => unreachable!("served by `service`"),
        },
        Ok(_) => (StatusCode::CREATED, "charged").into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e).into_response(),
    }
}

/// The route, behind the layer: an axum handler, or for a service error a
/// `tower::service_fn` that fails (`HandleErrorLayer` outside the layer
/// turns the error into a 500 of its own, `service error`).
fn router(app: App, layer: tower_redis_lock::IdempotencyLayer) -> Router {
    match app.end {
        End::ServiceError => {
            let svc = tower::service_fn(move |req: Request| {
                let app = app.clone();
                async move {
                    match work(&app, req).await {
                        Ok(0) => Err::<Response, tower::BoxError>("the service failed".into()),
                        Ok(_) => Ok((StatusCode::CREATED, "charged").into_response()),
                        Err(e) => Ok((StatusCode::INTERNAL_SERVER_ERROR, e).into_response()),
                    }
                }
            });
            let svc = ServiceBuilder::new()
                .layer(HandleErrorLayer::new(|e: tower::BoxError| async move {
                    (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("service error: {e}"),
                    )
                }))
                .layer(layer)
                .service(svc);
            Router::new().route_service("/w", svc)
        }
        _ => Router::new()
            .route("/w", post(handler).layer(layer))
            .with_state(app),
    }
}

async fn serve(env: &Env, before: Before, end: End) -> (std::net::SocketAddr, App) {
    env.batch("CREATE TABLE charges (k text NOT NULL)").await;
    let store = env.store(&Pools::default()).await;
    let app = App {
        runs: Arc::default(),
        before,
        end,
    };
    let addr = common::serve(router(app.clone(), layer(&store).ttl(TTL))).await;
    (addr, app)
}

/// The handler's charge is committed, whatever it answers next: the key
/// is final. Three answers, then one after the claim's TTL.
async fn final_after(kind: Kind, before: Before, end: End) {
    // What the handler committed: its charge, or nothing (a rollback).
    let charged = match before {
        Before::Rollback => 0,
        _ => 1,
    };
    let env = Env::new(kind).await;
    let (addr, app) = serve(&env, before, end).await;
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(send(addr, pay("k1", "")).await.0);
    }
    // Waiting out the claim's TTL is the point here: nothing may change
    // when it passes.
    tokio::time::sleep(TTL + Duration::from_millis(500)).await;
    answers.push(send(addr, pay("k1", "")).await.0);
    // Replayed or not, the same final answer.
    let answers: Vec<_> = answers
        .iter()
        .map(|s| s.trim_end_matches(" replayed").to_owned())
        .collect();
    let seen = (
        answers,
        app.runs.load(Ordering::SeqCst),
        env.charges().await,
    );
    let ended = "500 transaction-ended".to_owned();
    assert_eq!(
        seen,
        (vec![ended; 4], 1, charged),
        "{kind:?}, {before:?} then {end:?}: (answers, handler runs, charges)"
    );
}

every_store!(committed_then_429, |k| final_after(
    k,
    Before::Commit,
    End::TooMany
));
every_store!(committed_then_safe_to_retry, |k| final_after(
    k,
    Before::Commit,
    End::SafeToRetry
));
every_store!(committed_then_service_error, |k| final_after(
    k,
    Before::Commit,
    End::ServiceError
));
every_store!(committed_then_panic, |k| final_after(
    k,
    Before::Commit,
    End::Panic
));
pg_stores!(rolled_back_wrote_in_autocommit_then_429, |k| final_after(
    k,
    Before::RollbackThenWrite,
    End::TooMany
));

// PostgreSQL cannot see what a handler writes after its own `ROLLBACK`:
// a handler that rolls back makes the key final, as one that commits.
pg_stores!(
    rolled_back_then_429_is_final_on_postgresql,
    |k| final_after(k, Before::Rollback, End::TooMany)
);

/// SQLite sees every commit of the claim's connection: nothing of the
/// request committed, so the handler's 429 stands, then the retry runs
/// (201, not replayed) and charges once.
async fn rolled_back_is_free(kind: Kind) {
    let env = Env::new(kind).await;
    let (addr, app) = serve(&env, Before::Rollback, End::TooMany).await;
    let first = send(addr, pay("k1", "")).await.0;
    let retry = send(addr, pay("k1", "")).await.0;
    let seen = (
        first,
        retry,
        app.runs.load(Ordering::SeqCst),
        env.charges().await,
    );
    assert_eq!(
        seen,
        ("429".to_owned(), "201".to_owned(), 2, 1),
        "{kind:?}: (first, retry, handler runs, charges)"
    );
}

#[test]
fn rolled_back_then_429_frees_the_key_on_sqlite() {
    common::run(|| rolled_back_is_free(Kind::Sqlite));
}

/// SQLite: a trigger's `RAISE(ROLLBACK, ..)` ends the transaction under
/// the handler; it answers 500. Nothing committed: 503 problem+json, the
/// key free; once the table is fixed the retry runs and answers 201.
#[test]
fn sqlite_rollback_by_a_trigger_frees_the_key() {
    common::run(|| async {
        let env = Env::new(Kind::Sqlite).await;
        env.batch(
            "CREATE TABLE switch (fail INTEGER NOT NULL); INSERT INTO switch VALUES (1); \
             CREATE TABLE charges (k text NOT NULL); \
             CREATE TRIGGER refuse BEFORE INSERT ON charges \
             WHEN (SELECT fail FROM switch) = 1 \
             BEGIN SELECT RAISE(ROLLBACK, 'refused by the trigger'); END;",
        )
        .await;
        let store = env.store(&Pools::default()).await;
        // The same payments route, its handler counted.
        let (addr, app) = serve_charging(layer(&store).ttl(TTL)).await;
        let first = send(addr, pay("k1", "")).await.0;
        env.batch("UPDATE switch SET fail = 0").await;
        let retry = send(addr, pay("k1", "")).await.0;
        let seen = (first, retry, app.runs(), env.charges().await);
        assert_eq!(
            seen,
            (
                "503 unavailable retry-after".to_owned(),
                "201".to_owned(),
                2,
                1
            ),
            "(first, retry on the fixed table, handler runs, charges)"
        );
    });
}
