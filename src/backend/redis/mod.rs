//! Leases in Redis (or Valkey) through [fred](https://docs.rs/fred).

mod batch;
pub(crate) mod scripts;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fred::clients::{Client, Pool};
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::{ClientLike, LuaInterface};
use fred::types::config::{Config, ReconnectPolicy};
use fred::types::{Builder, ConnectHandle, CustomCommand, Key, Value};

use self::batch::{Batcher, Op};
use self::scripts::Script;
use super::local::InFlight;
use super::{Acquire, BackendError, BackendErrorKind, BackendFuture, LockBackend, Token};

/// Suffix of the fencing counter's key.
const FENCE_SUFFIX: &[u8] = b":fence";

/// What clones of one backend share about the eviction-policy check: it runs
/// once (at connect or after the first acquire) and warns once.
#[derive(Debug, Default)]
struct EvictionCheck {
    checked: std::sync::atomic::AtomicBool,
    warned: std::sync::atomic::AtomicBool,
}

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

    /// Read the server's `maxmemory-policy` (`CONFIG GET`) and warn once per
    /// backend if Redis may evict lease keys (any policy but `noeviction`:
    /// an evicted lease admits a duplicate). A user whose ACL denies `CONFIG`
    /// gets [`EvictionPolicy::Unknown`] and a debug line, never an error.
    ///
    /// Runs on its own once per backend: in [`connect`](RedisBackend::connect),
    /// or in the background after the first acquire that reached the server
    /// (every other constructor, including
    /// [`connect_lazy`](RedisBackend::connect_lazy) while Redis is down).
    pub async fn check_eviction_policy(&self) -> EvictionPolicy {
        self.eviction
            .checked
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let cmd = CustomCommand::new_static("CONFIG", fred::types::ClusterHash::Random, false);
        let reply = self
            .client
            .custom::<Value, _>(cmd, vec!["GET", "maxmemory-policy"])
            .await;
        let policy = match reply {
            Ok(Value::Array(items)) if items.len() >= 2 => items[1].as_string(),
            Ok(Value::Map(map)) => map.inner().into_values().next().and_then(|v| v.as_string()),
            Ok(other) => {
                tracing::debug!(reply = ?other, "unexpected CONFIG GET maxmemory-policy reply");
                None
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot read maxmemory-policy (CONFIG denied by an ACL?); make sure it is `noeviction`");
                return EvictionPolicy::Unknown;
            }
        };
        match policy {
            Some(p) if p == "noeviction" => EvictionPolicy::NoEviction,
            Some(p) => {
                if !self
                    .eviction
                    .warned
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(
                        maxmemory_policy = %p,
                        "Redis may evict lease keys (maxmemory-policy is not `noeviction`): an evicted lease admits a duplicate request; use `noeviction` or a dedicated Redis for leases"
                    );
                }
                EvictionPolicy::Evicts(p)
            }
            None => EvictionPolicy::Unknown,
        }
    }
}

/// Start the eviction-policy check in the background unless it ran already.
fn check_once<C>(client: &C, eviction: &Arc<EvictionCheck>)
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
    use std::sync::atomic::Ordering::Relaxed;
    if eviction.checked.load(Relaxed) || eviction.checked.swap(true, Relaxed) {
        return;
    }
    // Only the client and the check's state are used by the check.
    let backend = RedisBackend {
        client: client.clone(),
        eviction: eviction.clone(),
        local: None,
        batch: None,
    };
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move {
            backend.check_eviction_policy().await;
        });
    }
}

/// What [`RedisBackend::check_eviction_policy`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EvictionPolicy {
    /// `noeviction`: lease keys are never evicted.
    NoEviction,
    /// A policy that may evict lease keys (a warning was logged).
    Evicts(String),
    /// Could not tell (`CONFIG` denied, or an unexpected reply).
    Unknown,
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
        let config = Config::from_url(url).map_err(|e| {
            BackendError::new(
                BackendErrorKind::Other,
                format!("cannot parse Redis URL `{}`", redact_url(url)),
            )
            .with_source(e)
        })?;
        let mut builder = Builder::from_config(config);
        builder
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 2_000, 2))
            .with_connection_config(|c| {
                c.connection_timeout = Duration::from_secs(2);
                c.internal_command_timeout = Duration::from_secs(2);
                c.max_command_attempts = 3;
                c.max_command_buffer_len = 10_000;
            })
            .with_performance_config(|p| {
                p.default_command_timeout = Duration::from_secs(1);
            });
        Ok(builder)
    }

    /// Connect to `url` and wait (up to the connection timeout) for the first
    /// connection. Errors name the URL (password removed) and the cause.
    pub async fn connect(url: &str) -> Result<Self, BackendError> {
        let client = Self::builder(url)?
            .build()
            .map_err(|e| config_error(url, e))?;
        let task = wait_connected(&client, url).await?;
        supervise(client.clone(), task);
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
            .map_err(|e| config_error(url, e))?;
        let task = client.connect();
        supervise(client.clone(), task);
        // The eviction policy is checked after the first acquire succeeds.
        Ok(Self::new(client))
    }
}

