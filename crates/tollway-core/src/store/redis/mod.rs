//! The Redis store: every algorithm as one atomic Lua script, shared by a fleet.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use parking_lot::Mutex;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};
use sha2::{Digest, Sha256};
use smallvec::SmallVec;

use super::breaker::{DEFAULT_COOL_DOWN, DEFAULT_THRESHOLD, check_share, check_threshold};
use super::{BoxStoreFuture, BreakerState, Checked, CircuitBreaker, Operation, Store};
use crate::algorithm::Algorithm;
use crate::clock::{Clock, MonotonicClock};
use crate::error::ConfigError;
use crate::{Decision, Decisions, Denial, Policy, StoreError, StoreErrorKind};

/// The default per-call timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);
/// The default capacity of the local deny cache.
const DEFAULT_DENY_CACHE: usize = 65_536;
/// The longest user key stored as it is; longer (or unusual) keys are hashed.
pub const MAX_LITERAL_KEY: usize = 96;

/// The algorithms, as every script has them after the prelude.
macro_rules! lua_algorithms {
    () => {
        concat!(
            include_str!("../../../../../lua/token_bucket.lua"),
            "\n",
            include_str!("../../../../../lua/gcra.lua"),
            "\n",
            include_str!("../../../../../lua/leaky_bucket.lua"),
            "\n",
            include_str!("../../../../../lua/fixed_window.lua"),
            "\n",
            include_str!("../../../../../lua/sliding_window_counter.lua"),
            "\n",
            include_str!("../../../../../lua/sliding_window_log.lua"),
        )
    };
}

/// The script that decides (and peeks): the prelude, every algorithm, and the entry that
/// decides all of a request's limits (see `lua/prelude.lua` for its keys, arguments and
/// reply).
const SOURCE: &str = concat!(
    include_str!("../../../../../lua/prelude.lua"),
    "\n",
    lua_algorithms!(),
    "\n",
    include_str!("../../../../../lua/check.lua"),
);

/// The script that charges, refunds and resets: the same with `lua/operate.lua` as its
/// entry.
const OPERATE_SOURCE: &str = concat!(
    include_str!("../../../../../lua/prelude.lua"),
    "\n",
    lua_algorithms!(),
    "\n",
    include_str!("../../../../../lua/operate.lua"),
);

/// The scripts with their SHA-1s, computed once.
static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(SOURCE));
static OPERATE: LazyLock<Script> = LazyLock::new(|| Script::new(OPERATE_SOURCE));

/// The script's code for an algorithm (`ARGV` of each limit).
fn code(algorithm: Algorithm) -> u64 {
    match algorithm {
        Algorithm::TokenBucket => 1,
        Algorithm::LeakyBucket => 2,
        Algorithm::LeakyBucketShaper => 3,
        Algorithm::FixedWindow => 4,
        Algorithm::SlidingWindowLog => 5,
        Algorithm::SlidingWindowCounter => 6,
        Algorithm::Gcra => 7,
    }
}

