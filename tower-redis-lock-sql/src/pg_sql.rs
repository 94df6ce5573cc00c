//! The PostgreSQL statements of the SQL protocol, shared by the
//! tokio-postgres and sqlx adapters.

/// The schema (idempotent), under a transaction-scoped advisory lock so
/// that instances starting together do not race.
pub(crate) const SCHEMA: &str = "
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
pub(crate) const PRESENT: &str = "SELECT to_regclass('trl_idempotency') IS NOT NULL \
     AND to_regclass('trl_idempotency_scope') IS NOT NULL \
     AND to_regclass('trl_idempotency_expiry') IS NOT NULL";

/// The key's live row (if any) and its scope's use: one statement, outside
/// any transaction. A claim row (state 0) is returned however old: it was
/// committed by its handler, and the key is final. `$1` entry, `$2` scope.
pub(crate) const LOOK: &str = "SELECT l.fingerprint, l.state, l.record, l.left_ms, s.n, s.bytes, s.oldest \
     FROM (SELECT count(*)::bigint AS n, coalesce(sum(octet_length(record)), 0)::bigint AS bytes, \
           (extract(epoch FROM (min(expires_at) - statement_timestamp())) * 1000)::bigint AS oldest \
           FROM trl_idempotency WHERE scope = $2 AND expires_at > statement_timestamp()) s \
     LEFT JOIN (SELECT fingerprint, state, record, \
           (extract(epoch FROM (expires_at - statement_timestamp())) * 1000)::bigint AS left_ms \
           FROM trl_idempotency WHERE entry = $1 \
             AND (expires_at > statement_timestamp() OR state = 0)) l ON true";

/// The key's hold: a session-level advisory lock, never waiting.
pub(crate) const HOLD: &str = "SELECT pg_try_advisory_lock($1)";

/// Let go of the hold: `false` when this session did not hold it.
pub(crate) const UNHOLD: &str = "SELECT pg_advisory_unlock($1)";

/// What an unlock that found no lock means: the claim's statements did not
/// all run on one server session.
pub(crate) fn not_held(store: &str) -> tower_redis_lock::backend::BackendError {
    tracing::error!(store, "the key's advisory lock was not held by the session that let go of it: is a transaction-mode pooler (pgbouncer pool_mode=transaction) between the store and PostgreSQL?");
    tower_redis_lock::backend::BackendError::protocol(format!(
        "{store}: the key's advisory lock was not held by this session: the claim's statements \
         ran on different server sessions (a transaction-mode pooler such as pgbouncer \
         pool_mode=transaction?); connect the store directly or through a session-mode pool"
    ))
}

/// A duplicate's bounded wait for the holder, outside any handler's
/// transaction: one simple query, its own implicit transaction (so the
/// `SET LOCAL` ends with it, and the lock is let go at once).
pub(crate) fn wait(lock_id: i64, bound_ms: i64) -> String {
    // `lock_timeout` takes at most `INT_MAX` ms (about 24.8 days), and 0
    // would mean no bound at all.
    let bound_ms = bound_ms.clamp(1, i64::from(i32::MAX));
    format!("SET LOCAL lock_timeout = '{bound_ms}ms'; SELECT pg_advisory_xact_lock({lock_id})")
}

/// The claim row, in the handler's transaction; returns the transaction's
/// id (the marker). `$1` entry, `$2` scope, `$3` token, `$4` fingerprint,
/// `$5` lease ms.
pub(crate) const INSERT: &str = "INSERT INTO trl_idempotency \
     (entry, scope, token, fingerprint, state, record, expires_at) \
     VALUES ($1, $2, $3, $4, 0, NULL, statement_timestamp() + $5::bigint * interval '1 millisecond') \
     ON CONFLICT (entry) DO NOTHING RETURNING pg_current_xact_id()::text";