impl RedisBackend<Pool> {
    /// Like [`RedisBackend::connect`] with a pool of `size` connections.
    pub async fn connect_pool(url: &str, size: usize) -> Result<Self, BackendError> {
        let pool = RedisBackend::builder(url)?
            .build_pool(size)
            .map_err(|e| config_error(url, e))?;
        let task = wait_connected(&pool, url).await?;
        supervise(pool.clone(), task);
        Ok(Self::new(pool))
    }
}

/// Keep fred's connection task alive for clients this crate built. fred ends
/// it for good (no reconnect; every later command times out) when its router
/// meets an error it does not retry: an `ASK` redirection in fred 10.1.0
/// (the command after `ASKING` goes back to the slot's old owner, which
/// answers `ASK` again until the attempts run out), or a first connection
/// that fails. Start it again with back-off; stop after `quit()`.
pub(crate) fn supervise<C: ClientLike + Clone + Send + Sync + 'static>(
    client: C,
    first: ConnectHandle,
) {
    tokio::spawn(async move {
        let mut task = first;
        let mut delay = Duration::from_millis(50);
        loop {
            let started = std::time::Instant::now();
            match task.await {
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "redis connection task ended; starting it again")
                }
                // `quit()`, or the runtime is shutting down.
                Ok(Ok(())) | Err(_) => return,
            }
            if started.elapsed() > Duration::from_secs(10) {
                delay = Duration::from_millis(50);
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
            task = client.connect();
        }
    });
}

async fn wait_connected<C: ClientLike>(
    client: &C,
    url: &str,
) -> Result<ConnectHandle, BackendError> {
    // `init` subscribes to the connect notification before connecting, so it
    // cannot miss a fast success; bound it in time ourselves.
    match tokio::time::timeout(Duration::from_secs(3), client.init()).await {
        Ok(Ok(task)) => Ok(task),
        Ok(Err(e)) => Err(unreachable_error(url, Some(e))),
        Err(_) => {
            let _ = tokio::time::timeout(Duration::from_millis(100), client.quit()).await;
            Err(unreachable_error(url, None))
        }
    }
}

fn config_error(url: &str, e: FredError) -> BackendError {
    BackendError::new(
        BackendErrorKind::Other,
        format!("invalid Redis configuration for `{}`", redact_url(url)),
    )
    .with_source(e)
}

fn unreachable_error(url: &str, e: Option<FredError>) -> BackendError {
    let url = redact_url(url);
    let message = match &e {
        Some(e) if *e.kind() == ErrorKind::Auth => format!(
            "Redis at `{url}` refused the credentials (wrong password, or the ACL user is \
             disabled or lacks a command)"
        ),
        // `ErrorKind::Tls` exists only with a TLS feature; match the text.
        Some(e) if e.to_string().contains("TLS") || e.details().contains("Certificate") => {
            format!("TLS handshake with Redis at `{url}` failed (is the server's CA trusted?)")
        }
        _ => format!(
            "cannot reach Redis at `{url}` (is redis-server running and the address right?)"
        ),
    };
    let err = BackendError::new(BackendErrorKind::Unavailable, message);
    match e {
        Some(e) => err.with_source(e),
        None => err,
    }
}

/// The URL with any password replaced by `***`, for error messages: the
/// userinfo password (up to the *last* `@`, since passwords often carry an
/// unescaped `@`) and query parameters named like `*password*`
/// (`sentinelPassword`).
pub(crate) fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let mut out = format!("{scheme}://");
    match before_query.rsplit_once('@') {
        Some((userinfo, host)) => {
            match userinfo.split_once(':') {
                Some((user, _)) => out.push_str(&format!("{user}:***@")),
                None => out.push_str("***@"),
            }
            out.push_str(host);
        }
        None => out.push_str(before_query),
    }
    if let Some(query) = query {
        out.push('?');
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((name, _)) if name.to_ascii_lowercase().contains("password") => {
                    format!("{name}=***")
                }
                _ => param.to_owned(),
            })
            .collect();
        out.push_str(&params.join("&"));
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("redis://user:hunter2@localhost:6379"),
            "redis://user:***@localhost:6379"
        );
        assert_eq!(
            redact_url("redis://localhost:6379"),
            "redis://localhost:6379"
        );
        // Unescaped `@` and `:` inside the password.
        let url = "rediss://lock:p@ss:w@rd@redis.internal:6380/0";
        assert_eq!(redact_url(url), "rediss://lock:***@redis.internal:6380/0");
        // Password-only userinfo, as in `redis://:pw@host`.
        assert_eq!(redact_url("redis://:hunter2@h"), "redis://:***@h");
        // Sentinel passwords travel in the query.
        let url = "redis-sentinel://u:pw1@h:26379/0?sentinelServiceName=m&sentinelPassword=pw2&node=h2:26379";
        let redacted = redact_url(url);
        assert_eq!(
            redacted,
            "redis-sentinel://u:***@h:26379/0?sentinelServiceName=m&sentinelPassword=***&node=h2:26379"
        );
        assert!(!redacted.contains("pw1") && !redacted.contains("pw2"));
    }

    #[test]
    fn config_errors_do_not_echo_the_password() {
        let err = RedisBackend::builder("redis://u:hunter2@/nohost").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(!format!("{err:?}").contains("hunter2"), "{err:?}");
    }

    #[test]
    fn bad_url_is_a_clear_error() {
        let err = RedisBackend::builder("http//nope").unwrap_err();
        assert!(err.to_string().contains("cannot parse Redis URL"), "{err}");
    }
}
