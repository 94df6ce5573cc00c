//! What both layers share: their common settings and the setters that set
//! them, receiving the request body, and (from their own files) counters,
//! the expiring map and renewal. Imports run one way: `key` and `backend`
//! below, `lock` and `replay` above; nothing here imports either layer.

pub(crate) mod body;
pub(crate) mod renew;
#[macro_use]
pub(crate) mod settings;
