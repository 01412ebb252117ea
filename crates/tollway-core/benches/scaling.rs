//! How the memory store scales with threads, beside governor and beside a share-nothing
//! baseline, and what a sweep does to the checks running beside it (issue 19).
//!
//! ```sh
//! cargo bench -p tollway-core --features testing --bench scaling             # 10 rounds
//! SCALING_ROUNDS=30 cargo bench -p tollway-core --features testing --bench scaling
//! SCALING_PART=scaling cargo bench -p tollway-core --features testing --bench scaling   # or =sweep: one part
//! ```
//!
//! **Scaling.** Four patterns over 10,000 keys, at 1 and 2 threads (and at every
//! thread count up to the machine's cores, if it has more):
//! - `own`: each thread checks its own share of the keys, in a random order of its own;
//! - `apart`: the same, with keys chosen so that no two threads' keys share a shard of
//!   the shared store (and so no cache line of its cells): what `own` would give if the
//!   threads' states did not share lines (a diagnosis, not a traffic pattern: which
//!   shard a caller lands in cannot be chosen);
//! - `shared`: every thread checks all the keys, each in a random order of its own;
//! - `hot`: every thread checks one key.
//!
//! Four contenders, each built afresh every round (untimed), the same quota that allows
//! every check: tollway's `MemoryStore` (one store shared by the threads) under GCRA
//! (`tollway`) and under the token bucket (`tollway_tb`), governor's keyed limiter (one,
//! shared), and `share_nothing`: one `MemoryStore` per thread under GCRA, each holding
//! the keys its thread checks — the same table work with nothing shared between
//! threads, which is what the machine gives at best. Each case runs
//! about 100 ms a round, the cases in rotating order round after round, so that a slow
//! spell of a shared host falls on all of them. Printed: the median total checks per
//! second of each case, and per contender and pattern the median of the per-round
//! ratios of N threads to 1.
//!
//! **A sweep beside checks.** 1,000,000 keys of which half have expired; one thread
//! checks live keys in a random order, timing each check, while another sweeps the
//! store (`MemoryStore::sweep`; governor: `retain_recent`) over and over. tollway runs
//! it under GCRA, the token bucket and the sliding window counter (checks in lock-free
//! cells, which a sweep does not stop) and under the sliding window log (checks under
//! the shard's lock, which a sweep holds one shard at a time). Printed: the checking
//! thread's latency percentiles with and without the sweeper.

#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use governor::clock::FakeRelativeClock;
use governor::{Quota as GovQuota, RateLimiter};
use tollway_core::{Algorithm, ManualClock, MemoryStore, Policy, Quota};

mod common;
use common::shuffled;

const KEYS: usize = 10_000;
/// One unit a microsecond and a burst no run exhausts: every check is allowed.
const RATE: u32 = 1_000_000;
const BURST: u32 = 1_000_000_000;

