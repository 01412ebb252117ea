//! Redis through Sentinel: the primary the sentinels name, found again after a failover.
//!
//! The store keeps one multiplexed connection to the primary. It asks the sentinels
//! again when that connection breaks, when the server answers `READONLY` (a primary
//! demoted to a replica), and when a sentinel announces a failover. The first caller
//! that sees the failure asks; the others wait for its answer.
//!
//! A failover asked for (`SENTINEL FAILOVER`) leaves the old primary taking writes until
//! it is demoted, and the sentinels name the new one only after their next look at it,
//! about a second later. Those writes are lost. So when a sentinel announces that it
//! will send `REPLICAOF NO ONE` to a replica (`+failover-state-send-slaveof-noone`), the
//! store asks that replica every 2 ms whether it is a primary yet, and moves to it at
//! the first yes. Until then the old primary serves, and its writes still reach the
//! replica; after, only the writes of those last milliseconds can be lost.

use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, IntoConnectionInfo, RedisError};
use tokio::sync::oneshot;

use super::link::{Dial, Link};
use super::stall::Pulse;
use crate::{StoreError, StoreErrorKind};

/// How long the watch waits before subscribing again to a sentinel that went away.
const RESUBSCRIBE_AFTER: Duration = Duration::from_millis(500);
/// How long the watch waits for an announced promotion to happen; the sentinels'
/// `+promoted-slave` or `+switch-master` settles it anyway.
const PROMOTION_AT_MOST: Duration = Duration::from_secs(10);
/// How often the watch asks a replica being promoted whether it is a primary yet.
const PROMOTION_POLL: Duration = Duration::from_millis(2);

/// Where a Redis primary watched by Sentinel is found, and how to log in to it:
/// what [`RedisStoreBuilder::connect_sentinel`](super::RedisStoreBuilder::connect_sentinel)
/// takes.
///
/// The sentinels' URLs carry their own login (`redis://[user:password@]host:port`) and
/// TLS (`rediss://`, feature `tls`). The primary's login, database and TLS are set
/// here: they apply to whichever server the sentinels name. The password is never
/// printed, not even by `Debug`.
///
/// ```
/// use tollway_core::Sentinel;
///
/// let sentinel = Sentinel::new(
///     "checkout",
///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
/// )
/// .password("s3cret")
/// .db(1);
/// assert!(!format!("{sentinel:?}").contains("s3cret"));
/// ```
#[derive(Clone)]
pub struct Sentinel {
    master: String,
    nodes: Vec<String>,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    tls: bool,
}

impl fmt::Debug for Sentinel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A sentinel's URL may hold its password: only the host and port are shown.
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|node| match node.clone().into_connection_info() {
                Ok(info) => info.addr().to_string(),
                Err(_) => "<bad URL>".to_owned(),
            })
            .collect();
        f.debug_struct("Sentinel")
            .field("master", &self.master)
            .field("nodes", &nodes)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("db", &self.db)
            .field("tls", &self.tls)
            .finish()
    }
}

impl Sentinel {
    /// The primary the sentinels at `nodes` (`redis://host:port` URLs) know as `master`.
    pub fn new(
        master: impl Into<String>,
        nodes: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Sentinel {
            master: master.into(),
            nodes: nodes.into_iter().map(Into::into).collect(),
            username: None,
            password: None,
            db: 0,
            tls: false,
        }
    }

    /// The primary's ACL user name (default none: the `default` user).
    #[must_use]
    pub fn username(mut self, username: impl Into<String>) -> Self {
        self.username = Some(username.into());
        self
    }

    /// The primary's password (`requirepass`, or the ACL user's).
    #[must_use]
    pub fn password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// The database number on the primary (default 0).
    #[must_use]
    pub fn db(mut self, db: i64) -> Self {
        self.db = db;
        self
    }

