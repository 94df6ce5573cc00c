//! The bank test: fencing tokens carried into PostgreSQL keep a ledger exact
//! while leases expire under real process pauses.
//!
//! Two instances of `examples/ledger.rs` run as separate processes on one
//! Redis (started here) and one PostgreSQL database (created here on
//! 127.0.0.1:5432, dropped at the end, also on failure). Hundreds of workers
//! debit one account over both instances, each handler sitting `DELAY_MS`
//! between its read and its write, with a lease TTL of `TTL_MS`. Meanwhile
//! one instance is frozen (`SIGSTOP`) for longer than the TTL, again and
//! again: its lease expires while its handler still runs, and the other
//! instance takes over.
//!
//! With fencing, every debit answered 200 is in the balance exactly once and
//! the paused handlers are refused ("lease lost"). Without fencing, the same
//! run loses updates: the test asserts that too, so it proves it can fail.
//!
//! Needs PostgreSQL on 127.0.0.1:5432 (user `postgres`, trust auth; `.ci/run`
//! starts or installs it) and the `ledger` example binary, which the test
//! builds with cargo into its own target directory (a no-op when it is
//! fresh). An unreachable PostgreSQL is a loud failure, never a skip.

use crate::common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::examples::example_binary;
use common::pg::{pg_connect, Database};
use common::{req, send, Conn, RedisServer, Rng};

const ACCOUNT: &str = "acct-1";
const INITIAL: i64 = 1_000_000_000;
/// Lease TTL of both instances.
const TTL_MS: u64 = 300;
/// How long each handler sits between its read and its write.
const DELAY_MS: u64 = 50;
/// How long one instance stays frozen: well past the TTL plus a handler.
const PAUSE_MS: u64 = 2 * TTL_MS + 100;
/// Concurrent workers on the instance that gets paused, and on the other.
const WORKERS_PAUSED: usize = 120;
const WORKERS_OTHER: usize = 80;
/// Pause rounds: at least `MIN_ROUNDS`, then until `TARGET_HITS` pauses hit a
/// handler between its read and its write, at most `MAX_ROUNDS`.
const MIN_ROUNDS: usize = 10;
const MAX_ROUNDS: usize = 30;
const TARGET_HITS: u64 = 3;
/// Upper bound of requests per worker (the loop also ends with the rounds).
const MAX_REQUESTS_PER_WORKER: usize = 2_000;

/// One ledger process, killed on drop (resumed first if frozen).
struct Ledger {
    child: Child,
    addr: SocketAddr,
    exited: bool,
}

impl Ledger {
    fn start(bin: &PathBuf, db: &Database, redis: &RedisServer, fencing: bool) -> Self {
        let mut child = Command::new(bin)
            .env("ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", db.url())
            .env("REDIS_URL", redis.url())
            .env("LOCK_TTL_MS", TTL_MS.to_string())
            .env("FENCING", if fencing { "1" } else { "0" })
            .env_remove("REDLOCK_URLS")
            // Warnings (lost leases, no secret) are expected here.
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the ledger example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| {
                let _ = child.kill();
                panic!("the ledger did not start (its first line: {line:?}); see its stderr above")
            });
        assert!(
            line.contains(if fencing { "fencing on" } else { "fencing off" }),
            "{line}"
        );
        Self {
            child,
            addr,
            exited: false,
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill {sig} {} failed", self.child.id());
    }

