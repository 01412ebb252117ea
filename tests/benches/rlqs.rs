//! The quota service (RLQS) behind real Envoys: how exactly shares follow demand, and
//! what the assignments cost against RLS's one call a request.
//!
//! ```sh
//! bash tests/setup   # Envoy 1.40 into target/envoy
//! cargo bench -p tests --bench rlqs
//! ```
//!
//! **Shares.** Three Envoys on the documented configuration
//! (`crates/tollway-server/envoy-rlqs.yaml`), two asking one tollway-server replica and
//! one another, both on one `redis-server`; one API key limited to `LIMIT` a second
//! (burst `LIMIT`). Requests come open loop at twice the limit in all, split 10:1:1,
//! then 1:1:10, then 1:1:1, `PHASE` each. The application stamps what passed. Envoy
//! 1.40 reports every 5 s whatever `reporting_interval` says, so the report interval
//! cannot be varied. Redis's script calls, less the readiness probes (one a second a
//! replica), are the shares' store calls.
//!
//! **Cost.** The same Envoy configuration with the quota filter, with the rate limit
//! filter (`envoy.yaml`, one call a request, on Redis) and with neither, at a limit that
//! never refuses: 16 connections for 5 s a round, variants in turn, three rounds, medians.

#![allow(clippy::unwrap_used, missing_docs)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use support::RedisServer;
use support::envoy::{self, Envoy};
use support::http::{Server, Stamps, most_within};

const LIMIT: u64 = 200;
const PHASE: Duration = Duration::from_secs(30);
const CONNECTIONS: usize = 16;
const ROUND: Duration = Duration::from_secs(5);
const ROUNDS: usize = 3;

fn limits(redis: &str, limit: u64) -> String {
    format!(
        r#"
[store]
kind = "redis"
url = "{redis}"

[layer]
default = "per_key"
headers = "legacy"

[policies.per_key]
algorithm = "token_bucket"
limit = {limit}
period = "1s"

[[buckets]]
domain = "edge"
entries = [{{ key = "api_key" }}]
policy = "per_key"

[[buckets]]
domain = "edge"
entries = [{{ key = "caller", value = "anonymous" }}]
policy = "per_key"

[policies.per_address]
algorithm = "gcra"
limit = 1_000_000_000
period = "1h"

[policies.rls_key]
algorithm = "gcra"
limit = 1_000_000_000
period = "1h"

[[descriptors]]
domain = "edge"
entries = [{{ key = "remote_address" }}]
policy = "per_address"
key = "ip"

[[descriptors]]
domain = "edge"
entries = [{{ key = "api_key" }}]
policy = "rls_key"
"#
    )
}

