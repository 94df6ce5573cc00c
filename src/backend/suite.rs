//! The store suite (feature `testing`): see [`Suite`].

mod fresh;
mod idempotency;
mod lease;

use super::{IdempotencyBackend, LockBackend};

/// The checks every store passes, for the stores you write (feature
/// `testing`).
///
/// [`LockBackend`] and [`IdempotencyBackend`] are open traits: put leases and
/// idempotency records in your own database by implementing them. Its
/// functions run, against a store you hand them, the same checks every
/// store of this crate passes ([`MemoryBackend`](crate::MemoryBackend),
/// [`RedisBackend`](crate::RedisBackend), [`RedlockBackend`](super::RedlockBackend),
/// and the SQL stores of [`tower-redis-lock-sql`](https://docs.rs/tower-redis-lock-sql)):
/// the contract of the traits' docs, one method at a time, through the
/// trait alone. Call them from a test of your own:
///
/// ```toml
/// [dev-dependencies]
/// tower-redis-lock = { version = "0.2", features = ["testing"] }
/// tokio = { version = "1", features = ["macros", "rt"] }
/// ```
///
/// ```
/// use tower_redis_lock::backend::Suite;
/// use tower_redis_lock::MemoryBackend;
///
/// # /*
/// #[tokio::test]
/// # */
/// async fn my_store_passes() {
///     let store = MemoryBackend::new(); // your store, on a test database
///     Suite::lock_backend(&store).await; // if it holds leases
///     Suite::idempotency_backend(&store).await; // if it holds idempotency records
/// }
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap()
/// #     .block_on(my_store_passes());
/// ```
///
/// A check that finds the contract broken **panics** with a message that
/// names the trait method and the rule (`LockBackend::release: a token that
/// does not hold the lease must not release it`), so the test fails there.
/// An `Err` from the store where an answer was due fails the same way,
/// naming the method.
///
/// Each check works on keys of its own, drawn at random (`trl:{…}` storage
/// keys, as the layers make them), so one store serves every check, the
/// checks of several tests can share a database, and a run leaves only
/// released or expiring entries behind. Nothing here starts a server: the
/// store is yours to connect. The checks need a Tokio runtime with its time
/// driver (`#[tokio::test]` has one; either flavour); a store whose expiry
/// follows a server's clock needs the runtime's clock to run too (not
/// `start_paused`). The lease checks wait for one short lease (200 ms) to
/// expire.
///
/// # What [`lock_backend`](Self::lock_backend) asserts
///
/// | check | the store must |
/// |---|---|
/// | acquire | take a free key (a `validity`, if any, no longer than the TTL); count a re-sent acquire with the holder's token as acquired; refuse another token with `Held` (a `retry_after`, if any, no longer than the TTL); keep keys apart |
/// | release | delete only for the holder's token (`false` otherwise, the lease still held); answer `false` once the lease is gone; leave the key free |
/// | release dropped | take effect even when the future [`release`](LockBackend::release) or [`release_notify`](LockBackend::release_notify) returned is dropped unpolled (seen within 5 s) |
/// | extend | act only for the holder's token, and not on a free or released key |
/// | expiry | free a key once its TTL has passed (then the old holder can neither extend nor release it); keep a lease extended to a longer TTL past its first one |
/// | fences | from [`acquire_fenced`](LockBackend::acquire_fenced): no fence at all (the default), or a fence for every lease, the same one for a re-sent acquire, a larger one for the next lease on the key; and the lease taken either way |
/// | drain | answer [`drain`](super::Backend::drain) within 5 s once every release above was answered |
///
/// # What [`idempotency_backend`](Self::idempotency_backend) asserts
///
/// | check | the store must |
/// |---|---|
/// | claim | claim a free key; count a re-sent claim with our token as claimed; answer another token `InFlight` (time left within the lease), or `Mismatch` for another fingerprint |
/// | complete | store the record only for the claim's token; count a re-sent completion as done; answer later claims `Done` with the bytes as stored, `Mismatch` for another fingerprint; never extend or abandon a done entry |
/// | extend | act only on our live claim |
/// | abandon | free only our claim, after which any fingerprint can claim the key |
/// | abandon dropped | take effect even when the future [`abandon`](IdempotencyBackend::abandon) returned is dropped unpolled (seen within 5 s) |
/// | quota | refuse the claim past a scope's `max_entries` with `OverQuota` (its `retry_after` within the lease), but not a re-sent claim of an entry it holds; give another scope its own share; refuse new claims once the scope's records hold `max_bytes`, and still answer its done entries |
///
/// # What [`idempotency_backend_resent_commands`](Self::idempotency_backend_resent_commands) asserts
///
/// For stores whose client can re-send a command after the request gave up
/// on it (a Redis client re-sends in-flight commands after a reconnect): a
/// claim that lands after its own request abandoned the key claims nothing
/// and is an error, and the next request claims the key.
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
#[derive(Debug, Clone, Copy)]
pub struct Suite;

impl Suite {
    /// Run every [`LockBackend`] check on `store` (see [`Suite`] for what
    /// each asserts). Panics at the first broken rule, naming it.
    pub async fn lock_backend<B: LockBackend + ?Sized>(store: &B) {
        lease::run(store).await
    }

    /// Run every [`IdempotencyBackend`] check on `store` (see [`Suite`] for what
    /// each asserts). Panics at the first broken rule, naming it.
    pub async fn idempotency_backend<B: IdempotencyBackend + ?Sized>(store: &B) {
        idempotency::run(store).await
    }

    /// The extra [`IdempotencyBackend`] check for a store whose commands can be
    /// re-sent after the request gave up on them (a Redis client re-sends
    /// in-flight commands after a reconnect): a claim that lands after its
    /// own request abandoned the key claims nothing. Run it besides
    /// [`idempotency_backend`](Self::idempotency_backend). Panics if the late claim
    /// claimed the key, naming the rule.
    pub async fn idempotency_backend_resent_commands<B: IdempotencyBackend + ?Sized>(store: &B) {
        idempotency::abandon_before_claim_leaves_a_tombstone(store).await
    }
}

#[cfg(test)]
mod tests;
