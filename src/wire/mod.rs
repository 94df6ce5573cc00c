//! What both layers need to know of the protocols they sit in, written
//! once: nothing here knows a layer or a store.
//!
//! | file | holds |
//! |---|---|
//! | `body.rs` | receiving the request body whole before a lease or claim: within a size limit and a deadline, digested as it arrives (a gRPC request's over its messages) |
//! | `grpc.rs` | gRPC on the wire: which requests are gRPC, the status of an answer and its HTTP equivalent, a trailers-only status answer with its retry delay |
//! | `problem.rs` | RFC 9457 problem+json answers, each `type` a link to its section of the [`Rejection`](crate::Rejection) docs |

use std::time::Duration;

pub(crate) mod body;
pub(crate) mod grpc;
pub(crate) mod problem;

/// A delay as `Retry-After` carries it (the HTTP header, and gRPC's
/// `retry-after` metadata): whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_secs(d: Duration) -> u64 {
    let secs = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
    secs.max(1)
}

#[cfg(test)]
mod tests;
