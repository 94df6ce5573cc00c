//! Stop the same HTTP request from running twice at the same time.
//!
//! `tower-redis-lock` is tower middleware (and axum extractors) for axum and
//! hyper services. For each request it derives a **lock key** from the parts
//! you pick (method, route template, user identity, a digest of the body, a
//! header), takes a short **lease** on that key in Redis (or in memory), runs
//! your handler, and gives the lease back when the response is done. A
//! duplicate that arrives while the lease is held gets **409 Conflict**
//! (`application/problem+json`, with `Retry-After`) without reaching the
//! handler: the double-clicked "Pay" button runs once.
//!
//! ```no_run
//! use axum::{routing::post, Router};
//! use tower_redis_lock::{key::{RequestMethod, Route, TrustedHeader}, RedisBackend, RedisLockLayer};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = RedisBackend::connect("redis://127.0.0.1:6379").await?;
//! let lock = RedisLockLayer::new(backend, (RequestMethod, Route, TrustedHeader::new("x-user-id")))
//!     .digest_body();
//!
//! let app: Router = Router::new().route("/pay", post(|| async { "paid" }).layer(lock));
//! # let _ = app; Ok(()) }
//! ```
//!
//! With one process, use [`MemoryBackend`] instead; with a fleet, every
//! instance points at the same Redis (or Redis Cluster / Sentinel through the
//! fred URL forms).
//!
//! # Request flow
//!
//! ```text
//! request ─► key derivation ─► acquire lease ──┬─ held by other ─► 409 problem+json, Retry-After
//!                              (1 round trip)  ├─ backend down ──► 503 (fail-closed) | run (fail-open)
//!                                              └─ acquired ──────► handler ─► response body
//!                                                                               │ last frame
//!             release (compare-and-delete) ◄────────────────────────────────────┘ or drop / panic
//! ```
//!
//! # What is promised
//!
//! - **Mutual exclusion while the lease is valid**: with one healthy Redis
//!   primary, at most one request per key is admitted at a time, across any
//!   number of instances sharing it.
//! - **No spurious 409 for sequential requests**: the lease is released
//!   *before* the end of the response body is reported to the server, so a
//!   client that read the whole response and repeats the request is admitted
//!   ([`ReleaseMode::FireAndForget`](lock::ReleaseMode::FireAndForget)
//!   trades this for latency, by opt-in).
//! - **Nothing outlives the TTL**: release on completion, inner error, client
//!   disconnect (future or body dropped) and handler panic; the TTL
//!   (default 10 s) is the safety net. `Drop` never blocks.
//! - **Only the owner releases**: a 128-bit CSPRNG token per lease; release
//!   and extend are compare-and-act Lua scripts.
//! - **Bounded waiting**: every backend call has a deadline (default
//!   200 ms); then 503 (fail-closed, default) or the handler runs unlocked
//!   (fail-open).
//! - **Bounded memory**: the body is buffered only for
//!   [`RedisLockLayer::digest_body`], up to its limit (413 beyond).
//! - **No raw request data in Redis**: keys are `prefix:{digest}`, a fixed
//!   length keyed BLAKE3 digest of a length-prefixed encoding of the parts.
//!
//! # What is not promised
//!
//! This is an **efficiency lock**, not a correctness guarantee. It can admit
//! a duplicate when a handler runs longer than the TTL, when Redis fails over
//! to a replica that had not yet received the lease, when Redis evicts the
//! key (`maxmemory-policy` other than `noeviction`), after a Redis restart
//! without persistence, or when the server clock jumps. Where a double
//! execution costs money, make the write itself idempotent (a unique
//! constraint on the idempotency key) and treat this layer as the cheap first
//! line. Two opt-ins narrow the gap: [`RedisLockLayer::renew`] keeps the lease
//! of a long handler alive and tells it through [`Lease::is_lost`] when it is
//! gone, and [`RedisLockLayer::fencing`] issues a per-key number that only
//! grows ([`Lease::fence`]) for the database write to check.
//!
//! For payment endpoints, [`IdempotencyLayer`] stores the first response
//! for an `Idempotency-Key` and replays it to retries (see [`replay`]).
//!
//! # Modules
//!
//! | module | holds |
//! |---|---|
//! | [`lock`] | the lock middleware: [`RedisLockLayer`], its service, future and body, [`Lease`], renewal, [`Locker`](lock::Locker) |
//! | [`replay`] | the idempotency middleware, same shape: [`IdempotencyLayer`], stored-response replay |
//! | [`key`] | key parts, [`KeySpace`](key::KeySpace) (prefix and secret), the keyed digest |
//! | [`backend`] | [`LockBackend`](backend::LockBackend), [`MemoryBackend`], [`RedisBackend`], [`RedlockBackend`](backend::RedlockBackend) (quorum) |
//! | [`Rejection`] | the answers of both layers, as problem+json |
//!
//! # Features
//!
//! - `axum` (default): extractors, and [`key::Route`] reads axum's
//!   `MatchedPath`.
//! - `redis` (default): [`RedisBackend`] over fred 10.
//! - `metrics`: every outcome as the counter
//!   `tower_redis_lock_outcomes_total{layer="...",outcome="..."}` and the
//!   acquire latency as the histogram
//!   `tower_redis_lock_acquire_seconds{layer="..."}` (unit seconds), through
//!   the [`metrics`](https://docs.rs/metrics) facade; `layer` is the
//!   layer's [`label`](RedisLockLayer::label). Without it,
//!   [`RedisLockLayer::stats`] gives the same counts.
//! - `tls-rustls`: `rediss://` URLs, through fred's rustls with the *ring*
//!   provider.

#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    rust_2018_idioms,
    unreachable_pub,
    missing_debug_implementations
)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
pub mod key;
pub mod lock;
mod rejection;
pub mod replay;
mod stats;

#[cfg(feature = "redis")]
pub use backend::RedisBackend;
pub use backend::MemoryBackend;
#[cfg(feature = "redis")]
pub use fred;
pub use lock::{Lease, RedisLockLayer};
pub use rejection::Rejection;
pub use replay::IdempotencyLayer;

/// The README's Rust examples are compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
