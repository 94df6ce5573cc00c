//! What both layers share, written once. Crate-private; imports run one way:
//! `key` and `backend` below, `lock` and `replay` above, and nothing here
//! imports either layer.
//!
//! | file | holds |
//! |---|---|
//! | `settings.rs` | the settings both layers have, and their setters (`common_setters!`) with their docs |
//! | `body.rs` | receiving the whole request body within a limit and a deadline, before a lease or claim |
//! | `renew.rs` | [`Renewal`](crate::lock::Renewal), the policy, and the schedule that renews a lease or a claim |
//! | `retry.rs` | `Retry-After` for a 409: when the holder is expected to finish, from recent holds |
//! | `macros.rs` | boilerplate both layers need: settings `Deref`, service accessors, extension extractors |
//! | `stats.rs` | the counters of both layers, generic over each layer's outcome enum |

#[macro_use]
mod macros;
pub(crate) mod body;
pub(crate) mod renew;
pub(crate) mod retry;
#[macro_use]
pub(crate) mod settings;
pub(crate) mod stats;
