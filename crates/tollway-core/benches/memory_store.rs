//! Side-by-side speed of tollway's `MemoryStore::check_sync` and governor's default keyed
//! rate limiter, on the same quota.
//!
//! Run with `cargo bench -p tollway-core --bench memory_store`, or, to pair the two
//! libraries round by round (on a host with slow spells, the figures to compare), with
//! `MEMORY_BENCH_ROUNDS=30 cargo bench -p tollway-core --bench memory_store`.
//!
//! Both libraries run as their defaults: `MemoryStore::new()` (1,024 shards, a seeded foldhash,
//! the TSC clock through `quanta`) and `governor::RateLimiter::keyed` (a `DashMap` with the std
//! SipHash `RandomState`, the `quanta` TSC clock). Keys are `u64`s: governor is keyed by
//! the `u64` itself, tollway by its 8-byte little-endian encoding, built once up front,
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
use tollway_core::{Algorithm, MemoryStore, Policy, Quota};

/// Distinct keys in the `10k_keys` and `threads` groups.
const KEYS: usize = 10_000;

/// The "allow nearly everything" quota, expressed identically by both libraries:
/// 1,000,000 per second (one unit per microsecond) with a burst of 1,000,000,000.
/// tollway cannot take 1e9 per hour (limit × period must stay within 2^52 µs), and a
/// burst of 1e9 outlasts any bench run: at 50 M checks/s it takes 20 s of checks on one
/// key, net of refill, to run it down.
const ALLOW_RATE: u32 = 1_000_000;
const ALLOW_BURST: u32 = 1_000_000_000;
/// The "deny nearly everything" quota: 10 per hour.
const DENY_PER_HOUR: u32 = 10;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// The tollway side: an algorithm and its display name.
const ALGORITHMS: [(Algorithm, &str); 2] = [
    (Algorithm::Gcra, "tollway_gcra"),
    (Algorithm::TokenBucket, "tollway_token_bucket"),
];

fn allow_policy(algorithm: Algorithm) -> Policy {
    let quota = Quota::per_second(ALLOW_RATE.into())
        .unwrap()
        .with_burst(ALLOW_BURST.into())
        .unwrap();
    Policy::new("bench", algorithm, quota).unwrap()
}

fn allow_governor() -> DefaultKeyedRateLimiter<u64> {
    RateLimiter::keyed(GovQuota::per_second(nz(ALLOW_RATE)).allow_burst(nz(ALLOW_BURST)))
}

fn deny_policy(algorithm: Algorithm) -> Policy {
    Policy::new(
        "bench",
        algorithm,
        Quota::per_hour(DENY_PER_HOUR.into()).unwrap(),
    )
    .unwrap()
}

fn deny_governor() -> DefaultKeyedRateLimiter<u64> {
    RateLimiter::keyed(GovQuota::per_hour(nz(DENY_PER_HOUR)))
}

/// The same keys for both sides: `u64`s for governor, their little-endian bytes for
/// tollway.
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
        // Every key was seen, unless a filter skipped this benchmark.
        assert!(store.len() == KEYS || store.is_empty(), "{name} lost keys");
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
    assert!(
        limiter.len() == KEYS || limiter.is_empty(),
        "governor lost keys"
    );
    group.finish();
}

/// Runs `iters` checks in total on `threads` threads, each cycling through its own
/// contiguous share of `keys`, and returns the wall time from the moment the first
/// thread starts to the moment the last one finishes (timed by the threads themselves:
/// the thread that releases them may not run again until they are done, and a time it
/// took then would be next to nothing — and the calibrated count enormous).
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
                    let began = Instant::now();
                    let mut i = 0;
                    for _ in 0..n {
                        black_box(check(black_box(&mine[i])));
                        i += 1;
                        if i == mine.len() {
                            i = 0;
                        }
                    }
                    (began, Instant::now())
                })
            })
            .collect();
        start.wait();
        let spans: Vec<(Instant, Instant)> =
            workers.into_iter().map(|w| w.join().unwrap()).collect();
        wall(&spans)
    })
}

/// From the first thread's start to the last one's end.
fn wall(spans: &[(Instant, Instant)]) -> Duration {
    let first = spans.iter().map(|s| s.0).min();
    let last = spans.iter().map(|s| s.1).max();
    match (first, last) {
        (Some(first), Some(last)) => last - first,
        _ => Duration::ZERO,
    }
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

/// One measured case of the interleaved mode: runs `n` checks, returns the wall time.
type Case<'a> = (
    &'static str,
    &'static str,
    Box<dyn FnMut(u64) -> Duration + 'a>,
);

