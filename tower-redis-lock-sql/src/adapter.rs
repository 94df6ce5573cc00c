//! What one database client gives the SQL protocol: its statements, and how
//! to run them on a pooled connection. Crate-private; the protocol itself
//! (`protocol.rs`) is written once over it.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use tower_redis_lock::backend::contract::{EntryKey, Token};
use tower_redis_lock::backend::BackendError;

/// A boxed future of an adapter step.
pub(crate) type Step<'a, T> = Pin<Box<dyn Future<Output = Result<T, BackendError>> + Send + 'a>>;

/// How a claim holds its key while the handler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// A session-level lock of the claim's connection, outside the
    /// handler's transaction (PostgreSQL's advisory lock), so that nothing
    /// the handler does to its transaction frees the key: others wait on
    /// it; it goes with the connection, so a crash frees the key at once.
    /// The claim row itself is written in the handler's transaction and is
    /// invisible until it commits.
    Session,
    /// A committed claim row with our token and an expiry (SQLite: a
    /// short write transaction of its own, so that the handler's
    /// transaction does not hold the database's single write lock from the
    /// start): others see it in flight; a crash leaves it until it expires,
    /// then it is taken over. The handler's transaction marks the row
    /// (durably, with whatever the handler commits) before the handler can
    /// use it: a row a handler committed itself is never taken over.
    Row,
}

/// One claim, as the layer asked for it.
#[derive(Debug, Clone)]
pub(crate) struct Ask {
    pub(crate) key: EntryKey,
    pub(crate) token: Token,
    pub(crate) fp: Bytes,
    pub(crate) lease: Duration,
    pub(crate) max_entries: u64,
    pub(crate) max_bytes: u64,
    /// The layer's retention: how long a key made final without a record
    /// ([`Adapter::end`]) stays final, as a record would.
    pub(crate) retention: Duration,
}

impl Ask {
    /// A 64-bit lock id for the key (PostgreSQL's advisory locks): the
    /// first 8 bytes of BLAKE3 of the entry key.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlx-postgres")),
        allow(dead_code)
    )]
    pub(crate) fn lock_id(&self) -> i64 {
        lock_id(self.key.entry())
    }
}

/// A 64-bit lock id for an entry key.
pub(crate) fn lock_id(entry: &[u8]) -> i64 {
    let hash = blake3::hash(entry);
    let mut id = [0u8; 8];
    id.copy_from_slice(&hash.as_bytes()[..8]);
    i64::from_le_bytes(id)
}

/// The key's committed, unexpired row.
#[derive(Debug, Clone)]
pub(crate) struct Found {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) state: i16,
    pub(crate) record: Option<Vec<u8>>,
    /// Milliseconds until it expires.
    pub(crate) left_ms: Option<i64>,
}

/// What one look at the table found: the key's live row and its scope's
/// use (committed rows only).
#[derive(Debug, Clone)]
pub(crate) struct Look {
    pub(crate) live: Option<Found>,
    pub(crate) count: i64,
    pub(crate) bytes: i64,
    /// Milliseconds until the scope's oldest entry expires.
    pub(crate) oldest_ms: Option<i64>,
}

/// What the claim's write inside the handler's transaction found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Marked<M> {
    /// The transaction is ours, told apart by this marker from then on.
    Ours(M),
    /// A row committed since our look holds the key: look again.
    Taken,
    /// A serialization failure (or the like): roll back, look again.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlx-postgres")),
        allow(dead_code)
    )] // PostgreSQL only
    Retry,
}

/// What writing the record inside the handler's transaction found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// Written into our claim row, in our transaction.
    Written,
    /// The handler ended the transaction itself and something may have
    /// committed: the key is final.
    Ended,
    /// The transaction failed or was rolled back with nothing committed (a
    /// statement of the handler failed, a serialization failure, SQLite's
    /// own rollback): nothing of it can commit; the key can be freed.
    Failed,
}

/// What `COMMIT` answered. An error is an answer that did not arrive (the
/// connection lost): the store asks by the transaction's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Committed {
    /// Committed.
    Yes,
    /// Refused (serialization failure, deadlock, a deferred constraint):
    /// rolled back, nothing of it kept.
    Refused,
}

/// Whether the claim's transaction is still its own, found before the key
/// is freed, made final or recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    /// Still the transaction the claim opened, nothing of it committed.
    Ours,
    /// The handler ended it and something of the request may have
    /// committed (its own `COMMIT`, or writes after its own `ROLLBACK`):
    /// the key is final. Whatever the handler left open is rolled back.
    Ended,
    /// It ended with nothing committed (a rollback, the handler's or the
    /// database's own): the key can be freed.
    RolledBack,
}

