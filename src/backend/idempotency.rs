//! [`IdempotencyBackend`]: where the idempotency layer keeps its claims and
//! records, and what a store must do to be one; with [`EntryKey`] (where an
//! entry lives, and its scope) and [`Claim`] (what a claim found).
//!
//! The stores are in their own folders: `memory/records.rs`,
//! `redis/records.rs` (the SQL stores are the crate `tower-redis-lock-sql`);
//! `suite.rs` holds the checks every store passes (public as
//! `backend::Suite`, feature `testing`). What a record holds, its seal and
//! the join feed are the idempotency layer's
//! ([`idempotency`](crate::idempotency)): a store keeps and hands back
//! opaque bytes.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{Backend, BackendFuture, Claim, EntryKey, Token};

use crate::key::KeySpace;

/// Storage for the claims and records of an
/// [`IdempotencyLayer`](crate::IdempotencyLayer):
/// [`MemoryBackend`](crate::MemoryBackend), [`RedisBackend`](crate::RedisBackend),
/// an `Arc` of any store, or your own (for your database).
///
/// One entry per [`EntryKey`], in one of two states:
///
/// - **claimed**: a claim token and the request's fingerprint, expiring after
///   the `lease` (so a crashed instance frees the key);
/// - **done**: the fingerprint and a sealed record (opaque bytes to the
///   store), expiring after the `retention`.
///
/// The contract, for every method:
///
/// - **One round trip**, atomic on the store (a Lua script, a transaction):
///   the layer puts its own deadline around each call, and a call that ran
///   out of time may still land later.
/// - **Safe to re-send** after a lost reply (clients re-send commands after a
///   reconnect): a claim that finds our own token counts as claimed, a
///   completion that finds our own finished record counts as done.
/// - **Scopes are isolated**: every entry counts against its scope's share
///   (`max_entries` entries and `max_bytes` of records, see
///   [`claim`](Self::claim)); a store never evicts an unexpired entry to
///   make room, and refuses a new claim instead.
/// - **What is read back is untrusted**: the bytes of [`Claim::Done`] and of
///   [`feed`](Self::feed) are handed to the layer as stored, and the layer opens them
///   (checks their seal, decodes them without panics) before it replays
///   anything. A store neither decodes nor trusts them.
///
/// `Ok(false)` from the compare-and-act methods means *not our claim*
/// (expired, taken over, done, or not there); an `Err` means the store could
/// not answer (the layer answers 503, or retries a record).
pub trait IdempotencyBackend: Backend {
    /// Claim `key` for the request whose claim `token` and `fingerprint`
    /// are given, on the [`ClaimTerms`] `terms` (its `lease`, its scope's
    /// quota, how long the layer waits for the answer, the layer's
    /// retention); or report what is there, checking the fingerprint in
    /// the same step:
    ///
    /// - free (or expired) → [`Claim::Claimed`], unless the key's scope
    ///   ([`EntryKey::scope`]) already holds `max_entries` unexpired entries
    ///   or `max_bytes` of records: then [`Claim::OverQuota`], nothing
    ///   written;
    /// - claimed by `token` (a re-sent claim) → [`Claim::Claimed`] again,
    ///   its expiry pushed to `lease` from now;
    /// - claimed by another token → [`Claim::InFlight`] with the claim's time
    ///   left, or [`Claim::Mismatch`] if the fingerprints differ;
    /// - done → [`Claim::Done`] with the record as stored, or
    ///   [`Claim::Mismatch`] if the fingerprints differ.
    ///
    /// A claim that finds the mark [`abandon`](Self::abandon) left for its
    /// own `token` claims nothing and is an error: it is a re-sent command
    /// landing after its request gave up. A claim still unsent when
    /// `terms.timeout` (the layer's deadline) has passed must never be
    /// sent: a client that queues commands while it reconnects drops it
    /// (fred: the command's own timeout), so that it cannot take the key
    /// from a request that still runs once the store is back.
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        terms: &ClaimTerms,
    ) -> BackendFuture<Claim>;

    /// Turn our claim into a done entry holding `record`, kept for
    /// `retention`, and publish it to the key's waiters if the store has a
    /// [`feed`](Self::feed). `Ok(true)` also when the entry is already done
    /// with our token (a re-sent completion). A claim that lapsed (expired
    /// while the store could not be reached to renew it, or lost to a
    /// restart) with nothing in its place is stored all the same, under
    /// `fingerprint` (the claim's): the handler ran, and a retry must
    /// replay it, not run it again. `Ok(false)`: another request's claim or
    /// record holds the key, nothing stored. Never refused for room: the
    /// handler already ran. (A store that refuses it all the same, with a
    /// [`BackendError::new`](super::BackendError::new) error on every try,
    /// an item over its size limit, is given the record's not-stored
    /// marker, a few bytes, as a last try before the claim expires: the
    /// layer's retries are then answered 410, not run again. A timeout or
    /// [`BackendError::unavailable`](super::BackendError::unavailable) is
    /// an outage, retried with the whole record.)
    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool>;

    /// Push our claim's expiry to `lease` from now while its request runs
    /// or its record is being written. `Ok(false)`: the claim is no longer
    /// ours (expired, taken over, or already done).
    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool>;

    /// Delete our claim: its outcome is not kept (the handler marked it
    /// safe to retry, the status policy does not store it, or the request
    /// ended before its handler began), and tell the key's waiters it is
    /// free. `Ok(false)`: it was not ours, or not there (yet).
    ///
    /// Delivered like a lock release: it **takes effect even when the
    /// returned future is dropped unpolled** (act before returning, or send
    /// it from a task of your own, retried until the store answers or
    /// `lease` has passed). And a claim of ours that lands after it (a
    /// re-sent command) must claim nothing: where that can happen, leave a
    /// mark for `token` that outlives `lease` and that [`claim`](Self::claim)
    /// obeys.
    ///
    /// A transactional store ([`is_transactional`](Self::is_transactional))
    /// first finds out whether the claim's transaction is still its own:
    /// if the handler ended it and something of it committed, the key is
    /// not freed but made final (a later [`claim`](Self::claim) answers
    /// [`Claim::Ended`]), and the answer is
    /// [`BackendError::transaction_ended`](super::BackendError::transaction_ended);
    /// if it rolled back and nothing committed, the key is freed.
    fn abandon(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool>;

    /// How long the layer waits for this store's [`claim`](Self::claim)
    /// given its own `deadline`: `deadline` for a store that answers within
    /// it; longer for a store whose claim queues behind running handlers
    /// (SQLite, one writer: its claims wait for the write lock) and that
    /// bounds the wait itself, so that a claim the layer gave up on never
    /// lands later.
    fn claim_timeout(&self, deadline: Duration) -> Duration;

    /// A guard that keeps the store's [`drain`](Backend::drain) waiting
    /// while it lives: the layer holds one while a detached request runs,
    /// so that a graceful shutdown waits for its record. `None` where there
    /// is nothing to wait for (an in-process store: its records die with
    /// the process).
    fn hold(&self) -> Option<Box<dyn Send>>;

    /// Start listening to what this store publishes for the entries of
    /// `key_space` when a request that others wait for completes or frees
    /// its key: a receiver of `(entry key, message)`, the message the sealed
    /// record, or empty when the key was freed. Nothing received is trusted
    /// (the layer opens a record's seal first); a store may drop messages
    /// when the receiver is full (waiters look at the store again within
    /// seconds). The receiver ends when the store stops hearing (connection
    /// lost, subscription refused); the store stops when the layer drops
    /// it. The layer starts one on its first joining request, and again
    /// after it ended. `None`: this store publishes nothing, and a waiting
    /// duplicate looks at the store again instead.
    fn feed(
        &self,
        key_space: &KeySpace,
    ) -> Option<BackendFuture<tokio::sync::mpsc::Receiver<(Bytes, Bytes)>>>;

    /// Called once the layer won `key`'s claim for `token`, before the
    /// handler runs: a store may put into the request's `extensions` what
    /// the handler needs from it (the PostgreSQL store puts the claim's
    /// open transaction there). A store with nothing to hand over does
    /// nothing.
    fn claimed(&self, key: &EntryKey, token: &Token, extensions: &mut http::Extensions);

    /// `true` when [`complete`](Self::complete) commits the handler's own
    /// writes together with the record (one database transaction): then a
    /// completion that fails means the handler's work was undone, and the
    /// layer answers 503 instead of the handler's answer; a panic or an
    /// error of the handler, too, frees the key ([`abandon`](Self::abandon):
    /// a rollback) instead of recording a 500. A transactional store
    /// bounds its own [`complete`](Self::complete) and
    /// [`abandon`](Self::abandon) (its commit timeout: a `COMMIT` may take
    /// longer than a claim), and the layer waits for their answer without
    /// its deadline; one whose outcome stays unknown answers
    /// [`BackendError::outcome_unknown`](super::BackendError::outcome_unknown).
    /// `false`: the handler's effects stand whatever the store does, so
    /// they are recorded, and a record that could not be written leaves
    /// the claim to expire.
    fn is_transactional(&self) -> bool;
}

