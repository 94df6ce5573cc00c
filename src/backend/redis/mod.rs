//! Leases and idempotency records in Redis (or Valkey) through
//! [fred](https://docs.rs/fred): [`RedisBackend`].
//!
//! Every Redis call goes through the fred client as its user configured it
//! (addresses, credentials, TLS, reconnection, command attempts). Each step
//! is a native command where the server has it (Valkey ≥ 9: `SET NX PX GET`,
//! `DELIFEQ`, `SET … IFEQ`, found by a probe), else one `EVALSHA` of a
//! compare-and-act Lua script; either way a re-sent command
//! (fred re-sends in-flight commands on reconnect, up to
//! `max_command_attempts`) finds its own token and cannot conflict with
//! itself; keys are `prefix:{digest}`, a Redis Cluster hash tag, so every
//! script touches one slot.
//!
//! One road to Redis: the two hubs (`lock.rs` for leases, `records.rs` for
//! claims and records) make each step a [`Job`](job::Job) and send it
//! through one [`Dispatch`](dispatch::Dispatch); releases and abandoned
//! claims are delivered (`deliver.rs`). The leaves they call return values
//! and never call back.
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | [`RedisBackend`]: every inherent method (constructors, settings), its [`Backend`] |
//! | `connect.rs` | the fred `Builder` with this crate's defaults, connecting, URL redaction, the refusal of a TLS URL on a build without TLS, the connection supervisor, the `maxmemory-policy` check at connect and on every reconnect |
//! | `lock.rs` | [`LockBackend`](super::LockBackend) for [`RedisBackend`]: the lease hub |
//! | `records.rs` | [`IdempotencyBackend`](crate::backend::IdempotencyBackend) for [`RedisBackend`]: the claim hub, and the pub/sub subscriber that feeds joining duplicates |
//! | `job.rs` | a job: one operation as a value, and how it is written (its script, keys and arguments; its entry in a batch; its native commands in `job/native.rs`) |
//! | `probe.rs` | which road lease jobs take, native commands or scripts: the probe (`COMMAND INFO DELIFEQ`, per node) at connect and on every reconnection |
//! | `dispatch.rs` | the dispatch: every job on its key's connection, in order; batched (one batch in flight per connection), or alone |
//! | `deliver.rs` | delivery: a release or an abandoned claim goes on until Redis answered (in its caller's future, on a task of its own once that is dropped), the same job retried; the drain |
//! | `local.rs` | the local in-flight table: answers hit (a duplicate of a lease this process holds) or miss |
//! | `scripts.rs` | every Lua script of the crate, the `EVALSHA`/`EVAL` calls, and the conversions of replies and errors |
//! | `watch.rs` | waiting for a lease across instances: one subscriber connection, `SSUBSCRIBE` to the keys this process has waiters on, what it hears handed to the backend's watched keys |

pub(crate) mod connect;
mod deliver;
mod dispatch;
mod job;
mod local;
mod lock;
mod probe;
mod records;
pub(crate) mod scripts;
mod watch;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use fred::clients::{Client, Pool};
use fred::interfaces::ClientLike;
use fred::types::Builder;

use self::connect::{EvictionCheck, EvictionPolicy, First};
use self::deliver::Deliveries;
use self::dispatch::{Dispatch, BATCH_TIMEOUT};
use self::local::InFlight;
use self::probe::Probed;
use self::watch::Subscriptions;
use super::{Backend, BackendError, BackendFuture};

