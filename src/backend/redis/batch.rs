//! Auto-batching for [`RedisBackend`](super::RedisBackend): the acquires,
//! releases and extends of concurrent requests go to Redis as **one**
//! `EVALSHA` of a batch script.
//!
//! Why not fred's pipelining: fred writes (and flushes) each command as soon
//! as its router task sees it, and under Tokio that task runs right after each
//! command is queued, so every command costs a `writev` here and a read, a
//! write and a Lua call on the Redis side. A fred `Pipeline` does not help: it
//! flushes after every command too (fred 10.1 `process_pipeline`).
//!
//! Here one task per connection (one for a `Client`, one per connection of a
//! `Pool`, each key always on the same one) has at most one batch in flight: a call that finds it idle
//! goes out at once, alone, with the per-operation script (so at low load
//! nothing changes: same command, same latency); calls that arrive while a
//! batch is in flight wait for it and then go out together, as one
//! `EVALSHA batch n k1..kn ops` (`ops` one string: per operation its
//! letter, token, TTL and `;`), one write each way and one
//! script call for the lot. Each operation inside runs the same steps as its
//! own script, in arrival order, and one whose command fails (wrong type, OOM)
//! fails alone
//! (the batch script is `BATCH_LUA` in `scripts.rs`).
//!
//! A batch that gets no answer within the batch timeout is abandoned: its
//! callers get an error, the connection is replaced, and the next batch goes
//! out. The queue per connection is bounded; beyond it a call fails at once.
//!
//! Every batch goes out through the fred client (its connection, login,
//! TLS and retry settings), the lane's connection for a `Pool`. A fenced
//! acquire (two keys) is never inside a batch script, but goes through the
//! same queue, alone, so the key's later calls cannot overtake it.
//!
//! Only for non-cluster clients: a cluster script may only touch keys of one
//! slot.

use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use fred::clients::{Client, Pool};
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::{ClientLike, LuaInterface};
use fred::types::{Key, Value};
use tokio::sync::{mpsc, oneshot};

use super::scripts::{Script, BATCH};

/// Largest batch sent as one script call.
const MAX_BATCH: usize = 256;

/// Which operation a job is (its letter in the batch script).
#[derive(Clone, Copy)]
pub(crate) enum Op {
    Acquire,
    Release,
    /// A release that publishes if the key is marked (`key:wait`, a second
    /// key): always sent alone, with its own script.
    ReleaseNotify,
    Extend,
    /// An acquire with its fence counter (`key:fence`, a second key): always
    /// sent alone, with its own script.
    AcquireFenced,
}

impl Op {
    fn letter(self) -> u8 {
        match self {
            Op::Acquire | Op::AcquireFenced => b'a',
            Op::Release | Op::ReleaseNotify => b'r',
            Op::Extend => b'e',
        }
    }
}

/// Suffix of the fencing counter's key.
pub(crate) const FENCE_SUFFIX: &[u8] = b":fence";
/// Suffix of the mark of a key that requests wait for (`lease:wait`).
pub(crate) const WAIT_SUFFIX: &[u8] = b":wait";

/// Where a job's answer arrives.
pub(crate) type Reply = oneshot::Receiver<Result<Value, FredError>>;

/// One script call waiting for its batch.
pub(crate) struct Job {
    pub(crate) op: Op,
    /// The operation's own script, for a batch of one.
    pub(crate) script: &'static Script,
    pub(crate) key: Key,
    /// The token as 32 hex characters.
    token: [u8; 32],
    /// The TTL in ms (acquire and extend).
    ttl_ms: Option<i64>,
    /// A fenced acquire's counter life in ms (its third argument).
    fence_life: Option<i64>,
    /// The key's wait mark goes with it (`lease:wait`, a last key): an
    /// acquire that marks a key it finds held, or a release that notifies.
    mark: bool,
    reply: Option<oneshot::Sender<Result<Value, FredError>>>,
}

impl Job {
    pub(crate) fn new(
        op: Op,
        script: &'static Script,
        key: Key,
        token: [u8; 32],
        ttl_ms: Option<i64>,
        fence_life: Option<i64>,
    ) -> Self {
        Self {
            op,
            script,
            key,
            token,
            ttl_ms,
            fence_life,
            mark: false,
            reply: None,
        }
    }

    /// With the key's wait mark as a last key (the script must be one that
    /// takes it: `ACQUIRE_WAIT`, `ACQUIRE_FENCED`, `RELEASE_NOTIFY`).
    pub(crate) fn marked(mut self, mark: bool) -> Self {
        self.mark = mark;
        self
    }

