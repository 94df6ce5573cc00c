//! [`Rejection`] (every kind, its status and its answers, in `kinds.rs`),
//! and the answer a layer sends for one: the user's `on_rejection` hook or
//! the default problem+json, made a gRPC status for a gRPC request
//! ([`for_request`]).

use std::sync::Arc;

use bytes::Bytes;
use http::Response;

use crate::wire::grpc::status_of;

mod kinds;

pub use kinds::Rejection;

/// Turns a [`Rejection`] into the response sent to the client (a layer's
/// `on_rejection` hook, made uniform).
pub(crate) type Responder = Arc<dyn Fn(&Rejection) -> Response<Bytes> + Send + Sync>;

/// A responder from an `on_rejection` closure that returns anything
/// `IntoResponse`.
#[cfg(feature = "axum")]
pub(crate) fn responder<F, R>(f: F) -> Responder
where
    F: Fn(&Rejection) -> R + Send + Sync + 'static,
    R: axum::response::IntoResponse,
{
    Arc::new(move |rejection| in_memory(f(rejection).into_response(), rejection))
}

/// A responder from an `on_rejection` closure that returns an
/// `http::Response` (the same closures the `axum` form accepts).
#[cfg(not(feature = "axum"))]
pub(crate) fn responder<F, B>(f: F) -> Responder
where
    F: Fn(&Rejection) -> Response<B> + Send + Sync + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
{
    Arc::new(move |rejection| in_memory(f(rejection), rejection))
}

/// The user's answer with its body read out, which must already be in
/// memory; otherwise the default answer, and an error in the log.
fn in_memory<B>(res: Response<B>, rejection: &Rejection) -> Response<Bytes>
where
    B: http_body::Body<Data = Bytes>,
{
    let (parts, body) = res.into_parts();
    match ready_bytes(body) {
        Some(bytes) => Response::from_parts(parts, bytes),
        None => {
            tracing::error!(
                kind = rejection.kind(),
                "on_rejection returned a body that is not in memory (a stream, or an error); \
                 sending the default problem+json answer instead"
            );
            rejection.to_response()
        }
    }
}

/// Every data frame of `body`, if all of them are ready now.
fn ready_bytes<B: http_body::Body<Data = Bytes>>(body: B) -> Option<Bytes> {
    let mut body = std::pin::pin!(body);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut out = bytes::BytesMut::new();
    loop {
        match body.as_mut().poll_frame(&mut cx) {
            std::task::Poll::Ready(None) => return Some(out.freeze()),
            std::task::Poll::Ready(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    out.extend_from_slice(&data);
                }
            }
            std::task::Poll::Ready(Some(Err(_))) | std::task::Poll::Pending => return None,
        }
    }
}

/// The answer for `rejection`: the user's responder, or problem+json;
/// marked with the rejection, so that the service turns it into a gRPC
/// status for a gRPC request ([`for_request`]).
pub(crate) fn respond(responder: Option<&Responder>, rejection: &Rejection) -> Response<Bytes> {
    let mut res = match responder {
        Some(f) => f(rejection),
        None => rejection.to_response(),
    };
    res.extensions_mut().insert(Rejected(rejection.clone()));
    res
}

/// What [`respond`] puts in the extensions of a rejection's answer, so that
/// the service, which knows whether the request was gRPC, can answer a gRPC
/// client in its protocol ([`for_request`]).
#[derive(Debug, Clone)]
pub(crate) struct Rejected(pub(crate) Rejection);

/// The answer for a request: a rejection's answer (it carries
/// [`Rejected`]) becomes its gRPC answer when the request is gRPC and the
/// answer is not one already (an `on_rejection` hook may return one, and
/// is then obeyed; an HTTP answer is nothing a gRPC client can read).
/// Anything else is returned as it is.
pub(crate) fn for_request(mut res: Response<Bytes>, grpc: bool) -> Response<Bytes> {
    let Some(Rejected(rejection)) = res.extensions_mut().remove::<Rejected>() else {
        return res;
    };
    if grpc && status_of(res.headers()).is_none() {
        return rejection.to_grpc_response();
    }
    res
}

#[cfg(test)]
mod tests;
