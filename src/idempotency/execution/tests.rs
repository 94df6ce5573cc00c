//! How the layer ends a claim on a transactional store, driven by a
//! scripted store. The store is a stand-in (a `MemoryBackend` that says it
//! is transactional and answers as told): what a real SQL store answers on
//! each path is tested against PostgreSQL and SQLite in the
//! `tower-redis-lock-sql` crate; here only the layer's side is checked,
//! which needs answers a real database gives only under faults.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::ServiceExt;
use tower_layer::Layer;

use crate::backend::contract::{BackendFuture, Claim, EntryKey, Token};
use crate::backend::{Backend, BackendError, ClaimTerms, IdempotencyBackend};
use crate::key::{KeySpace, Route};
use crate::{IdempotencyLayer, MemoryBackend};

/// What the scripted store answers instead of the memory store.
#[derive(Debug, Clone, Copy)]
enum Script {
    /// Every claim finds the key final (`Claim::Ended`).
    ClaimEnded,
    /// An abandon finds that the handler ended the transaction.
    AbandonEnded,
    /// A completion cannot confirm its commit.
    CompleteUnknown,
    /// A completion takes `ms` (a slow `COMMIT`), then succeeds.
    CompleteSlow(u64),
    /// A completion finds another request's claim in the key's place.
    CompleteTaken,
    /// Not transactional (a store that keeps a lapsed claim's record, as
    /// Redis and memory do), and unreachable for renewals and completions
    /// until this instant.
    DownUntil(tokio::time::Instant),
    /// Not transactional; refuses every record over this many bytes (a
    /// store with an item size limit).
    RefusesOver(usize),
}

#[derive(Debug, Clone)]
struct Scripted {
    memory: MemoryBackend,
    script: Script,
}

impl Backend for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }

    fn is_in_process(&self) -> bool {
        true
    }

    fn drain(&self, _timeout: Duration) -> BackendFuture<()> {
        BackendFuture::ready(Ok(()))
    }
}

impl IdempotencyBackend for Scripted {
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        terms: &ClaimTerms,
    ) -> BackendFuture<Claim> {
        match self.script {
            Script::ClaimEnded => BackendFuture::ready(Ok(Claim::Ended)),
            _ => self.memory.claim(key, token, fingerprint, terms),
        }
    }

    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        match self.script {
            Script::CompleteUnknown => {
                BackendFuture::ready(Err(BackendError::outcome_unknown("commit answer lost")))
            }
            Script::CompleteSlow(ms) => {
                let answer = self
                    .memory
                    .complete(key, token, fingerprint, record, retention);
                BackendFuture::new(async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    answer.await
                })
            }
            Script::CompleteTaken => BackendFuture::ready(Ok(false)),
            Script::RefusesOver(most) if record.len() > most => {
                BackendFuture::ready(Err(BackendError::new("item over the size limit")))
            }
            Script::DownUntil(at) if tokio::time::Instant::now() < at => {
                BackendFuture::ready(Err(BackendError::unavailable("down")))
            }
            _ => self
                .memory
                .complete(key, token, fingerprint, record, retention),
        }
    }

    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        match self.script {
            Script::DownUntil(at) if tokio::time::Instant::now() < at => {
                BackendFuture::ready(Err(BackendError::unavailable("down")))
            }
            _ => self.memory.extend(key, token, lease),
        }
    }

    fn abandon(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        match self.script {
            Script::AbandonEnded => BackendFuture::ready(Err(BackendError::transaction_ended(
                "the handler committed",
            ))),
            _ => self.memory.abandon(key, token, lease),
        }
    }

    fn claim_timeout(&self, deadline: Duration) -> Duration {
        deadline
    }

    fn hold(&self) -> Option<Box<dyn Send>> {
        None
    }

    fn feed(
        &self,
        _key_space: &KeySpace,
    ) -> Option<BackendFuture<tokio::sync::mpsc::Receiver<(Bytes, Bytes)>>> {
        None
    }

    fn claimed(&self, _key: &EntryKey, _token: &Token, _extensions: &mut http::Extensions) {}

    fn is_transactional(&self) -> bool {
        !matches!(self.script, Script::DownUntil(_) | Script::RefusesOver(_))
    }
}

fn request() -> Request<Full<Bytes>> {
    Request::post("/pay")
        .header("idempotency-key", "k-1")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

/// Two requests with one key through a layer over `script`, the handler
/// answering `status`: both answers (status, problem type if any), how
/// often the handler ran, and the layer's stats.
async fn twice(
    script: Script,
    status: StatusCode,
) -> (
    [(StatusCode, String); 2],
    usize,
    crate::stats::IdempotencyStats,
) {
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let inner = tower::service_fn(move |_: Request<Full<Bytes>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            let mut res = Response::new(Full::new(Bytes::from_static(b"{\"id\":\"ch_1\"}")));
            *res.status_mut() = status;
            Ok::<_, Infallible>(res)
        }
    });
    let store = Scripted {
        memory: MemoryBackend::new(),
        script,
    };
    let layer = IdempotencyLayer::new(store, Route);
    let svc = layer.clone().layer(inner);
    let mut answers = Vec::new();
    for _ in 0..2 {
        let res = svc.clone().oneshot(request()).await.unwrap();
        let status = res.status();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        let kind = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .unwrap_or_default();
        answers.push((status, kind));
    }
    let answers = [answers[0].clone(), answers[1].clone()];
    (answers, runs.load(Ordering::SeqCst), layer.stats())
}

