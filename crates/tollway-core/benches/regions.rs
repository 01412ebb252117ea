//! One global Redis reached across regions: what a decision costs in latency when every
//! gateway decides against one Redis in one region (issue 21's baseline, the mode the
//! regional modes will be measured against).
//!
//! ```sh
//! cargo bench -p tollway-core --features redis --bench regions
//! ```
//!
//! Three simulated regions on loopback: region A holds the `redis-server`; the gateways
//! of B and C reach it through the tests' [`LatencyProxy`], which delays every byte by
//! half the inter-region round trip each way. One gateway a region (its own
//! `RedisStore`, server time, no deny cache, so every decision is a round trip) decides
//! for one customer limited to 100 a second: each region sends one request every 20 ms
//! whatever the answers take (150 a second together, so the limit refuses some), 150 of
//! them, the three regions at once. For inter-region round trips of 20, 80 and 150 ms it prints each region's
//! decision latency (p50, p99) and the admissions against the limit over the run (a full
//! bucket and the refill: a global Redis is exact, so no run may exceed it).

#![allow(clippy::unwrap_used, missing_docs)]

use std::time::{Duration, Instant};

use support::RedisServer;
use support::proxy::LatencyProxy;
use tollway_core::{Algorithm, Policy, Quota, RedisStore, Store};

const DECISIONS: usize = 150;
const PER_SECOND: u32 = 100;
const EVERY: Duration = Duration::from_millis(20);

struct Region {
    name: &'static str,
    latencies: Vec<Duration>,
    admitted: usize,
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e3
}

async fn gateway(name: &'static str, url: String, prefix: String, policy: Policy) -> Region {
    let store = RedisStore::builder()
        .prefix(prefix)
        .timeout(Duration::from_secs(5))
        .deny_cache(0)
        .without_local_fallback()
        .connect(&url)
        .await
        .unwrap();
    // Open loop: a request every EVERY whatever the answers take, as callers send.
    let mut ticks = tokio::time::interval(EVERY);
    let mut pending = tokio::task::JoinSet::new();
    for _ in 0..DECISIONS {
        ticks.tick().await;
        let (store, policy) = (store.clone(), policy.clone());
        pending.spawn(async move {
            let before = Instant::now();
            let decisions = store.check(b"customer", &[&policy], 1).await.unwrap();
            (before.elapsed(), decisions.is_allowed())
        });
    }
    let (mut latencies, mut admitted) = (Vec::with_capacity(DECISIONS), 0);
    while let Some(answer) = pending.join_next().await {
        let (took, allowed) = answer.unwrap();
        latencies.push(took);
        admitted += usize::from(allowed);
    }
    latencies.sort();
    Region {
        name,
        latencies,
        admitted,
    }
}

#[tokio::main]
async fn main() {
    let server = RedisServer::start();
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let policy = Policy::new(
        "global",
        Algorithm::Gcra,
        Quota::per_second(PER_SECOND).unwrap(),
    )
    .unwrap();
    println!(
        "one global Redis in region A; {DECISIONS} decisions a region every {EVERY:?}, the \
         regions at once; {PER_SECOND}/s for one customer"
    );
    println!();
    println!(
        "| round trip A–B, A–C | region | p50 ms | p99 ms | admitted (all regions) | limit over the run |"
    );
    println!("|---|---|---|---|---|---|");
    for rtt_ms in [20u64, 80, 150] {
        let one_way = Duration::from_micros(rtt_ms * 500);
        let to_b = LatencyProxy::start(target, one_way).await;
        let to_c = LatencyProxy::start(target, one_way).await;
        let prefix = support::unique_prefix(&format!("regions-{rtt_ms}"));
        let started = Instant::now();
        let regions = tokio::join!(
            gateway("A", server.url(), prefix.clone(), policy.clone()),
            gateway("B", to_b.redis_url(), prefix.clone(), policy.clone()),
            gateway("C", to_c.redis_url(), prefix, policy.clone()),
        );
        let ran = started.elapsed();
        let regions = [regions.0, regions.1, regions.2];
        let admitted: usize = regions.iter().map(|r| r.admitted).sum();
        let limit = f64::from(PER_SECOND) * (1.0 + ran.as_secs_f64());
        for region in &regions {
            println!(
                "| {rtt_ms} ms | {} | {:.2} | {:.2} | {admitted} ({}) | {limit:.0} in {:.1} s |",
                region.name,
                percentile(&region.latencies, 0.50),
                percentile(&region.latencies, 0.99),
                region.admitted,
                ran.as_secs_f64(),
            );
        }
        assert!(
            admitted as f64 <= limit,
            "a global Redis admitted {admitted}, over {limit}"
        );
    }
}