/// Take over an expired row, in the handler's transaction (never a claim
/// row a handler committed: that key is final).
pub(crate) const TAKE_OVER: &str = "UPDATE trl_idempotency \
     SET scope = $2, token = $3, fingerprint = $4, state = 0, record = NULL, \
         expires_at = statement_timestamp() + $5::bigint * interval '1 millisecond' \
     WHERE entry = $1 AND expires_at <= statement_timestamp() AND state <> 0 \
     RETURNING pg_current_xact_id()::text";

/// The record, in the handler's transaction, only if it is still the one
/// the claim opened. `$1` entry, `$2` token, `$3` record, `$4` retention
/// ms, `$5` the marker.
pub(crate) const RECORD: &str = "UPDATE trl_idempotency \
     SET state = 1, record = $3, expires_at = statement_timestamp() + $4::bigint * interval '1 millisecond' \
     WHERE entry = $1 AND token = $2 AND state = 0 \
       AND pg_current_xact_id_if_assigned()::text = $5";

/// A final record written outside any transaction (the handler ended its
/// own): `$1` entry, `$2` scope, `$3` token, `$4` fingerprint, `$5` record,
/// `$6` retention ms.
pub(crate) const FINALIZE: &str = "INSERT INTO trl_idempotency \
     (entry, scope, token, fingerprint, state, record, expires_at) \
     VALUES ($1, $2, $3, $4, 1, $5, statement_timestamp() + $6::bigint * interval '1 millisecond') \
     ON CONFLICT (entry) DO UPDATE SET scope = EXCLUDED.scope, token = EXCLUDED.token, \
         fingerprint = EXCLUDED.fingerprint, state = 1, record = EXCLUDED.record, \
         expires_at = EXCLUDED.expires_at";

/// A completion re-sent after its commit: our record is there.
pub(crate) const RECORDED: &str = "SELECT 1 FROM trl_idempotency \
     WHERE entry = $1 AND token = $2 AND state = 1 AND expires_at > statement_timestamp()";

/// One batch of the sweep, by the expiry index; rows a claim is taking
/// over are skipped, never waited on, and so are claim rows a handler
/// committed (the next claim makes them final).
pub(crate) const SWEEP: &str = "DELETE FROM trl_idempotency WHERE ctid IN \
     (SELECT ctid FROM trl_idempotency WHERE expires_at < statement_timestamp() AND state <> 0 \
      LIMIT $1 FOR UPDATE SKIP LOCKED)";

/// Make the key final without a record (state 2), outside any
/// transaction: our claim row, one its handler committed and left, or an
/// expired row (a claim that took it over inside the handler's
/// transaction, which the handler rolled back, left it there; under our
/// hold no other claim can be taking it). One row, or an error.
/// `$1` entry, `$2` scope, `$3` token, `$4` fingerprint, `$5` retention ms.
pub(crate) const END: &str = "INSERT INTO trl_idempotency \
     (entry, scope, token, fingerprint, state, record, expires_at) \
     VALUES ($1, $2, $3, $4, 2, NULL, statement_timestamp() + $5::bigint * interval '1 millisecond') \
     ON CONFLICT (entry) DO UPDATE SET scope = EXCLUDED.scope, token = EXCLUDED.token, \
         fingerprint = EXCLUDED.fingerprint, state = 2, record = NULL, \
         expires_at = EXCLUDED.expires_at \
     WHERE trl_idempotency.token = EXCLUDED.token OR trl_idempotency.state = 0 \
         OR trl_idempotency.expires_at <= statement_timestamp()";

/// Whether the transaction is still the claim's (`$1`, the claim's
/// transaction id), and that transaction's status: `committed`,
/// `aborted` or `in progress` (PostgreSQL >= 13).
pub(crate) const FATE: &str =
    "SELECT coalesce(pg_current_xact_id_if_assigned()::text = $1, false), \
     pg_xact_status($1::text::xid8)::text";

