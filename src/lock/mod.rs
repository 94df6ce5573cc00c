//! The lock middleware: one lease per request key, 409 for a concurrent
//! duplicate.
//!
//! The whole lease lifecycle sits in this folder:
//!
//! | file | holds |
//! |---|---|
//! | `layer.rs` | [`RedisLockLayer`], its builder (every setter written out) and [`RedisLockLayer::locker`] |
//! | `service.rs` | [`RedisLock`], the `tower::Service` |
//! | `future.rs` | [`ResponseFuture`]: derive the key → receive the body (unless streamed) → acquire → call → release or wrap the body |
//! | `acquire.rs` | the acquire engine, free functions over the config: derive the key, take the lease within the deadline (at once when the store answers in the call), wait in the key's queue, clean up a late acquire |
//! | `body.rs` | [`ResponseBody`]: holds the lease until the end of the stream, and reports that end only after the release finished |
//! | `lease.rs` | [`Lease`] (what the handler sees) and the release guard, which makes the release call (at once when the store answers in the call) |
//! | `renew.rs` | the lease watchdog, on the renewal schedule both layers share ([`Renewal`] is its policy), and what it reports to the handler's [`Lease`] |
//! | `wait.rs` | the wait queue of [`RedisLockLayer::wait`]: per key, first come first served, only its head looks at the store, woken by the backend's watch of the key |
//! | `locker.rs` | [`Locker`] and [`LockGuard`]: leases from handler code |
//! | `extract.rs` | the axum extractors (feature `axum`) |
//! | `config.rs` | what the layer was built with (data and its defaults), and the builder's choices (when a lease is released); the bottom of the folder: the engines import it, it imports only `wait.rs`'s queue type |
//!
//! What the layer counts is [`LockStats`](crate::LockStats), in
//! [`stats`](crate::stats) with the idempotency layer's.

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
#[cfg(test)]
mod testing;
mod wait;

pub use body::ResponseBody;
pub use future::ResponseFuture;
pub use layer::RedisLockLayer;
pub use lease::Lease;
pub use locker::{LockGuard, Locker};
pub use renew::Renewal;
pub use service::RedisLock;
