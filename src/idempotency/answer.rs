//! The answers the layer gives itself: a replay of a record, the 410 of a
//! record not stored, the rejections (with their log line and count), the
//! 503s of a store that failed or a record refused, and the problem answers
//! of a handler that failed after it began.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{Response, StatusCode};
use tokio::time::Instant;

use super::body::StoredTrailers;
use super::config::Config;
use super::record::{Record, StoredResponse};
use super::seal::Unsealed;
use crate::backend::BackendError;
use crate::key::LockKey;
use crate::stats::IdempotencyOutcome;
use crate::Rejection;

/// Response header added to replayed responses.
const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A rejection's answer, logged at DEBUG.
pub(super) fn rejected(config: &Config, r: Rejection) -> Response<Bytes> {
    tracing::debug!(outcome = r.kind(), "rejected: {r}");
    config.settings.reject(&r)
}

/// A scope at its quota: DEBUG for each request, and a WARN at most once a
/// minute per layer (a flood must not flood the logs too).
pub(super) fn over_quota(config: &Config, digest: &LockKey, scope: &LockKey) {
    tracing::debug!(key = %digest, scope = %scope, outcome = "over_quota", "answering 429");
    let now = Instant::now();
    let mut last = config
        .quota_warned
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if last.is_none_or(|at| now >= at + Duration::from_secs(60)) {
        *last = Some(now);
        tracing::warn!(
            scope = %scope,
            quota_entries = config.quota.entries,
            quota_bytes = config.quota.bytes,
            "a scope (identity and route) holds its whole share of the idempotency store; \
             its new keys get 429 until its oldest entries expire. If one scope is meant to \
             make that many requests (the key parts name no identity, or one client is a \
             busy backend), raise IdempotencyLayer::scope_quota"
        );
    }
}

/// A record read from the store that failed authentication or decoding:
/// never replayed, never a reason to run the handler again (its first run
/// happened). 503, and an ERROR that says what to look at.
pub(super) fn untrusted_record(
    config: &Config,
    digest: &LockKey,
    error: Unsealed,
) -> Response<Bytes> {
    tracing::error!(key = %digest, outcome = "untrusted_record", error = %error, "the stored record for this key was refused; answering 503 (check who else writes to this Redis, and that every instance uses the same KeySpace secret)");
    config.stats.record(IdempotencyOutcome::BackendError);
    config.settings.reject(&Rejection::Unavailable {
        retry_after: Duration::from_secs(1),
    })
}

pub(super) fn unavailable(
    config: &Config,
    digest: &LockKey,
    error: BackendError,
) -> Response<Bytes> {
    tracing::warn!(key = %digest, outcome = "backend_error", error = %error, "idempotency store failed; answering 503");
    config.stats.record(IdempotencyOutcome::BackendError);
    config.settings.reject(&Rejection::Unavailable {
        retry_after: Duration::from_secs(1),
    })
}

/// The answer to a request that found a finished record (`joined`: it
/// waited for the request in flight to record it).
pub(super) fn answer_record(
    config: &Config,
    digest: &LockKey,
    record: Record,
    joined: bool,
) -> Response<Bytes> {
    match record {
        Record::Response(stored) => {
            tracing::debug!(key = %digest, outcome = "replayed", joined);
            config.stats.record(if joined {
                IdempotencyOutcome::Joined
            } else {
                IdempotencyOutcome::Replayed
            });
            replay(config, stored)
        }
        Record::NotStored { status, reason } => {
            config.stats.record(IdempotencyOutcome::NotStored);
            let r = Rejection::NotStored {
                status,
                reason: reason.explain(),
            };
            tracing::debug!(key = %digest, outcome = r.kind(), "rejected: {r}");
            config.settings.reject(&r)
        }
    }
}

/// The stored response, with only the headers (and trailers) this layer
/// stores (a record read back is untrusted: whatever else it carries is
/// dropped). Its trailers ride in the extensions to the body
/// ([`ResponseBody::answer`](super::body::ResponseBody::answer)).
fn replay(config: &Config, stored: StoredResponse) -> Response<Bytes> {
    let grpc = crate::wire::grpc::is_grpc(&stored.headers);
    let mut res = Response::new(stored.body);
    *res.status_mut() = stored.status;
    *res.headers_mut() = config.stored(&stored.headers, grpc);
    res.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if let Some(trailers) = stored.trailers {
        let trailers = config.stored(&trailers, grpc);
        res.extensions_mut().insert(StoredTrailers(trailers));
    }
    res
}

/// What the handler failed with, in words, for a gRPC client.
const FAILED_MESSAGE: &str = "Request failed: the request failed on the server after it began; \
     whether it took effect is unknown. Repeating it with this idempotency-key returns this \
     answer; look the result up before repeating it with a new key.";

/// The answer recorded for a handler that panicked after it began: for a
/// gRPC request (`grpc`) `UNKNOWN` (what gRPC answers for a handler that
/// ended without a status), else a 500 problem+json.
pub(super) fn panic_response(grpc: bool) -> Response<Bytes> {
    if grpc {
        return crate::wire::grpc::status_response(
            crate::wire::grpc::code::UNKNOWN,
            FAILED_MESSAGE,
            None,
        );
    }
    crate::wire::problem::problem_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "handler-failed",
        "Request failed",
        "The request failed on the server after it began; whether it took effect is \
         unknown. Repeating it with this Idempotency-Key returns this answer; look the \
         result up before repeating it with a new key.",
        None,
        |_| {},
    )
}

/// The final answer of a request whose handler ended its own transaction
/// (`COMMIT` or `ROLLBACK` on the transaction a transactional store gave
/// it): kept as the key's record, so that no retry runs it again.
pub(super) fn transaction_ended_response(grpc: bool) -> Response<Bytes> {
    if grpc {
        return crate::wire::grpc::status_response(
            crate::wire::grpc::code::INTERNAL,
            "Request's transaction ended by its handler: its work and its idempotency record could not commit together; repeating it with this key returns this answer.",
            None,
        );
    }
    crate::wire::problem::problem_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "transaction-ended",
        "Request's transaction ended by its handler",
        "The handler committed or rolled back the request's database transaction itself, \
         so its work and its idempotency record could not commit together. What it did \
         outside that transaction may have taken effect. Repeating the request with this \
         Idempotency-Key returns this answer and never runs it again; look the result up \
         before repeating it with a new key.",
        None,
        |_| {},
    )
}

/// The answer when the run ended without one (runtime shutdown):
/// `UNKNOWN` for a gRPC request (`grpc`), else a 500 problem+json.
pub(super) fn internal_error(grpc: bool) -> Response<Bytes> {
    if grpc {
        return crate::wire::grpc::status_response(
            crate::wire::grpc::code::UNKNOWN,
            "Request failed: the server stopped before the request completed.",
            None,
        );
    }
    crate::wire::problem::problem_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "handler-failed",
        "Request failed",
        "The server stopped before the request completed.",
        None,
        |_| {},
    )
}
