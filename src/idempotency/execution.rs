//! The run of a request that won its claim (in the connection's task, and
//! in a task of its own once the connection stops waiting): it runs the inner
//! service's future and the response body up to the record limit, renews
//! the claim while they run, records the outcome (or frees the key) whatever
//! becomes of the connection, tells the duplicates that joined, and hands
//! the answer to the connection if it still waits.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures_util::FutureExt;
use http::response::Parts;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower_service::Service;

use super::admission::Won;
use super::answer::{panic_response, transaction_ended_response};
use super::body::ResponseBody;
use super::claim::Claimed;
use super::config::Config;
use super::flight::Outcome;
use super::record::{NotStoredReason, Record, StoredResponse};
use super::safe::SafeToRetry;
use super::seal::seal;
use crate::backend::BackendErrorKind;
use crate::key::LockKey;
use crate::stats::IdempotencyOutcome;

/// First pause between two attempts to write a record; it doubles up to
/// [`RECORD_BACKOFF_MAX`].
const RECORD_BACKOFF_START: Duration = Duration::from_millis(20);
/// Longest pause between two attempts to write a record.
const RECORD_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// What the connection waits for from the run.
pub(super) type Reply<ResB, E> = Result<Response<ResponseBody<ResB>>, E>;

/// What the run got from the inner service.
enum Executed<B: Body> {
    /// The key is to be freed (marked safe to retry, or not stored by the
    /// status policy): the response goes out as it is (or as it was read,
    /// for a gRPC answer whose trailers gave the status).
    Free(Response<ResponseBody<B>>),
    /// The whole body, within the record limit, and its trailers if it
    /// ended with some (a gRPC answer).
    Full(Parts, Bytes, Option<HeaderMap>),
    /// Reading stopped at a frame (over the limit, trailers) or an error,
    /// after `prefix`.
    Partial(Parts, Bytes, Result<Frame<B::Data>, B::Error>, Pin<Box<B>>),
    /// Not read: its length is unknown (a stream) or over the limit.
    Unread(Parts, B, NotStoredReason),
}

/// What the handler ended with: its response, its error, or a panic
/// (caught where the handler's future was polled).
type Joined<ResB, E> = Result<Result<Executed<ResB>, E>, Panicked>;

/// The handler or its body panicked (the payload is not looked at: the
/// panic hook has reported it).
struct Panicked;

/// Call the inner service and read the response body up to the record
/// limit; decide whether the key is freed. A gRPC request's gRPC answer
/// (`grpc`) is read with its trailers, and decided by its gRPC status.
async fn call_and_collect<S, B, ResB>(
    config: Arc<Config>,
    mut inner: S,
    req: Request<B>,
    grpc: bool,
) -> Result<Executed<ResB>, S::Error>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    ResB: Body,
    ResB::Data: From<Bytes>,
{
    let res = inner.call(req).await?;
    let status = res.status();
    if res.extensions().get::<SafeToRetry>().is_some() || !(config.store_when)(status) {
        return Ok(Executed::Free(res.map(ResponseBody::passthrough)));
    }
    if grpc && crate::wire::grpc::is_grpc(res.headers()) {
        return Ok(collect_grpc(&config, res).await);
    }
    let (parts, body) = res.into_parts();
    let reason = match body.size_hint().exact() {
        None => Some(NotStoredReason::Streaming),
        Some(n) if n > config.record_limit as u64 => Some(NotStoredReason::TooLarge),
        Some(_) => None,
    };
    if let Some(reason) = reason {
        return Ok(Executed::Unread(parts, body, reason));
    }
    let mut body = Box::pin(body);
    let mut buf = BytesMut::new();
    let stopped = collect(&mut body, &mut buf, config.record_limit).await;
    Ok(match stopped {
        None => Executed::Full(parts, buf.freeze(), None),
        Some(stopped) => Executed::Partial(parts, buf.freeze(), stopped, body),
    })
}

