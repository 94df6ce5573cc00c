//! Fixtures for the scale-out tests: a real Redis Cluster (3 masters + 3
//! replicas) and a Sentinel group (1 primary, 1 replica, 3 sentinels), each on
//! free loopback ports.
//!
//! Every `redis-server` runs under a small `sh` watchdog that kills it (and
//! removes its directory) as soon as the test process is gone, however the
//! process ends: a static fixture shared by all tests of one binary is never
//! dropped, so it cannot rely on `Drop`.
//!
//! The integration tests reach it as `crate::common::scale`, the load bench
//! as `tower_redis_lock_test_support::scale`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

pub use crate::server::cli;
use crate::server::{free_port, kill_guarded, server_pid, spawn_guarded};

/// [`eventually`](crate::eventually) from the fixtures' sync code
/// (which may run inside a test's runtime): on a thread of its own, with a
/// current-thread runtime of its own.
fn wait_until(within: Duration, cond: impl FnMut() -> bool + Send) -> bool {
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("tokio runtime")
                .block_on(crate::eventually(within, cond))
        })
        .join()
        .expect("wait thread")
    })
}

/// The pid of the server on `port` (from `INFO server`).
pub fn pid_of(port: u16) -> u32 {
    server_pid(port).unwrap_or_else(|| panic!("no server answers INFO on port {port}"))
}

/// `kill -SIG pid`.
pub fn kill_pid(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill {sig} {pid} failed");
}

/// A new directory for one start of a fixture: a start that failed half-way
/// leaves its directory (and its `nodes.conf`) behind, and a retry must not
/// load it.
fn fresh_dir(what: &str) -> PathBuf {
    static STARTS: AtomicUsize = AtomicUsize::new(0);
    let n = STARTS.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("trl-{what}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// How many times a fixture is started afresh (new ports, new directory)
/// before its test fails: a port [`free_port`] returned can be taken before
/// the server binds it.
const STARTS: usize = 3;

/// Run `start` until it succeeds, at most [`STARTS`] times; each failure is
/// printed (the test's output shows it), the last one panics.
fn start_with_retries<T>(what: &str, mut start: impl FnMut() -> Result<T, String>) -> T {
    let mut failures = Vec::new();
    for attempt in 1..=STARTS {
        match start() {
            Ok(fixture) => return fixture,
            Err(e) => {
                eprintln!(
                    "test fixture: starting the {what} failed (attempt {attempt} of {STARTS}): {e}"
                );
                failures.push(e);
            }
        }
    }
    panic!("could not start the {what} in {STARTS} attempts: {failures:?}");
}

fn base_args(port: u16, dir: &Path) -> Vec<String> {
    [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        dir.to_str().unwrap(),
        "--logfile",
        dir.join("log").to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

// ---------------------------------------------------------------- cluster

/// CRC16/XMODEM, as Redis Cluster uses for key slots.
pub fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The cluster slot of `key`, honouring `{hash tags}`.
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&c| c == b'{').and_then(|s| {
        let rest = &key[s + 1..];
        rest.iter()
            .position(|&c| c == b'}')
            .filter(|&e| e > 0)
            .map(|e| &rest[..e])
    });
    crc16(tagged.unwrap_or(key)) % 16384
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub master: bool,
    pub master_id: Option<String>,
    pub failed: bool,
    pub slots: Vec<(u16, u16)>,
}

impl NodeInfo {
    pub fn owns(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(a, b)| (a..=b).contains(&slot))
    }
}

fn parse_nodes(text: &str) -> Vec<NodeInfo> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
            let flags = f[2];
            let slots = f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|a| (a, a)),
                })
                .collect();
            Some(NodeInfo {
                id: f[0].to_owned(),
                port,
                master: flags.contains("master"),
                master_id: (f[3] != "-").then(|| f[3].to_owned()),
                failed: flags.contains("fail"),
                slots,
            })
        })
        .collect()
}

/// A 3-master, 3-replica cluster, started once per test binary.
pub struct Cluster {
    /// (client port, bus port, dir) of every node.
    nodes: Vec<(u16, u16, PathBuf)>,
    down: Mutex<Vec<u16>>,
}

/// Serialises tests that change the topology (slot migration, failover)
/// against the others: take `read()` for ordinary tests, `write()` to move
/// slots or fail over.
pub static TOPOLOGY: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

static CLUSTER: OnceLock<Cluster> = OnceLock::new();

