//! A TCP proxy on loopback between a client and a real server: a **fault
//! injector, not a mock**. Every byte is the real server's (PostgreSQL
//! here); the proxy only decides whether bytes get through. Controls:
//!
//! - [`FaultProxy::cut`]: close every connection through it now (both
//!   sides see the connection end), as when a network path or a middlebox
//!   drops; new connections are still accepted and forwarded.
//! - [`FaultProxy::black_hole`]: accept connections but forward nothing,
//!   either way, on old and new connections alike (bytes are dropped), as
//!   when a peer vanishes without a word.
//! - [`FaultProxy::restore`]: forward again; a connection that lost bytes
//!   in the black hole is closed (a byte stream with a hole in it is not a
//!   fault a client can see in real networks: there, TCP would reset it).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The proxy; stops accepting when dropped (its connections end at their
/// next cut or when either side closes).
pub struct FaultProxy {
    addr: SocketAddr,
    cuts: watch::Sender<u64>,
    black: watch::Sender<bool>,
    connections: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// A proxy on a free loopback port forwarding to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cuts, _) = watch::channel(0u64);
        let (black, _) = watch::channel(false);
        let connections = Arc::new(AtomicU64::new(0));
        let accept = {
            let (cuts, black, connections) = (cuts.clone(), black.clone(), connections.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    connections.fetch_add(1, Ordering::SeqCst);
                    let (cut, black) = (cuts.subscribe(), black.subscribe());
                    tokio::spawn(async move {
                        if let Ok(server) = TcpStream::connect(upstream).await {
                            pump(client, server, cut, black).await;
                        }
                    });
                }
            })
        };
        Self {
            addr,
            cuts,
            black,
            connections,
            accept,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }

    /// Close every connection through the proxy now.
    pub fn cut(&self) {
        self.cuts.send_modify(|n| *n += 1);
    }

    /// Forward nothing from now on (connections are still accepted).
    pub fn black_hole(&self) {
        self.black.send_replace(true);
    }

    /// Forward again; connections that lost bytes are closed.
    pub fn restore(&self) {
        self.black.send_replace(false);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Copy both ways until either side closes, a cut, or a restore after
/// bytes were lost.
async fn pump(
    client: TcpStream,
    server: TcpStream,
    mut cut: watch::Receiver<u64>,
    mut black: watch::Receiver<bool>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let (mut up, mut down) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    let mut lost = false;
    loop {
        tokio::select! {
            _ = cut.changed() => return,
            changed = black.changed() => {
                if changed.is_err() || (!*black.borrow_and_update() && lost) {
                    return;
                }
            }
            read = cr.read(&mut up) => {
                let n = match read { Ok(0) | Err(_) => return, Ok(n) => n };
                if *black.borrow() {
                    lost = true;
                } else if sw.write_all(&up[..n]).await.is_err() {
                    return;
                }
            }
            read = sr.read(&mut down) => {
                let n = match read { Ok(0) | Err(_) => return, Ok(n) => n };
                if *black.borrow() {
                    lost = true;
                } else if cw.write_all(&down[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}
