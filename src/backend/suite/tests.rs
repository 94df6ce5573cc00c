//! Every store of this crate through the public suite: in memory, and on
//! `redis-server`s of their own (the SQL stores run it in their crate,
//! `tower-redis-lock-sql`).

use crate::backend::Backend;
use std::time::Duration;

use super::*;
use bytes::Bytes;

use crate::backend::{Acquire, BackendFuture, Claim, ClaimTerms, EntryKey, RedlockBackend, Token};
use crate::MemoryBackend;

#[tokio::test]
async fn the_memory_store_passes_both_suites() {
    let store = MemoryBackend::new();
    Suite::lock_backend(&store).await;
    Suite::idempotency_backend(&store).await;
}

#[tokio::test]
async fn an_arc_of_a_store_passes_both_suites() {
    let store = std::sync::Arc::new(MemoryBackend::new());
    Suite::lock_backend(&store).await;
    Suite::idempotency_backend(&store).await;
    let store: std::sync::Arc<dyn LockBackend> = store;
    Suite::lock_backend(&*store).await;
}

#[tokio::test]
async fn redlock_over_memory_nodes_passes_the_lease_suite() {
    let nodes: Vec<MemoryBackend> = (0..3).map(|_| MemoryBackend::new()).collect();
    Suite::lock_backend(&RedlockBackend::new(nodes).expect("three nodes")).await;
}

/// A lease store whose release answers `true` whatever it finds.
#[derive(Debug)]
struct ReleasesAnything(MemoryBackend);

impl LockBackend for ReleasesAnything {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.0.acquire(key, token, ttl)
    }
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        drop(self.0.release(key, token)); // memory releases before returning
        BackendFuture::ready(Ok(true))
    }
    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        LockBackend::extend(&self.0, key, token, ttl)
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquire(key, token, ttl)
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.release(key, token)
    }

    fn watch(&self, _key: &Bytes) -> Option<BackendFuture<crate::backend::contract::Watch>> {
        None
    }

    fn native_calls(&self) -> Option<u64> {
        None
    }
}

impl Backend for ReleasesAnything {
    fn name(&self) -> &'static str {
        "releases-anything"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

#[tokio::test]
#[should_panic(expected = "LockBackend::release: a key nobody holds is not released")]
async fn a_store_that_breaks_the_lease_contract_fails_naming_the_rule() {
    Suite::lock_backend(&ReleasesAnything(MemoryBackend::new())).await;
}

/// An idempotency store whose abandon acts only when its future is polled.
#[derive(Debug)]
struct AbandonsWhenPolled(MemoryBackend);

impl IdempotencyBackend for AbandonsWhenPolled {
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        terms: &ClaimTerms,
    ) -> BackendFuture<Claim> {
        self.0.claim(key, token, fingerprint, terms)
    }
    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        self.0.complete(key, token, fingerprint, record, retention)
    }
    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        IdempotencyBackend::extend(&self.0, key, token, lease)
    }
    fn abandon(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        let (store, key, token) = (self.0.clone(), key.clone(), *token);
        BackendFuture::new(
            async move { IdempotencyBackend::abandon(&store, &key, &token, lease).await },
        )
    }

    fn claim_timeout(&self, deadline: Duration) -> Duration {
        deadline
    }

    fn hold(&self) -> Option<Box<dyn Send>> {
        None
    }

    fn feed(
        &self,
        _key_space: &crate::key::KeySpace,
    ) -> Option<BackendFuture<tokio::sync::mpsc::Receiver<(Bytes, Bytes)>>> {
        None
    }

    fn claimed(&self, _key: &EntryKey, _token: &Token, _extensions: &mut http::Extensions) {}

    fn is_transactional(&self) -> bool {
        false
    }
}

impl Backend for AbandonsWhenPolled {
    fn name(&self) -> &'static str {
        "abandons-when-polled"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

#[tokio::test(start_paused = true)]
#[should_panic(
    expected = "IdempotencyBackend::abandon: it takes effect even when its future is \
                           dropped unpolled"
)]
async fn a_store_that_breaks_the_replay_contract_fails_naming_the_rule() {
    Suite::idempotency_backend(&AbandonsWhenPolled(MemoryBackend::new())).await;
}

#[cfg(feature = "redis")]
mod on_redis {
    use super::*;
    use crate::RedisBackend;
    use tower_redis_lock_test_support::RedisServer;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_redis_store_passes_both_suites_and_the_resend_check() {
        let server = RedisServer::start();
        let store = RedisBackend::connect(&server.url())
            .await
            .expect("connect to the test redis-server");
        Suite::lock_backend(&store).await;
        Suite::idempotency_backend(&store).await;
        Suite::idempotency_backend_resent_commands(&store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_redis_store_without_its_local_table_passes_the_lease_suite() {
        let server = RedisServer::start();
        let store = RedisBackend::connect(&server.url())
            .await
            .expect("connect to the test redis-server")
            .local_dedup(false);
        Suite::lock_backend(&store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock_over_three_redis_servers_passes_the_lease_suite() {
        let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
        let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
        let store = RedlockBackend::connect(&urls)
            .await
            .expect("connect to the test redis-servers");
        Suite::lock_backend(&store).await;
    }
}
