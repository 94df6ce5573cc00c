//! [`LockBackend`] for [`RedisBackend`]: each step is one script call
//! (`scripts.rs`), handed to the batcher when there is one and answered from
//! the local in-flight table when it can be; and the parsing of acquire
//! replies (the conversions shared with the Redis
//! [`IdempotencyBackend`](crate::backend::IdempotencyBackend) are in `scripts.rs`).

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use fred::error::Error as FredError;
use fred::interfaces::LuaInterface;
use fred::types::{Key, Value};

use super::batch::{dispatch, Job, Op};
use super::connect::check_once;
use super::scripts::{self, as_int, map_err, protocol, ttl_millis, Script};
use super::RedisBackend;
use crate::backend::{Acquire, BackendError, BackendErrorKind, BackendFuture, LockBackend, Token};

impl<C> LockBackend for RedisBackend<C>
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.deliveries.saw_ttl(ttl);
        // A key this process waits for is marked when found held, so that
        // its release is published.
        let mark = self.subscriptions.watchers.is_watched(key);
        match &self.local {
            Some(table) => {
                let this = self.clone();
                table.acquire(key, token, ttl, move |k, t, ttl| {
                    this.eval_acquire(k, t, ttl, mark)
                })
            }
            None => BackendFuture::new(self.eval_acquire(key, token, ttl, mark)),
        }
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.deliveries.saw_ttl(ttl);
        let mark = self.subscriptions.watchers.is_watched(key);
        match &self.local {
            Some(table) => {
                let this = self.clone();
                table.acquire(key, token, ttl, move |k, t, ttl| {
                    this.eval_acquire_fenced(k, t, ttl, mark)
                })
            }
            None => self.eval_acquire_fenced(key, token, ttl, mark),
        }
    }

    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.deliver_release(key, token, false)
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.deliver_release(key, token, true)
    }

    /// Releases of keys this process waits for are heard here as soon as
    /// Redis answered; from other instances, through one subscriber
    /// connection (`watch.rs`).
    fn watch(&self, key: &Bytes) -> Option<BackendFuture<crate::backend::contract::Watch>> {
        self.subscriptions.watch(key)
    }

    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        self.deliveries.saw_ttl(ttl);
        match &self.local {
            Some(table) => table.extend(key, token, ttl, self.eval_extend(key, token, ttl)),
            None => BackendFuture::new(self.eval_extend(key, token, ttl)),
        }
    }
}

