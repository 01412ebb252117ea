//! The Redis store suites: the Lua script decides exactly like the Rust functions, for
//! one limit and for several at once, atomically across gateways; it survives `SCRIPT
//! FLUSH`; its keys expire, include the quota, and cannot be steered by a caller.
//!
//! Each suite is a function of a [`Target`] (one server or a cluster) that keeps to key
//! prefixes of its own, so that suites can share a server or a cluster, and returns the
//! Redis keys it used.

use std::collections::BTreeSet;
use std::future::IntoFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::AsyncCommands;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use tollway_core::{
    Algorithm, Decision, Denial, ManualClock, MemoryStore, Operation, Policy, Quota, RedisStore,
    RedisStoreBuilder, Store,
};

use crate::redis::{command_calls, unique_prefix};
use crate::stores::EPOCH_US;
use crate::{CheckOne, Rng};

/// Where the suite's stores connect.
#[derive(Clone, Debug)]
pub enum Target {
    /// One `redis-server`.
    Server(String),
    /// A Redis Cluster, through every node's URL.
    Cluster(Vec<String>),
}

impl Target {
    /// A gateway: `builder`'s store on its own connection(s) to the target.
    pub async fn connect(&self, builder: RedisStoreBuilder) -> RedisStore {
        match self {
            Target::Server(url) => builder.connect(url).await.unwrap(),
            Target::Cluster(urls) => {
                let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
                builder.connect_cluster(&urls).await.unwrap()
            }
        }
    }

    /// A plain client for keyed commands (`GET`, `PTTL`, ...), sent to the node that
    /// owns the key.
    pub async fn admin(&self) -> Admin {
        match self {
            Target::Server(url) => Admin::Server(
                redis::Client::open(url.as_str())
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap(),
            ),
            Target::Cluster(urls) => Admin::Cluster(
                redis::cluster::ClusterClient::new(urls.clone())
                    .unwrap()
                    .get_async_connection()
                    .await
                    .unwrap(),
            ),
        }
    }

    /// A connection to every node, replicas included (`SCRIPT FLUSH`, `INFO`).
    pub async fn each_node(&self) -> Vec<MultiplexedConnection> {
        let urls = match self {
            Target::Server(url) => std::slice::from_ref(url),
            Target::Cluster(urls) => urls.as_slice(),
        };
        let mut nodes = Vec::new();
        for url in urls {
            nodes.push(
                redis::Client::open(url.as_str())
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap(),
            );
        }
        nodes
    }
}

/// A connection to one server, or a cluster client that routes each command by its key.
#[derive(Clone)]
#[allow(missing_debug_implementations)] // redis-rs's cluster connection has no Debug
pub enum Admin {
    /// One server's connection.
    Server(MultiplexedConnection),
    /// The cluster's client.
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for Admin {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Admin::Server(con) => con.req_packed_command(cmd),
            Admin::Cluster(con) => con.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Admin::Server(con) => con.req_packed_commands(pipeline, offset, count),
            Admin::Cluster(con) => con.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Admin::Server(con) => con.get_db(),
            Admin::Cluster(con) => con.get_db(),
        }
    }
}

/// A store on the caller's (manual) time, with a timeout no test should reach.
///
/// Redis expires keys by its own clock, which runs on while the manual one stands still:
/// an hour's grace keeps every key's state as long as the test runs, however slowly.
/// (State that becomes fresh is deleted at once either way.)
pub fn builder(clock: &ManualClock) -> RedisStoreBuilder {
    RedisStore::builder()
        .without_local_fallback()
        .timeout(Duration::from_secs(5))
        .caller_time(clock.clone())
        .grace(Duration::from_secs(3_600))
}

/// Quotas that exercise uneven rates, short and long periods, bursts above and below the
/// limit.
fn quotas(algorithm: Algorithm) -> Vec<Quota> {
    let specs: [(u32, u64, u32); 5] = [
        (7, 3_000_000, 11),
        (100, 60_000_000, 100),
        (3, 1_000_000, 2),
        (50, 1_000, 64),
        (1, 86_400_000_000, 1),
    ];
    specs
        .iter()
        .map(|&(limit, period_us, burst)| {
            let q = Quota::with_period(limit, Duration::from_micros(period_us)).unwrap();
            if algorithm.uses_burst() {
                q.with_burst(burst).unwrap()
            } else {
                q
            }
        })
        .collect()
}

