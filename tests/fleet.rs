//! A fleet of gateways against real Redis processes: the store suite of
//! tests/redis_store.rs on a local Redis Cluster, the deny cache's savings, and faults —
//! a server killed and restarted under load, paused, its scripts flushed, a cluster
//! master killed — through the `CircuitBreaker` wrapper.
//!
//! Where the point is a decision's value, time is a manual clock. Where real processes
//! fail, restart or fail over, real time passes: the tests then wait for the condition
//! itself (the breaker's state, an answer from Redis, `CLUSTER NODES`), polled with a
//! deadline, never for a fixed sleep.

#![allow(clippy::unwrap_used)]

mod support;

#[path = "support/cluster.rs"]
mod cluster;

mod redis_store;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cluster::RedisCluster;
use redis::aio::MultiplexedConnection;
use redis_store::{EPOCH_US, Target, builder, command_calls};
use support::{CheckOne, RedisServer};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tollway_core::{
    Algorithm, BreakerState, CircuitBreaker, Decision, ManualClock, Policy, Quota, RedisStore,
    Store, StoreError,
};

/// Drops its items: tests/redis_store.rs keeps its one-server tests inside
/// `crate::standalone_only!`, and this binary runs its suite against a cluster instead.
macro_rules! drop_items {
    ($($item:item)*) => {};
}
pub(crate) use drop_items as standalone_only;

/// The Redis store's per-call timeout in the fault tests.
const TIMEOUT: Duration = Duration::from_millis(200);
/// What an answer may take beyond the timeout: the scheduler's slack on a busy machine.
const MARGIN: Duration = Duration::from_millis(100);
/// How long an open breaker keeps calls away from Redis.
const COOL_DOWN: Duration = Duration::from_millis(250);

// ---------------------------------------------------------------------------------------
// The store suite on a cluster
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_decides_exactly_like_the_rust_functions() {
    let cluster = RedisCluster::start().await;
    let keys = redis_store::conformance(&Target::Cluster(cluster.urls()), 2_500).await;
    cluster.assert_on_every_master(&keys).await;
}

