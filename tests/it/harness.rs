//! The fixture harness itself: a static fixture (the cluster, a sentinel
//! group) is started once per binary and every test that uses it fails when
//! its start does, so the start must tell its own servers from a server that
//! took one of its ports first, and retry on fresh ports.

use std::time::{Duration, Instant};

use crate::common::{cli, spawn_guarded, RedisServer};

/// A port held by another test's server: `spawn_guarded` says so (it must
/// not take that server's `PONG` for its own), and leaves that server alone.
#[test]
fn a_guarded_start_on_a_taken_port_is_an_error_not_someone_elses_server() {
    let other = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("trl-harness-{}/n0", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let args: Vec<String> = ["--port", &other.port.to_string(), "--bind", "127.0.0.1"]
        .iter()
        .chain(&["--save", "", "--dir", dir.to_str().unwrap()])
        .map(|s| s.to_string())
        .collect();
    refused_at_once(&dir, other.port, &args, "a port another server holds");
    assert_eq!(other.cli(&["PING"]), "PONG", "the other server was hurt");
    assert_eq!(cli(other.port, &["SET", "still", "mine"]), "OK");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// A server that exits at start (here: an option it does not know) is
/// noticed at once, not at the 10 s deadline.
#[test]
fn a_guarded_server_that_exits_at_start_is_an_error_at_once() {
    let port = crate::common::free_port();
    let dir = std::env::temp_dir().join(format!("trl-harness-exit-{}/n0", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let args: Vec<String> = ["--port", &port.to_string(), "--no-such-option", "yes"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    refused_at_once(&dir, port, &args, "a server that exited at start");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// `spawn_guarded` answers an error for `what`, and before its 10 s
/// deadline.
fn refused_at_once(dir: &std::path::Path, port: u16, args: &[String], what: &str) {
    let began = Instant::now();
    let started = spawn_guarded(dir, port, args);
    assert!(started.is_err(), "spawn_guarded reported success on {what}");
    assert!(
        began.elapsed() < Duration::from_secs(9),
        "{what} was noticed only at the deadline ({:?}): {started:?}",
        began.elapsed()
    );
}
