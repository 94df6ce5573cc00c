//! What the `exactly_once` example prints: a `DATABASE_URL` with an `@` in
//! its password shows in no part of its start-up error (moved here with the
//! example from the middleware's `tests/it/redis_security.rs`, where its
//! other examples keep the same check).

use std::process::Command;
use std::time::Duration;

use crate::common::examples::example_binary;

/// Everything `binary` prints (stdout and stderr) with `env` set, until its
/// first stdout line (the start-up line; then it is stopped) or its exit (a
/// start-up error). A watchdog stops it after 30 s.
fn printed(binary: &std::path::Path, env: &[(&str, &str)]) -> String {
    use std::io::{BufRead, Read};
    let mut cmd = Command::new(binary);
    cmd.env_remove("REDIS_URL")
        .env_remove("REDLOCK_URLS")
        .env_remove("DATABASE_URL")
        .env("ADDR", "127.0.0.1:0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start the example");
    let pid = child.id().to_string();
    let (done, stop) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if stop.recv_timeout(Duration::from_secs(30)).is_err() {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
        }
    });
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut out = String::new();
    stdout.read_line(&mut out).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let _ = done.send(());
    watchdog.join().unwrap();
    stdout.read_to_string(&mut out).unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    out
}

/// A `DATABASE_URL` with an `@` in its password: the example stops with an
/// error naming the variable (no database of that name, PostgreSQL up or
/// not), and no part of the secret is in what it prints.
#[test]
fn the_example_prints_no_part_of_a_database_url_secret() {
    let exactly_once = example_binary("exactly_once");
    let database_url = "postgres://postgres:pg@s3cret@127.0.0.1:5432/trl_no_such_database";
    let out = printed(&exactly_once, &[("DATABASE_URL", database_url)]);
    assert!(
        out.contains("DATABASE_URL"),
        "the error names the variable: {out}"
    );
    assert!(!out.contains("s3cret"), "printed: {out}");
}
