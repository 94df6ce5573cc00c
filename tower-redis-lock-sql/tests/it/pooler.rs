//! A PostgreSQL store behind a transaction-mode pooler (a real PgBouncer,
//! `pool_mode = transaction`, started by the test): the store's session
//! hold (an advisory lock) and the handler's transaction need one server
//! session per claim, which such a pooler does not give. The store must
//! refuse with a clear error: the claim fails (503 problem+json), the log
//! names the pooler, the handler never runs, and no lock is left behind:
//! the same request sent straight to PostgreSQL then runs and answers 201.

use crate::common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use common::charging::serve_charging;
use common::pgbouncer::PgBouncer;
use common::stores::{layer, pay, pg_stores, send, Env, Kind, Pools};

/// Warnings and errors logged in this process (a global subscriber set
/// once; the tests run one at a time, see `common::run`).
fn logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let sink = buffer.clone();
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .try_init();
        buffer
    })
    .clone()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn behind_a_transaction_pooler(kind: Kind) {
    let env = Env::new(kind).await;
    env.batch("CREATE TABLE charges (k text NOT NULL)").await;
    // The table, made straight on PostgreSQL.
    let direct = env.store(&Pools::default()).await;
    let bouncer = PgBouncer::start("transaction").await;
    let logs = logs();
    logs.lock().unwrap().clear();
    let pooled = env.unmigrated_store(&Pools {
        via: Some(bouncer.addr()),
        ..Pools::default()
    });
    let (addr, app) = serve_charging(layer(&pooled)).await;
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(send(addr, pay("k1", "")).await.0);
    }
    let logged = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    let runs_pooled = app.runs();
    // Straight to PostgreSQL: nothing of the pooled attempts holds the key.
    let (direct_addr, direct_app) = serve_charging(layer(&direct)).await;
    let straight = send(direct_addr, pay("k1", "")).await.0;
    let report = format!(
        "{kind:?}: through PgBouncer (transaction mode) {answers:?}, handler runs {runs_pooled}; \
         then straight to PostgreSQL {straight:?}, handler runs {}; charges {}; logged:\n{logged}",
        direct_app.runs(),
        env.charges().await
    );
    println!("{report}");
    assert!(
        answers.iter().all(|a| a == "503 unavailable retry-after"),
        "the store refuses a transaction-mode pooler: {report}"
    );
    assert_eq!(runs_pooled, 0, "the handler never runs behind it: {report}");
    let lower = logged.to_lowercase();
    assert!(
        lower.contains("pgbouncer") || lower.contains("pooler"),
        "the log names the pooler: {report}"
    );
    assert_eq!(straight, "201", "no lock left behind: {report}");
    assert_eq!((direct_app.runs(), env.charges().await), (1, 1), "{report}");
}

pg_stores!(
    behind_a_transaction_mode_pooler_the_store_refuses_and_leaves_no_lock,
    behind_a_transaction_pooler
);