    /// A job that never goes out in a batch script (more than one key).
    fn alone(&self) -> bool {
        self.mark || matches!(self.op, Op::AcquireFenced)
    }

    /// The key with `suffix`, same hash slot.
    fn derived_key(&self, suffix: &[u8]) -> Key {
        let mut key = Vec::with_capacity(self.key.as_bytes().len() + suffix.len());
        key.extend_from_slice(self.key.as_bytes());
        key.extend_from_slice(suffix);
        Key::from(Bytes::from(key))
    }

    /// The keys of a job sent alone: the lease, its fence counter (fenced
    /// acquire), its wait mark (marked).
    fn keys(&self) -> Vec<Key> {
        let mut keys = Vec::with_capacity(3);
        keys.push(self.key.clone());
        if matches!(self.op, Op::AcquireFenced) {
            keys.push(self.derived_key(FENCE_SUFFIX));
        }
        if self.mark {
            keys.push(self.derived_key(WAIT_SUFFIX));
        }
        keys
    }

    /// Send this operation alone, with its own script; its key and
    /// arguments are built again only if the server lacks the script.
    pub(crate) async fn run_alone<C: LuaInterface + Send + Sync>(
        &self,
        client: &C,
    ) -> Result<Value, FredError> {
        if self.alone() {
            let build = || (self.keys(), self.args());
            return self.script.run_built(client, build, build).await;
        }
        let build = || (self.key.clone(), self.args());
        self.script.run_built(client, build, build).await
    }

    /// The arguments of the operation's own script: token, the TTL, the
    /// fence counter's life.
    fn args(&self) -> Vec<Value> {
        let mut args = Vec::with_capacity(3);
        args.push(Value::Bytes(Bytes::copy_from_slice(&self.token)));
        args.extend(self.ttl_ms.map(Value::Integer));
        args.extend(self.fence_life.map(Value::Integer));
        args
    }

    /// Append this operation to the batch script's one argument: letter,
    /// token, TTL, `;`.
    fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.op.letter());
        out.extend_from_slice(&self.token);
        if let Some(ms) = self.ttl_ms {
            push_decimal(out, ms.max(0) as u64);
        }
        out.push(b';');
    }

    fn answer(&mut self, result: Result<Value, FredError>) {
        if let Some(tx) = self.reply.take() {
            let _ = tx.send(result);
        }
    }
}

/// `n` in decimal digits.
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// How long a batch in flight may wait for its answer by default
/// ([`RedisBackend::batch_timeout`](super::RedisBackend::batch_timeout)).
pub(crate) const BATCH_TIMEOUT: Duration = Duration::from_secs(1);
/// Calls waiting for their batch, per connection; beyond it a call fails at
/// once (`Backpressure`: the layer's fail policy answers) instead of queueing
/// without bound behind a wedged connection.
const QUEUE: usize = 10_000;

/// One connection and the batching task that feeds it.
struct Lane {
    client: Client,
    tx: std::sync::OnceLock<mpsc::Sender<Job>>,
}

/// Why a job was not queued.
pub(crate) enum Refused {
    /// No batching task can run here (no runtime): call directly.
    NoRuntime(Box<Job>),
    /// The queue is full.
    Full,
}

/// Handle to the batching tasks (started on first use, inside a runtime):
/// one per connection, one connection per key. All calls on a key go through
/// the same connection, in the order they were made, so a late acquire's
/// cleanup cannot overtake the acquire on another connection of a pool.
pub(crate) struct Batcher {
    lanes: Box<[Lane]>,
    timeout: Duration,
}

