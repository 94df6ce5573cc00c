//! The SQL store protocol, written once over an [`Adapter`]: claim, join,
//! complete, abandon, take-over and sweep.
//!
//! - **Claim**: one look outside any transaction (a live row answers: a
//!   replay, a mismatch, a claim in flight, a key made final; the scope's
//!   use is counted in the same statement); then the key's hold ([`Hold`]);
//!   then the handler's transaction, opened with the connection's defaults
//!   (or the store's `begin` statement), and the claim's write in it. A
//!   claim row seen committed without its hold is a handler that committed
//!   the request's transaction itself and whose process died: the key is
//!   made final ([`Claim::Ended`]).
//! - **Join**: a duplicate whose hold is refused waits for the holder
//!   outside any transaction of a handler (its own statement, bounded by
//!   the store's `lock_wait`), then looks again: it reads the committed
//!   record whatever the application's isolation level.
//! - **Complete**: the record is written into the claim row in the
//!   handler's transaction, guarded by the marker the claim wrote (the
//!   transaction must still be the one the claim opened), then `COMMIT`,
//!   then the hold is let go; the `COMMIT` is bounded by the store's
//!   commit timeout, and one whose answer was lost is asked about by the
//!   transaction's id. A transaction the handler ended itself is reported
//!   to the layer, which gives the store a final record to write (outside
//!   any transaction, still under the hold): the key stays final.
//! - **Abandon**: find the transaction's [`Fate`]: still ours, or rolled
//!   back with nothing committed: roll back, let go of the hold; ended by
//!   the handler: the key is made final. On a task of its own.
//! - **Take-over**: an expired row is taken by the next claim (the hold
//!   excludes a live one), unless a handler committed it (it is final).
//! - **Sweep**: expired rows are deleted in batches by the expiry index,
//!   batch after batch while a batch was full.
//! - **Drain**: wait, bounded, until no claim of this process is open
//!   (claimed, and not yet completed or abandoned).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use tower_redis_lock::backend::contract::{BackendFuture, Claim, EntryKey, Token};
use tower_redis_lock::backend::{BackendError, ClaimTerms};

use crate::adapter::{Adapter, Ask, Fate, Hold, Marked, Recorded};
use crate::open_count::OpenCount;

mod commit;
mod open;
mod rows;
mod sessions;
mod settings;

pub(crate) use open::Open;
use rows::{answer_of, positive_ms, Seen};

/// First wait before making a key final again (doubling up to
/// [`END_BACKOFF_MAX`]), when the database refused it for now
/// ([`Adapter::is_transient`](crate::adapter::Adapter::is_transient)).
const END_BACKOFF_START: Duration = Duration::from_millis(20);
/// Longest wait between tries of making a key final.
const END_BACKOFF_MAX: Duration = Duration::from_secs(1);
pub(crate) use rows::{millis, now_ms};
use sessions::SessionCheck;
pub(crate) use settings::*;