impl Cluster {
    /// The shared cluster, started on first use.
    pub fn get() -> &'static Cluster {
        CLUSTER.get_or_init(Cluster::start)
    }

    fn start() -> Cluster {
        start_with_retries("cluster", || {
            let cluster = Cluster::fresh();
            let started = cluster.try_start();
            if started.is_err() {
                for (_, _, dir) in &cluster.nodes {
                    kill_guarded(dir);
                }
            }
            started.map(|()| cluster)
        })
    }

    /// Six nodes on new ports in a new directory, not started.
    fn fresh() -> Cluster {
        let root = fresh_dir("cluster");
        let mut nodes = Vec::new();
        let mut used = Vec::new();
        for i in 0..6 {
            let (port, bus) = loop {
                let p = free_port();
                let b = free_port();
                if p != b && !used.contains(&p) && !used.contains(&b) {
                    break (p, b);
                }
            };
            used.extend([port, bus]);
            let dir = root.join(format!("n{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            nodes.push((port, bus, dir));
        }
        Cluster {
            nodes,
            down: Mutex::new(Vec::new()),
        }
    }

    fn try_start(&self) -> Result<(), String> {
        for i in 0..6 {
            self.spawn(i)?;
        }
        let addrs: Vec<String> = self
            .nodes
            .iter()
            .map(|(p, _, _)| format!("127.0.0.1:{p}"))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli on PATH");
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            ));
        }
        if !self.wait_stable(Duration::from_secs(30)) {
            return Err(format!(
                "cluster did not become stable within 30 s: {}",
                cli(self.nodes[0].0, &["CLUSTER", "NODES"])
            ));
        }
        Ok(())
    }

    fn spawn(&self, i: usize) -> Result<(), String> {
        let (port, bus, dir) = &self.nodes[i];
        let mut args = base_args(*port, dir);
        args.extend(
            [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-port",
                &bus.to_string(),
                "--cluster-node-timeout",
                "1000",
                // A replica may always take over (the failover tests want a
                // replica that missed writes to be promoted anyway).
                "--cluster-replica-validity-factor",
                "0",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        spawn_guarded(dir, *port, &args)
    }

    /// Client ports of all nodes.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.0).collect()
    }

    fn live_ports(&self) -> Vec<u16> {
        let down = self.down.lock().unwrap().clone();
        self.ports()
            .into_iter()
            .filter(|p| !down.contains(p))
            .collect()
    }

    /// `redis-cluster://` URL naming every live node.
    pub fn url(&self) -> String {
        let ports = self.live_ports();
        let others: Vec<String> = ports[1..]
            .iter()
            .map(|p| format!("node=127.0.0.1:{p}"))
            .collect();
        format!(
            "redis-cluster://127.0.0.1:{}?{}",
            ports[0],
            others.join("&")
        )
    }

    /// `CLUSTER NODES` as seen by `port`.
    pub fn nodes_seen_by(&self, port: u16) -> Vec<NodeInfo> {
        parse_nodes(&cli(port, &["CLUSTER", "NODES"]))
    }

    /// `CLUSTER NODES` from the first live node.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        self.nodes_seen_by(self.live_ports()[0])
    }

    /// Masters that serve slots (not failed).
    pub fn masters(&self) -> Vec<NodeInfo> {
        self.nodes()
            .into_iter()
            .filter(|n| n.master && !n.failed && !n.slots.is_empty())
            .collect()
    }

    /// The master serving `slot`.
    pub fn owner(&self, slot: u16) -> NodeInfo {
        self.masters()
            .into_iter()
            .find(|n| n.owns(slot))
            .unwrap_or_else(|| panic!("no master owns slot {slot}"))
    }

    /// A replica of the master `id`.
    pub fn replica_of(&self, id: &str) -> NodeInfo {
        self.nodes()
            .into_iter()
            .find(|n| !n.master && !n.failed && n.master_id.as_deref() == Some(id))
            .unwrap_or_else(|| panic!("master {id} has no replica"))
    }

    /// Stable: every live node says `cluster_state:ok`, sees 3 slot-serving
    /// masters covering all slots, and every such master has a live replica
    /// that reports its link up.
    pub fn wait_stable(&self, within: Duration) -> bool {
        wait_until(within, || {
            let live = self.live_ports();
            live.iter().all(|&p| {
                if !cli(p, &["CLUSTER", "INFO"]).contains("cluster_state:ok") {
                    return false;
                }
                let nodes = self.nodes_seen_by(p);
                let masters: Vec<&NodeInfo> = nodes
                    .iter()
                    .filter(|n| n.master && !n.failed && !n.slots.is_empty())
                    .collect();
                let covered: u32 = masters
                    .iter()
                    .flat_map(|m| m.slots.iter())
                    .map(|&(a, b)| (b - a) as u32 + 1)
                    .sum();
                masters.len() == 3
                    && covered == 16384
                    && masters.iter().all(|m| {
                        nodes.iter().any(|r| {
                            !r.failed
                                && r.master_id.as_deref() == Some(m.id.as_str())
                                && live.contains(&r.port)
                                && cli(r.port, &["INFO", "replication"])
                                    .contains("master_link_status:up")
                        })
                    })
            })
        })
    }

    /// `kill -9` the node on `port`, whose pid is `pid` (see [`pid_of`]).
    pub fn kill(&self, port: u16, pid: u32) {
        kill_pid(pid, "-KILL");
        self.down.lock().unwrap().push(port);
        assert!(
            wait_until(Duration::from_secs(5), || cli(port, &["PING"]) != "PONG"),
            "node {port} still answers after kill"
        );
    }

    /// Start the node on `port` again (it rejoins from its nodes.conf).
    pub fn restart(&self, port: u16) {
        let i = self
            .nodes
            .iter()
            .position(|n| n.0 == port)
            .expect("a cluster port");
        if let Err(e) = self.spawn(i) {
            panic!("restarting the cluster node on port {port}: {e}");
        }
        self.down.lock().unwrap().retain(|&p| p != port);
    }

    /// Number of keys matching `pattern` on the node at `port`.
    pub fn count_keys(&self, port: u16, pattern: &str) -> usize {
        let out = cli(port, &["--scan", "--pattern", pattern]);
        out.lines().filter(|l| !l.is_empty()).count()
    }
}

