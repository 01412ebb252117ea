//! The Redis store: every algorithm as one atomic Lua script, shared by a fleet.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use parking_lot::Mutex;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};
use sha2::{Digest, Sha256};

use crate::algorithm::Algorithm;
use crate::clock::{Clock, MonotonicClock};
use crate::error::ConfigError;
use crate::{Decision, Denial, Policy, Store, StoreError};

/// The default per-call timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);
/// The default capacity of the local deny cache.
const DEFAULT_DENY_CACHE: usize = 65_536;
/// The longest user key stored as it is; longer (or unusual) keys are hashed.
pub const MAX_LITERAL_KEY: usize = 96;

macro_rules! script {
    ($($file:literal),+ ; $entry:literal) => {
        concat!(
            include_str!("../../../../lua/prelude.lua"),
            $("\n", include_str!(concat!("../../../../lua/", $file)),)+
            "\n", $entry, "\n"
        )
    };
}

/// An algorithm's composed script: the prelude, the files it needs, its entry call.
fn source(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::TokenBucket => script!("token_bucket.lua"; "return run(token_bucket)"),
        Algorithm::LeakyBucket => {
            script!("token_bucket.lua", "gcra.lua", "leaky_bucket.lua"; "return run(leaky_meter)")
        }
        Algorithm::LeakyBucketShaper => {
            script!("token_bucket.lua", "gcra.lua", "leaky_bucket.lua"; "return run(leaky_shaper)")
        }
        Algorithm::FixedWindow => script!("fixed_window.lua"; "return run(fixed_window)"),
        Algorithm::SlidingWindowLog => script!("sliding_window_log.lua"; "return run_log()"),
        Algorithm::SlidingWindowCounter => {
            script!("sliding_window_counter.lua"; "return run(sliding_window_counter)")
        }
        Algorithm::Gcra => script!("gcra.lua"; "return run(gcra)"),
    }
}

/// Every algorithm's script with its SHA-1, computed once.
struct Scripts {
    token_bucket: Script,
    leaky_meter: Script,
    leaky_shaper: Script,
    fixed_window: Script,
    sliding_log: Script,
    sliding_counter: Script,
    gcra: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| {
    let script = |algorithm| Script::new(source(algorithm));
    Scripts {
        token_bucket: script(Algorithm::TokenBucket),
        leaky_meter: script(Algorithm::LeakyBucket),
        leaky_shaper: script(Algorithm::LeakyBucketShaper),
        fixed_window: script(Algorithm::FixedWindow),
        sliding_log: script(Algorithm::SlidingWindowLog),
        sliding_counter: script(Algorithm::SlidingWindowCounter),
        gcra: script(Algorithm::Gcra),
    }
});

/// An algorithm's script and its source.
fn script(algorithm: Algorithm) -> (&'static Script, &'static str) {
    let scripts = &*SCRIPTS;
    let script = match algorithm {
        Algorithm::TokenBucket => &scripts.token_bucket,
        Algorithm::LeakyBucket => &scripts.leaky_meter,
        Algorithm::LeakyBucketShaper => &scripts.leaky_shaper,
        Algorithm::FixedWindow => &scripts.fixed_window,
        Algorithm::SlidingWindowLog => &scripts.sliding_log,
        Algorithm::SlidingWindowCounter => &scripts.sliding_counter,
        Algorithm::Gcra => &scripts.gcra,
    };
    (script, source(algorithm))
}

/// A short, stable suffix per algorithm, so that changing a policy's algorithm never
/// reads state written by another.
fn suffix(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::TokenBucket => "tb",
        Algorithm::LeakyBucket => "lb",
        Algorithm::LeakyBucketShaper => "ls",
        Algorithm::FixedWindow => "fw",
        Algorithm::SlidingWindowLog => "sl",
        Algorithm::SlidingWindowCounter => "sc",
        Algorithm::Gcra => "gc",
    }
}

