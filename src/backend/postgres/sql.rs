//! The SQL of the PostgreSQL store, in one place.

use std::time::Duration;

/// The table's name.
pub(super) const TABLE: &str = "trl_idempotency";
/// Default bound on a claim's wait for a transaction that holds its key.
pub(super) const DEFAULT_LOCK_WAIT: Duration = Duration::from_millis(100);
/// Least time between two sweeps of expired rows (which skip the rows an
/// open claim is taking over, never waiting on them).
pub(super) const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// Most expired rows one sweep deletes.
pub(super) const SWEEP_BATCH: i64 = 500;

pub(super) const STATE_CLAIMED: i16 = 0;
pub(super) const STATE_DONE: i16 = 1;

/// The schema [`PostgresBackend::migrate`](super::PostgresBackend::migrate)
/// creates (idempotent), under a transaction-scoped advisory lock so that
/// instances starting together do not race.
pub(super) const SCHEMA: &str = "
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
pub(super) const PRESENT: &str = "SELECT to_regclass('trl_idempotency') IS NOT NULL \
     AND to_regclass('trl_idempotency_scope') IS NOT NULL \
     AND to_regclass('trl_idempotency_expiry') IS NOT NULL";

pub(super) const INSERT: &str = "INSERT INTO trl_idempotency \
     (entry, scope, token, fingerprint, state, record, expires_at) \
     VALUES ($1, $2, $3, $4, 0, NULL, statement_timestamp() + $5::bigint * interval '1 millisecond') \
     ON CONFLICT (entry) DO NOTHING RETURNING 1";

/// Take over an expired row (in our transaction; waits on its row lock).
pub(super) const TAKE_OVER: &str = "UPDATE trl_idempotency \
     SET scope = $2, token = $3, fingerprint = $4, state = 0, record = NULL, \
         expires_at = statement_timestamp() + $5::bigint * interval '1 millisecond' \
     WHERE entry = $1 AND expires_at <= statement_timestamp() RETURNING 1";

pub(super) const READ: &str = "SELECT fingerprint, state, record, \
     (extract(epoch FROM (expires_at - statement_timestamp())) * 1000)::bigint \
     FROM trl_idempotency WHERE entry = $1";

/// The key's row while it is live (unexpired).
pub(super) const READ_LIVE: &str = "SELECT fingerprint, state, record, \
     (extract(epoch FROM (expires_at - statement_timestamp())) * 1000)::bigint \
     FROM trl_idempotency WHERE entry = $1 AND expires_at > statement_timestamp()";

/// The scope's unexpired rows as our transaction sees them (committed ones
/// and our own): count, record bytes, milliseconds until the oldest expires.
pub(super) const SCOPE_USE: &str =
    "SELECT count(*), coalesce(sum(octet_length(record)), 0)::bigint, \
     (extract(epoch FROM (min(expires_at) - statement_timestamp())) * 1000)::bigint \
     FROM trl_idempotency WHERE scope = $1 AND expires_at > statement_timestamp()";

pub(super) const RECORD: &str = "UPDATE trl_idempotency \
     SET state = 1, record = $3, expires_at = statement_timestamp() + $4::bigint * interval '1 millisecond' \
     WHERE entry = $1 AND token = $2 AND state = 0";

/// A completion re-sent after its commit: our record is there.
pub(super) const RECORDED: &str = "SELECT 1 FROM trl_idempotency \
     WHERE entry = $1 AND token = $2 AND state = 1 AND expires_at > statement_timestamp()";

pub(super) const SWEEP: &str = "DELETE FROM trl_idempotency WHERE ctid IN \
     (SELECT ctid FROM trl_idempotency WHERE expires_at < statement_timestamp() LIMIT $1 \
      FOR UPDATE SKIP LOCKED)";
