//! Memory of the idempotency layer's in-process store under many distinct
//! keys: drives `REPLAY_KEYS` (default 1,000,000) requests, each with a
//! fresh `Idempotency-Key`, through `IdempotencyLayer` over a
//! `MemoryBackend` with its default limits, in this process (no sockets),
//! and prints the resident set size (`VmRSS` from `/proc/self/status`) every
//! `REPLAY_EVERY` keys (default 100,000) next to the baseline measured in
//! the same run before the first request.
//!
//! ```text
//! cargo bench --bench replay_memory
//! REPLAY_KEYS=200000 REPLAY_SECS=60 cargo bench --bench replay_memory
//! ```
//!
//! Bounded in count (`REPLAY_KEYS`) and time (`REPLAY_SECS`, default 300 s:
//! the run stops early and says so). The response is a 201 with a small
//! JSON body and `content-type` and `location` headers, as in
//! `examples/payments.rs`. Exits non-zero if a request is not answered 201.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, ServiceExt};
use tower_redis_lock::key::{Header, RequestMethod, UriPath};
use tower_redis_lock::{IdempotencyLayer, MemoryBackend};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// Resident set size of this process in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .expect("VmRSS in /proc/self/status (Linux)")
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn main() {
    let keys = env_or("REPLAY_KEYS", 1_000_000);
    let every = env_or("REPLAY_EVERY", 100_000).max(1);
    let budget = Duration::from_secs(env_or("REPLAY_SECS", 300));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let backend = MemoryBackend::new();
        let layer = IdempotencyLayer::new(
            backend,
            (RequestMethod, UriPath, Header::trusted_identity("x-user-id")),
        );
        let svc = layer.layer(service_fn(|req: Request<Full<Bytes>>| async move {
            let id = req.headers()["idempotency-key"].to_str().unwrap().to_owned();
            let body = format!(
                r#"{{"id":"pay_{id}","amount":500,"currency":"EUR","status":"succeeded"}}"#
            );
            let mut res = Response::new(Full::new(Bytes::from(body)));
            *res.status_mut() = StatusCode::CREATED;
            res.headers_mut()
                .insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
            res.headers_mut().insert(
                header::LOCATION,
                format!("/payments/pay_{id}").parse().unwrap(),
            );
            Ok::<_, Infallible>(res)
        }));

        let baseline = rss_kib();
        println!(
            "replay_memory: {keys} distinct keys through IdempotencyLayer over MemoryBackend (default limits)"
        );
        println!("{:>10} {:>10} {:>10} {:>12}", "keys", "rss MiB", "+MiB", "req/s");
        println!("{:>10} {:>10.1} {:>10.1} {:>12}", 0, mib(baseline), 0.0, "-");
        let body = Bytes::from_static(br#"{"amount":500,"currency":"EUR"}"#);
        let started = Instant::now();
        let mut lap = Instant::now();
        let mut peak = baseline;
        let mut sent = 0u64;
        while sent < keys {
            let req = Request::post("/payments")
                .header("x-user-id", "user-4242")
                .header("idempotency-key", format!("{sent:032x}"))
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(body.clone()))
                .expect("request");
            let res = svc.clone().oneshot(req).await.expect("infallible");
            if res.status() != StatusCode::CREATED {
                eprintln!("request {sent}: status {}", res.status());
                std::process::exit(1);
            }
            res.into_body().collect().await.expect("body");
            sent += 1;
            if sent.is_multiple_of(every) || sent == keys {
                let rss = rss_kib();
                peak = peak.max(rss);
                let rate = every as f64 / lap.elapsed().as_secs_f64();
                lap = Instant::now();
                println!(
                    "{sent:>10} {:>10.1} {:>10.1} {rate:>12.0}",
                    mib(rss),
                    mib(rss) - mib(baseline)
                );
            }
            if started.elapsed() > budget {
                println!("stopped after {sent} keys: the {budget:?} budget ran out");
                break;
            }
        }
        println!(
            "baseline {:.1} MiB, peak {:.1} MiB (+{:.1} MiB) after {sent} keys in {:.1} s",
            mib(baseline),
            mib(peak),
            mib(peak) - mib(baseline),
            started.elapsed().as_secs_f64()
        );
    });
}