impl<T: IdempotencyBackend + ?Sized> IdempotencyBackend for Arc<T> {
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        terms: &ClaimTerms,
    ) -> BackendFuture<Claim> {
        (**self).claim(key, token, fingerprint, terms)
    }

    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        (**self).complete(key, token, fingerprint, record, retention)
    }

    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        (**self).extend(key, token, lease)
    }

    fn abandon(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        (**self).abandon(key, token, lease)
    }

    fn claim_timeout(&self, deadline: Duration) -> Duration {
        (**self).claim_timeout(deadline)
    }

    fn hold(&self) -> Option<Box<dyn Send>> {
        (**self).hold()
    }

    fn feed(
        &self,
        key_space: &KeySpace,
    ) -> Option<BackendFuture<tokio::sync::mpsc::Receiver<(Bytes, Bytes)>>> {
        (**self).feed(key_space)
    }

    fn claimed(&self, key: &EntryKey, token: &Token, extensions: &mut http::Extensions) {
        (**self).claimed(key, token, extensions)
    }

    fn is_transactional(&self) -> bool {
        (**self).is_transactional()
    }
}

/// One scope's share of the store: at most `entries` claims and records at
/// once, and no new claim while its records hold `bytes` or more (given to
/// [`IdempotencyBackend::claim`] in its [`ClaimTerms`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Quota {
    /// Most entries (claims and records) one scope holds.
    pub(crate) entries: u64,
    /// Bytes of records past which one scope's new claims are refused.
    pub(crate) bytes: u64,
}