// ---------------------------------------------------------------- sentinel

/// One primary, one replica and three sentinels watching them as `trl`.
pub struct SentinelGroup {
    pub primary: u16,
    pub replica: u16,
    pub sentinels: Vec<u16>,
    pub name: &'static str,
}

impl SentinelGroup {
    /// Start all five processes; returns when every sentinel knows the
    /// replica and the two other sentinels (so a failover can be agreed).
    pub fn start() -> SentinelGroup {
        start_with_retries("sentinel group", || {
            let root = fresh_dir("sentinel");
            let started = SentinelGroup::try_start(&root);
            if started.is_err() {
                for dir in std::fs::read_dir(&root).into_iter().flatten().flatten() {
                    kill_guarded(&dir.path());
                }
            }
            started
        })
    }

    fn try_start(root: &Path) -> Result<SentinelGroup, String> {
        let name = "trl";
        let primary = free_port();
        let replica = loop {
            let p = free_port();
            if p != primary {
                break p;
            }
        };
        for (port, extra) in [
            (primary, vec![]),
            (
                replica,
                vec![
                    "--replicaof".to_owned(),
                    "127.0.0.1".to_owned(),
                    primary.to_string(),
                ],
            ),
        ] {
            let dir = root.join(format!("r{port}"));
            std::fs::create_dir_all(&dir).unwrap();
            let mut args = base_args(port, &dir);
            args.extend(extra);
            spawn_guarded(&dir, port, &args)?;
        }
        let mut sentinels = Vec::new();
        while sentinels.len() < 3 {
            let port = free_port();
            if [primary, replica].contains(&port) || sentinels.contains(&port) {
                continue;
            }
            let dir = root.join(format!("s{port}"));
            std::fs::create_dir_all(&dir).unwrap();
            let conf = dir.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/log\n\
                     sentinel monitor {name} 127.0.0.1 {primary} 2\n\
                     sentinel down-after-milliseconds {name} 500\n\
                     sentinel failover-timeout {name} 1000\n\
                     sentinel parallel-syncs {name} 1\n",
                    dir = dir.display()
                ),
            )
            .unwrap();
            spawn_guarded(
                &dir,
                port,
                &[conf.to_str().unwrap().to_owned(), "--sentinel".to_owned()],
            )?;
            sentinels.push(port);
        }
        let group = SentinelGroup {
            primary,
            replica,
            sentinels,
            name,
        };
        let discovered = wait_until(Duration::from_secs(20), || {
            group.sentinels.iter().all(|&s| {
                let replicas = cli(s, &["SENTINEL", "REPLICAS", name]);
                let others = cli(s, &["SENTINEL", "SENTINELS", name]);
                replicas.contains(&replica.to_string())
                    && group
                        .sentinels
                        .iter()
                        .filter(|&&o| o != s)
                        .all(|o| others.contains(&o.to_string()))
            })
        });
        if !discovered {
            return Err("sentinels did not discover the replica and each other within 20 s".into());
        }
        Ok(group)
    }

    /// `redis-sentinel://` URL naming all three sentinels.
    pub fn url(&self) -> String {
        format!(
            "redis-sentinel://127.0.0.1:{}?node=127.0.0.1:{}&node=127.0.0.1:{}&sentinelServiceName={}",
            self.sentinels[0], self.sentinels[1], self.sentinels[2], self.name
        )
    }

    /// The primary's port according to the first sentinel that answers.
    pub fn current_primary(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|&s| {
            let out = cli(s, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name]);
            out.lines().nth(1)?.trim().parse().ok()
        })
    }
}
