//! [`SafeToRetry`]: the handler's word that nothing happened.

/// Response extension a handler sets when it knows its request changed
/// nothing (it failed before any side effect: a validation it could not
/// finish, a dependency it never reached). The idempotency layer then frees
/// the key instead of recording the answer, so a retry with the same
/// `Idempotency-Key` runs for real.
///
/// Without it, every outcome after the handler began is recorded and
/// replayed, 5xx and panics included: the layer cannot tell "failed before
/// charging" from "charged, then failed", and only the second one must never
/// run twice.
///
/// ```
/// use axum::http::StatusCode;
/// use axum::response::IntoResponse;
/// use tower_redis_lock::idempotency::SafeToRetry;
///
/// async fn pay() -> axum::response::Response {
///     // The card network was unreachable: nothing was charged.
///     let mut res = (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
///     res.extensions_mut().insert(SafeToRetry);
///     res
/// }
/// # let _ = pay;
/// ```
///
/// With axum, `(SafeToRetry, (StatusCode::SERVICE_UNAVAILABLE, "try again"))`
/// sets it too: the type is an `IntoResponseParts`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SafeToRetry;

#[cfg(feature = "axum")]
impl axum::response::IntoResponseParts for SafeToRetry {
    type Error = std::convert::Infallible;

    fn into_response_parts(
        self,
        mut res: axum::response::ResponseParts,
    ) -> Result<axum::response::ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}
