//! The SQL store protocol, written once over an [`Adapter`]: claim, join,
//! complete, abandon, take-over and sweep.
//!
//! - **Claim**: one look outside any transaction (a live row answers: a
//!   replay, a mismatch, a claim in flight; the scope's use is counted in
//!   the same statement); then the key's hold, taken without waiting
//!   ([`Hold`]); then the handler's transaction, opened with the
//!   connection's defaults (or the store's `begin` statement), and the
//!   claim's write in it. Nothing else is set on the handler's transaction.
//! - **Join**: a duplicate whose hold is refused waits for the holder
//!   outside any transaction of a handler (its own statement, bounded by
//!   the store's `lock_wait`), then looks again: it reads the committed
//!   record whatever the application's isolation level.
//! - **Complete**: the record is written into the claim row in the
//!   handler's transaction, guarded by the marker the claim wrote (the
//!   transaction must still be the one the claim opened), then `COMMIT`,
//!   then the hold is let go. A transaction the handler ended itself is
//!   reported to the layer, which gives the store a final record to write
//!   (outside any transaction, still under the hold): the key stays final.
//! - **Abandon**: roll back, let go of the hold, on a task of its own.
//! - **Take-over**: an expired row is taken by the next claim (the hold
//!   excludes a live one).
//! - **Sweep**: expired rows are deleted in batches by the expiry index,
//!   batch after batch while a batch was full.
//! - **Drain**: wait, bounded, until no claim of this process is open
//!   (claimed, and not yet completed or abandoned).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::time::Instant;

use tower_redis_lock::backend::contract::{BackendFuture, Claim, EntryKey, Token};
use tower_redis_lock::backend::BackendError;

use crate::adapter::{Adapter, Ask, Committed, Found, Hold, Marked, Recorded};
use crate::open_count::{Counted, OpenCount};

/// Default bound on one wait for another claim's hold of the key.
pub(crate) const DEFAULT_LOCK_WAIT: Duration = Duration::from_millis(100);
/// Least time between two sweeps.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// Rows one batch of a sweep deletes.
pub(crate) const SWEEP_BATCH: i64 = 1_000;
/// Most time one sweep spends (batch after batch while they come back full).
pub(crate) const SWEEP_BUDGET: Duration = Duration::from_secs(2);

pub(crate) const STATE_CLAIMED: i16 = 0;
pub(crate) const STATE_DONE: i16 = 1;

/// Milliseconds since the Unix epoch, by this machine's clock (a row hold's
/// expiry: one machine).
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub(crate) fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

fn positive_ms(ms: Option<i64>) -> Option<Duration> {
    ms.filter(|ms| *ms > 0)
        .map(|ms| Duration::from_millis(ms as u64))
}

/// The connection of an open claim, shared with the handler's handle;
/// `None` once the store took it back.
pub(crate) type ClaimConn<C> = Arc<tokio::sync::Mutex<Option<C>>>;

/// One open claim: from its claim until its completion or abandon has
/// finished with its connection (in the table of open claims meanwhile, or
/// moved into the completion or the abandon's task). Counted while it lives.
struct Open<C> {
    ask: Ask,
    expires: Instant,
    /// Names the transaction the claim opened.
    marker: String,
    /// The handler ended the transaction itself: the next completion writes
    /// its record outside any transaction.
    ended: bool,
    conn: ClaimConn<C>,
    _counted: Counted,
}

/// The protocol's state over one adapter: shared by the clones of a store.
pub(crate) struct SqlStore<A: Adapter> {
    inner: Arc<Inner<A>>,
}

impl<A: Adapter> Clone for SqlStore<A> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<A: Adapter> {
    adapter: A,
    lock_wait: Duration,
    begin: Option<&'static str>,
    open: Mutex<HashMap<Bytes, Open<A::Conn>>>,
    count: OpenCount,
    swept: Mutex<Option<Instant>>,
}

impl<A: Adapter> fmt::Debug for SqlStore<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(A::NAME)
            .field("lock_wait", &self.inner.lock_wait)
            .field("begin", &self.inner.begin)
            .field("open", &self.lock_open().len())
            .finish_non_exhaustive()
    }
}

impl<A: Adapter> SqlStore<A> {
    pub(crate) fn new(adapter: A) -> Self {
        Self::with(adapter, DEFAULT_LOCK_WAIT, None)
    }

    fn with(adapter: A, lock_wait: Duration, begin: Option<&'static str>) -> Self {
        Self {
            inner: Arc::new(Inner {
                adapter,
                lock_wait,
                begin,
                open: Mutex::new(HashMap::new()),
                count: OpenCount::new(),
                swept: Mutex::new(None),
            }),
        }
    }

