//! Payments: an idempotent `POST /payments` with stored-response replay.
//!
//! ```text
//! cargo run --example payments                                  # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example payments   # Redis
//! ```
//!
//! - listens on `$ADDR` (default `127.0.0.1:3001`) and prints one line with
//!   the address and the store;
//! - `POST /payments?delay_ms=200` takes JSON `{"amount": n, "currency": "..."}`
//!   (read as JSON whatever the `Content-Type`; anything else is a 422 that
//!   is stored like any deterministic answer) and requires an
//!   `Idempotency-Key` header. The caller's identity comes
//!   from the `x-user-id` header, **trusted in this demo only**: in
//!   production take it from your auth layer (`key::Identity<T>`), or one
//!   client could read another's stored responses by sending their id and
//!   key. The handler waits `delay_ms` (default 200), creates a payment with
//!   a fresh id and answers `201` JSON with `Location: /payments/{id}`;
//! - a retry with the same key and body gets the same 201, byte for byte,
//!   with `Idempotent-Replayed: true`, and the handler does not run again;
//!   a duplicate that arrives while the first is running waits for it (up
//!   to 5 s) and gets the same 201, marked replayed; past that bound: 409 +
//!   `Retry-After`; same key, other body or query: 422; no or malformed
//!   key: 400 (all `application/problem+json`). The payment runs to its end
//!   and is recorded even if the client goes away mid-request;
//! - `GET /stats` returns `{"executions": N}`: how many payments the handler
//!   created in this process.
//! - SIGTERM or Ctrl-C shuts it down gracefully: no new connections, the
//!   requests in flight finish (up to 30 s), their releases are delivered
//!   (`Backend::drain`), exit status 0.
//!
//! Try it:
//! ```text
//! curl -i -X POST localhost:3001/payments -H 'x-user-id: alice' \
//!   -H 'Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324' \
//!   -H 'content-type: application/json' -d '{"amount":500,"currency":"EUR"}'
//! ```
//! (twice), then `curl localhost:3001/stats`.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use tower_redis_lock::idempotency::IdempotencyKey;
use tower_redis_lock::key::{Header, RequestMethod, Route};

#[derive(Clone, Default)]
struct Stats {
    executions: Arc<AtomicU64>,
}

#[derive(Deserialize)]
struct PayParams {
    delay_ms: Option<u64>,
}

#[derive(Deserialize)]
struct NewPayment {
    amount: u64,
    currency: String,
}

/// `pay_` and 24 random hex digits.
fn payment_id() -> String {
    format!("pay_{}", support::random_hex::<12>())
}

async fn create_payment(
    State(stats): State<Stats>,
    Query(p): Query<PayParams>,
    key: IdempotencyKey,
    body: Bytes,
) -> Response {
    // JSON whatever the Content-Type says, so `curl -d` works too.
    let payment: NewPayment = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => {
            // A deterministic 4xx: stored and replayed like a success.
            let problem = serde_json::json!({
                "type": "about:blank",
                "title": "Invalid payment",
                "status": 422,
                "detail": format!("expected {{\"amount\": n, \"currency\": \"...\"}}: {e}"),
            });
            return (
                StatusCode::UNPROCESSABLE_ENTITY,
                [(header::CONTENT_TYPE, "application/problem+json")],
                problem.to_string(),
            )
                .into_response();
        }
    };
    stats.executions.fetch_add(1, Ordering::SeqCst);
    let delay = p.delay_ms.unwrap_or(200).min(60_000);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let id = payment_id();
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{id}"))],
        Json(serde_json::json!({
            "id": id,
            "amount": payment.amount,
            "currency": payment.currency,
            "status": "succeeded",
            "idempotency_key": key.as_str(),
        })),
    )
        .into_response()
}

async fn stats(State(stats): State<Stats>) -> Json<serde_json::Value> {
    Json(serde_json::json!({"executions": stats.executions.load(Ordering::SeqCst)}))
}

#[tokio::main]
async fn main() {
    support::init_tracing();
    let (store, store_name) = support::or_exit("payments", support::replay_store_from_env().await);
    let drain = store.backend();
    let idempotency = store
        .idempotency_layer((RequestMethod, Route, Header::trusted_identity("x-user-id")))
        // Renewed while the handler runs; also the wait of a crashed one.
        .ttl(Duration::from_secs(70))
        // A duplicate in flight waits up to 5 s for the first one's answer.
        .join_timeout(Duration::from_secs(5));

    let app = Router::new()
        .route("/payments", post(create_payment).layer(idempotency))
        .route("/stats", get(stats))
        .with_state(Stats::default());

    let (listener, local) = support::bind("payments", "127.0.0.1:3001").await;
    println!("payments listening on http://{local} with the {store_name} store");
    support::serve("payments", listener, app, drain).await;
}