/// Limiter state in Redis, shared by every process that uses the same server and prefix.
///
/// Each decision is one `EVALSHA` of the policy's algorithm as a Lua script (the twins of
/// the Rust functions, in `lua/`), so concurrent requests from any number of nodes are
/// decided one at a time and can never over-admit. Scripts are loaded on first use and
/// reloaded transparently after `SCRIPT FLUSH`, a restart or a failover (`NOSCRIPT`).
///
/// **Time** comes from the server (`redis.call('TIME')`) by default, so clock skew
/// between gateways cannot widen a limit; [`RedisStoreBuilder::caller_time`] passes the
/// caller's clock instead, for services that reject `TIME` in scripts, and for tests.
///
/// **Keys** are `prefix:{policy:key}:alg`: the braces are a hash tag, so a script's keys
/// share a cluster slot. User keys of up to 96 bytes of `A-Z a-z 0-9 . : _ - @ + = /` are
/// kept readable; any other key (braces, spaces, binary, long) is replaced by `#` and 32
/// hex digits of its SHA-256, so a caller can neither move its key to another slot nor
/// bloat Redis with a huge key.
///
/// **Connections**: by default one multiplexed connection (a redis-rs
/// `ConnectionManager`, which reconnects by itself) pipelines every concurrent call; on
/// this machine that carried about 2.5× the calls per second of a pool that checks out a
/// connection per call. An existing `deadpool_redis::Pool` (feature `deadpool`) or
/// `ConnectionManager` is accepted too.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tollway_core::{Algorithm, Policy, Quota, RedisStore, Store};
///
/// let store = RedisStore::builder()
///     .prefix("checkout")
///     .timeout(Duration::from_millis(50))
///     .connect("redis://127.0.0.1:6379")
///     .await?;
/// let policy = Policy::new("free", Algorithm::Gcra, Quota::per_minute(100)?)?;
/// let decision = store.check(b"user-42", &policy, 1).await?;
/// println!("allowed: {}, remaining: {}", decision.is_allowed(), decision.remaining());
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Backend,
    prefix: String,
    timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
    grace_ms: u64,
    deny_cache: Option<DenyCache>,
}

/// Unit-cost denials Redis gave, answered locally until they expire.
///
/// Once Redis denies a one-unit request for a key until `T`, the key has less than one
/// unit until `T`: time only refills it, and no request of any cost can be admitted by
/// any node before then, so the key's state cannot change. Each node may therefore answer
/// the key's one-unit requests itself until `T`, and its answer is the one Redis would
/// give, field by field: remaining 0, the retry and reset times counted down. It never
/// admits anything. A flood from one key then costs Redis about one call per node per
/// retry period instead of one per request. (Counting down uses this node's clock: with
/// the server's `TIME`, local and server time differ by the call's latency, so a local
/// denial can outlast Redis's by that much.)
struct DenyCache {
    clock: Arc<dyn Clock>,
    hasher: foldhash::quality::RandomState,
    shards: Box<[Mutex<HashMap<u64, Denied>>]>,
    per_shard: usize,
}

#[derive(Clone, Copy)]
struct Denied {
    until_us: u64,
    reset_at_us: u64,
    limit: u64,
}

impl DenyCache {
    const SHARDS: usize = 16;

    fn new(capacity: usize, clock: Arc<dyn Clock>) -> Self {
        DenyCache {
            clock,
            hasher: foldhash::quality::RandomState::default(),
            shards: (0..Self::SHARDS).map(|_| Mutex::default()).collect(),
            per_shard: capacity.div_ceil(Self::SHARDS),
        }
    }

    fn slot(&self, key: &[u8], policy: &Policy) -> (u64, &Mutex<HashMap<u64, Denied>>) {
        let hash = self.hasher.hash_one((policy.id(), key));
        (hash, &self.shards[(hash as usize) % Self::SHARDS])
    }

