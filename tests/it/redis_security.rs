//! Redis security end to end, over real HTTP on loopback: password AUTH
//! (`requirepass`), a least-privilege ACL user, keyed digests in Redis, and
//! TLS (`rediss://`, feature `tls-rustls`). Wrong credentials (a clear error,
//! no secret in errors, `Debug` or logs) are in `tests/global_logger.rs`.

use crate::common;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use common::{req, send, serve, RedisServer};
use tokio::sync::{mpsc, Semaphore};
use tower_redis_lock::backend::LockBackend;
use tower_redis_lock::key::{KeySpace, RequestMethod, Route};
use tower_redis_lock::{Lease, RedisBackend, RedisLockLayer};

/// The commands the crate sends, as an ACL rule (README lists the same):
/// on connect fred sends `AUTH` (always allowed), `CLIENT ID`, `INFO server`
/// and, without credentials, `PING`; the lease scripts go as `EVALSHA` with
/// an `EVAL` fallback, and the scripts themselves call `GET`, `SET`, `PTTL`,
/// `PEXPIRE` and `DEL` (Redis checks the ACL inside scripts too); the probe
/// for native commands is `COMMAND INFO`, and on a server that has them the
/// lease calls are `SET`, `PTTL` and `DELIFEQ` ([`NATIVE_RULES`]).
const ACL_RULES: &[&str] = &[
    "on",
    "resetkeys",
    "~trl:*",
    "resetchannels",
    "-@all",
    "+evalsha",
    "+eval",
    "+get",
    "+set",
    "+pttl",
    "+pexpire",
    "+del",
    "+ping",
    "+client|id",
    "+info",
    "+command|info",
];

/// What a server with native lease commands (Valkey ≥ 9) needs beyond
/// [`ACL_RULES`] (Redis 7 refuses a rule for a command it lacks).
const NATIVE_RULES: &[&str] = &["+delifeq"];

/// [`NATIVE_RULES`] on a server that has the commands, else nothing.
fn native_rules(server: &RedisServer) -> &'static [&'static str] {
    if server.is_valkey() {
        NATIVE_RULES
    } else {
        &[]
    }
}

/// Sent by fred when it connects; denied, they only fill `ACL LOG`.
const ACL_HANDSHAKE: &[&str] = &["+ping", "+client|id", "+info"];

/// A server that requires `password` (set after start: the harness checks
/// readiness with an unauthenticated PING).
fn server_with_password(password: &str) -> RedisServer {
    let server = RedisServer::start();
    assert_eq!(
        server.cli(&["CONFIG", "SET", "requirepass", password]),
        "OK"
    );
    server
}

