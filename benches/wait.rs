//! Waiting for a held key (`RedisLockLayer::wait`): how soon after a
//! release the waiter holds the lease (wake-up latency, median and p99),
//! and how many Redis commands a waited request costs beyond a plain
//! acquire and release, on memory, on one instance over Redis (the waiter
//! hears the release in-process), and on two instances over one Redis (the
//! waiter hears it through sharded pub/sub).
//!
//! ```text
//! cargo bench --bench wait
//! ```
//!
//! Each round: a holder takes the key; a waiter asks for it and queues
//! (parked: on Redis, once its acquire has marked the key); the holder
//! releases at `t0`; the waiter holds the lease at `t1`; `t1 − t0` is one
//! sample. Bounded: `ROUNDS` rounds or `BUDGET` per setup, whichever first.

use std::time::Duration;

use tokio::time::Instant;
use tower_redis_lock::key::Route;
use tower_redis_lock::lock::Locker;
use tower_redis_lock::{MemoryBackend, RedisBackend, RedisLockLayer};
use tower_redis_lock_test_support::RedisServer;

const ROUNDS: usize = 300;
const BUDGET: Duration = Duration::from_secs(30);

fn layer(backend: impl tower_redis_lock::backend::LockBackend) -> RedisLockLayer {
    RedisLockLayer::new(backend, Route)
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(5))
}

/// Scripts (an `EVALSHA` refused with `NOSCRIPT` and sent again counts
/// once), `SSUBSCRIBE`s and `SUNSUBSCRIBE`s run so far.
fn commands(server: &RedisServer) -> u64 {
    let info = server.cli(&["INFO", "commandstats"]);
    let stat = |name: &str, field: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:")))
            .and_then(|l| l.split(',').find_map(|f| f.strip_prefix(field)))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    };
    stat("evalsha", "calls=") - stat("evalsha", "failed_calls=")
        + stat("eval", "calls=")
        + stat("ssubscribe", "calls=")
        + stat("sunsubscribe", "calls=")
}

/// Wake-up samples of `ROUNDS` rounds: `holder` holds, `waiter` waits
/// (`parked` says when it is), the holder releases.
async fn rounds(
    holder: &Locker,
    waiter: &Locker,
    waiter_layer: &RedisLockLayer,
    parked: impl Fn(u64) -> bool,
) -> Vec<Duration> {
    let started = Instant::now();
    let mut samples = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS as u64 {
        if started.elapsed() > BUDGET {
            break;
        }
        let key = holder.key_with(|k| k.push("round", &round.to_le_bytes()));
        let held = holder.lock(key).await.expect("the holder takes a free key");
        let before = waiter_layer.stats().waited;
        let w = waiter.clone();
        let waiting = tokio::spawn(async move {
            let guard = w.lock(key).await.expect("the waiter gets its turn");
            let at = Instant::now();
            guard.release().await;
            at
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while !(waiter_layer.stats().waited > before && parked(round)) {
            assert!(Instant::now() < deadline, "the waiter never parked");
            tokio::task::yield_now().await;
        }
        let t0 = Instant::now();
        held.release().await;
        let t1 = waiting.await.unwrap();
        samples.push(t1.saturating_duration_since(t0));
    }
    samples
}

fn report(setup: &str, mut samples: Vec<Duration>, per_waited: Option<f64>) {
    samples.sort_unstable();
    let at = |p: usize| samples[(samples.len() * p / 100).min(samples.len() - 1)];
    let commands = per_waited.map_or("-".to_owned(), |c| format!("{c:.2}"));
    println!(
        "| {setup} | {} | {:.0} µs | {:.0} µs | {commands} |",
        samples.len(),
        at(50).as_secs_f64() * 1e6,
        at(99).as_secs_f64() * 1e6,
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        println!("| setup | rounds | wake-up p50 | wake-up p99 | Redis commands per waited request beyond acquire + release |");
        println!("|---|---:|---:|---:|---:|");

        let memory = layer(MemoryBackend::new());
        let locker = memory.locker();
        let samples = rounds(&locker, &locker, &memory, |_| true).await;
        report("memory, one instance", samples, None);

        let server = RedisServer::start();
        let one = layer(RedisBackend::connect(&server.url()).await.unwrap());
        let locker = one.locker();
        let before = commands(&server);
        let samples = rounds(&locker, &locker, &one, |_| true).await;
        let n = samples.len() as f64;
        // Per round: holder acquire + release, waiter plain acquire + release.
        let extra = (commands(&server) - before) as f64 / n - 4.0;
        report("Redis, one instance", samples, Some(extra));

        let a = layer(RedisBackend::connect(&server.url()).await.unwrap());
        let b = layer(RedisBackend::connect(&server.url()).await.unwrap());
        let (holder, waiter) = (a.locker(), b.locker());
        let before = commands(&server);
        // Parked once its acquire marked the key (after subscribing).
        let mark = |round: u64| {
            let key = holder.key_with(|k| k.push("round", &round.to_le_bytes()));
            let storage = format!("trl:{{{}}}:wait", key);
            server.cli(&["EXISTS", &storage]).trim() == "1"
        };
        let samples = rounds(&holder, &waiter, &b, mark).await;
        let n = samples.len() as f64;
        let extra = (commands(&server) - before) as f64 / n - 4.0;
        report("Redis, two instances (pub/sub)", samples, Some(extra));
    });
}
