//! Idempotency mode: stored-response replay for payment endpoints.
//!
//! The lock alone stops duplicates only while the first request runs; a
//! retry after it completed would run the handler again. With
//! [`IdempotencyLayer`], the first completed response for an
//! `Idempotency-Key` is stored (status, chosen headers, body) for a retention
//! window, and retries get it back byte for byte with
//! `Idempotent-Replayed: true`, without reaching the handler.
//!
//! Conventions follow the IETF `Idempotency-Key` HTTP header draft
//! (draft-ietf-httpapi-idempotency-key-header): 400 when a required key is
//! missing or malformed, 409 while the first request is in flight, 422 when
//! a key is reused with a different payload. Like Stripe, keys are up to 255
//! bytes and kept 24 h by default, and the key is compared with a
//! fingerprint of the request; like the AWS Lambda Powertools idempotency
//! utility, the payload is validated on every path that finds an existing
//! record (here: in the same Lua round trip as the claim).
//!
//! | file | holds |
//! |---|---|
//! | `layer.rs` | [`IdempotencyLayer`]: key scope, required/optional key, fingerprint headers, stored headers, limits, retention, status policy |
//! | `service.rs` | [`Idempotency`], the `tower::Service`, and its [`ResponseFuture`]: key → body + fingerprint → claim → replay / reject / run and record |
//! | `body.rs` | [`ResponseBody`]: the answer, replayed or recorded in one piece, or the handler's body passed through |
//! | `key.rs` | [`IdempotencyKey`]: header parsing (RFC 8941 sf-string or bare token, ≤ 255 bytes); axum extractor |
//! | `store.rs` | [`ReplayBackend`]: claim / complete / abandon, for [`MemoryBackend`](crate::MemoryBackend) and [`RedisBackend`](crate::RedisBackend) |
//! | `record.rs` | what is kept, and its encoding |
//!
//! Its answers are [`Rejection`](crate::Rejection)s, like the lock's.
//!
//! What it does not promise: a claim outlived by its handler (longer than
//! [`IdempotencyLayer::ttl`]) can let a retry run concurrently, and a
//! record lost to Redis eviction, failover or restart lets a retry run again.
//! For money, also make the write itself idempotent (a unique constraint on
//! the key, which the [`IdempotencyKey`] extractor hands to the handler).

mod body;
#[cfg(feature = "axum")]
mod extract;
mod key;
mod layer;
pub(crate) mod memory;
mod record;
#[cfg(feature = "redis")]
mod redis;
mod service;
mod store;

pub use body::ResponseBody;
pub use key::IdempotencyKey;
pub use layer::IdempotencyLayer;
pub use service::{Idempotency, ResponseFuture};
pub use store::ReplayBackend;
