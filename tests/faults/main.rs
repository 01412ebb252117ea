//! Faults, with real processes: a Redis server killed and restarted under load,
//! paused, its scripts flushed mid-load; a cluster master killed; a Sentinel primary
//! failed over; a probe abandoned; and
//! what an HTTP and a gRPC server answer while their Redis is dead.
//!
//! Strict on outcomes — no over-admission, every request answered, the breaker opens and
//! closes, decisions come back from Redis — and generous on time: the bounds below are
//! what a loaded CI machine always meets, beside the timeouts they are measured against.
//! Where real processes fail, restart or fail over, real time passes: the tests wait for
//! the condition itself (the breaker's state, an answer from Redis, `CLUSTER NODES`),
//! never for a fixed sleep.
//!
//! Every test here starts its own Redis: each kills, pauses or restarts it.

#![allow(clippy::unwrap_used)]

mod answers;
mod breaker;
mod cluster;
mod in_flight;
mod leases;
mod migration;
mod outage;
mod sentinel;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::StatusCode;
use support::catalog::Catalog;
use support::cluster::RedisCluster;
use support::http as web;
use support::http::Hits;
use support::stores::{EPOCH_S, EPOCH_US, per_minute};
use support::suites::builder;
use support::{CheckOne, RedisServer, command_calls, grpc, script_calls, within};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tollway_core::{
    Algorithm, BreakerState, CircuitBreaker, Decision, ManualClock, Policy, Quota, RedisStore,
    Store, StoreError,
};
use tollway_tower::{OnStoreError, RateLimitLayer};
use tonic::Code;
use tonic_types::StatusExt;

/// The Redis store's per-call timeout in these tests.
const TIMEOUT: Duration = Duration::from_millis(200);
/// What an answer may take beyond the timeout: the scheduler's slack on a loaded machine
/// (a healthy one needs a millisecond).
const SLACK: Duration = Duration::from_secs(2);
/// How long an open breaker keeps calls away from Redis.
const COOL_DOWN: Duration = Duration::from_millis(250);
/// The longest a condition the tests wait for may take (Redis answering again, a
/// breaker changing state): ample on a loaded machine, where it takes milliseconds.
const WAIT_WITHIN: Duration = Duration::from_secs(20);
/// How soon after Redis is back (a restart, the end of a pause, a settled failover)
/// decisions must come from it again.
const RECOVER_WITHIN: Duration = Duration::from_secs(10);

/// A Redis store with nothing in front of Redis: the `TIMEOUT`, no deny cache (every
/// decision reaches Redis or fails), and no breaker or fallback of its own — the tests
/// that want them wrap it in a `CircuitBreaker` under test.
fn unguarded() -> tollway_core::RedisStoreBuilder {
    support::redis_store()
        .timeout(TIMEOUT)
        .deny_cache(0)
        .without_breaker()
        .without_local_fallback()
}

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