/// Limiter state in Redis, shared by every process that uses the same server and prefix.
///
/// Each request is one `EVALSHA` of one Lua script (the twins of the Rust functions, in
/// `lua/`) that decides all of the request's limits at once, all or nothing, so
/// concurrent requests from any number of nodes are decided one at a time and can never
/// over-admit, and a request refused by one limit is charged by none. The script is
/// loaded on first use and reloaded transparently after `SCRIPT FLUSH`, a restart or a
/// failover (`NOSCRIPT`).
///
/// **Time** comes from the server (`redis.call('TIME')`) by default, so clock skew
/// between gateways cannot widen a limit; [`RedisStoreBuilder::caller_time`] passes the
/// caller's clock instead, for services that reject `TIME` in scripts, and for tests.
/// On the server's clock a key is written to expire at the instant (`PXAT`,
/// `PEXPIREAT`: Redis 6.2 or later) its state becomes equivalent to a fresh one, counted
/// from the `TIME` the script read.
///
/// **Keys** are `prefix:{key}:policy:id`, one per limit: the braces are a hash tag, so
/// all of a caller's limits share a cluster slot and one script decides them; `id` is
/// [`Policy::id`] in hex, so a changed quota or algorithm starts afresh. User keys of up
/// to 96 bytes of `A-Z a-z 0-9 . : _ - @ + = /` are kept readable; any other key
/// (braces, spaces, binary, long) is replaced by `#` and 32 hex digits of its SHA-256,
/// so a caller can neither move its key to another slot nor bloat Redis with a huge key.
///
/// **When Redis is slow or gone**, each call fails after the store's timeout (100 ms by
/// default), and a breaker built in (see [`RedisStoreBuilder::breaker`]) stops calling
/// Redis after five failures in a row, so a dead Redis costs microseconds a request,
/// not a timeout; it probes Redis again every 250 ms. Meanwhile decisions come from a
/// local fallback limiter in this node's memory, which gives the node its share of each
/// quota ([`RedisStoreBuilder::local_fallback`]): the limit still holds, neither wide
/// open nor closed. Without the fallback
/// ([`RedisStoreBuilder::without_local_fallback`]), failures are errors, which the layer
/// answers by letting requests through or refusing them, as configured.
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
/// let decisions = store.check(b"user-42", &[&policy], 1).await?;
/// println!("allowed: {}, remaining: {}", decisions.is_allowed(), decisions[0].remaining());
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    front: Front,
}

/// What a decision goes through: the scripts alone, or the scripts behind a breaker
/// and/or a local fallback.
#[derive(Clone)]
enum Front {
    Scripts(Scripts),
    Guarded(CircuitBreaker<Scripts>),
}

/// The store that runs the script: what [`RedisStore`] guards with its breaker.
#[derive(Clone)]
struct Scripts {
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

/// Refusals of unit-cost requests that Redis gave, answered locally while they hold.
///
/// Once Redis refuses a one-unit request because a limit is out of units until `T`, that
/// limit has less than one unit until `T`: time only refills it, and a request of any
/// cost can only make it emptier. The same request (same key, same limits) is therefore
/// refused until the earliest such `T` among its denying limits, by every node, and each
/// node may answer it itself until then: the denying limits' decisions are the ones Redis
/// would give, field by field (remaining 0, the retry and reset times counted down); the
/// limits that did not deny report what Redis said of them at the refusal (their reset
/// counted down, their remaining as it was then: a little low, never high). It never
/// admits anything. A flood from one key then costs Redis about one call per node per
/// retry period instead of one per request. (Counting down uses this node's clock: with
/// the server's `TIME`, local and server time differ by the call's latency, so a local
/// refusal can outlast Redis's by that much.)
struct DenyCache {
    clock: Arc<dyn Clock>,
    hasher: foldhash::quality::RandomState,
    shards: Box<[Mutex<HashMap<u64, Refused>>]>,
    per_shard: usize,
}

/// Where a request's refusal is kept: the hash of its caller's key, and of that and its
/// limits.
#[derive(Clone, Copy)]
struct DenyEntry {
    caller: u64,
    request: u64,
}

/// A refusal, kept until `until_us`.
#[derive(Clone)]
struct Refused {
    caller: u64,
    until_us: u64,
    /// Each limit's decision, its times as instants of this node's clock.
    limits: SmallVec<[Remembered; 2]>,
}

#[derive(Clone, Copy)]
struct Remembered {
    denial: Option<Denial>,
    limit: u64,
    remaining: u64,
    reset_at_us: u64,
    retry_at_us: u64,
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

