//! Releases are delivered: a request that ended has its release sent whatever
//! its caller's deadline and whatever else was batched with it; a batch that
//! gets no answer does not freeze the backend; a late acquire's cleanup
//! cannot overtake it; a graceful shutdown leaves no lease behind. Every test
//! owns its `redis-server` (and, where the network is the fault, a TCP proxy).

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::proxy::Proxy;
use common::{eventually, req, run, send, serve, until_status, RedisServer};
use tokio::sync::mpsc;
use tower_redis_lock::backend::contract::{Acquire, Claim, EntryKey, Token};
use tower_redis_lock::backend::{ClaimTerms, IdempotencyBackend, LockBackend};
use tower_redis_lock::key::KeySpace;
use tower_redis_lock::key::UriPath;
use tower_redis_lock::{RedisBackend, RedisLockLayer};

type Gate = common::Gate<()>;

async fn gated(State(gate): State<Gate>) -> &'static str {
    gate.pass(()).await;
    "ok"
}

/// `/pay/{n}` runs `gated`; `/probe/{n}` answers at once; both behind `layer`.
async fn app(layer: RedisLockLayer) -> (SocketAddr, Gate, mpsc::UnboundedReceiver<()>) {
    let (gate, entered) = Gate::new();
    let router = Router::new()
        .route("/pay/{n}", post(gated))
        .route("/probe/{n}", post(|| async { "ok" }))
        .with_state(gate.clone())
        .layer(layer);
    (serve(router).await, gate, entered)
}

fn post_(path: &str) -> http::Request<http_body_util::Full<Bytes>> {
    req("POST", path, &[], "")
}

fn key(n: u8) -> Bytes {
    Bytes::from(format!("trl:{{delivery-{n}}}"))
}

/// Redis stalls (`DEBUG SLEEP 2`, as a fork or a slow command does) while an
/// acquire is on the wire and another request finishes: that request's
/// release waits behind the stalled batch and its 200 ms deadline passes. It
/// must still be sent: once Redis answers again no key is left, and the same
/// request is admitted (before, the batcher dropped the release, the key
/// stayed for the 70 s TTL and the repeat got 409).
#[test]
fn release_behind_a_stalled_batch_is_delivered() {
    run(|| async move {
        let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
        let backend = RedisBackend::connect(&server.url()).await.unwrap();
        let layer = RedisLockLayer::new(backend, UriPath)
            .ttl(Duration::from_secs(70))
            .deadline(Duration::from_millis(200));
        let (addr, gate, mut entered) = app(layer).await;

        let first = tokio::spawn(async move { send(addr, post_("/pay/1")).await.status });
        entered.recv().await.unwrap();
        assert_eq!(server.dbsize(), 1);

        let sleeper = server.debug_sleep(2.0);
        // The first 503 shows the stall began, with that probe's acquire in flight.
        until_status(addr, 503, Duration::from_secs(2), || post_("/probe/1"))
            .await
            .expect("redis stalled");
        gate.permits.add_permits(1);
        // The response waits at most the deadline for its release.
        assert_eq!(first.await.unwrap(), 200);
        assert_eq!(sleeper.join().unwrap(), "OK");

        assert!(
            eventually(Duration::from_secs(3), || server.dbsize() == 0).await,
            "keys left after the stall: {}",
            server.cli(&["KEYS", "*"])
        );
        gate.permits.add_permits(1);
        assert_eq!(send(addr, post_("/pay/1")).await.status, 200);
    });
}

