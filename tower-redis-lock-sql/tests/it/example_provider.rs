//! The `exactly_once` example against a provider that answers like a real
//! one: a loopback server shaped like Stripe's charges API (`POST`,
//! `Idempotency-Key`, answers `{"id": "ch_..", "object": "charge",
//! "amount": ..}`, the same charge again for a key it saw). Every payment
//! is answered 201 with the provider's charge id, a retry replays it, and
//! the provider is called once per key.

use crate::common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use common::examples::example_binary;
use common::pg::Database;
use common::{free_port, replayed, req, try_send};

/// Calls and charges per idempotency key.
#[derive(Clone, Default)]
struct Stripe {
    calls: Arc<Mutex<HashMap<String, u64>>>,
    charges: Arc<Mutex<HashMap<String, String>>>,
}

async fn create_charge(
    State(stripe): State<Stripe>,
    headers: http::HeaderMap,
    axum::Json(body): axum::Json<serde_json::Value>,
) -> axum::Json<serde_json::Value> {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    *stripe.calls.lock().unwrap().entry(key.clone()).or_default() += 1;
    let mut charges = stripe.charges.lock().unwrap();
    let n = charges.len();
    let id = charges
        .entry(key)
        .or_insert_with(|| format!("ch_3Qstripe{n:06}"))
        .clone();
    axum::Json(serde_json::json!({
        "id": id,
        "object": "charge",
        "amount": body["amount"],
        "currency": "eur",
        "paid": true,
        "status": "succeeded",
    }))
}

/// The example, killed on drop.
struct Example(Child);

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_example_answers_with_the_charge_id_of_a_stripe_shaped_provider() {
    let bin = example_binary("exactly_once");
    common::run(|| async move {
        let db = Database::create().await;
        let stripe = Stripe::default();
        let provider = common::serve(
            Router::new()
                .route("/v1/charges", post(create_charge))
                .with_state(stripe.clone()),
        )
        .await;
        let port = free_port();
        let mut child = Command::new(&bin)
            .env("ADDR", format!("127.0.0.1:{port}"))
            .env("DATABASE_URL", db.url())
            .env("STORE", "postgres")
            .env("PROVIDER_URL", format!("http://{provider}/v1/charges"))
            .env("PROVIDER_KEY", "downstream")
            .env("RUST_LOG", "error")
            .env_remove("REDIS_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the exactly_once example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let _example = Example(child);
        assert!(line.contains("listening on"), "first line {line:?}");
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let payment = |key: &str| {
            req(
                "POST",
                "/payments?delay_ms=0",
                &[
                    ("x-user-id", "alice"),
                    ("idempotency-key", key),
                    ("content-type", "application/json"),
                ],
                r#"{"amount":500,"currency":"EUR"}"#,
            )
        };
        let mut answered = Vec::new();
        for key in ["pay-1", "pay-2", "pay-3"] {
            let first = try_send(addr, payment(key)).await.expect("an answer");
            let retry = try_send(addr, payment(key)).await.expect("an answer");
            let body = |r: &common::Reply| String::from_utf8_lossy(&r.body).into_owned();
            let charge = serde_json::from_slice::<serde_json::Value>(&first.body)
                .ok()
                .and_then(|v| v["provider_charge"].as_str().map(str::to_owned));
            answered.push((
                key,
                first.status,
                charge,
                retry.status,
                replayed(&retry),
                body(&first),
            ));
        }
        // Charges the example's handler wrote (its `/stats`).
        let stats = try_send(addr, req("GET", "/stats", &[], ""))
            .await
            .expect("an answer");
        let executions = serde_json::from_slice::<serde_json::Value>(&stats.body)
            .ok()
            .and_then(|v| v["executions"].as_u64());
        let calls = stripe.calls.lock().unwrap().clone();
        let ids: Vec<String> = stripe.charges.lock().unwrap().values().cloned().collect();
        let report = format!(
            "answers {answered:#?}; provider calls per key {calls:?}; handler charges \
             {executions:?}"
        );
        for (key, status, charge, retry, was_replayed, _) in &answered {
            assert_eq!(*status, 201, "{key}: {report}");
            let charge = charge.as_deref().unwrap_or_default();
            assert!(
                charge.starts_with("ch_") && ids.iter().any(|id| id == charge),
                "{key}: the 201 names the provider's charge id: {report}"
            );
            assert!(*retry == 201 && *was_replayed, "{key}: replayed: {report}");
        }
        assert_eq!(calls.len(), 3, "{report}");
        assert!(
            calls.values().all(|n| *n == 1),
            "one call per key: {report}"
        );
    });
}
