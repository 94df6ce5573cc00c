//! Which road a lease's jobs take to the server, native commands or Lua
//! scripts ([`Paths`]), found by asking the server, never by its version
//! (Valkey 9.1 reports `redis_version` 7.2.4 in `INFO`): `COMMAND INFO
//! DELIFEQ`, on every node of a cluster. `DELIFEQ` came with Valkey 9.0,
//! after `SET … IFEQ` (8.1), so a server that has it has both.
//!
//! The probe runs at connect and again on every reconnection of each
//! connection (fred's reconnect notifications: a restart, a failover, a
//! node that joined), beside the `maxmemory-policy` check (`connect.rs`).
//! Until the first probe answers, jobs take the script road; a probe that
//! gets no answer (a timeout, `COMMAND` denied) keeps the road it found
//! before, and is asked again through the same connection a second later,
//! then after twice as long each time it gets none, seven times in about
//! two minutes (`connect.rs`). A native command refused on the way
//! (`unknown command` after a failover to an older server, `NOPERM` from
//! an ACL) sends that job as its script and turns the road back to
//! scripts until the next probe (`dispatch.rs`).
//! Both roads read and write the same key with the same token, so a switch
//! between them, or a fleet that mixes them, keeps mutual exclusion.
//!
//! On the script road a lone acquire still goes as `SET … NX PX … GET`
//! (every supported server has it, `job/native.rs`): not
//! probed, but a server that refuses it (a proxy, an ACL) gets the
//! acquire's script, and every later acquire too until a probe answers
//! ([`Paths::typed_acquire`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

use fred::clients::Client;
use fred::error::Error as FredError;
use fred::interfaces::ClientLike;
use fred::types::{ClusterHash, CustomCommand, Value};

/// No probe has answered yet: scripts.
const UNKNOWN: u8 = 0;
/// The server has the native commands.
const NATIVE: u8 = 1;
/// The server lacks them (or refused one): scripts.
const SCRIPTS: u8 = 2;

/// What one probe came to (the road it left is [`Paths::native`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Probed {
    /// Every node answered (or nothing was asked: the native road is
    /// turned off); `false` asks for another probe soon (`connect.rs`).
    pub(crate) answered: bool,
}

/// The road of one backend's lease jobs (shared by its clones and its
/// connections' listeners).
#[derive(Debug)]
pub(crate) struct Paths {
    /// [`RedisBackend::native_commands`](super::RedisBackend::native_commands).
    enabled: AtomicBool,
    /// What the server was last found to have.
    state: AtomicU8,
    /// Lease jobs the server answered as native commands.
    calls: AtomicU64,
    /// Whether a lone acquire on the script road goes as `SET … NX PX …
    /// GET` (every supported server has it: Redis ≥ 7.0,
    /// Valkey ≥ 7.2); cleared when the server refuses it, set again by
    /// the next probe that answers.
    typed_acquire: AtomicBool,
}

impl Default for Paths {
    fn default() -> Self {
        Self {
            enabled: AtomicBool::new(true),
            state: AtomicU8::new(UNKNOWN),
            calls: AtomicU64::new(0),
            typed_acquire: AtomicBool::new(true),
        }
    }
}

impl Paths {
    /// Whether lease jobs go out as native commands now.
    pub(crate) fn native(&self) -> bool {
        self.enabled.load(Ordering::Relaxed) && self.state.load(Ordering::Relaxed) == NATIVE
    }

    /// Allow (the default) or forbid the native road; whether that changed
    /// it.
    pub(crate) fn enable(&self, on: bool) -> bool {
        let changed = self.enabled.swap(on, Ordering::Relaxed) != on;
        if changed && !on {
            tracing::info!(
                path = "lua",
                "redis lease calls: Lua scripts (native commands turned off)"
            );
        }
        changed
    }

    /// Take the native road without asking the server (a server that turns
    /// out not to have the commands, as after a failover to an older one).
    #[cfg(test)]
    pub(crate) fn assume_native(&self) {
        self.state.store(NATIVE, Ordering::Relaxed);
    }

    /// Native lease calls answered so far, while the native road is taken;
    /// `None` on the script road.
    pub(crate) fn native_calls(&self) -> Option<u64> {
        self.native().then(|| self.calls.load(Ordering::Relaxed))
    }

    /// Whether a lone acquire on the script road goes as `SET … NX PX …
    /// GET` instead of its script (`job/native.rs`): unless the native
    /// road is turned off, or the server refused it.
    pub(crate) fn typed_acquire(&self) -> bool {
        self.enabled.load(Ordering::Relaxed) && self.typed_acquire.load(Ordering::Relaxed)
    }

