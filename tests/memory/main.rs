//! The memory store under real threads: many threads hammering one key must admit
//! exactly what the algorithm admits for the same requests one at a time.
#![allow(clippy::unwrap_used)]

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use tollway_core::{Algorithm, ManualClock, MemoryStore, Policy, Quota};

const THREADS: usize = 4;
const PER_THREAD_PER_PHASE: usize = 2_000;
/// Clock steps between phases: a burst at one instant, then partial and full refills.
const STEPS_MS: [u64; 6] = [0, 10, 250, 999, 1_000, 60_000];

/// Runs every phase with `THREADS` threads on one key and returns admitted units per
/// phase.
fn hammer(policy: &Policy) -> Vec<u64> {
    hammer_while(policy, false)
}

/// [`hammer`], with another thread sweeping the store over and over if `sweeping`.
fn hammer_while(policy: &Policy, sweeping: bool) -> Vec<u64> {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let barrier = Barrier::new(THREADS + 1);
    let admitted: Vec<AtomicU64> = STEPS_MS.iter().map(|_| AtomicU64::new(0)).collect();
    let done = AtomicBool::new(false);
    thread::scope(|s| {
        if sweeping {
            s.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    store.sweep();
                }
            });
        }
        for _ in 0..THREADS {
            s.spawn(|| {
                for phase in &admitted {
                    barrier.wait();
                    for _ in 0..PER_THREAD_PER_PHASE {
                        if store.check_sync(b"hot", policy, 1).is_allowed() {
                            phase.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    barrier.wait();
                }
            });
        }
        for step in STEPS_MS {
            clock.advance(Duration::from_millis(step));
            barrier.wait(); // start the phase
            barrier.wait(); // every thread done
        }
        done.store(true, Ordering::Relaxed);
    });
    admitted.iter().map(|a| a.load(Ordering::Relaxed)).collect()
}

/// The same requests, one at a time, through the same algorithm.
fn model(policy: &Policy) -> Vec<u64> {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    STEPS_MS
        .iter()
        .map(|&step| {
            clock.advance(Duration::from_millis(step));
            (0..THREADS * PER_THREAD_PER_PHASE)
                .filter(|_| store.check_sync(b"hot", policy, 1).is_allowed())
                .count() as u64
        })
        .collect()
}

#[test]
fn threads_hammering_one_key_admit_exactly_what_the_model_admits() {
    let quota = Quota::per_second(700).unwrap().with_burst(1_000).unwrap();
    for algorithm in Algorithm::ALL {
        let quota = if algorithm.uses_burst() {
            quota.clone()
        } else {
            Quota::per_second(700).unwrap()
        };
        let policy = Policy::new("hammer", algorithm, quota).unwrap();
        let expected = model(&policy);
        // The model is not vacuous: each phase admits some and denies some.
        let offered = (THREADS * PER_THREAD_PER_PHASE) as u64;
        assert!(
            expected.iter().all(|&n| n < offered) && expected.iter().sum::<u64>() > 0,
            "{algorithm:?}: {expected:?}"
        );
        assert_eq!(hammer(&policy), expected, "{algorithm:?}");
    }
}

// A sweep drops a key whose state is idle while threads decide on it: each phase after a
// long pause starts on an idle key, which the sweeper races the checks to remove. No
// admission may be lost with the removed state (over-admission) or counted twice.
#[test]
fn a_sweep_racing_the_checks_changes_no_count() {
    let quota = Quota::per_second(700).unwrap().with_burst(1_000).unwrap();
    for algorithm in [
        Algorithm::Gcra,
        Algorithm::LeakyBucketShaper,
        Algorithm::TokenBucket,
    ] {
        let policy = Policy::new("hammer", algorithm, quota.clone()).unwrap();
        assert_eq!(hammer_while(&policy, true), model(&policy), "{algorithm:?}");
    }
}

// Requests under one GCRA limit are decided without the shard's lock; requests under it
// and a second limit, under the lock. Both kinds at one instant on one key admit exactly
// the burst between them, and the second limit is charged for exactly its requests.
#[test]
fn one_limit_and_two_limit_requests_on_one_key_share_the_burst_exactly() {
    const BURST: u32 = 1_000;
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let quota = Quota::per_minute(60)
        .unwrap()
        .with_burst(BURST.into())
        .unwrap();
    let gcra = Policy::new("gcra", Algorithm::Gcra, quota).unwrap();
    let wide = Quota::per_minute(60).unwrap().with_burst(100_000).unwrap();
    let bucket = Policy::new("bucket", Algorithm::TokenBucket, wide).unwrap();
    let (alone, together) = (AtomicU64::new(0), AtomicU64::new(0));
    let barrier = Barrier::new(THREADS);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (store, gcra, bucket, barrier) = (&store, &gcra, &bucket, &barrier);
            let (alone, together) = (&alone, &together);
            s.spawn(move || {
                barrier.wait();
                for i in 0..PER_THREAD_PER_PHASE {
                    if (i + t) % 2 == 0 {
                        if store.check_sync(b"k", gcra, 1).is_allowed() {
                            alone.fetch_add(1, Ordering::Relaxed);
                        }
                    } else if store.decide(b"k", &[gcra, bucket], 1).is_allowed() {
                        together.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let (alone, together) = (alone.into_inner(), together.into_inner());
    assert_eq!(alone + together, u64::from(BURST), "{alone} + {together}");
    assert!(
        alone > 0 && together > 0,
        "both kinds admitted: {alone}, {together}"
    );
    let left = store.check_sync(b"k", &bucket, 0).remaining();
    assert_eq!(
        left,
        100_000 - together,
        "the bucket paid for its requests only"
    );
}

// A charge (a cost learnt after the fact) is one step on the key's state even while
// checks decide on the same key without the lock: every unit of every charge and every
// admitted check is in the state afterwards, whatever their order — the bucket is
// `T × units` ahead of now.
#[test]
fn charges_racing_checks_on_one_key_lose_no_unit() {
    use tollway_core::Operation;
    const CHARGES: u64 = 50;
    const UNITS: u64 = 3;
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    // 1,000 µs a unit; a burst of 1,000: the charges' 150 units are owed.
    let quota = Quota::per_second(1_000).unwrap().with_burst(1_000).unwrap();
    for algorithm in [Algorithm::Gcra, Algorithm::LeakyBucketShaper] {
        let policy = Policy::new(algorithm.name(), algorithm, quota.clone()).unwrap();
        let admitted = AtomicU64::new(0);
        let barrier = Barrier::new(THREADS);
        thread::scope(|s| {
            for t in 0..THREADS {
                let (store, policy, barrier, admitted) = (&store, &policy, &barrier, &admitted);
                s.spawn(move || {
                    barrier.wait();
                    if t == 0 {
                        for _ in 0..CHARGES {
                            store.apply(b"k", &[policy], Operation::Charge(UNITS));
                        }
                    } else {
                        for _ in 0..PER_THREAD_PER_PHASE {
                            if store.check_sync(b"k", policy, 1).is_allowed() {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                });
            }
        });
        let units = admitted.into_inner() + CHARGES * UNITS;
        let ahead = store.check_sync(b"k", &policy, 0).reset_after_micros();
        assert_eq!(ahead, units * 1_000, "{algorithm:?}: {units} units");
    }
}