/// All of a caller's limits share its hash tag, so one script decides them on the master
/// that owns the caller's slot: no `CROSSSLOT`, whatever limits a request has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_several_limits_decide_on_the_cluster_in_one_script() {
    let cluster = RedisCluster::start().await;
    redis_store::conformance_multi(&Target::Cluster(cluster.urls()), 1_500).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_the_cluster_never_admit_more_than_the_model() {
    let cluster = RedisCluster::start().await;
    let keys = redis_store::atomicity(&Target::Cluster(cluster.urls())).await;
    cluster.assert_on_every_master(&keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_survive_script_flush_on_every_cluster_node() {
    let cluster = RedisCluster::start().await;
    let keys = redis_store::script_flush(&Target::Cluster(cluster.urls())).await;
    cluster.assert_on_every_master(&keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_expire_when_their_state_is_fresh_again() {
    let cluster = RedisCluster::start().await;
    let keys = redis_store::expiry(&Target::Cluster(cluster.urls())).await;
    cluster.assert_on_every_master(&keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_quota_starts_afresh_on_the_cluster() {
    let cluster = RedisCluster::start().await;
    redis_store::a_changed_quota_starts_afresh(&Target::Cluster(cluster.urls())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_keys_cannot_choose_their_cluster_slot() {
    let cluster = RedisCluster::start().await;
    redis_store::hostile_keys(&Target::Cluster(cluster.urls())).await;
}

// ---------------------------------------------------------------------------------------
// The deny cache
// ---------------------------------------------------------------------------------------

/// Script calls a node took: `EVALSHA` (`NOSCRIPT` replies included) and `EVAL`.
async fn script_calls(node: &mut MultiplexedConnection) -> u64 {
    command_calls(node, "evalsha").await + command_calls(node, "eval").await
}

/// One key floods two nodes (two stores, each on its own connection) with 10,000
/// unit-cost requests, a 100 µs step of a shared manual clock apart: a second in all,
/// three retry periods of a 3-per-second token bucket. Returns every decision and the
/// script calls the (fresh) server took.
async fn flood(cache: bool) -> (Vec<Decision>, u64) {
    let server = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let mut nodes = Vec::new();
    for _ in 0..2 {
        let node = if cache {
            builder(&clock)
        } else {
            builder(&clock).deny_cache(0)
        };
        nodes.push(node.connect(&server.url()).await.unwrap());
    }
    let policy = Policy::new(
        "flood",
        Algorithm::TokenBucket,
        Quota::per_second(3).unwrap(),
    )
    .unwrap();
    let mut decisions = Vec::with_capacity(10_000);
    for i in 0..10_000 {
        decisions.push(
            nodes[i % 2]
                .check_one(b"flooder", &policy, 1)
                .await
                .unwrap(),
        );
        clock.advance(Duration::from_micros(100));
    }
    let calls = script_calls(&mut server.connection().await).await;
    (decisions, calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deny_cache_answers_a_flood_locally_exactly_as_redis_would() {
    let (uncached, calls_without) = flood(false).await;
    let (cached, calls_with) = flood(true).await;
    println!(
        "10,000 requests from one key through two nodes: {calls_without} script calls \
         without the deny cache, {calls_with} with it"
    );
    // The trace spans three retry periods: the bucket admits 3 at once, then one more
    // at 333 ms and at 667 ms.
    let allowed = uncached.iter().filter(|d| d.is_allowed()).count();
    assert_eq!(allowed, 5);
    // Field by field, the same answers.
    if let Some(i) = (0..uncached.len()).find(|&i| cached[i] != uncached[i]) {
        panic!(
            "request {i}: Redis said {:?}, the deny cache {:?}",
            uncached[i], cached[i]
        );
    }
    // Every request reached Redis without the cache (plus the one NOSCRIPT that loaded
    // the script on the fresh server); with it, a handful did.
    assert_eq!(calls_without, 10_001);
    assert!(calls_with <= 20, "{calls_with} script calls with the cache");
}

// ---------------------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------------------

/// Waits until `done` holds, for at most `within`, checking it again whenever the load
/// reports an answer (no polling interval: the load's own progress drives the wait).
async fn wait_for(what: &str, within: Duration, load: &Load, done: impl FnMut() -> bool) {
    assert!(
        holds_within(within, load, done).await,
        "waited {within:?} for {what}"
    );
}

/// Whether `done` comes to hold within `within`; see [`wait_for`].
async fn holds_within(within: Duration, load: &Load, mut done: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let answered = load.progress.notified();
        tokio::pin!(answered);
        // Registered before `done` is read, so no answer between the two is missed.
        answered.as_mut().enable();
        if done() {
            return true;
        }
        if tokio::time::timeout_at(deadline, answered).await.is_err() {
            return false;
        }
    }
}

/// Where an answer came from. The local fallback gives this node half of each quota, so
/// its decisions carry half Redis's limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Redis,
    Fallback,
    Error,
}

/// One answered request: which caller, when its call began and ended (since the load
/// started), and where the answer came from.
#[derive(Clone, Copy, Debug)]
struct Answer {
    caller: usize,
    began: Duration,
    ended: Duration,
    source: Source,
}

impl Answer {
    fn took(&self) -> Duration {
        self.ended - self.began
    }
}

/// Concurrent callers, one task each, sending a request every millisecond or so until
/// stopped, each recording every answer.
struct Load {
    start: Instant,
    stop: Arc<AtomicBool>,
    /// Woken after every answer, for [`wait_for`].
    progress: Arc<Notify>,
    redis_answers: Arc<AtomicU64>,
    /// Per caller, when the latest call answered by Redis began (µs since the start).
    latest_from_redis: Arc<Vec<AtomicU64>>,
    tasks: Vec<JoinHandle<Vec<Answer>>>,
}

impl Load {
    /// A bound on each task's requests, whatever happens to the stop flag.
    const MAX_REQUESTS: usize = 30_000;

    fn start<S>(store: &S, policy: &Policy, callers: &[String], redis_limit: u64) -> Load
    where
        S: Store + Clone + Send + Sync + 'static,
        S::Future: Send,
    {
        let start = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(Notify::new());
        let redis_answers = Arc::new(AtomicU64::new(0));
        let latest_from_redis: Arc<Vec<AtomicU64>> =
            Arc::new(callers.iter().map(|_| AtomicU64::new(0)).collect());
        let tasks = callers
            .iter()
            .enumerate()
            .map(|(caller, key)| {
                let (store, policy, key) = (store.clone(), policy.clone(), key.clone());
                let (stop, redis_answers) = (Arc::clone(&stop), Arc::clone(&redis_answers));
                let latest = Arc::clone(&latest_from_redis);
                let progress = Arc::clone(&progress);
                tokio::spawn(async move {
                    let mut answers = Vec::new();
                    for _ in 0..Self::MAX_REQUESTS {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let began = start.elapsed();
                        let result: Result<Decision, StoreError> =
                            store.check_one(key.as_bytes(), &policy, 1).await;
                        let ended = start.elapsed();
                        let source = match result {
                            Ok(d) if d.limit() == redis_limit => Source::Redis,
                            Ok(_) => Source::Fallback,
                            Err(_) => Source::Error,
                        };
                        if source == Source::Redis {
                            redis_answers.fetch_add(1, Ordering::Relaxed);
                            let us = u64::try_from(began.as_micros()).unwrap();
                            latest[caller].fetch_max(us, Ordering::Relaxed);
                        }
                        answers.push(Answer {
                            caller,
                            began,
                            ended,
                            source,
                        });
                        progress.notify_waiters();
                        // Pacing, not waiting: each caller sends about one request a
                        // millisecond, so the load lasts through the outage it observes.
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    answers
                })
            })
            .collect();
        Load {
            start,
            stop,
            progress,
            redis_answers,
            latest_from_redis,
            tasks,
        }
    }

    fn now(&self) -> Duration {
        self.start.elapsed()
    }

    fn redis_answers(&self) -> u64 {
        self.redis_answers.load(Ordering::Relaxed)
    }

    /// Whether `caller`'s requests reached Redis again in a call that began after `t`.
    fn redis_answered_since(&self, caller: usize, t: Duration) -> bool {
        self.latest_from_redis[caller].load(Ordering::Relaxed)
            > u64::try_from(t.as_micros()).unwrap()
    }

    async fn finish(self) -> Vec<Answer> {
        self.stop.store(true, Ordering::Relaxed);
        let mut answers = Vec::new();
        for task in self.tasks {
            answers.extend(task.await.unwrap());
        }
        answers
    }
}

fn count(answers: &[Answer], source: Source) -> usize {
    answers.iter().filter(|a| a.source == source).count()
}

fn slowest(answers: &[Answer]) -> Duration {
    answers.iter().map(Answer::took).max().unwrap()
}

/// Kills the server under a load of 16 concurrent callers through a breaker, measures a
/// request's cost while the breaker is open, restarts the server and measures how soon
/// decisions come from Redis again.
async fn redis_dies_and_comes_back_under_load(fallback: bool) {
    let mut server = RedisServer::start();
    // No deny cache: every decision reached Redis or did not.
    let redis = RedisStore::builder()
        .timeout(TIMEOUT)
        .deny_cache(0)
        .connect(&server.url())
        .await
        .unwrap();
    let states = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&states);
    let mut resilient = CircuitBreaker::builder(redis)
        .threshold(5)
        .cool_down(COOL_DOWN)
        .on_state_change(move |s| log.lock().unwrap().push(s));
    if fallback {
        resilient = resilient.local_fallback(0.5);
    }
    let store = resilient.build().unwrap();
    let policy = Policy::new(
        "outage",
        Algorithm::Gcra,
        Quota::per_second(1_000_000).unwrap(),
    )
    .unwrap();
    let redis_limit = store
        .check_one(b"warm-up", &policy, 1)
        .await
        .unwrap()
        .limit();
    let callers: Vec<String> = (0..16).map(|c| format!("caller-{c}")).collect();
    let load = Load::start(&store, &policy, &callers, redis_limit);
    let within = Duration::from_secs(10);
    wait_for("answers from Redis", within, &load, || {
        load.redis_answers() >= 100
    })
    .await;

    server.kill();
    let killed = load.now();
    wait_for("the breaker to open", within, &load, || {
        store.state() == BreakerState::Open
    })
    .await;
    // While the breaker is open a request costs microseconds, not a timeout.
    let mut open = Vec::with_capacity(1_000);
    for _ in 0..1_000 {
        let began = Instant::now();
        let answer = store.check_one(b"while-open", &policy, 1).await;
        open.push(began.elapsed());
        match answer {
            Ok(d) => assert!(fallback && d.limit() < redis_limit, "{d:?}"),
            Err(_) => assert!(!fallback),
        }
    }
    open.sort_unstable();
    let (median, p99) = (open[500], open[990]);
    // A probe while Redis is down fails, and the breaker opens again.
    wait_for("a failed probe", within, &load, || {
        let states = states.lock().unwrap();
        states
            .windows(2)
            .any(|w| w == [BreakerState::HalfOpen, BreakerState::Open])
    })
    .await;

    server.restart();
    let restarted = load.now();
    wait_for(
        "a decision from Redis after the restart",
        within,
        &load,
        || (0..callers.len()).any(|c| load.redis_answered_since(c, restarted)),
    )
    .await;
    let recovered_count = load.redis_answers();
    wait_for("more decisions from Redis", within, &load, || {
        load.redis_answers() >= recovered_count + 300
    })
    .await;
    let answers = load.finish().await;

    // Every request was answered within the timeout, plus the scheduler's slack.
    let slowest = slowest(&answers);
    assert!(slowest <= TIMEOUT + MARGIN, "an answer took {slowest:?}");
    // While Redis was away, answers came from the fallback or were errors, per policy.
    let (local, errors) = (
        count(&answers, Source::Fallback),
        count(&answers, Source::Error),
    );
    if fallback {
        assert!(local > 0 && errors == 0, "{local} local, {errors} errors");
    } else {
        assert!(local == 0 && errors > 0, "{local} local, {errors} errors");
    }
    // From the restart, how long until a decision came from Redis again; once one did,
    // every call that began afterwards went to Redis.
    let first = answers
        .iter()
        .filter(|a| a.source == Source::Redis && a.began >= restarted)
        .min_by_key(|a| a.ended)
        .unwrap();
    let recovery = first.ended - restarted;
    assert!(
        recovery < Duration::from_secs(1),
        "decisions came from Redis {recovery:?} after the restart"
    );
    let stragglers: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.began > first.ended && a.source != Source::Redis)
        .collect();
    assert!(
        stragglers.is_empty(),
        "after recovery: {:?}",
        &stragglers[..stragglers.len().min(5)]
    );
    // And they did reach the restarted server.
    assert!(script_calls(&mut server.connection().await).await > 0);
    assert!(
        median < Duration::from_millis(1),
        "median {median:?} while open"
    );
    println!(
        "fallback {fallback}: {} answers ({} from Redis, {local} local, {errors} errors), \
         slowest {slowest:?}; Redis killed at {killed:?}; while the breaker was open a \
         request took {median:?} (median), {p99:?} (p99); decisions from Redis again \
         {recovery:?} after the restart; breaker states {:?}",
        answers.len(),
        count(&answers, Source::Redis),
        states.lock().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_redis_under_load_falls_back_locally_in_time_and_recovers() {
    redis_dies_and_comes_back_under_load(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_redis_under_load_fails_fast_without_a_fallback_and_recovers() {
    redis_dies_and_comes_back_under_load(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pause_longer_than_the_timeout_is_answered_within_it() {
    const PAUSE: Duration = Duration::from_millis(1_000);
    let server = RedisServer::start();
    let store = RedisStore::builder()
        .timeout(TIMEOUT)
        .deny_cache(0)
        .connect(&server.url())
        .await
        .unwrap();
    let policy = Policy::new(
        "pause",
        Algorithm::TokenBucket,
        Quota::per_minute(1_000).unwrap(),
    )
    .unwrap();
    assert!(
        store
            .check_one(b"k", &policy, 1)
            .await
            .unwrap()
            .is_allowed()
    );

    let mut admin = server.connection().await;
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(PAUSE.as_millis().to_string())
        .arg("ALL")
        .query_async(&mut admin)
        .await
        .unwrap();
    let paused = Instant::now();
    let calls: Vec<_> = (0..32)
        .map(|_| {
            let (store, policy) = (store.clone(), policy.clone());
            tokio::spawn(async move {
                let began = Instant::now();
                let answer = store.check_one(b"k", &policy, 1).await;
                (began.elapsed(), answer)
            })
        })
        .collect();
    for call in calls {
        let (took, answer) = call.await.unwrap();
        assert!(answer.is_err(), "answered while paused: {answer:?}");
        assert!(took <= TIMEOUT + MARGIN, "an answer took {took:?}");
    }
    let answered = paused.elapsed();
    assert!(answered < PAUSE, "answers came {answered:?} into the pause");

    // When the pause ends, decisions come back. (The timed-out calls were already sent;
    // Redis may still run them then, so a timeout is not a promise that nothing counted.)
    let mut back = None;
    for _ in 0..50 {
        if let Ok(d) = store.check_one(b"k", &policy, 1).await {
            back = Some((paused.elapsed(), d));
            break;
        }
        // A failed call took the whole timeout: no sleep needed between tries.
    }
    let (back, decision) = back.expect("decisions after the pause");
    assert!(
        back >= PAUSE - Duration::from_millis(50) && back < PAUSE + Duration::from_secs(2),
        "decisions came back {back:?} into a {PAUSE:?} pause"
    );
    println!(
        "CLIENT PAUSE {PAUSE:?}: 32 concurrent calls answered (errors) within {answered:?}; \
         decisions back after {back:?}, remaining {} of 1000",
        decision.remaining()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_mid_load_fails_no_decision() {
    const TASKS: usize = 16;
    const PER_TASK: usize = 150;
    const LIMIT: u64 = 250;
    let server = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let mut gateways = Vec::new();
    for _ in 0..2 {
        // No deny cache: every request is a script call that a flush can hit.
        gateways.push(
            builder(&clock)
                .deny_cache(0)
                .connect(&server.url())
                .await
                .unwrap(),
        );
    }
    let policy = Policy::new(
        "flush",
        Algorithm::SlidingWindowLog,
        Quota::per_minute(250).unwrap(),
    )
    .unwrap();
    let tasks: Vec<JoinHandle<(usize, u64, Vec<StoreError>)>> = (0..TASKS)
        .map(|t| {
            let store = gateways[t % 2].clone();
            let policy = policy.clone();
            let key = t / 2 % 4;
            tokio::spawn(async move {
                let (mut admitted, mut errors) = (0, Vec::new());
                for _ in 0..PER_TASK {
                    match store
                        .check_one(format!("k{key}").as_bytes(), &policy, 1)
                        .await
                    {
                        Ok(d) => admitted += u64::from(d.is_allowed()),
                        Err(e) => errors.push(e),
                    }
                }
                (key, admitted, errors)
            })
        })
        .collect();
    let mut admin = server.connection().await;
    let mut flushes = 0;
    while flushes < 1_000 && !tasks.iter().all(JoinHandle::is_finished) {
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
        flushes += 1;
        // Each flush is a round trip: that paces the loop, and the load runs meanwhile.
        tokio::task::yield_now().await;
    }
    let mut admitted = [0u64; 4];
    for task in tasks {
        let (key, n, errors) = task.await.unwrap();
        assert!(errors.is_empty(), "failed decisions: {errors:?}");
        admitted[key] += n;
    }
    // Exact, as if nothing had happened: each key admitted its limit.
    assert_eq!(admitted, [LIMIT; 4]);
    // The flushes did land mid-load: scripts were reloaded with EVAL after NOSCRIPT.
    let reloads = command_calls(&mut admin, "eval").await;
    assert!(
        flushes >= 3 && reloads >= 3,
        "{flushes} flushes, {reloads} reloads"
    );
    println!(
        "{} decisions, {flushes} SCRIPT FLUSHes, {reloads} reloads by EVAL, none failed",
        TASKS * PER_TASK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_cluster_master_is_replaced_and_the_limiter_carries_on() {
    let mut cluster = RedisCluster::start().await;
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let redis = RedisStore::builder()
        .timeout(TIMEOUT)
        .deny_cache(0)
        .connect_cluster(&urls)
        .await
        .unwrap();
    let store = CircuitBreaker::builder(redis)
        .threshold(5)
        .cool_down(COOL_DOWN)
        .local_fallback(0.5)
        .build()
        .unwrap();
    let policy = Policy::new(
        "failover",
        Algorithm::Gcra,
        Quota::per_second(1_000_000).unwrap(),
    )
    .unwrap();
    let callers: Vec<String> = (0..24).map(|c| format!("caller-{c}")).collect();
    // GCRA keeps one Redis key per caller.
    let keys: Vec<String> = callers
        .iter()
        .map(|c| store.primary().state_key(c.as_bytes(), &policy))
        .collect();
    cluster.assert_on_every_master(&keys).await;
    let owners = cluster.masters_of(&keys).await;
    let victim = owners[&keys[0]];
    let orphans: Vec<usize> = (0..callers.len())
        .filter(|&c| owners[&keys[c]] == victim)
        .collect();
    let redis_limit = store
        .check_one(b"warm-up", &policy, 1)
        .await
        .unwrap()
        .limit();
    let load = Load::start(&store, &policy, &callers, redis_limit);
    let within = Duration::from_secs(10);
    wait_for("answers from Redis", within, &load, || {
        load.redis_answers() >= 100
    })
    .await;

    // State held only by the dead master (writes its replica had not received yet) is
    // lost with it: its callers' limits restart from what the replica had, at worst
    // from nothing. The limiter itself carries on.
    let killed = load.now();
    let (promoted, failover) = cluster.kill_master(victim).await;
    let settled = load.now();
    let every_caller_back = holds_within(within, &load, || {
        (0..callers.len()).all(|c| load.redis_answered_since(c, settled))
    })
    .await;
    if !every_caller_back {
        // Say what the store answers those callers now, past the breaker.
        let mut now = String::new();
        for c in (0..callers.len()).filter(|&c| !load.redis_answered_since(c, settled)) {
            let answer = store
                .primary()
                .check_one(callers[c].as_bytes(), &policy, 1)
                .await;
            let owner = if orphans.contains(&c) {
                "the dead master's"
            } else {
                "a live master's"
            };
            now.push_str(&format!("\n  caller {c} ({owner}): {answer:?}"));
        }
        panic!(
            "waited {within:?} after the cluster settled for decisions from Redis for every \
             caller; breaker {:?}; none came for these, which Redis answers now:{now}",
            store.state()
        );
    }
    let answers = load.finish().await;

    let slowest = slowest(&answers);
    assert!(slowest <= TIMEOUT + MARGIN, "an answer took {slowest:?}");
    assert_eq!(count(&answers, Source::Error), 0);
    let back = orphans
        .iter()
        .map(|&c| {
            answers
                .iter()
                .filter(|a| a.caller == c && a.source == Source::Redis && a.began >= settled)
                .map(|a| a.ended - settled)
                .min()
                .unwrap()
        })
        .max()
        .unwrap();
    assert!(back < Duration::from_secs(2), "{back:?}");
    println!(
        "master {victim} killed at {killed:?}; replica {promoted} took over, cluster settled \
         {failover:?} later; the dead master's {} callers reached Redis again {back:?} after \
         that; {} answers, {} local, slowest {slowest:?}",
        orphans.len(),
        answers.len(),
        count(&answers, Source::Fallback)
    );
}

/// Regression: a probe whose caller gives up (a client disconnects, an outer timeout
/// fires: the future is dropped) once left the breaker half-open for good, every later
/// call skipping Redis although it had come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_probe_does_not_leave_the_breaker_half_open() {
    let server = RedisServer::start();
    let redis = RedisStore::builder()
        .timeout(TIMEOUT)
        .deny_cache(0)
        .connect(&server.url())
        .await
        .unwrap();
    // The breaker's cool-down runs on a manual clock: the test moves it, never waits.
    let clock = ManualClock::new();
    let store = CircuitBreaker::builder(redis)
        .threshold(1)
        .cool_down(COOL_DOWN)
        .clock(clock.clone())
        .build()
        .unwrap();
    let policy = Policy::new("probe", Algorithm::Gcra, Quota::per_second(100).unwrap()).unwrap();
    assert!(store.check_one(b"k", &policy, 1).await.is_ok());

    // Scripts wait (writes are paused) while the admin connection still works.
    let mut admin = server.connection().await;
    let () = redis::cmd("CLIENT")
        .arg(&["PAUSE", "60000", "WRITE"])
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(store.check_one(b"k", &policy, 1).await.is_err());
    assert_eq!(store.state(), BreakerState::Open);
    // While open, calls skip Redis; after the cool-down the next call is the probe, and
    // its caller abandons it.
    assert!(store.check_one(b"k", &policy, 1).await.is_err());
    assert_eq!(store.state(), BreakerState::Open);
    clock.advance(COOL_DOWN);
    let probe = store.check_one(b"k", &policy, 1);
    assert_eq!(store.state(), BreakerState::HalfOpen);
    assert!(
        tokio::time::timeout(Duration::from_millis(20), probe)
            .await
            .is_err(),
        "the probe cannot answer while Redis is paused"
    );
    let () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query_async(&mut admin)
        .await
        .unwrap();
    // Redis answers again: the next call probes it and closes the breaker.
    let answer = store.check_one(b"k", &policy, 1).await;
    assert!(
        answer.is_ok(),
        "still {:?} after Redis came back: {answer:?}",
        store.state()
    );
    assert_eq!(store.state(), BreakerState::Closed);
}
