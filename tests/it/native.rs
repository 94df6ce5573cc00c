//! Native lease commands (`SET NX PX GET` + `PTTL`, `DELIFEQ`, `SET … IFEQ`)
//! where the server has them, Lua where it does not: each test runs on
//! Valkey 9 (native) and on Redis 7 (the script road), through
//! `on_both_servers!`. What the server ran is read from `INFO
//! commandstats`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use tower_redis_lock::backend::contract::{Acquire, Token};
use tower_redis_lock::backend::LockBackend;
use tower_redis_lock::key::{RequestMethod, UriPath};
use tower_redis_lock::{RedisBackend, RedisLockLayer};

use crate::common::{req, retry_until, serve, stamp, Conn, RedisServer};

/// Which server a test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    /// Valkey 9 (`TRL_VALKEY_SERVER`): native commands.
    Valkey,
    /// Redis 7.0 (`redis-server`): no `DELIFEQ`, Lua scripts.
    Redis,
}

impl Server {
    fn start(self) -> RedisServer {
        match self {
            Server::Valkey => RedisServer::start_valkey(),
            Server::Redis => RedisServer::start_redis(),
        }
    }
}

/// Each test `async fn name(server: Server)` once per server.
macro_rules! on_both_servers {
    ($($name:ident),+ $(,)?) => {
        mod valkey {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Server::Valkey).await
                }
            )+
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Server::Redis).await
                }
            )+
        }
    };
}

on_both_servers!(
    lone_lease_round_trips,
    acquire_release_extend_keep_the_contract,
    resent_acquire_finds_its_own_token,
    a_holder_time_left_comes_from_its_token,
    mixed_fleet_keeps_mutual_exclusion,
    native_commands_off_sends_scripts,
);

/// Calls per command since the server started.
fn commandstats(redis: &RedisServer) -> BTreeMap<String, u64> {
    commandstat(redis, "calls")
}

