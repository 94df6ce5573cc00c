//! The batcher against a real `redis-server`: a lane whose own connection
//! is refused at login sends its calls through fred instead.

use std::time::Duration;

use super::*;
use crate::backend::Token;
use crate::RedisBackend;
use tower_redis_lock_test_support::RedisServer;

/// A fred client can log in some way the lease calls' own connection does
/// not (fred's credential provider, which this crate does not compile):
/// stood in for here by a wrong password on that connection alone. The
/// calls still go out, through fred, and the lane stays there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_login_of_the_own_connection_falls_back_to_fred() {
    let server = RedisServer::start();
    server.cli(&["ACL", "SETUSER", "app", "on", ">right", "~*", "+@all"]);
    let url = format!("redis://app:right@127.0.0.1:{}", server.port());
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let mut batcher = Batcher::of(backend.client(), BATCH_TIMEOUT).expect("a batcher");
    let lane = &mut batcher.lanes[0];
    lane.direct = lane.direct.take().map(|t| t.with_password("wrong"));

    for i in 0..3 {
        let key = Key::from(format!("trl:{{fallback{i}}}"));
        let job = Job::new(
            Op::Acquire,
            &super::super::scripts::ACQUIRE,
            key,
            Token::generate().to_hex(),
            Some(5_000),
            None,
        );
        let reply = batcher.submit(job).ok().expect("queued");
        let answer = tokio::time::timeout(Duration::from_secs(5), reply)
            .await
            .expect("answered")
            .expect("not dropped");
        assert_eq!(
            answer.expect("acquired through fred"),
            Value::Integer(super::super::scripts::ACQUIRED)
        );
    }
    assert_eq!(server.dbsize(), 3, "every acquire landed");
}
