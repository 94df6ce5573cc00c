//! The SQLite statements of the SQL protocol, and the errors SQLite
//! answers them with.

pub(crate) const SCHEMA: &str = "
    PRAGMA journal_mode = WAL;
    CREATE TABLE IF NOT EXISTS trl_idempotency (
        entry       BLOB PRIMARY KEY,
        scope       BLOB NOT NULL,
        token       BLOB NOT NULL,
        fingerprint BLOB NOT NULL,
        state       INTEGER NOT NULL,
        record      BLOB,
        expires_at  INTEGER NOT NULL
    );
    CREATE INDEX IF NOT EXISTS trl_idempotency_scope ON trl_idempotency (scope, expires_at);
    CREATE INDEX IF NOT EXISTS trl_idempotency_expiry ON trl_idempotency (expires_at);";

/// The key's live row and its scope's use. A claim row a handler committed
/// itself (state 3) is returned however old: past its lease, its key is
/// final.
pub(crate) const LOOK: &str =
    "SELECT l.fingerprint, l.state, l.record, l.left_ms, s.n, s.bytes, s.oldest \
     FROM (SELECT count(*) AS n, coalesce(sum(length(record)), 0) AS bytes, \
           min(expires_at) - ?3 AS oldest \
           FROM trl_idempotency WHERE scope = ?2 AND expires_at > ?3) s \
     LEFT JOIN (SELECT fingerprint, state, record, expires_at - ?3 AS left_ms \
           FROM trl_idempotency WHERE entry = ?1 AND (expires_at > ?3 OR state = 3)) l ON 1";

/// The hold: a committed claim row (its own short write transaction), or
/// an expired row taken over (never one a handler committed: that key is
/// final). `?5` now, `?6` lease ms.
pub(crate) const HOLD: &str = "INSERT INTO trl_idempotency \
     (entry, scope, token, fingerprint, state, record, expires_at) \
     VALUES (?1, ?2, ?3, ?4, 0, NULL, ?5 + ?6) \
     ON CONFLICT (entry) DO UPDATE SET scope = excluded.scope, token = excluded.token, \
         fingerprint = excluded.fingerprint, state = 0, record = NULL, \
         expires_at = excluded.expires_at \
     WHERE trl_idempotency.expires_at <= ?5 AND trl_idempotency.state <> 3 \
     RETURNING 1";

/// Let go of the hold: our claim row, while it is one.
pub(crate) const UNHOLD: &str =
    "DELETE FROM trl_idempotency WHERE entry = ?1 AND token = ?2 AND state = 0";

/// The hold row's durable mark, in the handler's transaction before the
/// handler first uses it: committed by the handler itself, the row says
/// so (state 3) and its key is never run again. One row, or the claim is
/// no longer ours (its lease lapsed and another request took the row
/// over): the handler must not run on. State 3 is ours too (a mark run
/// again after its first run was cancelled unanswered).
pub(crate) const MARK: &str = "UPDATE trl_idempotency SET state = 3 \
     WHERE entry = ?1 AND token = ?2 AND state IN (0, 3)";

pub(crate) const RECORD: &str =
    "UPDATE trl_idempotency SET state = 1, record = ?3, expires_at = ?4 \
     WHERE entry = ?1 AND token = ?2 AND state IN (0, 3)";

/// A final record written outside any transaction (the handler ended its
/// own).
pub(crate) const FINALIZE: &str = "INSERT INTO trl_idempotency \
     (entry, scope, token, fingerprint, state, record, expires_at) \
     VALUES (?1, ?2, ?3, ?4, 1, ?5, ?6) \
     ON CONFLICT (entry) DO UPDATE SET state = 1, record = excluded.record, \
         expires_at = excluded.expires_at \
     WHERE trl_idempotency.token = excluded.token";

/// Final without a record (state 2): our claim row, or one a handler
/// committed and left. `?5` expiry.
pub(crate) const END: &str = "INSERT INTO trl_idempotency \
     (entry, scope, token, fingerprint, state, record, expires_at) \
     VALUES (?1, ?2, ?3, ?4, 2, NULL, ?5) \
     ON CONFLICT (entry) DO UPDATE SET token = excluded.token, state = 2, record = NULL, \
         expires_at = excluded.expires_at \
     WHERE trl_idempotency.token = excluded.token OR trl_idempotency.state = 3";

pub(crate) const RECORDED: &str = "SELECT 1 FROM trl_idempotency \
     WHERE entry = ?1 AND token = ?2 AND state = 1 AND expires_at > ?3";

/// The lease of a claim row a handler committed itself (or of a hold row
/// of the store's first version).
pub(crate) const EXTEND: &str = "UPDATE trl_idempotency SET expires_at = ?3 \
     WHERE entry = ?1 AND token = ?2 AND state IN (0, 3)";

/// Expired rows, never a claim row a handler committed (the next claim
/// makes it final).
pub(crate) const SWEEP: &str = "DELETE FROM trl_idempotency WHERE rowid IN \
     (SELECT rowid FROM trl_idempotency WHERE expires_at < ?2 AND state <> 3 LIMIT ?1)";

/// SQLite's "busy" codes (`SQLITE_BUSY` and its extended codes): the
/// transaction cannot write now.
pub(crate) fn is_busy(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i32>().ok())
            .is_some_and(|c| c & 0xff == 5 || c & 0xff == 6),
        _ => false,
    }
}

pub(crate) fn no_transaction(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.message().contains("no transaction is active"))
}
