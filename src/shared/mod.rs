//! What both layers share: their common settings and the setters that set
//! them, receiving the request body, counters, renewal and the expiring
//! map. Crate-private; imports run one way: `key` and `backend` below,
//! `lock` and `replay` above, and nothing here imports either layer.

pub(crate) mod body;
pub(crate) mod expiring;
pub(crate) mod renew;
#[macro_use]
pub(crate) mod settings;
pub(crate) mod stats;
