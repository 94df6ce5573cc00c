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
//! missing or malformed, 409 while the first request is in flight (after an
//! optional bounded wait for its answer), 422 when a key is reused with a
//! different payload. Like Stripe, keys are up to 255
//! bytes and kept 24 h by default, and the key is compared with a
//! fingerprint of the request; like the AWS Lambda Powertools idempotency
//! utility, the payload is validated on every path that finds an existing
//! record (here: in the same Lua round trip as the claim).
//!
//! | file | holds |
//! |---|---|
//! | `layer.rs` | [`IdempotencyLayer`]: key scope, required/optional key, fingerprint headers, stored headers, limits, retention, status policy |
//! | `service.rs` | [`Idempotency`], the `tower::Service`, and its boxed response future: admit, then run a claimed request to its end (in a task of its own once its future is dropped) |
//! | `admission.rs` | scope + `Idempotency-Key` + body + fingerprint → the entry key; the claim loop; the store's answer → replay / reject / run; the pending claim whose drop abandons it; a claim won, handed to the run as data |
//! | `joining.rs` | a duplicate's wait for the request in flight: on this instance (its flight), elsewhere (the store's feed, or looking again) |
//! | `execution.rs` | a claimed request's run: the handler and its body up to the record limit, claim renewals, the record write (retried) or the key freed |
//! | `answer.rs` | the answers the layer gives itself: a replay, the 410 of a record not stored, the rejections, the 503s of a store that failed |
//! | `body.rs` | [`ResponseBody`]: this layer's response body (a replayed or recorded answer in one piece, or the handler's body passed through); it holds nothing, the claim is the run's |
//! | `flight.rs` | the requests in flight on this instance, which duplicates join without a round trip |
//! | `feed.rs` | what the store published for the keys this layer's duplicates wait on (Redis pub/sub), handed to them |
//! | `record.rs` | what is kept for a completed request, and its byte encoding (decoded as untrusted input) |
//! | `seal.rs` | records bound to their entry key and fingerprint (a MAC with the key space's secret) |
//! | `safe.rs` | [`SafeToRetry`]: the response extension that frees the key |
//! | `header.rs` | [`IdempotencyKey`]: header parsing (RFC 8941 sf-string or bare token, ≤ 255 bytes) |
//! | `extract.rs` | the axum extractor for [`IdempotencyKey`] (feature `axum`) |
//! | `config.rs` | what the layer was built with, its defaults, and which headers a record keeps; the bottom of the folder: the engines import it, it imports only the data types (`flight.rs`, `feed.rs`, `seal.rs`'s key) |
//!
//! The stores are storage, in [`backend`](crate::backend): the open
//! [`IdempotencyBackend`](crate::backend::IdempotencyBackend) trait (claim / complete /
//! extend / abandon, the entry key, the feed) and one implementation per
//! store. A store keeps the sealed records as opaque bytes; only this
//! module encodes, seals, opens and decodes them. What the layer counts is
//! [`IdempotencyStats`](crate::IdempotencyStats).