/// Leases in Redis: `SET`-if-free-or-ours with `PX` in one round trip,
/// compare-and-delete release, compare-and-expire extend: native commands
/// where the server has them (Valkey ≥ 9: `SET … NX PX … GET`,
/// `DELIFEQ`, `SET … IFEQ`; asked at connect and on every reconnection,
/// see [`native_commands`](Self::native_commands)), Lua scripts elsewhere
/// (`EVALSHA`, with `NOSCRIPT` handled), except for a plain acquire (not
/// fenced, not of a key this process waits for) sent alone by a batching
/// backend (one server or a pool, the default), which is `SET … NX PX …
/// GET` on every server.
///
/// Needs Redis ≥ 7.0 or Valkey ≥ 7.2 (the acquire is `SET key token NX PX ttl
/// GET`); an older server's refusal comes back as an error that says so.
///
/// Wraps a fred [`Client`] (a single server, a cluster or a sentinel-managed
/// primary: they are all `Client`s built from a different `Config`) or a
/// fred [`Pool`]. Keys are `prefix:{digest}`, a Redis Cluster hash tag, so
/// they route to one slot.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// // From a URL, with the crate's defaults (reconnect forever, bounded queue):
/// let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379").await?;
///
/// // Or from a client you configured yourself:
/// use fred::prelude::*;
/// let client = Builder::from_config(Config::from_url("redis://127.0.0.1:6379")?).build()?;
/// client.init().await?;
/// let backend = tower_redis_lock::RedisBackend::new(client);
/// # let _ = backend; Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    /// The road every job takes: the client's (or pool's) connections, and
    /// the batching ([`auto_pipeline`](Self::auto_pipeline),
    /// [`batch_timeout`](Self::batch_timeout)).
    dispatch: Arc<Dispatch>,
    /// The eviction-policy check, at connect and on every reconnection
    /// (shared by clones).
    eviction: Arc<EvictionCheck>,
    /// The local in-flight table ([`local_dedup`](Self::local_dedup)).
    local: Option<Arc<InFlight>>,
    /// Releases and abandoned claims on their way (shared by clones).
    deliveries: Arc<Deliveries>,
    /// How long a fence counter outlives its lease's TTL
    /// ([`fence_window`](Self::fence_window)).
    fence_window: Duration,
    /// The keys this process waits for, and the subscriber that hears their
    /// releases (shared by clones).
    subscriptions: Arc<Subscriptions>,
}

/// The default of [`RedisBackend::fence_window`].
const FENCE_WINDOW: Duration = Duration::from_secs(60);
/// The least [`RedisBackend::batch_timeout`]: a smaller value is raised to it.
const MIN_BATCH_TIMEOUT: Duration = Duration::from_millis(10);

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("connections", &self.dispatch.clients().len())
            .field("auto_pipeline", &self.dispatch.batching())
            .field("local_dedup", &self.local.is_some())
            .field("native_commands", &self.dispatch.paths().native())
            .field("batch_timeout", &self.dispatch.timeout())
            .finish_non_exhaustive()
    }
}

impl RedisBackend {
    /// Use a fred client you built and connected (`init()`).
    ///
    /// fred's default command timeout is none; the layer puts its own deadline
    /// around every call, so that is fine, but you may also want
    /// `max_command_buffer_len` and a `ReconnectPolicy` (see
    /// [`RedisBackend::builder`] for the defaults this crate picks).
    ///
    /// The server's `maxmemory-policy` is checked (a warning if it may
    /// evict leases) when the client is connected already, and again each
    /// time it (re)connects; build the backend inside a Tokio runtime for
    /// that.
    ///
    /// A client you built is used as it is, and this crate cannot see the
    /// URL it came from: a fred built without a TLS feature connects a
    /// `rediss://` or `valkeys://` URL in plain text (fred only logs a
    /// warning), credentials included. Enable this crate's `tls-rustls` (or
    /// fred's own TLS feature), or build through [`RedisBackend::connect`],
    /// [`RedisBackend::connect_lazy`], [`RedisBackend::builder`] or
    /// [`RedisBackend::connect_pool`], which refuse such a URL before
    /// connecting.
    pub fn new(client: Client) -> Self {
        Self::watched(Self::over(Arc::from([client]), None), First::IfConnected)
    }

    /// [`new`](Self::new) over a client this crate built and connected (a
    /// Redlock node): closed once nothing uses it.
    pub(crate) fn new_owned(client: Client) -> Self {
        Self::watched(Self::owning(Arc::from([client])), First::IfConnected)
    }

    /// Use a fred pool you built and connected (`init()`): every call on a
    /// key goes through the same connection of the pool, so a key's calls
    /// keep their order. Otherwise as [`RedisBackend::new`].
    pub fn from_pool(pool: Pool) -> Self {
        Self::watched(Self::over(pool.clients().into(), None), First::IfConnected)
    }

    /// A backend over `clients` that this crate opened (`connect*`, each
    /// Redlock node): closed once the last clone, and the last release on
    /// its way, is gone.
    pub(crate) fn owning(clients: Arc<[Client]>) -> Self {
        let owner = dispatch::Owner::of(&clients);
        Self::over(clients, Some(owner))
    }