/// Let go of the hold of `token` on `entry` on `conn` (then pooled again
/// when `pool`, else closed). When the database refuses it for now
/// ([`Adapter::is_transient`]: SQLite's write lock held by another
/// writer), it is tried again on a task of its own, with back-off, at most
/// [`LET_GO_TRIES`] more times and until the hold would lapse anyway
/// (`until`), and this answers at once: the client is told the key is
/// free, and a retry must not meet the hold for the rest of its lease. (The
/// task holds the connection meanwhile: each try may wait SQLite's
/// `busy_timeout`, so the tries are few.)
pub(crate) async fn let_go<A: Adapter>(
    mut conn: A::Conn,
    entry: &Bytes,
    token: &Token,
    until: Instant,
    pool: bool,
) -> Result<(), BackendError> {
    let done = move |conn: A::Conn| {
        if pool {
            A::release(conn);
        }
    };
    match A::unhold(&mut conn, entry, token).await {
        Ok(()) => {
            done(conn);
            Ok(())
        }
        Err(e) if A::is_transient(&e) && Instant::now() < until => {
            tracing::warn!(error = %e, store = A::NAME, "letting go of the claim's hold: the database is busy; trying again in the background");
            let (entry, token) = (entry.clone(), *token);
            drop(tokio::spawn(async move {
                let mut backoff = END_BACKOFF_START;
                for tried in 1..=LET_GO_TRIES {
                    tokio::time::sleep(backoff).await;
                    match A::unhold(&mut conn, &entry, &token).await {
                        Ok(()) => return done(conn),
                        Err(e)
                            if A::is_transient(&e)
                                && tried < LET_GO_TRIES
                                && Instant::now() + backoff < until =>
                        {
                            backoff = (backoff * 2).min(END_BACKOFF_MAX);
                        }
                        Err(e) => {
                            tracing::error!(error = %e, store = A::NAME, "the claim's hold could not be let go of: it lapses with its lease");
                            return;
                        }
                    }
                }
            }));
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Most tries [`let_go`] makes in the background.
const LET_GO_TRIES: u32 = 8;

/// The connection of an open claim, shared with the handler's handle;
/// `None` once the store took it back.
pub(crate) type ClaimConn<C> = Arc<tokio::sync::Mutex<Option<C>>>;

/// The task that holds a handler's guard on its claim's connection now
/// (shared by the clones of its handle): a second ask from that same task
/// may be waiting for itself (a guard still alive in the caller), for
/// ever; it waits at most [`SAME_TASK_WAIT`] (another future of the task,
/// under `join!`, may let go meanwhile), then is an error. Another task
/// waits its turn without a bound, as before.
#[derive(Clone, Default)]
pub(crate) struct Holder(Arc<std::sync::Mutex<Option<Task>>>);

/// A task: a spawned one, or the future a runtime's `block_on` runs on
/// this thread (it has no task id; no other can be at the same time).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Task {
    Spawned(tokio::task::Id),
    BlockedOn(std::thread::ThreadId),
}

impl Task {
    fn current() -> Self {
        match tokio::task::try_id() {
            Some(id) => Self::Spawned(id),
            None => Self::BlockedOn(std::thread::current().id()),
        }
    }
}

impl Holder {
    fn now(&self) -> std::sync::MutexGuard<'_, Option<Task>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The guard on `conn`: waited for without a bound, or at most
    /// [`SAME_TASK_WAIT`] when the current task holds it already.
    pub(crate) async fn lock<C>(
        &self,
        conn: &ClaimConn<C>,
    ) -> Result<tokio::sync::OwnedMutexGuard<Option<C>>, BackendError> {
        let here = *self.now() == Some(Task::current());
        if !here {
            return Ok(conn.clone().lock_owned().await);
        }
        tokio::time::timeout(SAME_TASK_WAIT, conn.clone().lock_owned())
            .await
            .map_err(|_| {
                BackendError::new(
                    "this task already holds the request's connection (a guard from `conn()` \
                     or `client()` is still alive): use that one, or drop it before asking again",
                )
            })
    }

    /// Note the current task as the holder until the mark drops.
    pub(crate) fn hold(&self) -> HolderMark {
        let me = Some(Task::current());
        *self.now() = me;
        HolderMark {
            holder: self.clone(),
            me,
        }
    }
}

/// How long a second ask for a claim's connection from the task that holds
/// it waits before it is an error (see [`Holder`]).
pub(crate) const SAME_TASK_WAIT: Duration = Duration::from_secs(3);

/// Clears the [`Holder`] when the guard it goes with drops.
pub(crate) struct HolderMark {
    holder: Holder,
    me: Option<Task>,
}

impl Drop for HolderMark {
    fn drop(&mut self) {
        let mut now = self.holder.now();
        if *now == self.me {
            *now = None;
        }
    }
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
    settings: Settings,
    open: Mutex<HashMap<Bytes, Open<A>>>,
    count: OpenCount,
    swept: Mutex<Option<Instant>>,
    sessions: SessionCheck,
}

impl<A: Adapter> fmt::Debug for SqlStore<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(A::NAME)
            .field("settings", &self.inner.settings)
            .field("open", &self.lock_open().len())
            .finish_non_exhaustive()
    }
}

impl<A: Adapter> SqlStore<A> {
    pub(crate) fn new(adapter: A) -> Self {
        Self::with(
            adapter,
            Settings {
                lock_wait: DEFAULT_LOCK_WAIT,
                begin: None,
                commit_timeout: DEFAULT_COMMIT_TIMEOUT,
            },
        )
    }

    fn with(adapter: A, settings: Settings) -> Self {
        Self {
            inner: Arc::new(Inner {
                adapter,
                settings,
                open: Mutex::new(HashMap::new()),
                count: OpenCount::new(),
                swept: Mutex::new(None),
                sessions: SessionCheck::default(),
            }),
        }
    }