/// `redis-cli` as a given user (`None`: the default user with `requirepass`).
fn cli_as(server: &RedisServer, user: Option<&str>, password: &str, args: &[&str]) -> String {
    let mut cmd = Command::new("redis-cli");
    cmd.args(["-p", &server.port().to_string(), "--no-auth-warning"]);
    if let Some(user) = user {
        cmd.args(["--user", user]);
    }
    let out = cmd
        .args(["--pass", password])
        .args(args)
        .output()
        .expect("redis-cli on PATH");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Handler that reports its lease key, then waits for a permit.
#[derive(Clone)]
struct Gate {
    entered: mpsc::UnboundedSender<String>,
    permits: Arc<Semaphore>,
}

async fn gated(State(gate): State<Gate>, lease: Lease) -> String {
    let hex = lease.key().map(|k| k.to_hex()).unwrap_or_default();
    let _ = gate.entered.send(hex.clone());
    gate.permits.acquire().await.unwrap().forget();
    hex
}

/// Run the lock end to end over HTTP with `backend`: one request holds the
/// lease, a duplicate gets 409, the release empties the store. `count` reads
/// the number of keys in Redis with admin rights. Returns the stored key.
async fn lock_round_trip(backend: impl LockBackend, count: impl Fn() -> usize) -> String {
    let (tx, mut entered) = mpsc::unbounded_channel();
    let gate = Gate {
        entered: tx,
        permits: Arc::new(Semaphore::new(0)),
    };
    let layer = RedisLockLayer::new(backend, (RequestMethod, Route))
        .key_space(KeySpace::default().secret(b"redis-security-test"));
    let app = Router::new()
        .route("/pay", post(gated).layer(layer))
        .with_state(gate.clone());
    let addr = serve(app).await;
    let first = tokio::spawn(send(addr, req("POST", "/pay", &[], "")));
    let hex = tokio::time::timeout(Duration::from_secs(10), entered.recv())
        .await
        .expect("admitted within 10 s")
        .unwrap();
    assert_eq!(count(), 1, "the lease is in Redis");
    let dup = send(addr, req("POST", "/pay", &[], "")).await;
    assert_eq!(dup.status, 409, "{:?}", dup.body);
    gate.permits.add_permits(1);
    let reply = first.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(count(), 0, "released before the response ended");
    hex
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requirepass_auth_end_to_end() {
    let pw = "s3cret-Pa55word";
    let server = server_with_password(pw);
    // Without the password: refused.
    assert!(server.cli(&["DBSIZE"]).contains("NOAUTH"));
    let url = format!("redis://:{pw}@127.0.0.1:{}", server.port());
    let backend = RedisBackend::connect(&url)
        .await
        .expect("AUTH with password");
    let dbsize = || cli_as(&server, None, pw, &["DBSIZE"]).parse().unwrap();
    lock_round_trip(backend, dbsize).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_privilege_acl_user_end_to_end() {
    let admin_pw = "admin-pw";
    let server = server_with_password(admin_pw);
    let admin = |args: &[&str]| cli_as(&server, None, admin_pw, args);
    let mut setuser = vec!["ACL", "SETUSER", "lock", ">lock-pw"];
    setuser.extend_from_slice(ACL_RULES);
    setuser.extend_from_slice(native_rules(&server));
    assert_eq!(admin(&setuser), "OK");
    assert_eq!(admin(&["SET", "other:secret", "x"]), "OK");
    assert_eq!(admin(&["ACL", "LOG", "RESET"]), "OK");

    let url = format!("redis://lock:lock-pw@127.0.0.1:{}", server.port());
    let backend = RedisBackend::connect(&url)
        .await
        .expect("ACL user connects");
    let keys = || {
        admin(&["--scan", "--pattern", "trl:*"])
            .lines()
            .filter(|l| !l.is_empty())
            .count()
    };
    lock_round_trip(backend.clone(), keys).await;
    // Extend is the one script the layer does not call on its own.
    let key = bytes::Bytes::from_static(b"trl:{extend}");
    let token = tower_redis_lock::backend::contract::Token::generate();
    let ttl = Duration::from_secs(5);
    assert!(matches!(
        backend.acquire(&key, &token, ttl).await,
        Ok(tower_redis_lock::backend::contract::Acquire::Acquired { .. })
    ));
    assert!(backend.extend(&key, &token, ttl).await.unwrap());
    assert!(backend.release(&key, &token).await.unwrap());

    // Nothing the crate sent was denied...
    // Nothing the crate needs was denied: the one entry allowed is the
    // eviction-policy check (`CONFIG GET maxmemory-policy`), which is
    // deliberately not granted (it would also reveal `requirepass`) and is
    // tolerated when denied.
    let denied = denied_objects(&admin(&["ACL", "LOG"]));
    assert!(
        denied.iter().all(|o| o == "config|get"),
        "no command of the crate hit the ACL: {denied:?}"
    );
    // ...and the user can do nothing else.
    let lock = |args: &[&str]| cli_as(&server, Some("lock"), "lock-pw", args);
    assert!(lock(&["GET", "other:secret"]).contains("NOPERM"));
    assert!(lock(&["KEYS", "*"]).contains("NOPERM"));
    assert!(lock(&["FLUSHALL"]).contains("NOPERM"));
    assert!(lock(&["CONFIG", "GET", "requirepass"]).contains("NOPERM"));
    assert!(lock(&[
        "EVAL",
        "return redis.call('GET', KEYS[1])",
        "1",
        "other:secret"
    ])
    .contains("NOPERM"));
    // Redis 7 and Valkey 9 word the refusal differently.
    let flush = lock(&["EVAL", "return redis.call('FLUSHALL')", "0"]);
    assert!(
        flush.contains("can't run this command") || flush.contains("no permissions"),
        "{flush}"
    );
}

/// The lease itself needs only the script commands: fred tolerates a denied
/// `CLIENT ID`/`INFO` on connect (they then show up in `ACL LOG`, nothing
/// else does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minimal_acl_user_still_locks() {
    let server = RedisServer::start();
    let mut setuser = vec!["ACL", "SETUSER", "lock", ">lock-pw"];
    setuser.extend(ACL_RULES.iter().filter(|r| !ACL_HANDSHAKE.contains(r)));
    setuser.extend_from_slice(native_rules(&server));
    assert_eq!(server.cli(&setuser), "OK");
    let url = format!("redis://lock:lock-pw@127.0.0.1:{}", server.port());
    let backend = RedisBackend::connect(&url).await.expect("connects");
    let keys = || {
        server
            .cli(&["--scan", "--pattern", "trl:*"])
            .lines()
            .filter(|l| !l.is_empty())
            .count()
    };
    lock_round_trip(backend, keys).await;
    let denied = denied_objects(&server.cli(&["ACL", "LOG"]));
    assert!(!denied.is_empty(), "the handshake commands were denied");
    for object in denied {
        assert!(
            ["client|id", "info", "config|get"].contains(&object.as_str()),
            "denied: {object}"
        );
    }
}

/// The `object` fields of `ACL LOG` (the denied commands).
fn denied_objects(log: &str) -> Vec<String> {
    log.lines()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0] == "object")
        .map(|w| w[1].to_owned())
        .collect()
}

