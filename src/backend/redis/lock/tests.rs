use std::time::Duration;

use super::RedisBackend;

/// The batch timeout survives turning batching off and on again, in either
/// order of the builder calls (it used to fall back to 1 s when set while
/// batching was off). A configuration check: the client is never
/// connected, no Redis is needed to read what the backend was told.
#[test]
fn the_batch_timeout_is_kept_while_batching_is_off() {
    let client = || {
        let config = fred::types::config::Config::from_url("redis://127.0.0.1:1").expect("url");
        fred::clients::Client::new(config, None, None, None)
    };
    let timeout = |b: &RedisBackend| b.dispatch.batching().then(|| b.dispatch.timeout());
    let half = Duration::from_millis(500);
    let set_while_off = RedisBackend::new(client())
        .auto_pipeline(false)
        .batch_timeout(half)
        .auto_pipeline(true);
    assert_eq!(timeout(&set_while_off), Some(half));
    let set_then_off_on = RedisBackend::new(client())
        .batch_timeout(half)
        .auto_pipeline(false)
        .auto_pipeline(true);
    assert_eq!(timeout(&set_then_off_on), Some(half));
    let default = RedisBackend::new(client());
    assert_eq!(
        timeout(&default),
        Some(super::super::dispatch::BATCH_TIMEOUT)
    );
    assert_eq!(timeout(&default.auto_pipeline(false)), None);
}

/// Fence counters against a real `redis-server` (a `RedisServer` of the
/// test harness): they expire with their leases, and a fence issued after a
/// counter is gone is still larger than every earlier one.
mod fence_tests {
    use std::time::Duration;

    use bytes::Bytes;

    use crate::backend::{Acquire, LockBackend, RedisBackend, Token};
    use tower_redis_lock_test_support::{eventually, RedisServer as Server};

    const TTL: Duration = Duration::from_millis(300);

    async fn connect(server: &Server) -> RedisBackend {
        RedisBackend::connect(&server.url())
            .await
            .expect("connect to the test redis-server")
    }

    async fn fence(backend: &RedisBackend, key: &Bytes, token: &Token) -> u64 {
        match backend.acquire_fenced(key, token, TTL).await {
            Ok(Acquire::Acquired { fence: Some(f), .. }) => f,
            other => panic!("expected a fenced acquire, got {other:?}"),
        }
    }

    fn key(i: usize) -> Bytes {
        Bytes::from(format!("trl:{{k{i}}}"))
    }