/// Read a gRPC answer (HTTP 200) whole, trailers included, up to the
/// record limit, whatever its size hint (a gRPC body never knows its
/// length). Its gRPC status, in its trailers or (trailers-only) in its
/// headers, decides whether the key is freed: `store_when` is asked about
/// the status's HTTP equivalent (`UNAVAILABLE` is 503, `ABORTED` 409, ...),
/// so a handler's `UNAVAILABLE` is treated as a 503 is.
async fn collect_grpc<B>(config: &Config, res: Response<B>) -> Executed<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    let (parts, body) = res.into_parts();
    let mut body = Box::pin(body);
    let mut buf = BytesMut::new();
    let trailers = match collect(&mut body, &mut buf, config.record_limit).await {
        None => None,
        Some(Ok(frame)) if frame.is_trailers() => frame.into_trailers().ok(),
        Some(stopped) => return Executed::Partial(parts, buf.freeze(), stopped, body),
    };
    let code = trailers
        .as_ref()
        .and_then(crate::wire::grpc::status_of)
        .or_else(|| crate::wire::grpc::status_of(&parts.headers));
    let body = buf.freeze();
    match code {
        Some(code) if !(config.store_when)(crate::wire::grpc::http_equivalent(code)) => {
            let body = ResponseBody::full_with_trailers(body, trailers);
            Executed::Free(Response::from_parts(parts, body))
        }
        _ => Executed::Full(parts, body, trailers),
    }
}

/// Read `body` into `buf` up to `limit` bytes; `Some` with what stopped the
/// reading (a frame over the limit, trailers, an error) before its end.
async fn collect<B>(
    body: &mut Pin<Box<B>>,
    buf: &mut BytesMut,
    limit: usize,
) -> Option<Result<Frame<B::Data>, B::Error>>
where
    B: Body,
    B::Data: From<Bytes>,
{
    loop {
        if body.is_end_stream() {
            return None;
        }
        match body.frame().await {
            None => return None,
            Some(Err(e)) => return Some(Err(e)),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) => {
                    let bytes = data.copy_to_bytes(data.remaining());
                    if buf.len() + bytes.len() > limit {
                        return Some(Ok(Frame::data(B::Data::from(bytes))));
                    }
                    buf.extend_from_slice(&bytes);
                }
                // Trailers: not something a replay can reproduce.
                Err(frame) => return Some(Ok(frame)),
            },
        }
    }
}