    /// A backend over `clients` (one, or a pool's) with the defaults, closed
    /// through `owner` when this crate opened them; its eviction-policy
    /// check not started.
    fn over(clients: Arc<[Client]>, owner: Option<Arc<dispatch::Owner>>) -> Self {
        let subscriptions = Subscriptions::new(&clients[0]);
        let dispatch = Dispatch::new(clients, true, BATCH_TIMEOUT, Arc::default()).owned_by(owner);
        Self {
            dispatch: Arc::new(dispatch),
            eviction: Arc::default(),
            local: Some(Default::default()),
            deliveries: Arc::default(),
            fence_window: FENCE_WINDOW,
            subscriptions: Arc::new(subscriptions),
        }
    }

    /// `self`, its eviction-policy check run on every (re)connection and
    /// first as `first` says.
    fn watched(self, first: First) -> Self {
        let paths = self.dispatch.paths();
        self.eviction.listen(self.dispatch.clients(), first, paths);
        self
    }

    /// Write the script calls of concurrent requests to Redis together, as
    /// one pipeline per batch (on by default; a cluster client sends each
    /// call on its own: a script may only touch keys of one slot).
    /// A call that finds the connection idle is sent at once; calls arriving
    /// while a batch is in flight go out together when it returns. Saves a
    /// system call per command on both ends under load; at low load nothing
    /// changes.
    ///
    /// The batches go out through the fred client, so its addresses,
    /// credentials (a credential provider too), TLS, reconnection and
    /// `max_command_attempts` apply to them as to every other call. Each
    /// connection (one for a `Client`, each of a `Pool`) has at most one
    /// batch in flight, and every call on a key goes through the same
    /// connection in the order it was made, so a release never overtakes
    /// its own acquire. With `false`, each call is sent on its own (on a
    /// `Pool`, still on its key's connection).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_redis_lock::backend::BackendError> {
    /// let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .auto_pipeline(false); // every command on its own, as fred sends it
    /// # let _ = backend; Ok(()) }
    /// ```
    pub fn auto_pipeline(mut self, on: bool) -> Self {
        let (clients, timeout) = (self.dispatch.clients().clone(), self.dispatch.timeout());
        let paths = self.dispatch.paths().clone();
        let owner = self.dispatch.owner();
        self.dispatch = Arc::new(Dispatch::new(clients, on, timeout, paths).owned_by(owner));
        self
    }

    /// How long a batch of script calls in flight may wait for its answer
    /// (default 1 s; see [`auto_pipeline`](Self::auto_pipeline)). Past it the
    /// batch is abandoned: its acquires and extends fail (the layer answers
    /// per its fail policy and cleans up after an acquire that may still
    /// land), its releases are sent again, the connection is replaced, and
    /// the next batch goes out. Keep it above the slowest answer a healthy
    /// Redis gives under your load; it matters most for a client built
    /// without a command timeout (fred's default). On the native road
    /// ([`native_commands`](Self::native_commands)), where lease calls are
    /// not batched, each call has the same bound: past it the call fails
    /// and its connection is replaced (on a cluster, the calls sent while
    /// a connection is being replaced are bounded only by the client's own
    /// command timeout). A client without a reconnect policy (fred's
    /// default for a client built by hand) keeps its connection: a call
    /// past the bound still fails, and a late answer lets the calls behind
    /// it through. The bound is kept by one watch per
    /// connection, not a timer per call: a call gives up between 1 and 1.25
    /// times this timeout after it was sent. Values under 10 ms (among them
    /// `Duration::ZERO`: here it does not mean "no timeout") are raised to 10 ms:
    /// the watch looks every quarter of the timeout, and a bound under a
    /// round trip would give up on every call.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_redis_lock::backend::BackendError> {
    /// use std::time::Duration;
    /// let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .batch_timeout(Duration::from_millis(500));
    /// # let _ = backend; Ok(()) }
    /// ```
    pub fn batch_timeout(mut self, timeout: Duration) -> Self {
        let timeout = timeout.clamp(MIN_BATCH_TIMEOUT, crate::settings::MAX_DURATION);
        let (clients, on) = (self.dispatch.clients().clone(), self.dispatch.batching());
        let paths = self.dispatch.paths().clone();
        let owner = self.dispatch.owner();
        self.dispatch = Arc::new(Dispatch::new(clients, on, timeout, paths).owned_by(owner));
        self
    }