impl<C> RedisBackend<C>
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
    /// A release (`notify`: through [`RELEASE_NOTIFY_LUA`](scripts::RELEASE_NOTIFY_LUA)),
    /// delivered until Redis answered, retried: in the caller's future
    /// while it waits, on a task of its own once the caller stops waiting
    /// (deadline); the release still goes out. Once Redis says released,
    /// this process's waiters for the key hear of it.
    fn deliver_release(&self, key: &Bytes, token: &Token, notify: bool) -> BackendFuture<bool> {
        if let Some(table) = &self.local {
            table.forget(key, token);
        }
        // Its publication, when it comes back to our subscriber, is an echo.
        self.subscriptions.watchers.releasing(key, &token.to_hex());
        let attempt = {
            let this = self.clone();
            let (key, token) = (key.clone(), *token);
            move || {
                let call = this.eval_release(&key, &token, notify);
                let watchers = this.subscriptions.watchers.clone();
                let key = key.clone();
                async move {
                    let released = call.await;
                    if matches!(released, Ok(true)) {
                        watchers.released(&key);
                    }
                    released
                }
            }
        };
        self.deliveries.deliver(attempt(), attempt)
    }

    /// [`ACQUIRE_LUA`](scripts::ACQUIRE_LUA) (with `mark`,
    /// [`ACQUIRE_WAIT_LUA`](scripts::ACQUIRE_WAIT_LUA), sent alone),
    /// batched when it can be.
    fn eval_acquire(
        &self,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
        mark: bool,
    ) -> impl Future<Output = Result<Acquire, BackendError>> + Send + 'static {
        let client = self.client.clone();
        let eviction = self.eviction.clone();
        let key = Key::from(key.clone());
        let script: &'static Script = match mark {
            true => &scripts::ACQUIRE_WAIT,
            false => &scripts::ACQUIRE,
        };
        let job = Job::new(
            Op::Acquire,
            script,
            key,
            token.to_hex(),
            Some(ttl_millis(ttl)),
            None,
        )
        .marked(mark);
        let call = dispatch(&client, self.batch.as_ref(), job);
        async move {
            let reply = call.await.map_err(acquire_err)?;
            check_once(&client, &eviction);
            parse_acquire(&reply, false)
        }
    }

    /// [`ACQUIRE_FENCED_LUA`](scripts::ACQUIRE_FENCED_LUA) on the lease and its
    /// fence counter (two keys: never inside a batch script, but through the
    /// batcher's queue when there is one, so the key's later calls, a cleanup
    /// release among them, cannot overtake it).
    fn eval_acquire_fenced(
        &self,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
        mark: bool,
    ) -> BackendFuture<Acquire> {
        let client = self.client.clone();
        let eviction = self.eviction.clone();
        // Bounded well below what Redis accepts as an expiry (now + ms in an i64).
        let life =
            (ttl_millis(ttl).saturating_add(ttl_millis(self.fence_window))).min(i64::MAX / 4);
        let job = Job::new(
            Op::AcquireFenced,
            &scripts::ACQUIRE_FENCED,
            Key::from(key.clone()),
            token.to_hex(),
            Some(ttl_millis(ttl)),
            Some(life),
        )
        .marked(mark);
        let call = dispatch(&client, self.batch.as_ref(), job);
        BackendFuture::new(async move {
            let reply = call.await.map_err(map_err)?;
            check_once(&client, &eviction);
            parse_acquire(&reply, true)
        })
    }

    /// [`RELEASE_LUA`](scripts::RELEASE_LUA), batched when it can be; with
    /// `notify`, [`RELEASE_NOTIFY_LUA`](scripts::RELEASE_NOTIFY_LUA), alone
    /// (its second key is the wait mark).
    fn eval_release(
        &self,
        key: &Bytes,
        token: &Token,
        notify: bool,
    ) -> impl Future<Output = Result<bool, BackendError>> + Send + 'static {
        let op = match notify {
            true => Op::ReleaseNotify,
            false => Op::Release,
        };
        self.compare_and_act(op, key, token, None)
    }

    /// [`EXTEND_LUA`](scripts::EXTEND_LUA), batched when it can be.
    fn eval_extend(
        &self,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, BackendError>> + Send + 'static {
        self.compare_and_act(Op::Extend, key, token, Some(ttl_millis(ttl)))
    }

    /// Release or extend: a compare-and-act script answering 1 (done) or 0.
    fn compare_and_act(
        &self,
        op: Op,
        key: &Bytes,
        token: &Token,
        ttl_ms: Option<i64>,
    ) -> impl Future<Output = Result<bool, BackendError>> + Send + 'static {
        let key = Key::from(key.clone());
        let (script, what): (&Script, _) = match op {
            Op::Release => (&scripts::RELEASE, "release"),
            Op::ReleaseNotify => (&scripts::RELEASE_NOTIFY, "release"),
            Op::Extend => (&scripts::EXTEND, "extend"),
            // Not a compare-and-act script; its array reply would be a
            // protocol error below.
            Op::Acquire | Op::AcquireFenced => (&scripts::ACQUIRE, "acquire"),
        };
        let job = Job::new(op, script, key, token.to_hex(), ttl_ms, None)
            .marked(matches!(op, Op::ReleaseNotify));
        let call = dispatch(&self.client, self.batch.as_ref(), job);
        async move {
            let reply = call.await.map_err(map_err)?;
            as_int(&reply)
                .map(|n| n == 1)
                .ok_or_else(|| protocol(what, &reply))
        }
    }
}

/// An acquire's reply: [`ACQUIRED`](scripts::ACQUIRED) or the holder's
/// `PTTL` ([`ACQUIRE_LUA`](scripts::ACQUIRE_LUA), the batch script); with
/// `fenced`, `{1, fence}` acquired or `{0, pttl}` held
/// ([`ACQUIRE_FENCED_LUA`](scripts::ACQUIRE_FENCED_LUA)).
fn parse_acquire(reply: &Value, fenced: bool) -> Result<Acquire, BackendError> {
    let held = |pttl: i64| Acquire::Held {
        retry_after: (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
    };
    if !fenced {
        return match as_int(reply) {
            Some(scripts::ACQUIRED) => Ok(Acquire::acquired(None)),
            Some(pttl) if pttl >= -1 => Ok(held(pttl)),
            _ => Err(protocol("acquire", reply)),
        };
    }
    let Value::Array(items) = reply else {
        return Err(protocol("acquire", reply));
    };
    match (
        items.first().and_then(as_int),
        items.get(1).and_then(as_int),
    ) {
        (Some(1), Some(fence)) if fence >= 0 => Ok(Acquire::acquired(Some(fence as u64))),
        (Some(0), Some(pttl)) => Ok(held(pttl)),
        _ => Err(protocol("acquire", reply)),
    }
}

/// [`map_err`] for an acquire: a server older than Redis 7.0 refuses `SET`
/// with both `NX` and `GET` as a syntax error; say what to upgrade.
fn acquire_err(e: FredError) -> BackendError {
    if e.details().contains("syntax error") {
        let message = format!(
            "Redis refused `SET key token NX PX ttl GET` ({}): the lock needs Redis >= 7.0 or Valkey >= 7.2",
            e.details()
        );
        return BackendError::with_kind(BackendErrorKind::Other, message).with_source(e);
    }
    map_err(e)
}

#[cfg(test)]
mod tests;