/// The run of a request (a gRPC request if `grpc`) whose claim was `won`:
/// run it to its end while renewing the claim, record the outcome (or free
/// the key), tell the duplicates that joined, then hand the answer to the
/// connection if it still waits. The service polls it in the connection's
/// task and moves it to a task of its own if the connection's future is
/// dropped first (`service.rs`), so it always runs to its end.
pub(super) async fn execute<S, B, ResB>(
    config: Arc<Config>,
    inner: S,
    req: Request<B>,
    won: Won,
    grpc: bool,
    tx: oneshot::Sender<Reply<ResB, S::Error>>,
) where
    S: Service<Request<B>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: Send + 'static,
    ResB: Body + Send + 'static,
    ResB::Data: From<Bytes> + Send,
    ResB::Error: Send,
{
    // A graceful shutdown's drain waits for this request's record.
    let _hold = config.store.as_ref().hold();
    let began = Instant::now();
    let mut claim = Claimed::new(&config, won);
    // A panic in the handler or its body is caught where it is polled and
    // recorded like any other outcome (in its own task it cost a spawn and
    // a wake-up per request). Nothing of it is looked at after a panic.
    let work = AssertUnwindSafe(call_and_collect(config.clone(), inner, req, grpc))
        .catch_unwind()
        .map(|ended| ended.map_err(|_payload| Panicked));
    let work = std::pin::pin!(work);
    // A store whose record commits the handler's own writes: what is not
    // recorded is undone.
    let transactional = config.store.as_ref().is_transactional();
    let (mut record, answer) = match renewing(&config, &mut claim, work).await {
        Ok(Ok(Executed::Free(res))) => {
            tracing::debug!(key = %claim.digest, status = res.status().as_u16(), outcome = "freed", "not recorded: the key is free for a retry");
            return free(&config, claim, Ok(res), grpc, tx).await;
        }
        // Its writes roll back with the transaction: nothing happened, so
        // the key is freed rather than a 500 recorded (unless the handler
        // ended the transaction itself: the store tells).
        Ok(Err(e)) if transactional => {
            tracing::debug!(key = %claim.digest, outcome = "freed", "the service failed; its transaction is rolled back and the key freed");
            return free(&config, claim, Err(e), grpc, tx).await;
        }
        Err(Panicked) if transactional => {
            tracing::error!(key = %claim.digest, outcome = "panicked", "the handler panicked; its transaction is rolled back and the key freed");
            let res = panic_response(grpc).map(ResponseBody::full);
            return free(&config, claim, Ok(res), grpc, tx).await;
        }
        joined => outcome(&config, &claim.digest, joined, grpc),
    };
    let written = match write_record(&config, &mut claim, &mut record).await {
        Written::Yes => true,
        Written::No => false,
        Written::Unknown => {
            config.stats.record(IdempotencyOutcome::OutcomeUnknown);
            claim.finish(Outcome::Unknown);
            let _ = tx.send(Ok(outcome_unknown(&config, grpc)));
            return;
        }
        Written::Ended => {
            // The handler ended its transaction itself: the store
            // still holds the key; this answer is its final record.
            tracing::error!(key = %claim.digest, outcome = "transaction_ended", store = config.store.as_ref().name(), "the handler ended the request's transaction itself (COMMIT or ROLLBACK); answering 500 transaction-ended, kept as the key's final answer");
            let res = transaction_ended_response(grpc);
            let mut ended = stored(&config, res.status(), res.headers(), res.body(), None);
            let kept = matches!(
                write_record(&config, &mut claim, &mut ended).await,
                Written::Yes
            );
            config.stats.record(IdempotencyOutcome::of_record(kept));
            claim.finish(if kept {
                Outcome::Recorded(ended)
            } else {
                Outcome::Unknown
            });
            let _ = tx.send(Ok(res.map(ResponseBody::full)));
            return;
        }
    };
    config.stats.record(IdempotencyOutcome::of_record(written));
    config.holds.record(began.elapsed());
    let (outcome, answer) = match (written, transactional) {
        (true, _) => (Outcome::Recorded(record), answer),
        (false, false) => (Outcome::Unknown, answer),
        // Not committed: the handler's writes are undone (the store
        // tells a commit it could not confirm apart: `Unknown`
        // above). Never its success: 503, and the key is free.
        (false, true) => {
            tracing::error!(key = %claim.digest, outcome = "commit_failed", store = config.store.as_ref().name(), "the request's transaction did not commit (or its commit was not confirmed); answering 503 instead of the handler's answer");
            let res = config.settings.reject(&crate::Rejection::Unavailable {
                retry_after: Duration::from_secs(1),
            });
            let res = crate::rejection::for_request(res, grpc);
            (Outcome::Freed, Ok(res.map(ResponseBody::full)))
        }
    };
    claim.finish(outcome);
    let _ = tx.send(answer);
}

