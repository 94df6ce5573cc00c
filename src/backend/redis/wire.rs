//! The batcher's own connection to a plain (`redis://`, one server) Redis:
//! RESP2 written from the batching task straight onto a socket, and the reply
//! read back on the same task.
//!
//! Why not fred for these calls: each batch went from the batching task to
//! fred's router task and back, two more task wake-ups per batch and
//! fred's command machinery around a command this crate has already encoded
//! (its frames, its timer, its retry queue). Under load those wake-ups, not
//! the commands, were the lease's largest cost. The lease calls are a handful
//! of fixed commands (`EVALSHA` and `EVAL` of the scripts in `scripts.rs`)
//! whose replies are integers, short strings and one flat array, so the
//! connection needs little: connect, `AUTH` and `SELECT` as fred's `Config`
//! says, one command in flight, and a reply parser that treats every byte as
//! untrusted (`resp.rs`, fuzzed).
//!
//! A lost connection is opened again and the command re-sent, three
//! attempts in all (fred's, with this crate's builder); then the call fails
//! ([`ErrorKind::IO`]). A malformed reply closes the connection and fails
//! the call at once ([`ErrorKind::Protocol`]); the next call opens a new
//! one. A call that gets no answer is abandoned by the batcher's timeout,
//! which drops the future and with it the connection (a reply that never
//! came cannot shift later ones). A refused login ([`ErrorKind::Auth`]) makes
//! the batcher send that lane's calls through fred from then on (`batch.rs`).
//! Everything else (TLS, Sentinel, Cluster, Unix sockets) stays on fred.

use std::time::Duration;

use bytes::BytesMut;
use fred::bytes_utils::Str;
use fred::clients::Client;
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::ClientLike;
use fred::socket2::{SockRef, TcpKeepalive};
use fred::types::config::ServerConfig;
use fred::types::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub(crate) use super::resp::{bulk, bulk_decimal, encode, header, push_decimal};
use super::resp::{parse, Frame, Malformed, MAX_REPLY};

/// Where and how to connect: what the fred client's `Config` says.
#[derive(Clone)]
pub(crate) struct Target {
    host: String,
    port: u16,
    username: Option<String>,
    password: Option<String>,
    database: Option<u8>,
    nodelay: bool,
    keepalive: Option<TcpKeepalive>,
}

impl Target {
    /// The server of a client configured for one plain TCP server; `None` for
    /// TLS, Sentinel, Cluster or a Unix socket (those calls stay on fred).
    pub(crate) fn of(client: &Client) -> Option<Self> {
        let config = client.client_config();
        if config.uses_tls() {
            return None;
        }
        let ServerConfig::Centralized { server } = &config.server else {
            return None;
        };
        let tcp = &client.connection_config().tcp;
        Some(Self {
            host: server.host.to_string(),
            port: server.port,
            username: config.username.clone(),
            password: config.password.clone(),
            database: config.database,
            nodelay: tcp.nodelay.unwrap_or(true),
            keepalive: tcp.keepalive.clone(),
        })
    }
}

/// One connection (opened when first needed, again after a failure) and the
/// buffer the next command is encoded into.
pub(crate) struct Wire {
    target: Target,
    conn: Option<Conn>,
    out: Vec<u8>,
}

struct Conn {
    stream: TcpStream,
    buf: BytesMut,
}

impl Wire {
    pub(crate) fn new(target: Target) -> Self {
        Self {
            target,
            conn: None,
            out: Vec::with_capacity(4096),
        }
    }

    /// The command buffer, emptied: encode the next command into it.
    pub(crate) fn command(&mut self) -> &mut Vec<u8> {
        self.out.clear();
        &mut self.out
    }

