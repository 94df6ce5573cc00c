//! Checkout page: the anti-double-click story in a browser.
//!
//! ```text
//! cargo run --example checkout                                  # in-memory backend
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example checkout # Redis
//! ```
//!
//! - listens on `$ADDR` (default `127.0.0.1:3002`; `127.0.0.1:0` picks a free
//!   port) and prints one line with the address and the backend;
//! - `GET /` serves a small checkout page (inline HTML, CSS and JS, nothing
//!   external). If the browser has no `checkout_uid` cookie yet, the answer
//!   sets one: 128 random bits, a stand-in for a real session. Open the page
//!   in a private window and you are another user;
//! - the page's **Pay** button POSTs the order as JSON with `fetch` to `/pay`.
//!   It is deliberately *not* disabled while a payment runs: the server is
//!   what protects. Every click adds a line to the page: the payment, or
//!   "already in progress" when the layer answers 409 problem+json;
//! - `POST /pay?delay_ms=800` is locked on method, route, the cookie's user
//!   and a digest of the body. The handler waits `delay_ms` (default 800, so
//!   a double click overlaps) and answers 200 JSON. The page forwards its own
//!   `?delay_ms=` to `/pay`;
//! - the page's **Pay once** button POSTs the same order to `/pay-once`, an
//!   idempotent payment: the page makes one `Idempotency-Key` per checkout
//!   attempt (per page load, or `?attempt=<key>` to continue one), so a
//!   double click, or a retry after the answer was lost, gets the same
//!   payment. `/pay-once` sits behind an `IdempotencyLayer` (same key parts
//!   as `/pay`, a 5 s join bound): a duplicate that arrives while the
//!   payment runs waits for it and shows the same payment id, marked
//!   "replayed"; the handler answers `201` JSON with a fresh `payment_id`;
//! - `GET /stats` returns `{"executions": N}`: how often `/pay` and
//!   `/pay-once` ran here;
//! - `LOCK_DEADLINE_MS` (optional, default 200) bounds every backend call.
//! - SIGTERM or Ctrl-C shuts it down gracefully: no new connections, the
//!   requests in flight finish (up to 30 s), their releases are delivered
//!   (`Backend::drain`), exit status 0.
//!
//! Run two of these with the same `REDIS_URL` on two ports: the same user's
//! double click across both pages still runs once (cookies are per host, not
//! per port, so one browser is the same user on both).
//!
//! The cookie is a demo session: in production take identity from your
//! session or auth layer (`key::Identity<T>`).

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, COOKIE, SET_COOKIE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use tower_redis_lock::key::{KeyWriter, MissingPart, RequestMethod, Route};
use tower_redis_lock::{IdempotencyLayer, RedisLockLayer};

/// Name of the demo session cookie.
const COOKIE_NAME: &str = "checkout_uid";

#[derive(Clone)]
struct App {
    executions: Arc<AtomicU64>,
    /// The page with the server's address and backend filled in; `{{user}}`
    /// is left for each request.
    page: Arc<str>,
    server: Arc<str>,
}

#[derive(Deserialize)]
struct PayParams {
    delay_ms: Option<u64>,
}

#[derive(Deserialize)]
struct Order {
    item: String,
    amount_cents: u64,
}