/// What a [`claim`](IdempotencyBackend::claim) asks of the store besides
/// its key, token and fingerprint: the layer's settings for this request.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_lock::backend::ClaimTerms;
/// let terms = ClaimTerms::new(Duration::from_secs(30), 10_000, 64 << 20)
///     .timeout(Duration::from_millis(200))
///     .retention(Duration::from_secs(7 * 24 * 3600));
/// assert_eq!(terms.max_entries, 10_000);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimTerms {
    /// How long the claim lives unless extended (a crashed instance frees
    /// the key after it).
    pub lease: Duration,
    /// Most unexpired entries in the key's scope (a new claim beyond it
    /// is [`Claim::OverQuota`]).
    pub max_entries: u64,
    /// Most bytes of unexpired records in the key's scope.
    pub max_bytes: u64,
    /// The layer's deadline for the claim: past it the layer wants no
    /// claim any more, and one not sent yet must never be. (The layer waits
    /// for the answer as long as
    /// [`claim_timeout`](IdempotencyBackend::claim_timeout) answers for this
    /// deadline.)
    pub timeout: Duration,
    /// How long the layer keeps the key's record: a store that makes a key
    /// final without a record (its handler ended the request's transaction
    /// itself, then answered what is not stored) keeps it final as long.
    pub retention: Duration,
}

impl ClaimTerms {
    /// Terms with `lease` and the scope's quota, the layer's default
    /// deadline (200 ms) as `timeout` and its default retention (24 h).
    pub fn new(lease: Duration, max_entries: u64, max_bytes: u64) -> Self {
        Self {
            lease,
            max_entries,
            max_bytes,
            timeout: crate::settings::DEFAULT_DEADLINE,
            retention: crate::idempotency::config::DEFAULT_RETENTION,
        }
    }

    /// The layer's deadline for the claim.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long the layer keeps the key's record.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }
}
