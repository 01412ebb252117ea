//! The conformance traces against Redis: `tollway_core::testing`'s, through a store
//! without the deny cache and one with it; then what only Redis has, its `TIME`.

use std::collections::BTreeSet;
use std::time::Duration;

use tollway_core::testing::{Conformance, cost};
use tollway_core::{Algorithm, Clock, Decision, Denial, ManualClock, MemoryStore, Policy, Quota};

use super::{Target, builder};
use crate::redis::unique_prefix;
use crate::stores::EPOCH_US;
use crate::{CheckOne, Rng};

/// Which of allowed (0), limited (1) and refused (2) a decision is, to show a trace
/// exercises all three.
fn outcome(decision: &Decision) -> usize {
    match decision.denial() {
        None => 0,
        Some(Denial::Limited) => 1,
        Some(_) => 2,
    }
}

/// Replays `tollway_core::testing`'s one-limit trace of `events` events per algorithm
/// through two Redis stores, each against the memory store on a pinned clock: one
/// without the deny cache, so that every decision is the script's, and one with it (the
/// default), whose local answers must be the same. Returns the Redis keys it used.
pub async fn conformance(target: &Target, events: usize) -> Vec<String> {
    let suite = Conformance::new(events);
    let clock = ManualClock::at_micros(EPOCH_US);
    let scripts = target
        .connect(
            builder(&clock)
                .prefix(unique_prefix("script"))
                .deny_cache(0),
        )
        .await;
    let report = suite
        .clone()
        .named("script")
        .one_limit(&scripts, &clock)
        .await;
    let clock = ManualClock::at_micros(EPOCH_US);
    let cached = target
        .connect(builder(&clock).prefix(unique_prefix("cached")))
        .await;
    suite.named("deny cache").one_limit(&cached, &clock).await;
    let keys: BTreeSet<String> = report
        .used()
        .map(|(key, policy)| scripts.state_key(key, policy))
        .collect();
    keys.into_iter().collect()
}

/// The conformance trace in server-time mode: each script call reads Redis's `TIME` and
/// tells the time it read, and the memory store, fed that time, must decide the same,
/// field by field. Each policy's limit is raised and then cut in its part of the trace. The gaps are what the calls take (tens to hundreds of µs), so the
/// quotas are short enough for refills and window boundaries to happen among them.
/// Returns the Redis keys it used.
pub async fn conformance_server_time(target: &Target, events: usize) -> Vec<String> {
    const CALLERS: u64 = 4;
    let clock = ManualClock::at_micros(0);
    let scripts = target
        .connect(
            crate::redis_store()
                .without_local_fallback()
                .timeout(Duration::from_secs(5))
                .prefix(unique_prefix("server-time"))
                .deny_cache(0),
        )
        .await;
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let mut rng = Rng(0x5e77_e7ed);
    let specs: [(u64, u64, u64); 4] = [
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
            // Each policy's quota is raised, then cut, in its part of the trace: usage
            // carries across each change.
            let (limit, burst) = match i % segment * 3 / segment {
                0 => (limit, burst),
                1 => (limit * 3, burst * 3 + 1),
                _ => ((limit / 3).max(1), (burst / 3).max(1)),
            };
            let quota = Quota::with_period(limit, Duration::from_micros(period)).unwrap();
            let quota = if algorithm.uses_burst() {
                quota.with_burst(burst).unwrap()
            } else {
                quota
            };
            let policy =
                Policy::new(format!("time{}", i / segment), algorithm, quota.clone()).unwrap();
            let cost = cost(&mut rng, &quota, algorithm);
            let caller = format!("caller-{}", rng.below(CALLERS));
            let (decisions, told) = scripts
                .check_telling_time(caller.as_bytes(), &[&policy], cost)
                .await
                .unwrap();
            assert!(told >= clock.now_micros(), "Redis's TIME went back: {told}");
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
        self.0.now_micros() + self.1
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
    // Concurrency keeps a field a gateway in Redis, so one state fed both clocks is not
    // its model; its own suite covers several gateways.
    let skewable = Algorithm::ALL
        .into_iter()
        .filter(|&a| a != Algorithm::Concurrency);
    for algorithm in skewable {
        let policy = Policy::new(format!("skew-{algorithm:?}"), algorithm, quota.clone()).unwrap();
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
                    fed.set_micros(truth.now_micros() + u64::from(ahead) * SKEW_US);
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
        crate::redis_store()
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
        let policy = Policy::new(
            format!("skew-server-{algorithm:?}"),
            algorithm,
            quota.clone(),
        )
        .unwrap();
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

/// Replays `tollway_core::testing`'s all-or-nothing trace of `events` events (requests
/// against one to four limits of different algorithms, one event in four an
/// [`Operation`](tollway_core::Operation)) through two Redis stores, each against the
/// memory store on a pinned clock: every answer of the store without the deny cache must
/// be the same. The store with the deny cache may answer a repeated refusal locally: its
/// refusals must be exact, and the limits that did not refuse may report fewer remaining
/// units than they have (what Redis said at the refusal), never more. Returns the keys.
pub async fn conformance_multi(target: &Target, events: usize) -> Vec<String> {
    let suite = Conformance::new(events);
    let clock = ManualClock::at_micros(EPOCH_US);
    let scripts = target
        .connect(builder(&clock).prefix(unique_prefix("multi")).deny_cache(0))
        .await;
    let report = suite
        .clone()
        .named("script")
        .all_or_nothing(&scripts, &clock)
        .await;
    let clock = ManualClock::at_micros(EPOCH_US);
    let cached = target
        .connect(builder(&clock).prefix(unique_prefix("multi-cached")))
        .await;
    suite
        .named("deny cache")
        .stale_remaining_when_refused()
        .all_or_nothing(&cached, &clock)
        .await;
    let keys: BTreeSet<String> = report
        .used()
        .map(|(key, policy)| scripts.state_key(key, policy))
        .collect();
    keys.into_iter().collect()
}