fn file(name: &str, text: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("tollway-bench-rlqs-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("limits.toml");
    std::fs::write(&path, text).unwrap();
    path
}

async fn server(
    config: &std::path::Path,
    metrics: &PrometheusHandle,
) -> (tollway_server::Running, SocketAddr) {
    let any = support::server::any_port();
    let served = support::server::start(config, any, None, metrics.clone())
        .await
        .unwrap();
    (served.running, served.grpc)
}

async fn script_calls(redis: &RedisServer) -> u64 {
    let mut con = redis.connection().await;
    support::script_calls(&mut con).await
}

async fn shares(metrics: &PrometheusHandle) {
    let (app, stamps) = Stamps::serve().await;
    let redis = RedisServer::start();
    let config = file("shares", &limits(&redis.url(), LIMIT));
    let (first, grpc_a) = server(&config, metrics).await;
    let (second, grpc_b) = server(&config, metrics).await;
    let mut envoys = Vec::new();
    for grpc in [grpc_a, grpc_a, grpc_b] {
        let yaml = envoy::documented_file("envoy-rlqs.yaml", app.addr(), grpc);
        envoys.push(Envoy::start(&yaml).await);
    }
    let phases: [[u64; 3]; 3] = [[10, 1, 1], [1, 1, 10], [1, 1, 1]];
    let calls_before = script_calls(&redis).await;
    let started = Instant::now();
    let mut load = Vec::new();
    for (i, envoy) in envoys.iter().enumerate() {
        let client = envoy.client();
        load.push(tokio::spawn(async move {
            let mut sent = 0u64;
            for (p, weights) in phases.iter().enumerate() {
                let total: u64 = weights.iter().sum();
                let rate = 2 * LIMIT * weights[i] / total;
                let every = Duration::from_secs_f64(1.0 / rate as f64);
                let phase_start = started + PHASE * p as u32;
                let mut n = 0u32;
                loop {
                    let at = phase_start + every * n;
                    if at >= phase_start + PHASE {
                        break;
                    }
                    tokio::time::sleep_until(at.into()).await;
                    let client = client.clone();
                    tokio::spawn(async move {
                        let _ = client.get_with("/", &[("x-api-key", "k")]).await;
                    });
                    n += 1;
                    sent += 1;
                }
            }
            sent
        }));
    }
    let mut sent = 0;
    for task in load {
        sent += task.await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let elapsed = started.elapsed();
    let calls = script_calls(&redis).await - calls_before;
    let probes = 2 * elapsed.as_secs();
    let times = stamps.since(started);
    println!(
        "limit {LIMIT}/s (burst {LIMIT}); sent {sent} in {:.0} s, passed {}",
        elapsed.as_secs_f64(),
        times.len()
    );
    println!("| window | most passed | one bucket of the policy (burst + limit × window) |");
    println!("|---:|---:|---:|");
    for window in [1u64, 2, 5, 10, 30] {
        let most = most_within(&times, Duration::from_secs(window));
        println!("| {window} s | {most} | {} |", LIMIT + LIMIT * window);
    }
    println!();
    println!(
        "| phase (demand) | passed/s in each second | used, seconds 10–30 | every second ≥ 95% from |"
    );
    println!("|---|---|---:|---:|");
    for (p, weights) in phases.iter().enumerate() {
        let from = PHASE * p as u32;
        let per_second: Vec<usize> = (0..PHASE.as_secs())
            .map(|s| {
                let a = from + Duration::from_secs(s);
                let b = a + Duration::from_secs(1);
                times.iter().filter(|t| **t >= a && **t < b).count()
            })
            .collect();
        let late: usize = per_second[10..].iter().sum();
        let used = late as f64 / (LIMIT as f64 * (PHASE.as_secs() - 10) as f64);
        // From when every second passes 95% of the limit or more, to the phase's end.
        let low = |n: &usize| (*n as f64) < 0.95 * LIMIT as f64;
        let reached = match per_second.iter().rposition(low) {
            None => "0 s".to_owned(),
            Some(last) if last + 1 < per_second.len() => format!("{} s", last + 1),
            Some(_) => "never".to_owned(),
        };
        let shown: Vec<String> = per_second.iter().map(ToString::to_string).collect();
        println!(
            "| {}:{}:{} | {} | {:.1}% | {reached} |",
            weights[0],
            weights[1],
            weights[2],
            shown.join(" "),
            used * 100.0
        );
    }
    println!();
    println!(
        "script calls {calls} (readiness probes about {probes}): {} for shares, {:.5} a request passed",
        calls.saturating_sub(probes),
        calls.saturating_sub(probes) as f64 / times.len() as f64
    );
    first.stop().await;
    second.stop().await;
}

async fn cost(metrics: &PrometheusHandle) {
    let app = Server::start(Router::new().fallback(|| async { "ok" })).await;
    let redis = RedisServer::start();
    // A limit that never refuses: the bench measures the asking.
    let config = file("cost", &limits(&redis.url(), 1_000_000));
    let (running, grpc) = server(&config, metrics).await;
    let rls = envoy::documented(app.addr(), grpc);
    let rlqs = envoy::documented_file("envoy-rlqs.yaml", app.addr(), grpc);
    let (from, to) = (
        rls.find("          - name: envoy.filters.http.ratelimit")
            .unwrap(),
        rls.find("          - name: envoy.filters.http.router")
            .unwrap(),
    );
    let off = format!("{}{}", &rls[..from], &rls[to..]);
    let envoys = [
        Envoy::start(&off).await,
        Envoy::start(&rls).await,
        Envoy::start(&rlqs).await,
    ];
    let names = [
        "no filter",
        "RLS (one call a request, Redis)",
        "RLQS (assignments, Redis)",
    ];
    const KEY: &[(&str, &str)] = &[("x-api-key", "k")];
    // Warm up; the quota filter's first requests wait for its first assignment.
    for envoy in &envoys {
        let client = envoy.client();
        for _ in 0..200 {
            client.get_with("/", KEY).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let named: Vec<(&str, &Envoy)> = names.iter().copied().zip(envoys.iter()).collect();
    envoy::interleaved(&named, ROUNDS, CONNECTIONS, ROUND, KEY).await;
    running.stop().await;
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let metrics = PrometheusBuilder::new().install_recorder().unwrap();
        shares(&metrics).await;
        println!();
        cost(&metrics).await;
    });
}