//! Its answers are [`Rejection`](crate::Rejection)s, like the lock's.
//!
//! What it promises: once a request wins its claim, its handler (and a
//! response body of known length, or a gRPC one, up to the record limit) runs to
//! completion in a task of its own, so a client disconnect or an outer
//! timeout cannot cancel it; the
//! claim is renewed while it runs; its outcome is recorded at most once, 5xx
//! and panics included, unless the handler marks the response
//! [`SafeToRetry`]; and a retry gets the recorded answer.
//!
//! What it does not promise: a handler that outlives its renewals (20, a
//! third of [`IdempotencyLayer::ttl`] apart), or whose claim lapsed while
//! the store could not be reached, can let a retry run concurrently (if
//! no retry took the key meanwhile, the handler's record is still kept,
//! and later retries replay it); and a record lost to Redis eviction,
//! failover or restart lets a retry run again.
//! For money, also make the write itself idempotent (a unique constraint on
//! the key, which the [`IdempotencyKey`] extractor hands to the handler), or
//! keep the records in PostgreSQL or SQLite with the handler's writes (the
//! SQL stores of [`tower-redis-lock-sql`](https://docs.rs/tower-redis-lock-sql):
//! one transaction, exactly once for the database's side effects).
//!
//! # Using it
//!
//! | request | answer |
//! |---|---|
//! | first request with a key | the handler runs; its response is stored (if storable, see below) |
//! | retry, same key and payload, first one finished | the stored response: same status, stored headers and body, plus `Idempotent-Replayed: true`; the handler does not run |
//! | retry while the first one is still running | with `.join_timeout(bound)`: waits for the first one's answer and gets it, replayed; past the bound (or with no bound, the default) **409** problem+json with `Retry-After` (`Rejection::InFlight`) |
//! | same key, different payload (body, path, query or fingerprinted headers) | **422** problem+json (`Rejection::Mismatch`) |
//! | `Idempotency-Key` missing (when required) or malformed | **400** problem+json (`Rejection::MissingIdempotencyKey`, `Rejection::InvalidIdempotencyKey`) |
//! | first one finished, but its response was too large, streamed, or broke off | **410** problem+json, no `Retry-After`, with `original_status` (`Rejection::NotStored`, type `…:idempotent-response-not-stored`): final, never retry with this key; the handler does not run again |
//! | no identity for the scope (e.g. `Header::trusted_identity` missing) | **401** problem+json |
//! | the scope (identity and route) already holds its share of the store, `.scope_quota(entries, bytes)` (1,000 entries, 1 MiB) | **429** problem+json with `Retry-After` (`Rejection::OverQuota`): that scope only |
//! | request body over `.body_limit(..)` / not received in time | **413** / **408** problem+json |
//! | store (Redis) down or slower than the deadline | **503** problem+json with `Retry-After` (always fail-closed) |
//! | a SQL store's commit of the first request not confirmed within its commit timeout | **503** problem+json `outcome-unknown` with `Retry-After`: retry with the same key (`Rejection::OutcomeUnknown`) |
//! | a SQL store: the first request's handler ended its transaction itself and something of it committed | **500** problem+json `transaction-ended`, final, the same for every retry |
//!
//! **The key.** `Idempotency-Key` may be an RFC 8941 string (`"8e03978e-…"`) or
//! a bare token (`8e03978e-…`, letters, digits and ``!#$%&'*+-.^_`|~:/=``);
//! both forms of one value are the same key. At most 255 bytes, one header.
//! The stored key is a keyed BLAKE3 digest of the layer's key parts (method,
//! route template, and the caller's identity: put it there) plus the
//! `Idempotency-Key`, so two users' equal keys never meet. With
//! `.optional_key()`, a request without the header is keyed by its parts and
//! fingerprint instead (an identical request is replayed, any other runs). The
//! handler can read the validated key with the `idempotency::IdempotencyKey`
//! extractor.
//!
//! **The fingerprint.** A digest of the method, the concrete path, the request
//! headers you name with `.fingerprint_header(name)`, the query string, and
//! the body (buffered up to `.body_limit(..)`, 64 KiB by default).
//!
//! **What is stored.** Status, the headers in `.stored_headers(..)` (default:
//! `content-type`, `content-encoding`, `content-language`, `content-location`,
//! `location`, `etag`, `last-modified`, `cache-control`, `vary`; add one
//! with `.store_header(..)`) and
//! the body, up to `.record_limit(..)` (64 KiB), for `.retention(..)` (24 h).
//! Which statuses are stored is `.store_when(|status| ..)`; by default every
//! status except 409 and 429: 2xx, 3xx (a `303 See Other` after a
//! charge is replayed), other 4xx, and **5xx too**. Once the handler began,
//! the layer cannot tell "failed before charging" from "charged, then
//! failed", and only the second must never run twice. Stripe makes the same
//! choice (a 500 is saved once execution began, and the retry gets it); the
//! IETF draft leaves ambiguous outcomes to the server. A handler that *knows*
//! nothing happened says so: it inserts the [`SafeToRetry`] extension into
//! its response, and the key is freed at once, so the retry runs for real.
//! 409 and 429 are transient by nature and free the key too (a 408 is
//! stored: below the layer the body arrived whole, so it is a timeout that
//! cut the handler, which may have charged). A panic is
//! recorded as a 500 problem+json (type `…:handler-failed`), so its retry
//! gets the same 500 rather than a second execution.
//!
//! **gRPC.** A gRPC answer is HTTP 200 whatever its outcome; its status
//! comes in its trailers (or, trailers-only, its headers). For a gRPC
//! request the layer reads the answer whole with its trailers (up to the
//! record limit, whatever its size hint), asks `store_when` about the gRPC
//! status's HTTP equivalent (`UNAVAILABLE` 503, `INTERNAL` 500, `ABORTED`
//! 409, ...), and keeps the trailers in the record with the protocol's
//! headers (`content-type`, `grpc-status`, `grpc-message`,
//! `grpc-status-details-bin`, `grpc-encoding`) beside the stored ones; a
//! replay carries `idempotent-replayed: true` as metadata. Rejections are
//! gRPC statuses (see [`Rejection`](crate::Rejection)). For unary methods:
//! let streaming ones through with [`IdempotencyLayer::skip_when`].
//!
//! A body over the record limit, without a length known up front (a
//! stream), or that fails part-way, is delivered to the first client
//! normally, and the key is marked as done-but-not-stored: retries get the
//! 410 above rather than a second execution. The record is written *before*
//! the response is sent (a storable body is small and of known length, so it
//! is collected first and sent in one piece): a client that read the
//! response and retries at once is replayed, never refused.
//!
//! **Detached execution.** Once a request wins its claim, the inner
//! service's future and a response body of known length up to the record
//! limit (a gRPC answer's up to the limit, whatever its length) run to
//! their end whatever happens to the connection (another streamed body,
//! or one longer than the limit, is not stored and is read only as the
//! client reads it: work it does as it streams stops with the client, and
//! the key answers 410 all the same): in the connection's own
//! task while it waits for them, handed to a task of their own if its
//! future is dropped. A client that hangs up, or an outer `tower::timeout`
//! that fires, drops the wait, not the handler: the outcome is recorded
//! and the retry replays it. While the task
//! runs, the claim is renewed every third of `.ttl(..)` (at most 20 times,
//! about 7.7 TTLs), so a slow handler lets no retry in beside it within
//! that span; past it the claim expires and a retry can run.
//!
//! **Recording does not give up.** The record write is retried with back-off
//! (20 ms doubling to 1 s) until the claim would expire, renewing the claim
//! meanwhile. If it still fails, the claim is left to expire, never freed
//! early (until then retries get 409), and an ERROR log line names the key
//! digest. A store that answers each try with a refusal of its own (an
//! item over its size limit; not a timeout nor an outage) gets one last
//! try with the record's not-stored marker, a few bytes: kept, retries are
//! answered 410, never run again. If the process dies, the claim expires a TTL after its last
//! renewal and the next retry runs.
//!
//! **No claim outlives its request.** A claim whose request ends before its
//! handler begins (the store's deadline passed, the store failed, the
//! client left while the claim was on its way, shutdown) is taken back by a
//! compare-and-delete on its token that is delivered like a lock release: on
//! a task of its own once the request is gone, retried with back-off until
//! Redis answers or the claim would have expired. A claim that lands after
//! its request gave up (fred re-sends commands after a reconnect) finds the
//! tombstone the abandon left and claims nothing. `Backend::drain` on
//! the backend waits for these, and for claimed requests still running, so
//! a graceful shutdown leaves no claim behind. The 409 of a duplicate in
//! flight says `Retry-After` from how long this layer's recent requests took
//! (like the lock's; before three have completed, as long again as the first
//! has run), and the claim's TTL only when the store does not report how
//! long the claim has left (the SQL stores, for a duplicate that is not
//! joining a request of its own instance).
//!
//! **Joining a request in flight.** With `.join_timeout(bound)`, a duplicate
//! that arrives while the first request runs waits for its outcome: on the
//! same instance (clones of one layer) through a local notification, with no
//! round trip; from another instance through Redis pub/sub: its claim marks
//! the key as waited for (`w`), the original's record write publishes the
//! record on the channel named like the key, and the layer's one subscriber
//! connection (`PSUBSCRIBE prefix:{*:idem`, opened on its first joining
//! request, opened again if it ends; reconnected by the client's
//! reconnect policy, which `RedisBackend::connect` sets)
//! hands it over, so the join costs its claim round trip and nothing more
//! (with a secret; without one the publication wakes the duplicate, which
//! then reads the record: one more round trip). A wait on the feed lasts at
//! most 2 s before one more look at the store, so a publication lost (a
//! reconnect, an ACL that refuses `PSUBSCRIBE` or `PUBLISH`: see
//! `SECURITY.md`) delays an answer, never loses it; the first time that
//! happens a WARN says so.
//! Chosen over looking at the store again with growing pauses (more round
//! trips, and an answer up to a pause late). Looking again is the fallback when the subscriber connection cannot be
//! opened, and the memory store's way. Past the bound (one last look) the
//! duplicate gets the 409 as before. Every instance subscribed receives the
//! records of keys that had a duplicate (a 409 marks the key too), so the
//! channel carries only contested keys, not every payment.

