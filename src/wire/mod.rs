//! What both layers need to know of the protocols they sit in, written
//! once: receiving a request body, and gRPC on the wire.
//!
//! | file | holds |
//! |---|---|
//! | `body.rs` | receiving the request body whole before a lease or claim: within a size limit and a deadline, digested as it arrives |
//! | `grpc.rs` | gRPC on the wire: which requests are gRPC, the messages of a request body, the status of an answer and its HTTP equivalent |

pub(crate) mod body;
pub(crate) mod grpc;