/// Two layers with different secrets on one Redis: the same request is two
/// different keys (a MAC, not a public hash), and neither is the unkeyed key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_makes_redis_keys_a_mac() {
    let server = RedisServer::start();
    let mut stored = Vec::new();
    for secret in [Some("fleet-secret-one-1"), Some("fleet-secret-one-2"), None] {
        let backend = RedisBackend::connect(&server.url()).await.unwrap();
        let mut layer = RedisLockLayer::new(backend, (RequestMethod, Route));
        if let Some(secret) = secret {
            layer = layer.key_space(KeySpace::default().secret(secret));
        }
        let app = Router::new().route(
            "/pay",
            post(|lease: Lease| async move { lease.key().unwrap().to_hex() }),
        );
        let addr = serve(app.layer(layer)).await;
        let reply = send(addr, req("POST", "/pay", &[], "")).await;
        assert_eq!(reply.status, 200);
        stored.push(String::from_utf8(reply.body.to_vec()).unwrap());
    }
    assert_ne!(stored[0], stored[1], "different secrets, different keys");
    assert_ne!(stored[0], stored[2], "keyed != public digest");
    assert_ne!(stored[1], stored[2], "keyed != public digest");
    // The unkeyed key of (POST, /pay) is public: anyone can recompute it.
    assert_eq!(stored[2].len(), 32);
}

// ---- TLS ---------------------------------------------------------------------

#[cfg(feature = "tls-rustls")]
mod tls {
    use super::*;
    use std::path::{Path, PathBuf};

    use fred::prelude::*;
    use fred::rustls::pki_types::CertificateDer;
    use fred::rustls::{ClientConfig, RootCertStore};

