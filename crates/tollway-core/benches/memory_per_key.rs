//! Memory per key of tollway's `MemoryStore` beside governor's default keyed limiter,
//! and the memory store's footprint under a flood of unique keys.
//!
//! Run with `cargo bench -p tollway-core --bench memory_per_key`.
//!
//! Memory is measured as the growth of the process's resident set (`VmRSS` in
//! `/proc/self/status`, Linux only): the workspace forbids `unsafe`, which rules out a
//! counting global allocator. Each case runs in a fresh child process (this same binary,
//! started again with `TOLLWAY_MEM_CASE` set) so one case's freed-but-retained heap does
//! not hide or inflate the next one's. RSS counts what the allocator holds, including
//! slack and any table copies freed during growth but not yet returned to the kernel, so
//! read the bytes per key as an upper bound on the live data, at 4 KiB resolution.
//!
//! Cases:
//! - **per key**: 100,000 to 2,000,000 distinct keys (six counts, so that no one table
//!   size decides the figure; their mean is printed too) inserted into a `MemoryStore`
//!   (`max_keys` 4,000,000: room for every key in every shard; a `ManualClock` that
//!   never moves, so nothing expires) under GCRA, the token bucket, the sliding window
//!   counter (10 a second, in the lock-free cells, and 40,000 a second, a limit too
//!   large for them: in the shards' tables) and the sliding window log (one admission a
//!   key), and into
//!   `governor::RateLimiter::keyed` with `u64` keys. tollway gets each `u64`'s 8-byte
//!   little-endian encoding, built on the stack, so neither side allocates per key
//!   outside its own table.
//! - **unique-key flood**: 5,000,000 requests, each from a new key, into a `MemoryStore`
//!   with `max_keys` 100,000 on a `ManualClock` advanced 10 µs per request. At 10 per
//!   second a key's state is back to fresh 100 ms (10,000 requests) after its request,
//!   so sweeping keeps the store far below its bound; at 10 per minute a key stays live
//!   for 6 s (600,000 requests), more than the bound holds, so the store fills, turns
//!   new keys away as `StoreFull`, and admits new ones as old ones expire. The store's
//!   length is sampled every 1,000 requests and must never pass `max_keys`.

#![allow(clippy::unwrap_used)]

use std::fs;
use std::num::NonZeroU32;
use std::process::Command;
use std::time::{Duration, Instant};

use governor::{Quota as GovQuota, RateLimiter};
use tollway_core::{Algorithm, Denial, ManualClock, MemoryStore, Policy, Quota};

/// The environment variable that makes this binary run one case as a child.
const CASE_ENV: &str = "TOLLWAY_MEM_CASE";

/// Keys inserted in the per-key cases: each count is a case of its own.
const PER_KEY_COUNTS: [u64; 6] = [100_000, 250_000, 500_000, 1_000_000, 1_500_000, 2_000_000];
/// The environment variable that gives a per-key child its key count.
const KEYS_ENV: &str = "TOLLWAY_MEM_KEYS";
/// `max_keys` of the per-key store: room for every key.
const PER_KEY_MAX: usize = 4_000_000;

/// Requests in a flood, one new key each.
const FLOOD_REQUESTS: u64 = 5_000_000;
/// `max_keys` of the flooded store.
const FLOOD_MAX: usize = 100_000;
/// Simulated time between flood requests.
const FLOOD_STEP: Duration = Duration::from_micros(10);
/// A table row every this many requests.
const FLOOD_ROW_EVERY: u64 = 500_000;
/// The store's length is sampled every this many requests.
const FLOOD_SAMPLE_EVERY: u64 = 1_000;

const PER_KEY_CASES: [&str; 6] = [
    "tollway_gcra",
    "tollway_token_bucket",
    "tollway_counter_10",
    "tollway_counter_40k",
    "tollway_sliding_log",
    "governor",
];
const FLOOD_CASES: [&str; 3] = [
    "flood_gcra_10_per_second",
    "flood_token_bucket_10_per_second",
    "flood_gcra_10_per_minute",
];

fn main() {
    if let Ok(case) = std::env::var(CASE_ENV) {
        run_child(&case);
        return;
    }
    let started = Instant::now();

    println!();
    println!("Memory per key: RSS growth after inserting N distinct keys");
    println!("(each case in a fresh process; RSS at 4 KiB resolution, an upper bound)");
    println!();
    println!(
        "| {:<22} | {:>9} | {:>14} | {:>13} | {:>12} | {:>9} |",
        "case", "keys held", "RSS before KiB", "RSS after KiB", "peak RSS KiB", "bytes/key"
    );
    println!(
        "|{:-<24}|{:->11}|{:->16}|{:->15}|{:->14}|{:->11}|",
        "", "", "", "", "", ""
    );
    let mut means = Vec::new();
    for case in PER_KEY_CASES {
        let mut sum = 0.0;
        for keys in PER_KEY_COUNTS {
            let out = child(case, &[(KEYS_ENV, &keys.to_string())]);
            let line = out
                .lines()
                .find_map(|l| l.strip_prefix("result "))
                .unwrap_or_else(|| panic!("case {case} printed no result:\n{out}"));
            let v: Vec<u64> = line
                .split_whitespace()
                .map(|n| n.parse().unwrap())
                .collect();
            let (held, before, after, peak) = (v[0], v[1], v[2], v[3]);
            let per_key = (after.saturating_sub(before) * 1024) as f64 / held as f64;
            sum += per_key;
            println!(
                "| {case:<22} | {held:>9} | {before:>14} | {after:>13} | {peak:>12} | {per_key:>9.1} |"
            );
        }
        means.push((case, sum / PER_KEY_COUNTS.len() as f64));
    }
    println!();
    for (case, mean) in means {
        println!("{case}: mean over the six counts {mean:.1} bytes/key");
    }

    println!();
    println!(
        "Unique-key flood: {FLOOD_REQUESTS} requests, each from a new key, max_keys {FLOOD_MAX}, \
         ManualClock +{} µs per request",
        FLOOD_STEP.as_micros()
    );
    for case in FLOOD_CASES {
        let out = child(case, &[]);
        println!();
        println!("{case}:");
        println!(
            "| {:>10} | {:>9} | {:>12} | {:>7} | {:>16} | {:>10} |",
            "requests", "store.len", "max len seen", "RSS KiB", "StoreFull so far", "ns/request"
        );
        println!(
            "|{:->12}|{:->11}|{:->14}|{:->9}|{:->18}|{:->12}|",
            "", "", "", "", "", ""
        );
        for line in out.lines().filter_map(|l| l.strip_prefix("row ")) {
            let v: Vec<u64> = line
                .split_whitespace()
                .map(|n| n.parse().unwrap())
                .collect();
            println!(
                "| {:>10} | {:>9} | {:>12} | {:>7} | {:>16} | {:>10} |",
                v[0], v[1], v[2], v[3], v[4], v[5]
            );
        }
    }
    println!();
    println!("total time {:.1} s", started.elapsed().as_secs_f64());
}

