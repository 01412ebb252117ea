//! The builder: the store's settings, then a connection (one multiplexed connection, a
//! Redis Cluster, or one the caller made).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;

use super::deny_cache::DenyCache;
use super::{Backend, Front, Inner, RedisStore, Scripts, Sentinel};
use crate::clock::{Clock, MonotonicClock};
use crate::error::ConfigError;
use crate::store::CircuitBreaker;
use crate::store::breaker::{DEFAULT_COOL_DOWN, DEFAULT_THRESHOLD, check_share, check_threshold};
use crate::{StoreError, StoreErrorKind};

/// The default per-call timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);
/// The default capacity of the local deny cache.
const DEFAULT_DENY_CACHE: usize = 65_536;

/// Builds a [`RedisStore`].
#[must_use]
pub struct RedisStoreBuilder {
    prefix: String,
    timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
    grace: Duration,
    deny_cache: usize,
    /// Failures in a row that open the breaker, and how long it stays open; `None`: no
    /// breaker.
    breaker: Option<(u32, Duration)>,
    /// The share of each quota the local fallback gives this node; `None`: no fallback.
    fallback_share: Option<f64>,
    /// Time without a reply that declares a stall; `None`: no stall detection.
    stall_after: Option<Duration>,
    #[cfg(feature = "tls")]
    tls_root: Option<Vec<u8>>,
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("RedisStoreBuilder");
        s.field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("caller_time", &self.clock.is_some())
            .field("breaker", &self.breaker)
            .field("local_fallback", &self.fallback_share)
            .field("stall_after", &self.stall_after);
        #[cfg(feature = "tls")]
        s.field("tls_root_certificate", &self.tls_root.is_some());
        s.finish()
    }
}

impl RedisStoreBuilder {
    /// The defaults, as [`RedisStore::builder`] gives them.
    pub(super) fn new() -> Self {
        RedisStoreBuilder {
            prefix: "tollway".to_owned(),
            timeout: DEFAULT_TIMEOUT,
            clock: None,
            grace: Duration::ZERO,
            deny_cache: DEFAULT_DENY_CACHE,
            breaker: Some((DEFAULT_THRESHOLD, DEFAULT_COOL_DOWN)),
            fallback_share: Some(1.0),
            stall_after: Some(super::stall::DEFAULT_STALL_AFTER),
            #[cfg(feature = "tls")]
            tls_root: None,
        }
    }

    /// The first part of every key (default `tollway`): `A-Z a-z 0-9 _ - . :`, at most
    /// 64 bytes.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long a call may take (default 100 ms). A call that takes longer fails with
    /// a [`StoreError`]. A new connection must be made within it.
    ///
    /// With the stall watch on (the default, [`stall_after`](Self::stall_after)), on the
    /// store's own connections, Redis's silence decides instead: a call fails when Redis
    /// owes a reply and sends nothing for `stall_after`. While Redis keeps answering (a
    /// loaded Redis reaching the call in turn, or a busy process reading late), a call
    /// waits up to ten times `timeout`: it is decided exactly, not handed to the
    /// fallback.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Passes `clock`'s time to the scripts instead of reading the server's `TIME`.
    ///
    /// Every node must then count from the same origin. Use [`crate::SystemClock`], or a
    /// manual clock in tests. Skew between nodes moves their decisions.
    ///
    /// The repository's `tests/redis` (`clock_skew_...`) measures this. Two gateways
    /// 500 ms apart send 600 requests over 3 s at 10 per second. They admit, against
    /// agreeing clocks:
    ///
    /// | algorithm | skewed | admitted, skewed for agreeing |
    /// |---|---|---|
    /// | the buckets, GCRA, the fixed window | one more | 40 for 39; 41 for 40 |
    /// | the sliding log | five more | 35 for 30 |
    /// | the sliding counter | five fewer | 30 for 35 |
    ///
    /// That is skew spread over a steady load. A burst costs more. Gateways 250 ms
    /// behind and ahead, each sending a burst 100 ms before a window's end, admit of a
    /// limit of 300 a second (`tests/redis`, `skewed_caller_clocks_...`):
    ///
    /// | algorithm | skewed (500 ms apart) | what it costs |
    /// |---|---|---|
    /// | the fixed window | 600 | two windows at once: the one behind fills the window that ends, the one ahead the next |
    /// | the token bucket, GCRA | 450, 449 | the skew times the rate |
    /// | the sliding counter | 345 | the previous window, weighed for the skew less |
    /// | the sliding log | 300 | nothing |
    ///
    /// Leases do not change this: a loan is debited on the clock of the gateway that
    /// asks. Keep clocks synchronised well within the period, or keep the default
    /// (server time), where skew costs nothing. Redis expires keys by its own clock. So keys live a little longer than
    /// their state needs: see [`RedisStoreBuilder::grace`], default 1 s in this mode.
    pub fn caller_time(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        if self.grace.is_zero() {
            self.grace = Duration::from_secs(1);
        }
        self
    }