    /// Answer duplicates of a lease *this process* holds (or is taking right
    /// now) from a local in-flight table, without a Redis round trip (on by
    /// default). Requests at other instances still ask Redis; a local entry
    /// never outlives the lease: it is written only after Redis said
    /// *acquired*, expires at call start + TTL, and goes before our release
    /// is sent.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_redis_lock::backend::BackendError> {
    /// let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .local_dedup(false); // every request asks Redis
    /// # let _ = backend; Ok(()) }
    /// ```
    pub fn local_dedup(mut self, on: bool) -> Self {
        self.local = on.then(Default::default);
        self
    }

    /// How long a key's fence counter (`prefix:{digest}:fence`, with
    /// [`fencing`](crate::RedisLockLayer::fencing) on) outlives the TTL of
    /// the lease it was last written for (default 60 s). Every fenced
    /// acquire sets the counter's expiry to TTL + window, so Redis keeps one
    /// counter per key locked within the last TTL + window, not one per key
    /// ever locked. A fence is `max(counter + 1, the server clock in µs)`,
    /// so the fence after a counter expired still passes every earlier one;
    /// what the window buys is tolerance of the server's clock: it may be set
    /// back by up to the window (and the TTL) without a fence going down.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_redis_lock::backend::BackendError> {
    /// use std::time::Duration;
    /// let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .fence_window(Duration::from_secs(600)); // the clock may go back 10 minutes
    /// # let _ = backend; Ok(()) }
    /// ```
    pub fn fence_window(mut self, window: Duration) -> Self {
        self.fence_window = crate::settings::at_most_max(window);
        self
    }

