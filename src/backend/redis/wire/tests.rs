//! The connection against a real `redis-server`; and, for replies no real
//! server sends, a listener of the test's own that answers with bytes it
//! chose (a stand-in for a broken or hostile server, which redis-server
//! cannot be made to be).

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use tower_redis_lock_test_support::RedisServer;

fn command(wire: &mut Wire, args: &[&[u8]]) {
    encode(wire.command(), args);
}

#[tokio::test]
async fn talks_to_a_real_server_and_reconnects_after_a_restart() {
    let mut server = RedisServer::start();
    let mut wire = Wire::new(Target::plain("127.0.0.1", server.port()));
    command(&mut wire, &[b"SET", b"k", b"v"]);
    assert_eq!(wire.call().await.unwrap(), Value::String("OK".into()));
    command(
        &mut wire,
        &[
            b"EVAL",
            b"return {1, 'x', redis.call('GET', KEYS[1])}",
            b"1",
            b"k",
        ],
    );
    assert_eq!(
        wire.call().await.unwrap(),
        Value::Array(vec![
            Value::Integer(1),
            Value::String("x".into()),
            Value::String("v".into())
        ])
    );
    command(
        &mut wire,
        &[
            b"EVALSHA",
            b"0000000000000000000000000000000000000000",
            b"0",
        ],
    );
    let e = wire.call().await.unwrap_err();
    assert!(e.details().starts_with("NOSCRIPT"), "{e:?}");
    // The error reply kept the connection: the next call answers.
    command(&mut wire, &[b"GET", b"k"]);
    assert_eq!(wire.call().await.unwrap(), Value::String("v".into()));

    // A restart drops the connection under us: the call reconnects and
    // re-sends (the first write may still land on the old socket).
    server.restart();
    command(&mut wire, &[b"PING"]);
    assert_eq!(wire.call().await.unwrap(), Value::String("PONG".into()));
}

#[tokio::test]
async fn a_server_that_is_down_is_an_io_error() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let mut wire = Wire::new(Target::plain("127.0.0.1", port));
    command(&mut wire, &[b"PING"]);
    let e = wire.call().await.unwrap_err();
    assert_eq!(*e.kind(), ErrorKind::IO, "{e:?}");
}

#[tokio::test]
async fn credentials_and_database_come_from_the_target() {
    let server = RedisServer::start();
    server.cli(&["ACL", "SETUSER", "app", "on", ">s3cret", "~*", "+@all"]);
    server.cli(&["-n", "3", "SET", "where", "db3"]);
    let mut target = Target::plain("127.0.0.1", server.port());
    target.username = Some("app".into());
    target.password = Some("s3cret".into());
    target.database = Some(3);
    let mut wire = Wire::new(target.clone());
    command(&mut wire, &[b"GET", b"where"]);
    assert_eq!(wire.call().await.unwrap(), Value::String("db3".into()));

    target.password = Some("wrong".into());
    let mut wire = Wire::new(target);
    command(&mut wire, &[b"PING"]);
    let e = wire.call().await.unwrap_err();
    assert_eq!(*e.kind(), ErrorKind::Auth, "{e:?}");
}

/// A listener that answers the first command of its n-th connection with
/// `replies[n]` in one write and then closes that connection.
async fn fake_server(replies: &'static [&'static [u8]]) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        for reply in replies {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = socket.read(&mut buf).await;
            let _ = socket.write_all(reply).await;
        }
    });
    port
}

#[tokio::test]
async fn malformed_unasked_or_cut_replies_close_the_connection() {
    // A cut reply is a lost connection: re-sent on a new one, which the
    // listener (one connection only) no longer accepts: an IO error after
    // the last attempt.
    const GARBAGE: &[&[u8]] = &[b"!garbage\r\n"];
    const UNASKED: &[&[u8]] = &[b":1\r\n:2\r\n"];
    const CUT: &[&[u8]] = &[b"*2\r\n:1\r\n"];
    const NOTHING: &[&[u8]] = &[b""];
    for (reply, kind) in [
        (GARBAGE, ErrorKind::Protocol),
        (UNASKED, ErrorKind::Protocol),
        (CUT, ErrorKind::IO),
        (NOTHING, ErrorKind::IO),
    ] {
        let port = fake_server(reply).await;
        let mut wire = Wire::new(Target::plain("127.0.0.1", port));
        command(&mut wire, &[b"PING"]);
        let e = wire.call().await.unwrap_err();
        assert_eq!(*e.kind(), kind, "{reply:?}: {e:?}");
        assert!(wire.conn.is_none(), "{reply:?}: the connection is closed");
    }
}

#[tokio::test]
async fn a_lost_reply_is_asked_again_on_a_new_connection() {
    // The first two connections close without a reply (the command may
    // have run): the third attempt gets the answer.
    let port = fake_server(&[b"", b":4", b":7\r\n"]).await;
    let mut wire = Wire::new(Target::plain("127.0.0.1", port));
    command(&mut wire, &[b"EVALSHA", b"x", b"0"]);
    assert_eq!(wire.call().await.unwrap(), Value::Integer(7));
    assert!(wire.conn.is_some(), "the connection that answered is kept");
}

/// Through the backend: a client built from a URL with a user, a password
/// and a database sends its lease calls on a connection of its own, logged
/// in as that user, in that database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_sends_lease_calls_on_its_own_connection_with_the_url_s_credentials() {
    use crate::backend::{Acquire, LockBackend, Token};
    use crate::RedisBackend;

    let server = RedisServer::start();
    server.cli(&["ACL", "SETUSER", "app", "on", ">s3cret", "~*", "+@all"]);
    let url = format!("redis://app:s3cret@127.0.0.1:{}/2", server.port());
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let clients_before = server.cli(&["CLIENT", "LIST"]).lines().count();
    let (key, token) = (Bytes::from_static(b"trl:{wire}"), Token::generate());
    let acquired = backend
        .acquire(&key, &token, std::time::Duration::from_secs(5))
        .await
        .expect("acquire");
    assert!(matches!(acquired, Acquire::Acquired { .. }), "{acquired:?}");
    assert_eq!(
        server.cli(&["-n", "2", "EXISTS", "trl:{wire}"]),
        "1",
        "in db 2"
    );
    assert_eq!(server.cli(&["EXISTS", "trl:{wire}"]), "0", "not in db 0");
    let clients = server.cli(&["CLIENT", "LIST"]);
    assert_eq!(
        clients.lines().count(),
        clients_before + 1,
        "one more connection, the lease calls': {clients}"
    );
    assert!(
        clients
            .lines()
            .filter(|l| l.contains(" db=2 "))
            .all(|l| l.contains(" user=app ")),
        "{clients}"
    );
    assert!(backend.release(&key, &token).await.expect("release"));
    assert_eq!(server.cli(&["-n", "2", "DBSIZE"]), "0");
}
