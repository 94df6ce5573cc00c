//! [`PostgresBackend`]: an idempotency store whose claim, the handler's own
//! writes and the record commit in **one PostgreSQL transaction**.
//!
//! For a new key the store opens a transaction on a connection of the
//! application's pool, inserts the claim row and keeps the transaction open,
//! keyed by the claim token; the layer hands it to the handler as a
//! [`PgTransaction`] in the request's extensions; the handler writes its side
//! effects on it; [`complete`](ReplayBackend::complete) writes the record
//! into the claim row and commits. Until that commit nothing of the request
//! is visible to anyone, and a crash, a `kill -9` or a lost connection
//! anywhere before it leaves nothing: PostgreSQL aborts the transaction, the
//! claim row goes with the side effects, and the retry runs on a clean
//! slate. After the commit every retry replays.
//!
//! A duplicate's insert of the same key waits on the first transaction's
//! row lock (bounded by [`PostgresBackend::lock_wait`], PostgreSQL's
//! `lock_timeout`): when the first commits, the duplicate reads the record;
//! when it aborts, the duplicate's insert succeeds and its handler runs.
//! Nothing but done rows is ever committed (a row of a transaction that
//! commits on its own, behind the store's back, is treated as a claim that
//! expires after its lease).
//!
//! The table is in [`PostgresBackend`]'s docs.

use std::collections::HashMap;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{ClientWrapper, Object, Pool};
use tokio::time::Instant;
use tokio_postgres::error::SqlState;

use super::{Claim, EntryKey, ReplayBackend};
use crate::backend::{BackendError, BackendErrorKind, BackendFuture, Token};

/// The table's name.
const TABLE: &str = "trl_idempotency";
/// Default bound on a claim's wait for a transaction that holds its key.
const DEFAULT_LOCK_WAIT: Duration = Duration::from_millis(100);
/// Least time between two sweeps of expired rows (which skip the rows an
/// open claim is taking over, never waiting on them).
const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// Most expired rows one sweep deletes.
const SWEEP_BATCH: i64 = 500;

const STATE_CLAIMED: i16 = 0;
const STATE_DONE: i16 = 1;

/// The schema [`PostgresBackend::migrate`] creates (idempotent), under a
/// transaction-scoped advisory lock so that instances starting together do
/// not race.
const SCHEMA: &str = "
    BEGIN;
    SELECT pg_advisory_xact_lock(7244106);
    CREATE TABLE IF NOT EXISTS trl_idempotency (
        entry       bytea PRIMARY KEY,
        scope       bytea NOT NULL,
        token       bytea NOT NULL,
        fingerprint bytea NOT NULL,
        state       smallint NOT NULL,
        record      bytea,
        expires_at  timestamptz NOT NULL
    );
    CREATE INDEX IF NOT EXISTS trl_idempotency_scope ON trl_idempotency (scope, expires_at);
    CREATE INDEX IF NOT EXISTS trl_idempotency_expiry ON trl_idempotency (expires_at);
    COMMIT;";

/// Whether the table and both its indexes exist (a catalog lookup, no lock).
const PRESENT: &str = "SELECT to_regclass('trl_idempotency') IS NOT NULL \
     AND to_regclass('trl_idempotency_scope') IS NOT NULL \
     AND to_regclass('trl_idempotency_expiry') IS NOT NULL";

const INSERT: &str = "INSERT INTO trl_idempotency \
     (entry, scope, token, fingerprint, state, record, expires_at) \
     VALUES ($1, $2, $3, $4, 0, NULL, statement_timestamp() + $5::bigint * interval '1 millisecond') \
     ON CONFLICT (entry) DO NOTHING RETURNING 1";

/// Take over an expired row (in our transaction; waits on its row lock).
const TAKE_OVER: &str = "UPDATE trl_idempotency \
     SET scope = $2, token = $3, fingerprint = $4, state = 0, record = NULL, \
         expires_at = statement_timestamp() + $5::bigint * interval '1 millisecond' \
     WHERE entry = $1 AND expires_at <= statement_timestamp() RETURNING 1";

