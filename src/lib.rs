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
//! use tower_redis_lock::{key::{Method, Route, TrustedHeader}, RedisBackend, RedisLockLayer};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = RedisBackend::connect("redis://127.0.0.1:6379").await?;
//! let lock = RedisLockLayer::new(backend)
//!     .key((Method, Route, TrustedHeader::new("x-user-id")))
//!     .body_digest(64 * 1024);
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
//!   ([`ReleaseMode::FireAndForget`] trades this for latency, by opt-in).
//! - **Nothing outlives the TTL**: release on completion, inner error, client
//!   disconnect (future or body dropped) and handler panic; the TTL
//!   ([`DEFAULT_TTL`], 10 s) is the safety net. `Drop` never blocks.
//! - **Only the owner releases**: a 128-bit CSPRNG token per lease; release
//!   and extend are compare-and-act Lua scripts.
//! - **Bounded waiting**: every backend call has a deadline
//!   ([`DEFAULT_DEADLINE`], 200 ms); then 503 (fail-closed, default) or the
//!   handler runs unlocked (fail-open).
//! - **Bounded memory**: the body is buffered only for
//!   [`RedisLockLayer::body_digest`], up to its limit (413 beyond).
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
//! # Modules
//!
//! | module | holds |
//! |---|---|
//! | [`layer`](RedisLockLayer) | [`RedisLockLayer`] and its builder |
//! | [`service`](RedisLock) | [`RedisLock`], the `tower::Service` |
//! | `future` | [`ResponseFuture`]: derive key → acquire → call → wrap body |
//! | `body` | [`ResponseBody`]: releases at end of stream or on drop |
//! | [`key`] | [`KeyPart`](key::KeyPart), built-in parts, [`LockKey`] |
//! | [`backend`] | [`LockBackend`], [`MemoryBackend`], [`RedisBackend`], [`RedlockBackend`] (quorum) |
//! | `lease` | [`Lease`] (what the handler sees) and the release guard |
//! | `response` | [`Rejection`]: problem+json answers |
//! | `locker` | [`Locker`] and [`LockGuard`]: leases from handler code |
//! | `renew` | [`Renewal`]: the lease watchdog |
//! | `stats` | [`LockStats`]: outcome counters, [`Outcome`] |
//! | `extract` | axum extractors (feature `axum`) |
//! | [`replay`] | idempotency mode: [`IdempotencyLayer`](replay::IdempotencyLayer), stored-response replay |
//!
//! # Features
//!
//! - `axum` (default): extractors, and [`key::Route`] reads axum's
//!   `MatchedPath`.
//! - `redis` (default): [`RedisBackend`] over fred 10.
//! - `metrics`: every [`Outcome`] as the counter
//!   `tower_redis_lock_outcomes_total{outcome="..."}` and the acquire latency
//!   as the histogram `tower_redis_lock_acquire_seconds`, through the
//!   [`metrics`](https://docs.rs/metrics) facade. Without it,
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
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

pub mod backend;
mod body;
#[cfg(feature = "axum")]
mod extract;
mod future;
pub mod key;
mod layer;
mod lease;
mod locker;
mod renew;
pub mod replay;
mod response;
mod service;
mod stats;

pub use backend::{
    Acquire, BackendError, BackendErrorKind, LockBackend, MemoryBackend, RedlockBackend, Token,
};
#[cfg(feature = "redis")]
pub use backend::{EvictionPolicy, RedisBackend};
pub use body::ResponseBody;
#[cfg(feature = "axum")]
pub use extract::MissingLease;
pub use future::ResponseFuture;
pub use key::LockKey;
pub use layer::{
    BodyDigest, FailPolicy, MissingPartPolicy, NoBodyDigest, RedisLockLayer, ReleaseMode,
    DEFAULT_BODY_LIMIT, DEFAULT_BODY_TIMEOUT, DEFAULT_DEADLINE, DEFAULT_PREFIX, DEFAULT_TTL,
};
pub use lease::{Lease, LeaseStatus};
pub use locker::{LockGuard, Locker};
pub use renew::{Renewal, DEFAULT_MAX_RENEWALS};
pub use response::{Rejection, PROBLEM_JSON};
pub use service::RedisLock;
pub use stats::{LockStats, Outcome, StatsSnapshot};

/// The README's Rust examples are compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
