//! The Redis store: every algorithm as one atomic Lua script, shared by a fleet.
//!
//! [`RedisStore`] and its [`Store`] impl are here; the scripts and their calls are in
//! `scripts.rs`, the local deny cache in `deny_cache.rs`, the builder and its
//! connections in `builder.rs`.

mod builder;
mod deny_cache;
mod frames;
mod link;
mod scripts;
mod sentinel;
mod stall;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::RedisError;
use redis::aio::{ConnectionLike, ConnectionManager};
use sha2::{Digest, Sha256};

pub use self::builder::RedisStoreBuilder;
use self::deny_cache::{DenyCache, DenyEntry};
use self::scripts::{
    CALENDAR_WINDOW, Call, Kind, SCRIPT, ShareCall, Time, capacities, code, parse,
};
pub use self::sentinel::Sentinel;
use super::{
    BoxStoreFuture, BreakerState, Checked, CircuitBreaker, Cost, GiveBackFuture, Grant, LendFuture,
    Operation, Store,
};
#[cfg(feature = "testing")]
use crate::Decisions;
use crate::algorithm::Algorithm;
use crate::clock::Clock;
use crate::{Policy, StoreError, StoreErrorKind};

/// The longest user key stored as it is; longer (or unusual) keys are hashed.
pub const MAX_LITERAL_KEY: usize = 96;

/// Limiter state in Redis, shared by every process that uses the same server and prefix.
///
/// Each request is one `EVALSHA` of one Lua script. The scripts are the twins of the
/// Rust functions, in `lua/`. The script decides all of the request's limits at once,
/// all or nothing. So concurrent requests from any number of nodes are decided one at a
/// time, and can never over-admit. A request refused by one limit is charged by none.
/// The script is loaded on first use. It is reloaded transparently after `SCRIPT FLUSH`,
/// a restart or a failover (`NOSCRIPT`).
///
/// # Time
///
/// Time comes from the server (`redis.call('TIME')`) by default. So clock skew between
/// gateways cannot widen a limit. [`RedisStoreBuilder::caller_time`] passes the caller's
/// clock instead, for services that reject `TIME` in scripts, and for tests.
///
/// On the server's clock, a key is written to expire at the instant its state becomes
/// equivalent to a fresh one. That instant is counted from the `TIME` the script read.
/// The expiry uses `PXAT` and `PEXPIREAT`, so it needs Redis 6.2 or later.
///
/// # Keys
///
/// Keys are `prefix:{key}:policy:id`, one per limit. The braces are a hash tag. So all
/// of a caller's limits share a cluster slot, and one script decides them. `id` is
/// [`Policy::state_id`] in hex: a changed limit or burst keeps the key, and the state
/// says the limit it was written at; a changed algorithm or period starts afresh.
///
/// User keys of up to 96 bytes of `A-Z a-z 0-9 . : _ - @ + = /` are kept readable. Any
/// other key is replaced by `#` and 32 hex digits of its SHA-256: braces, spaces,
/// binary, or a longer key. So a caller can neither move its key to another slot, nor
/// bloat Redis with a huge key.
///
/// # When Redis is slow or gone
///
/// A call fails when Redis owes a reply and sends nothing for 20 ms (a stall), or after
/// the store's timeout (100 ms; ten times that while Redis keeps answering, see
/// [`RedisStoreBuilder::timeout`]). A breaker is built in
/// (see [`RedisStoreBuilder::breaker`]). It stops calling Redis after five failures in a
/// row. So a dead Redis costs microseconds a request, not a timeout. The breaker probes
/// Redis again every 250 ms.
///
/// Meanwhile decisions come from a local fallback limiter in this node's memory. It
/// gives the node its share of each quota ([`RedisStoreBuilder::local_fallback`]). So
/// the limit still holds, neither wide open nor closed. Without the fallback
/// ([`RedisStoreBuilder::without_local_fallback`]), failures are errors. The layer
/// answers them by letting requests through or refusing them, as configured.
///
/// # Connections
///
/// By default one multiplexed connection pipelines every concurrent call. It is a
/// redis-rs `ConnectionManager`, which reconnects by itself. It carries more calls a
/// second than a pool that checks out a connection per call (the repository's
/// `cargo bench -p tests --bench redis_store`). An existing
/// `deadpool_redis::Pool` (feature `deadpool`) or `ConnectionManager` is accepted too.
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
    /// This store's number among the gateways sharing Redis: its field in a concurrency
    /// limit's hash, so that its slots are its own to renew and to lose.
    gateway: u64,
    /// Time without a reply that declares a stall, on the store's own connections;
    /// `None`: each call waits its timeout.
    stall_after: Option<Duration>,
}

