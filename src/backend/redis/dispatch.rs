//! [`Dispatch`]: the one road from the Redis store to Redis. Every
//! operation (a lease's acquire, fenced acquire, release and extend, an
//! idempotency claim, completion, extension and abandon) is a [`Job`] that
//! goes out here, on its key's connection (the client's one, or the key's
//! own of a `Pool`: its *lane*), in the order it was asked for: a release
//! never overtakes its acquire, an abandon never overtakes its claim. (An
//! acquire that sends a second command after its first reply, see
//! `job/native.rs`, or its script again as `EVAL` after a `NOSCRIPT`,
//! sends it only while its caller still waits: once the caller gave up,
//! its cleanup release may be queued behind the acquire.)
//!
//! With batching (the default for a non-cluster client): one task per lane
//! has at most one batch in flight. A job that finds its lane idle (nothing
//! queued, nothing on its way on the connection) and its connection up goes
//! out at once, alone, from its caller's own task, with its own script or,
//! for a plain acquire, as `SET … NX PX … GET`, which every
//! supported server has (`job/native.rs`) and which costs the server less
//! (at low load no hop through the lane's task, and no Lua); jobs that
//! arrive while a call is on its way, or while the connection is down,
//! wait in the lane and then go out together, as
//! **one** `EVALSHA batch n k1..kn ops`
//! (`ops` one string: per operation its letter, token, TTL and `;`), one
//! write each way and one script call for the lot. Each operation inside
//! runs the same steps as its own script, in arrival order, and one whose
//! command fails (wrong type, OOM) fails alone (the batch script is
//! `BATCH_LUA` in `scripts.rs`). A lease job of several keys (a fenced or
//! marked acquire, a notifying release) goes through the same queue, alone,
//! so the key's later jobs cannot overtake it. An idempotency step goes out
//! at once on its lane's connection, pipelined by fred with the other
//! requests' steps (its order is kept by the layer, which awaits each step
//! of an entry before the next, and by the abandon's tombstone; see
//! `Job::keeps_lane`): a lane's one batch in flight would otherwise hold
//! every claim and record of the connection one round trip apart.
//!
//! Why not fred's pipelining: fred writes (and flushes) each command as soon
//! as its router task sees it, and under Tokio that task runs right after
//! each command is queued, so every command costs a `writev` here and a
//! read, a write and a Lua call on the Redis side. A fred `Pipeline` does
//! not help: it flushes after every command too (fred 10.1
//! `process_pipeline`).
//!
//! A batch that gets no answer within the batch timeout is abandoned: its
//! callers get an error, the connection is replaced, and the next batch goes
//! out. The queue per lane is bounded; beyond it a job fails at once. The
//! batch timeout is kept without a timer per call: the calls of a connection
//! (batches and native calls) share one watch (`dispatch/flight.rs`).
//!
//! Without batching (a cluster client: a script may only touch keys of one
//! slot; `auto_pipeline(false)`; outside a runtime) each job is sent alone,
//! on its key's connection. Every job goes out through the fred client (its
//! connection, login, TLS and retry settings).
//!
//! On the native road (`probe.rs`: the server has `DELIFEQ`), a lease's job
//! is sent alone too, at once, on its key's connection, as native commands
//! where it has them (`job/native.rs`), else as its script: fred feeds the
//! typed commands queued on a connection into one write (it flushes after
//! a custom command or a script) and sends a lone one at once, so requests
//! share writes under load and none waits at low load. A
//! job still goes through its lane while the lane has jobs queued or in
//! flight (the road just turned native), so that it cannot overtake them,
//! and while its connection is being replaced after a direct call got no
//! answer within the batch timeout, or while 16 native calls are on their
//! way on it (a busy connection, or Redis slow or stalled): those calls
//! then go out batched, one script call per batch, not one command (and
//! one fred future of several KiB) per call; under load a batch costs the
//! server less than the writes of as many native calls (`MAX_DIRECT`).
//! Inside such a batch each release is a `DELIFEQ` too (the batch script's
//! `n` argument), one command in the script instead of a `GET` and a `DEL`.
//! A native command the server refuses (`unknown command`, `NOPERM`) sends
//! the same job as its script, and the road turns back to scripts; a
//! `DELIFEQ` refused inside a batch sends those releases again, in a batch
//! without it, before the lane's next batch (an acquire of the same key
//! later in the refused batch found it still held: a conflict once, at the
//! moment the server changed, never two holders).

