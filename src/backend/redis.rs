//! Leases in Redis (or Valkey) through [fred](https://docs.rs/fred).

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use fred::clients::{Client, Pool};
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::{ClientLike, LuaInterface};
use fred::types::config::{Config, ReconnectPolicy};
use fred::types::{Builder, ConnectHandle, Key, Value};

use super::{Acquire, BackendError, BackendErrorKind, BackendFuture, LockBackend, Token};

/// Take the key if free or already ours (a re-sent command after a lost
/// reply), else report the holder's remaining milliseconds.
const ACQUIRE_LUA: &str = r#"local cur = redis.call('GET', KEYS[1])
if cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, 0}
end
return {0, redis.call('PTTL', KEYS[1])}"#;

/// Compare-and-delete.
const RELEASE_LUA: &str = r#"if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0"#;

/// Compare-and-expire.
const EXTEND_LUA: &str = r#"if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0"#;

/// A Lua script sent with `EVALSHA`, falling back to `EVAL` (which also caches
/// it on that server) when the server answers `NOSCRIPT` (restart, failover,
/// `SCRIPT FLUSH`, a cluster node that never saw it).
#[derive(Clone)]
struct Script {
    lua: &'static str,
    sha: String,
}

impl Script {
    fn new(lua: &'static str) -> Self {
        Self {
            lua,
            sha: fred::util::sha1_hash(lua),
        }
    }

    async fn run<C: LuaInterface + Send + Sync>(
        &self,
        client: &C,
        key: Key,
        args: Vec<Value>,
    ) -> Result<Value, FredError> {
        match client
            .evalsha::<Value, _, _, _>(self.sha.as_str(), key.clone(), args.clone())
            .await
        {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                client.eval::<Value, _, _, _>(self.lua, key, args).await
            }
            other => other,
        }
    }
}

struct Scripts {
    acquire: Script,
    release: Script,
    extend: Script,
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
    scripts: std::sync::Arc<Scripts>,
}

impl<C: Clone> Clone for RedisBackend<C> {
    fn clone(&self) -> Self {
        Self {
            client: self.client.clone(),
            scripts: self.scripts.clone(),
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
            client,
            scripts: std::sync::Arc::new(Scripts {
                acquire: Script::new(ACQUIRE_LUA),
                release: Script::new(RELEASE_LUA),
                extend: Script::new(EXTEND_LUA),
            }),
        }
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
        Ok(Self::new(client))
    }

    /// Start connecting to `url` in the background and return at once: the
    /// service starts even while Redis is down, requests get the fail policy's
    /// answer until it comes up, and fred keeps reconnecting.
    /// Only a URL that cannot be parsed is an error.
    pub fn connect_lazy(url: &str) -> Result<Self, BackendError> {
        let client = Self::builder(url)?
            .build()
            .map_err(|e| config_error(url, e))?;
        let task = client.connect();
        supervise(client.clone(), task);
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
    let err = BackendError::new(
        BackendErrorKind::Unavailable,
        format!(
            "cannot reach Redis at `{}` (is redis-server running and the address right?)",
            redact_url(url)
        ),
    );
    match e {
        Some(e) => err.with_source(e),
        None => err,
    }
}

/// The URL with any password replaced by `***`, for error messages.
pub(crate) fn redact_url(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        if let Some((userinfo, host)) = rest.split_once('@') {
            let user = userinfo.split(':').next().unwrap_or("");
            if userinfo.contains(':') {
                return format!("{scheme}://{user}:***@{host}");
            }
            return format!("{scheme}://***@{host}");
        }
    }
    url.to_owned()
}

fn map_err(e: FredError) -> BackendError {
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

fn token_value(token: &Token) -> Value {
    Value::Bytes(Bytes::copy_from_slice(&token.to_hex()))
}

fn ttl_ms(ttl: Duration) -> Value {
    // At least 1 ms: `PX 0` is an error in Redis.
    Value::Integer(ttl.as_millis().clamp(1, i64::MAX as u128) as i64)
}

fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Integer(i) => Some(*i),
        Value::String(s) => s.parse().ok(),
        Value::Bytes(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn protocol(what: &str, v: &Value) -> BackendError {
    BackendError::new(
        BackendErrorKind::Protocol,
        format!("unexpected reply to {what}: {v:?}"),
    )
}

impl<C> LockBackend for RedisBackend<C>
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        let client = self.client.clone();
        let scripts = self.scripts.clone();
        let key = Key::from(key.clone());
        let args = vec![token_value(token), ttl_ms(ttl)];
        Box::pin(async move {
            let reply = scripts
                .acquire
                .run(&client, key, args)
                .await
                .map_err(map_err)?;
            match &reply {
                Value::Array(items) if items.len() == 2 => {
                    match (as_int(&items[0]), as_int(&items[1])) {
                        (Some(1), _) => Ok(Acquire::Acquired { fence: None }),
                        (Some(0), Some(pttl)) => Ok(Acquire::Held {
                            retry_after: (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
                        }),
                        _ => Err(protocol("acquire", &reply)),
                    }
                }
                _ => Err(protocol("acquire", &reply)),
            }
        })
    }

    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        let client = self.client.clone();
        let scripts = self.scripts.clone();
        let key = Key::from(key.clone());
        let args = vec![token_value(token)];
        Box::pin(async move {
            let reply = scripts
                .release
                .run(&client, key, args)
                .await
                .map_err(map_err)?;
            as_int(&reply)
                .map(|n| n == 1)
                .ok_or_else(|| protocol("release", &reply))
        })
    }

    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        let client = self.client.clone();
        let scripts = self.scripts.clone();
        let key = Key::from(key.clone());
        let args = vec![token_value(token), ttl_ms(ttl)];
        Box::pin(async move {
            let reply = scripts
                .extend
                .run(&client, key, args)
                .await
                .map_err(map_err)?;
            as_int(&reply)
                .map(|n| n == 1)
                .ok_or_else(|| protocol("extend", &reply))
        })
    }

    fn name(&self) -> &'static str {
        "redis"
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
    }

    #[test]
    fn bad_url_is_a_clear_error() {
        let err = RedisBackend::builder("http//nope").unwrap_err();
        assert!(err.to_string().contains("cannot parse Redis URL"), "{err}");
    }
}
