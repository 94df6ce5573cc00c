//! RFC 9457 problem details: the `application/problem+json` answer of a
//! rejection (and of the idempotency layer's own failures), its `type` a
//! link to the kind's section of the [`Rejection`](crate::Rejection) docs,
//! with `Retry-After` where a retry can succeed.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use super::retry_after_secs;

/// Media type of the problem documents.
pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem+json response (`type` links to the docs of `kind`,
/// see [`problem_type`]), with `Retry-After` when given;
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
        "type": problem_type(kind),
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

/// Where the problem types are documented: the `Rejection` page of this
/// version's docs on docs.rs (major.minor, so a patch release keeps them).
const PROBLEM_DOCS: &str = concat!(
    "https://docs.rs/tower-redis-lock/",
    env!("CARGO_PKG_VERSION_MAJOR"),
    ".",
    env!("CARGO_PKG_VERSION_MINOR"),
    "/tower_redis_lock/enum.Rejection.html#"
);

/// The problem `type` of `kind`: a link to its heading in the
/// [`Rejection`](crate::Rejection) docs ("Problem types").
pub(crate) fn problem_type(kind: &str) -> String {
    format!("{PROBLEM_DOCS}{kind}")
}