    /// The entry of a request — its key and every limit's policy (which covers its
    /// quota) — if it can have one: only unit-cost requests are remembered.
    fn entry(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Option<DenyEntry> {
        if cost != 1 {
            return None;
        }
        let caller = self.hasher.hash_one(key);
        let mut hasher = self.hasher.build_hasher();
        hasher.write_u64(caller);
        for policy in policies {
            hasher.write_u64(policy.id());
        }
        Some(DenyEntry {
            caller,
            request: hasher.finish(),
        })
    }

    /// A caller's refusals all live in one shard, so that they can be forgotten together.
    fn shard(&self, caller: u64) -> &Mutex<HashMap<u64, Refused>> {
        &self.shards[(caller as usize) % Self::SHARDS]
    }

    /// Forgets every refusal of `key`'s requests (its state was changed).
    fn forget(&self, key: &[u8]) {
        let caller = self.hasher.hash_one(key);
        self.shard(caller).lock().retain(|_, r| r.caller != caller);
    }

    /// The local answer for the request of `entry`, if a refusal still covers it.
    fn lookup(&self, entry: DenyEntry) -> Option<Decisions> {
        let now = self.clock.now_micros();
        let mut map = self.shard(entry.caller).lock();
        let refused = map.get(&entry.request)?;
        if now >= refused.until_us {
            map.remove(&entry.request);
            return None;
        }
        let decisions = refused
            .limits
            .iter()
            .map(|r| {
                let reset = r.reset_at_us.saturating_sub(now);
                match r.denial {
                    None => Decision::allow(r.limit, r.remaining, reset, 0),
                    Some(Denial::Limited) => {
                        Decision::limited(r.limit, 0, reset, r.retry_at_us - now)
                    }
                    Some(denial) => Decision::refused(denial, r.limit, r.remaining, reset),
                }
            })
            .collect();
        Some(decisions)
    }

    /// Remembers the refusal of the (unit-cost) request of `entry` by limits out of
    /// units. (A unit never exceeds a capacity, which is at least 1.)
    fn remember(&self, entry: DenyEntry, decisions: &Decisions) {
        let Some(retry_us) = decisions
            .iter()
            .filter(|d| d.denial() == Some(Denial::Limited))
            .map(Decision::retry_after_micros)
            .min()
        else {
            return;
        };
        let now = self.clock.now_micros();
        let refused = Refused {
            caller: entry.caller,
            until_us: now + retry_us,
            limits: decisions
                .iter()
                .map(|d| Remembered {
                    denial: d.denial(),
                    limit: d.limit(),
                    remaining: d.remaining(),
                    reset_at_us: now + d.reset_after_micros(),
                    retry_at_us: now + d.retry_after_micros(),
                })
                .collect(),
        };
        let mut map = self.shard(entry.caller).lock();
        if map.len() >= self.per_shard && !map.contains_key(&entry.request) {
            map.retain(|_, r| r.until_us > now);
            if map.len() >= self.per_shard {
                return;
            }
        }
        map.insert(entry.request, refused);
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
        f.debug_struct("RedisStore")
            .field("scripts", self.scripts())
            .field("breaker", &self.breaker_state())
            .finish()
    }
}

impl Scripts {
    /// What the store is, as the `store` label of its metrics: `redis` (one multiplexed
    /// connection), `redis_cluster` or `redis_pool`.
    fn kind(&self) -> &'static str {
        match self.inner.backend {
            Backend::Manager(_) => "redis",
            Backend::Cluster(_) => "redis_cluster",
            #[cfg(feature = "deadpool")]
            Backend::Pool(_) => "redis_pool",
        }
    }
}

impl fmt::Debug for Scripts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("backend", &self.kind())
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
    /// A builder: prefix, timeout, time source, breaker and fallback, then a connection.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            prefix: "tollway".to_owned(),
            timeout: DEFAULT_TIMEOUT,
            clock: None,
            grace: Duration::ZERO,
            deny_cache: DEFAULT_DENY_CACHE,
            breaker: Some((DEFAULT_THRESHOLD, DEFAULT_COOL_DOWN)),
            fallback_share: Some(1.0),
            #[cfg(feature = "tls")]
            tls_root: None,
        }
    }

    /// The SHA-1 under which the script is loaded (`EVALSHA <sha> ...`), for driving it
    /// from other tools such as `redis-benchmark`. Its `KEYS`, `ARGV` and reply are
    /// described at the top of `lua/prelude.lua`.
    #[must_use]
    pub fn script_sha() -> &'static str {
        SCRIPT.get_hash()
    }

    /// The Redis key holding `key`'s state under `policy`:
    /// `prefix:{key}:policy:id`, the user key escaped or hashed.
    #[must_use]
    pub fn state_key(&self, key: &[u8], policy: &Policy) -> String {
        self.scripts().state_key(key, policy)
    }

    /// Where the store's breaker stands: closed while Redis answers, and always without
    /// a breaker.
    #[must_use]
    pub fn breaker_state(&self) -> BreakerState {
        match &self.front {
            Front::Scripts(_) => BreakerState::Closed,
            Front::Guarded(guarded) => guarded.state(),
        }
    }

    /// Decides like [`Store::check`] on the server's clock, whatever the builder chose,
    /// straight to Redis (no deny cache, breaker or fallback), and returns the time the
    /// script read from `TIME` (µs since the Unix epoch) beside the decisions.
    ///
    /// For tests that compare the scripts with the Rust functions in server-time mode: the
    /// function fed this time must decide the same. Not a stable API.
    #[doc(hidden)]
    pub async fn check_telling_time(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u32,
    ) -> Result<(Decisions, u64), StoreError> {
        let scripts = self.scripts();
        let call = scripts.call_of(key, policies, Kind::Check, cost, Time::ServerTold);
        let mut reply = scripts.run_script(&call).await?;
        let told = reply.pop().and_then(|t| u64::try_from(t).ok());
        let decisions = parse(&reply, &capacities(policies))?;
        let told = told.ok_or_else(|| {
            StoreError::new(StoreErrorKind::Script, "the script did not tell its time")
        })?;
        Ok((decisions, told))
    }

    fn scripts(&self) -> &Scripts {
        match &self.front {
            Front::Scripts(scripts) => scripts,
            Front::Guarded(guarded) => guarded.primary(),
        }
    }
}

