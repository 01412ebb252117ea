//! `ShouldRateLimit` calls a second and their latency: tollway-server on a memory store
//! and on Redis, beside the protocol's floor (a tonic service of the same generated types
//! that answers OK without deciding anything), the same client for each.
//!
//! ```text
//! bash crates/tollway-server/benches/rls.sh    (env: ROUNDS=3 SECONDS=5 CALLERS=64)
//! ```
//!
//! The script starts a redis-server of its own and passes `REDIS_URL`. The client runs in
//! this process beside the server (2 cores: both compete, for every variant alike):
//! `CALLERS` tasks over 4 HTTP/2 connections, each asking one descriptor of one of
//! 10,000 addresses at a time, for `SECONDS` a round. Rounds interleave the variants.

#![allow(clippy::unwrap_used, missing_docs)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::net::TcpListener;
use tonic::transport::Channel;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

/// The floor: answers OK to everything, deciding nothing.
struct Floor;

#[tonic::async_trait]
impl RateLimitService for Floor {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let statuses = request
            .get_ref()
            .descriptors
            .iter()
            .map(|_| Default::default());
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            statuses: statuses.collect(),
            ..Default::default()
        }))
    }
}

fn limits(store: &str) -> String {
    format!(
        "{store}
[layer]
default = \"per_address\"

[policies.per_address]
algorithm = \"gcra\"
limit = 1_000_000
period = \"1m\"

[[descriptors]]
domain = \"edge\"
entries = [{{ key = \"remote_address\" }}]
policy = \"per_address\"
key = \"ip\"
"
    )
}

/// Serves `variant` on a free port; returns its address and what stops it.
async fn start(variant: &str, dir: &std::path::Path) -> (SocketAddr, Box<dyn FnOnce() + Send>) {
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap();
    if variant == "floor" {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RateLimitServiceServer::new(Floor))
                .serve_with_incoming_shutdown(TcpIncoming::from(grpc), async {
                    let _ = stopped.await;
                }),
        );
        return (
            addr,
            Box::new(move || {
                let _ = stop.send(());
            }),
        );
    }
    let store = match variant {
        "redis" => format!(
            "[store]\nkind = \"redis\"\nurl = \"{}\"\n",
            std::env::var("REDIS_URL").unwrap()
        ),
        _ => String::new(),
    };
    let path: PathBuf = dir.join(format!("{variant}.toml"));
    std::fs::write(&path, limits(&store)).unwrap();
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .build_recorder()
        .handle();
    let running = tollway_server::start(tollway_server::Options {
        config: &path,
        grpc,
        http,
        metrics,
        watch: false,
        tls: None,
        connections: tollway_server::Connections::default(),
    })
    .await
    .unwrap();
    let stop = Box::new(move || {
        tokio::spawn(running.stop());
    });
    (addr, stop)
}

/// Calls a second, and p50 / p99 in microseconds, of `callers` tasks for `seconds`.
async fn drive(addr: SocketAddr, callers: usize, seconds: u64) -> (f64, u64, u64) {
    let mut channels = Vec::new();
    for _ in 0..4 {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        channels.push(channel);
    }
    let until = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let mut client = RateLimitServiceClient::new(channels[caller % 4].clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut n = caller as u32;
            while Instant::now() < until {
                n = n.wrapping_mul(2_654_435_761).wrapping_add(1);
                let address = format!("10.{}.{}.{}", (n >> 16) % 40, (n >> 8) % 250, n % 10);
                let request = RateLimitRequest {
                    domain: "edge".to_owned(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![Entry {
                            key: "remote_address".to_owned(),
                            value: address,
                        }],
                        ..Default::default()
                    }],
                    hits_addend: 1,
                };
                let began = Instant::now();
                let answer = client
                    .should_rate_limit(request)
                    .await
                    .unwrap()
                    .into_inner();
                latencies.push(began.elapsed().as_micros() as u64);
                assert_eq!(answer.overall_code, Code::Ok as i32);
            }
            latencies
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let at = |q: usize| all[(all.len() - 1) * q / 100];
    (all.len() as f64 / elapsed, at(50), at(99))
}

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let seconds: u64 = std::env::var("SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let callers: usize = std::env::var("CALLERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let mut variants = vec!["floor", "memory"];
    if std::env::var("REDIS_URL").is_ok() {
        variants.push("redis");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("tollway-rls-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let results = Arc::new(std::sync::Mutex::new(Vec::new()));
    runtime.block_on(async {
        for round in 1..=rounds {
            for variant in &variants {
                let (addr, stop) = start(variant, &dir).await;
                let (rate, p50, p99) = drive(addr, callers, seconds).await;
                stop();
                println!("round {round} {variant:>6}: {rate:>8.0} calls/s  p50 {p50:>5} µs  p99 {p99:>6} µs");
                results.lock().unwrap().push((*variant, rate, p50, p99));
            }
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "\n| variant | calls/s (median of {rounds}) | p50 µs | p99 µs |\n|---|---:|---:|---:|"
    );
    for variant in &variants {
        let mut rows: Vec<_> = results
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.0 == *variant)
            .map(|r| (r.1, r.2, r.3))
            .collect();
        rows.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (rate, p50, p99) = rows[rows.len() / 2];
        println!("| {variant} | {rate:.0} | {p50} | {p99} |");
    }
}
