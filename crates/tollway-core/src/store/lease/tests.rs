//! Gateways leasing from one shared store never admit more than the algorithm would:
//! the exact algorithm, fed what they admitted at the instants they admitted it, admits
//! every request.

use std::time::Duration;

use super::Leased;
use crate::testing::Rng;
use crate::{Algorithm, Clock, ManualClock, MemoryStore, Policy, Quota, Store};

/// What a run of gateways admitted, and how often they called the shared store.
struct Run {
    admitted: Vec<(u64, u64)>,
    /// Every request, admitted or not.
    offered: Vec<(u64, u64)>,
    requests: u64,
    calls: u64,
}

/// `gateways` gateways leasing from one memory store on `clock`, sent `events`
/// requests (costs 1 to `max_cost`, round robin) `gap` µs apart, on average.
async fn run(
    policies: &[&Policy],
    gateways: usize,
    events: usize,
    gap: u64,
    max_cost: u64,
    seed: u64,
) -> Run {
    let clock = ManualClock::at_micros(1_000_000_000);
    let shared = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let counting = Counting::new(shared);
    let leased: Vec<_> = (0..gateways)
        .map(|_| {
            Leased::builder(counting.clone())
                .clock(clock.clone())
                .horizon(Duration::from_millis(50))
                .build()
                .unwrap()
        })
        .collect();
    let mut rng = Rng(seed);
    let (mut admitted, mut offered) = (Vec::new(), Vec::new());
    for i in 0..events {
        clock.advance(Duration::from_micros(rng.below(2 * gap + 1)));
        let cost = 1 + rng.below(max_cost);
        let decisions = leased[i % gateways]
            .check(b"hot", policies, cost)
            .await
            .unwrap();
        offered.push((clock.now_micros(), cost));
        if decisions.is_allowed() {
            admitted.push((clock.now_micros(), cost));
        }
        // Let background renewals land.
        tokio::task::yield_now().await;
    }
    Run {
        admitted,
        offered,
        requests: events as u64,
        calls: counting.calls(),
    }
}

/// How many of `offered` the exact algorithm admits, one at a time at its instant.
fn exact_admits(policies: &[&Policy], offered: &[(u64, u64)]) -> usize {
    let clock = ManualClock::at_micros(0);
    let model = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    offered
        .iter()
        .filter(|&&(at, cost)| {
            clock.set_micros(at);
            model.decide(b"model", policies, cost).is_allowed()
        })
        .count()
}

/// Whether the exact algorithm admits every one of `admitted`, fed at its instant.
fn exact_admits_all(policies: &[&Policy], admitted: &[(u64, u64)]) -> Result<(), String> {
    let clock = ManualClock::at_micros(0);
    let model = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    for (i, &(at, cost)) in admitted.iter().enumerate() {
        clock.set_micros(at);
        let decisions = model.decide(b"model", policies, cost);
        if !decisions.is_allowed() {
            return Err(format!(
                "admission {i} (cost {cost} at {at} µs) is over the limit: {decisions:?}"
            ));
        }
    }
    Ok(())
}

/// 2,000 a second; a burst of 400 for the buckets and GCRA.
fn quota(algorithm: Algorithm) -> Quota {
    let quota = Quota::per_second(2_000).unwrap();
    if algorithm.uses_burst() {
        quota.with_burst(400).unwrap()
    } else {
        quota
    }
}

/// The lending algorithms, at a quota whose loans hold tens of units.
fn policies() -> Vec<Policy> {
    Algorithm::ALL
        .into_iter()
        .filter(|a| a.lends())
        .map(|algorithm| Policy::new(algorithm.name(), algorithm, quota(algorithm)).unwrap())
        .collect()
}

// The claim the leases rest on: units spent later, on any gateway, never pass the limit.
// Three gateways, demand at a tenth, half, the limit and three times it.
#[tokio::test(flavor = "current_thread")]
async fn leased_admissions_are_what_the_exact_algorithm_admits() {
    for policy in policies() {
        for (gap, seed) in [(5_000, 1), (1_000, 2), (500, 3), (166, 4)] {
            let run = run(&[&policy], 3, 6_000, gap, 1, seed).await;
            exact_admits_all(&[&policy], &run.admitted)
                .unwrap_or_else(|e| panic!("{} at {gap} µs apart: {e}", policy.name()));
        }
    }
}

// All or nothing: a request under two leased limits spends both or neither.
#[tokio::test(flavor = "current_thread")]
async fn two_limits_leased_together_stay_under_both() {
    let minute = Quota::per_minute(90_000).unwrap();
    let pairs = [
        (Algorithm::Gcra, Algorithm::FixedWindow),
        (Algorithm::TokenBucket, Algorithm::SlidingWindowCounter),
        (Algorithm::LeakyBucket, Algorithm::Gcra),
    ];
    for (a, b) in pairs {
        let first = Policy::new("first", a, quota(a)).unwrap();
        let second = Policy::new("second", b, minute.clone()).unwrap();
        let policies = [&first, &second];
        let run = run(&policies, 3, 6_000, 300, 3, 7).await;
        exact_admits_all(&policies, &run.admitted).unwrap_or_else(|e| panic!("{a:?}+{b:?}: {e}"));
    }
}