/// The next time gap: often none, often tiny, sometimes exactly to a period boundary,
/// sometimes a long idle stretch.
fn gap(rng: &mut Rng, now: u64, quota: &Quota) -> u64 {
    let period = quota.period_micros();
    match rng.below(10) {
        0..=2 => 0,
        3..=4 => rng.below(quota.emission_micros() * 2) + 1,
        5 => period - now % period, // exactly on the next boundary
        6 => (period - now % period).saturating_sub(1).max(1), // one tick before it
        7 => quota.emission_micros(),
        8 => rng.below(period) + 1,
        _ => period * (1 + rng.below(20)), // long idle
    }
}

fn cost(rng: &mut Rng, quota: &Quota, algorithm: Algorithm) -> u32 {
    let cap = if algorithm.uses_burst() {
        quota.burst()
    } else {
        quota.limit()
    };
    let c = match rng.below(10) {
        0..=5 => 1,
        6 => 0,
        7 => cap + 1,
        _ => 1 + rng.below(cap),
    };
    u32::try_from(c).unwrap()
}

/// Which of allowed (0), limited (1) and refused (2) a decision is, to show a trace
/// exercises all three.
fn outcome(decision: &Decision) -> usize {
    match decision.denial() {
        None => 0,
        Some(Denial::Limited) => 1,
        Some(_) => 2,
    }
}

/// Test-only reading of the manual clock without importing the trait everywhere.
trait NowForTest {
    fn now_micros_for_test(&self) -> u64;
}

impl NowForTest for ManualClock {
    fn now_micros_for_test(&self) -> u64 {
        tollway_core::Clock::now_micros(self)
    }
}

/// Replays `events` random (time, caller, cost) events per algorithm through Redis and
/// through the Rust functions (the memory store) on one pinned clock, and compares every
/// field of every decision. Two Redis stores answer each event: one without the deny
/// cache, so that every decision is the script's, and one with it (the default), whose
/// local answers must be the same. Returns the Redis keys it used.
pub async fn conformance(target: &Target, events: usize) -> Vec<String> {
    const CALLERS: u64 = 6;
    let clock = ManualClock::at_micros(EPOCH_US);
    let scripts = target
        .connect(
            builder(&clock)
                .prefix(unique_prefix("script"))
                .deny_cache(0),
        )
        .await;
    let cached = target
        .connect(builder(&clock).prefix(unique_prefix("cached")))
        .await;
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let mut rng = Rng(0x7011_6a7e);
    // A new policy (and so new keys) every fifth of the trace, cycling the quotas.
    let segment = events.div_ceil(5);
    let mut keys = BTreeSet::new();
    for algorithm in Algorithm::ALL {
        let quotas = quotas(algorithm);
        let mut counts = [0u64; 3];
        for i in 0..events {
            let quota = quotas[(i / segment) % quotas.len()];
            let policy = Policy::new(format!("conf{}", i / segment), algorithm, quota).unwrap();
            let now = clock.now_micros_for_test();
            clock.set_micros(now + gap(&mut rng, now, &quota));
            let cost = cost(&mut rng, &quota, algorithm);
            let caller = format!("caller-{}", rng.below(CALLERS));
            let expected = memory.check_sync(caller.as_bytes(), &policy, cost);
            let (script, local) = tokio::join!(
                scripts.check_one(caller.as_bytes(), &policy, cost),
                cached.check_one(caller.as_bytes(), &policy, cost),
            );
            let context = || {
                format!(
                    "{algorithm:?} event {i} {caller} at {} cost {cost} quota {quota:?}",
                    clock.now_micros_for_test()
                )
            };
            assert_eq!(script.unwrap(), expected, "script: {}", context());
            assert_eq!(local.unwrap(), expected, "deny cache: {}", context());
            counts[outcome(&expected)] += 1;
            keys.insert(scripts.state_key(caller.as_bytes(), &policy));
        }
        // The trace is not vacuous: it admits, limits and refuses (each at least 1%).
        assert!(
            counts.iter().all(|&n| n >= events as u64 / 100),
            "{algorithm:?}: {counts:?}"
        );
    }
    keys.into_iter().collect()
}

