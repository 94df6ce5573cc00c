//! [`ReplayBackend`]: where claims and records live.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::feed::Feed;
use crate::backend::{BackendFuture, Token};

/// Where the idempotency layer keeps its claims and records:
/// [`MemoryBackend`](crate::MemoryBackend), [`RedisBackend`](crate::RedisBackend),
/// or an `Arc` of either (to share one with other layers).
///
/// The trait is sealed: the claim and record protocol is the crate's own,
/// and implemented once per store it ships.
#[allow(private_bounds)] // sealed: the supertrait is crate-private on purpose
pub trait ReplayBackend: Sealed + Send + Sync + fmt::Debug + 'static {}

/// The operations behind [`ReplayBackend`], and the way into a shared store.
pub(crate) trait Sealed {
    /// The store, to be shared by the layer's services.
    fn into_store(self) -> Arc<dyn ReplayStore>;
}

impl Sealed for crate::MemoryBackend {
    fn into_store(self) -> Arc<dyn ReplayStore> {
        Arc::new(self)
    }
}
impl ReplayBackend for crate::MemoryBackend {}

impl Sealed for Arc<crate::MemoryBackend> {
    fn into_store(self) -> Arc<dyn ReplayStore> {
        self
    }
}
impl ReplayBackend for Arc<crate::MemoryBackend> {}

#[cfg(feature = "redis")]
impl<C> Sealed for crate::RedisBackend<C>
where
    crate::RedisBackend<C>: ReplayStore,
{
    fn into_store(self) -> Arc<dyn ReplayStore> {
        Arc::new(self)
    }
}
#[cfg(feature = "redis")]
impl<C> ReplayBackend for crate::RedisBackend<C> where crate::RedisBackend<C>: ReplayStore {}

#[cfg(feature = "redis")]
impl<C> Sealed for Arc<crate::RedisBackend<C>>
where
    crate::RedisBackend<C>: ReplayStore,
{
    fn into_store(self) -> Arc<dyn ReplayStore> {
        self
    }
}
#[cfg(feature = "redis")]
impl<C> ReplayBackend for Arc<crate::RedisBackend<C>> where crate::RedisBackend<C>: ReplayStore {}

/// Where one request's idempotency entry lives, and the scope whose share
/// of the store it counts against.
///
/// The entry is `prefix:{scope}:{digest}:idem` (hex digests): the scope's
/// digest is the Redis Cluster hash tag, so an entry and its scope's quota
/// keys share a slot and one script sees them all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryKey {
    /// The entry: `prefix:{scope}:digest:idem`; also its pub/sub channel.
    pub(crate) entry: Bytes,
    /// The scope's key prefix, `prefix:{scope}`, from which a store derives
    /// its per-scope keys.
    pub(crate) scope: Bytes,
    /// The entry's name inside its scope (the request digest, in hex).
    pub(crate) member: Bytes,
}

impl EntryKey {
    /// The keys of `digest` in `scope` under `key_space`.
    pub(crate) fn new(
        key_space: &crate::key::KeySpace,
        scope: &crate::key::LockKey,
        digest: &crate::key::LockKey,
    ) -> Self {
        let member = Bytes::from(digest.to_hex());
        let scope_key = key_space.storage_key(scope);
        let mut entry = Vec::with_capacity(scope_key.len() + member.len() + 6);
        entry.extend_from_slice(&scope_key);
        entry.push(b':');
        entry.extend_from_slice(&member);
        entry.extend_from_slice(b":idem");
        Self {
            entry: entry.into(),
            scope: scope_key,
            member,
        }
    }

    /// A per-scope key: the scope prefix with `suffix`.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // the Redis store's
    pub(crate) fn scope_key(&self, suffix: &str) -> Bytes {
        let mut out = Vec::with_capacity(self.scope.len() + suffix.len());
        out.extend_from_slice(&self.scope);
        out.extend_from_slice(suffix.as_bytes());
        out.into()
    }
}

/// One scope's share of the store: at most `entries` claims and records at
/// once, and no new claim while its records hold `bytes` or more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Quota {
    /// Most entries (claims and records) one scope holds.
    pub(crate) entries: u64,
    /// Bytes of records past which one scope's new claims are refused.
    pub(crate) bytes: u64,
}

/// Storage for idempotency claims and records.
///
/// One entry per key, in one of two states:
///
/// - **claimed**: `token` and `fingerprint`, expiring after the lease TTL
///   (so a crash frees the key);
/// - **done**: `fingerprint` and a sealed record (opaque bytes to the
///   store), expiring after the retention.
///
/// Every entry counts against its scope's [`Quota`]; a store never evicts
/// an unexpired entry to make room. Every method is one round trip and
/// must be safe to re-send after a lost reply (a claim finding our own
/// token counts as claimed; a completion finding our own finished record
/// counts as done).
pub(crate) trait ReplayStore: Send + Sync + fmt::Debug + 'static {
    /// Claim `key` for the first request, or report what is there. The
    /// fingerprint and the scope's quota are checked in the same step.
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
        quota: Quota,
    ) -> BackendFuture<Claim>;

    /// Turn our claim into a done entry holding `record`, kept for
    /// `retention`. `Ok(false)`: the claim was no longer ours (expired or
    /// taken over), nothing stored. Never refused for room: the handler
    /// already ran.
    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool>;

    /// Push our claim's expiry to `lease` from now while its request still
    /// runs or its record is being written. `Ok(false)`: the claim is no
    /// longer ours (expired, taken over, or already done).
    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool>;

    /// Delete our claim (the outcome is not kept: marked safe to retry, or
    /// not stored by the layer's status policy, or the request ended before
    /// its handler began). `Ok(false)`: it was not ours (or not there yet).
    ///
    /// Delivered like a release: it takes effect even when the returned
    /// future is dropped unpolled (the memory store acts at once; the Redis
    /// store sends it from a task of its own, retried until Redis answers or
    /// `lease` has passed), and a claim of ours that lands after it (a
    /// re-sent command) claims nothing.
    fn abandon(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool>;

    /// Hold the store's drain (`LockBackend::drain`) open while a detached
    /// request runs, so that a graceful shutdown waits for its record.
    /// `None` where there is nothing to wait for.
    fn hold(&self) -> Option<Box<dyn Send>> {
        None
    }

    /// Start a [`Feed`] of what the store publishes when a request that
    /// others wait for completes or frees its key (one per layer, on its
    /// first joining request; started again if it ends). `None`: this
    /// store publishes nothing, and a waiter looks again instead (free for
    /// the memory store).
    fn feed(&self, _key_space: &crate::key::KeySpace) -> Option<BackendFuture<Arc<Feed>>> {
        None
    }

    /// A short name for logs (`"memory"`, `"redis"`).
    fn name(&self) -> &'static str;

    /// `true` when keys never leave this process (no secret warning then).
    fn is_in_process(&self) -> bool {
        false
    }
}

/// Outcome of [`ReplayStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Claim {
    /// The key is ours: run the handler.
    Claimed,
    /// Another request with this key and fingerprint is running.
    InFlight {
        /// Time left on its claim, if known.
        retry_after: Option<Duration>,
    },
    /// The key was used with a different fingerprint.
    Mismatch,
    /// The first request completed; here is its sealed record, as stored
    /// (untrusted until opened).
    Done(Bytes),
    /// The scope holds its whole quota; nothing was claimed.
    OverQuota {
        /// When the scope's oldest entry expires.
        retry_after: Duration,
    },
}