    fn fence_keys(server: &Server) -> Vec<String> {
        server
            .cli(&["--scan", "--pattern", "trl:*:fence"])
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// The longest TTL (`Duration::MAX`, "for ever"), given to the backend
    /// itself (the layers clamp theirs): a lease is taken and extended, as
    /// on `MemoryBackend`, no panic (`Instant + Duration::MAX` overflowed in
    /// the local table, before).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_longest_ttl_takes_and_extends_a_lease() {
        let server = Server::start();
        let backend = connect(&server).await;
        let (k, token) = (key(0), Token::generate());
        let got = backend.acquire(&k, &token, Duration::MAX).await;
        assert!(matches!(got, Ok(Acquire::Acquired { .. })), "{got:?}");
        assert!(backend.extend(&k, &token, Duration::MAX).await.unwrap());
        assert!(backend.release(&k, &token).await.unwrap());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fence_counters_expire_with_their_leases() {
        let server = Server::start();
        // Long enough that the first counters outlive the loop on a loaded
        // machine (200 ms lost three of fifty under eight test runs at once).
        let window = Duration::from_secs(1);
        let backend = connect(&server).await.fence_window(window);
        const N: usize = 50;
        for i in 0..N {
            let token = Token::generate();
            fence(&backend, &key(i), &token).await;
            assert!(backend.release(&key(i), &token).await.expect("release"));
        }
        let keys = fence_keys(&server);
        assert_eq!(keys.len(), N, "one counter per key: {keys:?}");
        let life = (TTL + window).as_millis() as i64;
        for k in &keys {
            let pttl: i64 = server.cli(&["PTTL", k]).parse().expect("PTTL is a number");
            // -1 would be a counter kept forever; -2 (one already gone) and
            // 0 (one expiring this millisecond) are what a slow machine
            // reads for the first keys, bounded too.
            assert!(
                pttl == -2 || (0..=life).contains(&pttl),
                "{k}: PTTL {pttl}, expected 0..={life} (or gone)"
            );
        }
        // Gone once TTL + window have passed (polled, bounded).
        assert!(
            eventually(Duration::from_secs(5), || fence_keys(&server).is_empty()).await,
            "counters left after TTL + window: {:?}",
            fence_keys(&server)
        );
        assert_eq!(server.dbsize(), 0, "nothing else left either");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fence_after_the_counter_is_gone_is_larger_than_every_earlier_one() {
        let server = Server::start();
        let backend = connect(&server).await;
        let k = key(0);
        let mut seen = Vec::new();
        for _ in 0..3 {
            let token = Token::generate();
            seen.push(fence(&backend, &k, &token).await);
            assert!(backend.release(&k, &token).await.expect("release"));
        }
        assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
        // The counter vanishes (expiry, eviction, a restart without
        // persistence): the next fence still passes every earlier one.
        assert_eq!(server.cli(&["DEL", "trl:{k0}:fence"]), "1");
        let after = fence(&backend, &k, &Token::generate()).await;
        assert!(
            seen.iter().all(|&f| after > f),
            "fence {after} after the counter was deleted, earlier {seen:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_counter_ahead_of_the_clock_lives_until_the_clock_passes_it() {
        let server = Server::start();
        let window = Duration::from_millis(200);
        let backend = connect(&server).await.fence_window(window);
        // A counter 100 s ahead of the server's clock (in µs).
        let secs: u64 = server
            .cli(&["TIME"])
            .lines()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let ahead = (secs + 100) * 1_000_000;
        server.cli(&["SET", "trl:{k0}:fence", &ahead.to_string()]);
        let f = fence(&backend, &key(0), &Token::generate()).await;
        assert_eq!(f, ahead + 1, "counter + 1 when it is ahead of the clock");
        let pttl: i64 = server.cli(&["PTTL", "trl:{k0}:fence"]).parse().unwrap();
        assert!(pttl > 99_000, "kept until the clock passed it: PTTL {pttl}");
        // Past 2^53 a double cannot count: an error, never a fence that
        // fails to grow.
        server.cli(&["SET", "trl:{k1}:fence", "9007199254740991"]);
        let refused = backend
            .acquire_fenced(&key(1), &Token::generate(), TTL)
            .await;
        assert!(refused.is_err(), "{refused:?}");
        assert_eq!(server.cli(&["EXISTS", "trl:{k1}"]), "0", "no lease taken");
        // A counter that is not a number (a co-tenant's `nan`, which Lua
        // reads as NaN and every comparison lets through) is refused the
        // same way, before anything is written.
        for (i, junk) in ["nan", "-nan", "inf"].into_iter().enumerate() {
            let k = key(2 + i);
            let counter = format!("trl:{{k{}}}:fence", 2 + i);
            server.cli(&["SET", &counter, junk]);
            let refused = backend.acquire_fenced(&k, &Token::generate(), TTL).await;
            assert!(refused.is_err(), "{junk}: {refused:?}");
            let lease = format!("trl:{{k{}}}", 2 + i);
            assert_eq!(
                server.cli(&["EXISTS", &lease]),
                "0",
                "{junk}: no lease taken"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resent_acquire_of_our_live_lease_keeps_its_fence() {
        let server = Server::start();
        let backend = connect(&server).await.local_dedup(false);
        let (k, token) = (key(0), Token::generate());
        let first = fence(&backend, &k, &token).await;
        assert_eq!(fence(&backend, &k, &token).await, first);
        match backend.acquire_fenced(&k, &Token::generate(), TTL).await {
            Ok(Acquire::Held { .. }) => {}
            other => panic!("a stranger must be refused, got {other:?}"),
        }
    }
}

/// A `redis-server` 7 of the test harness and a backend over it (without
/// local dedup), on the script road.
async fn redis7() -> (tower_redis_lock_test_support::RedisServer, RedisBackend) {
    use crate::backend::LockBackend;

    let server = tower_redis_lock_test_support::RedisServer::start_redis();
    let backend = RedisBackend::connect(&server.url())
        .await
        .expect("connect")
        .local_dedup(false);
    assert_eq!(backend.native_calls(), None, "Redis 7: scripts");
    (server, backend)
}

/// A server that lacks a native command although the road says native (a
/// failover to an older server, before the probe of the reconnection):
/// Redis 7 answers `DELIFEQ` with `unknown command`; the release goes out
/// as its script in the same call, the lease is released, and later calls
/// take the script road. (`SET … NX PX … GET` exists on Redis 7: the
/// acquire is native.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_command_falls_back_to_the_script_and_releases() {
    use crate::backend::{Acquire, LockBackend, Token};

    let (server, backend) = redis7().await;
    backend.dispatch.paths().assume_native();
    let key = bytes::Bytes::from_static(b"trl:{unknown-command}");
    let token = Token::generate();
    let ttl = Duration::from_secs(30);
    assert!(matches!(
        backend.acquire(&key, &token, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    assert_eq!(backend.native_calls(), Some(1), "the acquire was native");
    assert!(backend.release(&key, &token).await.unwrap(), "released");
    assert_eq!(server.dbsize(), 0);
    assert_eq!(backend.native_calls(), None, "the script road since");
    assert_eq!(
        server.command_calls("evalsha") + server.command_calls("eval"),
        2
    );
}

/// On the script road, a lease call that finds nothing else of its
/// connection on its way goes out from its caller's own task (an acquire
/// as `SET … GET`, a release as its script): a lone acquire and release
/// never start the lane's task (a hop, a channel send
/// and a wake-up per step). Calls asked while one is on its way still go
/// out batched, in the order asked: here 1 alone and 19 in the lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_script_call_goes_out_from_its_callers_task() {
    use crate::backend::{Acquire, LockBackend, Token};

    let (server, backend) = redis7().await;
    assert!(backend.dispatch.batching());
    let ttl = Duration::from_secs(30);
    let key = bytes::Bytes::from_static(b"trl:{lone}");
    let token = Token::generate();
    assert!(matches!(
        backend.acquire(&key, &token, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    assert_eq!(
        (server.command_calls("set"), server.command_calls("evalsha")),
        (1, 0),
        "a lone acquire is one `SET`, no script"
    );
    assert!(backend.release(&key, &token).await.unwrap(), "released");
    assert_eq!(backend.dispatch.lanes_started(), 0, "no hop through a lane");

    // Asked together (each call is sent when it is made): the first alone,
    // the rest behind it in the lane, all acquired. The server holds back
    // every write while they are asked: without that, a first call whose
    // thread the OS preempts right after it wrote may find its answer there
    // already at its first poll, and the next call goes alone too (seen on
    // a loaded machine).
    server.cli(&["CLIENT", "PAUSE", "30000", "WRITE"]);
    let keys: Vec<_> = (0..20)
        .map(|i| bytes::Bytes::from(format!("trl:{{together-{i}}}")))
        .collect();
    let calls: Vec<_> = keys
        .iter()
        .map(|k| backend.acquire(k, &token, ttl))
        .collect();
    assert_eq!(backend.dispatch.lanes_started(), 1, "the rest queued");
    assert_eq!(server.dbsize(), 0, "nothing written while paused");
    server.cli(&["CLIENT", "UNPAUSE"]);
    for call in calls {
        assert!(matches!(call.await.unwrap(), Acquire::Acquired { .. }));
    }
    assert_eq!(server.dbsize(), 20);
    // Each acquire one `SET`: as itself when sent alone (the first one, and
    // the first of the 20), inside the script in a batch. No `PTTL`
    // anywhere: every key was free.
    assert_eq!(server.command_calls("set"), 21, "one per acquire");
    assert_eq!(server.command_calls("pttl"), 0);
    let scripts = server.command_calls("evalsha") + server.command_calls("eval");
    assert!(
        (2..=22).contains(&scripts),
        "the lone release, then at least one batch (each script's first call \
         refused `NOSCRIPT` and sent again): {scripts} script calls"
    );
}