/// The conformance trace in server-time mode: each script call reads Redis's `TIME` and
/// tells the time it read, and the memory store, fed that time, must decide the same,
/// field by field. The gaps are what the calls take (tens to hundreds of µs), so the
/// quotas are short enough for refills and window boundaries to happen among them.
/// Returns the Redis keys it used.
pub async fn conformance_server_time(target: &Target, events: usize) -> Vec<String> {
    const CALLERS: u64 = 4;
    let clock = ManualClock::at_micros(0);
    let scripts = target
        .connect(
            RedisStore::builder()
                .without_local_fallback()
                .timeout(Duration::from_secs(5))
                .prefix(unique_prefix("server-time"))
                .deny_cache(0),
        )
        .await;
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let mut rng = Rng(0x5e77_e7ed);
    let specs: [(u32, u64, u32); 4] = [
        (5, 2_000, 8),
        (50, 1_000, 64),
        (3, 20_000, 2),
        (100, 60_000_000, 100),
    ];
    let segment = events.div_ceil(specs.len());
    let mut keys = BTreeSet::new();
    for algorithm in Algorithm::ALL {
        let mut counts = [0u64; 3];
        for i in 0..events {
            let (limit, period, burst) = specs[i / segment];
            let quota = Quota::with_period(limit, Duration::from_micros(period)).unwrap();
            let quota = if algorithm.uses_burst() {
                quota.with_burst(burst).unwrap()
            } else {
                quota
            };
            let policy = Policy::new(format!("time{}", i / segment), algorithm, quota).unwrap();
            let cost = cost(&mut rng, &quota, algorithm);
            let caller = format!("caller-{}", rng.below(CALLERS));
            let (decisions, told) = scripts
                .check_telling_time(caller.as_bytes(), &[&policy], cost)
                .await
                .unwrap();
            assert!(
                told >= clock.now_micros_for_test(),
                "Redis's TIME went back: {told}"
            );
            clock.set_micros(told);
            let expected = memory.check_sync(caller.as_bytes(), &policy, cost);
            assert_eq!(
                decisions[0], expected,
                "{algorithm:?} event {i} {caller} at TIME {told} cost {cost} quota {quota:?}"
            );
            counts[outcome(&expected)] += 1;
            keys.insert(scripts.state_key(caller.as_bytes(), &policy));
        }
        assert!(
            counts.iter().all(|&n| n >= events as u64 / 100),
            "{algorithm:?}: {counts:?}"
        );
    }
    keys.into_iter().collect()
}

/// A gateway's clock that runs `ahead` µs ahead of the true (manual) one.
#[derive(Clone, Debug)]
struct Ahead(ManualClock, u64);

impl tollway_core::Clock for Ahead {
    fn now_micros(&self) -> u64 {
        self.0.now_micros_for_test() + self.1
    }
}

