//! Running the protocol's statements on a pooled tokio-postgres
//! connection, and reading their rows and errors.

use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;
use tower_redis_lock::backend::BackendError;

use super::Conn;
use crate::adapter::{Found, Look};

pub(crate) fn pg_error(what: &str, e: tokio_postgres::Error) -> BackendError {
    let message = format!("postgres {what}");
    let error = if e.is_closed() || e.code().is_none() {
        BackendError::unavailable(message)
    } else {
        BackendError::new(message)
    };
    error.with_source(e)
}

pub(crate) fn code(e: &tokio_postgres::Error) -> Option<&str> {
    e.code().map(SqlState::code)
}

/// One parameterized statement, prepared once per connection (deadpool's
/// statement cache).
pub(crate) async fn query(
    conn: &Conn,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, tokio_postgres::Error> {
    let client = conn.client();
    let statement = client.prepare_cached(sql).await?;
    client.query(&statement, params).await
}

pub(crate) async fn execute(
    conn: &Conn,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64, tokio_postgres::Error> {
    let client = conn.client();
    let statement = client.prepare_cached(sql).await?;
    client.execute(&statement, params).await
}

pub(crate) fn look_of(row: &Row) -> Result<Look, tokio_postgres::Error> {
    let state: Option<i16> = row.try_get(1)?;
    let live = match state {
        Some(state) => Some(Found {
            fingerprint: row.try_get(0)?,
            state,
            record: row.try_get(2)?,
            left_ms: row.try_get(3)?,
        }),
        None => None,
    };
    Ok(Look {
        live,
        count: row.try_get(4)?,
        bytes: row.try_get(5)?,
        oldest_ms: row.try_get(6)?,
    })
}

/// Two pooled connections, `a` and `b`, for the session check.
pub(crate) struct Two(pub(crate) Conn, pub(crate) Conn);

impl crate::pg_sql::SessionSteps for Two {
    async fn step(&mut self, on_a: bool, sql: &'static str) -> Result<Option<i32>, BackendError> {
        let conn = if on_a { &self.0 } else { &self.1 };
        let messages = conn
            .client()
            .simple_query(sql)
            .await
            .map_err(|e| pg_error("session check", e))?;
        Ok(messages.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => {
                row.get(0).and_then(|pid| pid.parse().ok())
            }
            _ => None,
        }))
    }
}
