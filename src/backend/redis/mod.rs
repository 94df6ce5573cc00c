//! Leases in Redis (or Valkey) through [fred](https://docs.rs/fred):
//! [`RedisBackend`].
//!
//! Every Redis call goes through the fred client as its user configured it
//! (addresses, credentials, TLS, reconnection, command attempts). Each lease
//! step is one `EVALSHA` of a compare-and-act Lua script, so a re-sent
//! command (fred re-sends in-flight commands on reconnect, up to
//! `max_command_attempts`) finds its own token and cannot conflict with
//! itself; keys are `prefix:{digest}`, a Redis Cluster hash tag, so every
//! script touches one slot.
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | [`RedisBackend`], its constructors and settings |
//! | `connect.rs` | the fred `Builder` with this crate's defaults, connecting, URL redaction, the refusal of a TLS URL on a build without TLS, the connection supervisor, the `maxmemory-policy` check |
//! | `scripts.rs` | every Lua script of the crate (lock, batch, idempotent replay), the `EVALSHA`/`NOSCRIPT` helper, and the conversions of arguments, replies and errors |
//! | `batch.rs` | the batcher: concurrent script calls as one `EVALSHA`, one batch in flight per connection, every call on a key through that key's connection; `dispatch`, which sends one lease call (batched or alone) |
//! | `deliver.rs` | release delivery: each release goes on until Redis answered (in its caller's future, on a task of its own once that is dropped), retried; the drain |
//! | `lock.rs` | [`LockBackend`](super::LockBackend) for [`RedisBackend`] |
//! | `local.rs` | the local in-flight table: duplicates of a lease this process holds, answered without a round trip |
//! | `watch.rs` | waiting for a lease across instances: one subscriber connection, `SSUBSCRIBE` to the keys this process has waiters on, what it hears handed to the backend's watched keys |
//! | `records.rs` | [`IdempotencyBackend`](crate::backend::IdempotencyBackend) for [`RedisBackend`]: one hash per entry, one `EVALSHA` per step (scripts in `scripts.rs`), and the pub/sub subscriber that feeds joining duplicates |

mod batch;
pub(crate) mod connect;
mod deliver;
mod local;
pub(crate) mod lock;
mod records;
pub(crate) mod scripts;
mod watch;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use fred::clients::{Client, Pool};
use fred::interfaces::{ClientLike, LuaInterface};
use fred::types::Builder;

use self::batch::Batcher;
use self::connect::EvictionCheck;
use self::deliver::Deliveries;
use self::local::InFlight;
use self::watch::Subscriptions;
use super::{Backend, BackendError, BackendFuture};

/// Leases in Redis: `SET`-if-free-or-ours with `PX` in one Lua round trip,
/// compare-and-delete release, compare-and-expire extend (`EVALSHA`, with
/// `NOSCRIPT` handled).
///
/// Needs Redis ≥ 7.0 or Valkey ≥ 7.2 (the acquire is `SET key token NX PX ttl
/// GET`); an older server's refusal comes back as an error that says so.
///
/// Wraps a fred [`Client`], [`Pool`] or any other fred client type that
/// implements `LuaInterface` (for example a cluster or sentinel client: they
/// are all `Client`s built from a different `Config`). Keys are
/// `prefix:{digest}`, a Redis Cluster hash tag, so they route to one slot.
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
pub struct RedisBackend<C = Client> {
    /// The fred client or pool every command goes through.
    client: C,
    /// The eviction-policy check, once per backend (shared by clones).
    eviction: Arc<EvictionCheck>,
    /// The local in-flight table ([`local_dedup`](Self::local_dedup)).
    local: Option<Arc<InFlight>>,
    /// The batcher ([`auto_pipeline`](Self::auto_pipeline)); `None` for a
    /// cluster or a client type it cannot drive.
    batch: Option<Arc<Batcher>>,
    /// The batch timeout ([`batch_timeout`](Self::batch_timeout)), kept
    /// while batching is off so that turning it on again keeps it.
    batch_timeout: Duration,
    /// Releases on their way (shared by clones).
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

impl<C: Clone> Clone for RedisBackend<C> {
    fn clone(&self) -> Self {
        Self {
            client: self.client.clone(),
            eviction: self.eviction.clone(),
            local: self.local.clone(),
            batch: self.batch.clone(),
            batch_timeout: self.batch_timeout,
            deliveries: self.deliveries.clone(),
            fence_window: self.fence_window,
            subscriptions: self.subscriptions.clone(),
        }
    }
}

impl<C> fmt::Debug for RedisBackend<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("client", &std::any::type_name::<C>())
            .finish_non_exhaustive()
    }
}

