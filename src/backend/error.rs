//! [`BackendError`]: what a store answers when it could not answer.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

/// What went wrong talking to a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BackendErrorKind {
    /// The call did not finish within the deadline.
    Timeout,
    /// No connection, connection lost, or the server refused work (loading,
    /// busy, read-only replica, out of memory).
    Unavailable,
    /// The server answered something the backend did not expect.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // built by the Redis and SQL stores
    Protocol,
    /// The request's transaction is not the one its claim opened (the
    /// handler ended it itself).
    TransactionEnded,
    /// Whether the call took effect is not known yet (a transactional
    /// store's `COMMIT` whose answer was lost while the database stays
    /// unreachable).
    OutcomeUnknown,
    /// Anything else.
    Other,
}

/// Error from a backend call.
#[derive(Debug)]
pub struct BackendError {
    pub(crate) kind: BackendErrorKind,
    message: String,
    source: Option<Box<dyn StdError + Send + Sync>>,
}

impl BackendError {
    /// A new error saying `message` (for backends of your own).
    pub fn new(message: impl Into<String>) -> Self {
        Self::with_kind(BackendErrorKind::Other, message)
    }

    /// A new error saying the store could not be reached or refused work
    /// now (no connection, a connection lost, a pool exhausted, a server
    /// loading or read-only): what a store of your own answers when it
    /// cannot talk to its database.
    ///
    /// ```
    /// use tower_redis_lock::backend::BackendError;
    /// let e = BackendError::unavailable("postgres pool: no connection");
    /// assert!(e.to_string().contains("no connection"));
    /// ```
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::with_kind(BackendErrorKind::Unavailable, message)
    }

    /// A new error saying the store answered something it should never
    /// answer (a reply of the wrong shape, a row in a state the store never
    /// writes): what a store of your own answers when what it reads back
    /// breaks its own format. Never an answer the layer acts on.
    ///
    /// ```
    /// use tower_redis_lock::backend::BackendError;
    /// let e = BackendError::protocol("a malformed row (state 7)");
    /// assert!(e.to_string().contains("malformed"));
    /// ```
    pub fn protocol(message: impl Into<String>) -> Self {
        Self::with_kind(BackendErrorKind::Protocol, message)
    }

    /// A new error of `kind`.
    pub(crate) fn with_kind(kind: BackendErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attach the underlying error.
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// The call exceeded `deadline`.
    pub fn timeout(deadline: Duration) -> Self {
        Self::with_kind(
            BackendErrorKind::Timeout,
            format!("no answer within the {} ms deadline", deadline.as_millis()),
        )
    }

    /// `true` when the call did not finish within its deadline.
    pub fn is_timeout(&self) -> bool {
        self.kind == BackendErrorKind::Timeout
    }

    /// The request's transaction is not the one its claim opened (the
    /// handler ran `COMMIT` or `ROLLBACK` itself) and the key is final:
    ///
    /// - from a transactional store's
    ///   [`complete`](super::IdempotencyBackend::complete): the store keeps
    ///   the key held, and the layer calls `complete` again with a final
    ///   record (the `transaction-ended` answer), which the store writes
    ///   outside any transaction;
    /// - from its [`abandon`](super::IdempotencyBackend::abandon): the
    ///   store did not free the key (something of the request committed)
    ///   and made it final itself, so that a later claim answers
    ///   [`Claim::Ended`](super::contract::Claim::Ended); the layer answers
    ///   `transaction-ended`.
    ///
    /// Either way the key never runs again.
    pub fn transaction_ended(message: impl Into<String>) -> Self {
        Self::with_kind(BackendErrorKind::TransactionEnded, message)
    }

    /// `true` for [`transaction_ended`](Self::transaction_ended).
    pub fn is_transaction_ended(&self) -> bool {
        self.kind == BackendErrorKind::TransactionEnded
    }

    /// Whether the call took effect is not known, and the store could not
    /// find out within its bound (a `COMMIT` whose answer was lost, the
    /// database unreachable since). The store keeps the key claimed until
    /// the outcome is known (a retry is answered in flight, or replays
    /// once the commit is known to have landed), never free for a second
    /// run; the layer answers 503 `outcome-unknown`.
    ///
    /// ```
    /// use tower_redis_lock::backend::BackendError;
    /// let e = BackendError::outcome_unknown("commit answer lost");
    /// assert!(e.is_outcome_unknown() && !e.is_timeout());
    /// ```
    pub fn outcome_unknown(message: impl Into<String>) -> Self {
        Self::with_kind(BackendErrorKind::OutcomeUnknown, message)
    }

    /// `true` for [`outcome_unknown`](Self::outcome_unknown).
    pub fn is_outcome_unknown(&self) -> bool {
        self.kind == BackendErrorKind::OutcomeUnknown
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("lock backend: ")?;
        f.write_str(&self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl StdError for BackendError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}