    /// Reaches the primary over TLS, verified as for a `rediss://` URL: against the
    /// system's roots, or the builder's
    /// [`tls_root_certificate`](super::RedisStoreBuilder::tls_root_certificate). The
    /// certificate must be valid for the address the sentinels announce. TLS to the
    /// sentinels themselves is asked by `rediss://` in their URLs. Both need the `tls`
    /// feature: without it, connecting fails and says so.
    #[must_use]
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// The clients that ask the sentinels for the primary, and connect to it.
    pub(super) fn resolver(
        &self,
        tcp: &redis::io::tcp::TcpSettings,
        #[cfg(feature = "tls")] root: Option<&[u8]>,
    ) -> Result<Resolver, StoreError> {
        let bad = |what: &'static str| StoreError::new(StoreErrorKind::Other, what);
        #[cfg(not(feature = "tls"))]
        let root: Option<&[u8]> = None;
        #[cfg(not(feature = "tls"))]
        if self.tls {
            return Err(bad(
                "TLS to the primary needs tollway-core's `tls` feature, which this build does not have",
            ));
        }
        if self.master.is_empty() {
            return Err(bad(
                "the Sentinel master name is empty: write the name the sentinels monitor",
            ));
        }
        if self.nodes.is_empty() {
            return Err(bad("no sentinel given: name at least one sentinel's URL"));
        }
        let mut sentinels = Vec::with_capacity(self.nodes.len());
        for node in &self.nodes {
            let info = node.clone().into_connection_info().map_err(|e| {
                StoreError::with_source(StoreErrorKind::Other, format!("bad Sentinel URL: {e}"), e)
            })?;
            sentinels.push(super::builder::client_of(
                info.set_tcp_settings(tcp.clone()),
                root,
            )?);
        }
        let mut login = redis::RedisConnectionInfo::default().set_db(self.db);
        if let Some(username) = &self.username {
            login = login.set_username(username);
        }
        if let Some(password) = &self.password {
            login = login.set_password(password);
        }
        // The address is a placeholder: each sentinel's answer gives the real one.
        let (host, port) = (String::from("0.0.0.0"), 0);
        let addr = if self.tls {
            redis::ConnectionAddr::TcpTls {
                host,
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            redis::ConnectionAddr::Tcp(host, port)
        };
        let info = addr
            .into_connection_info()
            .map_err(|e| StoreError::with_source(StoreErrorKind::Other, "bad Sentinel login", e))?
            .set_redis_settings(login);
        Ok(Resolver {
            master: self.master.clone(),
            sentinels,
            primary: Dial::new(&info, root.filter(|_| self.tls))?,
        })
    }
}

/// Asks the sentinels for the primary, and connects to it.
pub(super) struct Resolver {
    pub(super) master: String,
    pub(super) sentinels: Vec<redis::Client>,
    /// The primary's login, database and TLS, at whatever address a sentinel names.
    primary: Dial,
}

impl Resolver {
    /// A connection to the primary the first sentinel that answers names
    /// (`SENTINEL GET-MASTER-ADDR-BY-NAME`: the promoted replica as soon as a failover
    /// promoted it), once `ROLE` says it is one.
    pub(super) async fn primary(
        &self,
        config: &AsyncConnectionConfig,
    ) -> Result<(MultiplexedConnection, Arc<Pulse>), RedisError> {
        let mut last = None;
        for sentinel in &self.sentinels {
            match self.ask(sentinel, config).await {
                Ok(connection) => return Ok(connection),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            RedisError::from((redis::ErrorKind::InvalidClientConfig, "no sentinel given"))
        }))
    }

    async fn ask(
        &self,
        sentinel: &redis::Client,
        config: &AsyncConnectionConfig,
    ) -> Result<(MultiplexedConnection, Arc<Pulse>), RedisError> {
        let mut asking = sentinel
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        let named: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&self.master)
            .query_async(&mut asking)
            .await?;
        let Some((host, port)) = named else {
            return Err(RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "the sentinel monitors no primary of that name",
                self.master.clone(),
            )));
        };
        let (mut primary, pulse) = self.open(host, port, config).await?;
        if !is_primary(&mut primary).await? {
            return Err(RedisError::from((
                redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
                "the server the sentinel names as the primary is a replica",
            )));
        }
        Ok((primary, pulse))
    }

    /// A connection to the server at `host:port`, with the primary's login.
    async fn open(
        &self,
        host: String,
        port: u16,
        config: &AsyncConnectionConfig,
    ) -> Result<(MultiplexedConnection, Arc<Pulse>), RedisError> {
        self.primary.to(host, port).open(config).await
    }
}

/// Whether `ROLE` on `connection` says its server is a primary.
async fn is_primary(connection: &mut MultiplexedConnection) -> Result<bool, RedisError> {
    let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(connection).await?;
    Ok(role.first() == Some(&redis::Value::BulkString(b"master".to_vec())))
}