//! **Scopes and untrusted storage.** Everything the key parts name (put the
//! caller's identity there) is one *scope*. A scope holds at most its
//! `.scope_quota(..)` of the store (claims and records, and record bytes):
//! past it that scope alone gets 429. The bytes are checked when a claim is
//! made, and a record is always written once its handler ran: a scope's
//! claims in flight may record past its bytes (at most its entries ×
//! `.record_limit(..)`). No store ever evicts an unexpired
//! record to make room, so one client's flood can never make another
//! client's retry run again. What is read back from the store, or heard on
//! its channels, is untrusted: a record is accepted only if it was sealed for
//! this entry key and fingerprint (a MAC with the [`KeySpace`](crate::key::KeySpace)
//! secret; without a secret, only as read from its own key, and a
//! publication is only a wake-up to read it), it is decoded without panics
//! or unchecked allocation, and a replay carries only the `stored_headers`.
//! A record that fails is never replayed and never runs the handler again:
//! 503, and an ERROR log line.
//!
//! **Redis.** One hash per request, `prefix:{scope}:digest:idem` (claim and
//! record share the key; no raw user data in it), and per scope a sorted set
//! of its entries and a byte counter beside it (`prefix:{scope}:idem-quota`,
//! `…:idem-bytes`), all in the scope's Cluster slot, so that the quota is
//! checked in the claim's own script. Size `maxmemory` (with
//! `maxmemory-policy noeviction`) as active scopes × their byte quota plus
//! each entry's own overhead (a small hash and a sorted-set member: read it
//! with `MEMORY USAGE` on a key of yours). The first
//! request's claim, a replay, a conflict and a mismatch are each one `EVALSHA`
//! round trip (with `NOSCRIPT` fallback); recording the response is one more,
//! and each renewal of a long request's claim one more.
//! Several instances sharing a Redis replay each other's records. The store is
//! any [`backend::IdempotencyBackend`](crate::backend::IdempotencyBackend):
//! `MemoryBackend`, `RedisBackend`, an `Arc` of one, the SQL stores of
//! [`tower-redis-lock-sql`](https://docs.rs/tower-redis-lock-sql), or a store
//! you write for your own database (the trait documents the contract).
//!
//! **PostgreSQL and SQLite** ([`tower-redis-lock-sql`](https://docs.rs/tower-redis-lock-sql)).
//! A transactional store
//! ([`IdempotencyBackend::is_transactional`](crate::backend::IdempotencyBackend::is_transactional))
//! claims the key with a transaction that stays open while the handler
//! runs; the handler writes through that crate's transaction extractor in
//! it, and the record is written and committed before the answer. A
//! duplicate waits for the holder, then replays; a commit that fails is
//! answered 503, never with the handler's answer; a panic, a service error,
//! `SafeToRetry` or a status `store_when` refuses roll everything back and
//! free the key. One pooled connection per request in flight.
//!
//! **Memory.** On [`MemoryBackend`](crate::MemoryBackend) the store is
//! bounded: at most 100,000 entries (claims and records) and 64 MiB, set with
//! `MemoryBackend::idempotency_entry_limit` / `idempotency_byte_limit`. Expired entries
//! are swept a few at a time on every write (never a pass over the table).
//! Nothing unexpired is evicted: when the store is full, a new key gets
//! **503** with `Retry-After` and its handler does not run. So the store's
//! memory is bounded by these limits, not by the traffic, up to the records
//! of the claims in flight when the limit is reached (the byte limit
//! counts a fixed allowance per entry beside its bytes, so that it follows
//! the memory the process uses).
//!
//! **Limits.** A handler that outlives its claim's renewals can run twice; a record lost
//! to Redis eviction (`maxmemory-policy` other than `noeviction`), failover to
//! an unreplicated replica, or a restart without persistence, lets a retry
//! run again. For money, also make the write itself idempotent (a unique
//! constraint on the key), or use a SQL store
//! ([`tower-redis-lock-sql`](https://docs.rs/tower-redis-lock-sql)).
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

mod admission;
mod answer;
mod body;
mod claim;
pub(crate) mod config;
mod execution;
#[cfg(feature = "axum")]
mod extract;
mod feed;
mod flight;
mod header;
mod joining;
mod layer;
pub(crate) mod record;
mod safe;
mod seal;
mod service;

pub use body::ResponseBody;
pub use header::IdempotencyKey;
pub use layer::IdempotencyLayer;
pub use safe::SafeToRetry;
pub use service::Idempotency;
