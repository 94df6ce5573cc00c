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
//! | `stats.rs` | [`Stats`], the layer's outcome counters, and the same through the `metrics` facade |
//! | `memory.rs` | the bounded in-process store of [`MemoryBackend`](crate::MemoryBackend): limits, expiry index, eviction |
//! | `record.rs` | what is kept, and its encoding |
//!
//! Its answers are [`Rejection`](crate::Rejection)s, like the lock's.
//!
//! What it does not promise: a claim outlived by its handler (longer than
//! [`IdempotencyLayer::ttl`]) can let a retry run concurrently, and a
//! record lost to Redis eviction, failover or restart lets a retry run again.
//! For money, also make the write itself idempotent (a unique constraint on
//! the key, which the [`IdempotencyKey`] extractor hands to the handler).
//!
//! # Using it
//!
//!
//! The lock stops a duplicate only while the first request is running. A client
//! that retries *after* the first payment completed (its connection dropped
//! before it read the answer) would run the handler again. For such routes, add
//! `IdempotencyLayer::new(backend, key)`: the first completed response for an
//! `Idempotency-Key` is stored, and every retry gets that response back, byte
//! for byte, without reaching the handler.
//!
//! It follows the IETF `Idempotency-Key` header draft
//! (draft-ietf-httpapi-idempotency-key-header), with defaults close to Stripe's
//! (keys up to 255 bytes, kept 24 hours).
//!
//! | request | answer |
//! |---|---|
//! | first request with a key | the handler runs; its response is stored (if storable, see below) |
//! | retry, same key and payload, first one finished | the stored response: same status, stored headers and body, plus `Idempotent-Replayed: true`; the handler does not run |
//! | retry while the first one is still running | **409** problem+json with `Retry-After` (`Rejection::InFlight`) |
//! | same key, different payload (body, path or fingerprinted headers) | **422** problem+json (`Rejection::Mismatch`) |
//! | `Idempotency-Key` missing (when required) or malformed | **400** problem+json (`Rejection::MissingIdempotencyKey`, `Rejection::InvalidIdempotencyKey`) |
//! | first one finished, but its response was too large or streamed | **409** problem+json (no `Retry-After`) with `original_status` (`Rejection::NotStored`); the handler does not run again |
//! | no identity for the scope (e.g. `TrustedHeader` missing) | **401** problem+json |
//! | request body over `.body_limit(..)` / not received in time | **413** / **408** problem+json |
//! | store (Redis) down or slower than the deadline | **503** problem+json with `Retry-After` (always fail-closed) |
//!
//! **The key.** `Idempotency-Key` may be an RFC 8941 string (`"8e03978e-…"`) or
//! a bare token (`8e03978e-…`, letters, digits and ``!#$%&'*+-.^_`|~:/=``);
//! both forms of one value are the same key. At most 255 bytes, one header.
//! The stored key is a keyed BLAKE3 digest of the layer's key parts (method,
//! route template, and the caller's identity: put it there) plus the
//! `Idempotency-Key`, so two users' equal keys never meet. With
//! `.optional_key()`, a request without the header is keyed by its parts and
//! fingerprint instead (an identical request is replayed, any other runs). The
//! handler can read the validated key with the `replay::IdempotencyKey`
//! extractor.
//!
//! **The fingerprint.** A digest of the method, the concrete path, the request
//! headers you name with `.fingerprint_header(name)`, and the body (buffered up
//! to `.body_limit(..)`, 64 KiB by default). The query string is not part of it.
//!
//! **What is stored.** Status, the headers in `.stored_headers(..)` (default:
//! `content-type`, `content-encoding`, `content-language`, `content-location`,
//! `location`, `etag`, `last-modified`; add one with `.store_header(..)`) and
//! the body, up to `.record_limit(..)` (64 KiB), for `.retention(..)` (24 h).
//! Which statuses are stored is `.store_when(|status| ..)`; by default 2xx and
//! 4xx except 408, 409 and 429. 5xx are not stored because the failure is the
//! server's and the client must be able to retry for real; 408, 409 and 429 are
//! transient by nature. A response that is not stored frees the key at once, so
//! the retry runs. A body over the record limit, or without a length known up
//! front (a stream), is delivered to the first client normally, and the key is
//! marked as done-but-not-stored: retries get the 409 above rather than a
//! second execution. The record is written *before* the response is sent (a
//! storable body is small and of known length, so it is collected first and
//! sent in one piece): a client that read the response and retries at once is
//! replayed, never refused.
//!
//! **Crashes and timeouts.** While the first request runs, the key holds a
//! claim that expires after `.ttl(..)` (30 s; choose it longer than the slowest
//! handler). If the client disconnects, the handler fails or panics, or the
//! response is not storable, the claim is deleted; if the process dies, it
//! expires. Either way no record is stored and the next retry runs.
//!
//! **Redis.** One hash per key, `prefix:{digest}:idem` (claim and record share
//! the key and so the Cluster slot; no raw user data in it). The first
//! request's claim, a replay, a conflict and a mismatch are each one `EVALSHA`
//! round trip (with `NOSCRIPT` fallback); recording the response is one more.
//! Several instances sharing a Redis replay each other's records. The store is
//! any `backend::ReplayBackend`: `MemoryBackend`, `RedisBackend`, or an `Arc`
//! of either.
//!
//! **Memory.** On [`MemoryBackend`](crate::MemoryBackend) the store is
//! bounded: at most 100,000 entries (claims and records) and 64 MiB, set with
//! `MemoryBackend::replay_entry_limit` / `replay_byte_limit`. Expired entries
//! are swept a few at a time on every write (never a pass over the table).
//! To make room it evicts expired entries first, then the records closest to
//! their expiry (with one retention, the oldest); never an in-flight claim:
//! when only claims are left, a new key gets **503** with `Retry-After` and
//! its handler does not run. An evicted record lets a retry run again (a
//! WARN, at most once a minute, says so). Measured with
//! `cargo bench --bench replay_memory`: a million distinct keys leave the
//! resident memory flat at about 75 MiB over the baseline from the
//! 200,000th key on.
//!
//! **Limits.** A handler that outlives its claim can run twice; a record lost
//! to Redis eviction (`maxmemory-policy` other than `noeviction`), failover to
//! an unreplicated replica, or a restart without persistence, or evicted from
//! the memory store at its limits, lets a retry run again. For money, also make the write itself idempotent (a unique
//! constraint on the key).
//!
//! Try it: `cargo run --example payments` (or with `REDIS_URL=redis://…`) and
//!
//! ```sh
//! curl -i -X POST localhost:3001/payments -H 'x-user-id: alice' \
//!   -H 'Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324' \
//!   -H 'content-type: application/json' -d '{"amount":500,"currency":"EUR"}'
//! ```
//!
//! twice; `curl localhost:3001/stats` shows `{"executions":1}`.

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
mod stats;
mod store;

pub use body::ResponseBody;
pub use key::IdempotencyKey;
pub use layer::IdempotencyLayer;
pub use service::{Idempotency, ResponseFuture};
pub use stats::Stats;
pub use store::ReplayBackend;