impl<C> RedisBackend<C>
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
    /// Use a fred client or pool you built and connected (`init()`).
    ///
    /// fred's default command timeout is none; the layer puts its own deadline
    /// around every call, so that is fine, but you may also want
    /// `max_command_buffer_len` and a `ReconnectPolicy` (see
    /// [`RedisBackend::builder`] for the defaults this crate picks).
    ///
    /// A client you built is used as it is, and this crate cannot see the
    /// URL it came from: a fred built without a TLS feature connects a
    /// `rediss://` or `valkeys://` URL in plain text (fred only logs a
    /// warning), credentials included. Enable this crate's `tls-rustls` (or
    /// fred's own TLS feature), or build through [`RedisBackend::connect`],
    /// [`RedisBackend::connect_lazy`], [`RedisBackend::builder`] or
    /// [`RedisBackend::connect_pool`], which refuse such a URL before
    /// connecting.
    pub fn new(client: C) -> Self {
        Self {
            eviction: Arc::default(),
            local: Some(Default::default()),
            batch: Batcher::of(&client, batch::BATCH_TIMEOUT).map(Arc::new),
            batch_timeout: batch::BATCH_TIMEOUT,
            deliveries: Arc::default(),
            fence_window: FENCE_WINDOW,
            subscriptions: Arc::new(Subscriptions::new(&client)),
            client,
        }
    }

    /// Write the script calls of concurrent requests to Redis together, as
    /// one pipeline per batch (on by default for a fred `Client` or `Pool`;
    /// a cluster client sends each call on its own: a script may only touch
    /// keys of one slot).
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
        self.batch = if on {
            Batcher::of(&self.client, self.batch_timeout).map(Arc::new)
        } else {
            None
        };
        self
    }

    /// How long a batch of script calls in flight may wait for its answer
    /// (default 1 s; see [`auto_pipeline`](Self::auto_pipeline)). Past it the
    /// batch is abandoned: its acquires and extends fail (the layer answers
    /// per its fail policy and cleans up after an acquire that may still
    /// land), its releases are sent again, the connection is replaced, and
    /// the next batch goes out. Keep it above the slowest answer a healthy
    /// Redis gives under your load; it matters most for a client built
    /// without a command timeout (fred's default).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_redis_lock::backend::BackendError> {
    /// use std::time::Duration;
    /// let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .batch_timeout(Duration::from_millis(500));
    /// # let _ = backend; Ok(()) }
    /// ```
    pub fn batch_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.batch_timeout = timeout;
        if self.batch.is_some() {
            self.batch = Batcher::of(&self.client, timeout).map(Arc::new);
        }
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
        self.fence_window = window;
        self
    }

    /// The wrapped client.
    pub fn client(&self) -> &C {
        &self.client
    }
}

impl RedisBackend<Client> {
    /// A fred [`Builder`] for `url` with this crate's defaults: reconnect
    /// forever (exponential back-off 50 ms .. 2 s), connection timeout 2 s,
    /// fred command timeout 1 s (the layer's own deadline is shorter),
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

    /// Connect to `url` and wait up to 3 s for the first connection. Errors name the URL (password removed) and the cause.
    pub async fn connect(url: &str) -> Result<Self, BackendError> {
        let client = Self::builder(url)?
            .build()
            .map_err(|e| connect::config_error(url, e))?;
        let task = connect::wait_connected(&client, url).await?;
        connect::supervise(client.clone(), task);
        let backend = Self::new(client);
        backend.check_eviction_policy().await;
        Ok(backend)
    }

    /// Start connecting to `url` in the background and return at once: the
    /// service starts even while Redis is down, requests get the fail policy's
    /// answer until it comes up, and fred keeps reconnecting.
    /// Only a URL that cannot be parsed is an error.
    pub fn connect_lazy(url: &str) -> Result<Self, BackendError> {
        let client = Self::builder(url)?
            // fred's default gives up for good when the *first* connection
            // fails; here the reconnect policy must apply to it too.
            .with_config(|c| c.fail_fast = false)
            .build()
            .map_err(|e| connect::config_error(url, e))?;
        let task = client.connect();
        connect::supervise(client.clone(), task);
        // The eviction policy is checked after the first acquire succeeds.
        Ok(Self::new(client))
    }
}

impl RedisBackend<Pool> {
    /// Like [`RedisBackend::connect`] with a pool of `size` connections.
    pub async fn connect_pool(url: &str, size: usize) -> Result<Self, BackendError> {
        let pool = RedisBackend::builder(url)?
            .build_pool(size)
            .map_err(|e| connect::config_error(url, e))?;
        let task = connect::wait_connected(&pool, url).await?;
        connect::supervise(pool.clone(), task);
        Ok(Self::new(pool))
    }
}

impl<C> Backend for RedisBackend<C>
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
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

impl From<Client> for RedisBackend<Client> {
    fn from(client: Client) -> Self {
        Self::new(client)
    }
}

impl From<Pool> for RedisBackend<Pool> {
    fn from(pool: Pool) -> Self {
        Self::new(pool)
    }
}
