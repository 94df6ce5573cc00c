//! Every kind of [`Rejection`]: its HTTP status, problem `type`, title and
//! detail, its `Retry-After`, its gRPC code, and its two answers
//! (problem+json, a trailers-only gRPC status), documented kind by kind.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderValue;
use http::{Response, StatusCode};

use crate::key::{LockKey, MissingPart};
use crate::wire::grpc::{code, code_for_http, status_response, GRPC_ACCEPT_ENCODING};
use crate::wire::problem::problem_response;

/// Why a request was not passed to the handler, for both layers
/// ([`RedisLockLayer`](crate::RedisLockLayer) and
/// [`IdempotencyLayer`](crate::IdempotencyLayer)), and the rejection of the
/// crate's axum extractors.
///
/// Each variant is answered as RFC 9457 problem+json whose `type` links to
/// its section below (`https://docs.rs/tower-redis-lock/<major.minor>/tower_redis_lock/enum.Rejection.html#<kind>`,
/// see [`kind`](Self::kind)), and `Retry-After` where a retry can succeed.
/// Replace the answers with `on_rejection` on either layer.
///
/// A **gRPC request** (`content-type: application/grpc*`) gets a gRPC
/// status instead ([`to_grpc_response`](Self::to_grpc_response)): a
/// trailers-only answer with the code given below for each kind, the title
/// and detail as `grpc-message`, and where HTTP sends `Retry-After` the
/// delay as `retry-after` metadata (seconds), `grpc-retry-pushback-ms` and a
/// `google.rpc.RetryInfo` in `grpc-status-details-bin`. The codes follow
/// gRPC's status code guide: a client (and gRPC's retry policies) should
/// read each as meant there. An `on_rejection` hook's answer is sent to a
/// gRPC request only if it is a gRPC answer itself (it has `grpc-status`);
/// an HTTP answer would reach a gRPC client as `UNKNOWN`.
///
/// # Problem types
///
/// What each `type` means and what a client should do. The anchor is the
/// [`kind`](Self::kind); both layers use the same types.
///
/// ### conflict
///
/// **409**, with `Retry-After` (lock layer). An identical request (same key:
/// route, identity, and whatever else the route keys on) is being processed
/// right now. Do not send it again at once: wait `Retry-After` seconds, then
/// retry if you still need to (the first one may already have done the
/// work; check its result first).
///
/// gRPC: **`ABORTED`** with the retry delay: a concurrency conflict, to
/// retry at a higher level (after checking whether the first one did the
/// work), not at once.
///
/// ### unavailable
///
/// **503**, with `Retry-After`. The server could not check for duplicates
/// (its lock store failed or was slow) and refused rather than risk running
/// the request twice. Nothing ran. Retry after `Retry-After` seconds.
///
/// gRPC: **`UNAVAILABLE`** with the retry delay: transient, and nothing ran,
/// so a retry with back-off is safe (gRPC's retry policies retry it).
///
/// ### payload-too-large
///
/// **413**. The request body is over the route's limit; nothing ran. Send a
/// smaller body. (Server side: raise the layer's `body_limit`, or let a lock
/// layer stream the body with `stream_body`; or a limit set in front of the
/// layer, such as tower-http's `RequestBodyLimitLayer`, cut the body off.)
///
/// gRPC: **`RESOURCE_EXHAUSTED`**, no delay: what gRPC itself answers for a
/// message over the configured limit.
///
/// ### body-timeout
///
/// **408**. The request body did not arrive in time; nothing ran and no
/// lease was held. Send the whole body without pausing, then retry. (Server
/// side: the layer's `body_timeout`.)
///
/// gRPC: **`DEADLINE_EXCEEDED`**: the request did not complete in time
/// (here: nothing ran).
///
/// ### invalid-body
///
/// **400**. The request body stream broke off with an error; nothing ran.
/// Send the request again with a complete body.
///
/// gRPC: **`CANCELLED`**: what a gRPC server sees when its client broke
/// off the call.
///
/// ### missing-key-part
///
/// **401** or **400**. The request lacks what the route keys on: an
/// authenticated identity (401: authenticate and retry), a required header
/// (400: add it), or it carries a key's header more than once (400: send
/// it once; for the trusted identity header, a gateway in front of the
/// server appends instead of overwriting, and the server's operators must
/// fix it). The `detail` names the part.
///
/// gRPC: **`UNAUTHENTICATED`** (401: no identity) or **`INVALID_ARGUMENT`**
/// (400: the metadata entry is missing or repeated); a part made with
/// another status gets that status's code (403 `PERMISSION_DENIED`, ...).
///
/// ### idempotency-key-missing
///
/// **400** (idempotency layer). The route requires an `Idempotency-Key`
/// header: send one, a new unique value (such as a UUID) per operation and
/// the same value on every retry of that operation.
///
/// gRPC: **`INVALID_ARGUMENT`**: the client must add `idempotency-key`
/// metadata; retrying unchanged cannot succeed.
///
/// ### idempotency-key-invalid
///
/// **400**. The `Idempotency-Key` header is malformed (sent more than once,
/// too long, not a valid string); the `detail` says how. Fix the header; do
/// not retry unchanged.
///
/// gRPC: **`INVALID_ARGUMENT`**, as a missing key.
///
/// ### idempotency-key-in-flight
///
/// **409**, with `Retry-After`. The first request with this key is still
/// being processed. Retry with the same key after `Retry-After` seconds to
/// receive its response.
///
/// gRPC: **`ABORTED`** with the retry delay, as a held lease: a
/// concurrency conflict; retry with the same key after the delay to get
/// the first call's answer.
///
/// ### idempotency-key-reused
///
/// **422**. This key was already used for a different request (method,
/// path, query, fingerprinted headers or body differ). Use a new key for a
/// new operation; resend the original request unchanged to get its answer.
///
/// gRPC: **`FAILED_PRECONDITION`**: the system (this key's record) is not
/// in the state this request needs, and retrying unchanged cannot change
/// that; a new key is the fix.
///
/// ### idempotency-quota-exceeded
///
/// **429**, with `Retry-After` (idempotency layer). This client (identity on
/// this route) already has as many requests stored or in progress as the
/// route keeps for one client; nothing ran. Retry after `Retry-After`
/// seconds, when its oldest one expires. Other clients are not affected.
/// (Server side: the layer's `scope_quota`.)
///
/// gRPC: **`RESOURCE_EXHAUSTED`** with the retry delay: a per-client quota
/// is used up.
///
/// ### idempotent-response-not-stored
///
/// **410**, no `Retry-After`. The first request with this key completed
/// (its status is in `original_status`), but its response was not kept.
/// Final: it will not run again with this key. Look the result up, or use a
/// new key to repeat the operation.
///
/// gRPC: **`ALREADY_EXISTS`**, no delay: the operation with this key was
/// done already; repeating it with this key cannot run it again.
///
/// ### compressed-message
///
/// **415** (gRPC requests only). The request's message is compressed
/// (`grpc-encoding: gzip`, ...): the layer digests the message to tell a
/// retry from a new request, and a compressed message's bytes depend on the
/// compressor, so it is refused; nothing ran. Send it uncompressed.
///
/// gRPC: **`UNIMPLEMENTED`** with `grpc-accept-encoding: identity`: what
/// gRPC's compression spec and status code guide ask of a server that does
/// not take the client's compression.
///
/// ### malformed-message
///
/// **400** (gRPC requests only). The body is not a whole number of gRPC
/// messages (a 5-byte prefix and the length it gives), or a message is
/// flagged compressed on a request that names no `grpc-encoding`; nothing
/// ran.
///
/// gRPC: **`INTERNAL`**: what gRPC libraries answer for a request they
/// cannot parse (a broken client or proxy, not the caller's argument).
///
/// ### missing-layer
///
/// **500**. A server wiring mistake: a handler uses an extractor whose layer
/// is not in front of it. Nothing a client can fix; report it.
///
/// gRPC: **`INTERNAL`**: an invariant of the server is broken.
///
/// ### outcome-unknown
///
/// **503**, with `Retry-After` (idempotency layer over a SQL store). The
/// request ran and its transaction was sent to commit, but the database
/// did not confirm the commit within the store's commit timeout (the
/// connection was lost and the database stayed unreachable), so whether it
/// took effect is not known yet. The key stays claimed until it is known:
/// retry with the **same** `Idempotency-Key` after `Retry-After`; the retry
/// gets the recorded answer once the commit is known to have landed, or
/// runs once it is known not to have. Never repeat it with a new key.
///
/// gRPC: **`UNAVAILABLE`** with the retry delay: retry the call with the
/// same key.
///
/// ### handler-failed
///
/// **500** (idempotency layer). The request failed on the server after it
/// began (the handler panicked, or the server stopped), so whether it took
/// effect is unknown. Retrying with the same key returns this same answer;
/// look the result up before repeating the operation with a new key.
///
/// gRPC: **`UNKNOWN`**: the call failed after it began and its effect is
/// unknown (gRPC's own code for a handler that failed without a status).
///
/// ### transaction-ended
///
/// **500** (idempotency layer over a SQL store). The server's handler
/// committed or rolled back the request's database transaction itself, so
/// its work and the idempotency record could not commit together. Final:
/// retrying with the same key returns this same answer and never runs the
/// request again; look the result up before repeating the operation with a
/// new key. (Server side: a bug in the handler; it must leave the
/// transaction to the layer.)
///
/// gRPC: **`INTERNAL`**: a server invariant was broken (the handler ended a
/// transaction that was the layer's to end); final, like the HTTP answer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Rejection {
    /// 409 with `Retry-After`: an identical request holds the lease right now.
    Conflict {
        /// The contested key.
        key: LockKey,
        /// How long the holder is expected to need.
        retry_after: Duration,
    },
    /// 503 with `Retry-After`: the backend failed or missed its deadline and
    /// the layer is fail-closed.
    Unavailable {
        /// Suggested wait before retrying.
        retry_after: Duration,
    },
    /// 503 with `Retry-After` (idempotency layer over a transactional
    /// store): the request's commit was not confirmed and whether it took
    /// effect is not known yet; retry with the same `Idempotency-Key`.
    OutcomeUnknown {
        /// Suggested wait before retrying.
        retry_after: Duration,
    },
    /// 413: the body is larger than the layer's body limit.
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// 413: a body limit set in front of the layer (tower-http's
    /// `RequestBodyLimitLayer`, any `http_body_util::Limited`) cut the body
    /// off while the layer read it. Its problem type is `payload-too-large`,
    /// like [`PayloadTooLarge`](Self::PayloadTooLarge), whose limit is the
    /// layer's own.
    BodyLimited,
    /// 408: the body did not arrive within the body timeout.
    BodyTimeout {
        /// The deadline.
        after: Duration,
    },
    /// 400: the body could not be read (the client broke the stream).
    InvalidBody,
    /// A key part could not be derived (status from the part, 401 or 400).
    MissingPart(MissingPart),
    /// 415: a gRPC request's message is compressed; the layer digests
    /// messages and takes them uncompressed only.
    CompressedMessage {
        /// The request's `grpc-encoding`.
        encoding: String,
    },
    /// 400: a gRPC request's body is not a whole number of messages.
    MalformedMessage {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// 400: the route requires an `Idempotency-Key` and none was sent.
    MissingIdempotencyKey,
    /// 400: the `Idempotency-Key` header is malformed.
    InvalidIdempotencyKey {
        /// What is wrong with it.
        reason: String,
    },
    /// 409 with `Retry-After`: the first request with this `Idempotency-Key`
    /// is still being processed.
    InFlight {
        /// How long the first request is expected to need.
        retry_after: Duration,
    },
    /// 422: the `Idempotency-Key` was already used for a different request
    /// (method, path, query, fingerprinted headers or body differ).
    Mismatch,
    /// 429 with `Retry-After`: this scope (identity and route) already holds
    /// its share of the idempotency store (`IdempotencyLayer::scope_quota`);
    /// its oldest entry frees a place at `retry_after`. Other scopes are not
    /// affected.
    OverQuota {
        /// When the scope's oldest entry expires.
        retry_after: Duration,
    },
    /// 410 Gone, without `Retry-After`: the first request with this key
    /// completed, but its response was not kept (too large, streamed, its
    /// body failed, or the service returned an error), so it cannot be replayed. This is final: never
    /// retry with this key (it will not run again); look the result up, or
    /// use a new key to repeat the operation. Not a 409, which the IETF
    /// draft uses for "in flight, retry later".
    NotStored {
        /// Status of the original response.
        status: StatusCode,
        /// Why it was not kept.
        reason: &'static str,
    },
    /// 500: an extractor found nothing from its layer: a wiring mistake on
    /// the server (the layer is not in front of this handler).
    MissingExtension {
        /// The extractor, e.g. `Lease`.
        extractor: &'static str,
        /// The layer it needs, e.g. `RedisLockLayer`.
        layer: &'static str,
    },
}