const READ: &str = "SELECT fingerprint, state, record, \
     (extract(epoch FROM (expires_at - statement_timestamp())) * 1000)::bigint \
     FROM trl_idempotency WHERE entry = $1";

/// The key's row while it is live (unexpired).
const READ_LIVE: &str = "SELECT fingerprint, state, record, \
     (extract(epoch FROM (expires_at - statement_timestamp())) * 1000)::bigint \
     FROM trl_idempotency WHERE entry = $1 AND expires_at > statement_timestamp()";

/// The scope's unexpired rows as our transaction sees them (committed ones
/// and our own): count, record bytes, milliseconds until the oldest expires.
const SCOPE_USE: &str = "SELECT count(*), coalesce(sum(octet_length(record)), 0)::bigint, \
     (extract(epoch FROM (min(expires_at) - statement_timestamp())) * 1000)::bigint \
     FROM trl_idempotency WHERE scope = $1 AND expires_at > statement_timestamp()";

const RECORD: &str = "UPDATE trl_idempotency \
     SET state = 1, record = $3, expires_at = statement_timestamp() + $4::bigint * interval '1 millisecond' \
     WHERE entry = $1 AND token = $2 AND state = 0";

/// A completion re-sent after its commit: our record is there.
const RECORDED: &str = "SELECT 1 FROM trl_idempotency \
     WHERE entry = $1 AND token = $2 AND state = 1 AND expires_at > statement_timestamp()";

const SWEEP: &str = "DELETE FROM trl_idempotency WHERE ctid IN \
     (SELECT ctid FROM trl_idempotency WHERE expires_at < statement_timestamp() LIMIT $1 \
      FOR UPDATE SKIP LOCKED)";

