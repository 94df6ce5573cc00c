//! Where leases and idempotency records live: the [`LockBackend`] trait,
//! [`MemoryBackend`], [`RedisBackend`] and [`RedlockBackend`] (a quorum of
//! independent nodes), and [`IdempotencyBackend`], the open trait of the
//! idempotency layer's stores (claims and records; implement it for your own
//! database). The SQL stores (`PostgresBackend`, `SqlxPostgresBackend`,
//! `SqliteBackend`), whose records commit in the handler's own database
//! transaction, are a crate of their own built on this module's public API:
//! [`tower-redis-lock-sql`](https://docs.rs/tower-redis-lock-sql). A shared
//! backend is an `Arc` of one: `Arc<B>` and `Arc<dyn LockBackend>` are
//! backends too, and likewise for
//! [`IdempotencyBackend`]. [`RedisBackend`] answers
//! duplicates of leases this process holds from a local in-flight table,
//! without asking Redis. Every store of the crate passes one suite of
//! checks, public behind the feature `testing` (`Suite`), so that a store
//! you write for your own database can run it too.
//!
//! The contract (each step one round trip):
//!
//! - [`acquire`](LockBackend::acquire) sets `key = token` with an expiry if the
//!   key is free **or already holds `token`** (a client that re-sends the
//!   command after a lost reply must not conflict with itself), and otherwise
//!   reports the holder's remaining time.
//! - [`release`](LockBackend::release) and [`extend`](LockBackend::extend)
//!   act only if the key still holds `token` (compare-and-act).
//!
//! Deadlines are applied by the layer around every call, so a backend does
//! not need its own (but may have one).
//!
//! A store author finds the traits, the checks every store passes, and one
//! folder per store:
//!
//! | path | holds |
//! |---|---|
//! | `mod.rs` | these docs and the re-exports |
//! | `lock.rs` | [`Backend`] (what every store is: name, in-process, drain) and [`LockBackend`] (the lease contract) |
//! | `idempotency.rs` | [`IdempotencyBackend`] (the contract of the idempotency layer's stores) |
//! | `contract.rs` | the types both contracts speak: [`Acquire`], [`Token`], [`Watch`](contract::Watch), [`EntryKey`], [`Claim`], [`BackendFuture`] |
//! | `error.rs` | [`BackendError`] |
//! | `suite.rs` | `Suite` (feature `testing`): the checks every store passes, one method at a time through the traits (`suite/lease.rs`, `suite/idempotency.rs`); every store here runs them |
//! | `memory/` | [`MemoryBackend`]: leases and both traits (`mod.rs`), the claims and records table (`records.rs`) |
//! | `redis/` | [`RedisBackend`]: one road to Redis for leases, claims and records (each step a job, sent through one dispatch, releases and abandons delivered), connecting, the native commands (probed) and the Lua scripts, the local in-flight table, the subscribers (the folder's own docs have its map) |
//! | `redlock.rs` | [`RedlockBackend`]: one lease on a majority of independent backends |
//! | `watchers.rs` | the keys this process watches for releases ([`LockBackend::watch`]), shared by the memory and Redis backends |
//! | `expiring.rs` | the sharded expiring map under the three in-process tables (memory leases, memory records, Redis's local in-flight table) |
//!
//! The record format, its seal and the join feed are the idempotency
//! layer's (in [`idempotency`](crate::idempotency)): a store keeps and hands back
//! opaque bytes.
//!
//! # Deployments
//!
//! Pick the smallest deployment that covers your failure model; the layer and its
//! guarantees are the same on all of them (one backend round trip per request, a
//! lease per key, 409 for a concurrent duplicate).
//!
//! | you run | backend | what a Redis failure does |
//! |---|---|---|
//! | one process | `MemoryBackend` | nothing to fail; leases die with the process |
//! | a fleet, one Redis (or Valkey) primary | `RedisBackend::connect("redis://…")` | Redis down → 503 (fail-closed) or pass-through (fail-open) until it is back |
//! | a fleet that needs Redis to survive a node loss | Sentinel: `redis-sentinel://…` | 503s (or fail-open) until the sentinels promote the replica; leases not yet replicated are lost |
//! | more traffic than one primary takes | Redis Cluster: `redis-cluster://…` | only the slots of a failed master pause, until a replica is promoted; unreplicated leases on it are lost |
//! | leases that must survive losing a minority of nodes | `RedlockBackend` over 3 or 5 independent primaries | nothing while a majority answers; no quorum → 503 |
//!
//! ## Connection URLs
//!
//! All Redis forms go through `RedisBackend::connect(url)` (fred's `Config::from_url`),
//! and through `REDIS_URL` in the quickstart:
//!
//! ```text
//! redis://[user:password@]host:6379[/db]
//! rediss://…                                           # TLS (crate feature `tls-rustls`)
//! redis-cluster://host:7000?node=host:7001&node=host:7002
//! redis-sentinel://host:26379?node=host:26380&node=host:26381&sentinelServiceName=mymaster
//! ```
//!
//! For a cluster one reachable node is enough (the rest is discovered); list a few
//! so start-up survives one being down. For Sentinel the host and every `node` are
//! **sentinels**, and `sentinelServiceName` is required. A URL that cannot be parsed,
//! or that does not answer within 3 s, is an error that names it (password
//! removed) and the cause:
//!
//! ```text
//! $ REDIS_URL='redis-sentinel://127.0.0.1:26379' cargo run --example quickstart
//! quickstart: REDIS_URL: lock backend: cannot parse Redis URL `redis-sentinel://127.0.0.1:26379`: Config Error: Invalid or missing sentinel service name query parameter.
//! ```
//!
//! Redlock takes one backend per independent primary:
//!
//! ```rust,no_run
//! use std::time::Duration;
//! use tower_redis_lock::backend::RedlockBackend;
//!
//! # async fn demo() -> Result<(), tower_redis_lock::backend::BackendError> {
//! let urls = ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"];
//! // One client per independent primary, each without command re-sends.
//! let backend = RedlockBackend::connect(&urls).await?.node_timeout(Duration::from_millis(50));
//! # let _ = backend; Ok(()) }
//! ```
//!
//! and in the quickstart `REDLOCK_URLS=redis://10.0.0.1:6379,redis://10.0.0.2:6379,redis://10.0.0.3:6379`.
//!
//! ## Redis Cluster
//!
//! Lock keys are `prefix:{digest}`: the digest is a hash tag, so each key lives in
//! one slot and keys spread evenly over the masters. On a cluster of masters
//! with replicas:
//!
//! - **Manual failover** (`CLUSTER FAILOVER` on a replica): the replica catches up
//!   first, so no lease is lost; new requests are admitted once the replica
//!   has taken over.
//! - **A master crashes**: its slots pause until a replica is promoted
//!   (`cluster-node-timeout` plus the election); requests
//!   on those keys get the fail policy's answer meanwhile. **Lost-lease window:**
//!   replication is asynchronous, so a lease the master acknowledged but had not
//!   yet sent to its replica is gone after the promotion, and a second instance
//!   can take the same key while the first still runs. The window is the
//!   replication lag at the moment of the crash (short on a healthy network;
//!   as long as the link was down, if it was). The first owner learns it at
//!   release (`LockBackend::release` returns false) or, with renewal on, from
//!   `Lease::is_lost()`.
//! - **Slot migration** (resharding): leases move with `MIGRATE`, keep their TTL
//!   and owner, and exclusion holds throughout. fred 10.1.0 does not follow `ASK`
//!   redirections (it sends the command back to the old owner and then ends its
//!   connection task); `RedisBackend::connect` restarts that task, so a request
//!   whose key is in a slot being migrated gets a 503 and the instance recovers at
//!   once. If you build the fred client yourself, watch its connection task.
//!
//! ## Sentinel
//!
//! When the primary dies, the layer answers 503 (or runs fail-open) until
//! the sentinels have promoted a replica (`down-after-milliseconds` plus the
//! failover), then admits requests again through the new primary, where
//! exclusion across instances holds. The same lost-lease window as for a
//! cluster master applies.
//!
//! ## Redlock
//!
//! `backend::RedlockBackend` holds each lease on a majority (N/2 + 1) of independent
//! primaries. Acquire, release and extend go to all nodes at once and return as
//! soon as the answers settle the outcome, so a request costs one round trip to
//! the quorum-th fastest node, and a stalled node costs nothing (each node call is
//! bounded by `.node_timeout(..)`, 50 ms by default). A lease counts only while its
//! validity `TTL − elapsed − drift` (drift = 1 % of TTL + 2 ms) is positive, and
//! `Lease::remaining` and renewal count from that validity; votes from a failed
//! attempt are given back at once, including those of nodes that answered an
//! error (the command may have run there); a contender gets 409 with a
//! `Retry-After` of when a quorum will be free when another owner's votes leave
//! no quorum, and 503 when failed nodes cost it. So 3 nodes keep working with one
//! down and refuse with two; 5 nodes keep working with two down and refuse with
//! three.
//!
//! Its limits, plainly (Martin Kleppmann, *How to do distributed locking*, 2016):
//! Redlock assumes bounded network delay, bounded process pauses and clocks that
//! run at about the same rate. A GC or VM pause longer than the validity, a clock
//! jump on a node, or a node restarting **without persistence** while it held a
//! vote can let two owners in; it issues no fencing token. Run the nodes with
//! `appendonly yes` (or delay restarts by one TTL), use it to avoid duplicate work,
//! and make the protected operation idempotent where a duplicate would be wrong.
//!
//! What each deployment costs per request, and how long failovers took on
//! loopback: `BENCHMARKS.md` in the repository ("Deployments compared",
//! "Failover").

pub mod contract;
mod error;
pub(crate) mod expiring;
pub(crate) mod idempotency;
pub(crate) mod in_flight;
mod lock;
mod memory;
#[cfg(feature = "redis")]
pub(crate) mod redis;
mod redlock;
#[cfg(feature = "testing")]
mod suite;
pub(crate) mod watchers;
#[cfg(feature = "testing")]
pub use suite::Suite;

pub use error::BackendError;
pub(crate) use error::BackendErrorKind;
pub use idempotency::{ClaimTerms, IdempotencyBackend};
pub use lock::{Backend, LockBackend};
pub use memory::MemoryBackend;
#[cfg(feature = "redis")]
pub use redis::RedisBackend;
pub use redlock::RedlockBackend;

pub(crate) use contract::{Acquire, BackendFuture, Claim, EntryKey, Token};