    /// Send the command in the buffer and read its reply. A Redis error
    /// reply is an `Err` with the server's message and keeps the connection.
    /// A lost connection (refused, reset, closed) is opened again and the
    /// command sent again, [`ATTEMPTS`] times in all, as fred does with its
    /// commands: every script of the crate finds its own token when re-sent,
    /// so a command that ran before its reply was lost is harmless. A
    /// malformed reply closes the connection and fails at once.
    pub(crate) async fn call(&mut self) -> Result<Value, FredError> {
        let mut attempt = 1;
        loop {
            match self.attempt().await {
                Err(e) if *e.kind() == ErrorKind::IO && attempt < ATTEMPTS => {
                    // A restart refuses connections for a moment: do not
                    // spend every attempt in the same millisecond.
                    if attempt > 1 {
                        tokio::time::sleep(RETRY_PAUSE * attempt).await;
                    }
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn attempt(&mut self) -> Result<Value, FredError> {
        // Taken out for the call: if this future is dropped half-way (the
        // batch timeout) or fails, the connection goes with it.
        let mut conn = match self.conn.take() {
            Some(conn) => conn,
            None => Conn::open(&self.target).await?,
        };
        let reply = conn.round_trip(&self.out).await?;
        self.conn = Some(conn);
        reply
    }
}

/// Attempts per command over lost connections (fred's `max_command_attempts`
/// in this crate's builder).
const ATTEMPTS: u32 = 3;
/// The pause before the third attempt is twice this.
const RETRY_PAUSE: Duration = Duration::from_millis(25);

impl Conn {
    async fn open(target: &Target) -> Result<Self, FredError> {
        let stream = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .map_err(|e| io_error("connect", &e))?;
        if target.nodelay {
            let _ = stream.set_nodelay(true);
        }
        if let Some(keepalive) = &target.keepalive {
            let _ = SockRef::from(&stream).set_tcp_keepalive(keepalive);
        }
        let mut conn = Self {
            stream,
            buf: BytesMut::with_capacity(4096),
        };
        let mut out = Vec::new();
        if let Some(password) = &target.password {
            let mut args: Vec<&[u8]> = vec![b"AUTH"];
            if let Some(user) = &target.username {
                args.push(user.as_bytes());
            }
            args.push(password.as_bytes());
            encode(&mut out, &args);
            conn.expect_ok(&out).await?;
        }
        if let Some(db) = target.database.filter(|&db| db != 0) {
            out.clear();
            encode(&mut out, &[b"SELECT", db.to_string().as_bytes()]);
            conn.expect_ok(&out).await?;
        }
        Ok(conn)
    }

    async fn expect_ok(&mut self, command: &[u8]) -> Result<(), FredError> {
        match self.round_trip(command).await? {
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Write `command`, read one reply. The outer `Err` is a broken
    /// connection, the inner one a Redis error reply.
    async fn round_trip(&mut self, command: &[u8]) -> Result<Result<Value, FredError>, FredError> {
        self.stream
            .write_all(command)
            .await
            .map_err(|e| io_error("write", &e))?;
        loop {
            match parse(&self.buf) {
                Ok(Some((reply, used))) => {
                    if used != self.buf.len() {
                        // One command in flight: bytes past its reply were
                        // never asked for.
                        return Err(protocol_error("bytes after the reply"));
                    }
                    self.buf.clear();
                    return Ok(into_result(reply));
                }
                Ok(None) => {}
                Err(Malformed(why)) => return Err(protocol_error(why)),
            }
            if self.buf.len() >= MAX_REPLY {
                return Err(protocol_error("reply too large"));
            }
            self.buf.reserve(4096);
            let n = self
                .stream
                .read_buf(&mut self.buf)
                .await
                .map_err(|e| io_error("read", &e))?;
            if n == 0 {
                return Err(FredError::new(ErrorKind::IO, "Redis closed the connection"));
            }
        }
    }
}

fn io_error(what: &str, e: &std::io::Error) -> FredError {
    FredError::new(ErrorKind::IO, format!("{what}: {e}"))
}

fn protocol_error(what: &str) -> FredError {
    FredError::new(
        ErrorKind::Protocol,
        format!("malformed reply from Redis: {what}"),
    )
}

/// A parsed reply as fred's `Value` (what the scripts' callers read), or
/// the error of a Redis error reply.
fn into_result(frame: Frame) -> Result<Value, FredError> {
    match frame {
        Frame::Error(message) => {
            let kind = match message.split_whitespace().next().unwrap_or("") {
                "NOAUTH" | "WRONGPASS" => ErrorKind::Auth,
                "WRONGTYPE" => ErrorKind::InvalidArgument,
                _ => ErrorKind::Unknown,
            };
            Err(FredError::new(kind, message))
        }
        other => Ok(into_value(other)),
    }
}

fn into_value(frame: Frame) -> Value {
    match frame {
        Frame::Simple(s) => Value::String(s.into()),
        // An error inside an array (a failed `pcall` returned as is): its
        // message, as fred gives it.
        Frame::Error(s) => Value::String(s.into()),
        Frame::Integer(n) => Value::Integer(n),
        Frame::Bulk(b) => match Str::from_inner(b) {
            Ok(s) => Value::String(s),
            Err(e) => Value::Bytes(e.into_inner()),
        },
        Frame::Null => Value::Null,
        Frame::Array(items) => Value::Array(items.into_iter().map(into_value).collect()),
    }
}

/// Connection-level settings the wire keeps from fred's, for tests.
#[cfg(test)]
impl Target {
    pub(crate) fn with_password(mut self, password: &str) -> Self {
        self.password = Some(password.to_owned());
        self
    }

    pub(crate) fn plain(host: &str, port: u16) -> Self {
        Self {
            host: host.to_owned(),
            port,
            username: None,
            password: None,
            database: None,
            nodelay: true,
            keepalive: Some(TcpKeepalive::new().with_time(Duration::from_secs(30))),
        }
    }
}

#[cfg(test)]
mod tests;
