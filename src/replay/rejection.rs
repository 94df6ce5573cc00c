//! [`ReplayRejection`]: what the idempotency layer answers instead of
//! calling the handler, as RFC 9457 problem+json.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use super::key::InvalidKey;
use super::record::NotStoredReason;
use crate::response::{retry_after_secs, PROBLEM_JSON};
use crate::Rejection;

/// Why the idempotency layer answered without calling the handler.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ReplayRejection {
    /// 400: the route requires an `Idempotency-Key` and none was sent.
    MissingKey,
    /// 400: the `Idempotency-Key` header is malformed.
    InvalidKey(InvalidKey),
    /// 409 with `Retry-After`: the first request with this key is still
    /// being processed.
    InFlight {
        /// Time left on its claim.
        retry_after: Duration,
    },
    /// 422: the key was already used for a different request (body, path or
    /// fingerprinted headers differ).
    Mismatch,
    /// 409 without `Retry-After`: the first request with this key completed,
    /// but its response was not kept, so it cannot be replayed. Repeating
    /// with the same key will not run it again.
    NotStored {
        /// Status of the original response.
        status: StatusCode,
        /// Why it was not kept.
        reason: NotStoredReason,
    },
    /// A rejection shared with the lock layer: a missing key part (401/400),
    /// body too large (413), body timeout (408), unreadable body (400),
    /// store unavailable (503).
    Lock(Rejection),
}

impl From<Rejection> for ReplayRejection {
    fn from(r: Rejection) -> Self {
        Self::Lock(r)
    }
}

impl ReplayRejection {
    /// HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey(_) => StatusCode::BAD_REQUEST,
            Self::InFlight { .. } | Self::NotStored { .. } => StatusCode::CONFLICT,
            Self::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Lock(r) => r.status(),
        }
    }

    /// Short, stable name used in the problem `type` and in logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::MissingKey => "idempotency-key-missing",
            Self::InvalidKey(_) => "idempotency-key-invalid",
            Self::InFlight { .. } => "idempotency-key-in-flight",
            Self::Mismatch => "idempotency-key-reused",
            Self::NotStored { .. } => "idempotent-response-not-stored",
            Self::Lock(r) => r.kind(),
        }
    }

    /// The problem `title`.
    pub fn title(&self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key required",
            Self::InvalidKey(_) => "Idempotency-Key invalid",
            Self::InFlight { .. } => "Request with this Idempotency-Key in progress",
            Self::Mismatch => "Idempotency-Key reused for a different request",
            Self::NotStored { .. } => "Original response not available",
            Self::Lock(r) => r.title(),
        }
    }

    /// The problem `detail`.
    pub fn detail(&self) -> String {
        match self {
            Self::MissingKey => "This endpoint requires an Idempotency-Key header \
                 (a unique value per operation, such as a UUID)."
                .to_owned(),
            Self::InvalidKey(e) => format!("{e}."),
            Self::InFlight { .. } => "The first request with this Idempotency-Key is still \
                 being processed; retry after it completes to receive its response."
                .to_owned(),
            Self::Mismatch => "This Idempotency-Key was already used with a different \
                 request payload; use a new key for a new operation."
                .to_owned(),
            Self::NotStored { status, reason } => {
                let why = match reason {
                    NotStoredReason::TooLarge => "its body was larger than the record limit",
                    NotStoredReason::Streaming => "its body was streamed",
                };
                format!(
                    "The request with this Idempotency-Key was already processed (status {}), \
                     but its response was not kept because {why}. It will not run again \
                     with this key; look the result up, or use a new key to repeat it.",
                    status.as_u16()
                )
            }
            Self::Lock(r) => r.detail(),
        }
    }

    /// Value for `Retry-After` (on 409 in flight and 503).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InFlight { retry_after } => Some(*retry_after),
            Self::Lock(r) => r.retry_after(),
            _ => None,
        }
    }

    /// The default answer: problem+json with `Retry-After` where it applies.
    pub fn to_response(&self) -> Response<Bytes> {
        let status = self.status();
        let mut body = serde_json::json!({
            "type": format!("urn:tower-redis-lock:problem:{}", self.kind()),
            "title": self.title(),
            "status": status.as_u16(),
            "detail": self.detail(),
        });
        if let Self::NotStored { status, .. } = self {
            body["original_status"] = status.as_u16().into();
        }
        let mut res = Response::new(Bytes::from(body.to_string()));
        *res.status_mut() = status;
        res.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after() {
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        res
    }
}

impl fmt::Display for ReplayRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.title(), self.status(), self.detail())
    }
}

impl std::error::Error for ReplayRejection {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::InvalidKey(e) => Some(e),
            Self::Lock(r) => Some(r),
            _ => None,
        }
    }
}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for ReplayRejection {
    fn into_response(self) -> axum::response::Response {
        self.to_response().map(axum::body::Body::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_retry_after() {
        assert_eq!(ReplayRejection::MissingKey.status(), 400);
        assert_eq!(ReplayRejection::InvalidKey(InvalidKey::Empty).status(), 400);
        assert_eq!(ReplayRejection::Mismatch.status(), 422);
        let busy = ReplayRejection::InFlight {
            retry_after: Duration::from_millis(2500),
        };
        assert_eq!(busy.status(), 409);
        assert_eq!(busy.to_response().headers()[RETRY_AFTER], "3");
        let gone = ReplayRejection::NotStored {
            status: StatusCode::CREATED,
            reason: NotStoredReason::TooLarge,
        };
        let res = gone.to_response();
        assert_eq!(res.status(), 409);
        assert!(res.headers().get(RETRY_AFTER).is_none());
        let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
        assert_eq!(v["original_status"], 201);
        assert_eq!(res.headers()[CONTENT_TYPE], PROBLEM_JSON);
    }
}
