use super::*;

#[test]
fn the_pattern_covers_only_this_key_space() {
    assert_eq!(channel_pattern("trl"), "trl:{*:idem");
    assert_eq!(channel_pattern("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\:{*:idem");
    assert!(is_ours("trl", b"trl:{ab}:cd:idem"));
    for other in [
        &b"trl:{ab}:cd:idemx"[..],
        b"trlx:{ab}:cd:idem",
        b"other:{ab}:idem",
        b"trl:idem",
        b"trl:{",
    ] {
        assert!(!is_ours("trl", other), "{:?}", std::str::from_utf8(other));
    }
}

/// The scope's quota against a real `redis-server` (a `RedisServer` of the
/// test harness): what a claim costs the server when its scope has room,
/// and that a full scope of expired entries takes new claims again.
mod quota_tests {
    use std::time::Duration;

    use bytes::Bytes;

    use crate::backend::{Claim, ClaimTerms, EntryKey, IdempotencyBackend, RedisBackend, Token};
    use crate::key::{KeySpace, LockKey};
    use tower_redis_lock_test_support::{eventually, RedisServer as Server};

    const LEASE: Duration = Duration::from_secs(10);
    const SHORT: Duration = Duration::from_millis(150);
    const ROOMY: (u64, u64) = (1_000, 1 << 30);

    fn digest(name: &str) -> LockKey {
        let mut w = KeySpace::default().writer();
        w.push("quota-test", name.as_bytes());
        w.push("run", Token::generate().as_bytes());
        w.finish()
    }

    fn entry(scope: &LockKey, name: &str) -> EntryKey {
        EntryKey::new(&KeySpace::default(), scope, &digest(name))
    }

    /// A key space whose prefix has glob characters and a backslash (kept
    /// as they are in the channel, escaped only in the pattern) hears its
    /// own publications (a backslash was dropped from the prefix the
    /// publications were matched against, and every one discarded, before).
    #[tokio::test]
    async fn a_prefix_with_a_backslash_hears_its_publications() {
        let server = Server::start();
        let backend = connect(&server).await;
        let prefix = r"sh\op*[1]";
        let mut feed = backend
            .feed(&KeySpace::new(prefix))
            .expect("Redis has a feed")
            .await
            .expect("subscribed");
        let channel = format!("{prefix}:{{abc}}:idem");
        let heard = eventually(Duration::from_secs(5), || {
            server.cli(&["PUBLISH", &channel, "sealed"]);
            match feed.try_recv() {
                Ok((c, m)) => c == channel.as_bytes() && m == "sealed",
                Err(_) => false,
            }
        })
        .await;
        assert!(heard, "a publication on {channel} reached the feed");
    }

    async fn connect(server: &Server) -> RedisBackend {
        RedisBackend::connect(&server.url())
            .await
            .expect("connect to the test redis-server")
    }

    async fn claim(
        backend: &RedisBackend,
        key: &EntryKey,
        token: &Token,
        lease: Duration,
        (entries, bytes): (u64, u64),
    ) -> Claim {
        backend
            .claim(key, token, b"fp", &ClaimTerms::new(lease, entries, bytes))
            .await
            .expect("claim answered")
    }

    /// The scope's sorted set, by its key's name.
    fn quota_key(server: &Server) -> String {
        let keys = server.cli(&["--raw", "KEYS", "*:idem-quota"]);
        keys.lines().next().unwrap_or_default().to_owned()
    }

    /// The scope's byte count is the sum of what its members say they hold.
    fn assert_bytes_counted_once(server: &Server) {
        let quota = quota_key(server);
        let members = server.cli(&["--raw", "ZRANGE", &quota, "0", "-1"]);
        let held: u64 = members
            .lines()
            .filter_map(|m| m.rsplit(':').next()?.parse::<u64>().ok())
            .sum();
        let bytes_key = quota.replace(":idem-quota", ":idem-bytes");
        let counted: u64 = server.cli(&["GET", &bytes_key]).trim().parse().unwrap();
        assert_eq!(counted, held, "members {members:?}");
    }

    /// Entries (claims and records) in the server.
    fn live_entries(server: &Server) -> usize {
        server
            .cli(&["--raw", "KEYS", "*:idem"])
            .lines()
            .filter(|l| !l.is_empty())
            .count()
    }

    /// A claim whose scope has room reads nothing it does not need: no
    /// search for expired entries (that waits until the scope is full) and,
    /// in a scope with no entries yet, no byte count. Each `redis.call` in
    /// a script costs about as much as a small command of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_with_room_searches_no_expired_entries() {
        let server = Server::start();
        let backend = connect(&server).await;
        let scope = digest("scope");
        let token = Token::generate();
        let first = entry(&scope, "first");
        assert_eq!(
            claim(&backend, &first, &token, LEASE, ROOMY).await,
            Claim::Claimed
        );
        assert_eq!(server.command_calls("zrangebyscore"), 0, "no prune");
        assert_eq!(
            server.command_calls("get"),
            0,
            "a fresh scope holds no bytes"
        );
        let record = Bytes::from_static(b"a record");
        assert!(backend
            .complete(&first, &token, b"fp", &record, LEASE)
            .await
            .expect("complete answered"));
        let second = entry(&scope, "second");
        assert_eq!(
            claim(&backend, &second, &token, LEASE, ROOMY).await,
            Claim::Claimed
        );
        assert_eq!(server.command_calls("zrangebyscore"), 0, "no prune");
        assert_eq!(
            server.command_calls("get"),
            1,
            "a scope with a record reads its byte count once"
        );
        assert_eq!(server.cli(&["ZCARD", &quota_key(&server)]), "2");
    }

    /// A scope full of entries that have expired takes a new claim: the
    /// claim that finds it full drops the expired ones first, and only a
    /// scope full of live entries answers `OverQuota`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_scope_of_expired_entries_takes_new_claims() {
        let server = Server::start();
        let backend = connect(&server).await;
        let scope = digest("scope");
        let token = Token::generate();
        let three = (3, 1 << 30);
        // A live entry keeps the scope's set alive (a set whose entries
        // have all expired expires with them).
        assert_eq!(
            claim(&backend, &entry(&scope, "live"), &token, LEASE, three).await,
            Claim::Claimed
        );
        for name in ["one", "two"] {
            assert_eq!(
                claim(&backend, &entry(&scope, name), &token, SHORT, three).await,
                Claim::Claimed
            );
        }
        let third = entry(&scope, "three");
        assert!(
            matches!(
                claim(&backend, &third, &token, LEASE, three).await,
                Claim::OverQuota { .. }
            ),
            "three live claims fill a scope of three"
        );
        assert!(
            eventually(Duration::from_secs(5), || live_entries(&server) == 1).await,
            "the short claims expire"
        );
        assert_eq!(
            claim(&backend, &third, &token, LEASE, three).await,
            Claim::Claimed,
            "the expired entries make room"
        );
        assert_eq!(
            server.cli(&["ZCARD", &quota_key(&server)]),
            "2",
            "only the live claims are counted"
        );
    }

    /// A scope full by its bytes, whose expired record lies behind more
    /// than one batch (64) of expired claims (which count no bytes), takes
    /// a new claim in that same call: the claim keeps dropping expired
    /// entries while its scope is still full.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bytes_freed_behind_many_expired_claims_make_room_at_once() {
        let server = Server::start();
        let backend = connect(&server).await;
        let scope = digest("scope");
        let token = Token::generate();
        // A live record keeps the scope's set and byte count alive.
        let live = entry(&scope, "live");
        assert_eq!(
            claim(&backend, &live, &token, LEASE, ROOMY).await,
            Claim::Claimed
        );
        let small = Bytes::from_static(b"8 bytes.");
        assert!(backend
            .complete(&live, &token, b"fp", &small, LEASE)
            .await
            .expect("complete answered"));
        for i in 0..70 {
            let key = entry(&scope, &format!("claim-{i}"));
            assert_eq!(
                claim(&backend, &key, &token, SHORT, ROOMY).await,
                Claim::Claimed
            );
        }
        let recorded = entry(&scope, "recorded");
        assert_eq!(
            claim(&backend, &recorded, &token, SHORT, ROOMY).await,
            Claim::Claimed
        );
        let record = Bytes::from(vec![b'r'; 64]);
        assert!(backend
            .complete(&recorded, &token, b"fp", &record, SHORT)
            .await
            .expect("complete answered"));
        // A record counts its bytes and its key's.
        let live_bytes = (small.len() + live.entry().len()) as u64;
        let room = (1_000, live_bytes + 1);
        let next = entry(&scope, "next");
        assert!(
            matches!(
                claim(&backend, &next, &token, LEASE, room).await,
                Claim::OverQuota { .. }
            ),
            "two live records fill a share of one record's bytes"
        );
        assert!(
            eventually(Duration::from_secs(5), || live_entries(&server) == 1).await,
            "the short entries expire"
        );
        assert_eq!(
            claim(&backend, &next, &token, LEASE, room).await,
            Claim::Claimed,
            "the expired record's bytes are freed in one claim"
        );
        let bytes = quota_key(&server).replace("idem-quota", "idem-bytes");
        assert_eq!(server.cli(&["GET", &bytes]), live_bytes.to_string());
        assert_eq!(
            server.cli(&["ZCARD", &quota_key(&server)]),
            "2",
            "the live record and the new claim"
        );
    }

    /// A key used again after its record expired (the same digest, a
    /// record of the same size) counts its bytes once: the byte count is
    /// always the sum of what the scope's members say they hold.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_used_again_after_its_record_expired_counts_its_bytes_once() {
        let server = Server::start();
        let backend = connect(&server).await;
        let scope = digest("scope");
        // A live record keeps the scope's set and byte count alive.
        let live = entry(&scope, "live");
        let token = Token::generate();
        assert_eq!(
            claim(&backend, &live, &token, LEASE, ROOMY).await,
            Claim::Claimed
        );
        let record = Bytes::from_static(b"a record");
        assert!(backend
            .complete(&live, &token, b"fp", &record, LEASE)
            .await
            .expect("answered"));
        let again = entry(&scope, "again");
        for round in 0..3 {
            let token = Token::generate();
            assert_eq!(
                claim(&backend, &again, &token, LEASE, ROOMY).await,
                Claim::Claimed,
                "round {round}: the key is free again"
            );
            assert!(backend
                .complete(&again, &token, b"fp", &record, SHORT)
                .await
                .expect("answered"));
            assert!(
                eventually(Duration::from_secs(5), || live_entries(&server) == 1).await,
                "round {round}: the record expires"
            );
        }
        assert_bytes_counted_once(&server);
    }

    /// A claim that lapsed while its handler ran (it expired unrenewed, or
    /// a restart lost it) with nothing in its place: the handler's record
    /// is kept all the same, under the claim's fingerprint, and the retry
    /// replays it instead of running the handler again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lapsed_claim_with_nothing_in_its_place_keeps_its_record() {
        let server = Server::start();
        let backend = connect(&server).await;
        let scope = digest("scope");
        let key = entry(&scope, "lapsed");
        let token = Token::generate();
        assert_eq!(
            claim(&backend, &key, &token, LEASE, ROOMY).await,
            Claim::Claimed
        );
        // The claim is gone, as after its lease passed unrenewed.
        let entry_key = String::from_utf8(key.entry().to_vec()).unwrap();
        assert_eq!(server.cli(&["DEL", &entry_key]), "1");
        let record = Bytes::from_static(b"the handler's answer");
        assert!(
            backend
                .complete(&key, &token, b"fp", &record, LEASE)
                .await
                .expect("answered"),
            "the record is kept"
        );
        let retry = Token::generate();
        assert_eq!(
            claim(&backend, &key, &retry, LEASE, ROOMY).await,
            Claim::Done(record.clone()),
            "the retry replays it"
        );
        let other = backend
            .claim(
                &key,
                &retry,
                b"other",
                &ClaimTerms::new(LEASE, ROOMY.0, ROOMY.1),
            )
            .await
            .expect("answered");
        assert_eq!(other, Claim::Mismatch, "bound to the claim's fingerprint");
        // Only another request's abandon mark in its place (left while the
        // key was free): recorded as well.
        let marked = entry(&scope, "marked");
        let own = Token::generate();
        assert_eq!(
            claim(&backend, &marked, &own, LEASE, ROOMY).await,
            Claim::Claimed
        );
        let marked_key = String::from_utf8(marked.entry().to_vec()).unwrap();
        let gave_up = String::from_utf8(Token::generate().to_hex().to_vec()).unwrap();
        assert_eq!(server.cli(&["DEL", &marked_key]), "1");
        assert_eq!(
            server.cli(&["HSET", &marked_key, "s", "a", "t", &gave_up]),
            "2"
        );
        assert!(
            backend
                .complete(&marked, &own, b"fp", &record, LEASE)
                .await
                .expect("answered"),
            "recorded over another's abandon mark"
        );
        assert_eq!(
            claim(&backend, &marked, &retry, LEASE, ROOMY).await,
            Claim::Done(record.clone())
        );
        // Another request's claim in its place is not overwritten.
        let taken = entry(&scope, "taken");
        let mine = Token::generate();
        assert_eq!(
            claim(&backend, &taken, &mine, LEASE, ROOMY).await,
            Claim::Claimed
        );
        let taken_key = String::from_utf8(taken.entry().to_vec()).unwrap();
        assert_eq!(server.cli(&["DEL", &taken_key]), "1");
        let theirs = Token::generate();
        assert_eq!(
            claim(&backend, &taken, &theirs, LEASE, ROOMY).await,
            Claim::Claimed
        );
        assert!(
            !backend
                .complete(&taken, &mine, b"fp", &record, LEASE)
                .await
                .expect("answered"),
            "another's claim holds the key"
        );
        assert_bytes_counted_once(&server);
    }

    /// Redis full under `noeviction`: a claim taken before still renews
    /// and completes (the store's rule: a record is never refused for
    /// room, its handler ran), while a new claim is refused (503).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_taken_before_redis_filled_up_renews_and_completes() {
        let server = Server::start();
        let backend = connect(&server).await;
        let scope = digest("scope");
        let key = entry(&scope, "taken");
        let token = Token::generate();
        assert_eq!(
            claim(&backend, &key, &token, LEASE, ROOMY).await,
            Claim::Claimed
        );
        assert_eq!(
            server.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
            "OK"
        );
        let info = server.cli(&["INFO", "memory"]);
        let used: u64 = info
            .lines()
            .find_map(|l| l.trim().strip_prefix("used_memory:"))
            .and_then(|v| v.parse().ok())
            .expect("used_memory in INFO");
        // Full: a limit below what Redis holds already (as after a
        // co-tenant's writes), so that every write that needs room is
        // refused with OOM.
        let cap = (used / 2).to_string();
        assert_eq!(server.cli(&["CONFIG", "SET", "maxmemory", &cap]), "OK");
        let full = server.cli(&["SET", "co-tenant", "x"]);
        assert!(full.contains("OOM"), "Redis is full: {full}");
        assert!(
            backend.extend(&key, &token, LEASE).await.expect("answered"),
            "the claim renews"
        );
        let record = Bytes::from_static(b"a record");
        assert!(
            backend
                .complete(&key, &token, b"fp", &record, LEASE)
                .await
                .expect("answered"),
            "the record is written"
        );
        let new = entry(&scope, "new");
        let refused = backend
            .claim(
                &new,
                &Token::generate(),
                b"fp",
                &ClaimTerms::new(LEASE, ROOMY.0, ROOMY.1),
            )
            .await;
        assert!(refused.is_err(), "a new claim is refused: {refused:?}");
    }

    /// A subscriber whose start is given up on (the feed's bound passed
    /// while Redis did not answer, or the request that started it went
    /// away) quits: fred's connection task outlives the client handle, and
    /// would keep an idle connection, reconnecting, for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_subscriber_given_up_on_while_starting_quits() {
        let server = Server::start();
        let backend = connect(&server).await;
        let clients = |s: &Server| {
            s.cli(&["CLIENT", "LIST"])
                .lines()
                .filter(|l| !l.contains("cmd=client"))
                .count()
        };
        let before = clients(&server);
        server.cli(&["CLIENT", "PAUSE", "1500", "ALL"]);
        let start = backend.feed(&KeySpace::default()).expect("Redis publishes");
        let started = tokio::time::timeout(Duration::from_millis(300), start).await;
        assert!(started.is_err(), "paused: no subscriber yet");
        // Once Redis answers again, the connection given up on is closed.
        assert!(
            eventually(Duration::from_secs(5), || clients(&server) == before).await,
            "{} connections, {before} before the subscriber was started",
            clients(&server)
        );
    }
}
