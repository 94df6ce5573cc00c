//! A small TCP proxy between a client and Redis, controlled from the test:
//! delay either direction, blackhole (swallow everything), drop the next
//! reply and close the connection, or close every connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

#[derive(Default)]
struct Ctl {
    /// Delay of client → server bytes, in ms.
    delay_up_ms: AtomicU64,
    /// Delay of server → client bytes, in ms.
    delay_down_ms: AtomicU64,
    /// Swallow all bytes in both directions.
    blackhole: AtomicBool,
    /// Swallow the next server → client chunk, then close that connection.
    drop_next_reply: AtomicBool,
    /// Replies swallowed by `drop_next_reply`.
    dropped: AtomicUsize,
    /// Connections accepted so far.
    accepted: AtomicUsize,
    /// Client → server chunks read so far.
    chunks_up: AtomicUsize,
}

/// A proxy on a loopback port forwarding to `upstream`; stops when dropped.
pub struct Proxy {
    addr: SocketAddr,
    ctl: Arc<Ctl>,
    close: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone, Copy)]
enum Dir {
    Up,
    Down,
}

impl Proxy {
    /// Listen on a free loopback port and forward every connection to
    /// `127.0.0.1:upstream_port`.
    pub async fn start(upstream_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ctl = Arc::new(Ctl::default());
        let (close, _) = watch::channel(0u64);
        let task = {
            let ctl = ctl.clone();
            let close = close.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        return;
                    };
                    ctl.accepted.fetch_add(1, Ordering::SeqCst);
                    let ctl = ctl.clone();
                    let closed = close.subscribe();
                    tokio::spawn(async move {
                        if let Ok(upstream) = TcpStream::connect(("127.0.0.1", upstream_port)).await
                        {
                            connection(client, upstream, ctl, closed).await;
                        }
                    });
                }
            })
        };
        Self {
            addr,
            ctl,
            close,
            task,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.addr.port())
    }

    /// Delay client → server bytes (a command lands late).
    pub fn delay_up(&self, d: Duration) {
        self.ctl
            .delay_up_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    /// Delay server → client bytes (a reply arrives late).
    pub fn delay_down(&self, d: Duration) {
        self.ctl
            .delay_down_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    /// Swallow every byte in both directions while on (connections stay open).
    pub fn blackhole(&self, on: bool) {
        self.ctl.blackhole.store(on, Ordering::SeqCst);
    }

    /// The next reply from the server is swallowed and its connection closed
    /// (the command did run on the server; the client never hears of it).
    pub fn drop_next_reply(&self) {
        self.ctl.drop_next_reply.store(true, Ordering::SeqCst);
    }

    /// Replies swallowed so far by [`drop_next_reply`](Self::drop_next_reply).
    pub fn dropped_replies(&self) -> usize {
        self.ctl.dropped.load(Ordering::SeqCst)
    }

    /// Close every open connection (both sides).
    pub fn close_all(&self) {
        self.close.send_modify(|g| *g += 1);
    }

    /// Client → server chunks read so far (a command entered the proxy).
    pub fn chunks_up(&self) -> usize {
        self.ctl.chunks_up.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.ctl.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.close_all();
        self.task.abort();
    }
}

async fn connection(
    client: TcpStream,
    upstream: TcpStream,
    ctl: Arc<Ctl>,
    mut closed: watch::Receiver<u64>,
) {
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    tokio::select! {
        _ = pump(cr, uw, Dir::Up, ctl.clone()) => {}
        _ = pump(ur, cw, Dir::Down, ctl) => {}
        _ = closed.changed() => {}
    }
    // Both halves of both sockets are dropped here: the connection closes.
}

/// Copy `r` to `w` chunk by chunk, each chunk after its delay, in order.
/// Returns when either side closes or the connection must be cut.
async fn pump(
    mut r: impl AsyncReadExt + Unpin,
    mut w: impl AsyncWriteExt + Unpin,
    dir: Dir,
    ctl: Arc<Ctl>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match r.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if matches!(dir, Dir::Up) {
                ctl.chunks_up.fetch_add(1, Ordering::SeqCst);
            }
            if ctl.blackhole.load(Ordering::SeqCst) {
                continue;
            }
            if matches!(dir, Dir::Down) && ctl.drop_next_reply.swap(false, Ordering::SeqCst) {
                ctl.dropped.fetch_add(1, Ordering::SeqCst);
                return; // cut the connection without forwarding the reply
            }
            let delay = match dir {
                Dir::Up => ctl.delay_up_ms.load(Ordering::SeqCst),
                Dir::Down => ctl.delay_down_ms.load(Ordering::SeqCst),
            };
            let due = Instant::now() + Duration::from_millis(delay);
            if tx.send((due, buf[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    let writer = async {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if w.write_all(&chunk).await.is_err() {
                return;
            }
        }
        // Reader finished: keep the half-open side open until cut.
        std::future::pending::<()>().await
    };
    tokio::select! {
        _ = reader => {}
        _ = writer => {}
    }
}