/// One field of `INFO commandstats` (`calls`, `rejected_calls`, …) per
/// command.
fn commandstat(redis: &RedisServer, field: &str) -> BTreeMap<String, u64> {
    let prefix = format!("{field}=");
    redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter_map(|l| {
            let (name, fields) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let value = fields.split(',').find_map(|f| f.strip_prefix(&prefix))?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

fn calls(stats: &BTreeMap<String, u64>, name: &str) -> u64 {
    stats.get(name).copied().unwrap_or(0)
}

/// Scripts the server ran (`EVALSHA`, `EVAL`, `FCALL`).
fn scripts(stats: &BTreeMap<String, u64>) -> u64 {
    calls(stats, "evalsha") + calls(stats, "eval") + calls(stats, "fcall")
}

/// A user `name` on `redis` with `rules` after `on`, a password, every key
/// and channel; the URL that logs in as it.
fn acl_user(redis: &RedisServer, name: &str, rules: &[&str]) -> String {
    let mut args = vec!["ACL", "SETUSER", name, "on", ">secret", "~*", "&*"];
    args.extend_from_slice(rules);
    redis.cli(&args);
    format!("redis://{name}:secret@127.0.0.1:{}", redis.port())
}

/// Whether `holds` comes true within 10 s (looked at every 20 ms).
async fn within_10s(mut holds: impl FnMut() -> bool) -> bool {
    retry_until(Duration::from_secs(10), Duration::from_millis(20), || {
        std::future::ready(if holds() { Ok(()) } else { Err(()) })
    })
    .await
    .is_ok()
}

/// A lease on `name` acquired and released through `backend`, the release
/// a `DELIFEQ` (one more in `redis`'s commandstats).
async fn leased_natively(backend: &RedisBackend, redis: &RedisServer, name: &str) {
    let before = calls(&commandstats(redis), "delifeq");
    let (k, t) = (key(name), Token::generate());
    let got = backend.acquire(&k, &t, Duration::from_secs(30)).await;
    assert!(matches!(got, Ok(Acquire::Acquired { .. })), "{got:?}");
    assert!(backend.release(&k, &t).await.unwrap());
    assert_eq!(
        calls(&commandstats(redis), "delifeq"),
        before + 1,
        "released natively"
    );
}

fn key(name: &str) -> Bytes {
    Bytes::from(format!("trl-native:{{{name}}}"))
}

/// One request through the layer, alone: on Valkey the server runs no
/// script at all (acquire one `SET`, no `PTTL`: a holder's time left comes
/// from its token; release `DELIFEQ`); on Redis 7 the same acquire (every
/// supported server has `SET … NX PX … GET`) and one script, the release,
/// and no `DELIFEQ`.
async fn lone_lease_round_trips(server: Server) {
    let redis = server.start();
    let backend = RedisBackend::connect(&redis.url()).await.expect("connect");
    let layer = RedisLockLayer::new(backend, (RequestMethod, UriPath));
    let router = Router::new()
        .route("/pay/{id}", post(|| async { "ok" }))
        .layer(layer.clone());
    let addr = serve(router).await;
    let mut conn = Conn::open(addr).await;
    // Warm (the script cache on Redis) and count from here.
    assert_eq!(
        conn.send(req("POST", "/pay/warm", &[], "")).await.status,
        200
    );
    let before = commandstats(&redis);
    assert_eq!(conn.send(req("POST", "/pay/1", &[], "")).await.status, 200);
    let after = commandstats(&redis);
    let delta = |name: &str| calls(&after, name) - calls(&before, name);
    eprintln!(
        "{server:?} lone lease: set {} pttl {} delifeq {} evalsha {} eval {} fcall {}",
        delta("set"),
        delta("pttl"),
        delta("delifeq"),
        delta("evalsha"),
        delta("eval"),
        delta("fcall")
    );
    match server {
        Server::Valkey => {
            assert_eq!(scripts(&after), 0, "no Lua on Valkey: {after:?}");
            assert_eq!((delta("set"), delta("pttl"), delta("delifeq")), (1, 0, 1));
            let stats = layer.stats();
            assert_eq!(stats.native_calls, Some(4), "two leases, two calls each");
        }
        Server::Redis => {
            assert_eq!(scripts(&after) - scripts(&before), 1, "the release");
            // `SET` once: the acquire's own (the release script runs `GET`
            // and `DEL`).
            assert_eq!((delta("set"), delta("pttl")), (1, 0), "the acquire");
            assert_eq!(calls(&after, "delifeq"), 0);
            assert_eq!(layer.stats().native_calls, None);
        }
    }
    assert_eq!(redis.dbsize(), 0, "released");
}

/// The store contract, step by step, on whichever road the server takes.
async fn acquire_release_extend_keep_the_contract(server: Server) {
    let redis = server.start();
    let backend = RedisBackend::connect(&redis.url())
        .await
        .expect("connect")
        .local_dedup(false);
    let (a, b) = (Token::generate(), Token::generate());
    let k = key("contract");
    let ttl = Duration::from_secs(3);
    assert!(matches!(
        backend.acquire(&k, &a, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    match backend.acquire(&k, &b, ttl).await.unwrap() {
        Acquire::Held {
            retry_after: Some(left),
        } => assert!(left <= ttl && left > Duration::from_secs(2), "{left:?}"),
        other => panic!("expected held with its time left, got {other:?}"),
    }
    assert!(backend
        .extend(&k, &a, Duration::from_secs(30))
        .await
        .unwrap());
    let pttl: i64 = redis
        .cli(&["PTTL", "trl-native:{contract}"])
        .parse()
        .unwrap();
    assert!(pttl > 20_000, "extend keeps an expiry: {pttl}");
    assert!(!backend.extend(&k, &b, ttl).await.unwrap(), "not b's");
    assert!(!backend.release(&k, &b).await.unwrap(), "not b's");
    assert!(backend.release(&k, &a).await.unwrap());
    assert!(!backend.release(&k, &a).await.unwrap(), "gone");
    assert!(!backend.extend(&k, &a, ttl).await.unwrap(), "gone");
    assert_eq!(redis.dbsize(), 0);
    if server == Server::Valkey {
        let stats = commandstats(&redis);
        assert_eq!(scripts(&stats), 0, "{stats:?}");
        assert_eq!(backend.native_calls(), Some(8));
    } else {
        assert_eq!(backend.native_calls(), None);
    }
}

/// A refused acquire tells the holder's time left from the holder's token
/// alone (no `PTTL`): a token issued a while ago has that much less left; a
/// value of another format (an older instance's random token, anything a
/// co-tenant wrote) or a holder past its first TTL (renewed) has none, and
/// the layer falls back as for an unknown time; either way it is held.
async fn a_holder_time_left_comes_from_its_token(server: Server) {
    let redis = server.start();
    let backend = RedisBackend::connect(&redis.url())
        .await
        .expect("connect")
        .local_dedup(false);
    let ttl = Duration::from_secs(30);
    let now_ms = stamp::wall_ms();
    let old = stamp::issued_at(now_ms - 10_000);
    // Issued 40 s ago: renewed past its first 30 s TTL.
    let renewed = stamp::issued_at(now_ms - 40_000);
    let cases = [
        ("old", old.as_str(), Some((19_000, 20_001))),
        ("renewed", renewed.as_str(), None),
        ("random", "f3a1c09b7d2e4c55a0b1c2d3e4f50617", None),
        ("foreign", "not-a-token", None),
    ];
    for (name, value, left_ms) in cases {
        let k = key(name);
        let stored = format!("trl-native:{{{name}}}");
        redis.cli(&["SET", &stored, value, "PX", "60000"]);
        match backend.acquire(&k, &Token::generate(), ttl).await.unwrap() {
            Acquire::Held { retry_after } => match (left_ms, retry_after) {
                (Some((lo, hi)), Some(left)) => assert!(
                    (lo..hi).contains(&(left.as_millis() as u64)),
                    "{name}: {left:?} left"
                ),
                (None, None) => {}
                (want, got) => panic!("{name}: expected {want:?} ms left, got {got:?}"),
            },
            other => panic!("{name}: held by {value:?}, got {other:?}"),
        }
        assert_eq!(redis.cli(&["GET", &stored]), value, "{name}: untouched");
    }
    let stats = commandstats(&redis);
    assert_eq!(stats.get("pttl").copied().unwrap_or(0), 0, "{stats:?}");
}

/// A re-sent acquire (fred re-sends after a lost reply) finds its own token:
/// acquired, its expiry pushed out to the new TTL.
async fn resent_acquire_finds_its_own_token(server: Server) {
    let redis = server.start();
    let backend = RedisBackend::connect(&redis.url())
        .await
        .expect("connect")
        .local_dedup(false);
    let a = Token::generate();
    let k = key("resent");
    assert!(matches!(
        backend
            .acquire(&k, &a, Duration::from_secs(2))
            .await
            .unwrap(),
        Acquire::Acquired { .. }
    ));
    assert!(matches!(
        backend
            .acquire(&k, &a, Duration::from_secs(60))
            .await
            .unwrap(),
        Acquire::Acquired { .. }
    ));
    let pttl: i64 = redis.cli(&["PTTL", "trl-native:{resent}"]).parse().unwrap();
    assert!(pttl > 50_000, "expiry pushed out: {pttl}");
    assert!(backend.release(&k, &a).await.unwrap());
}

/// Instances on the native road and on the script road, on one server and
/// the same keys: never two holders at once, and each releases what the
/// other road took only with the holder's token.
async fn mixed_fleet_keeps_mutual_exclusion(server: Server) {
    let redis = server.start();
    let native = RedisBackend::connect(&redis.url())
        .await
        .expect("connect")
        .local_dedup(false);
    let scripts_only = RedisBackend::connect(&redis.url())
        .await
        .expect("connect")
        .local_dedup(false)
        .native_commands(false);
    if server == Server::Valkey {
        assert!(native.native_calls().is_some(), "Valkey: native road");
    }
    assert_eq!(scripts_only.native_calls(), None);

    // Across roads, token by token.
    let (a, b) = (Token::generate(), Token::generate());
    let k = key("cross");
    let ttl = Duration::from_secs(5);
    assert!(matches!(
        scripts_only.acquire(&k, &a, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    assert!(matches!(
        native.acquire(&k, &b, ttl).await.unwrap(),
        Acquire::Held { .. }
    ));
    assert!(!native.release(&k, &b).await.unwrap());
    assert!(
        native.extend(&k, &a, ttl).await.unwrap(),
        "a's, from either road"
    );
    assert!(native.release(&k, &a).await.unwrap());
    assert!(matches!(
        native.acquire(&k, &b, ttl).await.unwrap(),
        Acquire::Acquired { .. }
    ));
    assert!(!scripts_only.release(&k, &a).await.unwrap());
    assert!(scripts_only.release(&k, &b).await.unwrap());

    // Under contention: 8 workers, half on each road, 4 keys.
    let inside: Arc<Vec<AtomicBool>> = Arc::new((0..4).map(|_| AtomicBool::new(false)).collect());
    let admitted = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let backend = if w % 2 == 0 {
            native.clone()
        } else {
            scripts_only.clone()
        };
        let (inside, admitted) = (inside.clone(), admitted.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..200usize {
                let slot = (i + w) % 4;
                let k = key(&format!("contended-{slot}"));
                let t = Token::generate();
                if let Acquire::Acquired { .. } = backend
                    .acquire(&k, &t, Duration::from_secs(10))
                    .await
                    .unwrap()
                {
                    assert!(
                        !inside[slot].swap(true, Ordering::SeqCst),
                        "two holders of key {slot}"
                    );
                    admitted.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                    inside[slot].store(false, Ordering::SeqCst);
                    assert!(backend.release(&k, &t).await.unwrap());
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(admitted.load(Ordering::Relaxed) > 0);
    assert_eq!(redis.dbsize(), 0, "every lease released");
}

/// `native_commands(false)`: scripts even on a server that has the
/// commands.
async fn native_commands_off_sends_scripts(server: Server) {
    let redis = server.start();
    let backend = RedisBackend::connect(&redis.url())
        .await
        .expect("connect")
        .native_commands(false);
    let t = Token::generate();
    let k = key("off");
    let before = commandstats(&redis);
    assert!(matches!(
        backend
            .acquire(&k, &t, Duration::from_secs(5))
            .await
            .unwrap(),
        Acquire::Acquired { .. }
    ));
    assert!(backend.release(&k, &t).await.unwrap());
    let after = commandstats(&redis);
    assert!(scripts(&after) - scripts(&before) >= 2, "{after:?}");
    assert_eq!(calls(&after, "delifeq"), 0);
    // A plain acquire sent as itself runs `PTTL`; the script acquiring a
    // free key does not.
    assert_eq!(calls(&after, "pttl"), calls(&before, "pttl"), "{after:?}");
    assert_eq!(backend.native_calls(), None);
}

/// Valkey with an ACL that forbids `DELIFEQ` to the backend's user: the
/// probe finds the command, the release is refused (`NOPERM`), sent again
/// as its script, and the lease is still released; later calls take the
/// script road.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_refusing_delifeq_still_releases() {
    let (redis, url) = valkey_without_delifeq();
    let backend = RedisBackend::connect(&url)
        .await
        .expect("connect")
        .local_dedup(false);
    assert!(backend.native_calls().is_some(), "the probe found DELIFEQ");
    let t = Token::generate();
    let k = key("noperm");
    assert!(matches!(
        backend
            .acquire(&k, &t, Duration::from_secs(30))
            .await
            .unwrap(),
        Acquire::Acquired { .. }
    ));
    assert!(
        backend.release(&k, &t).await.unwrap(),
        "released by the script"
    );
    assert_eq!(redis.dbsize(), 0);
    assert_eq!(
        backend.native_calls(),
        None,
        "script road until the next probe"
    );
    let stats = commandstats(&redis);
    assert_eq!(
        calls(&stats, "evalsha") + calls(&stats, "eval"),
        2,
        "{stats:?}"
    );
}

/// The probe runs again on reconnection: a Valkey replaced by a Redis 7 on
/// the same port (a failover to an older server) turns the road to
/// scripts, and leases keep working throughout; back on Valkey, native
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_runs_again_on_reconnect() {
    let mut valkey = RedisServer::start_valkey();
    let port = valkey.port();
    let backend = RedisBackend::connect(&valkey.url())
        .await
        .expect("connect")
        .local_dedup(false);
    assert!(backend.native_calls().is_some());
    valkey.kill();
    let mut redis = std::process::Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server");
    let k = key("failover");
    let leased = |backend: RedisBackend, k: Bytes| async move {
        let t = Token::generate();
        matches!(
            backend.acquire(&k, &t, Duration::from_secs(5)).await,
            Ok(Acquire::Acquired { .. })
        ) && matches!(backend.release(&k, &t).await, Ok(true))
    };
    // Within 10 s, a lease goes through and the road is `native` (or not).
    let settles_on = |native: bool| {
        let (backend, k) = (backend.clone(), k.clone());
        retry_until(
            Duration::from_secs(10),
            Duration::from_millis(50),
            move || {
                let (backend, k) = (backend.clone(), k.clone());
                async move {
                    match leased(backend.clone(), k).await
                        && backend.native_calls().is_some() == native
                    {
                        true => Ok(()),
                        false => Err(()),
                    }
                }
            },
        )
    };
    let ok = settles_on(false).await.is_ok();
    let _ = redis.kill();
    let _ = redis.wait();
    assert!(ok, "script road on Redis 7 after the reconnection");
    valkey.restart();
    let ok = settles_on(true).await.is_ok();
    assert!(ok, "native again once back on Valkey");
}

/// A probe on a reconnection that gets no answer keeps the road it had:
/// the backend's user loses `COMMAND` after connect (an error answer, as
/// a timeout in a failover would be one), its connection is killed, and
/// the probe on the reconnection is refused. Lease calls stay native,
/// where before that refusal turned the road to scripts until the next
/// reconnection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_without_answer_keeps_the_native_road() {
    let redis = RedisServer::start_valkey();
    let url = acl_user(&redis, "probed", &["+@all"]);
    let backend = RedisBackend::connect(&url)
        .await
        .expect("connect")
        .local_dedup(false);
    assert!(backend.native_calls().is_some(), "the probe found DELIFEQ");
    let refused = || calls(&commandstat(&redis, "rejected_calls"), "command|info");
    assert_eq!(refused(), 0);
    redis.cli(&["ACL", "SETUSER", "probed", "-command"]);
    redis.cli(&["CLIENT", "KILL", "USER", "probed"]);
    let probed = within_10s(|| refused() > 0).await;
    assert!(probed, "the probe on the reconnection was refused");
    leased_natively(&backend, &redis, "unanswered-probe").await;
    assert!(backend.native_calls().is_some(), "still the native road");
}

/// A probe at connect that gets no answer is asked again soon, on the same
/// connection, not only at the next reconnection: a user without `COMMAND`
/// connects (the server did not say: scripts), is then given `COMMAND`,
/// and within seconds its backend takes the native road, with no new
/// connection made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_without_answer_at_connect_is_asked_again() {
    let redis = RedisServer::start_valkey();
    let url = acl_user(&redis, "late", &["+@all", "-command"]);
    let backend = RedisBackend::connect(&url)
        .await
        .expect("connect")
        .local_dedup(false);
    assert!(
        backend.native_calls().is_none(),
        "no answer at connect: scripts"
    );
    // The backend's connections, by client id.
    let ids = || {
        let mut ids: Vec<String> = redis
            .cli(&["CLIENT", "LIST"])
            .lines()
            .filter(|line| line.contains(" user=late "))
            .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("id=")))
            .map(str::to_owned)
            .collect();
        ids.sort();
        ids
    };
    let connected = ids();
    assert_eq!(connected.len(), 1, "one connection: {connected:?}");
    redis.cli(&["ACL", "SETUSER", "late", "+command"]);
    let native = within_10s(|| backend.native_calls().is_some()).await;
    assert!(native, "the probe was asked again and found DELIFEQ");
    assert_eq!(ids(), connected, "on the same connection");
    leased_natively(&backend, &redis, "probed-again").await;
}

/// The probe that turning the native road on again starts is asked again
/// too: a lazily connected backend with the road off (its listener's probe
/// asks nothing), a user without `COMMAND`; turned on, its probe is
/// refused, and once the user is given `COMMAND` the road turns native
/// within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_of_a_road_turned_on_again_is_asked_again() {
    let redis = RedisServer::start_valkey();
    let url = acl_user(&redis, "again", &["+@all", "-command"]);
    let backend = RedisBackend::connect_lazy(&url)
        .expect("lazy connect")
        .native_commands(false)
        .local_dedup(false);
    // Connected, and its listener's check (`CONFIG GET`, then the probe,
    // which asks nothing while the road is off) done.
    let checked = within_10s(|| calls(&commandstats(&redis), "config|get") > 0).await;
    assert!(checked, "the listener checked the connection");
    let (k, t) = (key("turned-on"), Token::generate());
    let got = backend.acquire(&k, &t, Duration::from_secs(30)).await;
    assert!(matches!(got, Ok(Acquire::Acquired { .. })), "{got:?}");
    assert!(backend.release(&k, &t).await.unwrap());
    let refused = || calls(&commandstat(&redis, "rejected_calls"), "command|info");
    assert_eq!(refused(), 0, "nothing probed while the road is off");
    let backend = backend.native_commands(true);
    let probed = within_10s(|| refused() > 0).await;
    assert!(probed, "turned on: the probe asked and was refused");
    assert!(backend.native_calls().is_none(), "no answer yet: scripts");
    redis.cli(&["ACL", "SETUSER", "again", "+command"]);
    let native = within_10s(|| backend.native_calls().is_some()).await;
    assert!(native, "the probe was asked again and found DELIFEQ");
}

/// A busy connection on the native road sends its first 16 lease calls
/// natively at once and the rest batched: fred writes every `DELIFEQ` on
/// its own, and past a few calls at once a batch script costs the server
/// less than that many writes. With the server stopped, 40 acquires asked
/// in a row: 16 go out as native commands (`SET` and `PTTL` each), the other 24
/// wait in the connection's lane and go out as batch scripts; once the
/// server runs again, every one is answered and acquired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_native_connection_batches_beyond_sixteen_calls() {
    let redis = RedisServer::start_valkey();
    let backend = RedisBackend::connect(&redis.url()).await.unwrap();
    assert!(backend.native_calls().is_some(), "Valkey: native road");
    let before = commandstats(&redis);
    let tokens: Vec<Token> = (0..40).map(|_| Token::generate()).collect();
    redis.pause();
    // Each call is on its way (or in the lane) once asked, not when polled.
    let asked: Vec<_> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| backend.acquire(&key(&format!("busy-{i}")), t, Duration::from_secs(30)))
        .collect();
    redis.resume();
    for (i, call) in asked.into_iter().enumerate() {
        let answer = tokio::time::timeout(Duration::from_secs(5), call)
            .await
            .expect("answered once the server runs");
        assert!(
            matches!(answer, Ok(Acquire::Acquired { .. })),
            "call {i}: {answer:?}"
        );
    }
    let after = commandstats(&redis);
    // Each acquire one `SET`: 16 sent as themselves (the native calls),
    // the rest inside the batch scripts; none sends a `PTTL`.
    assert_eq!(
        calls(&after, "set") - calls(&before, "set"),
        40,
        "{after:?}"
    );
    assert_eq!(calls(&after, "pttl"), calls(&before, "pttl"), "{after:?}");
    assert_eq!(backend.native_calls(), Some(16));
    let batches = scripts(&after) - scripts(&before);
    assert!(
        (1..=24).contains(&batches),
        "the 24 others in one or a few batches: {batches} scripts"
    );
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(
            backend.release(&key(&format!("busy-{i}")), t).await.ok(),
            Some(true),
            "lease {i} held by its token"
        );
    }
}

/// 40 leases held on Valkey, then released while the server is stopped:
/// past the first 16 (native `DELIFEQ`, sent at once) the releases wait
/// in the lane and go out batched, and inside the batch script each is one
/// `DELIFEQ` too, not a `GET` and a `DEL` (a command less per request for
/// the server under load). A lone job the lane sends may be its own
/// script (`GET` + `DEL`): at most one here, as the lane has one batch in
/// flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_releases_run_delifeq_inside_the_script() {
    let redis = RedisServer::start_valkey();
    let backend = RedisBackend::connect(&redis.url()).await.unwrap();
    assert!(backend.native_calls().is_some(), "Valkey: native road");
    let tokens = acquire_many(&backend, "batched-release", 40).await;
    let before = commandstats(&redis);
    release_while_paused(&redis, &backend, "batched-release", &tokens, false).await;
    let after = commandstats(&redis);
    let delta = |name| calls(&after, name) - calls(&before, name);
    assert!(scripts(&after) > scripts(&before), "some went batched");
    assert!(delta("get") <= 1, "GET + DEL in a batch: {after:?}");
    assert_eq!(delta("delifeq") + delta("get"), 40, "{after:?}");
    assert_eq!(redis.dbsize(), 0);
}

/// Valkey with an ACL that forbids `DELIFEQ`, found native by the probe:
/// releases that go out batched, with `DELIFEQ` inside the script, are
/// refused there, sent again in a batch without it, and released; the road
/// turns to scripts. (The batched calls are awaited first, so that the
/// batch goes out before any of the direct calls' refusals is read.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_refused_delifeq_still_releases() {
    let (redis, url) = valkey_without_delifeq();
    let backend = RedisBackend::connect(&url).await.expect("connect");
    assert!(backend.native_calls().is_some(), "the probe found DELIFEQ");
    let tokens = acquire_many(&backend, "batch-noperm", 40).await;
    assert!(backend.native_calls().is_some(), "acquires are not refused");
    let before = commandstats(&redis);
    release_while_paused(&redis, &backend, "batch-noperm", &tokens, true).await;
    assert_eq!(redis.dbsize(), 0, "every lease released");
    assert_eq!(
        backend.native_calls(),
        None,
        "script road until the next probe"
    );
    let after = commandstats(&redis);
    // Refused (`rejected_calls`): the 16 sent natively at once, and
    // the batched ones inside their script.
    let refused = redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_delifeq:"))
        .and_then(|f| f.split(',').find_map(|f| f.strip_prefix("rejected_calls=")))
        .and_then(|n| n.trim().parse::<u64>().ok());
    assert!(
        refused > Some(16),
        "DELIFEQ refused inside a batch: {refused:?}"
    );
    // The 16 sent again as their script, the lane's lone first job (if
    // any), the batch refused inside and the batch sent again without
    // `DELIFEQ` (and their `EVAL` after `NOSCRIPT`): about 20. A refusal
    // read as a failed release would have each delivered again (40 and
    // more).
    let ran = scripts(&after) - scripts(&before);
    assert!((18..=30).contains(&ran), "{ran} scripts: {after:?}");
}

/// Release the leases `tokens` (keys as [`acquire_many`] names them), all
/// asked while the server is paused, so that the first 16 go out natively
/// and the rest wait in the lane; each must answer released once the
/// server runs, awaited in order or, `last_first`, the last asked first.
async fn release_while_paused(
    redis: &RedisServer,
    backend: &RedisBackend,
    prefix: &str,
    tokens: &[Token],
    last_first: bool,
) {
    redis.pause();
    let mut asked: Vec<_> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (i, backend.release(&key(&format!("{prefix}-{i}")), t)))
        .collect();
    redis.resume();
    if last_first {
        asked.reverse();
    }
    for (i, call) in asked {
        let answer = tokio::time::timeout(Duration::from_secs(5), call)
            .await
            .expect("answered once the server runs");
        assert_eq!(answer.ok(), Some(true), "release {i}");
    }
}

