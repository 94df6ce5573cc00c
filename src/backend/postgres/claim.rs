//! A claim: what this process knows of the key, then one transaction that
//! inserts (or takes over) the key's row and checks the scope's share, or
//! reads the committed row and answers from it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::ClientWrapper;
use tokio::time::Instant;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::sql::*;
use super::transaction::Conn;
use super::{millis, pg_error, positive_ms, Open, PostgresBackend};
use crate::backend::{BackendError, BackendErrorKind, Token};
use crate::backend::{Claim, EntryKey};

/// One claim, as the layer asked for it.
pub(super) struct Ask {
    pub(super) key: EntryKey,
    pub(super) token: Token,
    pub(super) fp: Bytes,
    pub(super) lease: Duration,
    /// The scope's share: at most this many entries ...
    pub(super) max_entries: u64,
    /// ... and this many bytes of records.
    pub(super) max_bytes: u64,
}

impl PostgresBackend {
    /// What this process knows of `key` without a round trip: our own open
    /// claim (a re-sent claim), or another open claim here.
    pub(super) fn claim_here(
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
    pub(super) fn sweep_if_due(&self) {
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

    pub(super) async fn claim_in_db(&self, ask: Ask) -> Result<Claim, BackendError> {
        let conn = self.connection().await?;
        let db = conn.client();
        let (entry, scope, tok) = (
            &ask.key.entry[..],
            &ask.key.scope[..],
            &ask.token.as_bytes()[..],
        );
        // A live row (a record, most often: a retry) answers at once, in
        // one round trip and no transaction.
        let live = db
            .query_opt(READ_LIVE, &[&entry])
            .await
            .map_err(|e| pg_error("claim", e))?;
        if let Some(row) = live {
            let answer = answer_of(&row, &ask.fp);
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
        let lease_ms = millis(ask.lease);
        // At most a few turns: a row deleted (swept) between our insert and
        // our read, or taken over by another request meanwhile.
        for _ in 0..3 {
            let fp_bytes: &[u8] = &ask.fp;
            let params: [&(dyn ToSql + Sync); 5] = [&entry, &scope, &tok, &fp_bytes, &lease_ms];
            // Insert the row, or take over an expired one.
            let mut taken = take_row(db, INSERT, &params).await?;
            if taken == Some(false) {
                taken = take_row(db, TAKE_OVER, &params).await?;
            }
            let Some(ours) = taken else {
                return rolled_back(conn, Claim::InFlight { retry_after: None }).await;
            };
            if ours {
                return self.keep_claim(conn, ask).await;
            }
            let row = db
                .query_opt(READ, &[&entry])
                .await
                .map_err(|e| pg_error("claim", e))?;
            let Some(row) = row else { continue };
            let answer = answer_of(&row, &ask.fp)?;
            return rolled_back(conn, answer).await;
        }
        rolled_back(conn, Claim::InFlight { retry_after: None }).await
    }

    /// Our row is in: check the scope's share, then keep the transaction
    /// open for the handler.
    async fn keep_claim(&self, conn: Conn, ask: Ask) -> Result<Claim, BackendError> {
        let Ask {
            key,
            token,
            fp,
            lease,
            max_entries,
            max_bytes,
        } = ask;
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

/// Run the claim's `INSERT` or `TAKE_OVER` in its transaction: whether the
/// row is ours now, or `None` when another transaction held it past the
/// store's `lock_wait`.
async fn take_row(
    db: &ClientWrapper,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Option<bool>, BackendError> {
    match db.query_opt(sql, params).await {
        Ok(row) => Ok(Some(row.is_some())),
        Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => Ok(None),
        Err(e) => Err(pg_error("claim", e)),
    }
}