use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use fred::clients::{Client, WithOptions};
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::ClientLike;
use fred::types::config::Options;
use fred::types::{Key, Value};
use tokio::sync::{mpsc, oneshot};

mod flight;

use self::flight::Flight;
use super::job::native::{self, Native};
use super::job::{Job, Reply};
use super::probe::Paths;
use super::scripts::{self, map_err, BATCH};
use crate::backend::BackendError;

/// Largest batch sent as one script call.
const MAX_BATCH: usize = 256;
/// Most lease jobs on the native road on their way per connection; beyond
/// them jobs queue in the lane and go out batched. Under load that costs
/// Redis less: fred writes every custom command (`DELIFEQ`) on its own, so
/// each direct release is a write here and a read on the server, where one
/// batch script carries dozens of requests' calls (BENCHMARKS.md has the
/// runs that chose this bound). In an outage, the waiting calls hold a few
/// bytes each, not a fred command's future (several KiB). At up to this
/// many calls at once, every call goes out natively at once.
const MAX_DIRECT: usize = 16;
/// How long a batch in flight may wait for its answer by default
/// ([`RedisBackend::batch_timeout`](super::RedisBackend::batch_timeout)).
pub(crate) const BATCH_TIMEOUT: Duration = Duration::from_secs(1);
/// Jobs waiting for their batch, per lane; beyond it a job fails at once
/// (`Backpressure`: the layer's fail policy answers) instead of queueing
/// without bound behind a wedged connection.
const QUEUE: usize = 10_000;

/// A job waiting in its lane's queue, and where its answer goes.
struct Queued {
    job: Job,
    reply: oneshot::Sender<Result<Reply, BackendError>>,
    /// Counts the job in its lane until it is answered (or dropped).
    _busy: Busy,
}

/// One job queued or in flight in a lane (see [`Dispatch::send`]).
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Queued {
    /// Answer the job's caller with `result`, read as the job reads it.
    fn answer(self, result: Result<Value, FredError>) {
        let _ = self.reply.send(self.job.read(result));
    }
}

/// The connections of one backend and, when it batches, one queue per
/// connection (its task started on the first job, inside a runtime).
#[derive(Debug)]
pub(crate) struct Dispatch {
    /// The client's one connection, or each of a pool's.
    clients: Arc<[Client]>,
    /// One per lane when batching, none otherwise.
    queues: Box<[OnceLock<mpsc::Sender<Queued>>]>,
    /// Per lane, its jobs queued or in flight.
    busy: Box<[Arc<AtomicUsize>]>,
    /// Per connection, set while it is being replaced after a lease job on
    /// the native road got no answer within the batch timeout.
    wedged: Box<[Arc<AtomicBool>]>,
    /// Per connection, its calls on their way (native lease jobs and the
    /// lane's batch), and the watch that bounds them (`dispatch/flight.rs`).
    flights: Box<[Arc<Flight>]>,
    /// Per connection, the client for native commands and the lane's
    /// batches: fred's own per-command timer off, the flight's watch
    /// bounds them.
    untimed: Box<[WithOptions<Client>]>,
    /// The native road or the scripts' (`probe.rs`).
    paths: Arc<Paths>,
    /// The batch timeout (kept while batching is off, so that turning it
    /// on again keeps it).
    timeout: Duration,
    /// The connections' owner when this crate opened them (`connect*`):
    /// they are closed when it drops, after the last dispatch over them
    /// (a backend's clones, a release on its way).
    owner: Option<Arc<Owner>>,
}