/// Under `maxmemory` with `noeviction`, the acquire (a `SET`) of one request
/// fails with OOM; a release batched after it in the same script call still
/// runs, in that same call (before, `redis.call` aborted the whole batch
/// script and the release failed with it).
#[test]
fn oom_acquire_does_not_block_a_batched_release() {
    run(|| async move {
        let server = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
        let proxy = Proxy::start(server.port()).await;
        let backend = RedisBackend::connect(&proxy.url())
            .await
            .unwrap()
            .local_dedup(false);
        let ttl = Duration::from_secs(70);
        let (held, late, behind, oom) = (
            Token::generate(),
            Token::generate(),
            Token::generate(),
            Token::generate(),
        );
        assert!(matches!(
            backend.acquire(&key(1), &held, ttl).await.unwrap(),
            Acquire::Acquired { .. }
        ));
        assert_eq!(server.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
        let calls_before = server.command_calls("evalsha");

        // Hold the batcher while Redis is stopped: a lone acquire goes out
        // from its caller's task; the next one, asked while it is on its
        // way, goes out as the lane's batch, and the lane sends nothing more
        // until that batch is answered.
        server.pause();
        let sent = proxy.chunks_up();
        let in_flight = {
            let backend = backend.clone();
            tokio::spawn(async move { backend.acquire(&key(2), &late, ttl).await })
        };
        assert!(eventually(Duration::from_secs(2), || proxy.chunks_up() > sent).await);
        let sent = proxy.chunks_up();
        let batch_in_flight = {
            let backend = backend.clone();
            tokio::spawn(async move { backend.acquire(&key(4), &behind, ttl).await })
        };
        assert!(eventually(Duration::from_secs(2), || proxy.chunks_up() > sent).await);
        // Queue an acquire and then a release: they go out together.
        let mut acquire = backend.acquire(&key(3), &oom, ttl);
        tokio::select! {
            biased;
            _ = &mut acquire => panic!("answered while Redis is stopped"),
            () = std::future::ready(()) => {}
        }
        let mut release = backend.release(&key(1), &held);
        tokio::select! {
            biased;
            _ = &mut release => panic!("answered while Redis is stopped"),
            () = std::future::ready(()) => {}
        }
        server.resume();

        assert!(in_flight.await.unwrap().is_err(), "OOM");
        assert!(batch_in_flight.await.unwrap().is_err(), "OOM");
        assert!(acquire.await.is_err(), "OOM");
        assert!(
            release.await.unwrap(),
            "the release ran in spite of the OOM"
        );
        assert_eq!(server.dbsize(), 0);
        if server.is_valkey() {
            // Native: each acquire and the release once; no retry.
            assert_eq!(server.command_calls("delifeq"), 1);
            assert_eq!(server.command_calls("evalsha"), 0);
        } else {
            // Two script calls: the batch behind the lone acquire (which
            // went as `SET` + `PTTL`), and the batch of the acquire and the
            // release; no retry.
            assert_eq!(server.command_calls("evalsha") - calls_before, 2);
        }
    });
}

/// A deploy: SIGTERM to the quickstart example (the built binary, on Redis)
/// with 10 requests in flight. It finishes them (each answered 200), delivers
/// their releases, and exits 0 leaving no key in Redis (before, it exited at
/// once with status 143 and left all 10 leases for their 70 s TTL).
#[test]
fn sigterm_with_requests_in_flight_leaves_no_lease() {
    let binary = crate::common::examples::example_binary("quickstart");
    run(|| async move {
        use std::io::BufRead;
        let server = RedisServer::start();
        let mut child = std::process::Command::new(binary)
            .env("REDIS_URL", server.url())
            .env("ADDR", "127.0.0.1:0")
            .env_remove("REDLOCK_URLS")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start the quickstart example");
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let addr: SocketAddr = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .parse()
            .unwrap();

        let requests: Vec<_> = (0..10)
            .map(|i| {
                tokio::spawn(async move {
                    let user = format!("user-{i}");
                    let r = req(
                        "POST",
                        "/pay?delay_ms=1500",
                        &[("x-user-id", user.as_str())],
                        "{}",
                    );
                    send(addr, r).await.status
                })
            })
            .collect();
        assert!(
            eventually(Duration::from_secs(5), || server.dbsize() == 10).await,
            "10 leases held"
        );
        let pid = child.id().to_string();
        assert!(std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success());
        for r in requests {
            assert_eq!(r.await.unwrap(), 200, "a request in flight was finished");
        }
        let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
            .await
            .unwrap();
        assert!(status.success(), "exit status {status:?}");
        assert_eq!(
            server.dbsize(),
            0,
            "keys left: {}",
            server.cli(&["KEYS", "*"])
        );
    });
}

/// A batch that never gets an answer (its bytes swallowed by the proxy, on a
/// fred client without a command timeout) is abandoned after the batch
/// timeout (1 s by default), and the next request is served within the
/// deadline plus the batch timeout once the network works again (before,
/// every later acquire queued behind the wedged batch: 503 until fred gave
/// up, which without a command timeout is never). The swallowed bytes
/// leave the connection open: a fault of this proxy, not of TCP. Batches
/// are the script road's (one batch in flight, nothing behind it on the
/// wire); on the native road commands are pipelined, so later replies
/// would fill the swallowed ones' places, which no pipelining client can
/// tell. This test keeps the script road on every server; the native
/// road's own timeout is `native_call_without_answer_is_abandoned`.
#[test]
fn batch_without_answer_is_abandoned() {
    run(|| async move {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let client = RedisBackend::builder(&proxy.url())
            .unwrap()
            .with_performance_config(|p| p.default_command_timeout = Duration::ZERO)
            .build()
            .unwrap();
        fred::interfaces::ClientLike::init(&client).await.unwrap();
        let deadline = Duration::from_millis(200);
        let batch_timeout = Duration::from_secs(1);
        let backend = RedisBackend::new(client).native_commands(false);
        let layer = RedisLockLayer::new(backend, UriPath).deadline(deadline);
        let (addr, _gate, _entered) = app(layer).await;
        assert_eq!(send(addr, post_("/probe/0")).await.status, 200);

        proxy.blackhole(true);
        assert_eq!(send(addr, post_("/probe/1")).await.status, 503);
        proxy.blackhole(false);
        let took = until_status(
            addr,
            200,
            deadline + batch_timeout + Duration::from_secs(2),
            || post_("/probe/2"),
        )
        .await
        .expect("served again after the wedged batch");
        assert!(
            took <= deadline + batch_timeout + Duration::from_millis(500),
            "served again only after {took:?}"
        );
        assert!(eventually(Duration::from_secs(3), || server.dbsize() == 0).await);
    });
}

/// On a pool, an acquire whose reply is lost (the connection drops after
/// Redis ran it) is re-sent by fred once that connection is back; the
/// caller's cleanup (a release with the same token) must not overtake it on
/// another pool connection, or the re-sent acquire lands after the cleanup
/// and the key is held by nobody for the whole TTL. Checked
/// batched and unbatched.
#[test]
fn late_acquire_cleanup_is_not_overtaken_on_a_pool() {
    run(|| async move {
        for batched in [true, false] {
            let server = RedisServer::start();
            let proxy = Proxy::start(server.port()).await;
            // A command timeout longer than the delays below.
            let pool = RedisBackend::builder(&proxy.url())
                .unwrap()
                .with_performance_config(|p| p.default_command_timeout = Duration::from_secs(10))
                .build_pool(2)
                .unwrap();
            fred::interfaces::ClientLike::init(&pool).await.unwrap();
            let backend = RedisBackend::from_pool(pool)
                .auto_pipeline(batched)
                .local_dedup(false);
            let token = Token::generate();
            let ttl = Duration::from_secs(70);
            // Load the scripts (a NOSCRIPT reply is not the one to drop).
            backend.acquire(&key(9), &token, ttl).await.unwrap();
            assert!(backend.release(&key(9), &token).await.unwrap());

            // Every command lands 400 ms late: the re-sent acquire waits for
            // a new connection's hand-shake, the cleanup does not.
            proxy.delay_up(Duration::from_millis(400));
            proxy.drop_next_reply();
            let mut acquire = backend.acquire(&key(1), &token, ttl);
            tokio::select! {
                biased;
                _ = &mut acquire => panic!("answered although its reply is dropped"),
                () = std::future::ready(()) => {}
            }
            assert!(eventually(Duration::from_secs(2), || proxy.dropped_replies() == 1).await);
            assert_eq!(server.dbsize(), 1, "the acquire ran on the server");
            // The caller gave up: its cleanup goes out now.
            let cleanup = backend.release(&key(1), &token);
            // The acquire is answered once re-sent after the reconnect, or
            // abandoned with its batch (1 s): either way it ran before the
            // cleanup.
            let _ = acquire.await;
            let released = cleanup.await;
            // (`false` is possible: a first attempt that ran but whose reply
            // was lost to the reconnect, then a retry that found no key.)
            assert!(released.is_ok(), "batched {batched}: {released:?}");
            assert_eq!(
                server.dbsize(),
                0,
                "batched {batched}: the cleanup ran before the re-sent acquire"
            );
        }
    });
}

/// While Redis is stopped, calls queue up to a bound (10,000 per
/// connection, behind one batch of at most 256 on its way); beyond it a
/// call fails at once instead of queueing without limit, and the queued
/// ones are answered once Redis is back (before, the queue had no bound).
/// (The first call, alone on an idle connection, goes out from its
/// caller's task; the lane then sends one batch of what has queued behind
/// it, and holds the rest.) The batch queue is the script
/// road's: on the native road calls queue in fred, bounded by its
/// `max_command_buffer_len` and timed by its command timeout, so this test
/// keeps the script road on every server.
#[test]
fn full_batch_queue_fails_fast() {
    run(|| async move {
        const CALLS: usize = 10_300;
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port()).await;
        let backend = RedisBackend::connect(&proxy.url())
            .await
            .unwrap()
            .local_dedup(false)
            .native_commands(false)
            .batch_timeout(Duration::from_secs(10));
        let ttl = Duration::from_secs(70);
        let token = Token::generate();
        backend.acquire(&key(0), &token, ttl).await.unwrap();

        server.pause();
        let sent = proxy.chunks_up();
        let in_flight = backend.acquire(&key(1), &token, ttl);
        let in_flight = tokio::spawn(in_flight);
        assert!(eventually(Duration::from_secs(2), || proxy.chunks_up() > sent).await);
        let started = std::time::Instant::now();
        let mut refused = 0;
        let mut queued = Vec::new();
        for i in 0..CALLS {
            let k = Bytes::from(format!("trl:{{queue-{i}}}"));
            let mut call = backend.acquire(&k, &token, ttl);
            let answer = tokio::select! {
                biased;
                answer = &mut call => Some(answer),
                () = std::future::ready(()) => None,
            };
            match answer {
                Some(Err(e)) => {
                    assert!(e.to_string().contains("redis command failed"), "{e}");
                    refused += 1;
                }
                Some(Ok(a)) => panic!("answered while Redis is stopped: {a:?}"),
                None => queued.push(call),
            }
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        // Refused: all but the 10,000 queued and the up to 256 the lane
        // took into its batch.
        assert!(
            (CALLS - 10_000 - 256..=CALLS - 10_000).contains(&refused),
            "{refused} of {CALLS} refused at once"
        );
        server.resume();
        in_flight.await.unwrap().unwrap();
        for call in queued {
            assert!(call.await.is_ok());
        }
    });
}

/// An idempotency entry of `scope`, named `name` (each call a new one).
fn entry_of(scope: &tower_redis_lock::key::LockKey, name: &str) -> EntryKey {
    let mut w = KeySpace::default().writer();
    w.push("oom-test", name.as_bytes());
    w.push("run", Token::generate().as_bytes());
    EntryKey::new(&KeySpace::default(), scope, &w.finish())
}

/// Under `maxmemory` with `noeviction`, a new idempotency claim fails
/// closed on every path: also where the claim script wrote before the
/// claim's hash (a tombstone's delete, the scope's sweep of expired
/// entries), a write after which Redis 7 lets every other write of a
/// script without flags through.
#[test]
fn a_new_claim_fails_closed_at_oom_on_every_path() {
    run(|| async move {
        let server = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
        let backend = RedisBackend::connect(&server.url()).await.unwrap();
        let scope_of = |name: &str| {
            let mut w = KeySpace::default().writer();
            w.push("oom-scope", name.as_bytes());
            w.push("run", Token::generate().as_bytes());
            w.finish()
        };
        let (lease, short) = (Duration::from_secs(10), Duration::from_millis(150));
        let scope = scope_of("oom");
        // A tombstone another request left on `tomb`.
        let tomb = entry_of(&scope, "tomb");
        let gone = backend.abandon(&tomb, &Token::generate(), lease).await;
        assert!(matches!(gone, Ok(false)), "{gone:?}");
        // A full scope of two, one of whose entries expired: a claim sweeps
        // first (the other keeps the scope's set alive).
        let full = scope_of("oom-full");
        let (a, b) = (entry_of(&full, "a"), entry_of(&full, "b"));
        for (k, lease) in [(&b, lease), (&a, short)] {
            let terms = ClaimTerms::new(lease, 2, 1 << 30);
            let got = backend.claim(k, &Token::generate(), b"fp", &terms).await;
            assert_eq!(got.unwrap(), Claim::Claimed);
        }
        let gone =
            |k: &EntryKey| server.cli(&["EXISTS", &String::from_utf8_lossy(k.entry())]) == "0";
        assert!(!gone(&a), "the claim is there to expire");
        assert!(eventually(Duration::from_secs(5), || gone(&a)).await);
        let quota = format!("{}:idem-quota", String::from_utf8_lossy(a.scope()));
        assert_eq!(
            server.cli(&["ZCARD", &quota]),
            "2",
            "the scope still counts it"
        );

        assert_eq!(server.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
        let terms = ClaimTerms::new(lease, 2, 1 << 30);
        let mut claimed = Vec::new();
        for (what, key) in [
            ("a fresh key", entry_of(&scope, "fresh")),
            ("a tombstone", tomb.clone()),
            ("a full scope", entry_of(&full, "c")),
        ] {
            let got = backend.claim(&key, &Token::generate(), b"fp", &terms).await;
            if got.is_ok() {
                claimed.push(format!("{what}: {got:?}"));
            }
        }
        assert!(claimed.is_empty(), "answered at OOM: {claimed:?}");
        assert_eq!(server.cli(&["CONFIG", "SET", "maxmemory", "0"]), "OK");
        let got = backend
            .claim(&tomb, &Token::generate(), b"fp", &terms)
            .await;
        assert_eq!(got.unwrap(), Claim::Claimed, "with room again");
        let swept = backend
            .claim(&entry_of(&full, "c"), &Token::generate(), b"fp", &terms)
            .await;
        assert_eq!(swept.unwrap(), Claim::Claimed, "the sweep made room");
    })
}
