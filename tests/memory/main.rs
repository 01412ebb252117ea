//! The memory store under real threads: many threads hammering one key must admit
//! exactly what the algorithm admits for the same requests one at a time.
#![allow(clippy::unwrap_used)]

use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
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
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let barrier = Barrier::new(THREADS + 1);
    let admitted: Vec<AtomicU64> = STEPS_MS.iter().map(|_| AtomicU64::new(0)).collect();
    thread::scope(|s| {
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
            quota
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
