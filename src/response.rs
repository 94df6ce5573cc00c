//! Rejections: the answers the layer gives instead of calling the handler,
//! as RFC 9457 `application/problem+json`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::key::{LockKey, MissingPart};

/// Media type of the problem documents.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Why a request was not passed to the handler.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Rejection {
    /// 409: an identical request holds the lease right now.
    Conflict {
        /// The contested key.
        key: LockKey,
        /// How long the holder's lease has left.
        retry_after: Duration,
    },
    /// 503: the backend failed or missed its deadline and the layer is
    /// fail-closed.
    Unavailable {
        /// Suggested wait before retrying.
        retry_after: Duration,
    },
    /// 413: the body is larger than the digest limit.
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// 408: the body did not arrive within the body deadline.
    BodyTimeout {
        /// The deadline.
        after: Duration,
    },
    /// 400: the body could not be read (the client broke the stream).
    InvalidBody,
    /// A key part could not be derived (status from the part, 401 or 400).
    MissingPart(MissingPart),
}

impl Rejection {
    /// HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Conflict { .. } => StatusCode::CONFLICT,
            Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Self::InvalidBody => StatusCode::BAD_REQUEST,
            Self::MissingPart(m) => m.status(),
        }
    }

    /// Short, stable name used in the problem `type` and in logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Conflict { .. } => "conflict",
            Self::Unavailable { .. } => "unavailable",
            Self::PayloadTooLarge { .. } => "payload-too-large",
            Self::BodyTimeout { .. } => "body-timeout",
            Self::InvalidBody => "invalid-body",
            Self::MissingPart(_) => "missing-key-part",
        }
    }

    /// The problem `title`.
    pub fn title(&self) -> &'static str {
        match self {
            Self::Conflict { .. } => "Request already in progress",
            Self::Unavailable { .. } => "Lock service unavailable",
            Self::PayloadTooLarge { .. } => "Request body too large",
            Self::BodyTimeout { .. } => "Request body not received in time",
            Self::InvalidBody => "Request body could not be read",
            Self::MissingPart(_) => "Request cannot be identified",
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
            Self::PayloadTooLarge { limit } => {
                format!("The request body exceeds the {limit}-byte limit of this route.")
            }
            Self::BodyTimeout { after } => format!(
                "The request body was not received within {} ms.",
                after.as_millis()
            ),
            Self::InvalidBody => "The request body stream ended with an error.".to_owned(),
            Self::MissingPart(m) => m.detail().to_owned(),
        }
    }

    /// Value for `Retry-After` (whole seconds, rounded up), on 409 and 503.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Conflict { retry_after, .. } | Self::Unavailable { retry_after } => {
                Some(*retry_after)
            }
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
            |_| {},
        )
    }
}

/// An RFC 9457 problem+json response (`type` is
/// `urn:tower-redis-lock:problem:{kind}`), with `Retry-After` when given;
/// `extend` may add members to the document.
pub(crate) fn problem_response(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: &str,
    retry_after: Option<Duration>,
    extend: impl FnOnce(&mut serde_json::Value),
) -> Response<Bytes> {
    let mut body = serde_json::json!({
        "type": format!("urn:tower-redis-lock:problem:{kind}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    extend(&mut body);
    let mut res = Response::new(Bytes::from(body.to_string()));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    if let Some(after) = retry_after {
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
    }
    res
}

/// Whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_secs(d: Duration) -> u64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.max(1)
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

/// Turns a [`Rejection`] into the response sent to the client. Set with
/// [`RedisLockLayer::on_rejection`](crate::RedisLockLayer::on_rejection).
pub(crate) type Responder = Arc<dyn Fn(&Rejection) -> Response<Bytes> + Send + Sync>;

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for Rejection {
    fn into_response(self) -> axum::response::Response {
        self.to_response().map(axum::body::Body::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflict_is_problem_json_with_retry_after() {
        let key = crate::key::KeyWriter::new(&crate::key::DigestKey::public()).finish();
        let r = Rejection::Conflict {
            key,
            retry_after: Duration::from_millis(1500),
        };
        let res = r.to_response();
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert_eq!(res.headers()[CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(res.headers()[RETRY_AFTER], "2");
        let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
        assert_eq!(v["status"], 409);
        assert_eq!(v["type"], "urn:tower-redis-lock:problem:conflict");
        assert!(v["title"].is_string() && v["detail"].is_string());
        // The key digest is not echoed to the client.
        assert!(!String::from_utf8_lossy(res.body()).contains(&key.to_hex()));
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(3)), 3);
        assert_eq!(retry_after_secs(Duration::from_millis(3001)), 4);
    }

    #[test]
    fn statuses() {
        assert_eq!(Rejection::PayloadTooLarge { limit: 1 }.status(), 413);
        assert_eq!(
            Rejection::BodyTimeout {
                after: Duration::from_secs(1)
            }
            .status(),
            408
        );
        assert_eq!(Rejection::InvalidBody.status(), 400);
        let r = Rejection::Unavailable {
            retry_after: Duration::from_secs(1),
        };
        assert_eq!(r.status(), 503);
        assert_eq!(r.to_response().headers()[RETRY_AFTER], "1");
        assert!(Rejection::PayloadTooLarge { limit: 1 }
            .to_response()
            .headers()
            .get(RETRY_AFTER)
            .is_none());
    }
}