/// Listens to one sentinel at a time for the failovers of the store's master, until
/// the store is dropped. A switch drops the connection in hand and makes the next one.
pub(super) async fn watch(followed: Weak<Link>, mut closed: oneshot::Receiver<()>) {
    let mut first = true;
    loop {
        let Some(strong) = followed.upgrade() else {
            return;
        };
        let Some(resolver) = strong.resolver() else {
            return;
        };
        let master = resolver.master.clone();
        let subscribed = tokio::select! {
            _ = &mut closed => return,
            subscribed = subscribe(&strong) => subscribed,
        };
        if let Some(mut pubsub) = subscribed {
            // A switch missed while no sentinel was heard: ask again now.
            if !first {
                strong.forget_current();
            }
            first = false;
            drop(strong);
            let mut messages = pubsub.on_message();
            loop {
                let message = tokio::select! {
                    _ = &mut closed => return,
                    message = messages.next() => message,
                };
                let Some(message) = message else { break };
                let payload: String = message.get_payload().unwrap_or_default();
                let Some(event) = Event::of(message.get_channel_name(), &payload, &master) else {
                    continue;
                };
                let Some(strong) = followed.upgrade() else {
                    return;
                };
                strong.on(event).await;
            }
        } else {
            drop(strong);
        }
        tokio::select! {
            _ = &mut closed => return,
            () = tokio::time::sleep(RESUBSCRIBE_AFTER) => {}
        }
    }
}

/// A subscription to the failover's [`CHANNELS`] on the first sentinel that answers.
async fn subscribe(followed: &Link) -> Option<redis::aio::PubSub> {
    let resolver = followed.resolver()?;
    for sentinel in &resolver.sentinels {
        let subscribed = async {
            let mut pubsub = sentinel.get_async_pubsub().await.ok()?;
            pubsub.subscribe(&CHANNELS).await.ok()?;
            Some(pubsub)
        };
        if let Ok(Some(pubsub)) = tokio::time::timeout(followed.timeout, subscribed).await {
            return Some(pubsub);
        }
    }
    None
}

/// What a sentinel announced about the store's master.
#[derive(Debug, PartialEq, Eq)]
enum Event {
    /// A failover sends `REPLICAOF NO ONE` to this replica: it is the primary to be.
    Promoting(String, u16),
    /// The failover promoted a replica, or ended (`+switch-master`).
    Settled,
}

/// The channels the watch listens to.
const CHANNELS: [&str; 3] = [
    "+failover-state-send-slaveof-noone",
    "+promoted-slave",
    "+switch-master",
];

impl Event {
    /// The event `payload` on `channel` tells, if it is about `master`. A replica's
    /// events read `slave <ip:port> <ip> <port> @ <master> <ip> <port>`;
    /// `+switch-master` reads `<master> <old ip> <old port> <new ip> <new port>`.
    fn of(channel: &str, payload: &str, master: &str) -> Option<Event> {
        let words: Vec<&str> = payload.split(' ').collect();
        let of_replica = words.iter().position(|w| *w == "@");
        let about = match of_replica {
            Some(at) => words.get(at + 1) == Some(&master),
            None => words.first() == Some(&master),
        };
        if !about {
            return None;
        }
        if channel == "+failover-state-send-slaveof-noone" {
            let host = (*words.get(2)?).to_owned();
            let port = words.get(3)?.parse().ok()?;
            return Some(Event::Promoting(host, port));
        }
        Some(Event::Settled)
    }
}

impl Link {
    /// Follows what a sentinel announced. A replica being promoted is asked every
    /// [`PROMOTION_POLL`] whether it is a primary yet, on one connection that is used
    /// from the first yes; the
    /// old primary serves until then (its writes reach the replica until it is
    /// promoted). A settled failover drops the connection in hand and makes the next.
    async fn on(&self, event: Event) {
        match event {
            Event::Promoting(host, port) => {
                let deadline = tokio::time::Instant::now() + PROMOTION_AT_MOST;
                let mut replica = None;
                while tokio::time::Instant::now() < deadline {
                    if replica.is_none() {
                        let Some(resolver) = self.resolver() else {
                            return;
                        };
                        let opened = resolver.open(host.clone(), port, &self.config);
                        replica = tokio::time::timeout(self.timeout, opened)
                            .await
                            .ok()
                            .and_then(Result::ok);
                    }
                    if let Some((connection, pulse)) = &mut replica {
                        match tokio::time::timeout(self.timeout, is_primary(connection)).await {
                            Ok(Ok(true)) => {
                                self.install(connection.clone(), Arc::clone(pulse));
                                return;
                            }
                            Ok(Ok(false)) => {}
                            // Opened again on the next round.
                            _ => replica = None,
                        }
                    }
                    tokio::time::sleep(PROMOTION_POLL).await;
                }
            }
            Event::Settled => {
                self.forget_current();
                let _ = tokio::time::timeout(self.timeout, self.connection()).await;
            }
        }
    }
}