/// Closes the connections this crate opened once nothing uses them (the
/// last [`Dispatch`] over them dropped): fred's connection task, and the
/// supervisor that restarts it, would otherwise live as long as the
/// runtime, and a lazy backend would keep dialing a server that is gone.
#[derive(Debug)]
pub(crate) struct Owner {
    clients: Arc<[Client]>,
}

impl Owner {
    /// The owner of `clients`, opened by this crate.
    pub(crate) fn of(clients: &Arc<[Client]>) -> Arc<Self> {
        Arc::new(Self {
            clients: clients.clone(),
        })
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        // Outside a runtime (it is shutting down, or gone): its tasks,
        // the connections' included, end with it.
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for client in self.clients.iter() {
            let client = client.clone();
            drop(handle.spawn(async move {
                let _ = client.quit().await;
            }));
        }
    }
}

impl Dispatch {
    /// A dispatch over `clients` (one, or a pool's), batching when `batch`
    /// and the clients are not a cluster's.
    pub(crate) fn new(
        clients: Arc<[Client]>,
        batch: bool,
        timeout: Duration,
        paths: Arc<Paths>,
    ) -> Self {
        let batch = batch && clients.first().is_some_and(|c| !c.is_clustered());
        let lanes = if batch { clients.len() } else { 0 };
        Self {
            queues: (0..lanes).map(|_| OnceLock::new()).collect(),
            busy: (0..lanes).map(|_| Arc::default()).collect(),
            wedged: clients.iter().map(|_| Arc::default()).collect(),
            flights: clients.iter().map(|_| Arc::default()).collect(),
            untimed: clients.iter().map(untimed).collect(),
            clients,
            timeout,
            paths,
            owner: None,
        }
    }

    /// The same, closing its connections through `owner` (see [`Owner`]).
    pub(crate) fn owned_by(mut self, owner: Option<Arc<Owner>>) -> Self {
        self.owner = owner;
        self
    }

    /// The connections' owner, if this crate opened them.
    pub(crate) fn owner(&self) -> Option<Arc<Owner>> {
        self.owner.clone()
    }

    /// The road of lease jobs.
    pub(crate) fn paths(&self) -> &Arc<Paths> {
        &self.paths
    }

    /// The clients every job goes through.
    pub(crate) fn clients(&self) -> &Arc<[Client]> {
        &self.clients
    }

    /// Whether jobs are batched.
    pub(crate) fn batching(&self) -> bool {
        !self.queues.is_empty()
    }

    /// The batch timeout.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How many lanes have started their task.
    #[cfg(test)]
    pub(crate) fn lanes_started(&self) -> usize {
        self.queues.iter().filter(|q| q.get().is_some()).count()
    }