/// A Valkey whose user `limited` may run everything but `DELIFEQ` (the
/// probe still finds the command), and the URL that logs in as it.
fn valkey_without_delifeq() -> (RedisServer, String) {
    let redis = RedisServer::start_valkey();
    redis.cli(&[
        "ACL", "SETUSER", "limited", "on", ">secret", "~*", "&*", "+@all", "-delifeq",
    ]);
    let url = format!("redis://limited:secret@127.0.0.1:{}", redis.port());
    (redis, url)
}

/// `n` leases acquired on `backend`, keys `trl-native:{prefix-i}`, one at a time.
async fn acquire_many(backend: &RedisBackend, prefix: &str, n: usize) -> Vec<Token> {
    let tokens: Vec<Token> = (0..n).map(|_| Token::generate()).collect();
    for (i, t) in tokens.iter().enumerate() {
        let acquired = backend
            .acquire(&key(&format!("{prefix}-{i}")), t, Duration::from_secs(30))
            .await;
        assert!(
            matches!(acquired, Ok(Acquire::Acquired { .. })),
            "{acquired:?}"
        );
    }
    tokens
}

/// On the native road a lease call that gets no answer (the server stopped,
/// on a fred client without a command timeout) fails after the batch
/// timeout instead of waiting forever, and its connection is replaced:
/// served again once the server answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_call_without_answer_is_abandoned() {
    let redis = RedisServer::start_valkey();
    let client = RedisBackend::builder(&redis.url())
        .unwrap()
        .with_performance_config(|p| p.default_command_timeout = Duration::ZERO)
        .build()
        .unwrap();
    fred::interfaces::ClientLike::init(&client).await.unwrap();
    let backend = RedisBackend::new(client)
        .local_dedup(false)
        .batch_timeout(Duration::from_millis(500));
    // `new` probes in the background.
    let probed = retry_until(Duration::from_secs(5), Duration::from_millis(10), || {
        std::future::ready(backend.native_calls().ok_or(()))
    })
    .await;
    assert!(probed.is_ok(), "native road on Valkey");
    let t = Token::generate();
    redis.pause();
    let started = std::time::Instant::now();
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        backend.acquire(&key("stalled"), &t, Duration::from_secs(5)),
    )
    .await
    .expect("an answer within the batch timeout, not never");
    assert!(answer.is_err(), "{answer:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    redis.resume();
    let ok = retry_until(Duration::from_secs(10), Duration::from_millis(50), || {
        let backend = backend.clone();
        async move {
            let t = Token::generate();
            match backend
                .acquire(&key("after"), &t, Duration::from_secs(5))
                .await
            {
                Ok(Acquire::Acquired { .. }) => Ok(()),
                other => Err(other),
            }
        }
    })
    .await;
    assert!(ok.is_ok(), "{ok:?}");
}

