//! The Valkey harness: [`RedisServer::start_valkey`] runs the `valkey-server`
//! that `TRL_VALKEY_SERVER` names (`scripts/test.sh` sets it from
//! `scripts/valkey.sh`), a Valkey ≥ 9 that answers the native
//! compare-and-delete the Redis store will use. Without the variable this
//! test fails with the hint; it never skips.

use tower_redis_lock_test_support::RedisServer;

#[test]
fn a_valkey_server_is_valkey_9_and_answers_delifeq() {
    let mut server = RedisServer::start_valkey();
    assert!(server.is_valkey());
    let info = server.cli(&["INFO", "server"]);
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("valkey_version:"))
        .unwrap_or_else(|| panic!("INFO server names no valkey_version: {info}"));
    let major: u32 = version
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    assert!(major >= 9, "Valkey {version}: DELIFEQ needs 9.0 or newer");

    assert_eq!(server.cli(&["SET", "k", "mine"]), "OK");
    assert_eq!(
        server.cli(&["DELIFEQ", "k", "other"]),
        "0",
        "another value: kept"
    );
    assert_eq!(server.cli(&["GET", "k"]), "mine");
    assert_eq!(
        server.cli(&["DELIFEQ", "k", "mine"]),
        "1",
        "its own value: deleted"
    );
    assert_eq!(server.cli(&["EXISTS", "k"]), "0");

    // The harness's restart (same port) starts Valkey again, not redis-server.
    let port = server.port();
    server.restart();
    assert_eq!(server.port(), port);
    assert!(server.cli(&["INFO", "server"]).contains("valkey_version:"));
    assert_eq!(
        server.cli(&["DELIFEQ", "k", "mine"]),
        "0",
        "nothing kept across a restart"
    );
}
