//! The session check's two connections on sqlx.

use sqlx::Row;
use tower_redis_lock::backend::BackendError;

use super::Conn;
use crate::pg_sql::SessionSteps;
use crate::sqlx_conn::sqlx_error;

/// Two pooled connections, `a` and `b`, for the session check.
pub(super) struct Two(pub(super) Conn, pub(super) Conn);

impl SessionSteps for Two {
    async fn step(&mut self, on_a: bool, sql: &'static str) -> Result<Option<i32>, BackendError> {
        let conn = if on_a { &mut self.0 } else { &mut self.1 };
        let row = sqlx::raw_sql(sql)
            .fetch_optional(conn.get())
            .await
            .map_err(|e| sqlx_error("session check", e))?;
        row.map(|r| r.try_get::<i32, _>(0))
            .transpose()
            .map_err(|e| sqlx_error("session check", e))
    }
}
