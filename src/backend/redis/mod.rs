//! Leases in Redis (or Valkey) through [fred](https://docs.rs/fred).

mod batch;
pub(crate) mod connect;
pub(crate) mod scripts;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fred::clients::{Client, Pool};
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::{ClientLike, LuaInterface};
use fred::types::{Builder, Key, Value};

use self::batch::{Batcher, Op};
use self::connect::{check_once, EvictionCheck};
use self::scripts::Script;
use super::local::InFlight;
use super::{Acquire, BackendError, BackendErrorKind, BackendFuture, LockBackend, Token};

pub use self::connect::EvictionPolicy;

/// Suffix of the fencing counter's key.
const FENCE_SUFFIX: &[u8] = b":fence";

/// Leases in Redis: `SET`-if-free-or-ours with `PX` in one Lua round trip,
/// compare-and-delete release, compare-and-expire extend (`EVALSHA`, with
/// `NOSCRIPT` handled).
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
    client: C,
    eviction: Arc<EvictionCheck>,
    local: Option<std::sync::Arc<InFlight>>,
    batch: Option<Arc<Batcher>>,
}

impl<C: Clone> Clone for RedisBackend<C> {
    fn clone(&self) -> Self {
        Self {
            client: self.client.clone(),
            eviction: self.eviction.clone(),
            local: self.local.clone(),
            batch: self.batch.clone(),
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
    pub fn new(client: C) -> Self {
        Self {
            eviction: Arc::default(),
            local: Some(Default::default()),
            batch: Batcher::of(&client).map(Arc::new),
            client,
        }
    }

    /// Write the script calls of concurrent requests to Redis together, as
    /// one pipeline per batch (on by default for a fred `Client` or `Pool`).
    /// A call that finds the connection idle is sent at once; calls arriving
    /// while a batch is in flight go out together when it returns. Saves a
    /// system call per command on both ends under load; at low load nothing
    /// changes.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_redis_lock::BackendError> {
    /// let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .auto_pipeline(false); // every command on its own, as fred sends it
    /// # let _ = backend; Ok(()) }
    /// ```
    pub fn auto_pipeline(mut self, on: bool) -> Self {
        self.batch = if on {
            Batcher::of(&self.client).map(Arc::new)
        } else {
            None
        };
        self
    }

    /// Answer duplicates of a lease *this process* holds (or is taking right
    /// now) from a local in-flight table, without a Redis round trip (on by
    /// default). Requests at other instances still ask Redis; a local entry
    /// never outlives the lease (see [`LocalDedup`](super::LocalDedup)).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tower_redis_lock::BackendError> {
    /// let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .local_dedup(false); // every request asks Redis
    /// # let _ = backend; Ok(()) }
    /// ```
    pub fn local_dedup(mut self, on: bool) -> Self {
        self.local = on.then(Default::default);
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
    /// at most 3 attempts per command, and a bounded command queue (10,000) so
    /// an outage turns into fast errors instead of memory growth.
    ///
    /// `url` is any form fred accepts: `redis://`, `rediss://`,
    /// `redis-cluster://host:port?node=host:port`,
    /// `redis-sentinel://host:port?sentinelServiceName=name&node=...`.
    pub fn builder(url: &str) -> Result<Builder, BackendError> {
        connect::builder(url)
    }

    /// Connect to `url` and wait (up to the connection timeout) for the first
    /// connection. Errors name the URL (password removed) and the cause.
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

pub(crate) fn map_err(e: FredError) -> BackendError {
    let kind = match e.kind() {
        ErrorKind::Timeout => BackendErrorKind::Timeout,
        ErrorKind::Protocol | ErrorKind::Parse => BackendErrorKind::Protocol,
        ErrorKind::IO
        | ErrorKind::Canceled
        | ErrorKind::Backpressure
        | ErrorKind::Routing
        | ErrorKind::Cluster
        | ErrorKind::Sentinel => BackendErrorKind::Unavailable,
        _ => BackendErrorKind::Other,
    };
    BackendError::new(kind, "redis command failed").with_source(e)
}

pub(crate) fn token_value(token: &Token) -> Value {
    Value::Bytes(Bytes::copy_from_slice(&token.to_hex()))
}

pub(crate) fn ttl_ms(ttl: Duration) -> Value {
    // At least 1 ms: `PX 0` is an error in Redis.
    Value::Integer(ttl.as_millis().clamp(1, i64::MAX as u128) as i64)
}

pub(crate) fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Integer(i) => Some(*i),
        Value::String(s) => s.parse().ok(),
        Value::Bytes(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

pub(crate) fn protocol(what: &str, v: &Value) -> BackendError {
    BackendError::new(
        BackendErrorKind::Protocol,
        format!("unexpected reply to {what}: {v:?}"),
    )
}

/// `{1, fence}` acquired, `{0, pttl}` held (`fenced`: the second item of an
/// acquired reply is the fencing token).
fn parse_acquire(reply: &Value, fenced: bool) -> Result<Acquire, BackendError> {
    let Value::Array(items) = reply else {
        return Err(protocol("acquire", reply));
    };
    match (
        items.first().and_then(as_int),
        items.get(1).and_then(as_int),
    ) {
        (Some(1), _) if !fenced => Ok(Acquire::Acquired { fence: None }),
        (Some(1), Some(fence)) if fence >= 0 => Ok(Acquire::Acquired {
            fence: Some(fence as u64),
        }),
        (Some(0), Some(pttl)) => Ok(Acquire::Held {
            retry_after: (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
        }),
        _ => Err(protocol("acquire", reply)),
    }
}

impl<C> LockBackend for RedisBackend<C>
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        match &self.local {
            Some(table) => {
                let this = self.clone();
                table.acquire(key, token, ttl, move |k, t, ttl| {
                    this.eval_acquire(k, t, ttl)
                })
            }
            None => self.eval_acquire(key, token, ttl),
        }
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        match &self.local {
            Some(table) => {
                let this = self.clone();
                table.acquire(key, token, ttl, move |k, t, ttl| {
                    this.eval_acquire_fenced(k, t, ttl)
                })
            }
            None => self.eval_acquire_fenced(key, token, ttl),
        }
    }

    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        if let Some(table) = &self.local {
            table.forget(key, token);
        }
        self.eval_release(key, token)
    }

    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        match &self.local {
            Some(table) => table.extend(key, token, ttl, self.eval_extend(key, token, ttl)),
            None => self.eval_extend(key, token, ttl),
        }
    }

    fn name(&self) -> &'static str {
        "redis"
    }
}

impl<C> RedisBackend<C>
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
    fn eval_acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        let client = self.client.clone();
        let eviction = self.eviction.clone();
        let batch = self.batch.clone();
        let key = Key::from(key.clone());
        let args = vec![token_value(token), ttl_ms(ttl)];
        Box::pin(async move {
            let reply = scripts::ACQUIRE
                .run(&client, batch.as_ref(), Op::Acquire, key, args)
                .await
                .map_err(map_err)?;
            check_once(&client, &eviction);
            parse_acquire(&reply, false)
        })
    }

    fn eval_acquire_fenced(
        &self,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
    ) -> BackendFuture<Acquire> {
        let client = self.client.clone();
        let eviction = self.eviction.clone();
        let mut fence_key = Vec::with_capacity(key.len() + FENCE_SUFFIX.len());
        fence_key.extend_from_slice(key);
        fence_key.extend_from_slice(FENCE_SUFFIX);
        let keys = vec![Key::from(key.clone()), Key::from(Bytes::from(fence_key))];
        let args = vec![token_value(token), ttl_ms(ttl)];
        Box::pin(async move {
            let reply = scripts::ACQUIRE_FENCED
                .run_multi(&client, keys, args)
                .await
                .map_err(map_err)?;
            check_once(&client, &eviction);
            parse_acquire(&reply, true)
        })
    }

    fn eval_release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.compare_and_act(Op::Release, key, vec![token_value(token)])
    }

    fn eval_extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        self.compare_and_act(Op::Extend, key, vec![token_value(token), ttl_ms(ttl)])
    }

    /// Release or extend: a compare-and-act script answering 1 (done) or 0.
    fn compare_and_act(&self, op: Op, key: &Bytes, args: Vec<Value>) -> BackendFuture<bool> {
        let client = self.client.clone();
        let batch = self.batch.clone();
        let key = Key::from(key.clone());
        Box::pin(async move {
            let (script, what): (&Script, _) = match op {
                Op::Release => (&scripts::RELEASE, "release"),
                Op::Extend => (&scripts::EXTEND, "extend"),
                // Not a compare-and-act script; its array reply would be a
                // protocol error below.
                Op::Acquire => (&scripts::ACQUIRE, "acquire"),
            };
            let reply = script
                .run(&client, batch.as_ref(), op, key, args)
                .await
                .map_err(map_err)?;
            as_int(&reply)
                .map(|n| n == 1)
                .ok_or_else(|| protocol(what, &reply))
        })
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
