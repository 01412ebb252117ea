//! A local Redis Cluster: six `redis-server` processes on free loopback ports, three
//! masters with one replica each, joined by `redis-cli --cluster create`; stopped on drop.
//!
//! Or the same cluster speaking only TLS: to clients, between replicas and masters, and
//! on the cluster bus.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

use crate::redis::{RedisServer, TlsFiles, free_port};

/// The one cluster of this test binary, started by the first test that asks, for the
/// tests about the cluster that leave its nodes alone (each keeps to its own key prefix).
/// It stops when the binary ends.
pub fn shared_cluster() -> &'static RedisCluster {
    static SHARED: OnceLock<RedisCluster> = OnceLock::new();
    SHARED.get_or_init(|| {
        // Its own runtime on its own thread: the first test's runtime may be running this.
        std::thread::spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime to start the shared cluster")
                .block_on(RedisCluster::start())
        })
        .join()
        .expect("start the shared cluster")
    })
}

/// The longest the cluster may take to form, or a replica to take over.
const SETTLE: Duration = Duration::from_secs(20);
/// The pause between two looks at the cluster's state.
const POLL: Duration = Duration::from_millis(25);
/// Slots in a Redis Cluster.
const SLOTS: u32 = 16_384;

/// One line of `CLUSTER NODES`, as far as the tests need it.
#[derive(Clone, Debug)]
struct Node {
    id: String,
    /// The client port.
    port: u16,
    myself: bool,
    master: bool,
    /// Flagged `fail` or `fail?`.
    failing: bool,
    /// For a replica, its master's id.
    replica_of: Option<String>,
    /// Inclusive slot ranges it serves.
    slots: Vec<(u32, u32)>,
}

impl Node {
    fn parse(line: &str) -> Option<Node> {
        let mut fields = line.split_whitespace();
        let id = fields.next()?.to_owned();
        // `ip:port@cport[,hostname]`
        let address = fields.next()?;
        let port = address
            .split('@')
            .next()?
            .rsplit(':')
            .next()?
            .parse()
            .ok()?;
        let flags: Vec<&str> = fields.next()?.split(',').collect();
        let master_id = fields.next()?;
        // ping-sent, pong-recv, config-epoch, link-state, then the slots.
        let mut fields = fields.skip(4);
        let slots = fields
            .by_ref()
            .filter(|s| !s.starts_with('[')) // slots being migrated: none here
            .filter_map(|s| match s.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => s.parse().ok().map(|n| (n, n)),
            })
            .collect();
        Some(Node {
            id,
            port,
            myself: flags.contains(&"myself"),
            master: flags.contains(&"master"),
            failing: flags.iter().any(|f| f.starts_with("fail")),
            replica_of: (master_id != "-").then(|| master_id.to_owned()),
            slots,
        })
    }

    fn serves(&self, slot: u32) -> bool {
        self.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
    }
}

/// Three masters and three replicas on loopback, every one a [`RedisServer`].
#[derive(Debug)]
pub struct RedisCluster {
    servers: Vec<RedisServer>,
    killed: HashSet<u16>,
    /// The CA (PEM) of a TLS cluster's certificates.
    tls_ca: Option<String>,
}

impl RedisCluster {
    /// Starts six servers in cluster mode, joins them, and waits until every node says
    /// `cluster_state:ok`, all agree on who serves which slots, and every replica's link
    /// to its master is up and done syncing.
    ///
    /// # Panics
    ///
    /// When a server will not start, `redis-cli --cluster create` fails, or the cluster
    /// does not settle within 20 s.
    pub async fn start() -> Self {
        Self::start_inner(None).await
    }

    /// [`RedisCluster::start`], every node speaking only TLS with `files`' certificate:
    /// clients, replication and the cluster bus.
    pub async fn start_tls(files: &TlsFiles) -> Self {
        Self::start_inner(Some(files.clone())).await
    }