    /// Send `job` on its key's connection: queued in its lane *now*, not
    /// when the answer is first polled, so that jobs reach Redis in the
    /// order they were asked for.
    pub(crate) fn send(&self, job: Job) -> Sent {
        let lane = lane_of(job.key.as_bytes(), self.clients.len());
        // Sent from the caller's own task (no hop through the lane's task)
        // while nothing of the lane is queued or in flight before it. On
        // the native road up to `MAX_DIRECT` calls at once; on the script
        // road (batching) one at a time, and only while the connection is
        // up: a job asked while a call is on its way queues, and goes out
        // in the lane's next batch, and during an outage new jobs wait in
        // the lane (one batch at a time, each abandoned after the batch
        // timeout), not in fred's queue of a connection being made. (An
        // abandoned batch, or a native call sent before the outage was
        // noticed, stays in fred's queue or retry buffer and goes out once
        // it reconnects; the releases behind it follow it there.)
        let direct = match (self.paths.native(), self.queues.is_empty()) {
            (true, true) => true,
            (true, false) => self.flights[lane].calls() < MAX_DIRECT,
            (false, true) => false,
            (false, false) => self.flights[lane].calls() == 0 && self.clients[lane].is_connected(),
        } && self
            .busy
            .get(lane)
            .is_none_or(|n| n.load(Ordering::SeqCst) == 0)
            && !self.wedged[lane].load(Ordering::SeqCst)
            && tokio::runtime::Handle::try_current().is_ok();
        let queue = match job.keeps_lane() && !direct {
            true => self.queue(lane),
            false => None,
        };
        let job = match queue {
            Some(tx) => {
                let (reply, rx) = oneshot::channel();
                let _busy = Busy::new(&self.busy[lane]);
                match tx.try_send(Queued { job, reply, _busy }) {
                    Ok(()) => return Sent(Call::Queued(rx)),
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        return Sent(Call::Ready(Some(Err(map_err(FredError::new(
                            ErrorKind::Backpressure,
                            "too many calls waiting for a batch",
                        ))))))
                    }
                    Err(mpsc::error::TrySendError::Closed(queued)) => queued.job,
                }
            }
            None => job,
        };
        if direct && job.keeps_lane() {
            let (paths, timeout) = (self.paths.clone(), self.timeout);
            let wedged = self.wedged[lane].clone();
            let client = self.untimed[lane].clone();
            let on_its_way = self.flights[lane].board(timeout);
            let gone = Arc::new(AtomicBool::new(false));
            let caller = gone.clone();
            let mut direct = Direct {
                rest: Some(Box::pin(async move {
                    match on_its_way
                        .within(send_direct(&job, &client, &paths, &caller))
                        .await
                    {
                        Some(answer) => answer,
                        None => Err(abandoned(&client, &wedged, timeout)),
                    }
                })),
                polled: false,
                gone,
            };
            // Polled once now: its commands are in fred's queue before this
            // returns (fred takes a command without waiting), so jobs reach
            // Redis in the order they were asked for, as through a lane.
            let mut cx = Context::from_waker(std::task::Waker::noop());
            return match Pin::new(&mut direct).poll(&mut cx) {
                Poll::Ready(answer) => Sent(Call::Ready(Some(answer))),
                Poll::Pending => Sent(Call::Direct(direct)),
            };
        }
        let client = self.clients[lane].clone();
        Sent(Call::Alone(Box::pin(async move {
            let reply = job.send(&client).await;
            job.read(reply)
        })))
    }

    /// The connection that carries `job` (its key's lane), for a job that
    /// does not keep its place in the lane's queue
    /// ([`Job::keeps_lane`]: an idempotency step), which its caller sends
    /// itself: `job.send(&client)` then `job.read(..)`, as [`send`](Self::send)
    /// would, without its boxed future.
    pub(crate) fn connection(&self, job: &Job) -> &Client {
        debug_assert!(!job.keeps_lane(), "a lease's job goes through `send`");
        &self.clients[lane_of(job.key.as_bytes(), self.clients.len())]
    }

    /// The queue of `lane`, its task started if this is its first job;
    /// `None` without batching or outside a runtime.
    fn queue(&self, lane: usize) -> Option<&mpsc::Sender<Queued>> {
        let queue = self.queues.get(lane)?;
        if let Some(tx) = queue.get() {
            return Some(tx);
        }
        let handle = tokio::runtime::Handle::try_current().ok()?;
        Some(queue.get_or_init(|| {
            let (tx, rx) = mpsc::channel(QUEUE);
            handle.spawn(run_lane(
                self.untimed[lane].clone(),
                self.flights[lane].clone(),
                self.wedged[lane].clone(),
                self.paths.clone(),
                rx,
                self.timeout,
            ));
            tx
        }))
    }
}

/// `client` with fred's per-command timer off (`Options::timeout` zero):
/// for native calls and the lane's batches, which their [`Flight`] bounds.
fn untimed(client: &Client) -> WithOptions<Client> {
    client.with_options(&Options {
        timeout: Some(Duration::ZERO),
        ..Options::default()
    })
}