/// What the server runs per lease on Valkey 9, each road on one server in
/// one run (`INFO commandstats`): the native road no script, the script
/// road one `EVALSHA` per call. The server CPU of each (`usec`) is printed
/// for the record, not asserted: speed is measured in `benches/wrk.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_road_runs_no_script_per_lease() {
    let redis = RedisServer::start_valkey();
    // (calls, usec) of `cmdstat_<name>` lines whose name passes `pick`.
    let stats = |pick: &dyn Fn(&str) -> bool| -> (u64, u64) {
        let info = redis.cli(&["INFO", "commandstats"]);
        let mut sum = (0, 0);
        for line in info.lines() {
            let Some((name, fields)) = line
                .strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
            else {
                continue;
            };
            if name == "info" || !pick(name) {
                continue;
            }
            for field in fields.split(',') {
                if let Some(n) = field.strip_prefix("calls=") {
                    sum.0 += n.parse::<u64>().unwrap_or(0);
                }
                if let Some(n) = field.strip_prefix("usec=") {
                    sum.1 += n.parse::<u64>().unwrap_or(0);
                }
            }
        }
        sum
    };
    let scripts = |name: &str| name.starts_with("eval") || name.starts_with("fcall");
    const N: u32 = 500;
    let mut seen = Vec::new();
    for native in [true, false] {
        let backend = RedisBackend::connect(&redis.url())
            .await
            .expect("connect")
            .local_dedup(false)
            .native_commands(native);
        // Warm (the script cache).
        let t = Token::generate();
        backend
            .acquire(&key("warm"), &t, Duration::from_secs(5))
            .await
            .unwrap();
        backend.release(&key("warm"), &t).await.unwrap();
        let (scripts_before, all_before) = (stats(&scripts), stats(&|_| true));
        for i in 0..N {
            let (k, t) = (key(&format!("cpu-{i}")), Token::generate());
            backend
                .acquire(&k, &t, Duration::from_secs(5))
                .await
                .unwrap();
            assert!(backend.release(&k, &t).await.unwrap());
        }
        let (scripts_after, all_after) = (stats(&scripts), stats(&|_| true));
        seen.push((
            scripts_after.0 - scripts_before.0,
            (all_after.1 - all_before.1) as f64 / f64::from(N),
        ));
    }
    eprintln!(
        "server CPU per lease (acquire + release) on Valkey: native {:.2} µs, scripts {:.2} µs",
        seen[0].1, seen[1].1
    );
    assert_eq!(seen[0].0, 0, "the native road ran scripts: {seen:?}");
    assert_eq!(
        seen[1].0,
        2 * u64::from(N),
        "the script road: one EVALSHA per acquire and per release: {seen:?}"
    );
}