    async fn start_inner(tls: Option<TlsFiles>) -> Self {
        let tls_ca = tls.as_ref().map(|files| files.ca_cert.clone());
        let servers: Vec<RedisServer> = tokio::task::spawn_blocking(move || {
            (0..6)
                .map(|_| {
                    // The bus port is named, not left at port + 10,000: that can pass 65,535.
                    let bus = free_port().to_string();
                    let mut options = vec![
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "1000",
                        "--cluster-port",
                        &bus,
                        // A master waits this long for more replicas before a full sync
                        // (5 s by default): there is nothing to wait for here.
                        "--repl-diskless-sync-delay",
                        "0",
                    ];
                    match &tls {
                        Some(files) => {
                            options.extend(["--tls-cluster", "yes", "--tls-replication", "yes"]);
                            RedisServer::start_tls(files, &options)
                        }
                        None => RedisServer::start_with(&options),
                    }
                })
                .collect()
        })
        .await
        .unwrap();
        let addresses: Vec<String> = servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        let mut cli = tokio::process::Command::new("redis-cli");
        if let Some(ca) = servers[0].tls_ca_file() {
            cli.arg("--tls").arg("--cacert").arg(ca);
        }
        let child = cli
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Killed if the deadline below drops it.
            .kill_on_drop(true)
            .spawn()
            .expect("run redis-cli --cluster create (redis-tools)");
        // It waits for the nodes to meet for as long as it takes; a bus the nodes cannot
        // use would hang the test instead of failing it.
        let out = tokio::time::timeout(SETTLE, child.wait_with_output())
            .await
            .unwrap_or_else(|_| {
                panic!("redis-cli --cluster create did not finish within {SETTLE:?}")
            })
            .expect("read redis-cli's output");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster {
            servers,
            killed: HashSet::new(),
            tls_ca,
        };
        cluster.wait_until_settled().await;
        cluster
    }

