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
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, IntoConnectionInfo, RedisError};
use tokio::sync::{Mutex, oneshot};

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
        Ok(Resolver {
            master: self.master.clone(),
            sentinels,
            login,
            tls: self.tls,
            tcp: tcp.clone(),
            root: root.map(<[u8]>::to_vec),
        })
    }
}

/// Asks the sentinels for the primary, and connects to it.
pub(super) struct Resolver {
    master: String,
    sentinels: Vec<redis::Client>,
    /// The primary's login and database.
    login: redis::RedisConnectionInfo,
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    tls: bool,
    tcp: redis::io::tcp::TcpSettings,
    root: Option<Vec<u8>>,
}

impl Resolver {
    /// A connection to the primary the first sentinel that answers names
    /// (`SENTINEL GET-MASTER-ADDR-BY-NAME`: the promoted replica as soon as a failover
    /// promoted it), once `ROLE` says it is one.
    async fn primary(
        &self,
        config: &AsyncConnectionConfig,
    ) -> Result<MultiplexedConnection, RedisError> {
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
    ) -> Result<MultiplexedConnection, RedisError> {
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
        let mut primary = self.open(host, port, config).await?;
        if !is_primary(&mut primary).await? {
            return Err(RedisError::from((
                redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
                "the server the sentinel names as the primary is a replica",
            )));
        }
        Ok(primary)
    }

    /// A connection to the server at `host:port`, with the primary's login.
    async fn open(
        &self,
        host: String,
        port: u16,
        config: &AsyncConnectionConfig,
    ) -> Result<MultiplexedConnection, RedisError> {
        #[cfg(feature = "tls")]
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
        #[cfg(not(feature = "tls"))]
        let addr = redis::ConnectionAddr::Tcp(host, port);
        let info = addr
            .into_connection_info()?
            .set_redis_settings(self.login.clone())
            .set_tcp_settings(self.tcp.clone());
        let client = super::builder::client_of(info, self.root.as_deref()).map_err(|e| {
            RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "bad primary address",
                e.to_string(),
            ))
        })?;
        client
            .get_multiplexed_async_connection_with_config(config)
            .await
    }
}

/// Whether `ROLE` on `connection` says its server is a primary.
async fn is_primary(connection: &mut MultiplexedConnection) -> Result<bool, RedisError> {
    let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(connection).await?;
    Ok(role.first() == Some(&redis::Value::BulkString(b"master".to_vec())))
}

/// The primary as the sentinels last named it, and the way to ask them again.
pub(super) struct Followed {
    resolver: Resolver,
    /// Held by the one caller asking the sentinels.
    asking: Mutex<()>,
    current: RwLock<Current>,
    config: AsyncConnectionConfig,
    /// The most the watch's own calls take.
    timeout: Duration,
    /// Told each time a new primary is in hand (the breaker's hint to probe).
    on_new_primary: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Dropped with the store: ends its watch.
    _closed: oneshot::Sender<()>,
}

/// The connection to the primary, and how many the store has made.
struct Current {
    generation: u64,
    connection: Option<MultiplexedConnection>,
}

impl Followed {
    /// Follows the primary `resolver` finds, with connections that give up after
    /// `timeout`; a task listens to the sentinels' failovers while the store lives.
    pub(super) async fn connect(
        resolver: Resolver,
        timeout: Duration,
    ) -> Result<Arc<Self>, RedisError> {
        let (closed, on_close) = oneshot::channel();
        let followed = Arc::new(Followed {
            resolver,
            asking: Mutex::new(()),
            current: RwLock::new(Current {
                generation: 0,
                connection: None,
            }),
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout)),
            timeout,
            on_new_primary: std::sync::OnceLock::new(),
            _closed: closed,
        });
        followed.connection().await?;
        tokio::spawn(watch(Arc::downgrade(&followed), on_close));
        Ok(followed)
    }

    /// The connection to the primary and its generation: the one in hand, or a new one to
    /// the primary the sentinels name now.
    pub(super) async fn connection(&self) -> Result<(u64, MultiplexedConnection), RedisError> {
        if let Some(current) = self.in_hand() {
            return Ok(current);
        }
        let _asking = self.asking.lock().await;
        // Another caller may have found it while this one waited.
        if let Some(current) = self.in_hand() {
            return Ok(current);
        }
        let connection = self.resolver.primary(&self.config).await?;
        Ok(self.install(connection))
    }

    /// Makes `connection` the one in hand, a new generation.
    fn install(&self, connection: MultiplexedConnection) -> (u64, MultiplexedConnection) {
        let generation = {
            let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
            current.generation += 1;
            current.connection = Some(connection.clone());
            current.generation
        };
        #[cfg(feature = "metrics")]
        metrics::counter!(crate::metric::SENTINEL_RESOLVED.name).increment(1);
        if let Some(hint) = self.on_new_primary.get() {
            hint();
        }
        (generation, connection)
    }

    /// Calls `hint` each time a new primary is in hand: a breaker opened by the
    /// failover probes at once, instead of after its cool-down.
    pub(super) fn on_new_primary(&self, hint: impl Fn() + Send + Sync + 'static) {
        let _ = self.on_new_primary.set(Box::new(hint));
    }

    fn in_hand(&self) -> Option<(u64, MultiplexedConnection)> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        current
            .connection
            .clone()
            .map(|connection| (current.generation, connection))
    }

    /// Drops generation `generation`'s connection, if it is still the one in hand: the
    /// next call asks the sentinels.
    pub(super) fn forget(&self, generation: u64) {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        if current.generation == generation {
            current.connection = None;
        }
    }

    fn forget_current(&self) {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        current.connection = None;
    }
}

/// Whether `e` says the server at hand is no longer the primary, or no longer there.
pub(super) fn moved(e: &RedisError) -> bool {
    e.is_connection_dropped() || e.is_connection_refusal() || e.is_io_error() || read_only(e)
}

/// `READONLY`: the server is a replica now, and ran nothing.
pub(super) fn read_only(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
}

/// Listens to one sentinel at a time for the failovers of the store's master, until
/// the store is dropped. A switch drops the connection in hand and makes the next one.
async fn watch(followed: Weak<Followed>, mut closed: oneshot::Receiver<()>) {
    let mut first = true;
    loop {
        let Some(strong) = followed.upgrade() else {
            return;
        };
        let master = strong.resolver.master.clone();
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
async fn subscribe(followed: &Followed) -> Option<redis::aio::PubSub> {
    for sentinel in &followed.resolver.sentinels {
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

impl Followed {
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
                        let opened = self.resolver.open(host.clone(), port, &self.config);
                        replica = tokio::time::timeout(self.timeout, opened)
                            .await
                            .ok()
                            .and_then(Result::ok);
                    }
                    if let Some(connection) = &mut replica {
                        match tokio::time::timeout(self.timeout, is_primary(connection)).await {
                            Ok(Ok(true)) => {
                                self.install(connection.clone());
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