/// What clock skew does, per algorithm, at 10 per second (burst 10): two gateways share a
/// limit in caller-time mode, one with its clock 500 ms ahead of the other's; both send
/// a request every 10 ms of true time for 3 s. Admissions are compared with the same
/// traffic through gateways whose clocks agree, and every decision with the Rust
/// functions fed the deciding gateway's own time (which runs back and forth). Then the same two gateways' traffic in
/// server-time mode: each script call tells the `TIME` it read, and the memory store fed
/// those times decides every request the same, so skew cannot move a decision.
/// Returns (algorithm, admitted with skew, admitted without) and the Redis keys it used.
pub async fn clock_skew(target: &Target) -> (Vec<(Algorithm, u64, u64)>, Vec<String>) {
    const SKEW_US: u64 = 500_000;
    let quota = Quota::per_second(10).unwrap();
    let mut keys = Vec::new();
    let mut rows = Vec::new();
    for algorithm in Algorithm::ALL {
        let policy = Policy::new(format!("skew-{algorithm:?}"), algorithm, quota).unwrap();
        let mut admitted = [0u64; 2];
        for (skewed, count) in [true, false].into_iter().zip(&mut admitted) {
            // Start 0.7 s into a window, so the clocks disagree about which window it is.
            let truth = ManualClock::at_micros(EPOCH_US + 700_000);
            let prefix = unique_prefix("skew");
            let slow = target
                .connect(builder(&truth).prefix(prefix.clone()).deny_cache(0))
                .await;
            let ahead = Ahead(truth.clone(), if skewed { SKEW_US } else { 0 });
            let fast = target
                .connect(
                    builder(&truth)
                        .caller_time(ahead)
                        .prefix(prefix)
                        .deny_cache(0),
                )
                .await;
            // The Rust functions fed each gateway's own time, which runs back and forth
            // between the two, must decide as the script does.
            let fed = ManualClock::new();
            let memory = MemoryStore::builder().clock(fed.clone()).build().unwrap();
            for step in 0..300 {
                for (gateway, ahead) in [(&slow, false), (&fast, skewed)] {
                    let d = gateway.check_one(b"caller", &policy, 1).await.unwrap();
                    fed.set_micros(truth.now_micros_for_test() + u64::from(ahead) * SKEW_US);
                    let expected = memory.check_sync(b"caller", &policy, 1);
                    assert_eq!(d, expected, "{algorithm:?} step {step}, skewed {skewed}");
                    *count += u64::from(d.is_allowed());
                }
                truth.advance(Duration::from_millis(10));
            }
            keys.push(slow.state_key(b"caller", &policy));
        }
        rows.push((algorithm, admitted[0], admitted[1]));
    }

    // Server time: the same two gateways' requests (they have no clock to skew), decided
    // at the time Redis read.
    let prefix = unique_prefix("skew-server");
    let server_time = || {
        RedisStore::builder()
            .without_local_fallback()
            .timeout(Duration::from_secs(5))
            .prefix(prefix.clone())
            .deny_cache(0)
    };
    let gateways = [
        target.connect(server_time()).await,
        target.connect(server_time()).await,
    ];
    let clock = ManualClock::at_micros(0);
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    for algorithm in Algorithm::ALL {
        let policy = Policy::new(format!("skew-server-{algorithm:?}"), algorithm, quota).unwrap();
        for i in 0..40 {
            let (decisions, told) = gateways[i % 2]
                .check_telling_time(b"caller", &[&policy], 1)
                .await
                .unwrap();
            clock.set_micros(told);
            assert_eq!(
                decisions[0],
                memory.check_sync(b"caller", &policy, 1),
                "{algorithm:?} request {i} at TIME {told}"
            );
        }
        keys.push(gateways[0].state_key(b"caller", &policy));
    }
    (rows, keys)
}