    /// The local answer for a request, if a denial still covers it.
    fn lookup(&self, key: &[u8], policy: &Policy, cost: u32) -> Option<Decision> {
        if cost != 1 {
            return None;
        }
        let (hash, shard) = self.slot(key, policy);
        let now = self.clock.now_micros();
        let mut map = shard.lock();
        let denied = *map.get(&hash)?;
        if now >= denied.until_us {
            map.remove(&hash);
            return None;
        }
        Some(Decision::limited(
            denied.limit,
            0,
            denied.reset_at_us.saturating_sub(now),
            denied.until_us - now,
        ))
    }

    fn remember(&self, key: &[u8], policy: &Policy, cost: u32, decision: &Decision) {
        if cost != 1 || decision.denial() != Some(Denial::Limited) {
            return;
        }
        let (hash, shard) = self.slot(key, policy);
        let now = self.clock.now_micros();
        let mut map = shard.lock();
        if map.len() >= self.per_shard && !map.contains_key(&hash) {
            map.retain(|_, d| d.until_us > now);
            if map.len() >= self.per_shard {
                return;
            }
        }
        map.insert(
            hash,
            Denied {
                until_us: now + decision.retry_after_micros(),
                reset_at_us: now + decision.reset_after_micros(),
                limit: decision.limit(),
            },
        );
    }
}

enum Backend {
    Manager(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
    #[cfg(feature = "deadpool")]
    Pool(deadpool_redis::Pool),
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let backend = match self.inner.backend {
            Backend::Manager(_) => "multiplexed",
            Backend::Cluster(_) => "cluster",
            #[cfg(feature = "deadpool")]
            Backend::Pool(_) => "deadpool",
        };
        f.debug_struct("RedisStore")
            .field("backend", &backend)
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field(
                "time",
                &if self.inner.clock.is_some() {
                    "caller"
                } else {
                    "server"
                },
            )
            .finish()
    }
}

impl RedisStore {
    /// A builder: prefix, timeout, time source, then a connection.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            prefix: "tollway".to_owned(),
            timeout: DEFAULT_TIMEOUT,
            clock: None,
            grace: Duration::ZERO,
            deny_cache: DEFAULT_DENY_CACHE,
            #[cfg(feature = "tls")]
            tls_root: None,
        }
    }

    /// The SHA-1 under which `algorithm`'s script is loaded (`EVALSHA <sha> ...`), for
    /// driving it from other tools such as `redis-benchmark`. Its `KEYS` and `ARGV` are
    /// described at the top of `lua/prelude.lua`.
    #[must_use]
    pub fn script_sha(algorithm: Algorithm) -> &'static str {
        script(algorithm).0.get_hash()
    }

    /// The Redis keys holding `key`'s state under `policy`: one for every algorithm but
    /// the sliding window log, which keeps its entries and a small hash beside them.
    #[must_use]
    pub fn keys_for(&self, key: &[u8], policy: &Policy) -> Vec<String> {
        let base = format!(
            "{}:{{{}:{}}}:{}",
            self.inner.prefix,
            policy.name(),
            escape_key(key),
            suffix(policy.algorithm())
        );
        if policy.algorithm() == Algorithm::SlidingWindowLog {
            vec![format!("{base}:log"), format!("{base}:meta")]
        } else {
            vec![base]
        }
    }

    async fn eval(
        &self,
        script: (&'static Script, &'static str),
        keys: Vec<String>,
        args: [String; 7],
    ) -> Result<Vec<i64>, StoreError> {
        match &self.inner.backend {
            Backend::Manager(manager) => {
                let mut con = manager.clone();
                match invoke(script, &keys, &args, &mut con).await {
                    // A connection that broke (a restart, a failover) is reopened by the
                    // manager: one retry, within the same timeout.
                    Err(e) if e.is_connection_dropped() || e.is_io_error() => {
                        invoke(script, &keys, &args, &mut con)
                            .await
                            .map_err(redis_error)
                    }
                    other => other.map_err(redis_error),
                }
            }
            Backend::Cluster(cluster) => invoke(script, &keys, &args, &mut cluster.clone())
                .await
                .map_err(redis_error),
            #[cfg(feature = "deadpool")]
            Backend::Pool(pool) => {
                let mut con = pool
                    .get()
                    .await
                    .map_err(|e| StoreError::with_source("no Redis connection from the pool", e))?;
                invoke(script, &keys, &args, &mut con)
                    .await
                    .map_err(redis_error)
            }
        }
    }
}

