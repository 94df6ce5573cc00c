//! PostgreSQL for the integration tests (a database of the test's own on
//! 127.0.0.1:5432, dropped at the end, also on failure) and the example
//! binaries the process-level tests spawn.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

pub const PG_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
pub const PG_HINT: &str = "this test needs PostgreSQL on 127.0.0.1:5432 (user postgres, trust \
     auth). Start it (`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`) \
     or install it (Debian: `apt-get install postgresql`); `.ci/run` does both";

/// A client on `url`, or a loud failure with the hint.
pub async fn pg_connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| {
            let cause = std::error::Error::source(&e)
                .map(|c| format!(": {c}"))
                .unwrap_or_default();
            panic!("cannot connect to {url}: {e}{cause}\nHint: {PG_HINT}")
        });
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// A database of this test's own, dropped (`WITH (FORCE)`) when the guard
/// goes, on success and on panic alike.
pub struct Database {
    name: String,
}

static DATABASES: AtomicUsize = AtomicUsize::new(0);

impl Database {
    pub async fn create() -> Self {
        let n = DATABASES.fetch_add(1, Ordering::SeqCst);
        let name = format!("trl_it_{}_{n}", std::process::id());
        let admin = pg_connect(PG_ADMIN_URL).await;
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await
            .unwrap();
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}\nHint: {PG_HINT}"));
        Self { name }
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:5432/{}", self.name)
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        // On a thread of its own: Drop may run inside the test's runtime.
        let name = self.name.clone();
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let admin = pg_connect(PG_ADMIN_URL).await;
                admin
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("test: could not drop database {}", self.name);
        }
    }
}

/// `target/<profile>/examples/<name>`, built first with the features this
/// test was built with (so the library build is shared; a no-op when fresh).
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // target/<profile>/deps/bank-<hash>
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test runs from target/<profile>/deps");
    let target_dir = profile_dir.parent().expect("target/<profile>");
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev",
        Some(other) => other,
        None => "dev",
    };
    let mut features = vec!["axum", "redis"];
    if cfg!(feature = "metrics") {
        features.push("metrics");
    }
    if cfg!(feature = "tls-rustls") {
        features.push("tls-rustls");
    }
    if cfg!(feature = "postgres") {
        features.push("postgres");
    }
    if cfg!(feature = "sqlx-postgres") {
        features.push("sqlx-postgres");
    }
    if cfg!(feature = "sqlx-sqlite") {
        features.push("sqlx-sqlite");
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut build = Command::new(&cargo);
    // Without the variables cargo sets for a test process: build scripts
    // that watch them (ring watches CARGO_MANIFEST_DIR) would otherwise run
    // again, and everything above them rebuild, each time the environment
    // differs from the outer `cargo test`'s.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
                "OUT_DIR",
            ]
            .contains(&name.as_ref())
        {
            build.env_remove(name.as_ref());
        }
    }
    let status = build
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--quiet", "--example", name, "--profile", profile])
        .args(["--features", &features.join(",")])
        .arg("--target-dir")
        .arg(target_dir)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cargo}: {e}"));
    assert!(
        status.success(),
        "`cargo build --example {name}` failed ({status})"
    );
    let bin = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.exists(), "{} missing after the build", bin.display());
    bin
}