enum Backend {
    /// The store's own connection, to a URL's server or the sentinels' primary.
    Link(Arc<link::Link>),
    /// A `ConnectionManager` the user made.
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
    /// connection), `redis_cluster`, `redis_pool` or `redis_sentinel`.
    fn kind(&self) -> &'static str {
        match &self.inner.backend {
            Backend::Link(link) if link.resolver().is_some() => "redis_sentinel",
            Backend::Link(_) | Backend::Manager(_) => "redis",
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
        RedisStoreBuilder::new()
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

    /// Decides like [`Store::check`] on the server's clock, whatever the builder chose.
    ///
    /// It goes straight to Redis: no deny cache, breaker or fallback. It returns the
    /// time the script read from `TIME` (µs since the Unix epoch) beside the decisions.
    ///
    /// For tests that compare the scripts with the Rust functions in server-time mode: the
    /// function fed this time must decide the same (feature `testing`).
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub async fn check_telling_time(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u64,
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

    /// Lends like [`Store::lend`] on the server's clock, whatever the builder chose, and
    /// returns the time the script read beside the grant: see
    /// [`check_telling_time`](Self::check_telling_time) (feature `testing`).
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub async fn lend_telling_time(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u64,
        ask: u64,
    ) -> Result<(Grant, u64), StoreError> {
        let scripts = self.scripts();
        let call = scripts.call_of(key, policies, Kind::Lend { cost }, ask, Time::Server);
        let grant = granted(scripts.run_script(&call).await?, &capacities(policies))?;
        let at = grant.at();
        Ok((grant, at))
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

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future> {
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

    /// One script call, whatever the limits and their costs (see
    /// [`Store::check_each`]); through the breaker as a check.
    fn check_each(&self, key: &[u8], policies: &[&Policy], costs: &[u64]) -> Checked<Self::Future> {
        match &self.front {
            Front::Scripts(scripts) => scripts.check_each(key, policies, costs),
            Front::Guarded(guarded) => guarded.check_each(key, policies, costs),
        }
    }

    fn supports_each_cost(&self) -> Result<(), crate::ConfigError> {
        Ok(())
    }

    /// One script call takes the request's cost and the units lent, all or nothing,
    /// through the breaker (see [`CircuitBreaker`]'s `lend`). A refusal the deny cache
    /// knows is answered at once, as a check's is.
    fn lend(&self, key: &[u8], policies: &[&Policy], cost: u64, ask: u64) -> Option<LendFuture> {
        match &self.front {
            Front::Scripts(scripts) => scripts.lend_call(key, policies, cost, ask),
            Front::Guarded(guarded) => guarded.lend(key, policies, cost, ask),
        }
    }

    /// One ledger script call, through the breaker.
    fn share(
        &self,
        key: &[u8],
        policy: &Policy,
        ask: &crate::ShareAsk,
    ) -> Option<super::ShareFuture> {
        match &self.front {
            Front::Scripts(scripts) => scripts.share(key, policy, ask),
            Front::Guarded(guarded) => guarded.share(key, policy, ask),
        }
    }

    /// One script call, through the breaker; never sent twice.
    fn give_back(
        &self,
        key: &[u8],
        policies: &[&Policy],
        units: u64,
        ends: &[u64],
    ) -> Option<GiveBackFuture> {
        match &self.front {
            Front::Scripts(scripts) => scripts.give_back(key, policies, units, ends),
            Front::Guarded(guarded) => guarded.give_back(key, policies, units, ends),
        }
    }
}

/// The grant in a `lend` reply: the decisions, the units taken, the time it decided at.
fn granted(mut reply: Vec<i64>, capacities: &[u64]) -> Result<Grant, StoreError> {
    let bad = || {
        StoreError::new(
            StoreErrorKind::Script,
            "the lend script replied no units or time: is another version of tollway using the same prefix?",
        )
    };
    let at = reply
        .pop()
        .and_then(|t| u64::try_from(t).ok())
        .ok_or_else(bad)?;
    let units = reply
        .pop()
        .and_then(|u| u64::try_from(u).ok())
        .ok_or_else(bad)?;
    Ok(Grant::new(units, parse(&reply, capacities)?, at))
}

/// What a [`Board`](crate::Board) on this store uses: its prefix, and plain commands.
#[cfg(feature = "regions")]
impl RedisStore {
    /// The first part of every key this store writes.
    pub(crate) fn prefix(&self) -> &str {
        &self.scripts().inner.prefix
    }

    /// Redis's reply to `command`, as a `T`: straight to Redis (no breaker, no
    /// fallback), within the store's timeout.
    pub(crate) fn command<T: redis::FromRedisValue + 'static>(
        &self,
        command: redis::Cmd,
    ) -> impl Future<Output = Result<T, StoreError>> + Send + 'static {
        let scripts = self.scripts().clone();
        async move {
            let reply = scripts.run(Request::Command(&command)).await?;
            redis::from_redis_value(reply).map_err(|e| redis_error(e.into()))
        }
    }

    /// Redis's reply to `pipeline`, the same way.
    pub(crate) fn pipeline(
        &self,
        pipeline: redis::Pipeline,
    ) -> impl Future<Output = Result<redis::Value, StoreError>> + Send + 'static {
        let scripts = self.scripts().clone();
        async move { scripts.run(Request::Pipeline(&pipeline)).await }
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
            policy.state_id()
        )
    }

