//! Side-by-side speed of tollgate's `MemoryStore::check_sync` and governor's default keyed
//! rate limiter, on the same quota.
//!
//! Run with `cargo bench -p tollgate-core --bench memory_store`.
//!
//! Both libraries run as their defaults: `MemoryStore::new()` (64 shards, a seeded foldhash,
//! the TSC clock through `quanta`) and `governor::RateLimiter::keyed` (a `DashMap` with the std
//! SipHash `RandomState`, the `quanta` TSC clock). Keys are `u64`s: governor is keyed by
//! the `u64` itself, tollgate by its 8-byte little-endian encoding, built once up front,
//! so neither side formats or allocates a key inside the measured loop.
//!
//! Groups:
//! - `hot_key`: one key, every check allowed;
//! - `10k_keys`: cycling through 10,000 distinct keys, every check allowed;
//! - `threads`: 1 and 2 threads over 10,000 keys (each thread on its own share of the
//!   keys); the time reported is wall time per check across all threads, so the
//!   `elem/s` line is the total throughput;
//!   `baseline_no_shared_state` is arithmetic that shares nothing between threads: what
//!   two threads can gain on this machine at best;
//! - `denied_hot_key`: one key at 10 per hour, so every check after the tenth is denied.

#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use governor::{DefaultKeyedRateLimiter, Quota as GovQuota, RateLimiter};
use tollgate_core::{Algorithm, MemoryStore, Policy, Quota};

/// Distinct keys in the `10k_keys` and `threads` groups.
const KEYS: usize = 10_000;

/// The "allow nearly everything" quota, expressed identically by both libraries:
/// 1,000,000 per second (one unit per microsecond) with a burst of 1,000,000,000.
/// tollgate cannot take 1e9 per hour (limit × period must stay within 2^52 µs), and a
/// burst of 1e9 outlasts any bench run: at 50 M checks/s it takes 20 s of checks on one
/// key, net of refill, to run it down.
const ALLOW_RATE: u32 = 1_000_000;
const ALLOW_BURST: u32 = 1_000_000_000;
/// The "deny nearly everything" quota: 10 per hour.
const DENY_PER_HOUR: u32 = 10;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// The tollgate side: an algorithm and its display name.
const ALGORITHMS: [(Algorithm, &str); 2] = [
    (Algorithm::Gcra, "tollgate_gcra"),
    (Algorithm::TokenBucket, "tollgate_token_bucket"),
];

fn allow_policy(algorithm: Algorithm) -> Policy {
    let quota = Quota::per_second(ALLOW_RATE)
        .unwrap()
        .with_burst(ALLOW_BURST)
        .unwrap();
    Policy::new("bench", algorithm, quota).unwrap()
}

fn allow_governor() -> DefaultKeyedRateLimiter<u64> {
    RateLimiter::keyed(GovQuota::per_second(nz(ALLOW_RATE)).allow_burst(nz(ALLOW_BURST)))
}

fn deny_policy(algorithm: Algorithm) -> Policy {
    Policy::new("bench", algorithm, Quota::per_hour(DENY_PER_HOUR).unwrap()).unwrap()
}

fn deny_governor() -> DefaultKeyedRateLimiter<u64> {
    RateLimiter::keyed(GovQuota::per_hour(nz(DENY_PER_HOUR)))
}

/// The same keys for both sides: `u64`s for governor, their little-endian bytes for
/// tollgate.
fn keys() -> (Vec<u64>, Vec<[u8; 8]>) {
    // Spread the numbers out so they are not a dense run of small integers.
    let ids: Vec<u64> = (0..KEYS as u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let bytes = ids.iter().map(|k| k.to_le_bytes()).collect();
    (ids, bytes)
}

fn hot_key(c: &mut Criterion) {
    let mut group = c.benchmark_group("hot_key");
    group.throughput(Throughput::Elements(1));
    let key_id: u64 = 42;
    let key = key_id.to_le_bytes();
    for (algorithm, name) in ALGORITHMS {
        let store = MemoryStore::new();
        let policy = allow_policy(algorithm);
        assert!(store.check_sync(&key, &policy, 1).is_allowed());
        group.bench_function(name, |b| {
            b.iter(|| store.check_sync(black_box(&key), &policy, 1));
        });
        assert!(
            store.check_sync(&key, &policy, 1).is_allowed(),
            "{name} ran out of burst"
        );
    }
    let limiter = allow_governor();
    assert!(limiter.check_key(&key_id).is_ok());
    group.bench_function("governor", |b| {
        b.iter(|| limiter.check_key(black_box(&key_id)));
    });
    assert!(
        limiter.check_key(&key_id).is_ok(),
        "governor ran out of burst"
    );
    group.finish();
}

fn ten_k_keys(c: &mut Criterion) {
    let mut group = c.benchmark_group("10k_keys");
    group.throughput(Throughput::Elements(1));
    let (ids, bytes) = keys();
    for (algorithm, name) in ALGORITHMS {
        let store = MemoryStore::new();
        let policy = allow_policy(algorithm);
        let mut i = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                let key = &bytes[i];
                i += 1;
                if i == KEYS {
                    i = 0;
                }
                store.check_sync(black_box(key), &policy, 1)
            });
        });
        assert_eq!(store.len(), KEYS);
    }
    let limiter = allow_governor();
    let mut i = 0;
    group.bench_function("governor", |b| {
        b.iter(|| {
            let key = &ids[i];
            i += 1;
            if i == KEYS {
                i = 0;
            }
            limiter.check_key(black_box(key))
        });
    });
    assert_eq!(limiter.len(), KEYS);
    group.finish();
}