    /// `redis://127.0.0.1:<port>` for every node, killed ones included (as a client
    /// configured with the original node list would have).
    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(RedisServer::url).collect()
    }

    fn live_ports(&self) -> Vec<u16> {
        self.servers
            .iter()
            .map(RedisServer::port)
            .filter(|p| !self.killed.contains(p))
            .collect()
    }

    /// `CLUSTER NODES` as the node on `port` sees it.
    async fn view(&self, port: u16) -> Result<Vec<Node>, String> {
        let mut con = self
            .connect(port)
            .await
            .map_err(|e| format!("{port}: {e}"))?;
        let text: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut con)
            .await
            .map_err(|e| format!("{port}: CLUSTER NODES: {e}"))?;
        Ok(text.lines().filter_map(Node::parse).collect())
    }

    /// The ports of the masters that serve slots now.
    pub async fn masters(&self) -> Vec<u16> {
        let port = self.live_ports()[0];
        let view = self.view(port).await.unwrap();
        let mut masters: Vec<u16> = view
            .iter()
            .filter(|n| n.master && !n.failing && !n.slots.is_empty())
            .map(|n| n.port)
            .collect();
        masters.sort_unstable();
        masters
    }

    /// For each Redis key, the port of the master that owns its slot (`CLUSTER KEYSLOT`,
    /// then the slot ranges of `CLUSTER NODES`).
    pub async fn masters_of(&self, keys: &[String]) -> BTreeMap<String, u16> {
        let port = self.live_ports()[0];
        let view = self.view(port).await.unwrap();
        let mut con = self.connect(port).await.unwrap();
        let mut owners = BTreeMap::new();
        for key in keys {
            let slot: u32 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(key)
                .query_async(&mut con)
                .await
                .unwrap();
            let owner = view
                .iter()
                .find(|n| n.master && !n.failing && n.serves(slot))
                .unwrap_or_else(|| panic!("no master serves slot {slot} of {key}"));
            owners.insert(key.clone(), owner.port);
        }
        owners
    }

    /// Panics unless `keys` land on every master: a test that meant to spread its
    /// callers over the cluster did.
    pub async fn assert_on_every_master(&self, keys: &[String]) {
        let masters = self.masters().await;
        assert_eq!(masters.len(), 3, "three masters serve slots: {masters:?}");
        let owners = self.masters_of(keys).await;
        let mut per_master: BTreeMap<u16, usize> = masters.iter().map(|&m| (m, 0)).collect();
        for port in owners.values() {
            *per_master.entry(*port).or_default() += 1;
        }
        assert!(
            per_master.values().all(|&n| n > 0),
            "{} keys, per master: {per_master:?}",
            keys.len()
        );
    }

    /// Kills the master on `port` (a crash: no shutdown) and waits until its replica
    /// says it is a master serving the slots and the cluster has settled again. Returns
    /// the new master's port and how long the takeover took.
    ///
    /// # Panics
    ///
    /// When `port` is not a master with a replica, or no replica takes over within 20 s.
    pub async fn kill_master(&mut self, port: u16) -> (u16, Duration) {
        let view = self.view(port).await.unwrap();
        let master = view
            .iter()
            .find(|n| n.port == port && n.master)
            .unwrap_or_else(|| panic!("{port} is not a master"))
            .clone();
        let replica = view
            .iter()
            .find(|n| n.replica_of.as_deref() == Some(&master.id))
            .unwrap_or_else(|| panic!("master {port} has no replica"))
            .port;
        let server = self.servers.iter_mut().find(|s| s.port() == port).unwrap();
        server.kill();
        self.killed.insert(port);
        let killed_at = Instant::now();
        let deadline = killed_at + SETTLE;
        loop {
            let promoted = self.view(replica).await.is_ok_and(|view| {
                view.iter()
                    .any(|n| n.myself && n.master && n.slots == master.slots)
            });
            if promoted {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "replica {replica} did not take over from {port} within {SETTLE:?}"
            );
            tokio::time::sleep(POLL).await;
        }
        self.wait_until_settled().await;
        (replica, killed_at.elapsed())
    }

    /// How many error replies of these kinds (`ASK`, `MOVED`, `TRYAGAIN`, ...) the node
    /// on `port` has sent (`INFO errorstats`).
    pub async fn error_replies(&self, port: u16, kinds: &[&str]) -> u64 {
        let mut con = self.connect(port).await.unwrap();
        let info: String = redis::cmd("INFO")
            .arg("errorstats")
            .query_async(&mut con)
            .await
            .unwrap();
        // `errorstat_ASK:count=3`
        info.lines()
            .filter_map(|line| line.strip_prefix("errorstat_")?.split_once(":count="))
            .filter(|(kind, _)| kinds.contains(kind))
            .filter_map(|(_, n)| n.trim().parse::<u64>().ok())
            .sum()
    }

    /// The slot `key` hashes to (`CLUSTER KEYSLOT`).
    pub async fn slot_of(&self, key: &str) -> u32 {
        let mut con = self.connect(self.live_ports()[0]).await.unwrap();
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query_async(&mut con)
            .await
            .unwrap()
    }

    /// Moves `slot` to the master on `to`, the way `redis-cli --cluster reshard` does:
    /// `CLUSTER SETSLOT … IMPORTING` on the target, `… MIGRATING` on the source, then
    /// `MIGRATE` one key at a time (so a caller's keys are split between the two nodes
    /// for a while, as in a batched reshard), then `CLUSTER SETSLOT … NODE` on every
    /// master, and waits until the cluster has settled. Returns how many keys moved.
    ///
    /// `before_handover` runs when every key has moved and the source still owns the
    /// slot: a request for those keys meets `ASK` until it ends.
    ///
    /// # Panics
    ///
    /// When `to` is not a master, already serves `slot`, or a step fails.
    pub async fn migrate_slot(
        &self,
        slot: u32,
        to: u16,
        before_handover: impl Future<Output = ()>,
    ) -> usize {
        let view = self.view(to).await.unwrap();
        let source = view
            .iter()
            .find(|n| n.master && !n.failing && n.serves(slot))
            .unwrap_or_else(|| panic!("no master serves slot {slot}"))
            .clone();
        let target = view
            .iter()
            .find(|n| n.port == to && n.master)
            .unwrap_or_else(|| panic!("{to} is not a master"))
            .clone();
        assert_ne!(source.port, to, "{to} already serves slot {slot}");
        let mut from = self.connect(source.port).await.unwrap();
        let mut into = self.connect(to).await.unwrap();
        let set = |state: &str, id: &str| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SETSLOT").arg(slot).arg(state).arg(id);
            cmd
        };
        let () = set("IMPORTING", &source.id)
            .query_async(&mut into)
            .await
            .unwrap();
        let () = set("MIGRATING", &target.id)
            .query_async(&mut from)
            .await
            .unwrap();
        let mut moved = 0;
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(1)
                .query_async(&mut from)
                .await
                .unwrap();
            let Some(key) = keys.first() else { break };
            let answer: String = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(to)
                .arg("")
                .arg(0)
                .arg(5_000)
                .arg("KEYS")
                .arg(key)
                .query_async(&mut from)
                .await
                .unwrap();
            assert!(
                answer == "OK" || answer == "NOKEY",
                "MIGRATE {key}: {answer}"
            );
            moved += 1;
        }
        before_handover.await;
        // The target first, so that it owns the slot before the source lets go.
        let () = set("NODE", &target.id)
            .query_async(&mut into)
            .await
            .unwrap();
        for master in view
            .iter()
            .filter(|n| n.master && !n.failing && n.port != to)
        {
            let mut con = self.connect(master.port).await.unwrap();
            let () = set("NODE", &target.id).query_async(&mut con).await.unwrap();
        }
        self.wait_until_settled().await;
        moved
    }

    async fn wait_until_settled(&self) {
        let deadline = Instant::now() + SETTLE;
        loop {
            let why = match self.settled().await {
                Ok(()) => return,
                Err(why) => why,
            };
            assert!(
                Instant::now() < deadline,
                "the cluster did not settle within {SETTLE:?}: {why}"
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// `Ok` when every live node serves queries (`cluster_state:ok`), every one sees the
    /// same live masters serving all slots and the same replicas behind them, and every
    /// live replica's link to its master is up, its copy complete.
    async fn settled(&self) -> Result<(), String> {
        let live = self.live_ports();
        let mut agreed: Option<BTreeMap<u16, String>> = None;
        for &port in &live {
            let mut con = self
                .connect(port)
                .await
                .map_err(|e| format!("{port}: {e}"))?;
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(&mut con)
                .await
                .map_err(|e| format!("{port}: CLUSTER INFO: {e}"))?;
            if !info.contains("cluster_state:ok") {
                return Err(format!("{port}: cluster_state is not ok"));
            }
            let view = self.view(port).await?;
            let port_of: HashMap<&str, u16> =
                view.iter().map(|n| (n.id.as_str(), n.port)).collect();
            // Who does what, live nodes only: "master <slots>" or "replica of <port>".
            let roles: BTreeMap<u16, String> = view
                .iter()
                .filter(|n| !self.killed.contains(&n.port))
                .map(|n| {
                    let role = match &n.replica_of {
                        Some(id) => format!("replica of {:?}", port_of.get(id.as_str())),
                        None => format!("master {:?}", n.slots),
                    };
                    (n.port, role)
                })
                .collect();
            let keys: BTreeSet<u16> = roles.keys().copied().collect();
            if keys != live.iter().copied().collect() {
                return Err(format!("{port} knows {keys:?}, live are {live:?}"));
            }
            let served: u32 = view
                .iter()
                .filter(|n| n.master && !self.killed.contains(&n.port))
                .flat_map(|n| n.slots.iter().map(|(a, b)| b - a + 1))
                .sum();
            if served != SLOTS {
                return Err(format!("{port}: live masters serve {served} slots"));
            }
            match &agreed {
                Some(first) if *first != roles => {
                    return Err(format!("{port} sees {roles:?}, another {first:?}"));
                }
                Some(_) => {}
                None => agreed = Some(roles),
            }
            let me = view
                .iter()
                .find(|n| n.myself)
                .ok_or(format!("{port}: no myself line"))?;
            if me.replica_of.is_some() {
                let replication: String = redis::cmd("INFO")
                    .arg("replication")
                    .query_async(&mut con)
                    .await
                    .map_err(|e| format!("{port}: INFO replication: {e}"))?;
                if !replication.contains("master_link_status:up")
                    || !replication.contains("master_sync_in_progress:0")
                {
                    return Err(format!("replica {port} is not in sync yet"));
                }
            }
        }
        Ok(())
    }

    /// An admin connection to the node on `port`, over TLS to a TLS cluster.
    async fn connect(&self, port: u16) -> redis::RedisResult<MultiplexedConnection> {
        let client = match &self.tls_ca {
            Some(ca) => {
                // redis-rs needs a process-wide rustls crypto provider; another test may
                // have installed it first.
                let _ = rustls::crypto::ring::default_provider().install_default();
                let certificates = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(ca.as_bytes().to_vec()),
                };
                redis::Client::build_with_tls(format!("rediss://127.0.0.1:{port}"), certificates)?
            }
            None => redis::Client::open(format!("redis://127.0.0.1:{port}"))?,
        };
        client.get_multiplexed_async_connection().await
    }
}