/// Replays `events` random requests, each against one to four limits of different
/// algorithms (chosen afresh for every request, so the limits' states interleave), through
/// Redis and through the memory store on one pinned clock: every decision of every limit
/// must be the same, and so must the all-or-nothing rule (a refused request charges no
/// limit). One event in four is an [`Operation`] instead (peek, charge, refund, reset),
/// whose answers must be the same too, as must every decision after it. The store with
/// the deny cache may answer a repeated refusal locally; its
/// denials must be exact, and the limits that did not deny may report fewer remaining
/// units than they have (what Redis said at the refusal), never more. Returns the keys.
pub async fn conformance_multi(target: &Target, events: usize) -> Vec<String> {
    const CALLERS: u64 = 3;
    let clock = ManualClock::at_micros(EPOCH_US);
    let scripts = target
        .connect(builder(&clock).prefix(unique_prefix("multi")).deny_cache(0))
        .await;
    let cached = target
        .connect(builder(&clock).prefix(unique_prefix("multi-cached")))
        .await;
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let mut rng = Rng(0x0a11_0f0e);
    let pool: Vec<Policy> = Algorithm::ALL
        .iter()
        .enumerate()
        .map(|(i, &algorithm)| {
            let quota = quotas(algorithm)[i % 3];
            Policy::new(format!("multi{i}"), algorithm, quota).unwrap()
        })
        .collect();
    let mut keys = BTreeSet::new();
    let (mut admitted, mut refused_with_room) = (0, 0);
    let mut operations = [0usize; 5];
    for i in 0..events {
        let n = 1 + rng.below(4) as usize;
        let mut chosen: Vec<&Policy> = Vec::new();
        while chosen.len() < n {
            let p = &pool[rng.below(pool.len() as u64) as usize];
            if !chosen.iter().any(|c| c.name() == p.name()) {
                chosen.push(p);
            }
        }
        let now = clock.now_micros_for_test();
        clock.set_micros(now + gap(&mut rng, now, chosen[0].quota()));
        let cost = cost(&mut rng, chosen[0].quota(), chosen[0].algorithm()).min(3);
        let caller = format!("caller-{}", rng.below(CALLERS));
        // One event in four looks at or corrects the state instead of checking a request.
        let operation = match rng.below(20) {
            0 => Some(Operation::Peek(cost)),
            1 => Some(Operation::Charge(1 + rng.below(12) as u32)),
            2 => Some(Operation::Refund(1 + rng.below(12) as u32)),
            3 => Some(Operation::Reset),
            4 => Some(Operation::Drain(rng.below(12) as u32)),
            _ => None,
        };
        if let Some(operation) = operation {
            let expected = memory.apply(caller.as_bytes(), &chosen, operation);
            let (script, local) = tokio::join!(
                scripts
                    .operate(caller.as_bytes(), &chosen, operation)
                    .into_future(),
                cached
                    .operate(caller.as_bytes(), &chosen, operation)
                    .into_future(),
            );
            let names: Vec<&str> = chosen.iter().map(|p| p.name()).collect();
            let context = format!(
                "event {i} {caller} at {} {operation:?} limits {names:?}",
                clock.now_micros_for_test()
            );
            assert_eq!(script.unwrap(), expected, "script: {context}");
            assert_eq!(local.unwrap(), expected, "deny cache: {context}");
            operations[match operation {
                Operation::Peek(_) => 0,
                Operation::Charge(_) => 1,
                Operation::Refund(_) => 2,
                Operation::Reset => 3,
                _ => 4,
            }] += 1;
            continue;
        }
        let expected = memory.decide(caller.as_bytes(), &chosen, cost);
        let (script, local) = tokio::join!(
            scripts
                .check(caller.as_bytes(), &chosen, cost)
                .into_future(),
            cached.check(caller.as_bytes(), &chosen, cost).into_future(),
        );
        let names: Vec<&str> = chosen.iter().map(|p| p.name()).collect();
        let context = || {
            format!(
                "event {i} {caller} at {} cost {cost} limits {names:?}",
                clock.now_micros_for_test()
            )
        };
        assert_eq!(script.unwrap(), expected, "script: {}", context());
        let local = local.unwrap();
        assert_eq!(local.len(), expected.len(), "deny cache: {}", context());
        for (l, e) in local.iter().zip(expected.iter()) {
            if e.is_allowed() && !expected.is_allowed() {
                assert!(
                    l.is_allowed() && l.remaining() <= e.remaining(),
                    "deny cache: {}",
                    context()
                );
                assert_eq!(
                    l.reset_after(),
                    e.reset_after(),
                    "deny cache: {}",
                    context()
                );
            } else {
                assert_eq!(l, e, "deny cache: {}", context());
            }
        }
        if expected.is_allowed() {
            admitted += 1;
        } else if expected.iter().any(Decision::is_allowed) {
            refused_with_room += 1;
        }
        for p in &chosen {
            keys.insert(scripts.state_key(caller.as_bytes(), p));
        }
    }
    // The trace is not vacuous: requests pass, and requests are refused by one limit
    // while another had room (the case all-or-nothing is about).
    assert!(admitted >= events / 10, "{admitted} admitted");
    assert!(
        operations.iter().all(|&n| n >= events / 100),
        "operations (peek, charge, refund, reset, drain): {operations:?}"
    );
    assert!(
        refused_with_room >= events / 20,
        "{refused_with_room} refused with room"
    );
    keys.into_iter().collect()
}

/// A request against three limits is one script call, however many limits it has: the
/// server's `INFO commandstats` counts one `EVALSHA` a request.
pub async fn one_round_trip(target: &Target, node: &mut MultiplexedConnection) -> Vec<String> {
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = target
        .connect(builder(&clock).prefix(unique_prefix("trips")))
        .await;
    let policies: Vec<Policy> = [
        Algorithm::TokenBucket,
        Algorithm::SlidingWindowLog,
        Algorithm::Gcra,
    ]
    .iter()
    .enumerate()
    .map(|(i, &a)| Policy::new(format!("trip{i}"), a, Quota::per_minute(100).unwrap()).unwrap())
    .collect();
    let policies: Vec<&Policy> = policies.iter().collect();
    // Loads the script.
    store.check(b"warm", &policies, 1).await.unwrap();
    let before = command_calls(node, "evalsha").await;
    for _ in 0..10 {
        assert!(
            store
                .check(b"caller", &policies, 1)
                .await
                .unwrap()
                .is_allowed()
        );
    }
    assert_eq!(command_calls(node, "evalsha").await - before, 10);
    ["warm", "caller"]
        .iter()
        .flat_map(|k| policies.iter().map(|p| store.state_key(k.as_bytes(), p)))
        .collect()
}