    /// The server refused a lone acquire's `SET … NX PX … GET` on the
    /// script road (`e`): acquires go as their script until the next probe
    /// that answers.
    pub(crate) fn typed_acquire_refused(&self, e: &FredError) {
        if self.typed_acquire.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                path = "lua",
                error = %e,
                "redis refused SET NX PX GET for a lease acquire; acquires go as Lua scripts until the server is probed again"
            );
        }
    }

    /// Count a job the server answered natively.
    pub(crate) fn answered(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// The server refused a native command (`e`): scripts until the next
    /// probe.
    pub(crate) fn refused(&self, e: &FredError) {
        if self.state.swap(SCRIPTS, Ordering::Relaxed) == NATIVE {
            tracing::warn!(
                path = "lua",
                error = %e,
                "redis refused a native lease command; using Lua scripts until the server is probed again (at the next reconnection)"
            );
        }
    }

    /// Ask the server behind `client` (each node of a cluster) whether it
    /// has the native commands, and take the road it says; one log line
    /// when the road changes. Nothing is asked while the native road is
    /// turned off.
    ///
    /// A node that answers without `DELIFEQ` means scripts. A probe that
    /// gets no answer from some node (a timeout, a connection lost, an
    /// ACL that denies `COMMAND`) and no "without" from any other keeps
    /// the road as it was: a probe on a reconnection during a failover
    /// storm must not turn a native fleet to scripts until the next
    /// reconnection (a native command refused later still turns it, call
    /// by call, see `dispatch.rs`). Before any answer, that is scripts.
    /// Such a probe is asked again soon (`connect.rs`).
    pub(crate) async fn probe(&self, client: &Client) -> Probed {
        if !self.enabled.load(Ordering::Relaxed) {
            return Probed { answered: true };
        }
        let found = if client.is_clustered() {
            let nodes = client.active_connections();
            let mut found = if nodes.is_empty() { None } else { Some(true) };
            for node in nodes {
                match has_delifeq(&client.with_cluster_node(node)).await {
                    Some(true) => {}
                    Some(false) => {
                        found = Some(false);
                        break;
                    }
                    None => found = None,
                }
            }
            found
        } else {
            has_delifeq(client).await
        };
        if found.is_some() {
            // Asked again: a refusal may have been mended (an ACL, a proxy).
            self.typed_acquire.store(true, Ordering::Relaxed);
        }
        let (old, new) = match found {
            Some(true) => (self.state.swap(NATIVE, Ordering::Relaxed), NATIVE),
            Some(false) => (self.state.swap(SCRIPTS, Ordering::Relaxed), SCRIPTS),
            // No answer: the road stays as it is (one atomic step, so a
            // refusal that turns it to scripts meanwhile is not undone);
            // before any answer, scripts.
            None => match self.state.compare_exchange(
                UNKNOWN,
                SCRIPTS,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(old) => (old, SCRIPTS),
                Err(kept) => (kept, kept),
            },
        };
        if old != new {
            match (new, found) {
                (NATIVE, _) => tracing::info!(
                    path = "native",
                    "redis lease calls: native commands (SET NX PX GET, DELIFEQ, SET IFEQ)"
                ),
                (_, Some(false)) => tracing::info!(
                    path = "lua",
                    "redis lease calls: Lua scripts (the server has no DELIFEQ)"
                ),
                _ => tracing::info!(
                    path = "lua",
                    "redis lease calls: Lua scripts (the server did not say whether it has DELIFEQ)"
                ),
            }
        } else if found.is_none() && new == NATIVE {
            tracing::debug!(
                path = "native",
                "redis lease calls: the probe got no answer; native commands as before"
            );
        }
        Probed {
            answered: found.is_some(),
        }
    }
}

/// `COMMAND INFO DELIFEQ` through `client`: `Some(false)` for `[nil]` (a
/// server without it), `None` when there is no answer to read (an error,
/// among them an ACL without `COMMAND`).
async fn has_delifeq<C: ClientLike>(client: &C) -> Option<bool> {
    let cmd = CustomCommand::new_static("COMMAND", ClusterHash::Random, false);
    match client
        .custom::<Value, _>(cmd, vec!["INFO", "DELIFEQ"])
        .await
    {
        Ok(Value::Array(items)) => {
            Some(matches!(items.first(), Some(Value::Array(info)) if !info.is_empty()))
        }
        Ok(_) => Some(false),
        Err(e) => {
            tracing::debug!(error = %e, "cannot ask for DELIFEQ (a timeout, or COMMAND denied by an ACL?)");
            None
        }
    }
}
