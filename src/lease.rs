//! The lease a request holds: what the handler may see ([`Lease`]) and the
//! drop guard that gives it back.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::runtime::Handle;

use crate::backend::{LockBackend, Token};
use crate::key::LockKey;

/// How the request was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseStatus {
    /// The lease was acquired: no other request with this key runs now.
    Locked,
    /// The backend failed and the layer is fail-open: running unlocked.
    FailOpen,
    /// A key part was missing and the layer skips locking in that case.
    Skipped,
}

/// The request's lease, as the handler sees it (a request extension; with the
/// `axum` feature also an extractor).
#[derive(Debug, Clone)]
pub struct Lease {
    key: Option<LockKey>,
    status: LeaseStatus,
    acquired_at: Instant,
    ttl: Duration,
    fence: Option<u64>,
}

impl Lease {
    pub(crate) fn new(
        key: Option<LockKey>,
        status: LeaseStatus,
        ttl: Duration,
        fence: Option<u64>,
    ) -> Self {
        Self {
            key,
            status,
            acquired_at: Instant::now(),
            ttl,
            fence,
        }
    }

    /// The key digest (absent when a key part was missing and locking skipped).
    pub fn key(&self) -> Option<&LockKey> {
        self.key.as_ref()
    }

    /// How the request was admitted.
    pub fn status(&self) -> LeaseStatus {
        self.status
    }

    /// `true` when this request holds the lease.
    pub fn is_locked(&self) -> bool {
        self.status == LeaseStatus::Locked
    }

    /// The lease's time to live as configured.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Time left before the lease expires on its own (zero when not locked).
    ///
    /// Measured from when the acquire answered, so it is a slight
    /// over-estimate by the network delay of that answer.
    pub fn remaining(&self) -> Duration {
        if self.is_locked() {
            self.ttl.saturating_sub(self.acquired_at.elapsed())
        } else {
            Duration::ZERO
        }
    }

    /// Fencing token, when the backend issues them.
    pub fn fence(&self) -> Option<u64> {
        self.fence
    }
}

pub(crate) type ReleaseFuture = Pin<Box<dyn Future<Output = bool> + Send + 'static>>;

/// Owns a held lease; gives it back on [`release`](Self::release) or, if
/// still armed, when dropped (on a spawned task: `Drop` never blocks).
pub(crate) struct LeaseGuard {
    backend: Arc<dyn LockBackend>,
    key: Bytes,
    digest: LockKey,
    token: Token,
    deadline: Duration,
    handle: Option<Handle>,
    armed: bool,
}

impl std::fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("key", &self.digest)
            .field("armed", &self.armed)
            .finish_non_exhaustive()
    }
}

impl LeaseGuard {
    pub(crate) fn new(
        backend: Arc<dyn LockBackend>,
        key: Bytes,
        digest: LockKey,
        token: Token,
        deadline: Duration,
    ) -> Self {
        Self {
            backend,
            key,
            digest,
            token,
            deadline,
            handle: Handle::try_current().ok(),
            armed: true,
        }
    }

    /// Release now; the future resolves when the backend answered (or the
    /// deadline passed) with whether our lease was still there.
    pub(crate) fn release(mut self) -> ReleaseFuture {
        self.armed = false;
        Box::pin(release_task(
            self.backend.clone(),
            self.key.clone(),
            self.digest,
            self.token,
            self.deadline,
        ))
    }

    /// Keep the lease until its TTL (debounce mode): nothing is released.
    pub(crate) fn keep_until_ttl(mut self) {
        self.armed = false;
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.armed = false;
        let task = release_task(
            self.backend.clone(),
            self.key.clone(),
            self.digest,
            self.token,
            self.deadline,
        );
        match &self.handle {
            Some(handle) => {
                drop(handle.spawn(task));
            }
            None => tracing::warn!(
                key = %self.digest,
                "lease dropped outside a Tokio runtime; it will expire after its TTL"
            ),
        }
    }
}

/// Compare-and-delete with a deadline. Failures are logged, never raised:
/// the TTL is the safety net.
pub(crate) async fn release_task(
    backend: Arc<dyn LockBackend>,
    key: Bytes,
    digest: LockKey,
    token: Token,
    deadline: Duration,
) -> bool {
    let started = Instant::now();
    match tokio::time::timeout(deadline, backend.release(&key, &token)).await {
        Ok(Ok(true)) => {
            tracing::debug!(key = %digest, outcome = "released", latency_us = started.elapsed().as_micros() as u64);
            true
        }
        Ok(Ok(false)) => {
            tracing::warn!(
                key = %digest,
                outcome = "lease_lost",
                "lease had already expired or was taken over before release; consider a longer TTL"
            );
            false
        }
        Ok(Err(e)) => {
            tracing::warn!(key = %digest, outcome = "release_failed", error = %e, "release failed; the lease expires after its TTL");
            false
        }
        Err(_) => {
            tracing::warn!(key = %digest, outcome = "release_failed", deadline_ms = deadline.as_millis() as u64, "release timed out; the lease expires after its TTL");
            false
        }
    }
}
