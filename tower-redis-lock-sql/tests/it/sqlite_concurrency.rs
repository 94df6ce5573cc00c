//! SQLite with the defaults an application starts from: sqlx's pool
//! options (its `busy_timeout`) and the layer's default deadline. Payment
//! A holds SQLite's write lock from its `INSERT` through 1 s of work in its
//! transaction; payment B, another key, comes in meanwhile. B is answered
//! 201 when its turn comes, or 503 with `Retry-After`; then its key is
//! free: its retries are never answered 409 (in flight), and one gets 201.
//! One charge per key. The same with a pool `busy_timeout` (300 ms)
//! shorter than A's work.

use crate::common;

use std::time::Duration;

use common::charging::serve_charging;
use common::stores::{layer, pay, send, Env, Kind, Pools};

async fn two_payments(busy_timeout: Option<Duration>) {
    let env = Env::new(Kind::Sqlite).await;
    env.batch("CREATE TABLE charges (k text NOT NULL)").await;
    let store = env
        .store(&Pools {
            busy_timeout,
            ..Pools::default()
        })
        .await;
    let (addr, app) = serve_charging(layer(&store)).await;

    let a = tokio::spawn(send(addr, pay("a", "?work_ms=1000")));
    // A holds the write lock from here to its commit.
    tokio::time::timeout(Duration::from_secs(5), app.inserted.notified())
        .await
        .expect("payment A inserts its charge");
    let started = tokio::time::Instant::now();
    let mut b = vec![send(addr, pay("b", "")).await.0];
    // A client's retry schedule (`Retry-After` is 1 s; it retries sooner).
    for at in [500, 1_500] {
        if b.last().is_some_and(|s| s == "201") {
            break;
        }
        tokio::time::sleep_until(started + Duration::from_millis(at)).await;
        b.push(send(addr, pay("b", "")).await.0);
    }
    let a = a.await.unwrap().0;
    // After A ended: B's key is free, its retry runs (or replays its 201).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !b.last().is_some_and(|s| s.starts_with("201")) && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(250)).await;
        b.push(send(addr, pay("b", "")).await.0);
    }
    let charged_a = env
        .count("SELECT count(*) FROM charges WHERE k = 'a'")
        .await;
    let charged_b = env
        .count("SELECT count(*) FROM charges WHERE k = 'b'")
        .await;
    let report = format!(
        "busy_timeout {busy_timeout:?}: A {a:?}, B's answers {b:?}, charges a {charged_a} b \
         {charged_b}, handler runs {}",
        app.runs()
    );
    println!("{report}");
    assert_eq!(a, "201", "{report}");
    assert!(
        matches!(b[0].as_str(), "201" | "503 unavailable retry-after"),
        "B's first answer: 201 or 503 with Retry-After; {report}"
    );
    assert!(
        !b.iter().any(|s| s.starts_with("409")),
        "B's key is never left in flight; {report}"
    );
    assert!(
        b.last().is_some_and(|s| s.starts_with("201")),
        "B is charged in the end; {report}"
    );
    assert_eq!((charged_a, charged_b), (1, 1), "{report}");
    // A ran once; B once more than the times it was answered 503 (a run
    // whose commit was refused is answered 503), never more.
    let refused = b.iter().filter(|s| s.starts_with("503")).count() as u64;
    assert!(
        (2..=2 + refused).contains(&app.runs()),
        "no run the answers do not account for: {report}"
    );
}

#[test]
fn sqlite_with_default_settings_a_second_payment_waits_or_is_free_to_retry() {
    common::run(|| two_payments(None));
}

#[test]
fn sqlite_with_a_busy_timeout_shorter_than_a_transaction_a_second_payment_is_free_to_retry() {
    common::run(|| two_payments(Some(Duration::from_millis(300))));
}
