use super::*;

#[test]
fn default_policy() {
    // 408 included: below this layer the body has arrived whole (the
    // layer's own 408 comes before any claim), so a 408 there is a timeout
    // that cut a handler that may have charged.
    for ok in [200, 201, 204, 303, 400, 402, 404, 408, 422, 500, 502, 503] {
        assert!(
            default_store_when(StatusCode::from_u16(ok).unwrap()),
            "{ok}"
        );
    }
    for no in [101, 409, 429] {
        assert!(
            !default_store_when(StatusCode::from_u16(no).unwrap()),
            "{no}"
        );
    }
}

#[test]
#[should_panic(expected = "\"x request id\" is not a valid header name to fingerprint")]
fn an_invalid_fingerprint_header_is_named_at_start_up() {
    let layer = IdempotencyLayer::new(crate::MemoryBackend::new(), crate::key::RequestMethod);
    let _ = layer.fingerprint_header("x request id");
}

/// Two layers made from one by different key spaces each hear their own
/// key space's publications: each its own subscription (both shared the
/// first one's feed, subscribed to the first key space only, before).
#[tokio::test]
async fn layers_of_two_key_spaces_made_from_one_have_a_feed_each() {
    use crate::key::KeySpace;
    let server = tower_redis_lock_test_support::RedisServer::start();
    let backend = crate::RedisBackend::connect(&server.url()).await.unwrap();
    let base = IdempotencyLayer::new(backend, crate::key::RequestMethod)
        .join_timeout(std::time::Duration::from_secs(1));
    let a = base.clone().key_space(KeySpace::new("a"));
    let b = base.key_space(KeySpace::new("b"));
    let feed_a = crate::idempotency::joining::feed_of(&a.config)
        .await
        .expect("a feed");
    let feed_b = crate::idempotency::joining::feed_of(&b.config)
        .await
        .expect("a feed");
    assert!(
        !Arc::ptr_eq(&feed_a, &feed_b),
        "one feed for two key spaces"
    );
    let patterns = server.cli(&["PUBSUB", "NUMPAT"]);
    assert_eq!(patterns.trim(), "2", "a pattern per key space");
}