    /// Remembers up to `entries` unit-cost denials, and answers them locally until they
    /// expire. The default is 65,536. 0 turns the cache off.
    ///
    /// Its answers are the ones Redis would give, and it never admits anything. So it is
    /// on by default. A flood from one key then costs Redis about one call per node per
    /// retry period, instead of one per request.
    pub fn deny_cache(mut self, entries: usize) -> Self {
        self.deny_cache = entries;
        self
    }

    /// Extra time-to-live added to every key beyond the instant its state becomes fresh.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The breaker: after `threshold` failed calls in a row, Redis is not called for
    /// `cool_down`. Then one call probes it. A failed call is a timeout or a lost
    /// connection. The default is 5 failures and 250 ms. While the breaker is open, a
    /// decision costs microseconds, not a timeout. It comes from the local fallback.
    pub fn breaker(mut self, threshold: u32, cool_down: Duration) -> Self {
        self.breaker = Some((threshold, cool_down));
        self
    }

    /// Declares Redis stalled when it has owed a reply for `after` and sent nothing
    /// (default 20 ms). Every call waiting on that connection then fails at once, to the
    /// breaker and its local fallback, instead of each waiting its timeout.
    ///
    /// The watch reads the store's socket, where the replies arrive. A loaded Redis keeps
    /// replying. A busy gateway leaves a reply unread in the socket. Connection set-up
    /// (TCP, TLS, `AUTH`) ends before a connection carries calls. None of them is a stall.
    ///
    /// `after` must exceed the round trip to Redis and its slowest script: one call that
    /// takes longer is a stall. For a Redis a region away, raise it past the round trip
    /// or turn it off ([`without_stall_detection`](Self::without_stall_detection)).
    ///
    /// It watches the connections the store makes: [`connect`](Self::connect) and
    /// [`connect_sentinel`](Self::connect_sentinel). A Redis Cluster, a pool and a
    /// `ConnectionManager` handed over have no watch: each call waits its timeout. A call
    /// sent before the stall may run when Redis comes back: its charge stands, and the
    /// fallback's is counted too.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollway_core::RedisStore;
    ///
    /// let builder = RedisStore::builder().stall_after(Duration::from_millis(50));
    /// assert!(builder.validate().is_ok());
    /// assert!(RedisStore::builder().stall_after(Duration::ZERO).validate().is_err());
    /// ```
    pub fn stall_after(mut self, after: Duration) -> Self {
        self.stall_after = Some(after);
        self
    }

    /// No stall detection: each call waits its own timeout.
    pub fn without_stall_detection(mut self) -> Self {
        self.stall_after = None;
        self
    }

    /// No breaker: every decision calls Redis, and waits for its timeout when Redis is
    /// gone.
    pub fn without_breaker(mut self) -> Self {
        self.breaker = None;
        self
    }

    /// While Redis cannot decide, decide locally, in this node's memory.
    ///
    /// Redis cannot decide after a failed call, or while the breaker is open. The node
    /// then gets `share` of each quota (0 < share <= 1). With ten gateways, use 0.1. So
    /// the fleet as a whole stays near the limit. The default is a local fallback with
    /// share 1: each node alone may admit a whole quota. That is neither wide open nor
    /// closed.
    pub fn local_fallback(mut self, share: f64) -> Self {
        self.fallback_share = Some(share);
        self
    }

    /// No local fallback: a decision Redis cannot make is an error.
    ///
    /// The layer answers it as its `on_store_error` setting says. It lets the request
    /// through (fail open, its default), or refuses it (fail closed).
    pub fn without_local_fallback(mut self) -> Self {
        self.fallback_share = None;
        self
    }