/// An idempotency store in PostgreSQL whose record commits in the handler's
/// own transaction: **exactly once for database side effects**.
///
/// Built over the [`deadpool_postgres::Pool`] the application already has;
/// the table is created by [`migrate`](Self::migrate) (or by the SQL under
/// [The table](#the-table), run by your own migrations). Clones share the
/// store.
///
/// ```no_run
/// use axum::{routing::post, Router};
/// use tower_redis_lock::backend::{PgTransaction, PostgresBackend};
/// use tower_redis_lock::key::{RequestMethod, Route, TrustedHeader};
/// use tower_redis_lock::replay::IdempotencyKey;
/// use tower_redis_lock::IdempotencyLayer;
///
/// async fn pay(tx: PgTransaction, key: IdempotencyKey) -> Result<&'static str, String> {
///     let db = tx.client().await.map_err(|e| e.to_string())?;
///     // In the same transaction as the idempotency record: both commit, or neither.
///     db.execute("INSERT INTO charges (idempotency_key) VALUES ($1)", &[&key.as_str()])
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok("charged")
/// }
///
/// # async fn demo(pool: deadpool_postgres::Pool) -> Result<(), tower_redis_lock::backend::BackendError> {
/// let store = PostgresBackend::new(pool);
/// store.migrate().await?;
/// let idem = IdempotencyLayer::new(store, (RequestMethod, Route, TrustedHeader::new("x-user-id")))
///     .join_timeout(std::time::Duration::from_secs(5));
/// let app: Router = Router::new().route("/payments", post(pay).layer(idem));
/// # let _ = app; Ok(()) }
/// ```
///
/// **What the transaction covers**: the claim row, every statement the
/// handler runs through its [`PgTransaction`], and the record. What
/// [`store_when`](crate::IdempotencyLayer::store_when) refuses, a response
/// marked [`SafeToRetry`](crate::replay::SafeToRetry), a panic or an error of
/// the handler roll it back and free the key; a commit that fails (or whose
/// answer is lost) is answered 503 with `Retry-After`, never with the
/// handler's success (the retry then replays, or runs on a clean slate).
///
/// **What it does not cover**: calls outside this database (the card
/// network, an email provider: pass the `Idempotency-Key` downstream, so
/// that their retry is a no-op there too), and statements on other
/// connections (autocommit writes elsewhere are not undone).
///
/// Round trips: a replay (or a mismatch) is one statement; a new key three
/// (`BEGIN`, the claim row, the scope's count), its record two (the update,
/// `COMMIT`).
///
/// Each claim in flight holds one pooled connection until its record is
/// committed (and a duplicate's claim one while it waits): size the pool
/// for the concurrent requests of the routes it serves. The lease is the
/// transaction: it lasts as long as the handler (a handler that never ends
/// holds its key), and PostgreSQL frees it when the connection dies. An
/// instance that is frozen rather than dead (`SIGSTOP`, a partition) holds
/// its keys until it resumes or its connection is cut: bound that with the
/// role's `idle_in_transaction_session_timeout` (above your slowest handler)
/// or TCP keepalives.
/// Expired records are deleted by a bounded sweep (at most 500 rows, at
/// most every 10 s, on a claim).
///
/// The scope quota counts the scope's committed rows plus the claims in
/// flight in this process: claims in flight on other instances are not
/// visible until they commit, so a scope may pass its quota by those.
///
/// # The table
///
/// Created by [`migrate`](Self::migrate), or by your own migrations with
/// this SQL:
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS trl_idempotency (
///     entry       bytea PRIMARY KEY,     -- prefix:{scope}:digest:idem (digests, no user data)
///     scope       bytea NOT NULL,        -- prefix:{scope}: what the quota counts per
///     token       bytea NOT NULL,        -- the claim token of the request that wrote it
///     fingerprint bytea NOT NULL,        -- the request's fingerprint
///     state       smallint NOT NULL,     -- 0 claimed, 1 done
///     record      bytea,                 -- the sealed record (opaque, untrusted when read)
///     expires_at  timestamptz NOT NULL
/// );
/// CREATE INDEX IF NOT EXISTS trl_idempotency_scope ON trl_idempotency (scope, expires_at);
/// CREATE INDEX IF NOT EXISTS trl_idempotency_expiry ON trl_idempotency (expires_at);
/// ```
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    lock_wait: Duration,
    /// The claims whose transactions are open in this process.
    open: Mutex<HashMap<Bytes, Open>>,
    /// When the last sweep began.
    swept: Mutex<Option<Instant>>,
}

/// One open claim: its transaction's connection, shared with the handler's
/// [`PgTransaction`].
struct Open {
    token: Token,
    fingerprint: Bytes,
    scope: Bytes,
    expires: Instant,
    conn: Arc<tokio::sync::Mutex<Option<Conn>>>,
}

/// A pooled connection. Dropped while a transaction may be open on it, it
/// is taken out of the pool and closed (PostgreSQL then aborts the
/// transaction); only after a `COMMIT` or `ROLLBACK` that answered does it
/// go back to the pool.
struct Conn {
    obj: Option<Object>,
    clean: bool,
}

impl Conn {
    fn new(obj: Object) -> Self {
        Self {
            obj: Some(obj),
            clean: false,
        }
    }

    fn client(&self) -> &ClientWrapper {
        self.obj.as_ref().expect("a connection until dropped")
    }

    /// Back to the pool: no transaction is open on it.
    fn release(mut self) {
        self.clean = true;
    }

    /// End the transaction with `sql` (`COMMIT` / `ROLLBACK`); the
    /// connection goes back to the pool only if it answered.
    async fn finish(mut self, sql: &str) -> Result<(), tokio_postgres::Error> {
        self.client().batch_execute(sql).await?;
        self.clean = true;
        Ok(())
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(obj) = self.obj.take() {
            if !self.clean {
                // Out of the pool, and closed: the transaction aborts.
                drop(Object::take(obj));
            }
        }
    }
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("lock_wait", &self.inner.lock_wait)
            .field("open", &self.lock_open().len())
            .finish_non_exhaustive()
    }
}