/// The user id from the `checkout_uid` cookie: 32 lowercase hex digits, or
/// `None` when absent or malformed.
fn user_from_cookies(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE_NAME)
        .map(|(_, value)| value)
        .filter(|v| v.len() == 32 && v.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// The lock key part: the user from the cookie; none -> 401 problem+json.
fn cookie_user(parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
    match user_from_cookies(&parts.headers) {
        Some(user) => {
            key.push("user", user.as_bytes());
            Ok(())
        }
        None => Err(MissingPart::unauthenticated(
            "user",
            "no checkout session cookie: load the checkout page first",
        )),
    }
}

async fn checkout_page(State(app): State<App>, headers: HeaderMap) -> Response {
    let (user, new_cookie) = match user_from_cookies(&headers) {
        Some(user) => (user.to_owned(), None),
        None => {
            let user = support::random_hex::<16>();
            let cookie = format!("{COOKIE_NAME}={user}; Path=/; HttpOnly; SameSite=Strict");
            (user, Some(cookie))
        }
    };
    // `user` is 32 hex digits here, safe to put into HTML as it is.
    let body = app.page.replace("{{user}}", &user[..8]);
    let mut res = (
        [
            (
                CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            ),
            (CACHE_CONTROL, HeaderValue::from_static("no-store")),
        ],
        body,
    )
        .into_response();
    if let Some(cookie) = new_cookie.and_then(|c| HeaderValue::from_str(&c).ok()) {
        res.headers_mut().insert(SET_COOKIE, cookie);
    }
    res
}

async fn pay(
    State(app): State<App>,
    Query(p): Query<PayParams>,
    Json(order): Json<Order>,
) -> Json<serde_json::Value> {
    let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let delay = p.delay_ms.unwrap_or(800).min(10_000);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    Json(serde_json::json!({
        "status": "paid",
        "execution": n,
        "item": order.item,
        "amount_cents": order.amount_cents,
        "server": &*app.server,
    }))
}

/// The idempotent payment: one execution per checkout attempt's key.
async fn pay_once(
    State(app): State<App>,
    Query(p): Query<PayParams>,
    Json(order): Json<Order>,
) -> (StatusCode, Json<serde_json::Value>) {
    let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let delay = p.delay_ms.unwrap_or(800).min(10_000);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let body = serde_json::json!({
        "status": "paid",
        "payment_id": format!("pay_{}", support::random_hex::<8>()),
        "execution": n,
        "item": order.item,
        "amount_cents": order.amount_cents,
        "server": &*app.server,
    });
    (StatusCode::CREATED, Json(body))
}

async fn stats(State(app): State<App>) -> Json<serde_json::Value> {
    Json(serde_json::json!({"executions": app.executions.load(Ordering::SeqCst)}))
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `LOCK_DEADLINE_MS`, or the layer's default of 200 ms.
fn deadline_ms() -> u64 {
    std::env::var("LOCK_DEADLINE_MS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(200)
}

#[tokio::main]
async fn main() {
    support::init_tracing();
    let (backend, backend_name) = support::or_exit("checkout", support::backend_from_env().await);
    let drain = backend.clone();
    let lock = RedisLockLayer::new(backend, (RequestMethod, Route, cookie_user))
        .digest_body()
        .body_limit(16 * 1024)
        .ttl(Duration::from_secs(30))
        .deadline(Duration::from_millis(deadline_ms()));

    let (store, _) = support::or_exit("checkout", support::replay_store_from_env().await);
    let once: IdempotencyLayer = store
        .idempotency_layer((RequestMethod, Route, cookie_user))
        .ttl(Duration::from_secs(30))
        .deadline(Duration::from_millis(deadline_ms()))
        // A double click waits for the first click's payment.
        .join_timeout(Duration::from_secs(5));

    let (listener, local) = support::bind("checkout", "127.0.0.1:3002").await;
    let page = PAGE
        .replace("{{server}}", &html_escape(&local))
        .replace("{{backend}}", &html_escape(&backend_name));
    let app = App {
        executions: Arc::default(),
        page: page.into(),
        server: local.as_str().into(),
    };

    let router = Router::new()
        .route("/", get(checkout_page))
        .route("/pay", post(pay).layer(lock))
        .route("/pay-once", post(pay_once).layer(once))
        .route("/stats", get(stats))
        .with_state(app);

    println!("checkout listening on http://{local} with the {backend_name} backend");
    support::serve("checkout", listener, router, drain).await;
}

/// The whole page. `{{server}}`, `{{backend}}` are filled in at start-up,
/// `{{user}}` per request.
const PAGE: &str = r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Checkout</title>
<style>
  :root { --ink:#1f2430; --muted:#6b7280; --line:#e5e7eb; --ok:#047857; --okbg:#ecfdf5;
          --busy:#b45309; --busybg:#fffbeb; --err:#b91c1c; --errbg:#fef2f2; --brand:#4f46e5; }
  * { box-sizing: border-box; }
  body { margin:0; font:15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
         color:var(--ink); background:#f3f4f6; }
  main { max-width:560px; margin:32px auto; padding:0 16px; }
  .card { background:#fff; border:1px solid var(--line); border-radius:12px; padding:20px 22px;
          box-shadow:0 1px 2px rgba(0,0,0,.04); margin-bottom:16px; }
  h1 { font-size:20px; margin:0 0 4px; }
  .meta { color:var(--muted); font-size:13px; }
  .meta code { background:#f3f4f6; padding:1px 5px; border-radius:4px; }
  .line { display:flex; justify-content:space-between; padding:10px 0; border-bottom:1px solid var(--line); }
  .total { font-weight:600; border-bottom:0; }
  button#pay { width:100%; margin-top:12px; padding:12px; font-size:16px; font-weight:600;
               color:#fff; background:var(--brand); border:0; border-radius:8px; cursor:pointer; }
  button#pay:active, button#pay-once:active { transform:translateY(1px); }
  button#pay-once { width:100%; margin-top:8px; padding:12px; font-size:16px; font-weight:600;
               color:var(--brand); background:#fff; border:2px solid var(--brand); border-radius:8px; cursor:pointer; }
  h2 { font-size:15px; margin:0 0 8px; }
  ol#outcomes { list-style:none; margin:0; padding:0; }
  ol#outcomes li { padding:8px 10px; border-radius:6px; margin-bottom:6px; font-size:14px;
                   display:flex; justify-content:space-between; gap:12px; }
  ol#outcomes li .ms { color:var(--muted); font-variant-numeric:tabular-nums; white-space:nowrap; }
  li.pending { background:#f9fafb; color:var(--muted); }
  li.success { background:var(--okbg); color:var(--ok); }
  li.in-progress { background:var(--busybg); color:var(--busy); }
  li.error { background:var(--errbg); color:var(--err); }
  #empty { color:var(--muted); font-size:14px; }
</style>
</head>
<body>
<main>
  <div class="card">
    <h1>Checkout</h1>
    <div class="meta">Guest <code id="user">{{user}}</code> &middot;
      server <code id="server">{{server}}</code> &middot; <code id="backend">{{backend}}</code>
      &middot; attempt <code id="attempt"></code></div>
    <div class="line"><span>Merino wool scarf</span><span>&euro;42.00</span></div>
    <div class="line"><span>Shipping</span><span>&euro;0.00</span></div>
    <div class="line total"><span>Total</span><span>&euro;42.00</span></div>
    <button id="pay" type="button">Pay &euro;42.00</button>
    <button id="pay-once" type="button">Pay &euro;42.00 once (Idempotency-Key)</button>
  </div>
  <div class="card">
    <h2>What happened</h2>
    <p id="empty">Each click is listed here. The buttons stay enabled on purpose:
      Pay is refused while the same payment runs; Pay once sends one
      Idempotency-Key per checkout attempt, so every click gets the same payment.</p>
    <ol id="outcomes"></ol>
  </div>
</main>
<script>
(() => {
  const order = { item: "merino-scarf", amount_cents: 4200 };
  const params = new URLSearchParams(location.search);
  const delay = params.get("delay_ms");
  const query = delay ? "?delay_ms=" + encodeURIComponent(delay) : "";
  // One Idempotency-Key per checkout attempt: this page load, or the
  // attempt named in ?attempt= (to continue it elsewhere).
  const attempt = params.get("attempt") || Array.from(
    crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, "0")).join("");
  document.getElementById("attempt").textContent = attempt.slice(0, 8);
  const list = document.getElementById("outcomes");
  let clicks = 0;

  function show(li, outcome, text, ms) {
    li.className = outcome;
    li.dataset.outcome = outcome;
    li.firstChild.textContent = text;
    li.lastChild.textContent = ms + " ms";
  }

  async function pay(once) {
    const n = ++clicks;
    document.getElementById("empty").hidden = true;
    const li = document.createElement("li");
    li.className = "pending";
    li.dataset.outcome = "pending";
    li.dataset.click = String(n);
    li.dataset.kind = once ? "once" : "lock";
    li.append(document.createElement("span"), document.createElement("span"));
    li.lastChild.className = "ms";
    li.firstChild.textContent = "Click " + n + ": paying\u2026";
    list.append(li);
    const start = Date.now();
    li.dataset.start = String(start);
    const headers = { "content-type": "application/json" };
    if (once) headers["idempotency-key"] = attempt;
    try {
      const res = await fetch((once ? "/pay-once" : "/pay") + query, {
        method: "POST",
        headers,
        body: JSON.stringify(order),
        credentials: "same-origin",
      });
      const type = res.headers.get("content-type") || "";
      const body = type.includes("json") ? await res.json() : { detail: await res.text() };
      const end = Date.now();
      li.dataset.end = String(end);
      li.dataset.status = String(res.status);
      if (res.ok && once) {
        const replayed = res.headers.get("idempotent-replayed") === "true";
        li.dataset.payment = body.payment_id;
        li.dataset.replayed = String(replayed);
        show(li, "success", "Click " + n + ": paid \u2014 payment " + body.payment_id +
             " (execution #" + body.execution + " on " + body.server + ")" +
             (replayed ? " \u00b7 same payment, replayed" : ""), end - start);
      } else if (res.ok) {
        show(li, "success", "Click " + n + ": paid \u2014 execution #" + body.execution +
             " on " + body.server, end - start);
      } else if (res.status === 409) {
        show(li, "in-progress", "Click " + n + ": already in progress \u2014 409, not charged",
             end - start);
      } else {
        show(li, "error", "Click " + n + ": " + res.status + " " + (body.title || body.detail || ""),
             end - start);
      }
    } catch (e) {
      li.dataset.end = String(Date.now());
      show(li, "error", "Click " + n + ": network error: " + e, Date.now() - start);
    }
  }

  document.getElementById("pay").addEventListener("click", () => pay(false));
  document.getElementById("pay-once").addEventListener("click", () => pay(true));
})();
</script>
</body>
</html>
"#;
