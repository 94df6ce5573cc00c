//! A real PgBouncer in front of PostgreSQL (127.0.0.1:5432), started by the
//! test on a free port with an ini file of its own in a temporary
//! directory, killed on drop. A missing `pgbouncer` is a loud failure with
//! the install hint, never a skip.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::free_port;

pub const PGBOUNCER_HINT: &str = "this test needs PgBouncer (`pgbouncer` on PATH or in \
     /usr/sbin). Install it (Debian: `apt-get install pgbouncer`); `scripts/test.sh` does";

/// One `pgbouncer` process.
pub struct PgBouncer {
    child: Child,
    addr: SocketAddr,
    dir: PathBuf,
}

fn binary() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/sbin")])
        .map(|d| d.join("pgbouncer"))
        .find(|p| p.is_file());
    on_path.unwrap_or_else(|| panic!("pgbouncer not found.\nHint: {PGBOUNCER_HINT}"))
}

impl PgBouncer {
    /// Start one with `pool_mode` (`session`, `transaction`, `statement`),
    /// trust auth, every database of the local PostgreSQL; wait until it
    /// accepts connections.
    pub async fn start(pool_mode: &str) -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("trl-pgbouncer-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let users = dir.join("users.txt");
        std::fs::write(&users, "\"postgres\" \"\"\n").unwrap();
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n* = host=127.0.0.1 port=5432\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                 unix_socket_dir =\nauth_type = trust\nauth_file = {}\n\
                 pool_mode = {pool_mode}\nmax_client_conn = 200\ndefault_pool_size = 4\n\
                 ignore_startup_parameters = extra_float_digits,options\n",
                users.display()
            ),
        )
        .unwrap();
        let mut cmd = Command::new(binary());
        // PgBouncer refuses to run as root: it switches user itself.
        if is_root() {
            cmd.args(["-u", "postgres"]);
        }
        let child = cmd
            .arg(&ini)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start pgbouncer: {e}\nHint: {PGBOUNCER_HINT}"));
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut bouncer = Self { child, addr, dir };
        let end = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            if let Ok(Some(status)) = bouncer.child.try_wait() {
                panic!("pgbouncer exited at start ({status})\nHint: {PGBOUNCER_HINT}");
            }
            assert!(
                tokio::time::Instant::now() < end,
                "pgbouncer does not listen on {addr} after 10 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        bouncer
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