/// A lease's job sent from its caller's task: on the native road its
/// native commands where it has them, on the script road a plain acquire's
/// `SET … NX PX … GET`, else (or when the server refuses it)
/// its script; either way on `client`
/// (fred's timer off: the caller's flight bounds the call).
///
/// An acquire whose caller stopped waiting (`gone`, set when its [`Direct`]
/// is dropped unanswered) sends nothing after its first reply: the caller's
/// cleanup release may be on its way behind it already.
async fn send_direct(
    job: &Job,
    client: &WithOptions<Client>,
    paths: &Paths,
    gone: &AtomicBool,
) -> Result<Reply, BackendError> {
    let road = paths.native();
    let natively = match road {
        true => native::has_form(job),
        // A lone acquire goes natively on every server (`job/native.rs`).
        false => native::on_every_server(job) && paths.typed_acquire(),
    };
    if natively {
        match native::send(job, client, road, gone).await {
            Native::Answered(answer) => {
                if road && answer.is_ok() {
                    paths.answered();
                }
                return answer;
            }
            Native::Refused(e) if native::lacks_command(&e) => {
                if road {
                    paths.refused(&e);
                }
                // Refused on either road: the script road's acquires too.
                if native::on_every_server(job) {
                    paths.typed_acquire_refused(&e);
                }
            }
            // `OOM` on an extend falls back for this call alone.
            Native::Refused(_) | Native::Script => {}
        }
        if native::on_every_server(job) && gone.load(Ordering::SeqCst) {
            return Err(native::gave_up());
        }
    }
    // Boxed: only a call that falls back holds a script call's future.
    let reply = Box::pin(job.send_unless(client, || gone.load(Ordering::SeqCst))).await;
    job.read(reply)
}

/// A lease job sent from its caller's task that got no answer within
/// `timeout`: its caller gets an error and, as for a batch, the connection
/// is replaced ([`replace_connection`]).
fn abandoned(client: &Client, wedged: &Arc<AtomicBool>, timeout: Duration) -> BackendError {
    replace_connection(client, wedged, timeout, 1);
    map_err(FredError::new(
        ErrorKind::Timeout,
        "lease call abandoned: no answer within the batch timeout",
    ))
}

/// Replace `client`'s connection after `calls` lease calls (a direct
/// call, or a batch's) got no answer within `timeout`: it may be wedged (a
/// reply that never comes holds back every later one). Once however many
/// calls give up on it: the direct calls and the lane's batches share
/// `wedged`, set until the reconnection returned, so an outage that
/// abandons a batch a second does not queue a forced reconnection in fred
/// per batch (replayed one after another once Redis is back). A client
/// without a reconnect policy (fred's default for a client built by hand)
/// is left as it is: fred ends a connection's task for good when asked to
/// reconnect without one, and a late reply still lets the calls behind it
/// through.
fn replace_connection(client: &Client, wedged: &Arc<AtomicBool>, timeout: Duration, calls: usize) {
    if client.client_reconnect_policy().is_none() {
        tracing::warn!(
            calls,
            timeout_ms = timeout.as_millis() as u64,
            "no answer to a lease call within the batch timeout; abandoned (the client has no \
             reconnect policy: its connection is kept)"
        );
        return;
    }
    if wedged.swap(true, Ordering::SeqCst) {
        return;
    }
    tracing::warn!(
        calls,
        timeout_ms = timeout.as_millis() as u64,
        "no answer to a lease call within the batch timeout; abandoned, reconnecting"
    );
    let (client, wedged) = (client.clone(), wedged.clone());
    tokio::spawn(async move {
        let _ = client.force_reconnection().await;
        wedged.store(false, Ordering::SeqCst);
    });
}

/// The connection of a pool that carries every job on `key` (the same for
/// the life of the pool), so jobs on one key keep their order.
fn lane_of(key: &[u8], lanes: usize) -> usize {
    if lanes <= 1 {
        return 0;
    }
    let hash =
        std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
            .hash_one(key);
    (hash % lanes as u64) as usize
}