    /// Trusts only the CA certificate(s) in `pem` (PEM text), instead of the system's
    /// root certificates. This is for servers whose certificates a private CA signed.
    ///
    /// It applies to the `rediss://` URLs passed to [`RedisStoreBuilder::connect`] or
    /// [`RedisStoreBuilder::connect_cluster`]. It applies to every node the cluster's slot
    /// map names, too. A server's certificate must still be valid for its host. A URL
    /// that is not `rediss://` is refused.
    #[cfg(feature = "tls")]
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root = Some(pem.into());
        self
    }

    /// Checks the settings without connecting: what `connect` and the other builds
    /// refuse first (a limits file validates its `[store]` with it).
    ///
    /// # Errors
    ///
    /// When the prefix, timeout, breaker threshold or fallback share is one the store
    /// cannot use.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':');
        if self.prefix.is_empty() || self.prefix.len() > 64 || !self.prefix.chars().all(ok) {
            return Err(ConfigError::new(format!(
                "Redis key prefix {:?} must be 1 to 64 characters of A-Z, a-z, 0-9, '_', '-', '.', ':'",
                self.prefix
            )));
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::new(
                "Redis timeout must be more than zero: every call would fail",
            ));
        }
        if self.stall_after.is_some_and(|after| after.is_zero()) {
            return Err(ConfigError::new(
                "Redis stall_after must be more than zero: every call would be a stall; \
                 turn detection off with without_stall_detection",
            ));
        }
        if let Some((threshold, _)) = self.breaker {
            check_threshold(threshold)?;
        }
        if let Some(share) = self.fallback_share {
            check_share(share)?;
        }
        Ok(())
    }

    fn build(self, backend: Backend) -> Result<RedisStore, ConfigError> {
        let (breaker, fallback_share) = (self.breaker, self.fallback_share);
        // Only the store's own connections have a socket the watch can read.
        let stall_after = self
            .stall_after
            .filter(|_| matches!(backend, Backend::Link(_)));
        let scripts = Scripts {
            inner: Arc::new(Inner {
                prefix: self.prefix,
                timeout: self.timeout,
                grace_ms: u64::try_from(self.grace.as_millis()).unwrap_or(u64::MAX),
                deny_cache: (self.deny_cache > 0).then(|| {
                    let clock = self
                        .clock
                        .clone()
                        .unwrap_or_else(|| Arc::new(MonotonicClock::new()));
                    DenyCache::new(self.deny_cache, clock)
                }),
                clock: self.clock,
                gateway: gateway_number(),
                backend,
                stall_after,
            }),
        };
        if breaker.is_none() && fallback_share.is_none() {
            return Ok(RedisStore {
                front: Front::Scripts(scripts),
            });
        }
        let name = scripts.kind();
        let mut guarded = CircuitBreaker::builder(scripts).name(name);
        guarded = match breaker {
            Some((threshold, cool_down)) => guarded.threshold(threshold).cool_down(cool_down),
            None => guarded.without_breaker(),
        };
        if let Some(share) = fallback_share {
            guarded = guarded.local_fallback(share);
        }
        let guarded = guarded.build()?;
        if let Backend::Link(link) = &guarded.primary().inner.backend {
            link.on_new_connection(guarded.probe_hint());
        }
        Ok(RedisStore {
            front: Front::Guarded(guarded),
        })
    }

    /// Connects to `url` (`redis://[user:password@]host:port[/db]`) with one multiplexed,
    /// self-reconnecting connection. A password (with or without an ACL user name) is
    /// sent with `AUTH` on every connection, reconnections included.
    ///
    /// With the `tls` feature, `rediss://[user:password@]host:port[/db]` connects over
    /// TLS (rustls), verifying the server's certificate against the system's root
    /// certificates or the one given to [`RedisStoreBuilder::tls_root_certificate`].
    /// When the process has no default rustls crypto provider yet, `ring`'s is installed.
    ///
    /// # Errors
    ///
    /// When the prefix or timeout is invalid, or the URL cannot be parsed. When the
    /// server cannot be reached within the timeout, or refuses the credentials. With
    /// TLS, when the server presents a certificate that does not verify.
    pub async fn connect(self, url: &str) -> Result<RedisStore, StoreError> {
        use redis::IntoConnectionInfo;
        self.validate().map_err(config_error)?;
        let info = url.into_connection_info().map_err(|e| {
            StoreError::with_source(StoreErrorKind::Other, format!("bad Redis URL: {e}"), e)
        })?;
        #[cfg(feature = "tls")]
        let dial = super::link::Dial::new(&info, self.tls_root.as_deref())?;
        #[cfg(not(feature = "tls"))]
        let dial = super::link::Dial::new(&info, None)?;
        let link = tokio::time::timeout(
            self.timeout,
            super::link::Link::connect(super::link::Source::Server(dial), self.timeout),
        )
        .await
        .map_err(|_| {
            StoreError::new(
                StoreErrorKind::Timeout,
                format!("could not connect to Redis within {:?}", self.timeout),
            )
        })?
        .map_err(|e| {
            StoreError::with_source(
                StoreErrorKind::Connection,
                format!("could not connect to Redis: {e}"),
                e,
            )
        })?;
        self.build(Backend::Link(link)).map_err(config_error)
    }

    /// Connects to a Redis Cluster through any of its `nodes` (`redis://host:port` URLs).
    ///
    /// The client learns the slot map. It sends each script to the master that owns its
    /// keys. There is one hash tag per key, so never `CROSSSLOT`. It follows `MOVED` and
    /// `ASK` during resharding and failover.
    ///
    /// With the `tls` feature, `rediss://host:port` nodes are reached over TLS (every
    /// node then, the ones the slot map names too), verified as for
    /// [`RedisStoreBuilder::connect`].
    ///
    /// # Errors
    ///
    /// When the prefix or timeout is invalid, the URLs mix `redis://` and `rediss://`,
    /// or no node can be reached within the timeout.
    pub async fn connect_cluster(self, nodes: &[&str]) -> Result<RedisStore, StoreError> {
        self.validate().map_err(config_error)?;
        #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
        let mut builder = redis::cluster::ClusterClient::builder(nodes.iter().copied())
            .tcp_settings(tcp_settings())
            .connection_timeout(self.timeout)
            .response_timeout(self.timeout)
            // redis-rs sends `ASKING` and the redirected call as two writes on a shared
            // connection: another call between them takes the flag, and the importing
            // node answers `MOVED` back. Each such round costs two retries; sixteen
            // (redis-rs's default) let a reshard settle, and the timeout bounds them.
            .retries(16)
            .min_retry_wait(10)
            .max_retry_wait(100);
        #[cfg(feature = "tls")]
        {
            let (mut any_tls, mut all_tls) = (false, true);
            for node in nodes {
                let tls = matches!(
                    redis::IntoConnectionInfo::into_connection_info(*node)
                        .map_err(|e| StoreError::with_source(
                            StoreErrorKind::Other,
                            format!("bad Redis URL: {e}"),
                            e
                        ))?
                        .addr(),
                    redis::ConnectionAddr::TcpTls { .. }
                );
                any_tls |= tls;
                all_tls &= tls;
            }
            if any_tls {
                ensure_crypto_provider();
            }
            if let Some(root) = &self.tls_root {
                if !all_tls {
                    return Err(StoreError::new(
                        StoreErrorKind::Other,
                        "a TLS root certificate was given, but not every Redis Cluster node \
                         URL is rediss://: use rediss:// for all, or leave out \
                         tls_root_certificate",
                    ));
                }
                builder = builder.certs(redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root.clone()),
                });
            }
        }
        let client = builder.build().map_err(|e| {
            StoreError::with_source(
                StoreErrorKind::Other,
                format!("bad Redis Cluster nodes: {e}"),
                e,
            )
        })?;
        let connection = tokio::time::timeout(self.timeout, client.get_async_connection())
            .await
            .map_err(|_| {
                StoreError::new(
                    StoreErrorKind::Timeout,
                    format!(
                        "could not connect to the Redis Cluster within {:?}",
                        self.timeout
                    ),
                )
            })?
            .map_err(|e| {
                StoreError::with_source(
                    StoreErrorKind::Connection,
                    format!("could not connect to the Redis Cluster: {e}"),
                    e,
                )
            })?;
        self.build(Backend::Cluster(connection))
            .map_err(config_error)
    }

    /// Connects to the primary that Redis Sentinel names, and follows it.
    ///
    /// The store asks the sentinels for the primary, in the order given, and checks
    /// with `ROLE` that the server it names is one. It asks again when the connection
    /// breaks, when the server answers `READONLY` (a demoted primary), and at once when
    /// a sentinel announces `+promoted-slave` or `+switch-master` (it listens to one
    /// sentinel at a time while the store lives). A call that may be repeated is sent once more to the new
    /// primary, within its timeout.
    ///
    /// Until the sentinels agree on a new primary, calls fail: the breaker and its local
    /// fallback decide, as for a dead Redis. The store's breaker probes as soon as the
    /// store has the new primary, not after its cool-down. What a failover can cost is in the
    /// repository's `SECURITY.md` and `BENCHMARKS.md` ("Fleet and outages").
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tollway_core::{RedisStore, Sentinel};
    ///
    /// let sentinel = Sentinel::new("checkout", ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379"])
    ///     .password(std::env::var("REDIS_PASSWORD")?);
    /// let store = RedisStore::builder().connect_sentinel(&sentinel).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// When the settings are invalid (an empty master name, no sentinel, a bad URL).
    /// When no sentinel names a primary within the timeout, or the primary refuses the
    /// login.
    pub async fn connect_sentinel(self, sentinel: &Sentinel) -> Result<RedisStore, StoreError> {
        self.validate().map_err(config_error)?;
        let resolver = sentinel.resolver(
            &tcp_settings(),
            #[cfg(feature = "tls")]
            self.tls_root.as_deref(),
        )?;
        let followed = tokio::time::timeout(
            self.timeout,
            super::link::Link::connect(super::link::Source::Sentinel(resolver), self.timeout),
        )
        .await
        .map_err(|_| {
            StoreError::new(
                StoreErrorKind::Timeout,
                format!(
                    "no primary found through Redis Sentinel within {:?}",
                    self.timeout
                ),
            )
        })?
        .map_err(|e| {
            StoreError::with_source(
                StoreErrorKind::Connection,
                format!("no primary found through Redis Sentinel: {e}"),
                e,
            )
        })?;
        self.build(Backend::Link(followed)).map_err(config_error)
    }

    /// Uses an existing redis-rs `ConnectionManager`.
    ///
    /// # Errors
    ///
    /// When the prefix or timeout is invalid.
    pub fn with_connection_manager(
        self,
        manager: ConnectionManager,
    ) -> Result<RedisStore, ConfigError> {
        self.validate()?;
        self.build(Backend::Manager(manager))
    }

    /// Uses an existing deadpool-redis pool: each decision checks out a connection.
    ///
    /// # Errors
    ///
    /// When the prefix or timeout is invalid.
    #[cfg(feature = "deadpool")]
    pub fn with_pool(self, pool: deadpool_redis::Pool) -> Result<RedisStore, ConfigError> {
        self.validate()?;
        self.build(Backend::Pool(pool))
    }
}