// A hot key below its limit costs the shared store one call in tens of requests once
// it is hot; at three times its limit, the gateways still admit nearly all it allows.
// 50,000 a second: the rate at which one key on one Redis shard wants leases.
#[tokio::test(flavor = "current_thread")]
async fn a_hot_key_calls_the_store_rarely_and_admits_nearly_its_limit() {
    for algorithm in Algorithm::ALL.into_iter().filter(|a| a.lends()) {
        let mut quota = Quota::per_second(50_000).unwrap();
        if algorithm.uses_burst() {
            quota = quota.with_burst(5_000).unwrap();
        }
        let policy = Policy::new(algorithm.name(), algorithm, quota).unwrap();
        // Half the limit: 25,000 a second for 2 s.
        let below = run(&[&policy], 3, 50_000, 40, 1, 11).await;
        assert_eq!(
            below.admitted.len() as u64,
            below.requests,
            "{}: under the limit, every request is admitted",
            policy.name()
        );
        let per_call = below.requests / below.calls.max(1);
        assert!(
            per_call >= 20,
            "{}: {} calls for {} requests at half the limit",
            policy.name(),
            below.calls,
            below.requests
        );
        // Three times the limit, for 1.2 s; compared up to the end of the last whole
        // second (the windows' boundary), since units still held at the end of a run
        // are spent after it.
        let over = run(&[&policy], 3, 180_000, 7, 1, 12).await;
        let cut = over.offered.last().unwrap().0 / 1_000_000 * 1_000_000;
        let before = |events: &[(u64, u64)]| -> Vec<(u64, u64)> {
            events.iter().copied().filter(|e| e.0 < cut).collect()
        };
        let allowed = exact_admits(&[&policy], &before(&over.offered));
        let share = before(&over.admitted).len() as f64 / allowed as f64;
        assert!(
            share > 0.99,
            "{}: admitted {} of the {allowed} the limit allows",
            policy.name(),
            before(&over.admitted).len()
        );
        exact_admits_all(&[&policy], &over.admitted).unwrap();
        println!(
            "{}: {per_call} requests a call at half the limit; {:.1}% of the limit at three times it ({} calls)",
            policy.name(),
            share * 100.0,
            over.calls
        );
    }
}

/// A store that counts the calls made to it.
#[derive(Clone)]
struct Counting {
    store: MemoryStore<ManualClock>,
    calls: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Counting {
    fn new(store: MemoryStore<ManualClock>) -> Self {
        Counting {
            store,
            calls: Default::default(),
        }
    }

    fn calls(&self) -> u64 {
        self.calls.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn count(&self) {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Store for Counting {
    type Future = <MemoryStore<ManualClock> as Store>::Future;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> crate::Checked<Self::Future> {
        self.count();
        self.store.check(key, policies, cost)
    }

    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: crate::Operation,
    ) -> crate::Checked<Self::Future> {
        self.count();
        self.store.operate(key, policies, operation)
    }

    fn lend(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u64,
        ask: u64,
    ) -> Option<crate::LendFuture> {
        self.count();
        self.store.lend(key, policies, cost, ask)
    }
}

// A gateway that stops seeing a key gives its window units back after two horizons, so
// the last units of a period are not stuck in it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_idle_gateway_gives_its_window_units_back() {
    let clock = ManualClock::at_micros(1_000_000_000);
    let shared = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let policy = Policy::new(
        "window",
        Algorithm::FixedWindow,
        Quota::per_minute(6_000).unwrap(),
    )
    .unwrap();
    let gateway = Leased::builder(shared.clone())
        .clock(clock.clone())
        .horizon(Duration::from_millis(50))
        .build()
        .unwrap();
    for _ in 0..40 {
        clock.advance(Duration::from_micros(100));
        let decisions = gateway.check(b"hot", &[&policy], 1).await.unwrap();
        assert!(decisions.is_allowed());
        tokio::task::yield_now().await;
    }
    let remaining = || shared.apply(b"hot", &[&policy], crate::Operation::Peek(0))[0].remaining();
    assert!(
        remaining() < 6_000 - 40,
        "the gateway holds a loan: {}",
        remaining()
    );
    // Two horizons without a request, and the task that sweeps has run.
    clock.advance(Duration::from_millis(150));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(remaining(), 6_000 - 40, "what was not spent is back");
}

/// A limit cut while a gateway holds a loan under the old one: the loan's units count
/// against the new limit until they come back, and then the window admits the new
/// limit exactly, never more.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_cut_settles_outstanding_loans_against_the_new_limit() {
    let clock = ManualClock::at_micros(1_000_000_000);
    let shared = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let per_minute = |limit| {
        let quota = Quota::per_minute(limit).unwrap();
        Policy::new("window", Algorithm::FixedWindow, quota).unwrap()
    };
    let (before, cut) = (per_minute(6_000), per_minute(50));
    let gateway = Leased::builder(shared.clone())
        .clock(clock.clone())
        .horizon(Duration::from_millis(50))
        .build()
        .unwrap();
    let admit = async |policy: &Policy, requests: usize| {
        let mut admitted = 0;
        for _ in 0..requests {
            clock.advance(Duration::from_micros(100));
            if gateway
                .check(b"hot", &[policy], 1)
                .await
                .unwrap()
                .is_allowed()
            {
                admitted += 1;
            }
            tokio::task::yield_now().await;
        }
        admitted
    };
    assert_eq!(admit(&before, 40).await, 40);
    let while_lent = admit(&cut, 100).await;
    assert!(
        40 + while_lent <= 50,
        "{while_lent} more while the loan was out"
    );
    // Two horizons without a request: the old loan's units are back.
    clock.advance(Duration::from_millis(150));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = admit(&cut, 100).await;
    assert_eq!(40 + while_lent + after, 50);
}