#[tokio::test]
async fn a_key_the_store_found_ended_is_answered_transaction_ended_without_running() {
    let ([first, second], runs, stats) = twice(Script::ClaimEnded, StatusCode::CREATED).await;
    assert_eq!(runs, 0, "a final key never runs");
    for (status, kind) in [first, second] {
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(kind.ends_with("transaction-ended"), "{kind}");
    }
    assert_eq!(stats.transaction_ended, 2);
}

#[tokio::test]
async fn an_abandon_the_store_refused_answers_transaction_ended_not_the_handlers_429() {
    // The handler answered 429 (not kept): the layer frees the key, but the
    // store says the handler's transaction committed. Before, the layer
    // answered the 429, and a retry ran the handler again.
    let ([first, _], runs, stats) =
        twice(Script::AbandonEnded, StatusCode::TOO_MANY_REQUESTS).await;
    assert_eq!(first.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(first.1.ends_with("transaction-ended"), "{}", first.1);
    assert!(stats.transaction_ended >= 1);
    assert!(runs >= 1);
}

#[tokio::test]
async fn a_commit_not_confirmed_is_answered_outcome_unknown() {
    let ([first, _], _, stats) = twice(Script::CompleteUnknown, StatusCode::CREATED).await;
    assert_eq!(first.0, StatusCode::SERVICE_UNAVAILABLE);
    assert!(first.1.ends_with("outcome-unknown"), "{}", first.1);
    assert!(stats.outcome_unknown >= 1);
}

#[tokio::test(start_paused = true)]
async fn a_slow_commit_is_not_cut_at_the_deadline() {
    // A COMMIT of 2 s, ten times the default 200 ms deadline: the client
    // gets the handler's answer once it committed, and the retry replays it.
    let ([first, second], runs, stats) =
        twice(Script::CompleteSlow(2_000), StatusCode::CREATED).await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(second.0, StatusCode::CREATED, "replayed");
    assert_eq!(runs, 1);
    assert_eq!(stats.recorded, 1);
    assert_eq!(stats.outcome_unknown, 0);
}

/// A record the store refuses (another request's claim took the key's
/// place: the claim lapsed and a retry claimed it, a moment only a race
/// produces on a real store, hence the scripted store) is counted as a
/// record failure.
#[tokio::test(start_paused = true)]
async fn a_record_another_claim_refused_is_counted_as_failed() {
    let (_, _, stats) = twice(Script::CompleteTaken, StatusCode::CREATED).await;
    assert_eq!((stats.recorded, stats.record_failed), (0, 1));
}

/// A handler that ends while its store cannot be reached, its claim lapsed
/// (no renewal landed), gets its record once the store is back within a
/// TTL, and the retry replays it. Before, the layer gave up at the claim's
/// expiry, already past, after one try, and the retry ran the handler
/// again.
#[tokio::test(start_paused = true)]
async fn a_record_is_tried_for_a_ttl_after_its_claim_lapsed() {
    let began = tokio::time::Instant::now();
    let store = Scripted {
        memory: MemoryBackend::new(),
        // Down from just after the claim until 2 s.
        script: Script::DownUntil(began + Duration::from_secs(2)),
    };
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let inner = tower::service_fn(move |_: Request<Full<Bytes>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            // Past the claim's 1 s TTL.
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"paid"))))
        }
    });
    let layer = IdempotencyLayer::new(store, Route).ttl(Duration::from_secs(1));
    let svc = layer.clone().layer(inner);
    let first = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    tokio::time::sleep_until(began + Duration::from_secs(3)).await;
    let retry = svc.oneshot(request()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::OK);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(layer.stats().recorded, 1);
}

/// A store that refuses every record over its size limit: the response
/// could not be recorded until its claim would expire, and a retry after
/// that ran the handler again. Its not-stored marker gets a last try and
/// is kept: the retry is answered 410, not run.
#[tokio::test(start_paused = true)]
async fn a_record_the_store_refuses_leaves_its_not_stored_marker() {
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let inner = tower::service_fn(move |_: Request<Full<Bytes>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            let mut res = Response::new(Full::new(Bytes::from(vec![b'x'; 2_000])));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(res)
        }
    });
    let store = Scripted {
        memory: MemoryBackend::new(),
        script: Script::RefusesOver(1_000),
    };
    let svc = IdempotencyLayer::new(store, Route)
        .ttl(Duration::from_millis(300))
        .layer(inner);
    let first = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(
        first.status(),
        StatusCode::CREATED,
        "the first gets its answer"
    );
    // Past any claim the first request could still hold.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let retry = svc.oneshot(request()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::GONE, "told it was not stored");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "never run again");
}
