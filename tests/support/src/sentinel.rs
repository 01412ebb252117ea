//! Redis Sentinel, real: a primary, two replicas and three sentinels on loopback.
//!
//! The sentinels judge a primary down after 1 s without an answer, and two of three
//! must agree. [`SentinelGroup::start`] returns once every sentinel knows both replicas
//! and the other two sentinels, so a failover can be asked for at once.

use std::time::{Duration, Instant};

use crate::RedisServer;

/// The name the sentinels monitor the primary under.
pub const MASTER: &str = "tw";

/// The longest the group may take to be ready, or a failover to finish.
const WITHIN: Duration = Duration::from_secs(60);

/// A primary and two replicas (in `servers`, the first one started as the primary) and
/// three sentinels watching them.
#[derive(Debug)]
pub struct SentinelGroup {
    /// The Redis servers; which is the primary changes with failovers.
    pub servers: Vec<RedisServer>,
    /// The sentinels.
    pub sentinels: Vec<RedisServer>,
    password: Option<String>,
}

impl SentinelGroup {
    /// Starts the group with no password.
    pub async fn start() -> Self {
        Self::start_with_password(None).await
    }

    /// Starts the group; with `password`, every server and every sentinel asks for it.
    pub async fn start_with_password(password: Option<&str>) -> Self {
        // A replica's first sync starts at once, not after diskless sync's 5 s wait.
        let mut auth: Vec<&str> = vec!["--repl-diskless-sync-delay", "0"];
        if let Some(password) = password {
            auth.extend(["--requirepass", password, "--masterauth", password]);
        }
        let primary = RedisServer::start_with(&auth);
        let port = primary.port().to_string();
        let mut servers = vec![primary];
        for _ in 0..2 {
            let mut options = auth.clone();
            options.extend(["--replicaof", "127.0.0.1", &port]);
            servers.push(RedisServer::start_with(&options));
        }
        let mut conf = format!(
            "sentinel resolve-hostnames no\n\
             sentinel announce-ip 127.0.0.1\n\
             sentinel monitor {MASTER} 127.0.0.1 {port} 2\n\
             sentinel down-after-milliseconds {MASTER} 1000\n\
             sentinel failover-timeout {MASTER} 5000\n\
             sentinel parallel-syncs {MASTER} 1\n"
        );
        if let Some(password) = password {
            conf.push_str(&format!(
                "sentinel auth-pass {MASTER} {password}\nrequirepass {password}\n"
            ));
        }
        let sentinels = (0..3).map(|_| RedisServer::start_sentinel(&conf)).collect();
        let group = SentinelGroup {
            servers,
            sentinels,
            password: password.map(str::to_owned),
        };
        group.wait_until_ready().await;
        group
    }

    /// The sentinels' URLs (with the password, when there is one).
    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| self.url_of(s.port()))
            .collect()
    }

    fn url_of(&self, port: u16) -> String {
        match &self.password {
            Some(password) => format!("redis://:{password}@127.0.0.1:{port}"),
            None => format!("redis://127.0.0.1:{port}"),
        }
    }

    /// A connection to the server or sentinel on `port`, logged in.
    pub async fn connection(
        &self,
        port: u16,
    ) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        redis::Client::open(self.url_of(port))?
            .get_multiplexed_async_connection()
            .await
    }

    /// What sentinel `index` says of the primary, as `SENTINEL MASTER` fields.
    async fn master_fields(&self, index: usize) -> redis::RedisResult<Vec<(String, String)>> {
        let mut con = self.connection(self.sentinels[index].port()).await?;
        let flat: Vec<String> = redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(MASTER)
            .query_async(&mut con)
            .await?;
        Ok(flat
            .chunks(2)
            .filter_map(|pair| match pair {
                [k, v] => Some((k.clone(), v.clone())),
                _ => None,
            })
            .collect())
    }

    async fn wait_until_ready(&self) {
        let deadline = Instant::now() + WITHIN;
        for replica in &self.servers[1..] {
            loop {
                if let Ok(mut con) = self.connection(replica.port()).await {
                    let info: redis::RedisResult<String> = redis::cmd("INFO")
                        .arg("replication")
                        .query_async(&mut con)
                        .await;
                    // Synced: a failover finds it up to date.
                    if info.is_ok_and(|info| info.contains("master_link_status:up")) {
                        break;
                    }
                }
                assert!(
                    Instant::now() < deadline,
                    "the replica on {} did not sync within {WITHIN:?}",
                    replica.port()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        for index in 0..self.sentinels.len() {
            loop {
                let fields = self.master_fields(index).await.unwrap_or_default();
                let field = |name: &str| {
                    fields
                        .iter()
                        .find(|(k, _)| k == name)
                        .map(|(_, v)| v.clone())
                };
                if field("num-slaves").as_deref() == Some("2")
                    && field("num-other-sentinels").as_deref() == Some("2")
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the sentinels did not see the group within {WITHIN:?}: {fields:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// The port of the primary, as the first sentinel that answers names it.
    pub async fn primary_port(&self) -> u16 {
        for sentinel in &self.sentinels {
            let Ok(mut con) = self.connection(sentinel.port()).await else {
                continue;
            };
            let named: redis::RedisResult<(String, u16)> = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(MASTER)
                .query_async(&mut con)
                .await;
            if let Ok((_, port)) = named {
                return port;
            }
        }
        panic!("no sentinel names a primary");
    }

    /// The server on `port`.
    pub fn server(&mut self, port: u16) -> &mut RedisServer {
        self.servers
            .iter_mut()
            .find(|s| s.port() == port)
            .expect("a server of the group on that port")
    }

    /// Asks a sentinel for a failover (`SENTINEL FAILOVER`), retried while it has no
    /// replica ready to promote.
    pub async fn ask_failover(&self) {
        let deadline = Instant::now() + WITHIN;
        loop {
            let mut con = self
                .connection(self.sentinels[0].port())
                .await
                .expect("connect to a sentinel");
            let answer: redis::RedisResult<String> = redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(MASTER)
                .query_async(&mut con)
                .await;
            match answer {
                Ok(_) => return,
                Err(e) if Instant::now() < deadline => {
                    // NOGOODSLAVE until a sentinel has heard from a replica lately.
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("SENTINEL FAILOVER: {e}"),
            }
        }
    }

    /// Waits until the sentinels name a primary other than `old`, and it says it is one;
    /// returns its port.
    pub async fn wait_for_new_primary(&self, old: u16) -> u16 {
        let deadline = Instant::now() + WITHIN;
        loop {
            let port = self.primary_port().await;
            if port != old
                && let Ok(mut con) = self.connection(port).await
            {
                let role: redis::RedisResult<Vec<redis::Value>> =
                    redis::cmd("ROLE").query_async(&mut con).await;
                if let Ok(role) = role
                    && role.first() == Some(&redis::Value::BulkString(b"master".to_vec()))
                {
                    return port;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no new primary within {WITHIN:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