/// A database client, as the protocol uses it. Every step is one
/// statement (or one simple-query batch) on `conn`.
pub(crate) trait Adapter: Send + Sync + 'static {
    /// A pooled connection; dropped, it is closed (never pooled) unless
    /// [`release`](Self::release)d.
    type Conn: Send + 'static;
    /// What tells the claim's transaction apart (PostgreSQL: its id;
    /// SQLite: what the connection's commit and rollback hooks saw).
    type Marker: Clone + Send + Sync + 'static;
    /// The store's name for logs.
    const NAME: &'static str;
    /// How a claim holds its key.
    const HOLD: Hold;

    /// A connection of the pool.
    fn connect(&self) -> Step<'_, Self::Conn>;
    /// Back to the pool: no transaction open on it, nothing held.
    fn release(conn: Self::Conn);
    /// Whether each pooled connection is one server session (`false`
    /// behind a transaction-mode pooler, where the hold cannot work); asked
    /// once per store, on two connections of the pool. `true` where it
    /// cannot tell (a pool of one).
    fn one_session_each(&self) -> Step<'_, bool> {
        Box::pin(std::future::ready(Ok(true)))
    }
    /// Create the table and its indexes if missing.
    fn migrate(&self) -> Step<'_, ()>;

    /// The key's live row and its scope's use, outside any transaction.
    fn look<'a>(conn: &'a mut Self::Conn, ask: &'a Ask, now_ms: i64) -> Step<'a, Look>;
    /// Take the key's hold (never waiting): `false` when another holds it.
    fn hold<'a>(conn: &'a mut Self::Conn, ask: &'a Ask, now_ms: i64) -> Step<'a, bool>;
    /// Wait, up to `bound`, for another's hold of the key to end, outside
    /// any transaction of a handler: `true` when it ended (look again).
    fn wait<'a>(conn: &'a mut Self::Conn, ask: &'a Ask, bound: Duration) -> Step<'a, bool>;
    /// Let go of our hold (and, for a row hold, delete our claim row if it
    /// is still a claim), outside any transaction.
    fn unhold<'a>(conn: &'a mut Self::Conn, entry: &'a [u8], token: &'a Token) -> Step<'a, ()>;
    /// Open the handler's transaction: `begin` is the statement (`None`:
    /// the connection's defaults).
    fn begin<'a>(conn: &'a mut Self::Conn, begin: Option<&'a str>) -> Step<'a, ()>;
    /// The claim's write in the handler's transaction.
    fn mark<'a>(
        conn: &'a mut Self::Conn,
        ask: &'a Ask,
        now_ms: i64,
    ) -> Step<'a, Marked<Self::Marker>>;
    /// Write the record into our claim row, in the handler's transaction,
    /// if it is still the one `marker` names.
    fn record<'a>(
        conn: &'a mut Self::Conn,
        entry: &'a [u8],
        token: &'a Token,
        record: &'a [u8],
        expires_ms: (i64, i64),
        marker: &'a Self::Marker,
    ) -> Step<'a, Recorded>;
    /// Whether the claim's transaction is still ours (see [`Fate`]).
    fn fate<'a>(conn: &'a mut Self::Conn, marker: &'a Self::Marker) -> Step<'a, Fate>;
    /// Outside any transaction, make the key final without a record (its
    /// handler ended the request's transaction itself): our claim row, or
    /// one a handler committed and left (a crash).
    fn end<'a>(conn: &'a mut Self::Conn, ask: &'a Ask, now_ms: i64) -> Step<'a, ()>;
    /// Whether the transaction `marker` names committed, asked on a
    /// connection of its own (a `COMMIT` whose answer was lost):
    /// `Some(true)` committed, `Some(false)` rolled back, `None` not known
    /// yet.
    fn outcome<'a>(&'a self, marker: &'a Self::Marker) -> Step<'a, Option<bool>>;
    /// How long a claim may wait for its turn, given the layer's deadline
    /// (SQLite: for the write lock).
    fn claim_timeout(&self, deadline: Duration) -> Duration {
        deadline
    }
    /// Whether a write that failed with `e` may land if tried again on the
    /// same connection: the database refused it for now (SQLite: the write
    /// lock was busy; PostgreSQL: a lock or statement timeout, a
    /// serialization failure, a deadlock), not for good (a lost
    /// connection, a permission, a row taken over). The writes that make a
    /// key final are tried again, under the hold, while it says so.
    fn is_transient(_e: &BackendError) -> bool {
        false
    }
    /// Commit the handler's transaction.
    fn commit(conn: &mut Self::Conn) -> Step<'_, Committed>;
    /// Roll the handler's transaction back (nothing open: no error).
    fn rollback(conn: &mut Self::Conn) -> Step<'_, ()>;
    /// Outside any transaction (whatever the handler left open is rolled
    /// back first), make the key's row done with `record`.
    fn finalize<'a>(
        conn: &'a mut Self::Conn,
        ask: &'a Ask,
        record: &'a [u8],
        expires_ms: (i64, i64),
    ) -> Step<'a, ()>;
    /// Whether our record is there (a completion re-sent after its commit).
    fn recorded<'a>(
        conn: &'a mut Self::Conn,
        entry: &'a [u8],
        token: &'a Token,
        now_ms: i64,
    ) -> Step<'a, bool>;
    /// Push our claim row's expiry (a row hold only).
    fn extend<'a>(
        conn: &'a mut Self::Conn,
        entry: &'a [u8],
        token: &'a Token,
        expires_ms: (i64, i64),
    ) -> Step<'a, bool>;
    /// Delete up to `batch` expired rows by the expiry index; how many.
    fn sweep(conn: &mut Self::Conn, batch: i64, now_ms: i64) -> Step<'_, u64>;
}

/// An end mark or final record that found the key's row another
/// request's (it changed no row): the key could not be made final.
pub(crate) fn not_made_final(store: &str) -> BackendError {
    BackendError::new(format!(
        "{store}: the key's row is another request's (this claim's hold lapsed and was taken \
         over): the handler ended its transaction itself, and its key could not be made final"
    ))
}
