//! What both layers share: the pieces the lock and the idempotency layer
//! would otherwise each write for themselves. Crate-private; the layers in
//! `lock/` and `replay/` are thin middleware over it.

pub(crate) mod stats;
