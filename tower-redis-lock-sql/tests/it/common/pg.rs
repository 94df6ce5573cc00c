//! PostgreSQL for the integration tests (a database of the test's own on
//! 127.0.0.1:5432, dropped at the end, also on failure).

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
        let name = format!("trl_sql_it_{}_{n}", std::process::id());
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

    /// The database's name (to reach it through another address).
    pub fn name(&self) -> &str {
        &self.name
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