impl Store for RedisStore {
    type Future = BoxStoreFuture;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Checked<Self::Future> {
        match &self.front {
            Front::Scripts(scripts) => scripts.check(key, policies, cost),
            Front::Guarded(guarded) => guarded.check(key, policies, cost),
        }
    }

    /// Through the breaker (see [`CircuitBreaker`]'s `operate`): a charge or drain
    /// goes to the local fallback while the breaker is open; anything else straight
    /// to Redis.
    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        match &self.front {
            Front::Scripts(scripts) => scripts.operate(key, policies, operation),
            Front::Guarded(guarded) => guarded.operate(key, policies, operation),
        }
    }
}

/// Notes in Redis, for a [`SplitStore`](crate::SplitStore): a hash a topic, under
/// `{prefix}:board:{topic}`, written with one `HSET` and given the post's expiry in the
/// same transaction (`MULTI`/`EXEC`: a reader sees a post whole or not at all, and it
/// expires), read with one `HGETALL`; both through the store's connections and within
/// its timeout.
#[cfg(feature = "regions")]
impl crate::Board for RedisStore {
    fn post(
        &self,
        topic: &str,
        notes: Vec<(Vec<u8>, u64)>,
        keep: Duration,
    ) -> crate::BoardFuture<()> {
        let scripts = self.scripts().clone();
        let key = format!("{}:board:{topic}", scripts.inner.prefix);
        let keep = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX).max(1);
        Box::pin(async move {
            if notes.is_empty() {
                return Ok(());
            }
            let mut post = redis::pipe();
            post.atomic().cmd("HSET").arg(&key);
            for (name, n) in &notes {
                post.arg(&name[..]).arg(*n);
            }
            post.ignore().cmd("PEXPIRE").arg(&key).arg(keep).ignore();
            scripts.run(Request::Pipeline(&post)).await?;
            Ok(())
        })
    }

    fn read(&self, topic: &str) -> crate::BoardFuture<Vec<(Vec<u8>, u64)>> {
        let scripts = self.scripts().clone();
        let key = format!("{}:board:{topic}", scripts.inner.prefix);
        Box::pin(async move {
            let mut hgetall = redis::cmd("HGETALL");
            hgetall.arg(&key);
            let reply = scripts.run(Request::Command(&hgetall)).await?;
            let notes: HashMap<Vec<u8>, u64> =
                redis::from_redis_value(reply).map_err(|e| redis_error(e.into()))?;
            Ok(notes.into_iter().collect())
        })
    }
}

impl Scripts {
    fn state_key(&self, key: &[u8], policy: &Policy) -> String {
        self.key_of(&escape_key(key), policy)
    }

    /// The key of `policy`'s state for the caller whose escaped key is `tag`.
    fn key_of(&self, tag: &str, policy: &Policy) -> String {
        format!(
            "{}:{{{tag}}}:{}:{:016x}",
            self.inner.prefix,
            policy.name(),
            policy.id()
        )
    }

