//! The memory store's side of [`ReplayBackend`], until it moves.
//!
//! `memory.rs` (the table of [`MemoryBackend`]) implements the crate-private
//! [`ReplayStore`] below, in the shape the open [`ReplayBackend`] had before
//! it was opened (the quota as one [`Quota`]); this file adapts it. When
//! `memory.rs` moves to `backend/replay/memory.rs`, it implements
//! [`ReplayBackend`] directly and this file goes.

use std::time::Duration;

use bytes::Bytes;

pub(crate) use super::layer::Quota;
use crate::backend::{BackendFuture, ReplayBackend, Token};
pub(crate) use crate::backend::{Claim, EntryKey};
use crate::MemoryBackend;

/// [`ReplayBackend`] as the memory store implements it (see the module docs).
pub(crate) trait ReplayStore {
    /// [`ReplayBackend::claim`], with the scope's share as one [`Quota`].
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
        quota: Quota,
    ) -> BackendFuture<Claim>;

    /// [`ReplayBackend::complete`].
    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool>;

    /// [`ReplayBackend::extend`].
    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool>;

    /// [`ReplayBackend::abandon`].
    fn abandon(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool>;

    /// [`ReplayBackend::name`].
    fn name(&self) -> &'static str;

    /// [`ReplayBackend::is_in_process`].
    fn is_in_process(&self) -> bool {
        false
    }
}

impl ReplayBackend for MemoryBackend {
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
        max_entries: u64,
        max_bytes: u64,
    ) -> BackendFuture<Claim> {
        let quota = Quota {
            entries: max_entries,
            bytes: max_bytes,
        };
        ReplayStore::claim(self, key, token, fingerprint, lease, quota)
    }

    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        ReplayStore::complete(self, key, token, record, retention)
    }

    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        ReplayStore::extend(self, key, token, lease)
    }

    fn abandon(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        ReplayStore::abandon(self, key, token, lease)
    }

    fn name(&self) -> &'static str {
        ReplayStore::name(self)
    }

    fn is_in_process(&self) -> bool {
        ReplayStore::is_in_process(self)
    }
}
