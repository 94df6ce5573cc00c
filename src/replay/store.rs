//! [`ReplayBackend`]: where claims and records live.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::feed::Feed;
use super::record::Record;
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

/// Storage for idempotency claims and records.
///
/// One entry per key, in one of two states:
///
/// - **claimed**: `token` and `fingerprint`, expiring after the lease TTL
///   (so a crash frees the key);
/// - **done**: `fingerprint` and a [`Record`], expiring after the retention.
///
/// Every method is one round trip and must be safe to re-send after a lost
/// reply (a claim finding our own token counts as claimed; a completion
/// finding our own finished record counts as done).
pub(crate) trait ReplayStore: Send + Sync + fmt::Debug + 'static {
    /// Claim `key` for the first request, or report what is there. The
    /// fingerprint is compared in the same step.
    fn claim(
        &self,
        key: &Bytes,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
    ) -> BackendFuture<Claim>;

    /// Turn our claim into a done entry holding `record`, kept for
    /// `retention`. `Ok(false)`: the claim was no longer ours (expired or
    /// taken over), nothing stored.
    fn complete(
        &self,
        key: &Bytes,
        token: &Token,
        record: &Record,
        retention: Duration,
    ) -> BackendFuture<bool>;

    /// Push our claim's expiry to `lease` from now while its request still
    /// runs or its record is being written. `Ok(false)`: the claim is no
    /// longer ours (expired, taken over, or already done).
    fn extend(&self, key: &Bytes, token: &Token, lease: Duration) -> BackendFuture<bool>;

    /// Delete our claim (the outcome is not kept: marked safe to retry, or
    /// not stored by the layer's status policy).
    /// `Ok(false)`: it was no longer ours.
    fn abandon(&self, key: &Bytes, token: &Token) -> BackendFuture<bool>;

    /// Start a [`Feed`] of what the store publishes when a request that
    /// others wait for completes or frees its key (one per layer, on its
    /// first joining request). `None`: this store publishes nothing, and a
    /// waiter looks again instead (free for the memory store).
    fn feed(&self) -> Option<BackendFuture<Arc<Feed>>> {
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
    /// The first request completed; here is its record.
    Done(Record),
}
