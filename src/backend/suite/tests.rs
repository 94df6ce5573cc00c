use super::*;
use crate::MemoryBackend;

#[tokio::test]
async fn the_memory_store_passes() {
    every_store_check(&MemoryBackend::new()).await;
}

#[tokio::test]
async fn an_arc_of_a_store_passes() {
    every_store_check(&std::sync::Arc::new(MemoryBackend::new())).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn the_redis_store_passes() {
    let server = tower_redis_lock_test_support::RedisServer::start();
    let store = crate::RedisBackend::connect(&server.url())
        .await
        .expect("connect to the test redis-server");
    every_store_check(&store).await;
    abandon_before_claim_leaves_a_tombstone(&store).await;
}