/// A policy whose quota changes (10/min to 1,000/min) starts its callers afresh: the
/// state key names the quota.
pub async fn a_changed_quota_starts_afresh(target: &Target) -> Vec<String> {
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = target
        .connect(builder(&clock).prefix(unique_prefix("requota")))
        .await;
    let before = Policy::new(
        "api",
        Algorithm::TokenBucket,
        Quota::per_minute(10).unwrap(),
    )
    .unwrap();
    let after = Policy::new(
        "api",
        Algorithm::TokenBucket,
        Quota::per_minute(1_000).unwrap(),
    )
    .unwrap();
    for _ in 0..10 {
        assert!(
            store
                .check_one(b"k", &before, 1)
                .await
                .unwrap()
                .is_allowed()
        );
    }
    assert!(
        !store
            .check_one(b"k", &before, 1)
            .await
            .unwrap()
            .is_allowed()
    );
    let first = store.check_one(b"k", &after, 1).await.unwrap();
    assert!(first.is_allowed());
    assert_eq!(first.remaining(), 999);
    vec![
        store.state_key(b"k", &before),
        store.state_key(b"k", &after),
    ]
}

/// Runs `tasks` concurrent tasks, task `t` on gateway `t % gateways` for key
/// `t / gateways % keys` (so every key is hammered through every gateway), each sending
/// `per_task` requests, and returns the delays of the requests each key admitted, in
/// order (all 0 but the shaper's).
async fn hammer(
    gateways: &[RedisStore],
    policy: &Policy,
    keys: &[String],
    tasks: usize,
    per_task: usize,
) -> Vec<Vec<u64>> {
    let admitted: Arc<Vec<std::sync::Mutex<Vec<u64>>>> =
        Arc::new(keys.iter().map(|_| Default::default()).collect());
    let mut handles = Vec::new();
    for t in 0..tasks {
        let store = gateways[t % gateways.len()].clone();
        let k = t / gateways.len() % keys.len();
        let key = keys[k].clone();
        let policy = policy.clone();
        let admitted = Arc::clone(&admitted);
        handles.push(tokio::spawn(async move {
            for _ in 0..per_task {
                let d = store.check_one(key.as_bytes(), &policy, 1).await.unwrap();
                if d.is_allowed() {
                    admitted[k].lock().unwrap().push(d.delay_micros());
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    admitted
        .iter()
        .map(|delays| {
            let mut delays = delays.lock().unwrap().clone();
            delays.sort_unstable();
            delays
        })
        .collect()
}

/// What a limiter without a script does: read, decide, write — two round trips with a
/// gap between them.
async fn naive_get_then_set(
    target: &Target,
    gateways: usize,
    tasks: usize,
    per_task: usize,
    limit: u64,
) -> u64 {
    let mut cons = Vec::new();
    for _ in 0..gateways {
        cons.push(target.admin().await);
    }
    let admitted = Arc::new(AtomicU64::new(0));
    let key = unique_prefix("naive:hot");
    let mut handles = Vec::new();
    for t in 0..tasks {
        let mut con = cons[t % gateways].clone();
        let admitted = Arc::clone(&admitted);
        let key = key.clone();
        handles.push(tokio::spawn(async move {
            for _ in 0..per_task {
                let count: Option<u64> = con.get(&key).await.unwrap();
                let count = count.unwrap_or(0);
                if count < limit {
                    let () = con.set(&key, count + 1).await.unwrap();
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    admitted.load(Ordering::Relaxed)
}

/// Three gateways and 66 tasks hammer three keys per algorithm on a pinned clock: each
/// key admits exactly what the memory store admits to the same number of requests one at
/// a time — its capacity, never more — and the shaper gives each admitted request a
/// departure slot of its own, the model's delays exactly (no two requests sent at once);
/// a GET-then-SET limiter under the same load over-admits. Returns the Redis keys it used.
pub async fn atomicity(target: &Target) -> Vec<String> {
    const TASKS: usize = 66;
    const PER_TASK: usize = 30;
    // Time is pinned, so the exact model is the capacity: nothing refills mid-test.
    let clock = ManualClock::at_micros(EPOCH_US);
    let prefix = unique_prefix("atomicity");
    let mut gateways = Vec::new();
    for _ in 0..3 {
        // No deny cache: every one of the requests races inside Redis.
        gateways.push(
            target
                .connect(builder(&clock).prefix(prefix.clone()).deny_cache(0))
                .await,
        );
    }
    let quota = Quota::per_minute(100).unwrap();
    // A caller's keys share its hash tag; these three callers' tags hash to slots 5356,
    // 9359 and 13486: one on each master of a three-master cluster's default split.
    let callers: Vec<String> = ["hot-0", "hot-3", "hot-2"].map(String::from).to_vec();
    let per_key = TASKS * PER_TASK / callers.len();
    let mut keys = Vec::new();
    for algorithm in Algorithm::ALL {
        let policy = Policy::new(format!("atomic-{algorithm:?}"), algorithm, quota).unwrap();
        // The model: the same requests one at a time, on the same pinned clock.
        let model = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let expected: Vec<u64> = (0..per_key)
            .map(|_| model.check_sync(b"model", &policy, 1))
            .filter(Decision::is_allowed)
            .map(|d| d.delay_micros())
            .collect();
        assert_eq!(expected.len(), 100, "{algorithm:?}: the capacity");
        let admitted = hammer(&gateways, &policy, &callers, TASKS, PER_TASK).await;
        for (caller, delays) in callers.iter().zip(&admitted) {
            assert_eq!(
                delays.len(),
                expected.len(),
                "{algorithm:?} admitted {} of {per_key} for {caller}",
                delays.len()
            );
            assert_eq!(
                delays, &expected,
                "{algorithm:?}: the delays given to {caller}"
            );
        }
        if algorithm == Algorithm::LeakyBucketShaper {
            // Not vacuous: 100 distinct slots, 0.6 s apart.
            assert_eq!(expected[99], 99 * 600_000);
        }
        for caller in &callers {
            keys.push(gateways[0].state_key(caller.as_bytes(), &policy));
        }
    }
    // The same load through GET-then-SET over-admits: the race the scripts remove.
    let naive = naive_get_then_set(target, 3, TASKS, PER_TASK, 100).await;
    assert!(
        naive > 100,
        "the naive limiter admitted {naive}, expected more than 100"
    );
    println!(
        "naive GET-then-SET limiter admitted {naive} of {} (limit 100)",
        TASKS * PER_TASK
    );
    keys
}

/// Many callers' state survives `SCRIPT FLUSH` on every node: each node that runs a
/// script afterwards gets `NOSCRIPT`, reloads it with `EVAL`, and decides from the state
/// it kept. Returns the Redis keys it used.
pub async fn script_flush(target: &Target) -> Vec<String> {
    const CALLERS: usize = 24;
    let clock = ManualClock::at_micros(EPOCH_US);
    // No deny cache: every call must reach Redis, and the test counts them.
    let store = target
        .connect(builder(&clock).prefix(unique_prefix("flush")).deny_cache(0))
        .await;
    let policy = Policy::new(
        "noscript",
        Algorithm::TokenBucket,
        Quota::per_minute(10).unwrap(),
    )
    .unwrap();
    let callers: Vec<String> = (0..CALLERS).map(|c| format!("caller-{c}")).collect();
    for caller in &callers {
        let d = store
            .check_one(caller.as_bytes(), &policy, 1)
            .await
            .unwrap();
        assert_eq!(d.remaining(), 9, "{caller}");
    }

    let mut nodes = target.each_node().await;
    let mut before = Vec::new();
    for node in &mut nodes {
        before.push((
            command_calls(node, "evalsha").await,
            command_calls(node, "eval").await,
        ));
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(node)
            .await
            .unwrap();
    }
    for caller in &callers {
        let d = store
            .check_one(caller.as_bytes(), &policy, 1)
            .await
            .unwrap();
        assert_eq!(d.remaining(), 8, "{caller}: state kept, script reloaded");
    }
    let mut served = 0;
    for (node, (evalsha, eval)) in nodes.iter_mut().zip(before) {
        let evalsha = command_calls(node, "evalsha").await - evalsha;
        let eval = command_calls(node, "eval").await - eval;
        // A node that ran scripts after the flush had them reloaded with EVAL, after a
        // NOSCRIPT; one that ran none, none. (Counted per node: other tests sharing the
        // server or cluster may add calls of their own, each store one EVAL a node.)
        if evalsha > 0 {
            served += 1;
            assert!(eval >= 1, "a node ran {evalsha} EVALSHA and {eval} EVAL");
        } else {
            assert_eq!(eval, 0);
        }
    }
    assert!(served > 0);
    callers
        .iter()
        .map(|c| store.state_key(c.as_bytes(), &policy))
        .collect()
}

/// Keys expire when their state is fresh again, on the server's time and on the
/// caller's, for every algorithm and several callers. Returns the Redis keys it used.
pub async fn expiry(target: &Target) -> Vec<String> {
    let callers: Vec<String> = (0..6).map(|c| format!("idler-{c}")).collect();
    let mut con = target.admin().await;
    let mut keys = Vec::new();
    // Server time: a key expires at the instant its state is fresh, rounded up to Redis's
    // millisecond, counted from the TIME the script read — not from the millisecond the
    // command ran, which Redis 7.2 takes when the EVALSHA starts, before TIME (a key of a
    // 1 ms log written with a relative PEXPIRE could then go while an entry still counts).
    let store = target
        .connect(
            RedisStore::builder()
                .without_local_fallback()
                .prefix(unique_prefix("ttl"))
                .timeout(Duration::from_secs(5)),
        )
        .await;
    for algorithm in Algorithm::ALL {
        let policy = Policy::new("idle", algorithm, Quota::per_second(4).unwrap()).unwrap();
        for caller in &callers {
            let (d, told) = store
                .check_telling_time(caller.as_bytes(), &[&policy], 2)
                .await
                .unwrap();
            assert!(d.is_allowed());
            let key = store.state_key(caller.as_bytes(), &policy);
            let at: u64 = redis::cmd("PEXPIRETIME")
                .arg(&key)
                .query_async(&mut con)
                .await
                .unwrap();
            // Every one of these states is fresh again when its reset time has passed.
            let fresh = told + u64::try_from(d[0].reset_after().as_micros()).unwrap();
            assert_eq!(
                at,
                fresh.div_ceil(1000),
                "{algorithm:?} {key}: expires at {at} ms, TIME {told} µs, reset {:?}",
                d[0].reset_after()
            );
            keys.push(key);
        }
    }
    // With the caller's time, an idle caller's next look leaves nothing behind.
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = target
        .connect(builder(&clock).prefix(unique_prefix("idle")).deny_cache(0))
        .await;
    for algorithm in Algorithm::ALL {
        let policy = Policy::new("idle", algorithm, Quota::per_second(4).unwrap()).unwrap();
        for caller in &callers {
            let d = store
                .check_one(caller.as_bytes(), &policy, 1)
                .await
                .unwrap();
            assert!(d.is_allowed());
        }
        clock.advance(Duration::from_secs(3));
        for caller in &callers {
            let d = store
                .check_one(caller.as_bytes(), &policy, 0)
                .await
                .unwrap();
            assert!(d.is_allowed());
            let key = store.state_key(caller.as_bytes(), &policy);
            let exists: bool = con.exists(&key).await.unwrap();
            assert!(!exists, "{algorithm:?}: {key} outlived its state");
            keys.push(key);
        }
    }
    keys
}

/// Keys with braces, binary or a megabyte become short, hashed keys with one hash tag
/// (all of a caller's limits share it, so a cluster never answers `CROSSSLOT`), and
/// never collide with the key they imitate. Returns the Redis keys it used.
pub async fn hostile_keys(target: &Target) -> Vec<String> {
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = target
        .connect(builder(&clock).prefix(unique_prefix("hostile")))
        .await;
    let huge = vec![b'x'; 1 << 20];
    let mut keys = Vec::new();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingWindowLog] {
        let policy = Policy::new("keys", algorithm, Quota::per_second(1).unwrap()).unwrap();
        for key in [&b"}{victim"[..], b"\x00\xff binary", &huge] {
            assert!(store.check_one(key, &policy, 1).await.unwrap().is_allowed());
            let name = store.state_key(key, &policy);
            assert_eq!(name.matches('{').count(), 1, "{name}");
            assert!(name.len() < 80, "{} bytes", name.len());
            keys.push(name);
        }
        // The escaped key does not collide with the victim's own key.
        assert!(
            store
                .check_one(b"victim", &policy, 1)
                .await
                .unwrap()
                .is_allowed()
        );
        keys.push(store.state_key(b"victim", &policy));
    }
    keys
}
