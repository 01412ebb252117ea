//! Loans from Redis: the Lua `lend` against the memory store's, on the caller's clock and
//! on the server's; and gateways leasing from one Redis at once, never over the limit.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollway_core::testing::Conformance;
use tollway_core::{
    Algorithm, Checked, Clock as _, Leased, LendFuture, ManualClock, MemoryStore, Operation,
    Policy, Quota, Store,
};

use super::{Target, builder};
use crate::redis::unique_prefix;
use crate::stores::EPOCH_US;

/// `tollway_core::testing`'s loan trace of `events` events through Redis (no deny
/// cache, so that every grant is the script's) against the memory store on a pinned
/// clock. Returns the Redis keys it used.
pub async fn lend_conformance(target: &Target, events: usize) -> Vec<String> {
    let clock = ManualClock::at_micros(EPOCH_US);
    let scripts = target
        .connect(builder(&clock).prefix(unique_prefix("lend")).deny_cache(0))
        .await;
    let report = Conformance::new(events)
        .named("lend")
        .lending(&scripts, &clock)
        .await;
    let mut keys: Vec<String> = report
        .used()
        .map(|(key, policy)| scripts.state_key(key, policy))
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// Loans on the server's clock: each call reads Redis's `TIME` and tells it, and the
/// memory store fed that time lends the same. Short periods, so that refills and
/// window boundaries fall among the calls. Returns the Redis keys it used.
pub async fn lend_conformance_server_time(target: &Target, events: usize) -> Vec<String> {
    let clock = ManualClock::at_micros(0);
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let scripts = target
        .connect(
            crate::redis_store()
                .without_local_fallback()
                .timeout(Duration::from_secs(5))
                .prefix(unique_prefix("lend-time"))
                .deny_cache(0),
        )
        .await;
    let mut rng = crate::Rng(0x71e_1e4d);
    let mut keys = Vec::new();
    let mut lent = 0;
    for algorithm in Algorithm::ALL.into_iter().filter(|a| a.lends()) {
        let mut quota = Quota::with_period(40, Duration::from_millis(20)).unwrap();
        if algorithm.uses_burst() {
            quota = quota.with_burst(10).unwrap();
        }
        let policy =
            Policy::new(format!("lend-time-{}", algorithm.name()), algorithm, quota).unwrap();
        for i in 0..events {
            let cost = rng.below(3);
            let ask = rng.below(30);
            let (grant, told) = scripts
                .lend_telling_time(b"caller", &[&policy], cost, ask)
                .await
                .unwrap();
            assert!(told >= clock.now_micros(), "Redis's TIME went back: {told}");
            clock.set_micros(told);
            let expected = memory
                .lend(b"caller", &[&policy], cost, ask)
                .unwrap()
                .await
                .unwrap();
            assert_eq!(
                grant, expected,
                "{algorithm:?} loan {i} at TIME {told} cost {cost} ask {ask}"
            );
            lent += u64::from(grant.units() > cost);
        }
        keys.push(scripts.state_key(b"caller", &policy));
    }
    println!("{lent} of {} loans lent more than their cost", 5 * events);
    assert!(
        lent > events as u64 / 5,
        "only {lent} loans lent more than their cost"
    );
    keys
}

/// A store that counts the calls made to it: checks, operations and loans.
#[derive(Clone, Debug)]
pub struct Counted<S> {
    store: S,
    calls: Arc<AtomicU64>,
}

impl<S> Counted<S> {
    /// Counts `store`'s calls.
    pub fn new(store: S) -> Self {
        Counted {
            store,
            calls: Arc::default(),
        }
    }

    /// The store it counts the calls of.
    pub fn inner(&self) -> &S {
        &self.store
    }

    /// The calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

impl<S: Store> Store for Counted<S> {
    type Future = S::Future;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<S::Future> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.store.check(key, policies, cost)
    }

    fn operate(&self, key: &[u8], policies: &[&Policy], op: Operation) -> Checked<S::Future> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.store.operate(key, policies, op)
    }

    fn lend(&self, key: &[u8], policies: &[&Policy], cost: u64, ask: u64) -> Option<LendFuture> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.store.lend(key, policies, cost, ask)
    }
}

/// Three gateways, each leasing from a Redis store of its own, and 66 tasks hammer three
/// keys per lending algorithm on a pinned clock (nothing refills, nothing goes bad).
/// First 5 requests a task, about the capacity of 100 a key: the loans lend (fewer than
/// half the requests call Redis) and most of the capacity is admitted (what is not is
/// held in the gateways' loans). Then 25 more a task: no key ever admits more than its
/// capacity. Returns the Redis keys it used.
pub async fn leased_atomicity(target: &Target) -> Vec<String> {
    const TASKS: usize = 66;
    let clock = ManualClock::at_micros(EPOCH_US);
    let prefix = unique_prefix("leased");
    let quota = Quota::per_minute(100).unwrap();
    let callers = ["hot-0", "hot-3", "hot-2"];
    let mut keys = Vec::new();
    for algorithm in Algorithm::ALL.into_iter().filter(|a| a.lends()) {
        let policy = Policy::new(
            format!("leased-{}", algorithm.name()),
            algorithm,
            quota.clone(),
        )
        .unwrap();
        let mut gateways = Vec::new();
        let mut counted = Vec::new();
        for _ in 0..3 {
            let store = Counted::new(
                target
                    .connect(builder(&clock).prefix(prefix.clone()).deny_cache(0))
                    .await,
            );
            counted.push(store.clone());
            gateways.push(
                Leased::builder(store)
                    .clock(clock.clone())
                    .min_units(2)
                    .max_share(0.2)
                    .build()
                    .unwrap(),
            );
        }
        let admitted: Arc<Vec<AtomicU64>> = Arc::new(callers.iter().map(|_| 0.into()).collect());
        let mut requests = 0;
        for (round, per_task) in [5, 25].into_iter().enumerate() {
            let mut handles = Vec::new();
            for t in 0..TASKS {
                let gateway = gateways[t % 3].clone();
                let k = t / 3 % callers.len();
                let (caller, policy) = (callers[k], policy.clone());
                let admitted = Arc::clone(&admitted);
                handles.push(tokio::spawn(async move {
                    for _ in 0..per_task {
                        let d = gateway
                            .check(caller.as_bytes(), &[&policy], 1)
                            .await
                            .unwrap();
                        if d.is_allowed() {
                            admitted[k].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }));
            }
            for h in handles {
                h.await.unwrap();
            }
            requests += (TASKS * per_task) as u64;
            let calls: u64 = counted.iter().map(Counted::calls).sum();
            println!("{algorithm:?} round {round}: {calls} store calls for {requests} requests");
            if round == 0 {
                assert!(
                    calls * 2 < requests,
                    "{algorithm:?}: {calls} store calls for {requests} requests: the loans did not lend"
                );
                for (caller, admitted) in callers.iter().zip(admitted.iter()) {
                    let admitted = admitted.load(Ordering::Relaxed);
                    assert!(
                        admitted >= 50,
                        "{algorithm:?}: {caller} admitted only {admitted}"
                    );
                }
            }
            for (caller, admitted) in callers.iter().zip(admitted.iter()) {
                let admitted = admitted.load(Ordering::Relaxed);
                assert!(
                    admitted <= 100,
                    "{algorithm:?}: {caller} admitted {admitted}, over its capacity of 100"
                );
            }
        }
        for caller in callers {
            keys.push(counted[0].inner().state_key(caller.as_bytes(), &policy));
        }
    }
    keys
}