fn pg_error(what: &str, e: tokio_postgres::Error) -> BackendError {
    let kind = if e.is_closed() || e.code().is_none() {
        BackendErrorKind::Unavailable
    } else {
        BackendErrorKind::Other
    };
    BackendError::with_kind(kind, format!("postgres {what}")).with_source(e)
}

fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

fn positive_ms(ms: Option<i64>) -> Option<Duration> {
    ms.filter(|ms| *ms > 0)
        .map(|ms| Duration::from_millis(ms as u64))
}

impl PostgresBackend {
    /// A store on `pool`'s connections, in the table `trl_idempotency`
    /// (create it with [`migrate`](Self::migrate)).
    ///
    /// ```no_run
    /// # fn demo(pool: deadpool_postgres::Pool) {
    /// let store = tower_redis_lock::backend::PostgresBackend::new(pool);
    /// # let _ = store; }
    /// ```
    pub fn new(pool: Pool) -> Self {
        Self {
            inner: Arc::new(Inner {
                pool,
                lock_wait: DEFAULT_LOCK_WAIT,
                open: Mutex::new(HashMap::new()),
                swept: Mutex::new(None),
            }),
        }
    }

    /// How long one claim waits for the transaction of another request that
    /// holds its key (PostgreSQL's `lock_timeout`), default 100 ms; then
    /// [`Claim::InFlight`], and a joining duplicate claims again (so it
    /// waits on the lock again) until the layer's
    /// [`join_timeout`](crate::IdempotencyLayer::join_timeout). Keep it
    /// below the layer's [`deadline`](crate::IdempotencyLayer::deadline)
    /// (200 ms by default), which bounds the whole claim.
    ///
    /// ```no_run
    /// # fn demo(pool: deadpool_postgres::Pool) {
    /// let store = tower_redis_lock::backend::PostgresBackend::new(pool)
    ///     .lock_wait(std::time::Duration::from_millis(50));
    /// # let _ = store; }
    /// ```
    pub fn lock_wait(self, wait: Duration) -> Self {
        let inner = Inner {
            pool: self.inner.pool.clone(),
            lock_wait: wait.max(Duration::from_millis(1)),
            open: Mutex::new(HashMap::new()),
            swept: Mutex::new(None),
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Create the table and its indexes if they are missing (the SQL is
    /// under [The table](Self#the-table)); safe to run from several
    /// instances at once.
    ///
    /// ```no_run
    /// # async fn demo(store: tower_redis_lock::backend::PostgresBackend) -> Result<(), tower_redis_lock::backend::BackendError> {
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self) -> Result<(), BackendError> {
        let conn = self.connection().await?;
        // Already there: done, without a lock. (`CREATE INDEX IF NOT
        // EXISTS` takes a share lock on the table before it finds the
        // index, which would wait for every claim in flight, and stall
        // every new claim behind it: an instance starting beside busy ones.)
        let present = conn
            .client()
            .query_one(PRESENT, &[])
            .await
            .map_err(|e| pg_error("migrate", e))?;
        if present.try_get::<_, bool>(0).unwrap_or(false) {
            conn.release();
            return Ok(());
        }
        let done = conn.client().batch_execute(SCHEMA).await;
        done.map_err(|e| pg_error(&format!("migrate (creating {TABLE})"), e))?;
        conn.release();
        Ok(())
    }

    fn lock_open(&self) -> MutexGuard<'_, HashMap<Bytes, Open>> {
        // Every statement leaves the map whole; poisoning only means a
        // panic elsewhere while it was held.
        self.inner.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn connection(&self) -> Result<Conn, BackendError> {
        self.inner.pool.get().await.map(Conn::new).map_err(|e| {
            BackendError::with_kind(BackendErrorKind::Unavailable, "postgres pool").with_source(e)
        })
    }

    /// What this process knows of `key` without a round trip: our own open
    /// claim (a re-sent claim), or another open claim here.
    fn claim_here(
        &self,
        key: &EntryKey,
        token: &Token,
        fp: &[u8],
        lease: Duration,
    ) -> Option<Claim> {
        let mut open = self.lock_open();
        let o = open.get_mut(&key.entry)?;
        let now = Instant::now();
        Some(if o.token == *token {
            o.expires = now + lease;
            Claim::Claimed
        } else if *o.fingerprint != *fp {
            Claim::Mismatch
        } else {
            Claim::InFlight {
                retry_after: Some(o.expires.saturating_duration_since(now))
                    .filter(|d| !d.is_zero()),
            }
        })
    }

    /// Claims in flight in this process in `scope`, other than `entry`
    /// (invisible to our transaction until they commit), and the soonest
    /// of their expiries.
    fn open_in_scope(&self, scope: &[u8], entry: &[u8]) -> (u64, Option<Instant>) {
        let open = self.lock_open();
        let mut n = 0;
        let mut soonest: Option<Instant> = None;
        for (k, o) in open.iter() {
            if *o.scope == *scope && **k != *entry {
                n += 1;
                soonest = Some(soonest.map_or(o.expires, |s| s.min(o.expires)));
            }
        }
        (n, soonest)
    }

    /// Start a bounded sweep of expired rows, at most once per
    /// [`SWEEP_EVERY`], on a task and a connection of its own.
    fn sweep_if_due(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let now = Instant::now();
        {
            let mut swept = self.inner.swept.lock().unwrap_or_else(|p| p.into_inner());
            if swept.is_some_and(|at| now < at + SWEEP_EVERY) {
                return;
            }
            *swept = Some(now);
        }
        let store = self.clone();
        runtime.spawn(async move {
            let Ok(conn) = store.connection().await else {
                return;
            };
            match conn.client().execute(SWEEP, &[&SWEEP_BATCH]).await {
                Ok(n) => {
                    tracing::debug!(deleted = n, "swept expired idempotency records");
                    conn.release();
                }
                Err(e) => tracing::warn!(error = %e, "sweeping expired idempotency records failed"),
            }
        });
    }

    async fn claim_in_db(
        &self,
        key: EntryKey,
        token: Token,
        fp: Bytes,
        lease: Duration,
        max_entries: u64,
        max_bytes: u64,
    ) -> Result<Claim, BackendError> {
        let conn = self.connection().await?;
        let db = conn.client();
        let (entry, scope, tok) = (&key.entry[..], &key.scope[..], &token.as_bytes()[..]);
        // A live row (a record, most often: a retry) answers at once, in
        // one round trip and no transaction.
        let live = db
            .query_opt(READ_LIVE, &[&entry])
            .await
            .map_err(|e| pg_error("claim", e))?;
        if let Some(row) = live {
            let answer = answer_of(&row, &fp);
            conn.release();
            return answer;
        }
        let begin = format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = {}",
            millis(self.inner.lock_wait)
        );
        db.batch_execute(&begin)
            .await
            .map_err(|e| pg_error("begin", e))?;
        let lease_ms = millis(lease);
        // At most a few turns: a row deleted (swept) between our insert and
        // our read, or taken over by another request meanwhile.
        for _ in 0..3 {
            let inserted = match db
                .query_opt(INSERT, &[&entry, &scope, &tok, &&fp[..], &lease_ms])
                .await
            {
                Ok(row) => row.is_some(),
                Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                    return rolled_back(conn, Claim::InFlight { retry_after: None }).await;
                }
                Err(e) => return Err(pg_error("claim", e)),
            };
            let ours = inserted || {
                match db
                    .query_opt(TAKE_OVER, &[&entry, &scope, &tok, &&fp[..], &lease_ms])
                    .await
                {
                    Ok(row) => row.is_some(),
                    Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                        return rolled_back(conn, Claim::InFlight { retry_after: None }).await;
                    }
                    Err(e) => return Err(pg_error("claim", e)),
                }
            };
            if ours {
                return self
                    .keep_claim(conn, key, token, fp, lease, max_entries, max_bytes)
                    .await;
            }
            let row = db
                .query_opt(READ, &[&entry])
                .await
                .map_err(|e| pg_error("claim", e))?;
            let Some(row) = row else { continue };
            let answer = answer_of(&row, &fp)?;
            return rolled_back(conn, answer).await;
        }
        rolled_back(conn, Claim::InFlight { retry_after: None }).await
    }

    /// Our row is in: check the scope's share, then keep the transaction
    /// open for the handler.
    #[allow(clippy::too_many_arguments)]
    async fn keep_claim(
        &self,
        conn: Conn,
        key: EntryKey,
        token: Token,
        fp: Bytes,
        lease: Duration,
        max_entries: u64,
        max_bytes: u64,
    ) -> Result<Claim, BackendError> {
        let row = conn
            .client()
            .query_one(SCOPE_USE, &[&&key.scope[..]])
            .await
            .map_err(|e| pg_error("claim quota", e))?;
        let count: i64 = row.try_get(0).map_err(|e| pg_error("claim quota", e))?;
        let bytes: i64 = row.try_get(1).map_err(|e| pg_error("claim quota", e))?;
        let oldest: Option<i64> = row.try_get(2).map_err(|e| pg_error("claim quota", e))?;
        let (here, soonest_here) = self.open_in_scope(&key.scope, &key.entry);
        // Ours is counted in `count`: the others must leave room for it.
        let entries = count.max(1) as u64 + here;
        if entries > max_entries || bytes.max(0) as u64 >= max_bytes {
            let now = Instant::now();
            let retry_after = [
                positive_ms(oldest),
                soonest_here.map(|at| at.saturating_duration_since(now)),
            ]
            .into_iter()
            .flatten()
            .filter(|d| !d.is_zero())
            .min()
            .unwrap_or(Duration::from_secs(1));
            return rolled_back(conn, Claim::OverQuota { retry_after }).await;
        }
        let refused = {
            let mut open = self.lock_open();
            if open.contains_key(&key.entry) {
                // Cannot happen (our row lock excludes any other claim of
                // the key); never replace a claim's transaction.
                Some(conn)
            } else {
                open.insert(
                    key.entry.clone(),
                    Open {
                        token,
                        fingerprint: fp,
                        scope: key.scope.clone(),
                        expires: Instant::now() + lease,
                        conn: Arc::new(tokio::sync::Mutex::new(Some(conn))),
                    },
                );
                None
            }
        };
        match refused {
            Some(conn) => rolled_back(conn, Claim::InFlight { retry_after: None }).await,
            None => Ok(Claim::Claimed),
        }
    }

    /// Take our open claim of `key` out of the table, if it is ours.
    fn take_open(&self, key: &EntryKey, token: &Token) -> Option<Open> {
        let mut open = self.lock_open();
        match open.get(&key.entry) {
            Some(o) if o.token == *token => open.remove(&key.entry),
            _ => None,
        }
    }
}