/// A transaction's status, asked on a connection of its own: `$1` its id.
pub(crate) const STATUS: &str = "SELECT pg_xact_status($1::text::xid8)::text";

/// What the outcome of a `COMMIT` whose answer was lost is, by `STATUS`.
pub(crate) fn outcome_of(status: Option<&str>) -> Option<bool> {
    match status {
        Some("committed") => Some(true),
        Some("aborted") => Some(false),
        _ => None,
    }
}

/// The handler's transaction: the store's `BEGIN` (or `begin`), and no
/// `idle_in_transaction_session_timeout` for it: a handler may wait on a
/// payment provider longer than that, and the session's end would take
/// the key's hold with it while the handler still runs. Then the
/// [`CLAIM_SAVEPOINT`], which tells a failed transaction apart.
pub(crate) fn begin_statement(begin: Option<&str>) -> String {
    format!(
        "{}; SET LOCAL idle_in_transaction_session_timeout = 0; SAVEPOINT {CLAIM_SAVEPOINT}",
        begin.unwrap_or("BEGIN")
    )
}

/// A savepoint set as the handler's transaction opens. A transaction that
/// a statement failed in can run nothing but `ROLLBACK` and `ROLLBACK TO
/// SAVEPOINT`, and PostgreSQL clears its id and its locks at the failure:
/// `ROLLBACK TO` this savepoint is the one question such a transaction
/// still answers, whether it is the one the claim opened. A handler that
/// ended that transaction itself, charged in autocommit, then opened one
/// of its own that failed, would otherwise read as "nothing committed",
/// and the key would be freed for the charge to run again. Its cost: the
/// transaction's writes get a subtransaction id (one of the 64 PostgreSQL
/// caches per transaction before its snapshots overflow).
pub(crate) const CLAIM_SAVEPOINT: &str = "tower_redis_lock_claim";

/// `ROLLBACK TO` the [`CLAIM_SAVEPOINT`].
pub(crate) const BACK_TO_CLAIM: &str = "ROLLBACK TO SAVEPOINT tower_redis_lock_claim";

/// `BACK_TO_CLAIM` in a transaction without the savepoint: not the claim's.
pub(crate) const NO_SUCH_SAVEPOINT: &str = "3B001";

/// `BACK_TO_CLAIM` with no transaction open (a statement failed in
/// autocommit after the handler ended the claim's): not the claim's.
pub(crate) const NO_TRANSACTION: &str = "25P01";

/// Whether `BACK_TO_CLAIM`'s error says the transaction is not the claim's.
pub(crate) fn not_the_claims(code: Option<&str>) -> bool {
    matches!(code, Some(NO_SUCH_SAVEPOINT | NO_TRANSACTION))
}

/// The lowest server this protocol runs on (`pg_current_xact_id`,
/// `pg_xact_status` on `xid8`).
pub(crate) const MIN_SERVER_VERSION: i32 = 130000;

/// The server's version number.
pub(crate) const SERVER_VERSION: &str = "SELECT current_setting('server_version_num')::int";

/// The error for a server older than [`MIN_SERVER_VERSION`].
pub(crate) fn too_old(version: i32) -> Option<tower_redis_lock::backend::BackendError> {
    (version < MIN_SERVER_VERSION).then(|| {
        tower_redis_lock::backend::BackendError::new(format!(
            "PostgreSQL {}.{} is too old for the idempotency store: it needs 13 or later \
             (pg_current_xact_id, pg_xact_status)",
            version / 10000,
            version % 10000 / 100
        ))
    })
}

/// SQLSTATEs of a transaction the database rolled back on its own and that
/// may succeed when run again: serialization failure, deadlock.
pub(crate) fn is_retryable(code: &str) -> bool {
    code == "40001" || code == "40P01"
}

/// A statement refused because the transaction is already aborted.
pub(crate) const IN_FAILED_TRANSACTION: &str = "25P02";