/// `EVALSHA`, and on `NOSCRIPT` (after `SCRIPT FLUSH`, a restart, a failover, or a
/// cluster node that never saw the script) `EVAL` of the source, which also caches it on
/// that node: the call goes to the node that owns the keys either way.
async fn invoke(
    (script, source): (&'static Script, &'static str),
    keys: &[String],
    args: &[String; 7],
    con: &mut impl ConnectionLike,
) -> Result<Vec<i64>, RedisError> {
    let call = |command: &str, first: &str| {
        let mut cmd = redis::cmd(command);
        cmd.arg(first).arg(keys.len()).arg(keys).arg(&args[..]);
        cmd
    };
    match call("EVALSHA", script.get_hash()).query_async(con).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            call("EVAL", source).query_async(con).await
        }
        other => other,
    }
}

/// Makes sure rustls has a process-wide crypto provider before redis-rs builds its TLS
/// configuration (which panics without one): `ring`'s, unless the application already
/// installed its own.
#[cfg(feature = "tls")]
fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may install one first: either way there is one, which is all
        // that matters here.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

fn redis_error(e: RedisError) -> StoreError {
    StoreError::with_source(format!("Redis call failed: {e}"), e)
}

/// The boxed future of one Redis decision.
pub type RedisFuture = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>;

impl Store for RedisStore {
    type Future = RedisFuture;

    fn check_now(
        &self,
        key: &[u8],
        policy: &Policy,
        cost: u32,
    ) -> Option<Result<Decision, StoreError>> {
        let cache = self.inner.deny_cache.as_ref()?;
        cache.lookup(key, policy, cost).map(Ok)
    }

    fn check(&self, key: &[u8], policy: &Policy, cost: u32) -> Self::Future {
        if let Some(decision) = self
            .inner
            .deny_cache
            .as_ref()
            .and_then(|cache| cache.lookup(key, policy, cost))
        {
            return Box::pin(std::future::ready(Ok(decision)));
        }
        let this = self.clone();
        // Only a unit-cost request's denial is remembered: copy what that needs, only then.
        let remember =
            (cost == 1 && self.inner.deny_cache.is_some()).then(|| (key.to_vec(), policy.clone()));
        let keys = self.keys_for(key, policy);
        let quota = policy.quota();
        let now = self
            .inner
            .clock
            .as_ref()
            .map_or_else(String::new, |c| c.now_micros().to_string());
        let args = [
            now,
            quota.limit().to_string(),
            quota.period_micros().to_string(),
            quota.burst().to_string(),
            quota.emission_micros().to_string(),
            cost.to_string(),
            self.inner.grace_ms.to_string(),
        ];
        let script = script(policy.algorithm());
        let timeout = self.inner.timeout;
        Box::pin(async move {
            let reply = tokio::time::timeout(timeout, this.eval(script, keys, args))
                .await
                .map_err(|_| {
                    StoreError::new(format!("Redis call timed out after {timeout:?}"))
                })??;
            let decision = parse(&reply)?;
            if let (Some(cache), Some((key, policy))) = (&this.inner.deny_cache, &remember) {
                cache.remember(key, policy, cost, &decision);
            }
            Ok(decision)
        })
    }
}

fn parse(reply: &[i64]) -> Result<Decision, StoreError> {
    let field = |i: usize| reply.get(i).and_then(|&v| u64::try_from(v).ok());
    let parts = (
        field(0).and_then(|d| u8::try_from(d).ok()),
        field(1),
        field(2),
        field(3),
        field(4),
        field(5),
    );
    if let (Some(denial), Some(limit), Some(remaining), Some(reset), Some(retry), Some(delay)) =
        parts
    {
        if reply.len() == 6 {
            if let Some(d) = Decision::from_parts(denial, limit, remaining, reset, retry, delay) {
                return Ok(d);
            }
        }
    }
    Err(StoreError::new(format!(
        "Redis script replied {reply:?}, not a decision: is another version of tollway using the same prefix?"
    )))
}