impl Batcher {
    /// A batcher for `client` if it is a non-cluster fred `Client` or `Pool`.
    pub(crate) fn of<C: 'static>(client: &C, timeout: Duration) -> Option<Self> {
        let any = client as &dyn std::any::Any;
        let clients: Vec<Client> = if let Some(c) = any.downcast_ref::<Client>() {
            vec![c.clone()]
        } else {
            any.downcast_ref::<Pool>()?.clients().to_vec()
        };
        if clients.is_empty() || clients[0].is_clustered() {
            return None;
        }
        let lanes = clients
            .into_iter()
            .map(|client| Lane {
                client,
                tx: std::sync::OnceLock::new(),
            })
            .collect();
        Some(Self { lanes, timeout })
    }

    /// The batch timeout.
    #[cfg(test)]
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    fn sender(&self, key: &Key) -> Option<&mpsc::Sender<Job>> {
        let lane = &self.lanes[lane_of(key.as_bytes(), self.lanes.len())];
        if let Some(tx) = lane.tx.get() {
            return Some(tx);
        }
        let handle = tokio::runtime::Handle::try_current().ok()?;
        Some(lane.tx.get_or_init(|| {
            let (tx, rx) = mpsc::channel(QUEUE);
            handle.spawn(worker(lane.client.clone(), rx, self.timeout));
            tx
        }))
    }

    /// Queue `job` on its key's connection; the reply comes when its batch
    /// returns (an error if the batch was abandoned).
    pub(crate) fn submit(&self, mut job: Job) -> Result<Reply, Refused> {
        let Some(tx) = self.sender(&job.key) else {
            return Err(Refused::NoRuntime(Box::new(job)));
        };
        let (reply, rx) = oneshot::channel();
        job.reply = Some(reply);
        match tx.try_send(job) {
            Ok(()) => Ok(rx),
            Err(mpsc::error::TrySendError::Full(_)) => Err(Refused::Full),
            Err(mpsc::error::TrySendError::Closed(job)) => Err(Refused::NoRuntime(Box::new(job))),
        }
    }
}

/// The connection of a pool that carries every call on `key` (the same for
/// the life of the pool), so calls on one key keep their order.
fn lane_of(key: &[u8], lanes: usize) -> usize {
    if lanes <= 1 {
        return 0;
    }
    let hash =
        std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
            .hash_one(key);
    (hash % lanes as u64) as usize
}

/// For a fred `Pool`, the connection that carries every call on `key`
/// (unbatched calls too); `None` for any other client type.
pub(crate) fn pinned<C: 'static>(client: &C, key: &[u8]) -> Option<Client> {
    let pool = (client as &dyn std::any::Any).downcast_ref::<Pool>()?;
    let clients = pool.clients();
    clients.get(lane_of(key, clients.len())).cloned()
}

/// A lane's batching task: its batches go out through `client`, one at a
/// time.
async fn worker(client: Client, mut rx: mpsc::Receiver<Job>, timeout: Duration) {
    // One batch in flight, sent from this task itself (no task per batch:
    // that cost a spawn and a wake-up per batch, i.e. two per request at low
    // load). Calls arriving while it is in flight wait in the queue and go
    // out together as the next batch. One buffer for every batch.
    // Up to four in flight (each sent before the next was gathered, so
    // still in order) measured slower at 10 and 50 connections: smaller
    // batches cost more scripts and CPU than the shorter wait saves
    // (BENCHMARKS.md).
    let mut jobs = Vec::with_capacity(16);
    // A job that must go alone, taken from the queue while a batch was being
    // gathered: the next batch is that job.
    let mut carry: Option<Job> = None;
    loop {
        let first = match carry.take() {
            Some(job) => job,
            None => match rx.recv().await {
                Some(job) => job,
                None => break,
            },
        };
        let alone = first.alone();
        jobs.push(first);
        while !alone && jobs.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) if job.alone() => {
                    carry = Some(job);
                    break;
                }
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        let n = jobs.len();
        let sent = tokio::time::timeout(timeout, send(&client, &mut jobs)).await;
        // Abandoned jobs are dropped here: their callers get an error.
        jobs.clear();
        if sent.is_err() {
            // Abandoned: every caller gets an error now (an acquire's
            // caller cleans up after it, a release is retried by its
            // delivery task). The connection may be wedged (a reply that
            // will never come would shift every later reply): start a new
            // one, and let the next batch go.
            tracing::warn!(
                operations = n,
                timeout_ms = timeout.as_millis() as u64,
                "no answer to a batch within its timeout; abandoned, reconnecting"
            );
            let client = client.clone();
            tokio::spawn(async move {
                let _ = client.force_reconnection().await;
            });
        }
    }
}

/// Acquires and extends whose callers gave up (deadline) while queued need
/// no command. A release is never dropped: its delivery task waits for it,
/// and a lease must not outlive its request.
fn drop_abandoned(jobs: &mut Vec<Job>) {
    jobs.retain(|j| {
        matches!(j.op, Op::Release | Op::ReleaseNotify)
            || j.reply.as_ref().is_some_and(|tx| !tx.is_closed())
    });
}

