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
//! Here one task has at most one batch in flight: a call that finds it idle
//! goes out at once, alone, with the per-operation script (so at low load
//! nothing changes: same command, same latency); calls that arrive while a
//! batch is in flight wait for it and then go out together, as one
//! `EVALSHA batch n k1..kn op1 tok1 ttl1 ..`, one write each way and one
//! script call for the lot. Each operation inside runs the same steps as its
//! own script, in arrival order, and one whose command fails (wrong type, OOM)
//! fails alone
//! (the batch script is `BATCH_LUA` in `scripts.rs`).
//!
//! Only for non-cluster clients: a cluster script may only touch keys of one
//! slot.

use fred::clients::{Client, Pool};
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::ClientLike;
use fred::types::{Key, Value};
use tokio::sync::{mpsc, oneshot};

use super::scripts::{Script, BATCH};

/// Largest batch sent as one script call.
const MAX_BATCH: usize = 256;
/// Batches in flight at once (per backend). One gives the largest batches and
/// the least Redis CPU per request; 2 and 4 measured no better here.
const IN_FLIGHT: usize = 1;

/// Which operation a job is (its letter in the batch script).
#[derive(Clone, Copy)]
pub(crate) enum Op {
    Acquire,
    Release,
    Extend,
}

impl Op {
    fn letter(self) -> &'static str {
        match self {
            Op::Acquire => "a",
            Op::Release => "r",
            Op::Extend => "e",
        }
    }
}

/// Where a job's answer arrives.
pub(crate) type Reply = oneshot::Receiver<Result<Value, FredError>>;

/// One script call waiting for its batch.
pub(crate) struct Job {
    pub(crate) op: Op,
    /// The operation's own script, for a batch of one.
    pub(crate) script: Script,
    pub(crate) key: Key,
    /// Token, then TTL in ms for acquire and extend.
    pub(crate) args: Vec<Value>,
    reply: Option<oneshot::Sender<Result<Value, FredError>>>,
}

impl Job {
    pub(crate) fn new(op: Op, script: Script, key: Key, args: Vec<Value>) -> Self {
        Self {
            op,
            script,
            key,
            args,
            reply: None,
        }
    }

    fn answer(&mut self, result: Result<Value, FredError>) {
        if let Some(tx) = self.reply.take() {
            let _ = tx.send(result);
        }
    }
}

/// Where batches go: a client, or a pool (one of its clients per batch).
#[derive(Clone)]
enum Target {
    Client(Client),
    Pool(Pool),
}

impl Target {
    fn client(&self) -> &Client {
        match self {
            Self::Client(c) => c,
            Self::Pool(p) => p.next(),
        }
    }
}

/// Handle to the batching task (started on first use, inside a runtime).
pub(crate) struct Batcher {
    target: Target,
    tx: std::sync::OnceLock<mpsc::UnboundedSender<Job>>,
}

impl Batcher {
    /// A batcher for `client` if it is a non-cluster fred `Client` or `Pool`.
    pub(crate) fn of<C: 'static>(client: &C) -> Option<Self> {
        let any = client as &dyn std::any::Any;
        let target = if let Some(c) = any.downcast_ref::<Client>() {
            Target::Client(c.clone())
        } else {
            Target::Pool(any.downcast_ref::<Pool>()?.clone())
        };
        if target.client().is_clustered() {
            return None;
        }
        Some(Self {
            target,
            tx: std::sync::OnceLock::new(),
        })
    }

    fn sender(&self) -> Option<&mpsc::UnboundedSender<Job>> {
        if let Some(tx) = self.tx.get() {
            return Some(tx);
        }
        let handle = tokio::runtime::Handle::try_current().ok()?;
        Some(self.tx.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            handle.spawn(worker(self.target.clone(), rx));
            tx
        }))
    }

    /// Queue `job`; the reply comes when its batch returns. Gives the key
    /// and arguments back when no batching task can run here (no runtime):
    /// call directly.
    pub(crate) fn submit(&self, mut job: Job) -> Result<Reply, (Key, Vec<Value>)> {
        let Some(tx) = self.sender() else {
            return Err((job.key, job.args));
        };
        let (reply, rx) = oneshot::channel();
        job.reply = Some(reply);
        tx.send(job)
            .map_err(|mpsc::error::SendError(job)| (job.key, job.args))?;
        Ok(rx)
    }
}

async fn worker(target: Target, mut rx: mpsc::UnboundedReceiver<Job>) {
    let in_flight = std::sync::Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        // Wait for a free slot first: calls arriving meanwhile join this batch.
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let mut jobs = Vec::with_capacity(16);
        jobs.push(first);
        while jobs.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        let client = target.client().clone();
        tokio::spawn(async move {
            send(&client, jobs).await;
            drop(permit);
        });
    }
}

/// Send one batch and answer its jobs.
async fn send(client: &Client, mut jobs: Vec<Job>) {
    // Acquires and extends whose callers gave up (deadline) while queued
    // need no command. A release is never dropped: its delivery task waits
    // for it, and a lease must not outlive its request.
    jobs.retain(|j| {
        matches!(j.op, Op::Release) || j.reply.as_ref().is_some_and(|tx| !tx.is_closed())
    });
    if jobs.len() == 1 {
        if let Some(mut job) = jobs.pop() {
            let keys = vec![job.key.clone()];
            let args = std::mem::take(&mut job.args);
            let result = job.script.run_multi(client, keys, args).await;
            job.answer(result);
        }
        return;
    }
    if jobs.is_empty() {
        return;
    }
    let mut keys = Vec::with_capacity(jobs.len());
    let mut args = Vec::with_capacity(jobs.len() * 3);
    for job in &mut jobs {
        keys.push(job.key.clone());
        let mut it = std::mem::take(&mut job.args).into_iter();
        args.push(Value::from_static_str(job.op.letter()));
        args.push(it.next().unwrap_or(Value::Null));
        args.push(it.next().unwrap_or_else(|| Value::from_static_str("")));
    }
    match BATCH.run_multi(client, keys, args).await {
        Ok(Value::Array(replies)) if replies.len() == jobs.len() => {
            for (job, reply) in jobs.iter_mut().zip(replies) {
                let result = match reply {
                    Value::Array(ref pair) if matches!(pair.first(), Some(Value::Integer(-1))) => {
                        let message = pair.get(1).and_then(|v| v.as_str()).map_or_else(
                            || "error in the batch script".to_owned(),
                            |m| m.into_owned(),
                        );
                        Err(FredError::new(ErrorKind::Unknown, message))
                    }
                    other => Ok(other),
                };
                job.answer(result);
            }
        }
        Ok(other) => {
            let msg = format!("unexpected reply to the batch script: {other:?}");
            for job in &mut jobs {
                job.answer(Err(FredError::new(ErrorKind::Protocol, msg.clone())));
            }
        }
        Err(e) => {
            for job in &mut jobs {
                job.answer(Err(e.clone()));
            }
        }
    }
}
