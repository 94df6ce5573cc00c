//! [`ReplayStore`]: where claims and records live.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

use super::record::Record;
use crate::backend::{BackendFuture, Token};

/// Storage for idempotency claims and records. Implemented by
/// [`MemoryBackend`](crate::MemoryBackend) and
/// [`RedisBackend`](crate::RedisBackend).
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
pub trait ReplayStore: Send + Sync + fmt::Debug + 'static {
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

    /// Delete our claim (the outcome is not kept: 5xx, error, cancel).
    /// `Ok(false)`: it was no longer ours.
    fn abandon(&self, key: &Bytes, token: &Token) -> BackendFuture<bool>;

    /// A short name for logs (`"memory"`, `"redis"`).
    fn name(&self) -> &'static str;
}

/// Outcome of [`ReplayStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
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