    /// Send lease calls as native commands where the server has them (on by
    /// default): acquire as `SET key token NX PX ttl GET` (a holder's time
    /// left read from its token), release as `DELIFEQ key token`, extend as
    /// `SET key token PX ttl IFEQ token` (Valkey ≥ 9). Whether the server
    /// has them is asked (`COMMAND INFO DELIFEQ`, on each node of a
    /// cluster) at connect and on every reconnection, never read from its
    /// version; a server without them, or one that refuses one to this
    /// client (`unknown command`, `NOPERM`), gets the Lua scripts, as Redis
    /// 7 does. A fenced acquire, an acquire of a key this process waits
    /// for, a release that tells waiters, and every idempotency step stay
    /// scripts (each is atomic across keys). On a busy connection (16
    /// native calls on their way) the next calls go out batched in one
    /// script, as on the script road, each release in it a `DELIFEQ`
    /// (not on a cluster, where nothing is batched). Both
    /// roads keep the same key and value, so instances on either exclude
    /// each other. On a server without them (Redis 7, Valkey before 9) a
    /// plain acquire sent alone still goes as `SET … NX PX … GET`
    /// (every supported server has it; cheaper for the server than the
    /// script; with batching on, so not on a cluster), and every other call
    /// as its script; a server that refuses it gets the script until its
    /// next probe. With `false`, every call is a
    /// script (for this backend and its clones).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_redis_lock::backend::BackendError> {
    /// let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .native_commands(false); // Lua scripts everywhere
    /// # let _ = backend; Ok(()) }
    /// ```
    pub fn native_commands(self, on: bool) -> Self {
        if self.dispatch.paths().enable(on) && on {
            // Turned on again: look at the server once more (and again
            // while it gets no answer, as after a connect).
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let client = self.dispatch.clients()[0].clone();
                let paths = Arc::downgrade(self.dispatch.paths());
                handle.spawn(connect::probe_until_answered(client, paths));
            }
        }
        self
    }

    /// The fred clients every call goes through: the one client given, or
    /// each connection of the pool. Those of a backend built by
    /// [`connect`](Self::connect), [`connect_lazy`](Self::connect_lazy) or
    /// [`connect_pool`](Self::connect_pool) are closed once the backend's
    /// last clone is gone: build your own client
    /// ([`builder`](Self::builder), then [`new`](Self::new)) to keep using
    /// it after.
    pub fn clients(&self) -> &[Client] {
        self.dispatch.clients()
    }

    /// A fred [`Builder`] for `url` with this crate's defaults: reconnect
    /// forever (exponential back-off 50 ms .. 2 s), connection timeout 2 s,
    /// fred command timeout 1 s (the layers' default deadlines are
    /// shorter; lease calls sent natively or batched go without it,
    /// bounded by [`batch_timeout`](Self::batch_timeout), but idempotency
    /// steps, and lease calls sent alone without batching, keep it: an [`IdempotencyLayer::deadline`](crate::IdempotencyLayer::deadline)
    /// over 1 s needs a client with a longer one, from this builder and
    /// `with_performance_config`),
    /// at most 3 attempts per command, a bounded command queue (10,000) so
    /// an outage turns into fast errors instead of memory growth, and
    /// `TCP_NODELAY` and TCP keepalive (30 s idle) on every connection.
    ///
    /// `url` is any form fred accepts: `redis://`, `rediss://`,
    /// `redis-cluster://host:port?node=host:port`,
    /// `redis-sentinel://host:port?sentinelServiceName=name&node=...`.
    pub fn builder(url: &str) -> Result<Builder, BackendError> {
        connect::builder(url)
    }

    /// Connect to `url` and wait up to 3 s for the first connection. Errors
    /// name the URL (password removed) and the cause. The server's
    /// `maxmemory-policy` is checked before this returns, and again on every
    /// reconnection. The connection is the backend's: it is closed (`QUIT`)
    /// once the last clone of the backend is dropped and every release on
    /// its way has been delivered.
    pub async fn connect(url: &str) -> Result<Self, BackendError> {
        let client = Self::builder(url)?
            .build()
            .map_err(|e| connect::config_error(url, e))?;
        let task = connect::wait_connected(&client, url).await?;
        connect::supervise(client.clone(), task);
        let backend = Self::owning(Arc::from([client]));
        backend.check_eviction_policy().await;
        let probed = backend.probe_native().await;
        Ok(backend.watched(First::after(probed)))
    }

    /// Start connecting to `url` in the background and return at once: the
    /// service starts even while Redis is down, requests get the fail policy's
    /// answer until it comes up, and fred keeps reconnecting. The server's
    /// `maxmemory-policy` is checked once connected, and again on every
    /// reconnection. Only a URL that cannot be parsed is an error.
    pub fn connect_lazy(url: &str) -> Result<Self, BackendError> {
        let client = Self::builder(url)?
            // fred's default gives up for good when the *first* connection
            // fails; here the reconnect policy must apply to it too.
            .with_config(|c| c.fail_fast = false)
            .build()
            .map_err(|e| connect::config_error(url, e))?;
        // Listening before the first connection: it is checked too.
        let backend = Self::owning(Arc::from([client.clone()])).watched(First::Later);
        let task = client.connect();
        connect::supervise(client, task);
        Ok(backend)
    }

    /// Like [`RedisBackend::connect`] with a pool of `size` connections.
    pub async fn connect_pool(url: &str, size: usize) -> Result<Self, BackendError> {
        let pool = Self::builder(url)?
            .build_pool(size)
            .map_err(|e| connect::config_error(url, e))?;
        let task = connect::wait_connected(&pool, url).await?;
        connect::supervise(pool.clone(), task);
        let backend = Self::owning(pool.clients().into());
        backend.check_eviction_policy().await;
        let probed = backend.probe_native().await;
        Ok(backend.watched(First::after(probed)))
    }

    /// Read the server's `maxmemory-policy` now and warn if it may evict
    /// leases (once per policy found, shared by clones; see `connect.rs`).
    pub(crate) async fn check_eviction_policy(&self) -> EvictionPolicy {
        self.eviction.run(&self.dispatch.clients()[0]).await
    }

    /// Ask the server whether it has the native lease commands now, and
    /// take the road it says (`probe.rs`).
    pub(crate) async fn probe_native(&self) -> Probed {
        let paths = self.dispatch.paths();
        paths.probe(&self.dispatch.clients()[0]).await
    }

    /// What the last eviction-policy check found.
    #[cfg(test)]
    pub(crate) fn eviction_policy(&self) -> Option<EvictionPolicy> {
        self.eviction.last()
    }
}

impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    /// Waits for the releases and abandoned claims on their way, and for
    /// the idempotent requests running detached ([`IdempotencyBackend::hold`](crate::backend::IdempotencyBackend::hold)).
    fn drain(&self, timeout: Duration) -> BackendFuture<()> {
        let deliveries = self.deliveries.clone();
        BackendFuture::new(async move { deliveries.drain(timeout).await })
    }
}

impl From<Client> for RedisBackend {
    fn from(client: Client) -> Self {
        Self::new(client)
    }
}

impl From<Pool> for RedisBackend {
    fn from(pool: Pool) -> Self {
        Self::from_pool(pool)
    }
}