/// Runs this binary again with one case selected and returns what it printed.
fn child(case: &str, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .env(CASE_ENV, case)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "case {case} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn run_child(case: &str) {
    match case {
        "tollway_gcra" => per_key_tollway(Algorithm::Gcra, 10),
        "tollway_token_bucket" => per_key_tollway(Algorithm::TokenBucket, 10),
        "tollway_counter_10" => per_key_tollway(Algorithm::SlidingWindowCounter, 10),
        "tollway_counter_40k" => per_key_tollway(Algorithm::SlidingWindowCounter, 40_000),
        "tollway_sliding_log" => per_key_tollway(Algorithm::SlidingWindowLog, 10),
        "governor" => per_key_governor(),
        "flood_gcra_10_per_second" => flood(Algorithm::Gcra, Quota::per_second(10).unwrap()),
        "flood_token_bucket_10_per_second" => {
            flood(Algorithm::TokenBucket, Quota::per_second(10).unwrap());
        }
        "flood_gcra_10_per_minute" => flood(Algorithm::Gcra, Quota::per_minute(10).unwrap()),
        other => panic!("unknown case {other:?}"),
    }
}

/// A `VmRSS`/`VmHWM`-style line of `/proc/self/status`, in KiB.
fn status_kib(field: &str) -> u64 {
    let status = fs::read_to_string("/proc/self/status").expect("this bench needs Linux /proc");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}

fn rss_kib() -> u64 {
    status_kib("VmRSS:")
}

/// The key count a per-key child inserts.
fn per_key_keys() -> u64 {
    std::env::var(KEYS_ENV)
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000_000)
}

/// Keys under `algorithm` at `per_second` a second.
fn per_key_tollway(algorithm: Algorithm, per_second: u32) {
    let quota = Quota::per_second(per_second.into()).unwrap();
    let policy = Policy::new("mem", algorithm, quota).unwrap();
    let before = rss_kib();
    let store = MemoryStore::builder()
        .max_keys(PER_KEY_MAX)
        .clock(ManualClock::new())
        .build()
        .unwrap();
    for k in 0..per_key_keys() {
        assert!(store.check_sync(&k.to_le_bytes(), &policy, 1).is_allowed());
    }
    let after = rss_kib();
    let peak = status_kib("VmHWM:");
    println!("result {} {before} {after} {peak}", store.len());
    drop(store);
}

fn per_key_governor() {
    let quota = GovQuota::per_second(NonZeroU32::new(10).unwrap());
    let before = rss_kib();
    let limiter = RateLimiter::keyed(quota);
    for k in 0..per_key_keys() {
        assert!(limiter.check_key(&k).is_ok());
    }
    let after = rss_kib();
    let peak = status_kib("VmHWM:");
    println!("result {} {before} {after} {peak}", limiter.len());
    drop(limiter);
}

fn flood(algorithm: Algorithm, quota: Quota) {
    let policy = Policy::new("flood", algorithm, quota).unwrap();
    let clock = ManualClock::new();
    let store = MemoryStore::builder()
        .max_keys(FLOOD_MAX)
        .clock(clock.clone())
        .build()
        .unwrap();
    let mut max_len = 0;
    let mut store_full = 0u64;
    let mut block = Instant::now();
    for n in 1..=FLOOD_REQUESTS {
        let decision = store.check_sync(&n.to_le_bytes(), &policy, 1);
        if decision.denial() == Some(Denial::StoreFull) {
            store_full += 1;
        }
        clock.advance(FLOOD_STEP);
        if n % FLOOD_SAMPLE_EVERY == 0 {
            let len = store.len();
            assert!(
                len <= FLOOD_MAX,
                "store held {len} keys, over max_keys {FLOOD_MAX}"
            );
            max_len = max_len.max(len);
        }
        if n % FLOOD_ROW_EVERY == 0 {
            let ns = block.elapsed().as_nanos() / u128::from(FLOOD_ROW_EVERY);
            println!(
                "row {n} {} {max_len} {} {store_full} {ns}",
                store.len(),
                rss_kib()
            );
            block = Instant::now();
        }
    }
}
