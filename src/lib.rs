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
//! use tower_redis_lock::{key::{RequestMethod, Route, Header}, RedisBackend, RedisLockLayer};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = RedisBackend::connect("redis://127.0.0.1:6379").await?;
//! let lock = RedisLockLayer::new(backend, (RequestMethod, Route, Header::trusted_identity("x-user-id")))
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
//! # Where to put it, what it keys on
//!
//! - **Where to put it.** `Router::route_layer`, `Router::layer` or
//!   `MethodRouter::layer` (per-route settings: different TTLs and keys on
//!   different routes). `key::Route` reads axum's `MatchedPath`, which exists
//!   only for layers added through the router; elsewhere (plain hyper, a layer
//!   around the whole router) it falls back to the concrete URI path.
//! - **The key is required**: `RedisLockLayer::new(backend, key)` and
//!   `IdempotencyLayer::new(backend, key)`. Key parts (`key` module):
//!   `RequestMethod`, `Route`, `UriPath`, `Header::new(name)` /
//!   `Header::optional(name)`, `Identity<T>` (a typed extension from your auth
//!   layer: use this), `Header::trusted_identity(name)` (only behind a gateway that
//!   sets the header), closures of the `KeyPart::write` shape, and tuples of
//!   them. Header names are `&str` (`"X-User-Id"` works; an invalid name panics
//!   at start-up, naming it). A missing part answers 401 (identity) or 400
//!   (header), or runs unlocked with
//!   `.skip_missing_part()`; a key's header sent more than once is always
//!   400 (`MissingPart::malformed`), never run unlocked.
//! - **Key space**: `KeySpace::new("shop").secret(secret)` sets the Redis key
//!   prefix (default `trl`) and the digest secret; give the same `KeySpace` to
//!   both layers with `.key_space(space)`.
//! - **Backends**: `MemoryBackend` (one process), `RedisBackend::connect(url)`
//!   (`redis://`, `rediss://` with feature `tls-rustls`, `redis-cluster://`,
//!   `redis-sentinel://`), `RedisBackend::connect_lazy(url)` (start even while
//!   Redis is down), `RedisBackend::connect_pool(url, n)`,
//!   `RedisBackend::new(client)` for a fred `Client` you built (a `Pool`:
//!   `RedisBackend::from_pool(pool)`),
//!   `backend::RedlockBackend::new(nodes)` over independent primaries.
//!   `Arc<T: LockBackend>` is itself a backend. `RedisBackend` answers
//!   duplicates of leases this process holds from a local in-flight table,
//!   without a round trip (`.local_dedup(false)` turns it off).
//! - **In the handler**: the `Lease` extractor (key digest, status, remaining
//!   time, fence, `is_lost()`); the `lock::LockGuard` extractor or
//!   `Locker::lock(key)` (from `layer.locker()`) to take a lease from handler
//!   code, for keys built from parsed data.
//!
//! ## gRPC (tonic)
//!
//! Both layers work in front of a tonic server. tonic hands its layers a
//! `tonic::body::Body`, which the layers cannot rebuild from the body they
//! buffer, so one `map_request` turns it into an `axum::body::Body` first
//! (tonic's router takes any body):
//!
//! ```ignore
//! let layer = tower::ServiceBuilder::new()
//!     .map_request(|req: http::Request<tonic::body::Body>| req.map(axum::body::Body::new))
//!     .layer(IdempotencyLayer::new(backend, (Route, Header::trusted_identity("x-user-id"))));
//! tonic::transport::Server::builder().layer(layer).add_service(PaymentsServer::new(svc));
//! ```
//!
//! - **Answers**: a gRPC request (`content-type: application/grpc*`) gets
//!   every rejection as a trailers-only gRPC status, with the retry delay as
//!   metadata and `google.rpc.RetryInfo`; each kind's code, and why, is in
//!   the [`Rejection`] docs.
//! - **Keys**: `key::Route` and `key::UriPath` are the full method path
//!   (`/payments.v1.Payments/Create`), `key::Header` reads metadata; the body
//!   digest (`digest_body`, the idempotency fingerprint) is over the request's
//!   messages, not their 5-byte prefixes. A compressed message is refused
//!   (`UNIMPLEMENTED`): its bytes depend on the compressor, so a gzip retry of
//!   an identity call would look like another request. One flagged
//!   compressed on a request that names no `grpc-encoding` is malformed
//!   (`INTERNAL`).
//! - **Replay**: the idempotency layer records a unary answer with its
//!   trailers and replays it with `idempotent-replayed: true` metadata; its
//!   gRPC status decides whether it is stored (`store_when` is asked about
//!   the status's HTTP equivalent: a handler's `UNAVAILABLE` as a 503).
//!   An answer over the record limit is not stored whatever its status
//!   (its trailers come after the limit): retries get `ALREADY_EXISTS`.
//!   A compressed answer is replayed compressed (`grpc-encoding` kept):
//!   a retry that does not accept that encoding cannot read it, so
//!   fingerprint `grpc-accept-encoding` or answer uncompressed.
//! - **Streaming methods**: a layer sits in front of every method of a
//!   tonic server; a streaming call's messages are buffered whole before
//!   its handler sees the first (a bidirectional call whose client waits
//!   for an answer before it ends its stream fails after `body_timeout`,
//!   `DEADLINE_EXCEEDED`; a client stream over `body_limit` gets
//!   `RESOURCE_EXHAUSTED`), and the idempotency layer holds a streamed
//!   answer back until it ends or reaches the record limit. Let them
//!   through untouched with
//!   `IdempotencyLayer::skip_when(|req| ..)` by method path (for the lock
//!   layer: a key part that reports a `MissingPart` for them, with
//!   `skip_missing_part`).
//! - gRPC-Web is not recognised: put the layer inside the layer that
//!   translates it to gRPC.
//!
//! `examples/grpc.rs` is the `payments` example over gRPC.
//!
//! ## Settings and defaults (`RedisLockLayer`)
//!
//! | setter | default | what it does |
//! |---|---|---|
//! | `.ttl(d)` | 10 s | lease lifetime; choose it longer than the slowest handler, or turn on renewal |
//! | `.deadline(d)` | 200 ms | bound on every backend call |
//! | `.fail_open()` | off (fail closed) | on backend trouble: 503 + `Retry-After: 1` (closed, the default) or run the handler unlocked (open) |
//! | `.fire_and_forget()`, `.hold_until_ttl()` | neither (release before the end of the response is reported) | do not wait for the release; or debounce: keep the lease for the whole TTL |
//! | `.key_space(KeySpace)` | prefix `trl`, no secret | Redis key prefix and digest secret |
//! | `.digest_body()` | off | adds a digest of the body to the key |
//! | `.body_limit(n)` | 64 KiB | largest body received before the lease is taken (413 beyond), digested or not |
//! | `.body_timeout(d)` | 10 s | the whole body must arrive within it (408 after), before the lease is taken |
//! | `.stream_body()` | off | take the lease at the request head and let the handler stream the body: for large uploads; the lease is then held while a slow client uploads |
//! | `.skip_missing_part()` | off (reject) | run a request whose key part is missing unlocked (one that is there but malformed, a repeated header, is still 400) |
//! | `.renew(Renewal::new())` | off | lease renewal for long handlers (below) |
//! | `.fencing(true)` | off | fencing tokens (below) |
//! | `.label("payments")` | `"lock"` | metrics label and log field |
//! | `.retry_after_cap(d)` | none (the holder's TTL) | upper bound of a 409's `Retry-After` (below) |
//! | `.wait(d)` | off | wait up to `d` for a held key instead of answering 409 at once: first come, first served per instance, woken by the release (below) |
//! | `.max_waiters(per_key, total)` | 64, 4096 | waiters per key and in all, per instance; beyond them 409 at once |
//! | `.max_waiting_bytes(n)` | 16 MiB | request-body bytes held by waiters in all, per instance; beyond it 409 at once |
//! | `.on_rejection(\|r: &Rejection\| ..)` | problem+json | replaces every rejection response |
//!
//! `.stats()` returns a [`LockStats`] snapshot; `.locker()` a `Locker`
//! sharing the layer's backend and key space.
//!
//! # Guarantees and limits
//!
//! tower-redis-lock is an **efficiency lock**: it stops the double-clicked
//! "Pay" button and the retried webhook from running twice *at the same time*.
//! It is not, on its own, a correctness guarantee for money or inventory; for
//! that, pair it with fencing tokens (below) or a unique constraint in the
//! database, and with stored responses (`IdempotencyLayer`).
//!
//! ## What is promised
//!
//! With one healthy Redis primary (or the in-process `MemoryBackend`):
//!
//! - **Mutual exclusion while the lease is valid**: at most one request per key
//!   is admitted at a time, across every instance sharing that Redis.
//! - **No spurious 409 for sequential requests**: the lease is released before
//!   the end of the response body is reported, so a client that read the whole
//!   response and repeats it is admitted.
//! - **Nothing outlives the TTL**: the lease is released on completion, inner
//!   error, client disconnect and handler panic; the TTL (default 10 s) is the
//!   safety net when a release cannot reach Redis.
//! - **Releases are delivered**: once a request has ended its release is sent
//!   whatever its deadline (the deadline bounds how long the response waits
//!   for it, never whether it goes out) and whatever else was batched with
//!   it, retried with back-off until Redis answers or the lease would have
//!   expired anyway. A graceful shutdown waits for them (below).
//! - **Only the owner releases or renews**: a token per lease, 80 bits from
//!   a CSPRNG and the 48-bit time it was issued (`Token::generate`);
//!   release and renewal are compare-and-act: native commands where the
//!   server has them (Valkey ≥ 9 `DELIFEQ`, `SET … IFEQ`), Lua scripts
//!   elsewhere.
//! - **Bounded waiting**: every backend call has a deadline (default 200 ms).
//!   Redis slow, hung, partitioned or down gives 503 with `Retry-After`
//!   (fail-closed, the default) or runs the handler unlocked
//!   (`.fail_open()`), within the deadline plus scheduling slack.
//! - **A lost reply does not conflict with itself**: fred re-sends a command
//!   whose connection dropped; an acquire that finds "the key holds my own
//!   token" counts as acquired, its expiry pushed out (a fenced one returns
//!   the same fencing token). If its caller stopped waiting meanwhile, the
//!   acquire sends nothing more (nor its script again as `EVAL` after a
//!   `NOSCRIPT`), so that the caller's cleanup release is the last word on
//!   the key.
//!
//! ## What is not promised
//!
//! A duplicate can be admitted while the first request still runs when:
//!
//! - **the handler runs longer than the TTL** and renewal is off (turn on
//!   `.renew(Renewal::new())`, and watch `Lease::is_lost()`);
//! - **Redis fails over to a replica that had not received the lease yet**
//!   (replication is asynchronous; `WAIT` is not used);
//! - **Redis evicts the lease key** (`maxmemory-policy` other than
//!   `noeviction`; the backend warns at connect, and after a reconnection
//!   that finds another such policy, when it can read the policy);
//! - **Redis restarts without persistence** (every lease is gone);
//! - **the server clock jumps** (Redis expires keys by its own clock; a
//!   clock set back by more than the fence window can also let a fence go
//!   down, see *Fencing tokens*).
//!
//! And the other way round: an acquire that lands after the layer gave up holds
//! the key, unused, until its background cleanup arrives (about one round trip
//! later; see *Under faults*), so a request in that window gets a 409 it did
//! not deserve.
//!
//! The idempotency layer promises more on its routes (see [`idempotency`]): once a
//! request holds its key, its handler runs to completion in its own task (a
//! client disconnect or an outer timeout cannot cancel it), its claim is
//! renewed while it runs, its outcome is recorded (5xx and panics too,
//! unless the handler marks the answer `idempotency::SafeToRetry`; on a
//! store whose record commits with the handler's own writes, the SQL
//! stores, a panic or a service error rolls those writes back and frees
//! the key instead), and a retry gets the recorded answer; with
//! `.join_timeout(d)` a duplicate in flight waits up to `d` for that answer
//! instead of a bare 409 (off by default: 409 at once).
//!
//! Where a double execution costs money, carry the **fencing token** into the
//! database: claim the row with the fence before reading it, and write only
//! while the row still carries it (the recipe under *Fencing tokens* below;
//! a guard on the write alone does not cover a read-modify-write), or make
//! the write idempotent.
//!
//! ## Exactly once for database side effects
//!
//! On Redis or memory the payment path is at most once *while the process
//! lives*: an instance killed mid-handler (kill -9, OOM, a node lost) leaves
//! its writes in the database and its claim without a record; the claim
//! expires and the retry runs again. With a SQL store the claim row, the
//! handler's writes and the record are **one transaction** (the design
//! Stripe describes for its idempotency keys): the handler writes through
//! the request's transaction, and the layer commits it with the record
//! before answering; a crash before the commit leaves nothing, after it
//! every retry replays. The SQL stores (PostgreSQL through tokio-postgres or
//! sqlx, SQLite through sqlx) and their transaction extractors are a crate
//! of their own, built on this crate's public store API:
//! [`tower-redis-lock-sql`](https://docs.rs/tower-redis-lock-sql), with its
//! own MSRV (sqlx's) and semver.
//!
//! ## Lease renewal (opt-in)
//!
//! `.renew(Renewal::new())` renews the lease every third of the TTL
//! (`Renewal::at_fraction`, `Renewal::every`) while the request runs, at most 20
//! times by default (`max_renewals`, `max_total`). It stops before the release
//! is sent, so no renewal ever follows a release. When a renewal finds the lease
//! gone, or no renewal succeeded before it expired, `Lease::is_lost()` turns
//! true, `Lease::lost()` resolves, and a `lease_lost` warning is logged.
//! `Lease::renewals()` counts the renewals so far.
//!
//! ## Fencing tokens (opt-in)
//!
//! `.fencing(true)` issues, in the acquire's round trip, a number per key that
//! strictly increases from one holder to the next: `max(counter + 1, the
//! server's clock in µs)`, the counter kept in `prefix:{digest}:fence` (same
//! hash slot as the lease). `Lease::fence()` returns it. The counter expires
//! with its lease plus a window (`RedisBackend::fence_window`, default 60 s),
//! so Redis keeps one counter per key locked within the last TTL + window,
//! not one per key ever locked; a fence issued after the counter is gone
//! still passes every earlier one, because the clock has moved past them.
//! `MemoryBackend` keeps no per-key fence state at all (one counter for the
//! whole table, with the same clock floor).
//!
//! Fences are therefore large numbers (about 1.8e15 today, always below 2^53:
//! they fit an `i64` and a PostgreSQL `bigint`) with gaps, not 1, 2, 3:
//! compare them with `>`, never count on `+ 1`. A re-sent acquire of our own
//! live lease gets the fence it already had.
//!
//! A lease can expire while its handler still runs (a GC stall, a frozen VM,
//! a `SIGSTOP` longer than the TTL): the lock then admits the next request
//! and the two handlers overlap. The fence lets the database tell them apart:
//! each row keeps the highest fence that touched it and refuses older ones.
//! In a read-modify-write both the read and the write must carry the fence:
//! claim the row with it before reading, write only while the row still
//! carries it.
//!
//! ```sql
//! -- once: ALTER TABLE accounts ADD COLUMN fence bigint NOT NULL DEFAULT 0;
//! -- 1. Claim, then read; its own statement, committed at once (a newer
//! --    holder's claim must not wait for an older holder's transaction).
//! --    No row: a newer fence holds the account; stop ("lease lost").
//! UPDATE accounts SET fence = $fence WHERE id = $id AND fence < $fence
//! RETURNING balance;
//! -- 2. The handler's work, then the write, with any journal row in the
//! --    same statement or transaction. 0 rows: a newer holder took over
//! --    meanwhile; nothing changed, answer 409.
//! UPDATE accounts SET balance = $new WHERE id = $id AND fence = $fence;
//! ```
//!
//! `examples/ledger.rs` is this recipe on PostgreSQL. Run two instances on
//! one Redis and freeze one (`SIGSTOP`) past the TTL while debits run: with
//! fencing the final balance is the initial one minus every debit answered
//! 200, each written once, and the frozen handler's writes are refused;
//! with `FENCING=0` the same run loses updates.
//!
//! What fencing does not cover:
//!
//! - **side effects outside the database**: an e-mail sent, a card charged
//!   at a payment provider, a message published, a file written. A handler
//!   that wakes up after losing its lease still does them unless that system
//!   checks the fence too. Do them after the fenced write succeeded, and make
//!   them idempotent (the provider's idempotency key, an outbox table
//!   written with the fenced write);
//! - **writes that do not check the fence**: every code path that changes
//!   the row must claim or check it;
//! - **other lock keys**: a fence orders the holders of one key; rows written
//!   under two different keys are not fenced against each other.
//!
//! And what it rests on: **the server's clock**. A counter that expired or
//! was lost with Redis (a restart without persistence, a failover to a
//! replica that had not received it) starts again from the clock, above
//! every earlier fence, unless the clock went back (or a failover's new
//! primary runs behind the old one) by more than the time since the key was
//! last locked: always at least the TTL plus the window for an expired
//! counter. A clock set back by more than that, or a wrong clock corrected,
//! can issue a fence below one in your rows: the database then refuses those
//! holders (safe, but 409s) until the clock passes the rows' fences again.
//! Keep the servers on NTP, and raise `fence_window` if your clocks may go
//! back further.
//!
//! ## `Retry-After` on a 409
//!
//! A 409 says when the holder is expected to finish, not how long its TTL is
//! (a 600 ms handler under a 70 s TTL answers `Retry-After: 1`, not 70). Each
//! layer remembers how long its last 64 holds took (acquire to release, in
//! this instance). The refused acquire learns the holder's remaining TTL in
//! the same round trip (on Redis from the issue time the holder's token
//! carries, returned by the refused `SET … GET` itself, or a `PTTL` inside
//! a script; in memory the entry's expiry); the holder took its lease with
//! the same TTL, so it has held it for `ttl − remaining`, and
//!
//! ```text
//! Retry-After = clamp(p90(last 64 holds) − (ttl − remaining), 1 s, min(remaining, cap))
//! ```
//!
//! in whole seconds, rounded up. Until the layer has seen three holds (a fresh
//! instance) nothing is learned yet, and it is how long the holder has held
//! its lease so far (`ttl − remaining`: a hold is expected to last about as
//! long again), with the same bounds; it is the TTL (capped) only when the
//! store does not say how long the holder has left. The cap is `.retry_after_cap(d)` (none by
//! default). Each instance learns from its own holds: the instances of a fleet
//! run the same handlers, so their estimates agree once each has seen a few
//! requests. A holder that renewed its lease looks younger than it is where
//! a script reads its `PTTL`, which makes the learned answer later (and the
//! one before three holds earlier); where its token is read, it looks as old
//! as it is but with the time left of its first TTL (an earlier answer), and
//! once past that TTL its time left is unknown. The token's issue time is
//! the holder's clock: a holder whose clock runs ahead of this instance's
//! looks younger by as much (up to a TTL; beyond it, unknown), so keep the
//! fleet's clocks in sync (NTP). It is an estimate: a holder slower than its
//! route's 90th percentile answers 409 again, and the client waits once more.
//!
//! ## Observability
//!
//! Every event carries the key digest (never raw request data), an `outcome`
//! (`acquired`, `conflict`, `backend_error`, `fail_open`, `skipped`, `released`,
//! `release_failed`, `lease_lost`, `renewed`, `renew_failed`), the layer's
//! `.label(..)` and, for backend calls, `latency_us`. Acquire events sit in a
//! `lock` span that names the digest too. `RedisLockLayer::stats()` returns
//! a [`LockStats`] snapshot (a count per outcome, and the acquire round trips:
//! `round_trips`, `round_trip_timeouts`, `mean_round_trip()`). With the
//! `metrics` feature the same counts go to the `metrics` facade, described
//! with their units, every series labelled `layer="<label>"`:
//! `tower_redis_lock_outcomes_total` (also labelled `outcome`) and
//! `tower_redis_lock_acquire_seconds`.
//!
//! The idempotency layer does the same in its own words:
//! `IdempotencyLayer::stats()` returns a [`IdempotencyStats`] snapshot (`claimed`,
//! `replayed`, `joined`, `mismatch`, `conflict`, `not_stored`, `recorded`,
//! `record_failed`, `backend_error`, `over_quota`, `transaction_ended`,
//! `outcome_unknown`, and the claim round trips
//! in the `round_trip*` fields), and the `metrics` feature adds
//! `tower_redis_lock_idempotency_outcomes_total{layer,outcome}` and
//! `tower_redis_lock_idempotency_claim_seconds{layer}` (default label `"idempotency"`). The
//! two snapshots use the same names where they mean the same thing
//! (`conflict`, `backend_error`, `round_trip*`); see [`stats`].
//!
//! ## Graceful shutdown
//!
//! Releases to Redis run on tasks of their own; a task still running when
//! the runtime ends is lost, and its lease stays until its TTL. Stop taking
//! requests, let the ones in flight finish, then wait (bounded) for the
//! releases with [`Backend::drain`](backend::Backend::drain), before
//! `main` returns:
//!
//! ```no_run
//! # #[cfg(all(feature = "axum", feature = "redis"))]
//! # async fn demo(listener: tokio::net::TcpListener, app: axum::Router) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use tower_redis_lock::backend::Backend;
//!
//! let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379").await?;
//! // `RedisLockLayer::new(backend.clone(), key)` on the routes of `app` ...
//! axum::serve(listener, app)
//!     .with_graceful_shutdown(async { let _ = tokio::signal::ctrl_c().await; })
//!     .await?;
//! backend.drain(Duration::from_secs(5)).await?; // every release delivered
//! # Ok(()) }
//! ```
//!
//! The examples do this on SIGTERM and Ctrl-C (`examples/support/mod.rs`).
//!
//! ## Under faults
//!
//! Redis down, hung, partitioned or restarting gives 503 with `Retry-After`
//! (or runs the handler, fail-open) within the deadline plus scheduling
//! slack, never a hung request or a 500; a request already admitted keeps
//! its whole response when Redis dies under it; an acquire that lands after
//! the layer gave up is removed by a compare-and-delete with its token; a
//! reply lost and re-sent never refuses its own request; one failing
//! operation of a batch fails alone, an unanswered batch is given up after
//! the batch timeout, and a release is still sent when its batch stalls;
//! requests are admitted again within 3 s of Redis being reachable. What
//! each fault does, with its bound (start-up, kill, restart, hang, a
//! thousand requests in a hang, partition, lost reply, `SCRIPT FLUSH`,
//! eviction policy, late acquire, client gone, renewal, fencing, batches,
//! pools, SIGTERM): `FAULTS.md` in the repository.
//!
//! # Modules
//!
//! | module | holds |
//! |---|---|
//! | [`lock`] | the lock middleware: [`RedisLockLayer`], its service and future, its [`ResponseBody`](lock::ResponseBody) (holds the lease until the body ends), [`Lease`], renewal, [`Locker`](lock::Locker) |
//! | [`idempotency`] | the idempotency middleware, same shape: [`IdempotencyLayer`], admission, execution, joining, its own [`ResponseBody`](idempotency::ResponseBody), and the data only it reads: the record format, its seal, the join feed |
//! | [`key`] | key parts, [`KeySpace`](key::KeySpace) (prefix and secret), the keyed digest |
//! | [`backend`] | the stores: the traits [`LockBackend`](backend::LockBackend) (leases) and [`IdempotencyBackend`](backend::IdempotencyBackend) (the idempotency layer's claims and records, open to your own database), and one implementation per store: [`MemoryBackend`], [`RedisBackend`], [`RedlockBackend`](backend::RedlockBackend) (quorum); the SQL stores are the crate [`tower-redis-lock-sql`](https://docs.rs/tower-redis-lock-sql) |
//! | [`stats`] | what each layer counts: [`LockStats`], [`IdempotencyStats`] |
//! | [`Rejection`] | the answers of both layers, as problem+json, or as gRPC statuses for gRPC requests |
//!
//! Crate-private files named for what they hold serve both layers: the
//! settings they share, the renewal schedule, the `Retry-After` estimate,
//! and in `wire/` what the layers know of the protocols they sit in:
//! receiving the request body (`wire/body.rs`), gRPC's wire facts
//! (`wire/grpc.rs`: which requests are gRPC, the status of an answer, a
//! trailers-only status) and problem+json (`wire/problem.rs`).
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
//!   [`RedisLockLayer::stats`] gives the same counts. The idempotency layer's
//!   outcomes go to `tower_redis_lock_idempotency_outcomes_total` and
//!   `tower_redis_lock_idempotency_claim_seconds` ([`IdempotencyLayer::stats`]); a lock
//!   layer that waits ([`RedisLockLayer::wait`]) records the time waited in
//!   `tower_redis_lock_wait_seconds{layer="..."}`.
//! - `tls-rustls`: `rediss://` URLs, through fred's rustls with the *ring*
//!   provider.
//! - `testing`: `backend::Suite`, the checks every store of this crate
//!   passes, as async functions you run against a `LockBackend` or
//!   `IdempotencyBackend` of your own in your tests.
//!
//! The SQL stores are not a feature of this crate: they are the crate
//! [`tower-redis-lock-sql`](https://docs.rs/tower-redis-lock-sql).

#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    rust_2018_idioms,
    unreachable_pub,
    missing_debug_implementations
)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// Without the `redis` feature there is no `RedisBackend`: the docs that
// mention it (most of them) keep its name, unlinked, instead of failing the
// build. This lets every broken link through in such a build; the default
// and all-features builds (CI builds both) still check every link.
#![cfg_attr(not(feature = "redis"), allow(rustdoc::broken_intra_doc_links))]

pub mod backend;
pub mod idempotency;
pub mod key;
pub mod lock;
mod rejection;
mod renewal;
mod retry_after;
mod run_to_end;
mod settings;
pub mod stats;
mod wire;

pub use backend::MemoryBackend;
#[cfg(feature = "redis")]
pub use backend::RedisBackend;
#[cfg(feature = "redis")]
pub use fred;
pub use idempotency::IdempotencyLayer;
pub use lock::{Lease, RedisLockLayer};
pub use rejection::Rejection;
pub use stats::{IdempotencyStats, LockStats};

/// The README's Rust examples are compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