/// Run the handler, renewing the claim when a renewal is due. The handler
/// goes on while a renewal is on its way (a renewal can take up to the
/// store's deadline, and a handler held back that long could outlive its
/// claim); a renewal under way when the handler ends is waited for, so
/// that the record goes out behind it.
async fn renewing<T>(
    config: &Config,
    claim: &mut Claimed,
    mut work: Pin<&mut impl Future<Output = T>>,
) -> T {
    let mut joined = None;
    loop {
        // The work, or the next renewal, whichever comes first (by hand:
        // tokio's `select!` needs its `macros` feature).
        let mut renewal = std::pin::pin!(sleep_until(claim.schedule.next()));
        let step = std::future::poll_fn(|cx| {
            if let Poll::Ready(joined) = work.as_mut().poll(cx) {
                return Poll::Ready(Some(joined));
            }
            renewal.as_mut().poll(cx).map(|()| None)
        })
        .await;
        if let Some(joined) = step {
            return joined;
        }
        let mut renew = std::pin::pin!(claim.renew(config));
        std::future::poll_fn(|cx| {
            if joined.is_none() {
                if let Poll::Ready(done) = work.as_mut().poll(cx) {
                    joined = Some(done);
                }
            }
            renew.as_mut().poll(cx).map(|_| ())
        })
        .await;
        if let Some(joined) = joined.take() {
            return joined;
        }
    }
}

/// The record to write and the answer to give, for what the handler's
/// task ended with (a freed key is handled by [`execute`] first). A panic
/// of a gRPC request (`grpc`) is recorded as a gRPC status.
fn outcome<ResB, E>(
    config: &Config,
    digest: &LockKey,
    joined: Joined<ResB, E>,
    grpc: bool,
) -> (Record, Reply<ResB, E>)
where
    ResB: Body,
{
    match joined {
        Ok(Ok(Executed::Free(_))) => unreachable!("a freed key is answered before"),
        Ok(Ok(Executed::Full(parts, body, trailers))) => {
            let record = stored(
                config,
                parts.status,
                &parts.headers,
                &body,
                trailers.as_ref(),
            );
            let res = Response::from_parts(parts, ResponseBody::full_with_trailers(body, trailers));
            (record, Ok(res))
        }
        Ok(Ok(Executed::Partial(parts, prefix, stopped, body))) => {
            let reason = match &stopped {
                Err(_) => NotStoredReason::BodyFailed,
                Ok(frame) if frame.is_data() => NotStoredReason::TooLarge,
                Ok(_) => NotStoredReason::Streaming,
            };
            let record = not_stored(parts.status, reason);
            let res = Response::from_parts(parts, ResponseBody::resumed(prefix, stopped, body));
            (record, Ok(res))
        }
        Ok(Ok(Executed::Unread(parts, body, reason))) => {
            let record = not_stored(parts.status, reason);
            let res = Response::from_parts(parts, ResponseBody::passthrough(body));
            (record, Ok(res))
        }
        Ok(Err(e)) => {
            let failed = NotStoredReason::ServiceFailed;
            (
                not_stored(StatusCode::INTERNAL_SERVER_ERROR, failed),
                Err(e),
            )
        }
        Err(Panicked) => {
            tracing::error!(key = %digest, outcome = "panicked", "the handler panicked after the request began; recorded as a 500");
            let res = panic_response(grpc);
            let record = stored(config, res.status(), res.headers(), res.body(), None);
            (record, Ok(res.map(ResponseBody::full)))
        }
    }
}

/// The record of a response kept whole (with the trailers it ended with).
fn stored(
    config: &Config,
    status: StatusCode,
    headers: &HeaderMap,
    body: &Bytes,
    trailers: Option<&HeaderMap>,
) -> Record {
    let grpc = crate::wire::grpc::is_grpc(headers);
    Record::Response(StoredResponse {
        status,
        headers: config.stored(headers, grpc),
        body: body.clone(),
        trailers: trailers.map(|t| Box::new(config.stored(t, grpc))),
    })
    .kept()
}

