//! Decisions per second through `RedisStore`, side by side with `redis-benchmark`
//! running `EVALSHA` of the same token bucket script against the same server.
//!
//! ```sh
//! cargo bench -p tests --bench redis_store
//! ```
//!
//! Starts its own `redis-server` on a free loopback port. Each round runs
//! `redis-benchmark -c 50 -P 16` (50 connections, 16 commands pipelined on each: the
//! server's ceiling for this script), then tollway with 64 concurrent tasks on one
//! multiplexed connection — the default store (its breaker and local fallback), then one
//! built `without_breaker().without_local_fallback()` — then the default through a
//! deadpool-redis pool (a connection checked out per call), all over 10,000 random keys,
//! and prints all four.

#![allow(clippy::unwrap_used, missing_docs)]

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{CheckOne, RedisServer, Rng};
use tollway_core::{Algorithm, Policy, Quota, RedisStore};

const TASKS: usize = 64;
const KEYS: u64 = 10_000;
const CALLS: usize = 400_000;
const ROUNDS: usize = 3;
const LIMIT: u32 = 1_000_000;
const BURST: u32 = 1_000_000_000;

struct Run {
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
}

fn redis_benchmark(port: u16) -> Run {
    let quota = Quota::per_second(LIMIT.into())
        .unwrap()
        .with_burst(BURST.into())
        .unwrap();
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args([
            "-c",
            "50",
            "-P",
            "16",
            "-n",
            &CALLS.to_string(),
            "-r",
            &KEYS.to_string(),
        ])
        .args(["--csv", "EVALSHA", RedisStore::script_sha(), "1"])
        .arg("tollway:{bench:__rand_int__}:bench:0")
        // ARGV (lua/prelude.lua): the server's time, cost 1, no grace, then the token
        // bucket (code 1) at the quota.
        .args(["", "1", "0", "1"])
        .args([
            quota.limit().to_string(),
            quota.period_micros().to_string(),
            quota.burst().to_string(),
            quota.emission_micros().to_string(),
        ])
        .output()
        .expect("redis-benchmark is installed with redis-server");
    let text = String::from_utf8_lossy(&out.stdout);
    // "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    let line = text
        .lines()
        .find(|l| l.starts_with("\"EVALSHA"))
        .unwrap_or_else(|| panic!("no result from redis-benchmark: {text}"));
    let f: Vec<f64> = line
        .split(',')
        .skip(1)
        .map(|v| v.trim_matches('"').parse().unwrap())
        .collect();
    Run {
        per_second: f[0],
        p50_ms: f[3],
        p99_ms: f[5],
    }
}

async fn tollway(store: &RedisStore, policy: &Policy) -> Run {
    let per_task = CALLS / TASKS;
    let started = Instant::now();
    let mut handles = Vec::new();
    for t in 0..TASKS {
        let store = store.clone();
        let policy = policy.clone();
        handles.push(tokio::spawn(async move {
            let mut rng = Rng(t as u64 + 1);
            let mut latencies = Vec::with_capacity(per_task);
            for _ in 0..per_task {
                let key = rng.below(KEYS).to_string();
                let sent = Instant::now();
                let d = store.check_one(key.as_bytes(), &policy, 1).await.unwrap();
                latencies.push(sent.elapsed());
                assert!(d.is_allowed());
            }
            latencies
        }));
    }
    let mut latencies = Vec::with_capacity(CALLS);
    for h in handles {
        latencies.extend(h.await.unwrap());
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Run {
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50_ms: ms(at(0.50)),
        p99_ms: ms(at(0.99)),
    }
}

fn main() {
    // `cargo test --benches` runs bench targets with `--bench` absent: do nothing then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = rt.block_on(async {
        RedisStore::builder()
            .timeout(Duration::from_secs(5))
            .connect(&server.url())
            .await
            .unwrap()
    });
    let bare = rt.block_on(async {
        RedisStore::builder()
            .without_breaker()
            .without_local_fallback()
            .timeout(Duration::from_secs(5))
            .connect(&server.url())
            .await
            .unwrap()
    });
    let quota = Quota::per_second(LIMIT.into())
        .unwrap()
        .with_burst(BURST.into())
        .unwrap();
    let policy = Policy::new("bench", Algorithm::TokenBucket, quota).unwrap();
    // Loads the script, so that redis-benchmark's EVALSHA finds it.
    rt.block_on(store.check_one(b"warm", &policy, 1)).unwrap();
    let store = Arc::new(store);
    let pooled = deadpool_redis::Config::from_url(server.url())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let pooled = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .with_pool(pooled)
        .unwrap();

    println!(
        "{CALLS} token bucket decisions per run over {KEYS} keys, {ROUNDS} rounds, interleaved"
    );
    println!(
        "{:<44} {:>12} {:>9} {:>9}",
        "client", "decisions/s", "p50 ms", "p99 ms"
    );
    let mut ratios = Vec::new();
    let mut breaker_ratios = Vec::new();
    let mut pool_ratios = Vec::new();
    let row = |name: &str, r: &Run| {
        println!(
            "{name:<44} {:>12.0} {:>9.3} {:>9.3}",
            r.per_second, r.p50_ms, r.p99_ms
        )
    };
    for _ in 0..ROUNDS {
        let b = redis_benchmark(server.port());
        row("redis-benchmark EVALSHA -c 50 -P 16", &b);
        let t = rt.block_on(tollway(&store, &policy));
        row("tollway RedisStore, 64 tasks, multiplexed", &t);
        let n = rt.block_on(tollway(&bare, &policy));
        row("  the same without breaker and fallback", &n);
        let p = rt.block_on(tollway(&pooled, &policy));
        row("tollway RedisStore, 64 tasks, deadpool pool", &p);
        ratios.push(t.per_second / b.per_second);
        breaker_ratios.push(t.per_second / n.per_second);
        pool_ratios.push(t.per_second / p.per_second);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    println!(
        "tollway multiplexed / redis-benchmark: {:.1}% (mean of {ROUNDS} rounds)",
        mean(&ratios) * 100.0
    );
    println!(
        "tollway multiplexed, default / without breaker and fallback: {:.1}% (mean of {ROUNDS} rounds)",
        mean(&breaker_ratios) * 100.0
    );
    println!(
        "tollway multiplexed / deadpool pool: {:.2}x (mean of {ROUNDS} rounds)",
        mean(&pool_ratios)
    );
}