    /// The same store with settings changed by `change` (claims in flight
    /// keep the old ones).
    pub(crate) fn settings(self, change: impl FnOnce(&mut Settings)) -> Self
    where
        A: Clone,
    {
        let mut settings = self.inner.settings;
        change(&mut settings);
        settings.lock_wait = settings.lock_wait.max(Duration::from_millis(1));
        Self::with(self.inner.adapter.clone(), settings)
    }

    /// How long the layer waits for a claim (see
    /// [`Adapter::claim_timeout`]).
    pub(crate) fn claim_timeout(&self, deadline: Duration) -> Duration {
        self.inner.adapter.claim_timeout(deadline)
    }

    pub(crate) async fn migrate(&self) -> Result<(), BackendError> {
        self.inner.adapter.migrate().await?;
        self.check_sessions().await
    }

    fn lock_open(&self) -> MutexGuard<'_, HashMap<Bytes, Open<A>>> {
        self.inner.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take_open(&self, key: &EntryKey, token: &Token) -> Option<Open<A>> {
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
        terms: &ClaimTerms,
    ) -> BackendFuture<Claim> {
        let ask = Ask {
            key: key.clone(),
            token: *token,
            fp: Bytes::copy_from_slice(fingerprint),
            lease: terms.lease,
            max_entries: terms.max_entries,
            max_bytes: terms.max_bytes,
            retention: terms.retention,
        };
        if let Some(answer) = self.claim_here(&ask) {
            return BackendFuture::ready(Ok(answer));
        }
        self.sweep_if_due();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return BackendFuture::ready(Err(BackendError::new(
                "the SQL idempotency stores need a tokio runtime",
            )));
        };
        let store = self.clone();
        // On a task of its own, to its end: a claim the layer stopped
        // waiting for (its deadline) is undone once it is placed, never left
        // to land later (SQLite's write lock is not interrupted).
        let (tx, rx) = tokio::sync::oneshot::channel();
        runtime.spawn(async move {
            let (key, token) = (ask.key.clone(), ask.token);
            let answer = store.claim_in_db(ask).await;
            if let Err(Ok(Claim::Claimed)) = tx.send(answer) {
                tracing::debug!(
                    store = A::NAME,
                    "a claim placed after the layer stopped waiting for it: undone"
                );
                let _ = store.abandon(&key, &token).await;
            }
        });
        BackendFuture::new(async move {
            rx.await
                .unwrap_or_else(|_| Err(BackendError::new("the claim's task failed")))
        })
    }

    /// Refuse a pool whose connections are not one server session each.
    pub(crate) async fn check_sessions(&self) -> Result<(), BackendError> {
        self.inner.sessions.check(&self.inner.adapter).await
    }

    async fn claim_in_db(&self, ask: Ask) -> Result<Claim, BackendError> {
        self.check_sessions().await?;
        let mut conn = self.inner.adapter.connect().await?;
        // A few turns at most: a hold let go while we waited, a row
        // committed (or swept) between our look and our write.
        for _ in 0..4 {
            let look = A::look(&mut conn, &ask, now_ms()).await?;
            let mut orphan = false;
            if let Some(found) = look.live {
                match answer_of::<A>(found, &ask.fp)? {
                    Seen::Answer(answer) => {
                        A::release(conn);
                        return Ok(answer);
                    }
                    Seen::Orphan => orphan = true,
                }
            }
            if !orphan {
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
            }
            if orphan && A::HOLD == Hold::Row {
                // Past its lease, and never taken over: final.
                A::end(&mut conn, &ask, now_ms()).await?;
                A::release(conn);
                tracing::warn!(store = A::NAME, "a claim committed by its own handler, whose process is gone: the key is final (transaction-ended)");
                return Ok(Claim::Ended);
            }
            if !A::hold(&mut conn, &ask, now_ms()).await? {
                // Held by another claim: wait for it outside any handler's
                // transaction, then look again.
                if A::wait(&mut conn, &ask, self.inner.settings.lock_wait).await? {
                    continue;
                }
                A::release(conn);
                return Ok(Claim::InFlight { retry_after: None });
            }
            if orphan {
                // A handler committed the request's transaction itself and
                // its claim is gone (its process died): nothing of the key
                // may run again.
                let ended = A::end(&mut conn, &ask, now_ms()).await;
                A::unhold(&mut conn, ask.key.entry(), &ask.token).await?;
                ended?;
                A::release(conn);
                tracing::warn!(store = A::NAME, "a claim committed by its own handler, whose process is gone: the key is final (transaction-ended)");
                return Ok(Claim::Ended);
            }
            // The key is held: a failure from here closes the connection
            // (dropped unclean), which lets go of a session hold and of
            // whatever the transaction wrote; a row hold is deleted on a
            // task of its own.
            let began = match A::begin(&mut conn, self.inner.settings.begin).await {
                Ok(()) => A::mark(&mut conn, &ask, now_ms()).await,
                Err(e) => Err(e),
            };
            match began {
                Ok(Marked::Ours(marker)) => return Ok(self.keep(conn, ask, marker)),
                Ok(Marked::Taken | Marked::Retry) => {
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

    fn keep(&self, conn: A::Conn, ask: Ask, marker: A::Marker) -> Claim {
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
            // The handler may still hold the transaction (a `conn()` guard
            // kept past its answer: in its response body, or in a task):
            // then nothing can be committed or rolled back until it lets
            // go. Its fate is settled then, as an abandon's (rolled back, or
            // the key made final if the handler committed); the request's
            // outcome is not known now.
            let bound = store.inner.settings.commit_timeout;
            let slot = tokio::time::timeout(bound, open.conn.clone().lock_owned()).await;
            let Ok(mut slot) = slot else {
                store.lock_open().insert(key.entry().clone(), open);
                drop(store.abandon(&key, &token));
                return Err(BackendError::outcome_unknown(format!(
                    "{}: the handler still holds the request's transaction (a `conn()` guard \
                     kept past its answer, in its response body or a task), so it cannot \
                     commit; it is rolled back (or the key made final, if the handler \
                     committed it) once the guard is dropped",
                    A::NAME
                )));
            };
            let Some(mut conn) = slot.take() else {
                return Ok(false);
            };
            drop(slot);
            if open.ended {
                // The handler ended the transaction itself: `record` is the
                // layer's final answer, written outside any transaction,
                // under the hold; then the connection is closed (which lets
                // go of a session hold).
                //
                // The key must become final before the hold lapses (a
                // retry would run again): tried again, under the hold,
                // while the database refuses it for now
                // (`Adapter::is_transient`), until the hold's expiry (a
                // session hold is let go of only when the connection is
                // dropped).
                let mut backoff = END_BACKOFF_START;
                while let Err(e) = A::finalize(&mut conn, &open.ask, &record, expires).await {
                    if !A::is_transient(&e) || Instant::now() + backoff >= open.expires {
                        tracing::error!(error = %e, store = A::NAME, "the handler ended the request's transaction itself, and its final record could not be written: once its hold expires, a retry runs again");
                        return Err(e);
                    }
                    tracing::warn!(error = %e, store = A::NAME, "writing the final record failed; retrying under the hold");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(END_BACKOFF_MAX);
                }
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
                Recorded::Written => {
                    let bound = store.inner.settings.commit_timeout;
                    commit::commit(&store.inner.adapter, conn, open, bound).await
                }
                Recorded::Ended => {
                    // Keep the connection (and the hold) for the final record.
                    *open.conn.lock().await = Some(conn);
                    let mut open = open;
                    open.ended = true;
                    store.lock_open().insert(key.entry().clone(), open);
                    Err(BackendError::transaction_ended(format!(
                        "{}: the request's transaction is not the one its claim opened (the \
                         handler ran COMMIT or ROLLBACK itself)",
                        A::NAME
                    )))
                }
                // Nothing of it can commit: closed (never pooled, whatever
                // the handler left), which rolls back and lets go of the
                // hold; the key is free.
                Recorded::Failed => {
                    let _ = A::rollback(&mut conn).await;
                    let _ = let_go::<A>(conn, key.entry(), &token, open.expires, false).await;
                    Ok(false)
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
        let until = Instant::now() + lease;
        let session = A::HOLD == Hold::Session;
        let ours = {
            let mut open = self.lock_open();
            match open.get_mut(key.entry()) {
                Some(o) if o.ask.token == *token => {
                    if session {
                        o.expires = until;
                    }
                    true
                }
                _ => false,
            }
        };
        if !ours || session {
            // A session hold lasts as long as its connection.
            return BackendFuture::ready(Ok(ours));
        }
        let store = self.clone();
        let (entry, token) = (key.entry().clone(), *token);
        BackendFuture::new(async move {
            let mut conn = store.inner.adapter.connect().await?;
            let ours = A::extend(&mut conn, &entry, &token, (now_ms(), millis(lease))).await?;
            A::release(conn);
            // The row's expiry moved: so does what this process reads as
            // the hold's end (not before: a renewal refused, busy, leaves
            // the row to lapse when it said).
            if ours {
                if let Some(o) = store.lock_open().get_mut(&entry) {
                    if o.ask.token == token {
                        o.expires = o.expires.max(until);
                    }
                }
            }
            Ok(ours)
        })
    }

    /// [`IdempotencyBackend::abandon`](tower_redis_lock::backend::IdempotencyBackend::abandon):
    /// on a task of its own, so that it takes effect even if this future is
    /// never polled; awaited up to the commit timeout.
    pub(crate) fn abandon(&self, key: &EntryKey, token: &Token) -> BackendFuture<bool> {
        let Some(open) = self.take_open(key, token) else {
            return BackendFuture::ready(Ok(false));
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Closing the connection aborts the transaction and lets go of
            // the hold.
            drop(open);
            return BackendFuture::ready(Ok(true));
        };
        let bound = self.inner.settings.commit_timeout;
        let task = runtime.spawn(async move {
            let Some(mut conn) = open.conn.lock().await.take() else {
                return Ok(false);
            };
            let (ask, now) = (&open.ask, now_ms());
            let fate = match open.ended {
                true => {
                    // Whatever the handler left open since goes first: the
                    // end mark must not run inside it.
                    let _ = A::rollback(&mut conn).await;
                    Fate::Ended
                }
                false => A::fate(&mut conn, &open.marker).await?,
            };
            match fate {
                Fate::Ours => {
                    A::rollback(&mut conn).await?;
                    let_go::<A>(conn, ask.key.entry(), &ask.token, open.expires, true).await?;
                    Ok(true)
                }
                // Nothing of it committed: closed (never pooled, whatever
                // the database left), the key is free.
                Fate::RolledBack => {
                    // Whatever the handler opened after its rollback goes
                    // first: the unhold must not run inside it (closing
                    // the connection would undo it, and the key would
                    // stay claimed for its TTL).
                    let _ = A::rollback(&mut conn).await;
                    let _ =
                        let_go::<A>(conn, ask.key.entry(), &ask.token, open.expires, false).await;
                    Ok(true)
                }
                Fate::Ended => {
                    // The key must become final before the hold lapses (a
                    // retry would run again): tried again, under the hold,
                    // while the database refuses it for now
                    // (`Adapter::is_transient`), until the hold's expiry (a
                    // session hold is let go of only when the connection
                    // is dropped, after this).
                    let mut backoff = END_BACKOFF_START;
                    let mut ended = A::end(&mut conn, ask, now).await;
                    while let Err(e) = &ended {
                        if !A::is_transient(e) || Instant::now() + backoff >= open.expires {
                            tracing::error!(error = %e, store = A::NAME, "the handler ended the request's transaction itself, and its key could not be made final: once its hold expires, a retry runs again");
                            break;
                        }
                        tracing::warn!(error = %e, store = A::NAME, "making the key final failed; retrying under the hold");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(END_BACKOFF_MAX);
                        ended = A::end(&mut conn, ask, now_ms()).await;
                    }
                    // Not final: the hold stays until it lapses (no earlier
                    // retry runs again), never let go of here.
                    let what = match ended {
                        Ok(()) => {
                            let _ = A::unhold(&mut conn, ask.key.entry(), &ask.token).await;
                            "the key is final"
                        }
                        Err(_) => "the key could not be made final; do not retry it",
                    };
                    Err(BackendError::transaction_ended(format!(
                        "{}: the handler ended the request's transaction itself and something \
                         of it may have committed; {what}",
                        A::NAME
                    )))
                }
            }
        });
        BackendFuture::new(async move {
            match tokio::time::timeout(bound, task).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(panicked)) => Err(BackendError::new(format!(
                    "{}: the abandon's task failed: {panicked}",
                    A::NAME
                ))),
                Err(_) => Err(BackendError::outcome_unknown(format!(
                    "{}: the database did not answer the abandon within the store's commit \
                     timeout ({bound:?}); whether the handler committed is not known",
                    A::NAME
                ))),
            }
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
