//! Test stores for the lock layer's unit tests.

use std::time::Duration;

use bytes::Bytes;

use crate::backend::contract::{Acquire, Watch};
use crate::backend::{Backend, BackendFuture, LockBackend, MemoryBackend, Token};

/// A `MemoryBackend` whose answers come as futures, not in the call: the
/// path of a store that is not in process (Redis), with the table to look
/// at.
#[derive(Debug, Clone)]
pub(crate) struct Deferred(pub(crate) MemoryBackend);

fn later<T: Send + 'static>(now: BackendFuture<T>) -> BackendFuture<T> {
    BackendFuture::new(async move {
        tokio::task::yield_now().await;
        now.await
    })
}

impl LockBackend for Deferred {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        later(self.0.acquire(key, token, ttl))
    }
    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        later(self.0.acquire_fenced(key, token, ttl))
    }
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        later(self.0.release(key, token))
    }
    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        later(self.0.release_notify(key, token))
    }
    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        later(self.0.extend(key, token, ttl))
    }
    fn watch(&self, key: &Bytes) -> Option<BackendFuture<Watch>> {
        self.0.watch(key).map(later)
    }

    fn native_calls(&self) -> Option<u64> {
        self.0.native_calls()
    }
}

impl Backend for Deferred {
    fn name(&self) -> &'static str {
        "deferred"
    }
    fn is_in_process(&self) -> bool {
        false
    }
    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

/// A `MemoryBackend` whose renewals (`extend`) after the first `answered`
/// never answer: a store that stalls on a renewal (a mock, because the
/// moment a stalled renewal outlives the lease is a race on a real server;
/// with paused time it is exact here).
#[derive(Debug, Clone)]
pub(crate) struct StallsRenewals {
    pub(crate) memory: MemoryBackend,
    pub(crate) answered: usize,
    pub(crate) calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl LockBackend for StallsRenewals {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.memory.acquire(key, token, ttl)
    }
    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.memory.acquire_fenced(key, token, ttl)
    }
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.memory.release(key, token)
    }
    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.memory.release_notify(key, token)
    }
    fn watch(&self, key: &Bytes) -> Option<BackendFuture<Watch>> {
        self.memory.watch(key)
    }
    fn native_calls(&self) -> Option<u64> {
        None
    }
    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        match n < self.answered {
            true => self.memory.extend(key, token, ttl),
            false => BackendFuture::new(std::future::pending()),
        }
    }
}

impl Backend for StallsRenewals {
    fn name(&self) -> &'static str {
        "stalls-renewals"
    }
    fn is_in_process(&self) -> bool {
        false
    }
    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}