impl Rejection {
    /// HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Conflict { .. } => StatusCode::CONFLICT,
            Self::Unavailable { .. } | Self::OutcomeUnknown { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::PayloadTooLarge { .. } | Self::BodyLimited => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Self::InvalidBody
            | Self::MissingIdempotencyKey
            | Self::InvalidIdempotencyKey { .. } => StatusCode::BAD_REQUEST,
            Self::MissingPart(m) => m.status(),
            Self::CompressedMessage { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::MalformedMessage { .. } => StatusCode::BAD_REQUEST,
            Self::InFlight { .. } => StatusCode::CONFLICT,
            Self::NotStored { .. } => StatusCode::GONE,
            Self::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::OverQuota { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::MissingExtension { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Short, stable name used in the problem `type` and in logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Conflict { .. } => "conflict",
            Self::Unavailable { .. } => "unavailable",
            Self::OutcomeUnknown { .. } => "outcome-unknown",
            Self::PayloadTooLarge { .. } | Self::BodyLimited => "payload-too-large",
            Self::BodyTimeout { .. } => "body-timeout",
            Self::InvalidBody => "invalid-body",
            Self::MissingPart(_) => "missing-key-part",
            Self::CompressedMessage { .. } => "compressed-message",
            Self::MalformedMessage { .. } => "malformed-message",
            Self::MissingIdempotencyKey => "idempotency-key-missing",
            Self::InvalidIdempotencyKey { .. } => "idempotency-key-invalid",
            Self::InFlight { .. } => "idempotency-key-in-flight",
            Self::Mismatch => "idempotency-key-reused",
            Self::OverQuota { .. } => "idempotency-quota-exceeded",
            Self::NotStored { .. } => "idempotent-response-not-stored",
            Self::MissingExtension { .. } => "missing-layer",
        }
    }

    /// The problem `title`.
    pub fn title(&self) -> &'static str {
        match self {
            Self::Conflict { .. } => "Request already in progress",
            Self::Unavailable { .. } => "Lock service unavailable",
            Self::OutcomeUnknown { .. } => "Outcome not known yet",
            Self::PayloadTooLarge { .. } | Self::BodyLimited => "Request body too large",
            Self::BodyTimeout { .. } => "Request body not received in time",
            Self::InvalidBody => "Request body could not be read",
            Self::MissingPart(_) => "Request cannot be identified",
            Self::CompressedMessage { .. } => "Compressed request message",
            Self::MalformedMessage { .. } => "Malformed request message",
            Self::MissingIdempotencyKey => "Idempotency-Key required",
            Self::InvalidIdempotencyKey { .. } => "Idempotency-Key invalid",
            Self::InFlight { .. } => "Request with this Idempotency-Key in progress",
            Self::Mismatch => "Idempotency-Key reused for a different request",
            Self::OverQuota { .. } => "Too many stored requests",
            Self::NotStored { .. } => "Original response not available",
            Self::MissingExtension { .. } => "Server misconfigured",
        }
    }

    /// The problem `detail`.
    pub fn detail(&self) -> String {
        match self {
            Self::Conflict { .. } => {
                "An identical request is being processed; retry after it completes.".to_owned()
            }
            Self::Unavailable { .. } => {
                "The request could not be checked for duplicates right now; retry shortly."
                    .to_owned()
            }
            Self::OutcomeUnknown { .. } => "The request ran, but the database did not confirm \
                 its commit, so whether it took effect is not known yet. Retry with the same \
                 Idempotency-Key: the retry returns the outcome once it is known. Do not \
                 repeat it with a new key."
                .to_owned(),
            Self::PayloadTooLarge { limit } => format!(
                "The request body exceeds the {limit}-byte limit of this route. Send a smaller \
                 body; the server raises the limit with the layer's `body_limit` setting (a lock \
                 layer can instead stream the body to the handler with `stream_body`)."
            ),
            Self::BodyLimited => "The request body exceeds this server's size limit for the \
                 route. Send a smaller body."
                .to_owned(),
            Self::BodyTimeout { after } => format!(
                "The request body was not received within {} ms. Send the whole body without \
                 pausing; the server sets this deadline with the layer's `body_timeout` setting \
                 (a lock layer can instead stream the body to the handler with `stream_body`).",
                after.as_millis()
            ),
            Self::InvalidBody => "The request body stream ended with an error.".to_owned(),
            Self::MissingPart(m) => m.detail().to_owned(),
            Self::CompressedMessage { encoding } => format!(
                "The request message is compressed with `{encoding}`; this method takes \
                 uncompressed messages only (the server digests the message to recognise a \
                 retry). Send it without compression."
            ),
            Self::MalformedMessage { reason } => {
                format!("The request body is not a sequence of gRPC messages: {reason}.")
            }
            Self::MissingIdempotencyKey => "This endpoint requires an Idempotency-Key header \
                 (a unique value per operation, such as a UUID)."
                .to_owned(),
            Self::InvalidIdempotencyKey { reason } => format!("{reason}."),
            Self::InFlight { .. } => "The first request with this Idempotency-Key is still \
                 being processed; retry after it completes to receive its response."
                .to_owned(),
            Self::Mismatch => "This Idempotency-Key was already used with a different \
                 request payload; use a new key for a new operation."
                .to_owned(),
            Self::OverQuota { .. } => "This client already has as many idempotent requests \
                 stored or in progress as this endpoint keeps for one client; retry after \
                 the time given, when the oldest one expires."
                .to_owned(),
            Self::NotStored { status, reason } => format!(
                "The request with this Idempotency-Key was already processed (status {}), \
                 but its response was not kept because {reason}. It will not run again \
                 with this key; look the result up, or use a new key to repeat it.",
                status.as_u16()
            ),
            Self::MissingExtension { extractor, layer } => format!(
                "the `{extractor}` extractor found nothing from `{layer}`: add the layer to \
                 this route (`Router::route_layer`, `Router::layer` or `MethodRouter::layer`), \
                 or take `Option<{extractor}>`"
            ),
        }
    }

    /// Value for `Retry-After` (whole seconds, rounded up), on the 409 of a
    /// held lease or an in-flight key, on the 429 of a scope over its quota,
    /// and on 503.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Conflict { retry_after, .. }
            | Self::Unavailable { retry_after }
            | Self::OutcomeUnknown { retry_after }
            | Self::InFlight { retry_after }
            | Self::OverQuota { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// The default answer: problem+json with `Retry-After` where it applies.
    pub fn to_response(&self) -> Response<Bytes> {
        problem_response(
            self.status(),
            self.kind(),
            self.title(),
            &self.detail(),
            self.retry_after(),
            |body| {
                if let Self::NotStored { status, .. } = self {
                    body["original_status"] = status.as_u16().into();
                }
            },
        )
    }

    /// The gRPC status code a gRPC request gets for this rejection (the
    /// protocol's number, e.g. `tonic::Code::from_i32(r.grpc_code())`);
    /// each kind's code and why are under "gRPC" in the docs above.
    pub fn grpc_code(&self) -> i32 {
        match self {
            Self::Conflict { .. } | Self::InFlight { .. } => code::ABORTED,
            Self::Unavailable { .. } | Self::OutcomeUnknown { .. } => code::UNAVAILABLE,
            Self::PayloadTooLarge { .. } | Self::BodyLimited | Self::OverQuota { .. } => {
                code::RESOURCE_EXHAUSTED
            }
            Self::BodyTimeout { .. } => code::DEADLINE_EXCEEDED,
            Self::InvalidBody => code::CANCELLED,
            Self::MalformedMessage { .. } | Self::MissingExtension { .. } => code::INTERNAL,
            Self::CompressedMessage { .. } => code::UNIMPLEMENTED,
            Self::MissingPart(m) => code_for_http(m.status()),
            Self::MissingIdempotencyKey | Self::InvalidIdempotencyKey { .. } => {
                code::INVALID_ARGUMENT
            }
            Self::Mismatch => code::FAILED_PRECONDITION,
            Self::NotStored { .. } => code::ALREADY_EXISTS,
        }
    }

    /// The answer a gRPC request gets: a trailers-only response with
    /// [`grpc_code`](Self::grpc_code), the title and detail as
    /// `grpc-message`, and where a retry can succeed the delay as
    /// `retry-after` (whole seconds), `grpc-retry-pushback-ms` and a
    /// `google.rpc.RetryInfo` in `grpc-status-details-bin`. What the layers
    /// send to gRPC requests by default; an `on_rejection` hook can return it
    /// too.
    pub fn to_grpc_response(&self) -> Response<Bytes> {
        let message = format!("{}: {}", self.title(), self.detail());
        let mut res = status_response(self.grpc_code(), &message, self.retry_after());
        if let Self::CompressedMessage { .. } = self {
            // What gRPC's compression spec asks of a server that refuses
            // an encoding: name the ones it takes.
            res.headers_mut()
                .insert(GRPC_ACCEPT_ENCODING, HeaderValue::from_static("identity"));
        }
        res
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.title(), self.status(), self.detail())
    }
}

impl std::error::Error for Rejection {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::MissingPart(m) => Some(m),
            _ => None,
        }
    }
}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for Rejection {
    fn into_response(self) -> axum::response::Response {
        if let Self::MissingExtension { .. } = self {
            tracing::error!("{self}");
        }
        self.to_response().map(axum::body::Body::from)
    }
}

#[cfg(test)]
mod tests;
