//! The paced client: a fixed offered load, open loop, in a process of its
//! own (this binary with `--paced-client`). wrk's `delay()` hook cannot
//! hold a rate (its gap starts when the answer arrives, in whole
//! milliseconds), so this client sends on a fixed schedule that a late
//! answer does not move.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use crate::load::{parse, Sample, BODY};

/// How many keep-alive connections the paced client opens.
pub const CONNS: u32 = 200;

/// Runs the paced client against `addr` at `rate` req/s for `secs`.
pub fn run(addr: SocketAddr, rate: f64, secs: f64, tag: &str) -> Sample {
    let out = Command::new("timeout")
        .args(["-k", "5", &(secs.ceil() as u64 + 30).to_string()])
        .arg(std::env::current_exe().expect("own path"))
        .arg("--paced-client")
        .arg(addr.to_string())
        .arg(CONNS.to_string())
        .arg(rate.to_string())
        .arg(secs.to_string())
        .arg(tag)
        .output()
        .expect("run the paced client");
    parse(&out, "PACEDRESULT ")
}

/// `--paced-client <addr> <conns> <rate> <secs> <tag>`: `conns` hyper
/// connections on one thread, each sending on a fixed schedule (`conns /
/// rate` apart, staggered) until `secs` have passed; each request has 5 s
/// to answer. Prints `PACEDRESULT` with the fields of wrk's line
/// (requests, µs, connect/read/write/status/timeout errors, p50, p99, max
/// in µs) and the p99 measured from the scheduled send time.
pub fn client(args: &[String]) {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    let addr: SocketAddr = args[0].parse().expect("addr");
    let conns: u32 = args[1].parse().expect("conns");
    let rate: f64 = args[2].parse().expect("rate");
    let secs: f64 = args[3].parse().expect("secs");
    let tag = args[4].clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let interval = Duration::from_secs_f64(conns as f64 / rate.max(1.0));
        let mut senders = Vec::new();
        for _ in 0..conns {
            let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            stream.set_nodelay(true).expect("nodelay");
            let (sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .expect("handshake");
            tokio::spawn(async move {
                let _ = conn.await;
            });
            senders.push(sender);
        }
        let start = tokio::time::Instant::now() + Duration::from_millis(20);
        let end = start + Duration::from_secs_f64(secs);
        let tasks: Vec<_> = senders
            .into_iter()
            .enumerate()
            .map(|(c, mut sender)| {
                let tag = tag.clone();
                tokio::spawn(async move {
                    let first = start + interval.mul_f64(c as f64 / conns as f64);
                    let (mut lat, mut sched) = (Vec::new(), Vec::new());
                    let (mut bad_status, mut errors) = (0u64, 0u64);
                    for k in 0u32.. {
                        let at = first + interval * k;
                        if at >= end {
                            break;
                        }
                        tokio::time::sleep_until(at).await;
                        let t0 = tokio::time::Instant::now();
                        let key = format!("{tag}-{c}-{k}");
                        let req = http::Request::post("/pay?delay_ms=0")
                            .header("host", "bench")
                            .header("content-type", "application/json")
                            .header("x-user-id", &key)
                            .header("idempotency-key", &key)
                            .body(Full::new(Bytes::from_static(BODY.as_bytes())))
                            .expect("request");
                        let answer = async {
                            sender.ready().await.ok()?;
                            let res = sender.send_request(req).await.ok()?;
                            let status = res.status();
                            res.into_body().collect().await.ok()?;
                            Some(status)
                        };
                        let answer = tokio::time::timeout(Duration::from_secs(5), answer)
                            .await
                            .ok()
                            .flatten();
                        let done = tokio::time::Instant::now();
                        match answer {
                            Some(s) if s.is_success() => {}
                            Some(_) => bad_status += 1,
                            None => {
                                errors += 1;
                                break;
                            }
                        }
                        lat.push((done - t0).as_micros() as u64);
                        sched.push((done - at).as_micros() as u64);
                    }
                    (lat, sched, bad_status, errors)
                })
            })
            .collect();
        let (mut lat, mut sched, mut bad, mut errs) = (Vec::new(), Vec::new(), 0, 0);
        for t in tasks {
            let (l, s, b, e) = t.await.expect("client task");
            lat.extend(l);
            sched.extend(s);
            bad += b;
            errs += e;
        }
        let took = (tokio::time::Instant::now() - start).as_micros();
        lat.sort_unstable();
        sched.sort_unstable();
        let pct = |v: &[u64], p: f64| {
            v.get(((v.len().max(1) - 1) as f64 * p) as usize)
                .copied()
                .unwrap_or(0)
        };
        println!(
            "PACEDRESULT {} {} {} 0 0 {} 0 {} {} {} {}",
            lat.len(),
            took,
            errs,
            bad,
            pct(&lat, 0.5),
            pct(&lat, 0.99),
            lat.last().copied().unwrap_or(0),
            pct(&sched, 0.99)
        );
    });
}
