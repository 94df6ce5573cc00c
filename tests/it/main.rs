//! The integration tests, in one binary: every test binary links the crate
//! and its dependencies again, which on 2 cores costs minutes. One module
//! per area; shared helpers (the `redis-server` harness, loopback HTTP, the
//! `suite!` macro over both backends) in `common`.
//!
//! Two tests own their process and keep a binary of their own:
//! `tests/upload_memory.rs` (asserts the peak RSS of the process) and
//! `tests/global_logger.rs` (installs the process-wide `log` logger and
//! `tracing` subscriber). `tests/no_tls.rs` has one too: CI builds it
//! without TLS, and this whole binary took minutes to build that way.

#[macro_use]
mod common;

mod bank;
mod chaos;
mod cluster;
mod delivery;
mod faults;
mod grpc;
mod harness;
mod hostile;
mod hostile_idempotency;
mod idempotency;
mod idempotency_stats;
mod idempotency_store;
mod layer;
mod native;
mod one_client;
mod redis_security;
mod redlock;
mod round_trips;
mod secret_warning;
mod secret_warning_locker;
mod sentinel;
mod wait;
mod wait_bytes;