/// What a committed row of the key says to a claim for `fp`.
/// Untrusted bytes: compared, never decoded here; a malformed row is an
/// error, never an answer.
fn answer_of(row: &tokio_postgres::Row, fp: &[u8]) -> Result<Claim, BackendError> {
    let get_err = |e| pg_error("claim row", e);
    let their_fp: Vec<u8> = row.try_get(0).map_err(get_err)?;
    let state: i16 = row.try_get(1).map_err(get_err)?;
    let record: Option<Vec<u8>> = row.try_get(2).map_err(get_err)?;
    let left: Option<i64> = row.try_get(3).map_err(get_err)?;
    if their_fp != fp {
        return Ok(Claim::Mismatch);
    }
    match (state, record) {
        (STATE_DONE, Some(record)) => Ok(Claim::Done(Bytes::from(record))),
        // Committed behind the store's back (even with our own token): a
        // claim that is no transaction of ours, held until it expires.
        (STATE_CLAIMED, _) => Ok(Claim::InFlight {
            retry_after: positive_ms(left),
        }),
        _ => Err(BackendError::with_kind(
            BackendErrorKind::Protocol,
            format!("postgres claim: a malformed row in {TABLE} (state {state})"),
        )),
    }
}

/// Roll back and give the connection back; `answer` is the claim's.
async fn rolled_back(conn: Conn, answer: Claim) -> Result<Claim, BackendError> {
    // A rollback that fails closes the connection (dropped unclean), which
    // aborts the transaction as well: the answer stands.
    let _ = conn.finish("ROLLBACK").await;
    Ok(answer)
}