/// A lane's task: its batches go out through `client` (fred's per-command
/// timer off), one at a time, each bounded by the lane's `flight` (no timer
/// of its own: see `flight.rs`).
async fn run_lane(
    client: WithOptions<Client>,
    flight: Arc<Flight>,
    wedged: Arc<AtomicBool>,
    paths: Arc<Paths>,
    mut rx: mpsc::Receiver<Queued>,
    timeout: Duration,
) {
    // One batch in flight, sent from this task itself (no task per batch:
    // that cost a spawn and a wake-up per batch, i.e. two per request at low
    // load). Jobs arriving while it is in flight wait in the queue and go
    // out together as the next batch. One buffer for every batch.
    // Up to four in flight (each sent before the next was gathered, so
    // still in order) measured slower at 10 and 50 connections: smaller
    // batches cost more scripts and CPU than the shorter wait saves
    // (BENCHMARKS.md).
    let mut batch = Vec::with_capacity(16);
    // A job that must go alone, taken from the queue while a batch was being
    // gathered: the next batch is that job.
    let mut carry: Option<Queued> = None;
    loop {
        let first = match carry.take() {
            Some(queued) => queued,
            None => match rx.recv().await {
                Some(queued) => queued,
                None => break,
            },
        };
        let alone = !first.job.batchable();
        batch.push(first);
        while !alone && batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(queued) if !queued.job.batchable() => {
                    carry = Some(queued);
                    break;
                }
                Ok(queued) => batch.push(queued),
                Err(_) => break,
            }
        }
        let n = batch.len();
        let boarded = flight.board(timeout);
        let sent = boarded.within(send(&client, &mut batch, &paths)).await;
        drop(boarded);
        // Abandoned jobs are dropped here: their callers get an error.
        batch.clear();
        if sent.is_none() {
            // Abandoned: every caller gets an error now (an acquire's
            // caller cleans up after it, a release is retried by its
            // delivery). The connection may be wedged (a reply that will
            // never come would shift every later reply): start a new one,
            // and let the next batch go.
            replace_connection(&client, &wedged, timeout, n);
        }
    }
}

/// Send one batch and answer its jobs (`batch` is left empty). Jobs whose
/// callers stopped waiting are left unsent when they may be
/// ([`Job::skippable`]). On the native road its releases are `DELIFEQ`
/// inside the script; those the server refuses (it lacks the command, or
/// this client may not run it) go again in a batch without it, and the
/// road turns to scripts until the next probe.
async fn send(client: &WithOptions<Client>, batch: &mut Vec<Queued>, paths: &Paths) {
    batch.retain(|q| !q.job.skippable() || !q.reply.is_closed());
    if batch.len() <= 1 {
        if let Some(queued) = batch.pop() {
            let result = queued.job.send(client).await;
            queued.answer(result);
        }
        return;
    }
    let native = paths.native();
    let reply = send_batch(client, batch, native).await;
    let mut refused = Vec::new();
    answer_batch(batch, reply, native.then_some(&mut refused));
    if let Some(first) = refused.first() {
        paths.refused(&FredError::new(ErrorKind::Unknown, first.1.clone()));
        let mut again: Vec<Queued> = refused.into_iter().map(|(q, _)| q).collect();
        let reply = send_batch(client, &again, false).await;
        answer_batch(&mut again, reply, None);
    }
}

/// `EVALSHA` of the batch script for `batch` (`EVAL` if the server lacks
/// it), with `DELIFEQ` for its releases when `native`.
async fn send_batch(
    client: &WithOptions<Client>,
    batch: &[Queued],
    native: bool,
) -> Result<Value, FredError> {
    let args = || {
        let mut args = ops_of(batch);
        if native {
            args.push(Value::from_static_str("n"));
        }
        args
    };
    match BATCH.evalsha(client, keys_of(batch), args()).await {
        Err(e) if scripts::is_noscript(&e) => BATCH.eval(client, keys_of(batch), args()).await,
        other => other,
    }
}

/// The batch script's keys: each job's.
fn keys_of(batch: &[Queued]) -> Vec<Key> {
    batch.iter().map(|q| q.job.key.clone()).collect()
}

/// The batch script's one argument: every job, encoded.
fn ops_of(batch: &[Queued]) -> Vec<Value> {
    let mut ops = Vec::with_capacity(batch.len() * 48);
    for queued in batch {
        queued.job.encode(&mut ops);
    }
    vec![Value::Bytes(Bytes::from(ops))]
}

