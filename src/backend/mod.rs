//! Where leases and idempotency records live: the [`LockBackend`] trait,
//! [`MemoryBackend`], [`RedisBackend`] and [`RedlockBackend`] (a quorum of
//! independent nodes), and [`ReplayBackend`], what the idempotency layer
//! stores in. A shared backend is an `Arc` of one: `Arc<B>` and
//! `Arc<dyn LockBackend>` are backends too. [`RedisBackend`] answers
//! duplicates of leases this process holds from a local in-flight table,
//! without asking Redis.
//!
//! The contract (each step one round trip):
//!
//! - [`acquire`](LockBackend::acquire) sets `key = token` with an expiry if the
//!   key is free **or already holds `token`** (a client that re-sends the
//!   command after a lost reply must not conflict with itself), and otherwise
//!   reports the holder's remaining time.
//! - [`release`](LockBackend::release) and [`extend`](LockBackend::extend)
//!   act only if the key still holds `token` (compare-and-act).
//!
//! Deadlines are applied by the layer around every call, so a backend does
//! not need its own (but may have one).

#[cfg(feature = "redis")]
mod local;
mod memory;
#[cfg(feature = "redis")]
pub(crate) mod redis;
mod redlock;

pub use memory::MemoryBackend;
#[cfg(feature = "redis")]
pub use redis::RedisBackend;
pub use redlock::RedlockBackend;
pub use crate::replay::ReplayBackend;

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

/// A boxed, `Send` future returned by backends.
pub type BackendFuture<T> = Pin<Box<dyn Future<Output = Result<T, BackendError>> + Send + 'static>>;

/// Storage for leases. Implemented by [`MemoryBackend`] and [`RedisBackend`];
/// implement it to put leases elsewhere.
pub trait LockBackend: Send + Sync + fmt::Debug + 'static {
    /// Take the lease on `key` for `ttl` if it is free or already ours.
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire>;

    /// Like [`acquire`](Self::acquire), and also issue a fencing token in the
    /// same round trip: a number per key that only grows (a fresh lease gets
    /// the next number; a re-sent acquire that finds our own token gets the
    /// number it already had). Used when the layer has
    /// [`fencing`](crate::RedisLockLayer::fencing) on.
    ///
    /// The default forwards to `acquire` and issues no fence (`fence: None`);
    /// a backend wrapper should forward this method too.
    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquire(key, token, ttl)
    }

    /// Delete `key` if it still holds `token`. `Ok(false)`: it did not (expired
    /// or taken over).
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool>;

    /// Reset the expiry of `key` to `ttl` if it still holds `token`.
    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool>;

    /// A short name for logs and start-up lines (`"memory"`, `"redis"`).
    fn name(&self) -> &'static str;

    /// `true` when keys never leave this process (then an unkeyed digest
    /// reveals nothing and no secret warning is logged). Default `false`.
    fn is_in_process(&self) -> bool {
        false
    }
}

impl<T: LockBackend + ?Sized> LockBackend for Arc<T> {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        (**self).acquire(key, token, ttl)
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        (**self).acquire_fenced(key, token, ttl)
    }

    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        (**self).release(key, token)
    }

    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        (**self).extend(key, token, ttl)
    }

    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn is_in_process(&self) -> bool {
        (**self).is_in_process()
    }
}

/// Outcome of [`LockBackend::acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquire {
    /// The lease is ours.
    Acquired {
        /// Fencing token, when the backend issues one.
        fence: Option<u64>,
    },
    /// Someone else holds it.
    Held {
        /// How long the holder's lease has left, if known.
        retry_after: Option<Duration>,
    },
}

/// The owner's secret for one lease: 128 bits from a CSPRNG.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token([u8; 16]);

impl Token {
    /// A fresh random token from the operating system's CSPRNG.
    ///
    /// # Panics
    /// If the operating system has no random source to give (it always has
    /// one on the platforms Tokio runs on).
    pub fn generate() -> Self {
        let mut bytes = [0u8; 16];
        if let Err(e) = getrandom::fill(&mut bytes) {
            panic!("tower-redis-lock: the OS random source failed: {e}");
        }
        Self(bytes)
    }

    /// Build a token from raw bytes (tests, custom backends).
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// The token as 32 lowercase hex characters (how it is stored in Redis).
    pub fn to_hex(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        crate::key::hex_encode(&self.0, &mut out);
        out
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only a prefix: enough to correlate logs, not to forge a release.
        let hex = self.to_hex();
        write!(f, "Token({}..)", String::from_utf8_lossy(&hex[..8]))
    }
}

/// What went wrong talking to a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BackendErrorKind {
    /// The call did not finish within the deadline.
    Timeout,
    /// No connection, connection lost, or the server refused work (loading,
    /// busy, read-only replica, out of memory).
    Unavailable,
    /// The server answered something the backend did not expect.
    Protocol,
    /// Anything else.
    Other,
}

/// Error from a backend call.
#[derive(Debug)]
pub struct BackendError {
    kind: BackendErrorKind,
    message: String,
    source: Option<Box<dyn StdError + Send + Sync>>,
}

impl BackendError {
    /// A new error saying `message` (for backends of your own).
    pub fn new(message: impl Into<String>) -> Self {
        Self::with_kind(BackendErrorKind::Other, message)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_differ_and_debug_hides_most() {
        let a = Token::generate();
        let b = Token::generate();
        assert_ne!(a, b);
        let dbg = format!("{a:?}");
        let hex = a.to_hex();
        assert!(!dbg.contains(std::str::from_utf8(&hex).unwrap()));
    }

    #[test]
    fn error_display_names_cause() {
        let e = BackendError::timeout(Duration::from_millis(200));
        assert!(e.is_timeout());
        assert!(!BackendError::new("custom").is_timeout());
        assert!(e.to_string().contains("200 ms"));
    }
}