/// The connection of an open claim, once the handler let go of it (taken,
/// so that a handle the handler kept sees the transaction as over).
async fn take_conn(o: &Open) -> Option<Conn> {
    o.conn.lock().await.take()
}

impl ReplayBackend for PostgresBackend {
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
        max_entries: u64,
        max_bytes: u64,
    ) -> BackendFuture<Claim> {
        if let Some(answer) = self.claim_here(key, token, fingerprint, lease) {
            return Box::pin(std::future::ready(Ok(answer)));
        }
        self.sweep_if_due();
        let store = self.clone();
        let (key, token, fp) = (key.clone(), *token, Bytes::copy_from_slice(fingerprint));
        // Dropped part-way (the layer's deadline), the future drops its
        // connection unclean: the transaction aborts with it.
        Box::pin(async move {
            store
                .claim_in_db(key, token, fp, lease, max_entries, max_bytes)
                .await
        })
    }

    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        let open = self.take_open(key, token);
        let store = self.clone();
        let (key, token, record) = (key.clone(), *token, record.clone());
        Box::pin(async move {
            let retention_ms = millis(retention);
            let Some(open) = open else {
                // Not open here: done already (a completion re-sent after
                // its commit), or not ours.
                let conn = store.connection().await?;
                let found = conn
                    .client()
                    .query_opt(RECORDED, &[&&key.entry[..], &&token.as_bytes()[..]])
                    .await
                    .map_err(|e| pg_error("complete", e))?;
                conn.release();
                return Ok(found.is_some());
            };
            let Some(conn) = take_conn(&open).await else {
                return Ok(false);
            };
            let updated = conn
                .client()
                .execute(
                    RECORD,
                    &[
                        &&key.entry[..],
                        &&token.as_bytes()[..],
                        &&record[..],
                        &retention_ms,
                    ],
                )
                .await
                .map_err(|e| pg_error("complete", e))?;
            if updated != 1 {
                // Our claim row is gone from our own transaction (the
                // handler rolled it back, or committed it away): nothing
                // of this request is kept.
                let _ = conn.finish("ROLLBACK").await;
                return Ok(false);
            }
            conn.finish("COMMIT")
                .await
                .map_err(|e| pg_error("commit", e))?;
            Ok(true)
        })
    }

    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        // The row lock is the claim: it holds while the transaction is open.
        let mut open = self.lock_open();
        let ours = match open.get_mut(&key.entry) {
            Some(o) if o.token == *token => {
                o.expires = Instant::now() + lease;
                true
            }
            _ => false,
        };
        Box::pin(std::future::ready(Ok(ours)))
    }

    fn abandon(&self, key: &EntryKey, token: &Token, _lease: Duration) -> BackendFuture<bool> {
        // Out of the table now, rolled back on a task of its own: it takes
        // effect even if this future is never polled.
        let Some(open) = self.take_open(key, token) else {
            return Box::pin(std::future::ready(Ok(false)));
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to roll back on: closing the connection (dropping
            // it unclean) aborts the transaction just as well.
            drop(open);
            return Box::pin(std::future::ready(Ok(true)));
        };
        let rollback = runtime.spawn(async move {
            if let Some(conn) = take_conn(&open).await {
                let _ = conn.finish("ROLLBACK").await;
            }
        });
        Box::pin(async move {
            let _ = rollback.await;
            Ok(true)
        })
    }

    fn claimed(&self, key: &EntryKey, token: &Token, extensions: &mut http::Extensions) {
        let open = self.lock_open();
        if let Some(o) = open.get(&key.entry).filter(|o| o.token == *token) {
            extensions.insert(PgTransaction {
                conn: o.conn.clone(),
            });
        }
    }

    fn is_transactional(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "postgres"
    }
}