    async fn eval(&self, request: Request<'_>) -> Result<redis::Value, StoreError> {
        match &self.inner.backend {
            Backend::Manager(manager) => {
                let mut con = manager.clone();
                match request.send(&mut con).await {
                    // A connection that broke (a restart, a failover) is reopened by the
                    // manager: one retry, within the same timeout.
                    Err(e) if e.is_connection_dropped() || e.is_io_error() => {
                        request.send(&mut con).await.map_err(redis_error)
                    }
                    other => other.map_err(redis_error),
                }
            }
            Backend::Cluster(cluster) => request
                .send(&mut cluster.clone())
                .await
                .map_err(redis_error),
            #[cfg(feature = "deadpool")]
            Backend::Pool(pool) => {
                let mut con = pool.get().await.map_err(|e| {
                    StoreError::with_source(
                        StoreErrorKind::Connection,
                        "no Redis connection from the pool",
                        e,
                    )
                })?;
                request.send(&mut con).await.map_err(redis_error)
            }
        }
    }
}

/// What goes to Redis: a decision's script call, or a plain command (a board's).
#[derive(Clone, Copy)]
enum Request<'a> {
    Script(&'a Call),
    #[cfg_attr(not(feature = "regions"), allow(dead_code))]
    Command(&'a redis::Cmd),
    #[cfg_attr(not(feature = "regions"), allow(dead_code))]
    Pipeline(&'a redis::Pipeline),
}

impl Request<'_> {
    async fn send(self, con: &mut impl ConnectionLike) -> Result<redis::Value, RedisError> {
        match self {
            Request::Script(call) => call.invoke(con).await,
            Request::Command(cmd) => cmd.query_async(con).await,
            Request::Pipeline(pipe) => pipe.query_async(con).await,
        }
    }
}

/// One script call: its keys and arguments (see `lua/prelude.lua`).
struct Call {
    keys: SmallVec<[String; 2]>,
    time: Time,
    kind: Kind,
    /// The request's cost, or the units to charge or refund.
    units: u32,
    grace_ms: u64,
    /// Per limit: algorithm code, limit, period (µs), burst, emission interval (µs).
    limits: SmallVec<[[u64; 5]; 2]>,
}

/// Where a call's time comes from.
enum Time {
    /// The caller's clock read this instant, in µs.
    Caller(u64),
    /// The server's `TIME`.
    Server,
    /// The server's `TIME`, replied after the decisions.
    ServerTold,
}

/// Which script a call runs, and how.
#[derive(Clone, Copy)]
enum Kind {
    /// `check.lua`, writing the new states.
    Check,
    /// `check.lua`, writing nothing.
    Peek,
    /// `operate.lua`, with its operation's name.
    Operate(&'static str),
}

impl Call {
    /// `EVALSHA`, and on `NOSCRIPT` (after `SCRIPT FLUSH`, a restart, a failover, or a
    /// cluster node that never saw the script) `EVAL` of the source, which also caches
    /// it on that node: the call goes to the node that owns the keys either way.
    async fn invoke(&self, con: &mut impl ConnectionLike) -> Result<redis::Value, RedisError> {
        let (script, source) = match self.kind {
            Kind::Check | Kind::Peek => (&*SCRIPT, SOURCE),
            Kind::Operate(_) => (&*OPERATE, OPERATE_SOURCE),
        };
        match self
            .command("EVALSHA", script.get_hash())
            .query_async(con)
            .await
        {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.command("EVAL", source).query_async(con).await
            }
            other => other,
        }
    }

    fn command(&self, name: &str, script: &str) -> redis::Cmd {
        let mut cmd = redis::cmd(name);
        cmd.arg(script).arg(self.keys.len()).arg(&self.keys[..]);
        match self.time {
            Time::Caller(now) => cmd.arg(now),
            Time::Server => cmd.arg(""),
            Time::ServerTold => cmd.arg("TIME"),
        };
        cmd.arg(self.units);
        match self.kind {
            Kind::Peek => cmd.arg("peek"),
            Kind::Check | Kind::Operate(_) => cmd.arg(self.grace_ms),
        };
        for limit in &self.limits {
            cmd.arg(&limit[..]);
        }
        if let Kind::Operate(operation) = self.kind {
            cmd.arg(operation);
        }
        cmd
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
    let kind = if e.is_timeout() {
        StoreErrorKind::Timeout
    } else if e.is_connection_dropped() || e.is_connection_refusal() || e.is_io_error() {
        StoreErrorKind::Connection
    } else {
        StoreErrorKind::Script
    };
    StoreError::with_source(kind, format!("Redis call failed: {e}"), e)
}

/// The store's connections send each call at once (`TCP_NODELAY`): calls are small and
/// pipelined on one connection, and with Nagle's algorithm (redis-rs's default) a call
/// made while another's reply is on its way waits for that reply's acknowledgement — on
/// a network with delayed acknowledgements, tens of milliseconds (measured across a
/// simulated 20 ms round trip: 34 ms a decision at the median instead of 24; see
/// BENCHMARKS.md). Connections a user hands over (`with_manager`, a pool) keep theirs.
fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

/// A setting the builder refused, as the error of a `connect`.
fn config_error(e: ConfigError) -> StoreError {
    StoreError::with_source(StoreErrorKind::Other, e.to_string(), e)
}

impl Store for Scripts {
    type Future = BoxStoreFuture;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Checked<BoxStoreFuture> {
        let cache = self.inner.deny_cache.as_ref();
        let entry = cache.and_then(|cache| cache.entry(key, policies, cost));
        if let Some(decisions) = cache.zip(entry).and_then(|(c, e)| c.lookup(e)) {
            #[cfg(feature = "metrics")]
            metrics::counter!("tollway_deny_cache_hits_total").increment(1);
            return Checked::Ready(Ok(decisions));
        }
        self.call(key, policies, Kind::Check, cost, entry)
    }

    /// A peek asks Redis (the deny cache answers only requests); a charge, refund or
    /// reset also makes this node forget the refusals it remembers for the key, whose
    /// times it changed. (Other nodes answer theirs until they run out: at most the
    /// retry time they gave.)
    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<BoxStoreFuture> {
        let (kind, units) = match operation {
            Operation::Peek(cost) => (Kind::Peek, cost),
            Operation::Charge(units) => (Kind::Operate("charge"), units),
            Operation::Refund(units) => (Kind::Operate("refund"), units),
            Operation::Reset => (Kind::Operate("reset"), 0),
            Operation::Drain(keep) => (Kind::Operate("drain"), keep),
        };
        let answer = self.call(key, policies, kind, units, None);
        if matches!(operation, Operation::Peek(_)) || self.inner.deny_cache.is_none() {
            return answer;
        }
        // Forgotten before and after: a refusal remembered while the script ran (a check
        // that was under way) must not outlive the change either.
        let forget = |this: &Scripts, key: &[u8]| {
            if let Some(cache) = &this.inner.deny_cache {
                cache.forget(key);
            }
        };
        forget(self, key);
        match answer {
            Checked::Ready(answer) => Checked::Ready(answer),
            Checked::Pending(call) => {
                let (this, key) = (self.clone(), key.to_vec());
                Checked::Pending(Box::pin(async move {
                    let answer = call.await;
                    forget(&this, &key);
                    answer
                }))
            }
        }
    }
}

impl Scripts {
    /// Runs one script call for `key`'s limits; a refusal is remembered under the deny
    /// cache's `entry`, if any.
    fn call(
        &self,
        key: &[u8],
        policies: &[&Policy],
        kind: Kind,
        units: u32,
        entry: Option<DenyEntry>,
    ) -> Checked<BoxStoreFuture> {
        let time = match &self.inner.clock {
            Some(clock) => Time::Caller(clock.now_micros()),
            None => Time::Server,
        };
        let call = self.call_of(key, policies, kind, units, time);
        let capacities = capacities(policies);
        let this = self.clone();
        Checked::Pending(Box::pin(async move {
            let decisions = parse(&this.run_script(&call).await?, &capacities)?;
            if let (Some(cache), Some(entry)) = (&this.inner.deny_cache, entry)
                && !decisions.is_allowed()
            {
                cache.remember(entry, &decisions);
            }
            Ok(decisions)
        }))
    }

    fn call_of(
        &self,
        key: &[u8],
        policies: &[&Policy],
        kind: Kind,
        units: u32,
        time: Time,
    ) -> Call {
        let tag = escape_key(key);
        Call {
            keys: policies.iter().map(|p| self.key_of(&tag, p)).collect(),
            time,
            kind,
            units,
            grace_ms: self.inner.grace_ms,
            limits: policies
                .iter()
                .map(|p| {
                    let q = p.quota();
                    let code = code(p.algorithm());
                    [
                        code,
                        q.limit(),
                        q.period_micros(),
                        q.burst(),
                        q.emission_micros(),
                    ]
                })
                .collect(),
        }
    }

    /// The script's reply to `call`, within the timeout.
    async fn run_script(&self, call: &Call) -> Result<Vec<i64>, StoreError> {
        let reply = self.run(Request::Script(call)).await?;
        redis::from_redis_value(reply).map_err(|e| redis_error(e.into()))
    }

    /// Redis's reply to `request`, within the timeout.
    async fn run(&self, request: Request<'_>) -> Result<redis::Value, StoreError> {
        let timeout = self.inner.timeout;
        #[cfg(feature = "metrics")]
        let started = std::time::Instant::now();
        let reply = tokio::time::timeout(timeout, self.eval(request)).await;
        #[cfg(feature = "metrics")]
        metrics::histogram!("tollway_store_duration_seconds", "store" => self.kind())
            .record(started.elapsed());
        reply.map_err(|_| {
            StoreError::new(
                StoreErrorKind::Timeout,
                format!("Redis call timed out after {timeout:?}"),
            )
        })?
    }
}

/// What each limit can hold: the capacity a reply's decisions report.
fn capacities(policies: &[&Policy]) -> SmallVec<[u64; 2]> {
    policies.iter().map(|p| p.quota().burst()).collect()
}

/// The decisions in a script's reply: four integers a limit, `{ denial, remaining,
/// reset_after_us, wait_us }`, for limits of the given capacities.
fn parse(reply: &[i64], capacities: &[u64]) -> Result<Decisions, StoreError> {
    let bad = || {
        StoreError::new(
            StoreErrorKind::Script,
            format!(
                "Redis script replied {reply:?}, not {} decisions: is another version of tollway using the same prefix?",
                capacities.len()
            ),
        )
    };
    if reply.len() != 4 * capacities.len() {
        return Err(bad());
    }
    reply
        .chunks_exact(4)
        .zip(capacities)
        .map(|(fields, &limit)| {
            let field = |i: usize| u64::try_from(fields[i]).map_err(|_| bad());
            let (remaining, reset, wait) = (field(1)?, field(2)?, field(3)?);
            match fields[0] {
                0 => Ok(Decision::allow(limit, remaining, reset, wait)),
                1 if wait > 0 => Ok(Decision::limited(limit, remaining, reset, wait)),
                2 if wait == 0 => Ok(Decision::refused(
                    Denial::CostExceedsCapacity,
                    limit,
                    remaining,
                    reset,
                )),
                _ => Err(bad()),
            }
        })
        .collect()
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
    /// Failures in a row that open the breaker, and how long it stays open; `None`: no
    /// breaker.
    breaker: Option<(u32, Duration)>,
    /// The share of each quota the local fallback gives this node; `None`: no fallback.
    fallback_share: Option<f64>,
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
            .field("local_fallback", &self.fallback_share);
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
    /// manual clock in tests), and skew between nodes moves their decisions. Measured
    /// with two gateways 500 ms apart sending 600 requests over 3 s at 10 per second
    /// (`tests/redis`, `clock_skew_...`): the buckets, GCRA and the fixed window admitted
    /// one more than with agreeing clocks (40 for 39; 41 for 40), the sliding log five
    /// more (35 for 30), the sliding counter five fewer (30 for 35). Keep clocks
    /// synchronised well within the period, or keep the default (server time). Keys live
    /// a little longer than their state needs (see
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

    /// The breaker: after `threshold` failed calls in a row (a timeout, a lost
    /// connection) Redis is not called for `cool_down`, then one call probes it (default:
    /// 5 failures, 250 ms). While it is open a decision costs microseconds, not a
    /// timeout, and comes from the local fallback.
    pub fn breaker(mut self, threshold: u32, cool_down: Duration) -> Self {
        self.breaker = Some((threshold, cool_down));
        self
    }

    /// No breaker: every decision calls Redis, and waits for its timeout when Redis is
    /// gone.
    pub fn without_breaker(mut self) -> Self {
        self.breaker = None;
        self
    }

    /// While Redis cannot decide (a failed call, an open breaker), decide locally, in
    /// this node's memory, giving it `share` of each quota (0 < share <= 1): with ten
    /// gateways, 0.1, so that the fleet as a whole stays near the limit. The default is
    /// a local fallback with share 1 (each node alone may admit a whole quota): neither
    /// wide open nor closed.
    pub fn local_fallback(mut self, share: f64) -> Self {
        self.fallback_share = Some(share);
        self
    }

    /// No local fallback: a decision Redis cannot make is an error, and the layer
    /// answers it as its `on_store_error` setting says — lets the request through (fail
    /// open, its default) or refuses it (fail closed).
    pub fn without_local_fallback(mut self) -> Self {
        self.fallback_share = None;
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

    /// The client for `url`, with the trusted CA if one was given, sending without delay
    /// (see [`tcp_settings`]).
    fn client(&self, url: &str) -> Result<redis::Client, StoreError> {
        use redis::IntoConnectionInfo;
        let url = url
            .into_connection_info()
            .map_err(|e| {
                StoreError::with_source(StoreErrorKind::Other, format!("bad Redis URL: {e}"), e)
            })?
            .set_tcp_settings(tcp_settings());
        #[cfg(feature = "tls")]
        if let Some(root) = &self.tls_root {
            ensure_crypto_provider();
            let certificates = redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(root.clone()),
            };
            return redis::Client::build_with_tls(url, certificates).map_err(|e| {
                StoreError::with_source(
                    StoreErrorKind::Other,
                    format!("bad Redis URL or TLS root certificate: {e}"),
                    e,
                )
            });
        }
        let client = redis::Client::open(url).map_err(|e| {
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
        let scripts = Scripts {
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
        Ok(RedisStore {
            front: Front::Guarded(guarded.build()?),
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
    /// When the prefix or timeout is invalid, the URL cannot be parsed, the server cannot
    /// be reached within the timeout, refuses the credentials, or (TLS) presents a
    /// certificate that does not verify.
    pub async fn connect(self, url: &str) -> Result<RedisStore, StoreError> {
        self.validate().map_err(config_error)?;
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
        self.build(Backend::Manager(manager)).map_err(config_error)
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
        self.validate().map_err(config_error)?;
        #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
        let mut builder = redis::cluster::ClusterClient::builder(nodes.iter().copied())
            .tcp_settings(tcp_settings())
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
    fn every_algorithm_has_its_own_code() {
        let codes: std::collections::HashSet<_> = Algorithm::ALL.iter().map(|a| code(*a)).collect();
        assert_eq!(codes.len(), Algorithm::ALL.len());
    }

    #[test]
    fn replies_parse_into_decisions_or_are_refused() {
        let d = parse(&[0, 4, 100, 0, 1, 0, 60, 20, 2, 7, 0, 0], &[5, 1, 9]).unwrap();
        assert!(d[0].is_allowed() && d[0].remaining() == 4 && d[0].limit() == 5);
        assert_eq!(d[1].denial(), Some(Denial::Limited));
        assert_eq!(d[1].retry_after_micros(), 20);
        assert_eq!(d[2].denial(), Some(Denial::CostExceedsCapacity));
        // Wrong length, a negative field, a limited decision without a wait, a
        // refusal with one, an unknown code.
        for (reply, limits) in [
            (&[0, 1, 2][..], &[1][..]),
            (&[0, -1, 0, 0], &[1]),
            (&[1, 0, 5, 0], &[1]),
            (&[2, 0, 5, 3], &[1]),
            (&[9, 0, 0, 0], &[1]),
        ] {
            let err = parse(reply, limits).unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Script, "{reply:?}");
        }
    }
}
