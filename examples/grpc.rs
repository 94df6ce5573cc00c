//! Payments over gRPC: `payments.v1.Payments` (tonic) behind an
//! `IdempotencyLayer`, the `payments` example's behaviour for gRPC clients.
//!
//! ```text
//! cargo run --example grpc                                  # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example grpc   # Redis
//! ```
//!
//! - listens on `$ADDR` (default `127.0.0.1:50051`, HTTP/2 without TLS) and
//!   prints one line with the address and the store;
//! - `Create(CreatePaymentRequest { amount, currency, delay_ms })` requires
//!   `idempotency-key` metadata; the caller's identity comes from
//!   `x-user-id` metadata, **trusted in this demo only** (in production
//!   take it from your auth layer, `key::Identity<T>`). The handler waits
//!   `delay_ms` and answers a `Payment` with a fresh id; an amount of 0 or
//!   less is `INVALID_ARGUMENT`, stored like any deterministic answer;
//! - a retry with the same key and message gets the same answer with
//!   `idempotent-replayed: true` metadata, and the handler does not run
//!   again; a duplicate that arrives while the first runs waits for it (up
//!   to 5 s) and gets the same answer, marked replayed; past that bound
//!   `ABORTED` with `retry-after` metadata; same key, other message
//!   `FAILED_PRECONDITION`; no key `INVALID_ARGUMENT`; no `x-user-id`
//!   `UNAUTHENTICATED`; Redis down `UNAVAILABLE`; a gzip-compressed request
//!   `UNIMPLEMENTED` (send it uncompressed). The payment runs to its end and
//!   is recorded even if the client goes away;
//! - `Stats(StatsRequest {})` answers `StatsReply { executions }`: how many
//!   payments the handler created in this process;
//! - SIGTERM or Ctrl-C shuts it down gracefully: no new calls, the calls in
//!   flight finish, their records and releases are delivered, exit 0.
//!
//! Try it with grpcurl (the proto is in `examples/grpc_payments/mod.rs`):
//! ```text
//! grpcurl -plaintext -proto payments.proto -H 'x-user-id: alice' \
//!   -H 'idempotency-key: 8e03978e-40d5-43e8-bc93-6894a57f9324' \
//!   -d '{"amount": 500, "currency": "EUR"}' 127.0.0.1:50051 payments.v1.Payments/Create
//! ```

mod grpc_payments;
mod support;

use std::time::Duration;

#[tokio::main]
async fn main() {
    support::init_tracing();
    let (store, store_name) = support::or_exit("grpc", support::replay_store_from_env().await);
    let drain = store.backend();
    let idempotency = store
        .idempotency_layer(grpc_payments::key())
        // Only `Create` is deduplicated; `Stats` goes straight through.
        .skip_when(grpc_payments::not_create)
        // Renewed while the handler runs; also the wait of a crashed one.
        .ttl(Duration::from_secs(70))
        // A duplicate in flight waits up to 5 s for the first one's answer.
        .join_timeout(Duration::from_secs(5));

    let (listener, local) = support::bind("grpc", "127.0.0.1:50051").await;
    println!("grpc listening on {local} (payments.v1.Payments) with the {store_name} store");
    let served = grpc_payments::serve(
        listener,
        grpc_payments::for_tonic(idempotency),
        grpc_payments::Demo::default(),
        support::shutdown_signal(),
    )
    .await;
    if let Err(e) = served {
        eprintln!("grpc: server error: {e}");
        std::process::exit(1);
    }
    match drain.drain(Duration::from_secs(5)).await {
        Ok(()) => eprintln!("grpc: shut down; every release delivered"),
        Err(e) => eprintln!("grpc: shut down; {e}"),
    }
}