/// Answer each job of a batch from the batch script's reply (one integer or
/// error message per job), or all of them with its error. With `refused`
/// (a batch with `DELIFEQ`), a release whose `DELIFEQ` the server refused
/// is not answered but moved there, with the server's message.
fn answer_batch(
    batch: &mut Vec<Queued>,
    reply: Result<Value, FredError>,
    mut refused: Option<&mut Vec<(Queued, String)>>,
) {
    match reply {
        Ok(Value::Array(replies)) if replies.len() == batch.len() => {
            for (queued, reply) in batch.drain(..).zip(replies) {
                let result = match reply {
                    Value::Integer(_) => Ok(reply),
                    // A command of this operation failed: its message.
                    other => {
                        let message = other.as_str().map_or_else(
                            || "error in the batch script".to_owned(),
                            |m| m.into_owned(),
                        );
                        if let Some(refused) = refused.as_deref_mut().filter(|_| {
                            queued.job.is_release() && native::refused_in_script(&message)
                        }) {
                            refused.push((queued, message));
                            continue;
                        }
                        Err(FredError::new(ErrorKind::Unknown, message))
                    }
                };
                queued.answer(result);
            }
        }
        Ok(other) => {
            let msg = format!("unexpected reply to the batch script: {other:?}");
            for queued in batch.drain(..) {
                queued.answer(Err(FredError::new(ErrorKind::Protocol, msg.clone())));
            }
        }
        Err(e) => {
            for queued in batch.drain(..) {
                queued.answer(Err(e.clone()));
            }
        }
    }
}

/// The answer to one [`Dispatch::send`], read ([`Job::read`]): from the
/// job's batch, or from a call of its own.
pub(crate) struct Sent(Call);

enum Call {
    /// Queued in its lane.
    Queued(oneshot::Receiver<Result<Reply, BackendError>>),
    /// Answered when it was sent (the lane's queue was full, or a direct
    /// call answered at its first poll).
    Ready(Option<Result<Reply, BackendError>>),
    /// Sent alone, without a lane task.
    Alone(Answer),
    /// A lease job sent from its caller's task.
    Direct(Direct),
}

type Answer = Pin<Box<dyn Future<Output = Result<Reply, BackendError>> + Send + 'static>>;

/// A lease job sent from its caller's task: sent at its first poll;
/// dropped after that and before its answer (its caller's deadline), the
/// rest runs on a task of its own, so that its timeout still applies and a
/// wedged connection is still replaced (as a batch's lane task does).
struct Direct {
    rest: Option<Answer>,
    polled: bool,
    /// Set when this is dropped before its answer (its caller stopped
    /// waiting): an acquire then sends nothing after its first reply.
    gone: Arc<AtomicBool>,
}

impl Future for Direct {
    type Output = Result<Reply, BackendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.polled = true;
        let Some(rest) = self.rest.as_mut() else {
            return Poll::Ready(Err(BackendError::new(
                "lease call polled after it answered",
            )));
        };
        let out = rest.as_mut().poll(cx);
        if out.is_ready() {
            self.rest = None;
        }
        out
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        if let (true, Some(rest)) = (self.polled, self.rest.take()) {
            self.gone.store(true, Ordering::SeqCst);
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                drop(handle.spawn(async move {
                    let _ = rest.await;
                }));
            }
        }
    }
}

impl Future for Sent {
    type Output = Result<Reply, BackendError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            Call::Queued(reply) => Pin::new(reply).poll(cx).map(|answer| {
                answer.unwrap_or_else(|_| {
                    Err(map_err(FredError::new(
                        ErrorKind::Timeout,
                        "batch abandoned: no answer within the batch timeout",
                    )))
                })
            }),
            Call::Ready(answer) => Poll::Ready(
                answer
                    .take()
                    .unwrap_or_else(|| Err(BackendError::new("call polled after it answered"))),
            ),
            Call::Alone(fut) => fut.as_mut().poll(cx),
            Call::Direct(direct) => Pin::new(direct).poll(cx),
        }
    }
}
