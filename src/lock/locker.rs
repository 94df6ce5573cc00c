//! [`Locker`]: take leases from handler code, with a layer's settings.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;

use super::acquire::{self, Admission, NoLease};
use super::config::Config;
use super::lease::{Lease, LeaseGuard};

use crate::backend::LockBackend;
use crate::key::{KeyPart, KeyWriter, LockKey};
use crate::rejection::Rejection;

/// Takes leases directly, for handlers whose key needs parsed data (a field
/// of the JSON body, a database id) or that want the lock in their signature
/// (with the `axum` feature, [`LockGuard`] is an extractor when a `Locker` is
/// in the router state).
///
/// Same backend, TTL, deadline, fail policy and answers as the layer it was
/// made from ([`RedisLockLayer::locker`](crate::RedisLockLayer::locker)).
///
/// ```
/// # async fn demo() -> Result<(), tower_redis_lock::Rejection> {
/// use tower_redis_lock::{key::Route, lock::Locker, MemoryBackend};
///
/// let locker = Locker::new(MemoryBackend::new(), Route);
/// let key = locker.key_with(|k| k.push("order", b"42"));
/// let guard = locker.lock(key).await?;          // 409/503 as a `Rejection`
/// assert!(guard.lease().is_locked());
/// assert!(locker.lock(key).await.is_err());    // held
/// guard.release().await;                        // or just drop it
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Locker {
    config: Arc<Config>,
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.config.backend)
            .field("ttl", &self.config.settings.ttl)
            .finish_non_exhaustive()
    }
}

impl Locker {
    pub(crate) fn from_config(config: Arc<Config>) -> Self {
        Self { config }
    }

    /// A locker over `backend` whose [`lock_request`](Self::lock_request)
    /// derives keys with `key`, with the layer defaults; configure through
    /// [`RedisLockLayer`](crate::RedisLockLayer) and
    /// [`RedisLockLayer::locker`](crate::RedisLockLayer::locker) for anything else.
    pub fn new(backend: impl LockBackend, key: impl KeyPart) -> Self {
        let config = Config::new(backend, key);
        config.warn_if_unkeyed();
        Self::from_config(Arc::new(config))
    }

    /// Build a key from your own values (hashed in the layer's key space).
    pub fn key_with(&self, f: impl FnOnce(&mut KeyWriter)) -> LockKey {
        let mut writer = self.config.settings.key_space.writer();
        f(&mut writer);
        writer.finish()
    }

    /// The key the layer's key parts derive from a request head. `Err` when
    /// a part is missing, with the part's own status (401 for a missing
    /// identity), whether or not the layer
    /// [skips](crate::RedisLockLayer::skip_missing_part) locking then: there
    /// is no key to give either way. Nothing is counted.
    pub fn key_for(&self, parts: &Parts) -> Result<LockKey, Rejection> {
        let mut writer = self.config.settings.key_space.writer();
        self.config
            .settings
            .key
            .write(parts, &mut writer)
            .map_err(Rejection::MissingPart)?;
        Ok(writer.finish())
    }

    /// Take the lease on `key`: one backend round trip within the deadline
    /// (or, if the layer [waits](crate::RedisLockLayer::wait) and the key is
    /// held, a wait in its queue, bounded the same). `Err` is the 409 (held) or 503 (backend down, fail-closed) answer; with
    /// a fail-open layer a backend failure gives an unlocked guard instead.
    pub async fn lock(&self, key: LockKey) -> Result<LockGuard, Rejection> {
        let storage = self.config.settings.key_space.storage_key(&key);
        match acquire::start(&self.config, key, storage, 0).await {
            Admission::Locked(taken) => {
                let (guard, lease) = taken.hold(&self.config);
                Ok(LockGuard {
                    lease,
                    guard: Some(guard),
                })
            }
            Admission::Unlocked(lease) => Ok(LockGuard { lease, guard: None }),
            Admission::Rejected(r) => Err(r),
        }
    }

    /// Derive the key from a request head with the layer's key parts and take
    /// the lease. A missing part is rejected, or gives an unlocked guard when
    /// the layer skips locking in that case.
    pub async fn lock_request(&self, parts: &Parts) -> Result<LockGuard, Rejection> {
        match self.derive(parts) {
            Ok(writer) => self.lock(writer.finish()).await,
            Err(NoLease::Reject(r)) => Err(r),
            Err(NoLease::Unlocked(lease)) => Ok(LockGuard { lease, guard: None }),
        }
    }

    /// The layer's key parts' key for a request head; `Err` says how to go
    /// on without a lease.
    fn derive(&self, parts: &Parts) -> Result<KeyWriter, NoLease> {
        let mut writer = self.config.settings.key_space.writer();
        match self.config.settings.key.write(parts, &mut writer) {
            Ok(()) => Ok(writer),
            Err(missing) => Err(acquire::missing_part(&self.config, missing)),
        }
    }

    /// The response the layer would send for `rejection` (its custom
    /// responder, or problem+json).
    pub fn response_for(&self, rejection: &Rejection) -> http::Response<bytes::Bytes> {
        self.config.settings.reject(rejection)
    }
}

/// A held lease, released when dropped (on a spawned task) or by
/// [`release`](Self::release), which waits for the backend. Release it
/// before answering if the same client may repeat the request at once.
#[derive(Debug)]
pub struct LockGuard {
    lease: Lease,
    guard: Option<LeaseGuard>,
}

impl LockGuard {
    /// What was acquired.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Release now and wait for the backend. `true` if our lease was still
    /// there (`false`: it had expired or the layer was fail-open).
    pub async fn release(mut self) -> bool {
        match self.guard.take() {
            Some(guard) => guard.release().await,
            None => false,
        }
    }
}