/// The interleaved mode (`MEMORY_BENCH_ROUNDS=N`): every case of every group runs once per
/// round for about 100 ms on a store made for it, rounds after rounds, so a slow spell of
/// the machine (on a shared host, seconds in which single-thread speed drops by a third)
/// falls on tollway and governor alike instead of on whichever criterion happened to be
/// sampling, and each round samples a new memory layout. Prints
/// the median ns per check of each case and, per group, the median of the per-round
/// ratios of each tollway case to governor.
fn interleaved(rounds: usize) {
    let (ids, bytes) = keys();
    let (ids, bytes) = (&ids, &bytes);
    let hot_id: u64 = 42;
    let hot = hot_id.to_le_bytes();
    let mut cases: Vec<Case<'_>> = Vec::new();
    // Every case builds its store or limiter afresh each round, untimed: where a table
    // lands in memory (and which shard a key hashes to, seeded per store) moves a hot
    // key's cost by up to a third on this machine, the same way for a whole run, so one
    // store per run would measure one layout. Each loop is written out, as in the
    // criterion benches above, rather than made by one generic helper: tried, a helper
    // changed the code the compiler made for the loops (governor's hot key went from 30
    // to 50 ns a check), which measures the helper.
    for (algorithm, name) in ALGORITHMS {
        cases.push((
            "hot_key",
            name,
            Box::new(move |n| {
                let (store, policy) = (MemoryStore::new(), allow_policy(algorithm));
                store.check_sync(&hot, &policy, 1);
                let began = Instant::now();
                for _ in 0..n {
                    black_box(store.check_sync(black_box(&hot), &policy, 1));
                }
                began.elapsed()
            }),
        ));
        cases.push((
            "10k_keys",
            name,
            Box::new(move |n| {
                let (store, policy) = (MemoryStore::new(), allow_policy(algorithm));
                for key in bytes {
                    store.check_sync(key, &policy, 1);
                }
                let mut i = 0;
                let began = Instant::now();
                for _ in 0..n {
                    black_box(store.check_sync(black_box(&bytes[i]), &policy, 1));
                    i = if i + 1 == KEYS { 0 } else { i + 1 };
                }
                began.elapsed()
            }),
        ));
        for (group, threads) in [("threads/1", 1), ("threads/2", 2)] {
            cases.push((
                group,
                name,
                Box::new(move |n| {
                    let (store, policy) = (MemoryStore::new(), allow_policy(algorithm));
                    for key in bytes {
                        store.check_sync(key, &policy, 1);
                    }
                    let check = |key: &[u8; 8]| store.check_sync(key, &policy, 1);
                    run_threads(n, threads, bytes, &check)
                }),
            ));
        }
        cases.push((
            "denied_hot_key",
            name,
            Box::new(move |n| {
                let (store, policy) = (MemoryStore::new(), deny_policy(algorithm));
                for _ in 0..=DENY_PER_HOUR {
                    store.check_sync(&hot, &policy, 1);
                }
                assert!(!store.check_sync(&hot, &policy, 1).is_allowed());
                let began = Instant::now();
                for _ in 0..n {
                    black_box(store.check_sync(black_box(&hot), &policy, 1));
                }
                began.elapsed()
            }),
        ));
    }
    cases.push((
        "hot_key",
        "governor",
        Box::new(move |n| {
            let limiter = allow_governor();
            let _ = limiter.check_key(&hot_id);
            let began = Instant::now();
            for _ in 0..n {
                let _ = black_box(limiter.check_key(black_box(&hot_id)));
            }
            began.elapsed()
        }),
    ));
    cases.push((
        "10k_keys",
        "governor",
        Box::new(move |n| {
            let limiter = allow_governor();
            for key in ids {
                let _ = limiter.check_key(key);
            }
            let mut i = 0;
            let began = Instant::now();
            for _ in 0..n {
                let _ = black_box(limiter.check_key(black_box(&ids[i])));
                i = if i + 1 == KEYS { 0 } else { i + 1 };
            }
            began.elapsed()
        }),
    ));
    for (group, threads) in [("threads/1", 1), ("threads/2", 2)] {
        cases.push((
            group,
            "governor",
            Box::new(move |n| {
                let limiter = allow_governor();
                for key in ids {
                    let _ = limiter.check_key(key);
                }
                let check = |key: &u64| limiter.check_key(key);
                run_threads(n, threads, ids, &check)
            }),
        ));
    }
    cases.push((
        "denied_hot_key",
        "governor",
        Box::new(move |n| {
            let limiter = deny_governor();
            for _ in 0..=DENY_PER_HOUR {
                let _ = limiter.check_key(&hot_id);
            }
            assert!(limiter.check_key(&hot_id).is_err());
            let began = Instant::now();
            for _ in 0..n {
                let _ = black_box(limiter.check_key(black_box(&hot_id)));
            }
            began.elapsed()
        }),
    ));

    // About 100 ms a case: calibrate the count once, on the first round.
    let mut counts = vec![0u64; cases.len()];
    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for round in 0..rounds + 1 {
        for k in 0..cases.len() {
            let c = (round + k) % cases.len();
            let run = &mut cases[c].2;
            if round == 0 {
                let probe = 100_000;
                let t = run(probe).as_secs_f64();
                counts[c] = ((0.1 / t.max(1e-9)) * probe as f64) as u64;
                continue;
            }
            let t = run(counts[c]);
            ns[c].push(t.as_nanos() as f64 / counts[c] as f64);
        }
    }
    println!("interleaved: {rounds} rounds, every case about 100 ms a round, in rotating order");
    println!(
        "{:<16} {:<24} {:>10} {:>8} {:>8}",
        "group", "case", "median ns", "lowest", "highest"
    );
    for (c, (group, name, _)) in cases.iter().enumerate() {
        let mut v = ns[c].clone();
        v.sort_by(f64::total_cmp);
        println!(
            "{group:<16} {name:<24} {:>10.2} {:>8.2} {:>8.2}",
            v[v.len() / 2],
            v[0],
            v[v.len() - 1]
        );
    }
    println!();
    println!(
        "tollway / governor, median of the per-round ratios [lowest .. highest] (below 100%: faster)"
    );
    for (c, (group, name, _)) in cases.iter().enumerate() {
        if *name == "governor" {
            continue;
        }
        let Some(g) = cases
            .iter()
            .position(|(gr, n, _)| gr == group && *n == "governor")
        else {
            continue;
        };
        let mut r: Vec<f64> = ns[c]
            .iter()
            .zip(&ns[g])
            .map(|(a, b)| a / b * 100.0)
            .collect();
        r.sort_by(f64::total_cmp);
        println!(
            "{group:<16} {name:<24} {:>7.1}%  [{:.1} .. {:.1}]",
            r[r.len() / 2],
            r[0],
            r[r.len() - 1]
        );
    }
    println!();
    println!("two threads / one thread, total checks per second, median of the per-round ratios");
    for name in ALGORITHMS.iter().map(|(_, n)| *n).chain(["governor"]) {
        let one = cases
            .iter()
            .position(|(g, n, _)| *g == "threads/1" && *n == name);
        let two = cases
            .iter()
            .position(|(g, n, _)| *g == "threads/2" && *n == name);
        if let (Some(one), Some(two)) = (one, two) {
            let mut r: Vec<f64> = ns[one].iter().zip(&ns[two]).map(|(a, b)| a / b).collect();
            r.sort_by(f64::total_cmp);
            println!(
                "{name:<24} {:>5.2}x  [{:.2} .. {:.2}]",
                r[r.len() / 2],
                r[0],
                r[r.len() - 1]
            );
        }
    }
}

fn main() {
    if let Ok(rounds) = std::env::var("MEMORY_BENCH_ROUNDS") {
        // `cargo test --benches` runs this binary without --bench: do nothing then.
        if std::env::args().any(|a| a == "--bench") {
            interleaved(
                rounds
                    .parse()
                    .expect("MEMORY_BENCH_ROUNDS is a whole number"),
            );
        }
        return;
    }
    // What `criterion_group!`/`criterion_main!` expand to, written out because the
    // generated `pub fn` trips the workspace's `missing_docs` lint.
    let mut c = config().configure_from_args();
    hot_key(&mut c);
    ten_k_keys(&mut c);
    threads(&mut c);
    denied_hot_key(&mut c);
    c.final_summary();
}