/// The client for `info`; over TLS, trusting `root` (PEM) when given, else the system's
/// roots.
pub(super) fn client_of(
    info: redis::ConnectionInfo,
    root: Option<&[u8]>,
) -> Result<redis::Client, StoreError> {
    #[cfg(feature = "tls")]
    if let Some(root) = root {
        ensure_crypto_provider();
        let certificates = redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(root.to_vec()),
        };
        return redis::Client::build_with_tls(info, certificates).map_err(|e| {
            StoreError::with_source(
                StoreErrorKind::Other,
                format!("bad Redis URL or TLS root certificate: {e}"),
                e,
            )
        });
    }
    #[cfg(not(feature = "tls"))]
    let _ = root;
    let client = redis::Client::open(info).map_err(|e| {
        StoreError::with_source(StoreErrorKind::Other, format!("bad Redis URL: {e}"), e)
    })?;
    #[cfg(feature = "tls")]
    if matches!(
        client.get_connection_info().addr(),
        redis::ConnectionAddr::TcpTls { .. }
    ) {
        ensure_crypto_provider();
    }
    Ok(client)
}

/// Makes sure rustls has a process-wide crypto provider before redis-rs builds its TLS
/// configuration (which panics without one): `ring`'s, unless the application already
/// installed its own.
#[cfg(feature = "tls")]
pub(super) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may install one first: either way there is one, which is all
        // that matters here.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// The store's connections send each call at once (`TCP_NODELAY`).
///
/// Calls are small and pipelined on one connection. Nagle's algorithm is redis-rs's
/// default. With it, a call made while another's reply is on its way waits for that
/// reply's acknowledgement. On a network with delayed acknowledgements, that is tens of
/// milliseconds. The repository's `BENCHMARKS.md` has the measured cost. Connections a user hands over
/// (`with_manager`, a pool) keep their own setting.
fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

/// A setting the builder refused, as the error of a `connect`.
fn config_error(e: ConfigError) -> StoreError {
    StoreError::with_source(StoreErrorKind::Other, e.to_string(), e)
}

/// A number no other gateway sharing Redis is likely to have: random, below 2^52 (exact
/// in the scripts' doubles).
fn gateway_number() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static MADE: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u64(MADE.fetch_add(1, Ordering::Relaxed));
    hasher.finish() & ((1 << 52) - 1)
}
