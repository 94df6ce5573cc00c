//! The lock middleware: one lease per request key, 409 for a concurrent
//! duplicate.
//!
//! The whole lease lifecycle sits in this folder:
//!
//! | file | holds |
//! |---|---|
//! | `layer.rs` | [`RedisLockLayer`] and its builder, the policies |
//! | `service.rs` | [`RedisLock`], the `tower::Service` |
//! | `acquire.rs` | the engine: derive the key, take the lease within the deadline, clean up a late acquire |
//! | `future.rs` | [`ResponseFuture`]: prepare (receive the body, digest it) → acquire → call → release or wrap the body |
//! | `lease.rs` | [`Lease`] (what the handler sees) and the release guard |
//! | `renew.rs` | the lease watchdog, on the shared renewal schedule ([`Renewal`] is its policy) |
//! | `stats.rs` | `LockOutcome`: what the layer counts in [`Stats`](crate::Stats) |
//! | `locker.rs` | [`Locker`] and [`LockGuard`]: leases from handler code |
//! | `extract.rs` | the axum extractors (feature `axum`) |

mod acquire;
mod body;
mod config;
#[cfg(feature = "axum")]
mod extract;
mod future;
mod layer;
pub(crate) mod lease;
mod locker;
mod renew;
mod service;

pub use body::ResponseBody;
pub use config::ReleaseMode;
pub use future::ResponseFuture;
pub use layer::RedisLockLayer;
pub use lease::Lease;
pub use locker::{LockGuard, Locker};
pub use renew::Renewal;
pub use service::RedisLock;