    /// The same store with another bound on a duplicate's wait (claims in
    /// flight stay with the old one).
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlx-postgres")),
        allow(dead_code)
    )] // PostgreSQL only
    pub(crate) fn lock_wait(self, wait: Duration) -> Self
    where
        A: Clone,
    {
        let begin = self.inner.begin;
        Self::with(
            self.inner.adapter.clone(),
            wait.max(Duration::from_millis(1)),
            begin,
        )
    }

    /// The same store opening the handler's transaction with `begin`.
    pub(crate) fn begin_with(self, begin: &'static str) -> Self
    where
        A: Clone,
    {
        let wait = self.inner.lock_wait;
        Self::with(self.inner.adapter.clone(), wait, Some(begin))
    }

    pub(crate) async fn migrate(&self) -> Result<(), BackendError> {
        self.inner.adapter.migrate().await
    }

    fn lock_open(&self) -> MutexGuard<'_, HashMap<Bytes, Open<A::Conn>>> {
        self.inner.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take_open(&self, key: &EntryKey, token: &Token) -> Option<Open<A::Conn>> {
        let mut open = self.lock_open();
        match open.get(key.entry()) {
            Some(o) if o.ask.token == *token => open.remove(key.entry()),
            _ => None,
        }
    }

    /// The open claim's connection, for the handler's handle.
    pub(crate) fn claim_conn(&self, key: &EntryKey, token: &Token) -> Option<ClaimConn<A::Conn>> {
        let open = self.lock_open();
        open.get(key.entry())
            .filter(|o| o.ask.token == *token)
            .map(|o| o.conn.clone())
    }

    /// What this process knows of `key` without a round trip.
    fn claim_here(&self, ask: &Ask) -> Option<Claim> {
        let mut open = self.lock_open();
        let o = open.get_mut(ask.key.entry())?;
        let now = Instant::now();
        Some(if o.ask.token == ask.token {
            o.expires = now + ask.lease;
            Claim::Claimed
        } else if o.ask.fp != ask.fp {
            Claim::Mismatch
        } else {
            Claim::InFlight {
                retry_after: Some(o.expires.saturating_duration_since(now))
                    .filter(|d| !d.is_zero()),
            }
        })
    }

    /// Claims in flight here in `scope` other than `entry`, invisible to a
    /// look until they commit (a session hold's), and the soonest expiry.
    fn open_in_scope(&self, scope: &[u8], entry: &[u8]) -> (u64, Option<Instant>) {
        if A::HOLD == Hold::Row {
            // Committed claim rows: the look counts them.
            return (0, None);
        }
        let open = self.lock_open();
        let mut n = 0;
        let mut soonest: Option<Instant> = None;
        for (k, o) in open.iter() {
            if **o.ask.key.scope() == *scope && **k != *entry {
                n += 1;
                soonest = Some(soonest.map_or(o.expires, |s| s.min(o.expires)));
            }
        }
        (n, soonest)
    }

    /// [`IdempotencyBackend::claim`](tower_redis_lock::backend::IdempotencyBackend::claim).
    pub(crate) fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
        max_entries: u64,
        max_bytes: u64,
    ) -> BackendFuture<Claim> {
        let ask = Ask {
            key: key.clone(),
            token: *token,
            fp: Bytes::copy_from_slice(fingerprint),
            lease,
            max_entries,
            max_bytes,
        };
        if let Some(answer) = self.claim_here(&ask) {
            return BackendFuture::ready(Ok(answer));
        }
        self.sweep_if_due();
        let store = self.clone();
        // Dropped part-way (the layer's deadline), the future drops its
        // connection unclean: it is closed, and its transaction and hold go
        // with it (a row hold's row expires).
        BackendFuture::new(async move { store.claim_in_db(ask).await })
    }

    async fn claim_in_db(&self, ask: Ask) -> Result<Claim, BackendError> {
        let mut conn = self.inner.adapter.connect().await?;
        // A few turns at most: a hold let go while we waited, a row
        // committed (or swept) between our look and our write.
        for _ in 0..4 {
            let look = A::look(&mut conn, &ask, now_ms()).await?;
            if let Some(found) = look.live {
                let answer = answer_of(found, &ask.fp);
                A::release(conn);
                return answer;
            }
            let (here, soonest_here) = self.open_in_scope(ask.key.scope(), ask.key.entry());
            let entries = look.count.max(0) as u64 + 1 + here;
            if entries > ask.max_entries || look.bytes.max(0) as u64 >= ask.max_bytes {
                let now = Instant::now();
                let retry_after = [
                    positive_ms(look.oldest_ms),
                    soonest_here.map(|at| at.saturating_duration_since(now)),
                ]
                .into_iter()
                .flatten()
                .filter(|d| !d.is_zero())
                .min()
                .unwrap_or(Duration::from_secs(1));
                A::release(conn);
                return Ok(Claim::OverQuota { retry_after });
            }
            if !A::hold(&mut conn, &ask, now_ms()).await? {
                // Held by another claim: wait for it outside any handler's
                // transaction, then look again.
                if A::wait(&mut conn, &ask, self.inner.lock_wait).await? {
                    continue;
                }
                A::release(conn);
                return Ok(Claim::InFlight { retry_after: None });
            }
            // The key is held: a failure from here closes the connection
            // (dropped unclean), which lets go of a session hold; a row
            // hold is deleted on a task of its own.
            let began = match A::begin(&mut conn, self.inner.begin).await {
                Ok(()) => A::mark(&mut conn, &ask, now_ms()).await,
                Err(e) => Err(e),
            };
            match began {
                Ok(Marked::Ours(marker)) => return Ok(self.keep(conn, ask, marker)),
                Ok(Marked::Taken) | Ok(Marked::Retry) => {
                    A::rollback(&mut conn).await?;
                    A::unhold(&mut conn, ask.key.entry(), &ask.token).await?;
                }
                Err(e) => {
                    drop(conn);
                    self.unhold_elsewhere(&ask);
                    return Err(e);
                }
            }
        }
        A::release(conn);
        Ok(Claim::InFlight { retry_after: None })
    }

    fn keep(&self, conn: A::Conn, ask: Ask, marker: String) -> Claim {
        let mut open = self.lock_open();
        // Our hold excludes any other claim of the key in any process.
        open.insert(
            ask.key.entry().clone(),
            Open {
                expires: Instant::now() + ask.lease,
                ask,
                marker,
                ended: false,
                conn: Arc::new(tokio::sync::Mutex::new(Some(conn))),
                _counted: self.inner.count.open(),
            },
        );
        Claim::Claimed
    }

    /// A row hold whose connection failed: delete our claim row from a
    /// connection of its own, on a task (a session hold went with its
    /// connection).
    fn unhold_elsewhere(&self, ask: &Ask) {
        if A::HOLD != Hold::Row {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.clone();
        let (entry, token) = (ask.key.entry().clone(), ask.token);
        runtime.spawn(async move {
            if let Ok(mut conn) = store.inner.adapter.connect().await {
                if A::unhold(&mut conn, &entry, &token).await.is_ok() {
                    A::release(conn);
                }
            }
        });
    }

    /// [`IdempotencyBackend::complete`](tower_redis_lock::backend::IdempotencyBackend::complete).
    pub(crate) fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        let open = self.take_open(key, token);
        let store = self.clone();
        let (key, token, record) = (key.clone(), *token, record.clone());
        BackendFuture::new(async move {
            let expires = (now_ms(), millis(retention));
            let Some(open) = open else {
                // Not open here: done already (a completion re-sent after
                // its commit), or not ours.
                let mut conn = store.inner.adapter.connect().await?;
                let found = A::recorded(&mut conn, key.entry(), &token, now_ms()).await?;
                A::release(conn);
                return Ok(found);
            };
            let Some(mut conn) = open.conn.lock().await.take() else {
                return Ok(false);
            };
            if open.ended {
                // The handler ended the transaction itself: `record` is the
                // layer's final answer, written outside any transaction,
                // under the hold; then the connection is closed (which lets
                // go of a session hold).
                A::finalize(&mut conn, &open.ask, &record, expires).await?;
                A::unhold(&mut conn, key.entry(), &token).await?;
                drop(conn);
                return Ok(true);
            }
            let recorded = A::record(
                &mut conn,
                key.entry(),
                &token,
                &record,
                expires,
                &open.marker,
            )
            .await?;
            match recorded {
                Recorded::Written => {}
                Recorded::Ended => {
                    // Keep the connection (and the hold) for the final record.
                    *open.conn.lock().await = Some(conn);
                    let mut open = open;
                    open.ended = true;
                    store.lock_open().insert(key.entry().clone(), open);
                    return Err(BackendError::transaction_ended(format!(
                        "{}: the request's transaction is not the one its claim opened (the \
                         handler ran COMMIT or ROLLBACK itself)",
                        A::NAME
                    )));
                }
                Recorded::NotOurs | Recorded::Failed => {
                    A::rollback(&mut conn).await?;
                    A::unhold(&mut conn, key.entry(), &token).await?;
                    A::release(conn);
                    return Ok(false);
                }
            }
            match A::commit(&mut conn).await? {
                Committed::Yes => {
                    A::unhold(&mut conn, key.entry(), &token).await?;
                    A::release(conn);
                    Ok(true)
                }
                // Rolled back by the database: nothing of the request is
                // kept, the key is free, a retry runs on a clean slate.
                Committed::Refused => {
                    A::unhold(&mut conn, key.entry(), &token).await?;
                    A::release(conn);
                    Ok(false)
                }
                // The handler committed its work itself and the record
                // committed on its own, after it: the key is final.
                Committed::NoTransaction => {
                    A::unhold(&mut conn, key.entry(), &token).await?;
                    drop(conn);
                    Ok(true)
                }
            }
        })
    }

    /// [`IdempotencyBackend::extend`](tower_redis_lock::backend::IdempotencyBackend::extend).
    pub(crate) fn extend(
        &self,
        key: &EntryKey,
        token: &Token,
        lease: Duration,
    ) -> BackendFuture<bool> {
        let ours = {
            let mut open = self.lock_open();
            match open.get_mut(key.entry()) {
                Some(o) if o.ask.token == *token => {
                    o.expires = Instant::now() + lease;
                    true
                }
                _ => false,
            }
        };
        if !ours || A::HOLD == Hold::Session {
            // A session hold lasts as long as its connection.
            return BackendFuture::ready(Ok(ours));
        }
        let store = self.clone();
        let (entry, token) = (key.entry().clone(), *token);
        BackendFuture::new(async move {
            let mut conn = store.inner.adapter.connect().await?;
            let ours = A::extend(&mut conn, &entry, &token, (now_ms(), millis(lease))).await?;
            A::release(conn);
            Ok(ours)
        })
    }

    /// [`IdempotencyBackend::abandon`](tower_redis_lock::backend::IdempotencyBackend::abandon).
    pub(crate) fn abandon(&self, key: &EntryKey, token: &Token) -> BackendFuture<bool> {
        // Out of the table now, rolled back on a task of its own: it takes
        // effect even if this future is never polled.
        let Some(open) = self.take_open(key, token) else {
            return BackendFuture::ready(Ok(false));
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Closing the connection aborts the transaction and lets go of
            // a session hold; a row hold expires.
            drop(open);
            return BackendFuture::ready(Ok(true));
        };
        let (entry, token) = (key.entry().clone(), *token);
        let rollback = runtime.spawn(async move {
            let Some(mut conn) = open.conn.lock().await.take() else {
                return;
            };
            if open.ended {
                // Whatever the handler left: closed with the connection.
                let _ = A::rollback(&mut conn).await;
                let _ = A::unhold(&mut conn, &entry, &token).await;
                return;
            }
            if A::rollback(&mut conn).await.is_ok()
                && A::unhold(&mut conn, &entry, &token).await.is_ok()
            {
                A::release(conn);
            }
        });
        BackendFuture::new(async move {
            let _ = rollback.await;
            Ok(true)
        })
    }

    /// [`Backend::drain`](tower_redis_lock::backend::Backend::drain): wait,
    /// at most `timeout`, until no claim of this process is open (claimed,
    /// and not yet completed or abandoned: its completion or its abandon's
    /// rollback finished with its connection); else an error that says how
    /// many are left. Answered in the call when none is open.
    pub(crate) fn drain(&self, timeout: Duration) -> BackendFuture<()> {
        self.inner.count.drain(A::NAME, timeout)
    }

    /// Start a sweep of expired rows, at most once per [`SWEEP_EVERY`], on
    /// a task and a connection of its own.
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
            match store.sweep().await {
                Ok(n) => tracing::debug!(deleted = n, store = A::NAME, "swept expired idempotency records"),
                Err(e) => tracing::warn!(error = %e, store = A::NAME, "sweeping expired idempotency records failed"),
            }
        });
    }

    /// Delete expired rows, batch after batch while a batch was full,
    /// within [`SWEEP_BUDGET`]: how many.
    pub(crate) async fn sweep(&self) -> Result<u64, BackendError> {
        let began = Instant::now();
        let mut conn = self.inner.adapter.connect().await?;
        let mut total = 0;
        loop {
            let n = A::sweep(&mut conn, SWEEP_BATCH, now_ms()).await?;
            total += n;
            if n < SWEEP_BATCH as u64 || began.elapsed() >= SWEEP_BUDGET {
                break;
            }
        }
        A::release(conn);
        Ok(total)
    }
}

/// What a committed row of the key says to a claim for `fp`. Untrusted
/// bytes: compared, never decoded here; a malformed row is an error.
fn answer_of(found: Found, fp: &[u8]) -> Result<Claim, BackendError> {
    if found.fingerprint != fp {
        return Ok(Claim::Mismatch);
    }
    match (found.state, found.record) {
        (STATE_DONE, Some(record)) => Ok(Claim::Done(Bytes::from(record))),
        // A claim held by a committed row (a row hold's, or one a handler
        // committed behind the store's back): in flight until it expires.
        (STATE_CLAIMED, _) => Ok(Claim::InFlight {
            retry_after: positive_ms(found.left_ms),
        }),
        (state, _) => Err(BackendError::protocol(format!(
            "idempotency store: a malformed row (state {state})"
        ))),
    }
}