    /// SIGTERM, then wait (bounded) for a clean exit: graceful shutdown.
    fn terminate(mut self) {
        self.signal("-TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                self.exited = true;
                assert!(status.success(), "ledger exited with {status} on SIGTERM");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "ledger still running 10 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    async fn stats(&self) -> (u64, u64) {
        let stats = send(self.addr, req("GET", "/stats", &[], "")).await.json();
        (
            stats["applied"].as_u64().unwrap(),
            stats["stale"].as_u64().unwrap(),
        )
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        if self.exited {
            return;
        }
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the clients saw.
#[derive(Default)]
struct Tally {
    /// (amount, balance answered) of every 200.
    ok: Vec<(i64, i64)>,
    /// 409 from the layer: the lease was held.
    held: u64,
    /// 409 "Lease lost" from the handler.
    lease_lost: u64,
    /// 503 (a lock deadline missed around a pause).
    unavailable: u64,
    other: Vec<(u16, String)>,
    requests: u64,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.ok.extend(other.ok);
        self.held += other.held;
        self.lease_lost += other.lease_lost;
        self.unavailable += other.unavailable;
        self.other.extend(other.other);
        self.requests += other.requests;
    }
}

async fn worker(addr: SocketAddr, salt: u64, stop: Arc<AtomicBool>) -> Tally {
    let mut rng = Rng::new(salt);
    let mut conn = Conn::open(addr).await;
    let mut tally = Tally::default();
    let uri = format!("/accounts/{ACCOUNT}/debit?delay_ms={DELAY_MS}");
    for _ in 0..MAX_REQUESTS_PER_WORKER {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let amount = rng.range(1, 9) as i64;
        let reply = conn
            .send(req(
                "POST",
                &uri,
                &[("content-type", "application/json")],
                &format!(r#"{{"amount":{amount}}}"#),
            ))
            .await;
        tally.requests += 1;
        let body = reply.json();
        match reply.status {
            200 => tally.ok.push((amount, body["balance"].as_i64().unwrap())),
            409 if body["title"] == "Lease lost" => tally.lease_lost += 1,
            409 => tally.held += 1,
            503 => tally.unavailable += 1,
            status => tally
                .other
                .push((status, String::from_utf8_lossy(&reply.body).into_owned())),
        }
        if reply.status != 200 {
            // Pacing between retries, not synchronisation.
            tokio::time::sleep(Duration::from_millis(rng.range(20, 60))).await;
        }
    }
    tally
}

/// The journal, in write order: (amount, balance before, balance after).
async fn journal(db: &tokio_postgres::Client) -> Vec<(i64, i64, i64)> {
    db.query(
        "SELECT amount, balance_before, balance_after FROM debits WHERE account = $1 ORDER BY seq",
        &[&ACCOUNT],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// Debits that read a balance another debit had already replaced: each one
/// overwrote (lost) at least one update.
fn chain_breaks(journal: &[(i64, i64, i64)]) -> usize {
    let mut expected_before = INITIAL;
    let mut breaks = 0;
    for &(_, before, after) in journal {
        if before != expected_before {
            breaks += 1;
        }
        expected_before = after;
    }
    breaks
}

struct Run {
    tally: Tally,
    journal: Vec<(i64, i64, i64)>,
    final_balance: i64,
    pauses: usize,
    /// (applied, stale) summed over both instances.
    applied: u64,
    stale: u64,
    elapsed: Duration,
}

async fn bank_run(fencing: bool) -> Run {
    let started = Instant::now();
    let bin = example_binary("ledger");
    let db = Database::create().await;
    let redis = RedisServer::start();
    let paused = Ledger::start(&bin, &db, &redis, fencing);
    let other = Ledger::start(&bin, &db, &redis, fencing);
    let client = pg_connect(&db.url()).await;

    let put = send(
        paused.addr,
        req(
            "PUT",
            &format!("/accounts/{ACCOUNT}"),
            &[("content-type", "application/json")],
            &format!(r#"{{"balance":{INITIAL}}}"#),
        ),
    )
    .await;
    assert_eq!(put.status, 200, "{:?}", put.body);

    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for i in 0..WORKERS_PAUSED + WORKERS_OTHER {
        let addr = if i < WORKERS_PAUSED {
            paused.addr
        } else {
            other.addr
        };
        workers.push(tokio::spawn(worker(addr, i as u64, stop.clone())));
    }

    // Freeze one instance past the TTL, again and again, while the load runs.
    let mut rng = Rng::new(u64::MAX);
    let mut pauses = 0;
    for round in 1..=MAX_ROUNDS {
        tokio::time::sleep(Duration::from_millis(rng.range(150, 350))).await;
        let hits = if fencing {
            paused.stats().await.1 + other.stats().await.1
        } else {
            chain_breaks(&journal(&client).await) as u64
        };
        if round > MIN_ROUNDS && hits >= TARGET_HITS {
            break;
        }
        paused.signal("-STOP");
        tokio::time::sleep(Duration::from_millis(PAUSE_MS)).await;
        paused.signal("-CONT");
        pauses += 1;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);

    let mut tally = Tally::default();
    for w in workers {
        let t = tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .expect("workers finish within 30 s of the stop")
            .expect("worker panicked");
        tally.merge(t);
    }

    let (a_applied, a_stale) = paused.stats().await;
    let (b_applied, b_stale) = other.stats().await;
    let final_balance: i64 = client
        .query_one("SELECT balance FROM accounts WHERE id = $1", &[&ACCOUNT])
        .await
        .unwrap()
        .get(0);
    let journal = journal(&client).await;
    drop(client);
    paused.terminate();
    other.terminate();
    Run {
        tally,
        journal,
        final_balance,
        pauses,
        applied: a_applied + b_applied,
        stale: a_stale + b_stale,
        elapsed: started.elapsed(),
    }
}

fn report(name: &str, run: &Run) {
    let sum: i64 = run.tally.ok.iter().map(|(a, _)| a).sum();
    println!(
        "{name}: {} requests, {} debits answered 200 (sum {sum}), {} refused as held, \
         {} lease lost, {} unavailable; {} pauses of {PAUSE_MS} ms (TTL {TTL_MS} ms, \
         handler delay {DELAY_MS} ms); stats applied {} stale {}; journal {} rows, \
         {} chain breaks; final balance {} (expected {}, off by {}); {:.1} s",
        run.tally.requests,
        run.tally.ok.len(),
        run.tally.held,
        run.tally.lease_lost,
        run.tally.unavailable,
        run.pauses,
        run.applied,
        run.stale,
        run.journal.len(),
        chain_breaks(&run.journal),
        run.final_balance,
        INITIAL - sum,
        run.final_balance - (INITIAL - sum),
        run.elapsed.as_secs_f64(),
    );
}

#[test]
fn fencing_keeps_every_debit_exactly_once_under_pauses() {
    let run = common::run(|| bank_run(true));
    report("fencing on", &run);
    let t = &run.tally;
    assert!(t.other.is_empty(), "unexpected answers: {:?}", t.other);
    assert!(
        t.ok.len() >= 50,
        "too few debits applied to prove anything: {}",
        t.ok.len()
    );
    assert!(run.pauses >= MIN_ROUNDS, "only {} pauses", run.pauses);
    assert!(
        run.stale >= 1,
        "no pause hit a handler between its read and its write in {} pauses",
        run.pauses
    );

    // The invariant: final = initial - sum of the debits answered 200.
    let sum: i64 = t.ok.iter().map(|(a, _)| a).sum();
    assert_eq!(run.final_balance, INITIAL - sum, "a lost update");
    // Every 200 was written exactly once: one journal row per 200, matched
    // by the balance it answered (unique: balances only go down), and the
    // journal is one unbroken chain from the initial balance.
    assert_eq!(run.journal.len(), t.ok.len());
    let mut answered: Vec<(i64, i64)> = t.ok.iter().map(|&(a, b)| (b, a)).collect();
    let mut written: Vec<(i64, i64)> = run.journal.iter().map(|&(a, _, b)| (b, a)).collect();
    answered.sort_unstable();
    written.sort_unstable();
    assert_eq!(answered, written, "200s and journal rows differ");
    assert_eq!(chain_breaks(&run.journal), 0);
    assert_eq!(run.applied, t.ok.len() as u64);
    // Every refusal for a lost lease reached its client as such.
    assert_eq!(run.stale, t.lease_lost);
}

#[test]
fn without_fencing_pauses_lose_updates() {
    let run = common::run(|| bank_run(false));
    report("fencing off", &run);
    let t = &run.tally;
    assert!(t.other.is_empty(), "unexpected answers: {:?}", t.other);
    assert_eq!(run.stale, 0, "no fence, no refusal");
    assert_eq!(run.journal.len(), t.ok.len());
    // The same run without fencing must break the invariant: a paused
    // handler wrote a balance computed from a stale read.
    let sum: i64 = t.ok.iter().map(|(a, _)| a).sum();
    assert!(
        chain_breaks(&run.journal) >= 1,
        "no lost update in {} pauses: the test could not have caught one",
        run.pauses
    );
    assert!(
        run.final_balance > INITIAL - sum,
        "lost updates leave more money than the 200s allow: {} vs {}",
        run.final_balance,
        INITIAL - sum
    );
}