/// Send one batch and answer its jobs (`jobs` is left empty).
async fn send<C: LuaInterface + Send + Sync>(client: &C, jobs: &mut Vec<Job>) {
    drop_abandoned(jobs);
    if jobs.len() == 1 {
        if let Some(mut job) = jobs.pop() {
            let result = job.run_alone(client).await;
            job.answer(result);
        }
        return;
    }
    if jobs.is_empty() {
        return;
    }
    let build = || {
        let keys: Vec<Key> = jobs.iter().map(|j| j.key.clone()).collect();
        let mut ops = Vec::with_capacity(jobs.len() * 48);
        for job in jobs.iter() {
            job.encode(&mut ops);
        }
        (keys, vec![Value::Bytes(Bytes::from(ops))])
    };
    let reply = BATCH.run_built(client, build, build).await;
    answer_batch(jobs, reply);
}

/// Answer each job of a batch from the batch script's reply (one integer or
/// error message per job), or all of them with its error.
fn answer_batch(jobs: &mut [Job], reply: Result<Value, FredError>) {
    match reply {
        Ok(Value::Array(replies)) if replies.len() == jobs.len() => {
            for (job, reply) in jobs.iter_mut().zip(replies) {
                let result = match reply {
                    Value::Integer(_) => Ok(reply),
                    // A command of this operation failed: its message.
                    other => Err(FredError::new(
                        ErrorKind::Unknown,
                        other.as_str().map_or_else(
                            || "error in the batch script".to_owned(),
                            |m| m.into_owned(),
                        ),
                    )),
                };
                job.answer(result);
            }
        }
        Ok(other) => {
            let msg = format!("unexpected reply to the batch script: {other:?}");
            for job in jobs.iter_mut() {
                job.answer(Err(FredError::new(ErrorKind::Protocol, msg.clone())));
            }
        }
        Err(e) => {
            for job in jobs.iter_mut() {
                job.answer(Err(e.clone()));
            }
        }
    }
}

/// Send a lease call (a [`Job`]: one key, or a lease with its fence
/// counter or wait mark): handed to `batch` when there is one (it may go
/// out with the calls of other requests, as one `BATCH_LUA` of
/// `scripts.rs`). Queued in the batch *now*, not
/// when the future is first polled, so calls reach Redis in the order
/// they were made (a late acquire's cleanup cannot overtake the acquire).
pub(crate) fn dispatch<C: LuaInterface + Clone + Send + Sync + 'static>(
    client: &C,
    batch: Option<&Arc<Batcher>>,
    job: Job,
) -> ScriptCall {
    let job = match batch {
        Some(batch) => match batch.submit(job) {
            Ok(reply) => return ScriptCall(Call::Batched(reply)),
            Err(Refused::Full) => {
                return ScriptCall(Call::Failed(Some(FredError::new(
                    ErrorKind::Backpressure,
                    "too many calls waiting for a batch",
                ))))
            }
            Err(Refused::NoRuntime(job)) => *job,
        },
        None => job,
    };
    // On a pool, always the key's own connection: calls on a key keep
    // their order.
    let fut: Pin<Box<dyn Future<Output = _> + Send>> = match pinned(client, job.key.as_bytes()) {
        Some(pinned) => Box::pin(async move { job.run_alone(&pinned).await }),
        None => {
            let client = client.clone();
            Box::pin(async move { job.run_alone(&client).await })
        }
    };
    ScriptCall(Call::Direct(fut))
}

/// The reply to one [`dispatch`]: from the batcher, or from a call of
/// its own (no batcher: a cluster, `auto_pipeline(false)`, no runtime).
pub(crate) struct ScriptCall(Call);

enum Call {
    Batched(Reply),
    Failed(Option<FredError>),
    Direct(Pin<Box<dyn Future<Output = Result<Value, FredError>> + Send + 'static>>),
}

impl Future for ScriptCall {
    type Output = Result<Value, FredError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            Call::Batched(reply) => Pin::new(reply).poll(cx).map(|answer| {
                answer.unwrap_or_else(|_| {
                    Err(FredError::new(
                        ErrorKind::Timeout,
                        "batch abandoned: no answer within the batch timeout",
                    ))
                })
            }),
            Call::Failed(error) => Poll::Ready(Err(error.take().unwrap_or_else(|| {
                FredError::new(ErrorKind::Unknown, "script call polled after it answered")
            }))),
            Call::Direct(fut) => fut.as_mut().poll(cx),
        }
    }
}