/// Under `maxmemory` with `noeviction`, Valkey refuses `SET … IFEQ` (OOM);
/// the extend goes out as its script (`PEXPIRE` is not refused) in the same
/// call and extends, and the road stays native (the server has the
/// commands).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_extend_refused_for_memory_falls_back_to_the_script() {
    let redis = RedisServer::start_valkey_with(&["--maxmemory-policy", "noeviction"]);
    let backend = RedisBackend::connect(&redis.url())
        .await
        .expect("connect")
        .local_dedup(false);
    let t = Token::generate();
    let k = key("oom-extend");
    assert!(matches!(
        backend
            .acquire(&k, &t, Duration::from_secs(5))
            .await
            .unwrap(),
        Acquire::Acquired { .. }
    ));
    assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
    assert!(backend
        .extend(&k, &t, Duration::from_secs(60))
        .await
        .unwrap());
    let pttl: i64 = redis
        .cli(&["PTTL", "trl-native:{oom-extend}"])
        .parse()
        .unwrap();
    assert!(pttl > 50_000, "extended: {pttl}");
    assert!(backend.native_calls().is_some(), "still the native road");
    assert!(
        backend.release(&k, &t).await.unwrap(),
        "DELIFEQ is not refused"
    );
    assert_eq!(
        calls(&commandstats(&redis), "evalsha") + calls(&commandstats(&redis), "eval"),
        2
    );
}