/// The `i`th key id.
fn id(i: u64) -> u64 {
    i.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

fn policy(algorithm: Algorithm) -> Policy {
    let quota = Quota::per_second(RATE.into())
        .unwrap()
        .with_burst(BURST.into())
        .unwrap();
    Policy::new("bench", algorithm, quota).unwrap()
}

fn governor() -> governor::DefaultKeyedRateLimiter<u64> {
    RateLimiter::keyed(GovQuota::per_second(nz(RATE)).allow_burst(nz(BURST)))
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pattern {
    Own,
    Apart,
    Shared,
    Hot,
}

impl Pattern {
    const ALL: [Pattern; 4] = [Pattern::Own, Pattern::Apart, Pattern::Shared, Pattern::Hot];

    fn name(self) -> &'static str {
        match self {
            Pattern::Own => "own",
            Pattern::Apart => "apart",
            Pattern::Shared => "shared",
            Pattern::Hot => "hot",
        }
    }

    /// The key ids thread `t` of `threads` checks, in its order; `shard` is the shared
    /// store's shard of a key id.
    fn keys(self, ids: &[u64], t: usize, threads: usize, shard: impl Fn(u64) -> usize) -> Vec<u64> {
        let share = ids.len() / threads;
        let in_order = |mine: Vec<u64>| {
            shuffled(mine.len(), 7 + t as u64)
                .into_iter()
                .map(|i| mine[i])
                .collect()
        };
        match self {
            Pattern::Own => in_order(ids[t * share..(t + 1) * share].to_vec()),
            // The ids in the order `ids` has them, continued past its end, whose shard is
            // thread t's (the shards taken round robin).
            Pattern::Apart => in_order(
                (0..)
                    .map(id)
                    .filter(|&k| shard(k) % threads == t)
                    .take(share)
                    .collect(),
            ),
            Pattern::Shared => shuffled(ids.len(), 7 + t as u64)
                .into_iter()
                .map(|i| ids[i])
                .collect(),
            Pattern::Hot => vec![ids[0]],
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Contender {
    /// GCRA.
    Tollway,
    TollwayTokenBucket,
    Governor,
    ShareNothing,
}

impl Contender {
    const ALL: [Contender; 4] = [
        Contender::Tollway,
        Contender::TollwayTokenBucket,
        Contender::Governor,
        Contender::ShareNothing,
    ];

    fn name(self) -> &'static str {
        match self {
            Contender::Tollway => "tollway",
            Contender::TollwayTokenBucket => "tollway_tb",
            Contender::Governor => "governor",
            Contender::ShareNothing => "share_nothing",
        }
    }
}

/// One thread's loop: `n` checks cycling through `keys`.
fn drive(n: u64, keys: &[u64], check: impl Fn(u64)) {
    let mut i = 0;
    for _ in 0..n {
        check(black_box(keys[i]));
        i = if i + 1 == keys.len() { 0 } else { i + 1 };
    }
}

/// Runs `n` checks in total on `threads` threads and returns the wall time from the
/// moment the first starts to the moment the last finishes, as the threads time it (the
/// thread that releases them may not run again until they are done).
fn run(contender: Contender, pattern: Pattern, threads: usize, n: u64, ids: &[u64]) -> Duration {
    let policy = policy(match contender {
        Contender::TollwayTokenBucket => Algorithm::TokenBucket,
        _ => Algorithm::Gcra,
    });
    let shared_store = MemoryStore::new();
    let per_thread: Vec<Vec<u64>> = (0..threads)
        .map(|t| pattern.keys(ids, t, threads, |k| shared_store.shard_of(&k.to_le_bytes())))
        .collect();
    let limiter = governor();
    // One store per thread for the share-nothing baseline; the shared ones otherwise.
    let own_stores: Vec<MemoryStore> = (0..threads).map(|_| MemoryStore::new()).collect();
    for (t, keys) in per_thread.iter().enumerate() {
        for &k in keys {
            match contender {
                Contender::Tollway | Contender::TollwayTokenBucket => {
                    shared_store.check_sync(&k.to_le_bytes(), &policy, 1);
                }
                Contender::Governor => {
                    let _ = limiter.check_key(&k);
                }
                Contender::ShareNothing => {
                    own_stores[t].check_sync(&k.to_le_bytes(), &policy, 1);
                }
            }
        }
    }
    let start = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let workers: Vec<_> = per_thread
            .iter()
            .enumerate()
            .map(|(t, keys)| {
                let count = n / threads as u64;
                let (start, policy, shared_store, limiter, own) =
                    (&start, &policy, &shared_store, &limiter, &own_stores[t]);
                s.spawn(move || {
                    start.wait();
                    let began = Instant::now();
                    match contender {
                        Contender::Tollway | Contender::TollwayTokenBucket => {
                            drive(count, keys, |k| {
                                black_box(shared_store.check_sync(&k.to_le_bytes(), policy, 1));
                            })
                        }
                        Contender::Governor => drive(count, keys, |k| {
                            let _ = black_box(limiter.check_key(&k));
                        }),
                        Contender::ShareNothing => drive(count, keys, |k| {
                            black_box(own.check_sync(&k.to_le_bytes(), policy, 1));
                        }),
                    }
                    (began, Instant::now())
                })
            })
            .collect();
        start.wait();
        let spans: Vec<(Instant, Instant)> =
            workers.into_iter().map(|w| w.join().unwrap()).collect();
        let first = spans.iter().map(|s| s.0).min().unwrap();
        let last = spans.iter().map(|s| s.1).max().unwrap();
        last - first
    })
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn scaling(rounds: usize) {
    let ids: Vec<u64> = (0..KEYS as u64).map(id).collect();
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    let thread_counts: Vec<usize> = (1..=cores.max(2)).collect();
    let mut cases = Vec::new();
    for pattern in Pattern::ALL {
        for contender in Contender::ALL {
            for &threads in &thread_counts {
                cases.push((pattern, contender, threads));
            }
        }
    }
    // About 100 ms a case: the count calibrated on a first, unrecorded round.
    let mut counts = vec![0u64; cases.len()];
    let mut per_s: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for round in 0..=rounds {
        for k in 0..cases.len() {
            let c = (round + k) % cases.len();
            let (pattern, contender, threads) = cases[c];
            if round == 0 {
                let probe = 200_000;
                let t = run(contender, pattern, threads, probe, &ids).as_secs_f64();
                counts[c] = ((0.1 / t.max(1e-9)) * probe as f64) as u64;
                continue;
            }
            let n = counts[c] - counts[c] % threads as u64;
            let t = run(contender, pattern, threads, n, &ids);
            per_s[c].push(n as f64 / t.as_secs_f64());
        }
    }
    println!("scaling: {rounds} rounds, every case about 100 ms a round, in rotating order");
    println!(
        "{:<8} {:<14} {:>8} {:>16} {:>14} {:>14}",
        "pattern", "contender", "threads", "checks/s median", "lowest", "highest"
    );
    for (c, (pattern, contender, threads)) in cases.iter().enumerate() {
        let (m, lo, hi) = median(per_s[c].clone());
        println!(
            "{:<8} {:<14} {:>8} {:>16.0} {:>14.0} {:>14.0}",
            pattern.name(),
            contender.name(),
            threads,
            m,
            lo,
            hi
        );
    }
    println!();
    println!("N threads / 1 thread, total checks per second, median of the per-round ratios");
    for pattern in Pattern::ALL {
        for contender in Contender::ALL {
            let of = |threads| {
                cases
                    .iter()
                    .position(|&c| c == (pattern, contender, threads))
                    .unwrap()
            };
            for &threads in &thread_counts[1..] {
                let ratios: Vec<f64> = per_s[of(threads)]
                    .iter()
                    .zip(&per_s[of(1)])
                    .map(|(n, one)| n / one)
                    .collect();
                let (m, lo, hi) = median(ratios);
                println!(
                    "{:<8} {:<14} {threads}/1 {m:>6.2}x  [{lo:.2} .. {hi:.2}]",
                    pattern.name(),
                    contender.name()
                );
            }
        }
    }
}

/// Latency percentiles (ns) of one thread's checks of live keys, with another thread
/// sweeping the same store over and over, or not.
fn sweep_latency() {
    const KEYS: u64 = 1_000_000;
    let ids: Vec<u64> = (0..KEYS).map(id).collect();
    // Live keys: the odd ones, which a fresh check keeps for an hour; the even ones were
    // checked an hour ago on a 10 per second quota and have expired.
    let live: Vec<u64> = shuffled(KEYS as usize / 2, 3)
        .into_iter()
        .map(|i| ids[2 * i + 1])
        .collect();
    let percentiles = |mut ns: Vec<u64>| {
        ns.sort_unstable();
        let at = |p: f64| ns[((ns.len() as f64 * p) as usize).min(ns.len() - 1)];
        format!(
            "p50 {:>6}  p99 {:>7}  p99.9 {:>8}  max {:>9}",
            at(0.5),
            at(0.99),
            at(0.999),
            ns[ns.len() - 1]
        )
    };
    let short = Quota::per_second(10).unwrap();
    let long = Quota::per_hour(10).unwrap();
    for sweeping in [false, true] {
        // tollway: GCRA, the token bucket and the sliding window counter in lock-free
        // cells, the sliding window log in the shards' locked tables.
        for (algorithm, name) in [
            (Algorithm::Gcra, "tollway GCRA"),
            (Algorithm::TokenBucket, "tollway token bucket"),
            (Algorithm::SlidingWindowCounter, "tollway sliding counter"),
            (Algorithm::SlidingWindowLog, "tollway sliding log"),
        ] {
            let clock = ManualClock::new();
            let store = MemoryStore::builder()
                .max_keys(2 * KEYS as usize)
                .clock(clock.clone())
                .build()
                .unwrap();
            let (expiring, lasting) = (
                Policy::new("short", algorithm, short.clone()).unwrap(),
                Policy::new("long", algorithm, long.clone()).unwrap(),
            );
            for (i, id) in ids.iter().enumerate() {
                let policy = if i % 2 == 0 { &expiring } else { &lasting };
                store.check_sync(&id.to_le_bytes(), policy, 1);
            }
            clock.advance(Duration::from_secs(60));
            let (lat, sweeps) = beside_sweeps(
                sweeping,
                || {
                    store.sweep();
                },
                |key| {
                    black_box(store.check_sync(&key.to_le_bytes(), &lasting, 1));
                },
                &live,
            );
            println!(
                "{name:<23} {:<16} {} ns  ({sweeps} sweeps)",
                if sweeping { "while sweeping" } else { "alone" },
                percentiles(lat)
            );
        }
        // governor, keyed on a fake clock moved the same way.
        let clock = FakeRelativeClock::default();
        let short = RateLimiter::dashmap_with_clock(GovQuota::per_second(nz(10)), clock.clone());
        // One limiter holds both kinds of key in governor: the expiring ones checked at
        // the start, the live ones checked again after the clock moves.
        for id in &ids {
            let _ = short.check_key(id);
        }
        clock.advance(Duration::from_secs(60));
        for id in &live {
            let _ = short.check_key(id);
        }
        let (lat, sweeps) = beside_sweeps(
            sweeping,
            || short.retain_recent(),
            |key| {
                let _ = black_box(short.check_key(&key));
            },
            &live,
        );
        println!(
            "{:<23} {:<16} {} ns  ({sweeps} sweeps)",
            "governor",
            if sweeping { "while sweeping" } else { "alone" },
            percentiles(lat)
        );
    }
}

/// The latency (ns) of `CHECKS` calls of `check` cycling through `live`, with another
/// thread calling `sweep` over and over (if `sweeping`); and how many sweeps it made.
fn beside_sweeps(
    sweeping: bool,
    sweep: impl Fn() + Sync,
    check: impl Fn(u64),
    live: &[u64],
) -> (Vec<u64>, u64) {
    const CHECKS: usize = 2_000_000;
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let sweeper = s.spawn(|| {
            let mut sweeps = 0u64;
            while sweeping && !stop.load(Ordering::Relaxed) {
                sweep();
                sweeps += 1;
            }
            sweeps
        });
        let mut lat = Vec::with_capacity(CHECKS);
        for i in 0..CHECKS {
            let key = live[i % live.len()];
            let began = Instant::now();
            check(key);
            lat.push(began.elapsed().as_nanos() as u64);
        }
        stop.store(true, Ordering::Relaxed);
        (lat, sweeper.join().unwrap())
    })
}

fn main() {
    // `cargo test --benches` runs this binary without --bench: do nothing then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let rounds = std::env::var("SCALING_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(10);
    // SCALING_PART=scaling or =sweep runs one part.
    let part = std::env::var("SCALING_PART").unwrap_or_default();
    if part != "sweep" {
        scaling(rounds);
        println!();
    }
    if part != "scaling" {
        sweep_latency();
    }
}