/// The user key as it appears inside the hash tag: itself when short and plain, else
/// `#` and the first 128 bits of its SHA-256 in hex.
fn escape_key(key: &[u8]) -> String {
    let plain = |b: &u8| b.is_ascii_alphanumeric() || b".:_-@+=/".contains(b);
    if key.len() <= MAX_LITERAL_KEY && key.iter().all(plain) {
        // All ASCII, checked above.
        return key.iter().map(|&b| char::from(b)).collect();
    }
    let digest = Sha256::digest(key);
    let mut out = String::with_capacity(33);
    out.push('#');
    for b in &digest[..16] {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Builds a [`RedisStore`].
#[must_use]
pub struct RedisStoreBuilder {
    prefix: String,
    timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
    grace: Duration,
    deny_cache: usize,
    #[cfg(feature = "tls")]
    tls_root: Option<Vec<u8>>,
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("RedisStoreBuilder");
        s.field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("caller_time", &self.clock.is_some());
        #[cfg(feature = "tls")]
        s.field("tls_root_certificate", &self.tls_root.is_some());
        s.finish()
    }
}

impl RedisStoreBuilder {
    /// The first part of every key (default `tollway`): `A-Z a-z 0-9 _ - . :`, at most
    /// 64 bytes.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The most one decision may take, connection retry included (default 100 ms). A
    /// call that takes longer fails with a [`StoreError`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Passes `clock`'s time to the scripts instead of reading the server's `TIME`.
    ///
    /// Every node must then count from the same origin (use [`crate::SystemClock`], or a
    /// manual clock in tests), and skew between nodes widens or narrows their limits by
    /// as much. Keys live a little longer than their state needs (see
    /// [`RedisStoreBuilder::grace`], default 1 s in this mode), since Redis expires them
    /// by its own clock.
    pub fn caller_time(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        if self.grace.is_zero() {
            self.grace = Duration::from_secs(1);
        }
        self
    }

    /// Remembers up to `entries` unit-cost denials and answers them locally until they
    /// expire (default 65,536; 0 turns the cache off). Its answers are the ones Redis
    /// would give and it never admits anything, so it is on by default; a flood from one
    /// key then costs Redis about one call per node per retry period instead of one per
    /// request.
    pub fn deny_cache(mut self, entries: usize) -> Self {
        self.deny_cache = entries;
        self
    }

    /// Extra time-to-live added to every key beyond the instant its state becomes fresh.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Trusts only the CA certificate(s) in `pem` (PEM text) for the `rediss://` URLs
    /// passed to [`RedisStoreBuilder::connect`] or [`RedisStoreBuilder::connect_cluster`]
    /// (every node the cluster's slot map names, too), instead of the system's root
    /// certificates: for servers whose certificates a private CA signed. A server's
    /// certificate must still be valid for its host; a URL that is not `rediss://` is
    /// refused.
    #[cfg(feature = "tls")]
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root = Some(pem.into());
        self
    }

    /// The client for `url`, with the trusted CA if one was given.
    fn client(&self, url: &str) -> Result<redis::Client, StoreError> {
        #[cfg(feature = "tls")]
        if let Some(root) = &self.tls_root {
            ensure_crypto_provider();
            let certificates = redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(root.clone()),
            };
            return redis::Client::build_with_tls(url, certificates).map_err(|e| {
                StoreError::with_source(format!("bad Redis URL or TLS root certificate: {e}"), e)
            });
        }
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::with_source(format!("bad Redis URL: {e}"), e))?;
        #[cfg(feature = "tls")]
        if matches!(
            client.get_connection_info().addr(),
            redis::ConnectionAddr::TcpTls { .. }
        ) {
            ensure_crypto_provider();
        }
        Ok(client)
    }

    fn validate(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    fn build(self, backend: Backend) -> RedisStore {
        RedisStore {
            inner: Arc::new(Inner {
                backend,
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
            }),
        }
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
    /// When the prefix or timeout is invalid, the URL cannot be parsed, the server cannot
    /// be reached within the timeout, refuses the credentials, or (TLS) presents a
    /// certificate that does not verify.
    pub async fn connect(self, url: &str) -> Result<RedisStore, StoreError> {
        self.validate()
            .map_err(|e| StoreError::with_source(e.to_string(), e))?;
        let client = self.client(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout))
            .set_number_of_retries(1);
        let manager = tokio::time::timeout(
            self.timeout,
            ConnectionManager::new_with_config(client, config),
        )
        .await
        .map_err(|_| {
            StoreError::new(format!(
                "could not connect to Redis within {:?}",
                self.timeout
            ))
        })?
        .map_err(|e| StoreError::with_source(format!("could not connect to Redis: {e}"), e))?;
        Ok(self.build(Backend::Manager(manager)))
    }

    /// Connects to a Redis Cluster through any of its `nodes` (`redis://host:port` URLs):
    /// the client learns the slot map, sends each script to the master that owns its
    /// keys (one hash tag per key, so never `CROSSSLOT`), and follows `MOVED` and `ASK`
    /// during resharding and failover.
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
        self.validate()
            .map_err(|e| StoreError::with_source(e.to_string(), e))?;
        #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
        let mut builder = redis::cluster::ClusterClient::builder(nodes.iter().copied())
            .connection_timeout(self.timeout)
            .response_timeout(self.timeout)
            .retries(2)
            .min_retry_wait(10)
            .max_retry_wait(100);
        #[cfg(feature = "tls")]
        {
            let (mut any_tls, mut all_tls) = (false, true);
            for node in nodes {
                let tls = matches!(
                    redis::IntoConnectionInfo::into_connection_info(*node)
                        .map_err(|e| StoreError::with_source(format!("bad Redis URL: {e}"), e))?
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
        let client = builder
            .build()
            .map_err(|e| StoreError::with_source(format!("bad Redis Cluster nodes: {e}"), e))?;
        let connection = tokio::time::timeout(self.timeout, client.get_async_connection())
            .await
            .map_err(|_| {
                StoreError::new(format!(
                    "could not connect to the Redis Cluster within {:?}",
                    self.timeout
                ))
            })?
            .map_err(|e| {
                StoreError::with_source(format!("could not connect to the Redis Cluster: {e}"), e)
            })?;
        Ok(self.build(Backend::Cluster(connection)))
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
        Ok(self.build(Backend::Manager(manager)))
    }

    /// Uses an existing deadpool-redis pool: each decision checks out a connection.
    ///
    /// # Errors
    ///
    /// When the prefix or timeout is invalid.
    #[cfg(feature = "deadpool")]
    pub fn with_pool(self, pool: deadpool_redis::Pool) -> Result<RedisStore, ConfigError> {
        self.validate()?;
        Ok(self.build(Backend::Pool(pool)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_short_keys_stay_readable_and_others_are_hashed() {
        assert_eq!(escape_key(b"203.0.113.7"), "203.0.113.7");
        assert_eq!(escape_key(b"2001:db8::/64"), "2001:db8::/64");
        let braces = escape_key(b"x}{other-slot");
        assert!(braces.starts_with('#') && braces.len() == 33, "{braces}");
        let long = escape_key(&[b'a'; 10_000]);
        assert_eq!(long.len(), 33);
        assert_ne!(escape_key(b"a b"), escape_key(b"a  b"));
    }

    #[test]
    fn every_algorithm_has_its_own_script() {
        let shas: std::collections::HashSet<_> = Algorithm::ALL
            .iter()
            .map(|a| script(*a).0.get_hash())
            .collect();
        assert_eq!(shas.len(), Algorithm::ALL.len());
    }
}
