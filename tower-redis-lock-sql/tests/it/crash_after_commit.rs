//! The process dies after the handler's own `COMMIT`.
//!
//! The child is this test binary itself, re-run with `--ignored --exact
//! crash_after_commit::child` and `TRL_CRASH_*` variables naming the store
//! and the database: it serves a handler that inserts a charge through
//! the request's transaction, runs `COMMIT` itself, prints `committed` and
//! blocks. The test SIGKILLs it there, then sends the same request to a
//! fresh server in this process on the same database:
//!
//! - PostgreSQL: 500 `transaction-ended` (after 409 at most while
//!   PostgreSQL notices the dead session; polled, and final before 3/4 of
//!   the claim's TTL);
//! - SQLite: 409 in flight until the first claim's TTL passes, then 500
//!   `transaction-ended`.
//!
//! Never a second charge; the handler never runs in the second server.

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::charging::serve_charging;
use common::stores::{
    every_store, exec, insert_charge, key_of, layer, pay, send, Env, Kind, Pools,
};
use tokio::io::{AsyncBufReadExt, BufReader};

/// The claim TTL of both servers.
const TTL: Duration = Duration::from_secs(2);

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Postgres => "postgres",
        Kind::Sqlx => "sqlx",
        Kind::Sqlite => "sqlite",
    }
}

/// The child's server: charge, `COMMIT`, say so, block. Run by the tests
/// below in a process of its own, never on its own.
#[test]
#[ignore = "the child process of the crash_after_commit tests; they run it"]
fn child() {
    let kind = match std::env::var("TRL_CRASH_KIND").as_deref() {
        Ok("postgres") => Kind::Postgres,
        Ok("sqlx") => Kind::Sqlx,
        Ok("sqlite") => Kind::Sqlite,
        other => panic!("TRL_CRASH_KIND {other:?}: run by the crash_after_commit tests"),
    };
    let at = std::env::var("TRL_CRASH_AT").expect("TRL_CRASH_AT");
    common::run(|| async move {
        let env = Env::attach(kind, &at).await;
        let store = env.store(&Pools::default()).await;
        let handler = |req: Request| async move {
            let (parts, _) = req.into_parts();
            let ext = &parts.extensions;
            let charged = exec(ext, &insert_charge(&key_of(&parts.headers))).await;
            let committed = exec(ext, "COMMIT").await;
            println!("committed {charged:?} {committed:?}");
            std::future::pending::<()>().await;
            StatusCode::CREATED
        };
        let router = Router::new().route("/w", post(handler).layer(layer(&store).ttl(TTL)));
        let addr = common::serve(router).await;
        println!("listening on {addr}");
        std::future::pending::<()>().await;
    });
}

type ChildLines = tokio::io::Lines<BufReader<tokio::process::ChildStdout>>;

/// The rest of the child's first line that starts with `prefix` (at most
/// 30 s).
async fn line_with(lines: &mut ChildLines, prefix: &'static str) -> String {
    let read = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.trim().to_owned();
            }
        }
        panic!("the child ended before `{prefix}`");
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .unwrap_or_else(|_| panic!("no `{prefix}` from the child in 30 s"))
}

async fn killed_after_commit(kind: Kind) {
    let env = Env::new(kind).await;
    env.batch("CREATE TABLE charges (k text NOT NULL)").await;
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "crash_after_commit::child",
            "--nocapture",
        ])
        .env("TRL_CRASH_KIND", kind_name(kind))
        .env("TRL_CRASH_AT", env.at())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("re-run this test binary as the child");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let child_addr: std::net::SocketAddr = line_with(&mut lines, "listening on ")
        .await
        .parse()
        .unwrap();
    let cut_off = tokio::spawn(send(child_addr, pay("k1", "")));
    let committed = line_with(&mut lines, "committed").await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let killed_at = tokio::time::Instant::now();
    let cut_off = cut_off.await.unwrap().0;

    // A fresh server on the same database.
    let store = env.store(&Pools::default()).await;
    // The same payments route, its handler counted.
    let (addr, app) = serve_charging(layer(&store).ttl(TTL)).await;
    let mut answers = Vec::new();
    let bound = TTL + Duration::from_secs(5);
    loop {
        let (s, _) = send(addr, pay("k1", "")).await;
        let in_flight = s.starts_with("409");
        answers.push((killed_at.elapsed().as_millis(), s));
        if !in_flight || killed_at.elapsed() > bound {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let again = send(addr, pay("k1", "")).await.0;
    let report = format!(
        "{kind:?}: the child {committed:?}, its request {cut_off:?}; the fresh server's answers \
         (ms after the kill) {answers:?}, then {again:?}; its handler runs {}, charges {}",
        app.runs(),
        env.charges().await
    );
    println!("{report}");
    assert_eq!(
        committed, "Ok(()) Ok(())",
        "the child charged and committed: {report}"
    );
    assert_eq!(env.charges().await, 1, "never a second charge: {report}");
    assert_eq!(app.runs(), 0, "the handler never runs again: {report}");
    // Replayed or not, the same final answer.
    let (_, last) = answers.last().unwrap();
    assert_eq!(
        last.trim_end_matches(" replayed"),
        "500 transaction-ended",
        "{report}"
    );
    assert_eq!(
        again.trim_end_matches(" replayed"),
        "500 transaction-ended",
        "{report}"
    );
    for (at, s) in &answers[..answers.len() - 1] {
        assert!(
            s.starts_with("409"),
            "only 409 before the final answer: {report}"
        );
        if kind == Kind::Sqlite {
            assert!(*at < TTL.as_millis() + 200, "409 past the TTL: {report}");
        }
    }
    match kind {
        // The claim row of the dead process stands until its TTL.
        Kind::Sqlite => assert!(
            answers[0].1.starts_with("409"),
            "in flight at first: {report}"
        ),
        // PostgreSQL sees the session die with the process: final well
        // before the claim's TTL would pass.
        _ => assert!(
            answers.last().unwrap().0 < TTL.as_millis() * 3 / 4,
            "final before the TTL: {report}"
        ),
    }
}

every_store!(
    killed_after_its_own_commit_the_key_is_final,
    killed_after_commit
);