/// The record of a response that could not be kept.
fn not_stored(status: StatusCode, reason: NotStoredReason) -> Record {
    Record::NotStored { status, reason }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What became of a record.
enum Written {
    /// Stored in place of our claim.
    Yes,
    /// Not stored (the claim is not ours any more, or the store failed
    /// until the claim would expire).
    No,
    /// Not stored: the request's transaction is not the one its claim
    /// opened (a transactional store); the store still holds the key and
    /// waits for a final record.
    Ended,
    /// Whether it committed is not known (a transactional store's commit
    /// not confirmed within its bound); the store keeps the key claimed.
    Unknown,
}

/// Store `record` in place of our claim, retrying with back-off until the
/// claim would expire (renewing it meanwhile), and at least one TTL from
/// the first try for a store that keeps the record of a lapsed claim (not
/// a transactional one): a handler that ends while the store cannot be
/// reached, its claim lapsed, still gets its record once the store is back,
/// unless a retry took the key meanwhile. On failure the claim is left to
/// expire, never freed early: until then a retry is refused, not run.
///
/// A response the store refused until then (every try answered with an
/// error of the store's own, not a timeout nor `unavailable`: a store that
/// refuses an item over its size) gets one last try as its
/// not-stored marker, a few bytes, instead of none: kept, a retry is
/// answered 410, never run again. `record` is then that marker, so that a
/// duplicate joined here is handed what the store keeps. A store that
/// could not be reached gets no such try: once it is back, the whole
/// record goes.
async fn write_record(config: &Config, claim: &mut Claimed, record: &mut Record) -> Written {
    let mut sealed = seal(
        &config.seal_key,
        &claim.key.entry,
        &claim.fingerprint,
        record,
    );
    let lapsed_too = !config.store.as_ref().is_transactional();
    let first_try = Instant::now();
    let mut backoff = RECORD_BACKOFF_START;
    let mut attempts = 0u32;
    // Every failure so far was the store refusing this record (an answer of
    // its own, not a timeout nor an outage: no try may have landed).
    let mut refused = true;
    loop {
        attempts += 1;
        let call = config.store.as_ref().complete(
            &claim.key,
            &claim.token,
            &claim.fingerprint,
            &sealed,
            config.retention,
        );
        // A transactional store bounds its completion itself (a `COMMIT`
        // may take longer than a claim): never cut at the deadline.
        let answer = match config.store.as_ref().is_transactional() {
            true => Ok(call.await),
            false => tokio::time::timeout(config.settings.deadline, call).await,
        };
        match answer {
            Ok(Ok(true)) => {
                tracing::debug!(key = %claim.digest, outcome = "recorded", attempts);
                return Written::Yes;
            }
            Ok(Ok(false)) if config.store.as_ref().is_transactional() => {
                tracing::warn!(key = %claim.digest, outcome = "claim_lost", attempts, "the request's transaction is gone (aborted, refused at commit, or its connection lost): nothing of it was kept");
                return Written::No;
            }
            Ok(Ok(false)) => {
                tracing::error!(key = %claim.digest, outcome = "claim_lost", "the claim expired before the response was recorded and another request's claim or record holds the key now (choose a longer ttl)");
                return Written::No;
            }
            Ok(Err(e)) if e.is_transaction_ended() => return Written::Ended,
            Ok(Err(e)) if e.is_outcome_unknown() => {
                tracing::error!(key = %claim.digest, outcome = "outcome_unknown", attempts, error = %e, "the request's commit was not confirmed; answering 503 outcome-unknown, the key stays claimed until its outcome is known");
                return Written::Unknown;
            }
            Ok(Err(e)) => {
                refused &= e.kind == BackendErrorKind::Other;
                tracing::warn!(key = %claim.digest, outcome = "record_failed", attempts, error = %e, "recording the response failed; retrying");
            }
            Err(_) => {
                refused = false;
                tracing::warn!(key = %claim.digest, outcome = "record_failed", attempts, "recording the response timed out; retrying");
            }
        }
        // A renewal that finds no claim may mean an attempt that timed out
        // landed after all (the entry is done): the next attempt tells,
        // since a completion finding our own record succeeds.
        claim.renew_if_due(config).await;
        let give_up = match lapsed_too {
            true => claim.expires().max(first_try + config.settings.ttl),
            false => claim.expires(),
        };
        if Instant::now() + backoff + config.settings.deadline >= give_up {
            // Refused every time (not an outage, whose end would let the
            // whole record through, nor a try that may have landed): the
            // marker, a few bytes, once.
            let last_chance = refused && Instant::now() + config.settings.deadline < give_up;
            if let (Record::Response(response), true) = (&*record, last_chance) {
                *record = Record::NotStored {
                    status: response.status,
                    reason: NotStoredReason::TooLarge,
                };
                sealed = seal(
                    &config.seal_key,
                    &claim.key.entry,
                    &claim.fingerprint,
                    record,
                );
                tracing::warn!(key = %claim.digest, outcome = "record_failed", attempts, "the response could not be recorded; one last try with its not-stored marker (a retry is then answered 410, never run again)");
                continue;
            }
            tracing::error!(key = %claim.digest, outcome = "record_failed", attempts, store = config.store.as_ref().name(), "the response could not be recorded before the claim expires; the claim is left to expire (never freed early): retries get 409 until then, and run again after it");
            return Written::No;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RECORD_BACKOFF_MAX);
    }
}

/// Free our claim (the handler's answer is not kept) and answer `answer`:
/// unless a transactional store finds that the handler ended the request's
/// transaction and something of it committed (the key is final: answered
/// `transaction-ended`), or cannot tell whether it committed (503
/// `outcome-unknown`). Waits up to the deadline for any other store; the
/// abandon is delivered beyond it all the same. A transactional store
/// bounds its abandon itself.
async fn free<ResB: Body, E>(
    config: &Config,
    mut claim: Claimed,
    answer: Reply<ResB, E>,
    grpc: bool,
    tx: oneshot::Sender<Reply<ResB, E>>,
) {
    let store = config.store.as_ref();
    let call = store.abandon(&claim.key, &claim.token, config.settings.ttl);
    let freed = match store.is_transactional() {
        true => Some(call.await),
        false => tokio::time::timeout(config.settings.deadline, call)
            .await
            .ok(),
    };
    let (outcome, answer) = match freed {
        Some(Err(e)) if e.is_transaction_ended() => {
            tracing::error!(key = %claim.digest, outcome = "transaction_ended", store = store.name(), "the handler ended the request's transaction itself and something of it committed; the key is final, answered 500 transaction-ended");
            config.stats.record(IdempotencyOutcome::TransactionEnded);
            let res = transaction_ended_response(grpc);
            let ended = stored(config, res.status(), res.headers(), res.body(), None);
            (Outcome::Recorded(ended), Ok(res.map(ResponseBody::full)))
        }
        Some(Err(e)) if e.is_outcome_unknown() => {
            tracing::error!(key = %claim.digest, outcome = "outcome_unknown", error = %e, "whether the request's transaction committed is not known; answering 503 outcome-unknown, the key stays claimed");
            config.stats.record(IdempotencyOutcome::OutcomeUnknown);
            (Outcome::Unknown, Ok(outcome_unknown(config, grpc)))
        }
        Some(Err(e)) => {
            tracing::warn!(key = %claim.digest, outcome = "abandon_failed", error = %e, "claim not freed; it expires after its TTL");
            (Outcome::Freed, answer)
        }
        Some(Ok(freed)) => {
            tracing::debug!(key = %claim.digest, outcome = "abandoned", freed);
            (Outcome::Freed, answer)
        }
        None => {
            tracing::debug!(key = %claim.digest, outcome = "abandoning", "freeing the claim goes on after the deadline");
            (Outcome::Freed, answer)
        }
    };
    claim.finish(outcome);
    let _ = tx.send(answer);
}

/// The 503 of a request whose commit was not confirmed: retry with the
/// same key.
fn outcome_unknown<B: Body>(config: &Config, grpc: bool) -> Response<ResponseBody<B>> {
    let res = config.settings.reject(&crate::Rejection::OutcomeUnknown {
        retry_after: Duration::from_secs(1),
    });
    crate::rejection::for_request(res, grpc).map(ResponseBody::full)
}

#[cfg(test)]
mod tests;