/// The request's own PostgreSQL transaction, opened by [`PostgresBackend`]
/// when the request won its idempotency claim: what the handler writes
/// through it commits together with the idempotency record, or not at all.
///
/// An axum extractor (feature `axum`; also in the request's extensions):
/// it answers 500 problem+json when the layer in front is not an
/// [`IdempotencyLayer`](crate::IdempotencyLayer) over a [`PostgresBackend`].
/// Take `Option<PgTransaction>` where the route may run without it.
///
/// Do not `COMMIT` or `ROLLBACK` it yourself: the layer commits it with the
/// record, and rolls it back when the outcome is not kept. A statement that
/// fails aborts the whole transaction (PostgreSQL's rule): use a
/// `SAVEPOINT` where a failure is expected and handled.
#[derive(Clone)]
pub struct PgTransaction {
    conn: Arc<tokio::sync::Mutex<Option<Conn>>>,
}

impl fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransaction").finish_non_exhaustive()
    }
}

impl PgTransaction {
    /// The transaction's connection, to run statements on: a guard that
    /// derefs to deadpool's [`ClientWrapper`] (and so to
    /// [`tokio_postgres::Client`]), one user at a time until dropped. An
    /// error once the transaction is over (the handler kept the handle past
    /// its answer).
    ///
    /// ```no_run
    /// # async fn demo(tx: tower_redis_lock::backend::PgTransaction) -> Result<(), Box<dyn std::error::Error>> {
    /// let db = tx.client().await?;
    /// db.execute("UPDATE accounts SET balance = balance - 5 WHERE id = 1", &[]).await?;
    /// # Ok(()) }
    /// ```
    pub async fn client(&self) -> Result<impl Deref<Target = ClientWrapper> + Send, BackendError> {
        let guard = self.conn.clone().lock_owned().await;
        if guard.is_none() {
            return Err(BackendError::new(
                "the request's transaction is over (committed or rolled back by the idempotency layer)",
            ));
        }
        Ok(PgTransactionGuard { guard })
    }
}

/// The connection of a [`PgTransaction`], inside its transaction: derefs to
/// deadpool's [`ClientWrapper`] (and so to [`tokio_postgres::Client`]).
struct PgTransactionGuard {
    guard: tokio::sync::OwnedMutexGuard<Option<Conn>>,
}

impl fmt::Debug for PgTransactionGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransactionGuard").finish_non_exhaustive()
    }
}

impl Deref for PgTransactionGuard {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        // Checked `Some` when the guard was made, and nobody else can take
        // it while the guard holds the lock.
        self.guard
            .as_ref()
            .map(Conn::client)
            .expect("checked when the guard was made")
    }
}

#[cfg(feature = "axum")]
const MISSING_TRANSACTION: crate::Rejection = crate::Rejection::MissingExtension {
    extractor: "PgTransaction",
    layer: "IdempotencyLayer over a PostgresBackend",
};

#[cfg(feature = "axum")]
extension_extractor!(PgTransaction, MISSING_TRANSACTION);

#[cfg(test)]
pub(crate) mod tests;
