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

/// How a claim holds its key while the handler runs, outside the handler's
/// transaction (so that nothing the handler does to its transaction frees
/// the key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// A session-level lock of the claim's connection (PostgreSQL's
    /// advisory lock): others wait on it; it goes with the connection, so a
    /// crash frees the key at once. The claim row itself is written in the
    /// handler's transaction and is invisible until it commits.
    Session,
    /// A committed claim row with our token and an expiry (SQLite: a short
    /// write transaction of its own, so the handler's transaction does not
    /// hold the database's single write lock from the start): others see it
    /// in flight; a crash leaves it until it expires, then it is taken over.
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
pub(crate) enum Marked {
    /// The transaction is ours, told apart by this marker at completion.
    Ours(String),
    /// A row committed since our look holds the key: look again.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlx-postgres")),
        allow(dead_code)
    )] // PostgreSQL only
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
    /// The transaction is not the one the claim opened (the handler ran
    /// `COMMIT` or `ROLLBACK` itself).
    Ended,
    /// Our claim row is not ours any more (taken over after its lease).
    #[cfg_attr(not(feature = "sqlx-sqlite"), allow(dead_code))] // row holds only
    NotOurs,
    /// The transaction failed (a statement of the handler failed, or a
    /// serialization failure): nothing of it can commit.
    Failed,
}

/// What `COMMIT` answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Committed {
    /// Committed.
    Yes,
    /// Refused (serialization failure, deadlock): rolled back, retryable.
    Refused,
    /// There was no transaction to commit: the handler committed it itself
    /// and the record was written on its own (SQLite).
    #[cfg_attr(not(feature = "sqlx-sqlite"), allow(dead_code))] // SQLite only
    NoTransaction,
}

/// A database client, as the protocol uses it. Every step is one
/// statement (or one simple-query batch) on `conn`.
pub(crate) trait Adapter: Send + Sync + 'static {
    /// A pooled connection; dropped, it is closed (never pooled) unless
    /// [`release`](Self::release)d.
    type Conn: Send + 'static;
    /// The store's name for logs.
    const NAME: &'static str;
    /// How a claim holds its key.
    const HOLD: Hold;

    /// A connection of the pool.
    fn connect(&self) -> Step<'_, Self::Conn>;
    /// Back to the pool: no transaction open on it, nothing held.
    fn release(conn: Self::Conn);
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
    fn mark<'a>(conn: &'a mut Self::Conn, ask: &'a Ask, now_ms: i64) -> Step<'a, Marked>;
    /// Write the record into our claim row, in the handler's transaction,
    /// if it is still the one `marker` names.
    fn record<'a>(
        conn: &'a mut Self::Conn,
        entry: &'a [u8],
        token: &'a Token,
        record: &'a [u8],
        expires_ms: (i64, i64),
        marker: &'a str,
    ) -> Step<'a, Recorded>;
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
