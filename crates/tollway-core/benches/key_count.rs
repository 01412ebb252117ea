//! Time per check as the store grows: tollway's `MemoryStore` beside governor's keyed
//! limiter at 10,000, 100,000 and 1,000,000 keys, checked in a random order.
//!
//! ```sh
//! cargo bench -p tollway-core --bench key_count               # 5 rounds
//! KEY_COUNT_ROUNDS=10 cargo bench -p tollway-core --bench key_count   # at most 40
//! ```
//!
//! Each count's two contenders are built once and filled with every key (untimed): a
//! `MemoryStore` with `max_keys` 4,000,000, so that every key is held (1,024 shards, as
//! the default), and `governor::RateLimiter::keyed`, both on a GCRA quota that allows
//! every check and keeps every key live (asserted before and after the rounds). A round
//! times 2,000,000 checks of each, cycling through the keys in one random order, the
//! contenders in alternating order round after round. Printed: the median ns per check
//! and the median of the per-round ratios tollway / governor. The `memory_store` bench
//! cycles through 10,000 keys in order; here the order is random and the larger counts
//! leave the processor's caches, so a check's cost is mostly the cache lines it reads.
//!
//! With `KEY_COUNT_COUNT=<contender>:<keys>` (contender `gcra`, `token_bucket` or
//! `governor`) it times nothing: it fills that contender with the keys and makes
//! [`COUNTED`] checks in `counted`, for `benches/check_instructions.sh` to count their
//! instructions (and cache misses) under callgrind.

#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use governor::{Quota as GovQuota, RateLimiter};
use tollway_core::{Algorithm, MemoryStore, Policy, Quota};

mod common;
use common::shuffled;

const COUNTS: [usize; 3] = [10_000, 100_000, 1_000_000];
const CHECKS: usize = 2_000_000;
/// Checks made in count mode: within the burst on one key, so that every one is allowed.
const COUNTED: usize = 9_000;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// `n` distinct keys, in a random order.
fn keys(n: usize) -> Vec<u64> {
    shuffled(n, 11)
        .into_iter()
        .map(|i| (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// ns per check of `CHECKS` checks cycling through `keys`.
fn time(keys: &[u64], check: impl Fn(u64)) -> f64 {
    let began = Instant::now();
    let mut i = 0;
    for _ in 0..CHECKS {
        check(black_box(keys[i]));
        i = if i + 1 == keys.len() { 0 } else { i + 1 };
    }
    began.elapsed().as_nanos() as f64 / CHECKS as f64
}

/// [`COUNTED`] checks cycling through `keys`: what count mode's callgrind counts.
#[inline(never)]
fn counted(keys: &[u64], check: impl Fn(u64)) {
    let mut i = 0;
    for _ in 0..COUNTED {
        check(black_box(keys[i]));
        i = if i + 1 == keys.len() { 0 } else { i + 1 };
    }
}

/// Count mode: `spec` is `<contender>:<keys>`.
fn count(spec: &str, quota: Quota) {
    let (contender, n) = spec
        .split_once(':')
        .expect("KEY_COUNT_COUNT=<contender>:<keys>");
    let keys = keys(n.parse().expect("a number of keys"));
    let store = MemoryStore::builder().max_keys(4_000_000).build().unwrap();
    let algorithm = match contender {
        "gcra" | "governor" => Algorithm::Gcra,
        "token_bucket" => Algorithm::TokenBucket,
        other => panic!("no contender {other}: gcra, token_bucket or governor"),
    };
    let policy = Policy::new("bench", algorithm, quota).unwrap();
    if contender == "governor" {
        let limiter = RateLimiter::keyed(
            GovQuota::with_period(Duration::from_millis(86_400))
                .unwrap()
                .allow_burst(nz(10_000)),
        );
        for &k in &keys {
            assert!(limiter.check_key(&k).is_ok());
        }
        counted(&keys, |k| assert!(limiter.check_key(&k).is_ok()));
    } else {
        for &k in &keys {
            assert!(store.check_sync(&k.to_le_bytes(), &policy, 1).is_allowed());
        }
        counted(&keys, |k| {
            assert!(store.check_sync(&k.to_le_bytes(), &policy, 1).is_allowed());
        });
    }
}

fn main() {
    // `cargo test --benches` runs this binary without --bench: do nothing then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    // At most 40 rounds: 200 checks of each of 10,000 keys a round stay within the burst.
    let rounds: usize = std::env::var("KEY_COUNT_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5)
        .clamp(1, 40);
    // Every check allowed, and every key live throughout (a check moves a key's state
    // 86.4 s on, and a burst of 10,000 is more than a run's checks of one key): a key
    // whose state is back to fresh could be swept and come back through the lock, which
    // is not a lookup.
    let quota = Quota::with_period(1_000, Duration::from_secs(86_400))
        .unwrap()
        .with_burst(10_000)
        .unwrap();
    if let Ok(spec) = std::env::var("KEY_COUNT_COUNT") {
        count(&spec, quota);
        return;
    }
    let policy = Policy::new("bench", Algorithm::Gcra, quota).unwrap();
    println!("ns per check, GCRA, keys in a random order; {rounds} rounds, medians");
    println!(
        "{:>10} {:>10} {:>10} {:>18}",
        "keys", "tollway", "governor", "tollway/governor"
    );
    for count in COUNTS {
        let keys = keys(count);
        let store = MemoryStore::builder().max_keys(4_000_000).build().unwrap();
        let limiter = RateLimiter::keyed(
            GovQuota::with_period(Duration::from_millis(86_400))
                .unwrap()
                .allow_burst(nz(10_000)),
        );
        for &k in &keys {
            assert!(store.check_sync(&k.to_le_bytes(), &policy, 1).is_allowed());
            assert!(limiter.check_key(&k).is_ok());
        }
        assert_eq!(store.len(), count, "every key held before the rounds");
        let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let tollway = || {
                time(&keys, |k| {
                    black_box(store.check_sync(&k.to_le_bytes(), &policy, 1));
                })
            };
            let governor = || {
                time(&keys, |k| {
                    let _ = black_box(limiter.check_key(&k));
                })
            };
            let (t, g) = if round % 2 == 0 {
                let t = tollway();
                (t, governor())
            } else {
                let g = governor();
                (tollway(), g)
            };
            ours.push(t);
            theirs.push(g);
            ratios.push(t / g);
        }
        // No key became idle: none was swept and came back through the lock.
        assert_eq!(store.sweep(), count, "every key live after the rounds");
        let last = keys[keys.len() - 1].to_le_bytes();
        assert!(
            store.check_sync(&last, &policy, 1).is_allowed(),
            "every check allowed"
        );
        println!(
            "{count:>10} {:>10.1} {:>10.1} {:>17.0}%",
            median(ours),
            median(theirs),
            100.0 * median(ratios)
        );
    }
}
