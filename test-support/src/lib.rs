//! The test harness of `tower-redis-lock`, shared by its unit tests (in
//! `src/`), its integration tests (`tests/`) and its benches, as a path
//! dev-dependency: never published, and independent of the crate it tests
//! (it starts servers and waits; it knows nothing of leases).
//!
//! - [`RedisServer`]: a `redis-server` owned by one test on a free port,
//!   killed on drop, that the test can kill, restart, pause and resume
//!   without touching anyone else's ([`server`]); [`reached_every`], whether
//!   a key landed on each of several servers.
//! - [`RedisServer::start_valkey`]: the same with a Valkey ≥ 9 server (native
//!   `DELIFEQ`), the `valkey-server` that `TRL_VALKEY_SERVER` names
//!   (`scripts/valkey.sh` finds or builds one; `scripts/test.sh` sets it).
//!   With `TRL_TEST_SERVER=valkey` ([`TEST_SERVER_ENV`]),
//!   [`RedisServer::start`] and the [`scale`] fixtures run that Valkey
//!   instead of `redis-server`, so the suites written for Redis run on
//!   Valkey's native commands too; [`RedisServer::start_redis`] is always
//!   `redis-server`.
//! - [`retry_until`] and [`eventually`]: the one wait helper, for work that
//!   has no other signal ([`wait`]).
//! - [`scale`]: a real Redis Cluster (3 masters + 3 replicas) and a Sentinel
//!   group, started once per process under watchdogs tied to it.
//!
//! Tests that need Redis start their own server and fail loudly, with the
//! install hint, when `redis-server` is missing (or, for Valkey, when
//! `TRL_VALKEY_SERVER` is unset): they never skip.

#![forbid(unsafe_code)]
#![warn(rust_2018_idioms)]

pub mod scale;
pub mod server;
pub mod wait;

pub use server::{
    cli, free_port, hold_port, kill_guarded, reached_every, spawn_guarded, valkey_server,
    RedisServer, INSTALL_HINT, TEST_SERVER_ENV, VALKEY_HINT, VALKEY_SERVER_ENV,
};
pub use wait::{eventually, retry_until};
