//! [`Isolation`]: the level a PostgreSQL store opens the handler's
//! transaction at, when it is told one.

/// The isolation level a store opens the handler's transaction at, when it
/// is told one (the default is the connection's own): see
/// `PostgresBackend::isolation` and `SqlxPostgresBackend::isolation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Isolation {
    /// `READ COMMITTED`.
    ReadCommitted,
    /// `REPEATABLE READ`.
    RepeatableRead,
    /// `SERIALIZABLE`.
    Serializable,
}

impl Isolation {
    /// The statement that opens a transaction at this level.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlx-postgres")),
        allow(dead_code)
    )]
    pub(crate) fn begin(self) -> &'static str {
        match self {
            Self::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Self::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Self::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }
}