    async fn eval(&self, request: Request<'_>) -> Result<redis::Value, StoreError> {
        match &self.inner.backend {
            Backend::Manager(manager) => {
                let mut con = manager.clone();
                match request.send(&mut con).await {
                    // A connection that broke (a restart, a failover) is reopened by the
                    // manager: one retry, within the same timeout.
                    Err(e)
                        if (e.is_connection_dropped() || e.is_io_error())
                            && request.may_repeat() =>
                    {
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
            Backend::Link(link) => {
                let connection = link.connection().await.map_err(redis_error)?;
                match self.send_on(&connection, request).await? {
                    // The server went away or was demoted: the next connection is made
                    // again (a sentinel's primary asked again). A replica's READONLY ran
                    // nothing, so that call is always sent again; after a broken
                    // connection, only one that may repeat.
                    Err(e) if link::moved(&e) => {
                        link.forget(connection.generation);
                        if !(request.may_repeat() || link::read_only(&e)) {
                            return Err(redis_error(e));
                        }
                        let connection = link.connection().await.map_err(redis_error)?;
                        self.send_on(&connection, request).await?.map_err(|e| {
                            if link::moved(&e) {
                                link.forget(connection.generation);
                            }
                            redis_error(e)
                        })
                    }
                    other => other.map_err(redis_error),
                }
            }
        }
    }

    /// Sends `request` on the store's own `connection`, under the stall watch when it
    /// is on (which then also judges the timeout). The outer error is a stall or a
    /// timeout; the inner one is Redis's.
    async fn send_on(
        &self,
        connection: &link::Connection,
        request: Request<'_>,
    ) -> Result<Result<redis::Value, RedisError>, StoreError> {
        let mut redis = connection.redis.clone();
        let Some(after) = self.inner.stall_after else {
            return Ok(request.send(&mut redis).await);
        };
        let timeout = self.inner.timeout;
        stall::wait(after, timeout, &connection.pulse, request.send(&mut redis))
            .await
            .map_err(|ended| match ended {
                stall::Ended::Stalled => StoreError::new(
                    StoreErrorKind::Timeout,
                    format!("Redis stalled: no reply for {after:?} with calls waiting"),
                ),
                stall::Ended::TimedOut => timed_out(timeout),
            })
    }
}

/// A call that took its timeout.
fn timed_out(timeout: Duration) -> StoreError {
    StoreError::new(
        StoreErrorKind::Timeout,
        format!("Redis call timed out after {timeout:?}"),
    )
}

/// What goes to Redis: a decision's script call, or a plain command (a board's).
#[derive(Clone, Copy)]
enum Request<'a> {
    Script(&'a Call),
    Share(&'a ShareCall),
    #[cfg_attr(not(feature = "regions"), allow(dead_code))]
    Command(&'a redis::Cmd),
    #[cfg_attr(not(feature = "regions"), allow(dead_code))]
    Pipeline(&'a redis::Pipeline),
}

impl Request<'_> {
    /// Whether it may be sent again after its connection broke (see
    /// [`Kind::may_repeat`]).
    fn may_repeat(self) -> bool {
        match self {
            Request::Script(call) => call.kind.may_repeat(),
            Request::Share(_) => true,
            Request::Command(_) | Request::Pipeline(_) => true,
        }
    }

    async fn send(self, con: &mut impl ConnectionLike) -> Result<redis::Value, RedisError> {
        match self {
            Request::Script(call) => call.invoke(con).await,
            Request::Share(call) => call.invoke(con).await,
            Request::Command(cmd) => cmd.query_async(con).await,
            Request::Pipeline(pipe) => pipe.query_async(con).await,
        }
    }
}

fn redis_error(e: RedisError) -> StoreError {
    let kind = if e.is_timeout() {
        StoreErrorKind::Timeout
    } else if e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_io_error()
        || link::read_only(&e)
    {
        // A replica answering (a demoted primary) is a connection to the wrong server.
        StoreErrorKind::Connection
    } else {
        StoreErrorKind::Script
    };
    StoreError::with_source(kind, format!("Redis call failed: {e}"), e)
}

impl Store for Scripts {
    type Future = BoxStoreFuture;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<BoxStoreFuture> {
        let cache = self.inner.deny_cache.as_ref();
        let entry = cache.and_then(|cache| cache.entry(key, policies, cost));
        if let Some(decisions) = cache.zip(entry).and_then(|(c, e)| c.lookup(e)) {
            #[cfg(feature = "metrics")]
            metrics::counter!(crate::metric::DENY_CACHE_HITS.name).increment(1);
            return Checked::Ready(Ok(decisions));
        }
        self.call(key, policies, Kind::Check, cost, entry)
    }

    /// One script call, as a check. The deny cache, which remembers refusals of one
    /// cost, neither answers nor remembers it.
    fn check_each(
        &self,
        key: &[u8],
        policies: &[&Policy],
        costs: &[u64],
    ) -> Checked<BoxStoreFuture> {
        match Cost::of(policies, costs) {
            Ok(Cost::Same(cost)) => self.check(key, policies, cost),
            Ok(Cost::Each(costs)) => {
                let time = match &self.inner.clock {
                    Some(clock) => Time::Caller(clock.now_micros()),
                    None => Time::Server,
                };
                let mut call = self.call_of(key, policies, Kind::CheckEach, 0, time);
                call.extra = costs.iter().map(|&c| scripts::exact(c)).collect();
                let capacities = capacities(policies);
                let this = self.clone();
                Checked::Pending(Box::pin(async move {
                    parse(&this.run_script(&call).await?, &capacities)
                }))
            }
            Err(e) => Checked::Ready(Err(e)),
        }
    }

    fn supports_each_cost(&self) -> Result<(), crate::ConfigError> {
        Ok(())
    }

    fn lend(&self, key: &[u8], policies: &[&Policy], cost: u64, ask: u64) -> Option<LendFuture> {
        self.lend_call(key, policies, cost, ask)
    }

    /// One call of `lua/share.lua`. Sent again after a broken connection: a repeat pays
    /// for a new bucket twice at most, which only leaves less in the pool.
    fn share(
        &self,
        key: &[u8],
        policy: &Policy,
        ask: &crate::ShareAsk,
    ) -> Option<super::ShareFuture> {
        crate::share::shareable(policy).ok()?;
        let call = ShareCall {
            key: format!(
                "{}:{{{}}}:{}:share:{:016x}",
                self.inner.prefix,
                escape_key(key),
                policy.name(),
                policy.state_id()
            ),
            now_ms: self.inner.clock.as_ref().map(|c| c.now_micros() / 1_000),
            terms: crate::share::Terms::of(policy),
            ask: ask.clone(),
        };
        let this = self.clone();
        Some(Box::pin(async move {
            let reply = this.run(Request::Share(&call)).await?;
            let reply: Vec<i64> =
                redis::from_redis_value(reply).map_err(|e| redis_error(e.into()))?;
            scripts::shared(&reply)
        }))
    }

    /// One `giveback` call, sent once: a call that may have run is not sent again.
    fn give_back(
        &self,
        key: &[u8],
        policies: &[&Policy],
        units: u64,
        ends: &[u64],
    ) -> Option<GiveBackFuture> {
        if ends.len() != policies.len() {
            return None;
        }
        let time = match &self.inner.clock {
            Some(clock) => Time::Caller(clock.now_micros()),
            None => Time::Server,
        };
        let mut call = self.call_of(key, policies, Kind::GiveBack, units, time);
        call.extra = ends.iter().copied().collect();
        let this = self.clone();
        Some(Box::pin(
            async move { this.run_script(&call).await.map(|_| ()) },
        ))
    }

    /// A peek asks Redis: the deny cache answers only requests. A charge, refund or reset
    /// also makes this node forget the refusals it remembers for the key, whose times it
    /// changed. Other nodes answer theirs until they run out: at most the retry time they
    /// gave.
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
    /// One `lend` call for `key`'s limits; a refusal is remembered, as a check's is.
    fn lend_call(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u64,
        ask: u64,
    ) -> Option<LendFuture> {
        if !super::lend::all_lend(policies) {
            return None;
        }
        let cache = self.inner.deny_cache.as_ref();
        let entry = cache.and_then(|cache| cache.entry(key, policies, cost));
        if let Some(decisions) = cache.zip(entry).and_then(|(c, e)| c.lookup(e)) {
            #[cfg(feature = "metrics")]
            metrics::counter!(crate::metric::DENY_CACHE_HITS.name).increment(1);
            return Some(Box::pin(std::future::ready(Ok(Grant::new(
                0, decisions, 0,
            )))));
        }
        let time = match &self.inner.clock {
            Some(clock) => Time::Caller(clock.now_micros()),
            None => Time::Server,
        };
        let call = self.call_of(key, policies, Kind::Lend { cost }, ask, time);
        let capacities = capacities(policies);
        let this = self.clone();
        Some(Box::pin(async move {
            let grant = granted(this.run_script(&call).await?, &capacities)?;
            if let (Some(cache), Some(entry)) = (&this.inner.deny_cache, entry)
                && !grant.decisions().is_allowed()
            {
                cache.remember(entry, grant.decisions());
            }
            Ok(grant)
        }))
    }

    /// Runs one script call for `key`'s limits; a refusal is remembered under the deny
    /// cache's `entry`, if any.
    fn call(
        &self,
        key: &[u8],
        policies: &[&Policy],
        kind: Kind,
        units: u64,
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
        units: u64,
        time: Time,
    ) -> Call {
        let tag = escape_key(key);
        // A calendar's windows are computed here, on this clock: the script takes the
        // one that holds its own now (see fixed_window.lua).
        let now = match time {
            Time::Caller(now) => now,
            _ => crate::SystemClock.now_micros(),
        };
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
                    if let Some(calendar) = q.calendar() {
                        let (start, end, next) = calendar.window(now);
                        return [CALENDAR_WINDOW, q.limit(), start, end, next];
                    }
                    let code = code(p.algorithm());
                    // Concurrency's third number names this gateway's field.
                    let third = match p.algorithm() {
                        Algorithm::Concurrency => self.inner.gateway,
                        _ => q.burst(),
                    };
                    [
                        code,
                        q.limit(),
                        q.period_micros(),
                        third,
                        q.emission_micros(),
                    ]
                })
                .collect(),
            extra: smallvec::SmallVec::new(),
        }
    }

    /// The script's reply to `call`, within the timeout.
    async fn run_script(&self, call: &Call) -> Result<Vec<i64>, StoreError> {
        let reply = self.run(Request::Script(call)).await?;
        redis::from_redis_value(reply).map_err(|e| redis_error(e.into()))
    }

    /// Redis's reply to `request`, within the timeout. On the store's own connections
    /// with the stall watch on, the watch judges the timeout by the socket; this bounds
    /// the whole call (a connection made included) at what the watch may allow.
    async fn run(&self, request: Request<'_>) -> Result<redis::Value, StoreError> {
        let timeout = self.inner.timeout;
        let watched =
            matches!(self.inner.backend, Backend::Link(_)) && self.inner.stall_after.is_some();
        let bound = if watched {
            timeout.saturating_mul(stall::BEHIND_AT_MOST)
        } else {
            timeout
        };
        #[cfg(feature = "metrics")]
        let started = std::time::Instant::now();
        let reply = tokio::time::timeout(bound, self.eval(request)).await;
        #[cfg(feature = "metrics")]
        metrics::histogram!(crate::metric::STORE_DURATION.name, "store" => self.kind())
            .record(started.elapsed());
        reply.map_err(|_| timed_out(timeout))?
    }
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
}
