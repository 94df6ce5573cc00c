//! The lease contract: [`Backend`], what every store is (its name, whether
//! its keys stay in this process, a graceful shutdown's wait), and
//! [`LockBackend`], the leases themselves; with the forwarding impls that
//! make an `Arc` of a store a store.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::contract::{self, Acquire, BackendFuture, Token};

/// What every store is, whatever it stores: a name for logs, whether its
/// keys stay in this process, and a graceful shutdown's wait. The
/// supertrait of [`LockBackend`] and [`IdempotencyBackend`](super::IdempotencyBackend): a store that
/// is both implements it once. Every method is required, so that a
/// wrapper that forgets one does not compile.
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// A short name for logs and start-up lines (`"memory"`, `"redis"`,
    /// `"postgres"`).
    fn name(&self) -> &'static str;

    /// `true` when keys never leave this process (then an unkeyed digest
    /// reveals nothing and no secret warning is logged).
    fn is_in_process(&self) -> bool;

    /// Wait, at most `timeout`, until everything this store was asked to
    /// finish has finished: every release and abandoned claim delivered
    /// (answered by the store, or given up when it would have expired
    /// anyway), and every request an
    /// [`IdempotencyLayer`](crate::IdempotencyLayer) runs detached
    /// recorded (the layer holds [`IdempotencyBackend::hold`](super::IdempotencyBackend::hold) while one
    /// runs; a transactional store also waits for its open claims). Call
    /// it at graceful shutdown, after the server stopped taking requests
    /// and before the runtime ends: work still on its way when the runtime
    /// ends is lost, and its leases and claims stay until their TTL.
    ///
    /// An error says how much was still on its way at `timeout`. A store
    /// with nothing to wait for answers at once.
    ///
    /// ```no_run
    /// # async fn demo(listener: tokio::net::TcpListener, app: axum::Router) {
    /// use std::time::Duration;
    /// use tower_redis_lock::backend::Backend;
    ///
    /// let backend = tower_redis_lock::RedisBackend::connect("redis://127.0.0.1:6379")
    ///     .await
    ///     .unwrap();
    /// // ... `RedisLockLayer::new(backend.clone(), key)` on the routes ...
    /// axum::serve(listener, app)
    ///     .with_graceful_shutdown(async { let _ = tokio::signal::ctrl_c().await; })
    ///     .await
    ///     .unwrap();
    /// if let Err(e) = backend.drain(Duration::from_secs(5)).await {
    ///     eprintln!("{e}");
    /// }
    /// # }
    /// ```
    fn drain(&self, timeout: Duration) -> BackendFuture<()>;
}

/// Storage for leases. Implemented by [`MemoryBackend`](super::MemoryBackend), [`RedisBackend`](super::RedisBackend)
/// and [`RedlockBackend`](super::RedlockBackend); implement it to put leases elsewhere. Every
/// method is required (a wrapper that forgets one does not compile).
pub trait LockBackend: Backend {
    /// Take the lease on `key` for `ttl` if it is free or already ours.
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire>;

    /// Like [`acquire`](Self::acquire), and also issue a fencing token in the
    /// same round trip: a number per key that strictly increases (a fresh
    /// lease gets a number larger than every fence issued for the key
    /// before, also after the backend dropped what it kept for the key; a
    /// re-sent acquire that finds our own token gets the number it already
    /// had). Keep any per-key fence state bounded by the live leases: the
    /// crate's backends take a floor from the clock (µs since 1970) so that
    /// they can forget a key's counter once its lease is gone. Used when the
    /// layer has [`fencing`](crate::RedisLockLayer::fencing) on.
    ///
    /// A store that issues no fences forwards to `acquire` (its `Acquired`
    /// then has `fence: None`, and the layer's
    /// [`Lease::fence`](crate::Lease::fence) is `None`).
    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire>;

    /// Delete `key` if it still holds `token`. `Ok(false)`: it did not (expired
    /// or taken over).
    ///
    /// A release still on its way is waited for by
    /// [`drain`](Backend::drain).
    ///
    /// The release takes effect even when the returned future is dropped
    /// before it completes, or unpolled: the layer drops it at its
    /// deadline, or when its request goes away (a client that disconnects
    /// while the response's release is on its way). A store whose call
    /// runs only while polled runs it on a task of its own
    /// (`tokio::spawn`) instead; the crate's stores do either. The same
    /// holds for [`release_notify`](Self::release_notify);
    /// `Suite` (feature `testing`) checks both.
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool>;

    /// [`release`](Self::release), and if requests wait for `key` (a
    /// watching backend marked it), tell them, on every instance, in the
    /// same round trip. A layer whose requests wait releases through this;
    /// a layer whose requests never wait uses `release`, which costs
    /// nothing more. A store that hears no releases
    /// ([`watch`](Self::watch) answers `None`) forwards to `release`.
    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool>;

    /// Reset the expiry of `key` to `ttl` if it still holds `token`.
    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool>;

    /// Listen for the releases of `key`, for requests that wait for it
    /// ([`RedisLockLayer::wait`](crate::RedisLockLayer::wait)): the future
    /// resolves once the backend hears them (Redis: once its subscription to
    /// the key's channel is confirmed). While a watch on a key lives, the
    /// backend's acquires of that key that find it held mark it as waited
    /// for, so that a release of it, from any instance, through
    /// [`release_notify`](Self::release_notify), is heard; a release made
    /// through this backend in this process is heard without a round trip.
    ///
    /// `None`: this backend hears nothing; waiting requests then look again
    /// with a bounded back-off (never later than the holder's expiry). An
    /// error means the same for this wait.
    fn watch(&self, key: &Bytes) -> Option<BackendFuture<contract::Watch>>;

    /// How many lease calls this store has had answered as native server
    /// commands (`DELIFEQ`, `SET … IFEQ`), while it takes that road;
    /// `None` while it sends scripts, or for a store without such a road
    /// (every store but `RedisBackend`: write `None`). The layer reports
    /// it as [`LockStats::native_calls`](crate::stats::LockStats::native_calls);
    /// a wrapper forwards it.
    fn native_calls(&self) -> Option<u64>;
}

impl<T: Backend + ?Sized> Backend for Arc<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn is_in_process(&self) -> bool {
        (**self).is_in_process()
    }

    fn drain(&self, timeout: Duration) -> BackendFuture<()> {
        (**self).drain(timeout)
    }
}

impl<T: LockBackend + ?Sized> LockBackend for Arc<T> {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        (**self).acquire(key, token, ttl)
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        (**self).acquire_fenced(key, token, ttl)
    }

    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        (**self).release(key, token)
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        (**self).release_notify(key, token)
    }

    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        (**self).extend(key, token, ttl)
    }

    fn watch(&self, key: &Bytes) -> Option<BackendFuture<contract::Watch>> {
        (**self).watch(key)
    }

    fn native_calls(&self) -> Option<u64> {
        (**self).native_calls()
    }
}
