//! [`LockBackend`] for [`RedisBackend`], the hub of a lease's calls: each
//! step is a [`Job`] sent through the dispatch (`dispatch.rs`); an acquire
//! first asks the local in-flight table (`local.rs`), which answers hit or
//! miss, and this file sends the job and reports the answer back; a release
//! is delivered (`deliver.rs`), waking this process's waiters once Redis
//! said released. Replies come read (`job.rs`). No file this one calls
//! calls back into it.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::deliver::After;
use super::job::{Job, Reply};
use super::local::Begin;
use super::RedisBackend;
use crate::backend::contract::Watch;
use crate::backend::{Acquire, BackendError, BackendFuture, LockBackend, Token};

impl LockBackend for RedisBackend {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        take(self, key, token, ttl, false)
    }

    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        take(self, key, token, ttl, true)
    }

    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        give_back(self, key, token, false)
    }

    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        give_back(self, key, token, true)
    }

    /// Releases of keys this process waits for are heard here as soon as
    /// Redis answered; from other instances, through one subscriber
    /// connection (`watch.rs`).
    fn watch(&self, key: &Bytes) -> Option<BackendFuture<Watch>> {
        self.subscriptions.watch(key)
    }

    fn native_calls(&self) -> Option<u64> {
        self.dispatch.paths().native_calls()
    }

    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        self.deliveries.saw_ttl(ttl);
        let call = self.dispatch.send(Job::extend(key, token.to_hex(), ttl));
        let Some(table) = &self.local else {
            return BackendFuture::new(async move { done(call.await) });
        };
        // The local entry may not outlive the lease this extend sets; it
        // may live that long once Redis confirmed it.
        let expires = Instant::now() + crate::settings::at_most_max(ttl);
        table.shorten(key, token, expires);
        let (table, key, token) = (table.clone(), key.clone(), *token);
        BackendFuture::new(async move {
            let extended = done(call.await);
            table.extend_answered(&key, &token, expires, &extended);
            extended
        })
    }
}

/// An acquire (`fenced`: with its fencing token, `ACQUIRE_FENCED_LUA`):
/// answered from the local in-flight table on a hit, else sent as a job,
/// its answer reported back to the table. A key this process waits for is
/// marked when found held, so that its release is published.
fn take(
    backend: &RedisBackend,
    key: &Bytes,
    token: &Token,
    ttl: Duration,
    fenced: bool,
) -> BackendFuture<Acquire> {
    backend.deliveries.saw_ttl(ttl);
    let mark = backend.subscriptions.watchers.is_watched(key);
    let hex = token.to_hex();
    let job = match fenced {
        true => Job::acquire_fenced(
            key,
            hex,
            ttl,
            ttl.saturating_add(backend.fence_window),
            mark,
        ),
        false => Job::acquire(key, hex, ttl, mark),
    };
    let Some(table) = &backend.local else {
        let call = backend.dispatch.send(job);
        return BackendFuture::new(async move { acquired(call.await) });
    };
    match table.begin(key, token, ttl, mark) {
        Begin::Hit(answer) => BackendFuture::ready(Ok(answer)),
        Begin::Lead(lead) => {
            let call = backend.dispatch.send(job);
            BackendFuture::new(async move {
                let answer = acquired(call.await);
                lead.finish(answer.as_ref().ok().copied());
                answer
            })
        }
        Begin::Bypass { expires } => {
            let call = backend.dispatch.send(job);
            let (table, key, token) = (table.clone(), key.clone(), *token);
            BackendFuture::new(async move {
                let answer = acquired(call.await);
                table.reacquired(&key, &token, expires, &answer);
                answer
            })
        }
        Begin::Wait {
            answer: leader,
            marked,
        } => {
            let dispatch = backend.dispatch.clone();
            BackendFuture::new(async move {
                match leader.await {
                    // A waiter's look must leave the mark on a key found
                    // held, or its release publishes nothing: the leader's
                    // acquire went out unmarked (sent before the key was
                    // watched here). Ask ourselves, marked.
                    Ok(Acquire::Held { .. }) if mark && !marked => {
                        acquired(dispatch.send(job).await)
                    }
                    Ok(answer) => Ok(answer),
                    // The leader failed or gave up: ask ourselves.
                    Err(_) => acquired(dispatch.send(job).await),
                }
            })
        }
    }
}

/// A release (`notify`: `RELEASE_NOTIFY_LUA`), delivered until Redis
/// answered, retried: in the caller's future while it waits, on a task of
/// its own once the caller stops waiting (deadline); the release still goes
/// out. Once Redis says released, this process's waiters for the key hear
/// of it.
fn give_back(
    backend: &RedisBackend,
    key: &Bytes,
    token: &Token,
    notify: bool,
) -> BackendFuture<bool> {
    if let Some(table) = &backend.local {
        table.forget(key, token);
    }
    let watchers = &backend.subscriptions.watchers;
    // Its publication, when it comes back to our subscriber, is an echo.
    watchers.releasing(key, token);
    let job = Job::release(key, token.to_hex(), notify);
    let first = backend.dispatch.send(job.clone());
    let after = After::Wake(watchers.clone());
    let delivery = backend
        .deliveries
        .deliver(&backend.dispatch, job, first, after);
    BackendFuture::new(delivery)
}

/// What the dispatch answered to an acquire.
fn acquired(reply: Result<Reply, BackendError>) -> Result<Acquire, BackendError> {
    reply?.into_acquire()
}

/// What the dispatch answered to a compare-and-act.
fn done(reply: Result<Reply, BackendError>) -> Result<bool, BackendError> {
    reply?.into_done()
}

#[cfg(test)]
mod tests;