    /// A throw-away CA and a server certificate for 127.0.0.1/localhost,
    /// made with the `openssl` CLI.
    fn make_certs(dir: &Path) {
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()
                .expect("the TLS test needs the `openssl` CLI (Debian: apt-get install openssl)");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        std::fs::write(
            dir.join("ext.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
        )
        .unwrap();
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=tower-redis-lock test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ]);
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]);
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "ext.cnf",
            "-out",
            "server.crt",
        ]);
        openssl(&["x509", "-in", "ca.crt", "-outform", "DER", "-out", "ca.der"]);
    }

    /// `redis-server` with TLS only (`--port 0`), killed on drop; the
    /// harness's server, plus the test CA and its directory.
    struct TlsServer {
        server: RedisServer,
        certs: PathBuf,
    }

    impl std::ops::Deref for TlsServer {
        type Target = RedisServer;
        fn deref(&self) -> &RedisServer {
            &self.server
        }
    }

    impl TlsServer {
        fn start() -> Self {
            let certs = std::env::temp_dir().join(format!(
                "trl-tls-{}-{}",
                std::process::id(),
                common::free_port()
            ));
            std::fs::create_dir_all(&certs).unwrap();
            make_certs(&certs);
            Self {
                server: RedisServer::start_tls(&certs),
                certs,
            }
        }

        /// A rustls client config trusting only the test CA.
        fn client_tls(&self) -> ClientConfig {
            let der = std::fs::read(self.certs.join("ca.der")).unwrap();
            let mut roots = RootCertStore::empty();
            roots.add(CertificateDer::from(der)).unwrap();
            ClientConfig::builder_with_provider(Arc::new(
                fred::rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth()
        }
    }

    impl Drop for TlsServer {
        fn drop(&mut self) {
            self.server.kill();
            let _ = std::fs::remove_dir_all(&self.certs);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rediss_with_a_private_ca_end_to_end() {
        let server = TlsServer::start();
        // The crate's builder (its reconnect/queue defaults), plus the CA.
        let mut builder = RedisBackend::builder(&server.url()).unwrap();
        let tls = server.client_tls();
        builder.with_config(|c| c.tls = Some(TlsConnector::from(tls).into()));
        let client = builder.build().unwrap();
        tokio::time::timeout(Duration::from_secs(5), client.init())
            .await
            .expect("TLS connect within 5 s")
            .expect("TLS handshake with the test CA");
        let backend = RedisBackend::new(client);
        let dbsize = || server.cli(&["DBSIZE"]).parse().unwrap();
        lock_round_trip(backend, dbsize).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rediss_rejects_an_untrusted_certificate_and_plaintext() {
        let server = TlsServer::start();
        // `rediss://` with the system roots: the test CA is not trusted.
        let started = Instant::now();
        let err = match RedisBackend::connect(&server.url()).await {
            Ok(_) => panic!("trusted a certificate from an unknown CA"),
            Err(e) => e,
        };
        println!("untrusted CA ({:?}): {err}", started.elapsed());
        assert!(err.to_string().contains("TLS handshake"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        // Plain `redis://` to the TLS port never gets a session.
        let plain = format!("redis://127.0.0.1:{}", server.port);
        assert!(RedisBackend::connect(&plain).await.is_err());
    }
}

// ---- The documented least-privilege ACL, feature by feature ---------------

/// The ACL rules SECURITY.md documents for `features` (`"lock"` first, then
/// any of `"fencing"`, `"renewal"`, `"replay"`): the `ACL SETUSER lock ...`
/// lines of its `text` block, each under a `# <feature>:` comment line. The
/// tests run each feature as a user made of exactly these rules, so the
/// document cannot fall behind the commands the crate sends.
fn documented_acl(features: &[&str]) -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/SECURITY.md"))
        .expect("read SECURITY.md");
    let mut section: Option<String> = None;
    let mut rules: Vec<(String, Vec<String>)> = Vec::new();
    for line in doc.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("# ") {
            let name = name.split_whitespace().next().unwrap_or("");
            let name = name.trim_end_matches(':').to_owned();
            // A feature may need nothing beyond the lock's line.
            rules.push((name.clone(), Vec::new()));
            section = Some(name);
        } else if let Some(rest) = line.strip_prefix("ACL SETUSER lock ") {
            let words = rest
                .split_whitespace()
                // The password placeholder: the test sets its own.
                .filter(|w| !w.starts_with('>'))
                .map(str::to_owned)
                .collect();
            if let Some(section) = &section {
                rules.push((section.clone(), words));
            }
        }
    }
    let mut out = Vec::new();
    for feature in features {
        let found: Vec<&Vec<String>> = rules
            .iter()
            .filter(|(s, _)| s == feature)
            .map(|(_, r)| r)
            .collect();
        assert!(
            !found.is_empty(),
            "SECURITY.md documents no ACL line under `# {feature}`"
        );
        for r in found {
            out.extend(r.iter().cloned());
        }
    }
    out
}

/// A server with a `lock` user holding exactly the documented rules for
/// `features`, and that user's URL.
fn acl_server(features: &[&str]) -> (RedisServer, String) {
    let server = RedisServer::start();
    let mut features = features.to_vec();
    if server.is_valkey() {
        features.push("native");
    }
    let rules = documented_acl(&features);
    let mut setuser = vec!["ACL", "SETUSER", "lock", ">lock-pw"];
    setuser.extend(rules.iter().map(String::as_str));
    assert_eq!(server.cli(&setuser), "OK", "{setuser:?}");
    assert_eq!(server.cli(&["ACL", "LOG", "RESET"]), "OK");
    let url = format!("redis://lock:lock-pw@127.0.0.1:{}", server.port());
    (server, url)
}

/// Nothing the feature needs was denied: the one entry allowed is the
/// eviction-policy check (`CONFIG GET`), deliberately not granted.
fn assert_nothing_denied(server: &RedisServer) {
    let denied = denied_objects(&server.cli(&["ACL", "LOG"]));
    assert!(
        denied.iter().all(|o| o == "config|get"),
        "commands denied to the documented ACL user: {denied:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_acl_runs_the_lock() {
    let (server, url) = acl_server(&["lock"]);
    let backend = RedisBackend::connect(&url).await.expect("connects");
    let keys = || {
        server
            .cli(&["--scan", "--pattern", "trl:*"])
            .lines()
            .filter(|l| !l.is_empty())
            .count()
    };
    lock_round_trip(backend, keys).await;
    assert_nothing_denied(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_acl_runs_fencing() {
    let (server, url) = acl_server(&["lock", "fencing"]);
    let backend = RedisBackend::connect(&url).await.expect("connects");
    let app = Router::new().route(
        "/pay",
        post(
            |lease: Lease| async move { lease.fence().map(|f| f.to_string()).unwrap_or_default() },
        )
        .layer(RedisLockLayer::new(backend, Route).fencing(true)),
    );
    let addr = serve(app).await;
    let mut last = 0;
    for _ in 0..2 {
        let reply = send(addr, req("POST", "/pay", &[], "")).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let fence: u64 = String::from_utf8_lossy(&reply.body)
            .parse()
            .unwrap_or_else(|_| panic!("fencing token issued: {:?}", reply.body));
        assert!(fence > last, "{fence} after {last}");
        last = fence;
    }
    assert_nothing_denied(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_acl_runs_renewal() {
    let (server, url) = acl_server(&["lock", "renewal"]);
    let backend = RedisBackend::connect(&url).await.expect("connects");
    let app = Router::new().route(
        "/pay",
        post(|lease: Lease| async move {
            // Until the watchdog renewed twice (bounded: 5 s).
            let renewed = || lease.renewals() >= 2 || lease.is_lost();
            let _ = common::eventually(Duration::from_secs(5), renewed).await;
            format!("{} {}", lease.renewals(), lease.is_lost())
        })
        .layer(
            RedisLockLayer::new(backend, Route)
                .ttl(Duration::from_millis(600))
                .renew(tower_redis_lock::lock::Renewal::new()),
        ),
    );
    let addr = serve(app).await;
    let reply = send(addr, req("POST", "/pay", &[], "")).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body, "2 false", "renewed twice, never lost");
    assert_nothing_denied(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_acl_runs_replay() {
    let (server, url) = acl_server(&["lock", "replay"]);
    let backend = RedisBackend::connect(&url).await.expect("connects");
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new().route(
        "/pay",
        post(move || {
            let r = r.clone();
            async move {
                let n = r.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                (http::StatusCode::CREATED, format!("payment {n}"))
            }
        })
        .layer(tower_redis_lock::IdempotencyLayer::new(backend, Route)),
    );
    let addr = serve(app).await;
    let pay = || req("POST", "/pay", &[("idempotency-key", "k-1")], "{}");
    let first = send(addr, pay()).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = send(addr, pay()).await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    // A different payload under the same key: 422, read from the record.
    let other = send(
        addr,
        req("POST", "/pay", &[("idempotency-key", "k-1")], "{\"x\":1}"),
    )
    .await;
    assert_eq!(other.status, 422, "{:?}", other.body);
    assert_nothing_denied(&server);
}

/// A key used again once its record expired (its entry in the scope's
/// quota not yet swept) as the documented user: the record script counts
/// the entry's bytes once (`EXISTS` on the byte count); nothing is denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_acl_runs_replay_of_a_key_used_again() {
    let (server, url) = acl_server(&["lock", "replay"]);
    let backend = RedisBackend::connect(&url).await.expect("connects");
    let app = Router::new().route(
        "/pay",
        post(|| async { (http::StatusCode::CREATED, "paid") }).layer(
            tower_redis_lock::IdempotencyLayer::new(backend, Route)
                .retention(Duration::from_millis(300)),
        ),
    );
    let addr = serve(app).await;
    let pay = || req("POST", "/pay", &[("idempotency-key", "k-2")], "{}");
    assert_eq!(send(addr, pay()).await.status, 201);
    let expired = common::eventually(Duration::from_secs(5), || {
        server
            .cli(&["--scan", "--pattern", "trl:*:idem"])
            .lines()
            .all(|l| l.is_empty())
    })
    .await;
    assert!(expired, "the record expired");
    let again = send(addr, pay()).await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert!(
        !again.headers.contains_key("idempotent-replayed"),
        "run again"
    );
    assert_nothing_denied(&server);
}

/// `.wait(..)` as the documented user: a duplicate waits for the holder,
/// marked as waited for and subscribed to the key's channel, and the
/// holder's release (which looks for that mark) lets it in; nothing is
/// denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_acl_runs_wait() {
    let (server, url) = acl_server(&["lock", "wait"]);
    let (tx, mut entered) = mpsc::unbounded_channel();
    let gate = Gate {
        entered: tx,
        permits: Arc::new(Semaphore::new(0)),
    };
    // Two instances: one process answers its own duplicate from its table
    // of leases in flight, without asking Redis.
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let backend = RedisBackend::connect(&url).await.expect("connects");
        let layer =
            RedisLockLayer::new(backend, (RequestMethod, Route)).wait(Duration::from_secs(8));
        let app = Router::new()
            .route("/pay", post(gated).layer(layer))
            .with_state(gate.clone());
        addrs.push(serve(app).await);
    }
    let first = tokio::spawn(send(addrs[0], req("POST", "/pay", &[], "")));
    entered.recv().await.unwrap();
    let dup = tokio::spawn(send(addrs[1], req("POST", "/pay", &[], "")));
    let marked = common::eventually(Duration::from_secs(5), || {
        server
            .cli(&["--scan", "--pattern", "trl:*:wait"])
            .lines()
            .any(|l| !l.is_empty())
    })
    .await;
    assert!(marked, "the duplicate waits, its key marked");
    gate.permits.add_permits(2);
    let first = first.await.unwrap();
    assert_eq!(first.status, 200, "{:?}", first.body);
    let dup = dup.await.unwrap();
    assert_eq!(dup.status, 200, "let in after the release: {:?}", dup.body);
    assert_nothing_denied(&server);
}

/// Two instances as the documented user, one request held on A and its
/// duplicate on B: B joins through the subscription and gets A's answer as
/// soon as A records it; nothing is denied.
async fn join_across_instances(url: &str) -> (common::Reply, common::Reply, Duration) {
    let (tx, mut entered) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let instance = |backend: RedisBackend| {
        let (tx, gate) = (tx.clone(), gate.clone());
        Router::new().route(
            "/pay",
            post(move || {
                let (tx, gate) = (tx.clone(), gate.clone());
                async move {
                    let _ = tx.send(());
                    gate.acquire().await.unwrap().forget();
                    (http::StatusCode::CREATED, "paid once")
                }
            })
            .layer(
                tower_redis_lock::IdempotencyLayer::new(backend, Route)
                    .join_timeout(Duration::from_secs(8)),
            ),
        )
    };
    let a = serve(instance(RedisBackend::connect(url).await.unwrap())).await;
    let b = serve(instance(RedisBackend::connect(url).await.unwrap())).await;
    let pay = || req("POST", "/pay", &[("idempotency-key", "k-1")], "{}");
    let first = tokio::spawn(send(a, pay()));
    entered.recv().await.unwrap();
    let dup = tokio::spawn(send(b, pay()));
    // B's claim marks the entry as waited for before it listens.
    let admin = url.replace("lock:lock-pw@", "");
    let port = admin.rsplit(':').next().unwrap().to_owned();
    let waited = common::eventually(Duration::from_secs(5), || {
        let out = Command::new("redis-cli")
            .args(["-p", &port, "--raw", "EVAL"])
            .arg("for _, k in ipairs(redis.call('KEYS', 'trl:{*:idem')) do if redis.call('HGET', k, 'w') then return 1 end end return 0")
            .arg("0")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim() == "1"
    })
    .await;
    assert!(waited, "the duplicate waits");
    let released = Instant::now();
    gate.add_permits(1);
    let first = first.await.unwrap();
    let dup = dup.await.unwrap();
    (first, dup, released.elapsed())
}

#[test]
fn documented_acl_runs_joining() {
    common::run_logged(|logs| async move {
        let (server, url) = acl_server(&["lock", "replay", "joining"]);
        let (first, dup, after) = join_across_instances(&url).await;
        assert_eq!(first.status, 201);
        assert_eq!(dup.body, first.body, "{dup:?}");
        assert_eq!(dup.headers["idempotent-replayed"], "true");
        assert!(
            after < Duration::from_secs(1),
            "woken by the publication: {after:?}"
        );
        assert_nothing_denied(&server);
        assert!(
            logs.lines_with(&["record_failed"]).is_empty(),
            "{}",
            logs.text()
        );
        assert!(
            logs.lines_with(&["no subscription"]).is_empty(),
            "{}",
            logs.text()
        );
    })
}

/// Without the joining rules PSUBSCRIBE and PUBLISH are refused: the record
/// is still written at the first attempt (the publication is a `pcall`),
/// the refused subscription is logged once, and the duplicate still gets
/// the answer from the store, long before the join bound.
#[test]
fn refused_pubsub_never_fails_a_record_and_joins_fall_back() {
    common::run_logged(|logs| async move {
        let (server, url) = acl_server(&["lock", "replay"]);
        let (first, dup, after) = join_across_instances(&url).await;
        assert_eq!(first.status, 201);
        assert_eq!(dup.body, first.body, "{dup:?}");
        assert_eq!(dup.headers["idempotent-replayed"], "true");
        assert!(
            after < Duration::from_secs(3),
            "answered from the store: {after:?}"
        );
        assert!(
            logs.lines_with(&["record_failed"]).is_empty(),
            "{}",
            logs.text()
        );
        assert_eq!(
            logs.lines_with(&["no subscription"]).len(),
            1,
            "logged once: {}",
            logs.text()
        );
        let denied = denied_objects(&server.cli(&["ACL", "LOG"]));
        assert!(denied.iter().any(|o| o == "psubscribe"), "{denied:?}");
    })
}

// ---- the examples print URLs without their secrets ----------------------------

/// Everything `binary` prints (stdout and stderr) with `env` set, until its
/// first stdout line (the start-up line; then it is stopped) or its exit (a
/// start-up error). A watchdog stops it after 30 s.
fn printed(binary: &std::path::Path, env: &[(&str, &str)]) -> String {
    use std::io::{BufRead, Read};
    let mut cmd = Command::new(binary);
    cmd.env_remove("REDIS_URL")
        .env_remove("REDLOCK_URLS")
        .env_remove("DATABASE_URL")
        .env("ADDR", "127.0.0.1:0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start the example");
    let pid = child.id().to_string();
    let (done, stop) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if stop.recv_timeout(Duration::from_secs(30)).is_err() {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
        }
    });
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut out = String::new();
    stdout.read_line(&mut out).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let _ = done.send(());
    watchdog.join().unwrap();
    stdout.read_to_string(&mut out).unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    out
}

/// `REDIS_URL` with an `@` in its password, a sentinel URL with
/// `sentinelPassword=`, and a `DATABASE_URL` with an `@` in its password:
/// whatever the examples print (start-up line or start-up error), no part of
/// a secret is in it (the examples' own redaction cut at the first `@` and
/// printed `redis://***@t-Pa55@…`). The `exactly_once` example's half of
/// this test moved with it to `tower-redis-lock-sql`
/// (`tests/it/examples.rs` there).
#[test]
fn examples_print_no_part_of_a_url_secret() {
    use crate::common::examples::example_binary;
    let (quickstart, ledger) = (&example_binary("quickstart"), &example_binary("ledger"));
    let server = RedisServer::start();
    assert_eq!(
        server.cli(&[
            "ACL",
            "SETUSER",
            "leak",
            "on",
            ">s3cr@t-Pa55",
            "~*",
            "&*",
            "+@all"
        ]),
        "OK"
    );
    let redis_url = format!("redis://leak:s3cr@t-Pa55@127.0.0.1:{}", server.port());
    let out = printed(quickstart, &[("REDIS_URL", &redis_url)]);
    assert!(out.contains("redis://"), "the URL is shown: {out}");
    for secret in ["s3cr", "t-Pa55", "Pa55"] {
        assert!(!out.contains(secret), "{secret:?} printed: {out}");
    }

    let closed = common::free_port();
    let sentinel = format!(
        "redis-sentinel://127.0.0.1:{closed}?sentinelServiceName=m&sentinelUsername=sen\
         &sentinelPassword=sentinel-s3cret"
    );
    let out = printed(quickstart, &[("REDIS_URL", &sentinel)]);
    assert!(out.contains("redis-sentinel://"), "the URL is shown: {out}");
    assert!(!out.contains("sentinel-s3cret"), "printed: {out}");

    // No database of that name: the example stops with an error naming the
    // URL (PostgreSQL up or not).
    let database_url = "postgres://postgres:pg@s3cret@127.0.0.1:5432/trl_no_such_database";
    let out = printed(ledger, &[("DATABASE_URL", database_url)]);
    assert!(out.contains("postgres://"), "the URL is shown: {out}");
    assert!(!out.contains("s3cret"), "printed: {out}");
}