/// Runs `iters` checks in total on `threads` threads, each cycling through its own
/// contiguous share of `keys`, and returns the wall time from the moment all threads
/// are released to the moment the last one finishes.
fn run_threads<K: Sync, R>(
    iters: u64,
    threads: usize,
    keys: &[K],
    check: &(dyn Fn(&K) -> R + Sync),
) -> Duration {
    let share = keys.len() / threads;
    let start = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let mine = &keys[t * share..(t + 1) * share];
                let n = iters / threads as u64 + u64::from((t as u64) < iters % threads as u64);
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let mut i = 0;
                    for _ in 0..n {
                        black_box(check(black_box(&mine[i])));
                        i += 1;
                        if i == mine.len() {
                            i = 0;
                        }
                    }
                })
            })
            .collect();
        start.wait();
        let began = Instant::now();
        for worker in workers {
            worker.join().unwrap();
        }
        began.elapsed()
    })
}

fn threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("threads");
    group.throughput(Throughput::Elements(1));
    let (ids, bytes) = keys();
    for threads in [1, 2] {
        for (algorithm, name) in ALGORITHMS {
            let store = MemoryStore::new();
            let policy = allow_policy(algorithm);
            let check = |key: &[u8; 8]| store.check_sync(key, &policy, 1);
            group.bench_with_input(BenchmarkId::new(name, threads), &threads, |b, &threads| {
                b.iter_custom(|iters| run_threads(iters, threads, &bytes, &check));
            });
        }
        // The machine's own ceiling: about 70 ns of arithmetic per "check" that touches
        // no shared memory. Two threads can gain no more than this does.
        let spin = |key: &u64| {
            let mut x = *key;
            for _ in 0..64 {
                x = (x ^ (x >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            }
            x
        };
        group.bench_with_input(
            BenchmarkId::new("baseline_no_shared_state", threads),
            &threads,
            |b, &threads| {
                b.iter_custom(|iters| run_threads(iters, threads, &ids, &spin));
            },
        );
        let limiter = allow_governor();
        let check = |key: &u64| limiter.check_key(key);
        group.bench_with_input(
            BenchmarkId::new("governor", threads),
            &threads,
            |b, &threads| {
                b.iter_custom(|iters| run_threads(iters, threads, &ids, &check));
            },
        );
    }
    group.finish();
}

fn denied_hot_key(c: &mut Criterion) {
    let mut group = c.benchmark_group("denied_hot_key");
    group.throughput(Throughput::Elements(1));
    let key_id: u64 = 42;
    let key = key_id.to_le_bytes();
    for (algorithm, name) in ALGORITHMS {
        let store = MemoryStore::new();
        let policy = deny_policy(algorithm);
        for _ in 0..DENY_PER_HOUR {
            assert!(store.check_sync(&key, &policy, 1).is_allowed());
        }
        assert!(!store.check_sync(&key, &policy, 1).is_allowed());
        group.bench_function(name, |b| {
            b.iter(|| store.check_sync(black_box(&key), &policy, 1));
        });
    }
    let limiter = deny_governor();
    for _ in 0..DENY_PER_HOUR {
        assert!(limiter.check_key(&key_id).is_ok());
    }
    assert!(limiter.check_key(&key_id).is_err());
    group.bench_function("governor", |b| {
        b.iter(|| limiter.check_key(black_box(&key_id)));
    });
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30)
}

fn main() {
    // What `criterion_group!`/`criterion_main!` expand to, written out because the
    // generated `pub fn` trips the workspace's `missing_docs` lint.
    let mut c = config().configure_from_args();
    hot_key(&mut c);
    ten_k_keys(&mut c);
    threads(&mut c);
    denied_hot_key(&mut c);
    c.final_summary();
}
