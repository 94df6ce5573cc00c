//! Shared by the examples: start logging, serve with a graceful shutdown
//! that drains the store. Not part of the library API (a copy of the part of
//! the middleware's `examples/support/mod.rs` these examples use).
#![allow(dead_code)]

use std::sync::Arc;

use tower_redis_lock::backend::Backend;

/// `2 * N` lowercase hex digits from the operating system's random source.
pub fn random_hex<const N: usize>() -> String {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).expect("the OS random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `$ADDR` or the default.
pub fn addr_from_env(default: &str) -> String {
    std::env::var("ADDR").unwrap_or_else(|_| default.to_owned())
}

/// Logging at `warn` by default (no per-request lines); `RUST_LOG` overrides.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Logs go to stderr: stdout carries only the one start-up line.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// The value, or exit with status 2 and `example: error` on stderr (a start-up
/// problem the user must fix: bad URL, unreachable Redis, port taken).
pub fn or_exit<T>(example: &str, result: Result<T, String>) -> T {
    result.unwrap_or_else(|e| {
        eprintln!("{example}: {e}");
        std::process::exit(2);
    })
}

/// Listen on `$ADDR` (or `default`); returns the listener and the address it
/// really got (`127.0.0.1:0` picks a free port). Exits 2 if it cannot bind.
pub async fn bind(example: &str, default: &str) -> (tokio::net::TcpListener, String) {
    let addr = addr_from_env(default);
    let listener = or_exit(
        example,
        tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}")),
    );
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or(addr);
    (listener, local)
}

/// How long a graceful shutdown waits for requests still running.
const GRACE: std::time::Duration = std::time::Duration::from_secs(30);
/// How long it then waits for the store: releases still on their way to
/// Redis, claims still open in a SQL store.
const DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Serve `app` until SIGTERM or Ctrl-C, then shut down gracefully: stop
/// accepting, let the requests in flight finish (up to 30 s), and wait (up
/// to 5 s) for `store` to drain (every pending release delivered, every
/// open claim completed or abandoned), so nothing is left behind by the
/// process. Exits 1 on a server error.
pub async fn serve(
    example: &str,
    listener: tokio::net::TcpListener,
    app: axum::Router,
    store: Arc<dyn Backend>,
) {
    let (signalled, mut stopping) = tokio::sync::watch::channel(false);
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        shutdown_signal().await;
        let _ = signalled.send(true);
    });
    let grace = async {
        let _ = stopping.wait_for(|stop| *stop).await;
        tokio::time::sleep(GRACE).await;
    };
    tokio::select! {
        result = std::future::IntoFuture::into_future(server) => {
            if let Err(e) = result {
                eprintln!("{example}: server error: {e}");
                std::process::exit(1);
            }
        }
        () = grace => eprintln!("{example}: requests still running after {} s; stopping anyway", GRACE.as_secs()),
    }
    match store.drain(DRAIN).await {
        Ok(()) => eprintln!("{example}: shut down; the {} store drained", store.name()),
        Err(e) => eprintln!("{example}: shut down; {e}"),
    }
}

/// Resolves on Ctrl-C (SIGINT) or, on Unix, SIGTERM (what `kill`, systemd,
/// Docker and Kubernetes send).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

/// A URL as these examples print it: its scheme and host part only. The user,
/// the password (which may itself hold `@`, `/` or `?`) and the query (where
/// `sentinelPassword=` lives) are dropped; a string without `scheme://` is
/// not shown at all.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "***".to_owned();
    };
    // Everything up to the last `@` is userinfo, whatever it holds.
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let host = host.split(['?', '#']).next().unwrap_or_default();
    format!("{scheme}://{host}")
}

/// An RFC 9457 problem answer.
pub fn problem(
    status: http::StatusCode,
    title: &str,
    detail: impl Into<String>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let body = serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail.into(),
    });
    (
        status,
        [(http::header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}