/// Redis 7 (the script road) with a user who may run scripts but not
/// `SET` itself: a lone acquire's `SET … NX PX … GET` is refused
/// (`NOPERM`), sent again as its script (which the ACL refuses too: an
/// error, no lease), and acquires go as scripts from then on; granted
/// `SET`, they stay scripts until the server is probed again, at the next
/// reconnection, and then go as a plain `SET` again (the lease's only
/// script call is then its release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_plain_acquire_goes_as_its_script_until_probed_again() {
    let redis = RedisServer::start_redis();
    let url = acl_user(&redis, "noset", &["+@all", "-set"]);
    let backend = RedisBackend::connect(&url)
        .await
        .expect("connect")
        .local_dedup(false);
    let k = key("noset");
    let t = Token::generate();
    let refused = commandstat(&redis, "rejected_calls");
    let got = backend.acquire(&k, &t, Duration::from_secs(30)).await;
    assert!(got.is_err(), "SET denied, in the script too: {got:?}");
    assert_eq!(redis.dbsize(), 0, "no lease");
    let now = commandstat(&redis, "rejected_calls");
    assert_eq!(
        calls(&now, "set") - calls(&refused, "set"),
        2,
        "the plain SET, then the script's, each refused once: {now:?}"
    );
    redis.cli(&["ACL", "SETUSER", "noset", "+set"]);
    // The release script in the server's cache (no `NOSCRIPT` below).
    assert!(!backend.release(&k, &t).await.unwrap());
    // Granted: the script road, until the next probe.
    let before = commandstats(&redis);
    let got = backend.acquire(&k, &t, Duration::from_secs(30)).await;
    assert!(matches!(got, Ok(Acquire::Acquired { .. })), "{got:?}");
    assert!(backend.release(&k, &t).await.unwrap());
    let after = commandstats(&redis);
    assert_eq!(scripts(&after) - scripts(&before), 2, "acquire + release");
    // A reconnection probes the server, and the plain acquire is back.
    redis.cli(&["CLIENT", "KILL", "USER", "noset"]);
    let typed = retry_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let before = scripts(&commandstats(&redis));
            let got = backend.acquire(&k, &t, Duration::from_secs(30)).await;
            let _ = backend.release(&k, &t).await;
            // The release's script alone: the acquire was a plain `SET`.
            match (got, scripts(&commandstats(&redis)) - before) {
                (Ok(Acquire::Acquired { .. }), 1) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(typed.is_ok(), "plain SET again: {typed:?}");
    assert_eq!(redis.dbsize(), 0);
}