/// How the fate of a claim's transaction reads from [`FATE`]: still ours,
/// or ended by the handler (whatever it committed: PostgreSQL cannot see
/// what a handler wrote after its own `ROLLBACK`, so a handler that ends
/// the transaction either way makes the key final).
pub(crate) fn fate_of(ours: bool) -> crate::adapter::Fate {
    match ours {
        true => crate::adapter::Fate::Ours,
        false => crate::adapter::Fate::Ended,
    }
}

/// How long the session check waits for a second pooled connection (a
/// pool of one cannot be checked).
pub(crate) const SECOND_CONNECTION: std::time::Duration = std::time::Duration::from_secs(1);

/// Rounds of the session check.
pub(crate) const SESSION_ROUNDS: usize = 3;

/// One round of the session check on two pooled connections `a` and `b`:
/// the steps, in order, and the connection each runs on. A `pid` step
/// reads the session's server process. One server session per connection
/// reads `b` the same in steps 1 and 5, `a` the same in 2 and 4, and the
/// two apart; a transaction-mode pooler hands a connection whichever
/// session is idle (the one the other just let go of).
pub(crate) const SESSION_STEPS: [(bool, &str); 6] = [
    (false, "BEGIN; SELECT pg_backend_pid()"),
    (true, "SELECT pg_backend_pid()"),
    (false, "COMMIT"),
    (true, "BEGIN; SELECT pg_backend_pid()"),
    (false, "SELECT pg_backend_pid()"),
    (true, "COMMIT"),
];

/// What one round of [`SESSION_STEPS`] read: `b` at steps 1 and 5, `a`
/// at 2 and 4.
fn one_session_each(b: [i32; 2], a: [i32; 2]) -> bool {
    b[0] == b[1] && a[0] == a[1] && a[0] != b[0]
}

/// Two pooled connections of a client, as the session check uses them.
pub(crate) trait SessionSteps {
    /// Run `sql` (a simple query: no prepared statement, which a
    /// transaction-mode pooler may not keep) on connection `a` (`on_a`) or
    /// `b`: the server process it read, if it read one.
    fn step(
        &mut self,
        on_a: bool,
        sql: &'static str,
    ) -> impl std::future::Future<
        Output = Result<Option<i32>, tower_redis_lock::backend::BackendError>,
    > + Send;
}

/// [`SESSION_ROUNDS`] rounds of [`SESSION_STEPS`] on `conns`: whether each
/// connection was one server session throughout.
pub(crate) async fn sessions_apart(
    conns: &mut impl SessionSteps,
) -> Result<bool, tower_redis_lock::backend::BackendError> {
    let mut fine = true;
    for _ in 0..SESSION_ROUNDS {
        let (mut seen_a, mut seen_b) = (Vec::new(), Vec::new());
        for (on_a, sql) in SESSION_STEPS {
            let pid = conns.step(on_a, sql).await?;
            match on_a {
                true => seen_a.extend(pid),
                false => seen_b.extend(pid),
            }
        }
        fine &= match (<[i32; 2]>::try_from(seen_b), <[i32; 2]>::try_from(seen_a)) {
            (Ok(b), Ok(a)) => one_session_each(b, a),
            _ => {
                return Err(tower_redis_lock::backend::BackendError::protocol(
                    "postgres session check: no pid",
                ))
            }
        };
    }
    Ok(fine)
}

/// PostgreSQL's refusals that pass (`Adapter::is_transient`): a lock not
/// had within `lock_timeout` (`55P03`), a statement cancelled by
/// `statement_timeout` (`57014`), a serialization failure (`40001`), a
/// deadlock (`40P01`).
#[cfg_attr(
    not(any(feature = "postgres", feature = "sqlx-postgres")),
    allow(dead_code)
)]
pub(crate) fn is_transient(sqlstate: &str) -> bool {
    matches!(sqlstate, "55P03" | "57014" | "40001" | "40P01")
}
