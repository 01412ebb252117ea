//! The quota service (RLQS) behind real Envoys: the documented configuration
//! (`crates/tollway-server/envoy-rlqs.yaml`), three Envoy processes, two tollway-server
//! replicas on one Redis. Each Envoy decides locally from its assignment; the
//! application counts what passed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::envoy::{self, Envoy};
use support::http::{Stamps, most_within};
use support::redis::RedisServer;

use super::{File, tollway};

/// 20 a second per API key, a burst of 20, shared as buckets.
fn limits(redis: &str) -> String {
    format!(
        r#"
[store]
kind = "redis"
url = "{redis}"
stall_after_ms = 1000

[layer]
default = "per_key"

[policies.per_key]
algorithm = "token_bucket"
limit = 20
period = "1s"

[[buckets]]
domain = "edge"
entries = [{{ key = "client" }}]
policy = "per_key"

[[buckets]]
domain = "edge"
entries = [{{ key = "caller", value = "anonymous" }}]
policy = "per_key"
"#
    )
}

#[test]
fn the_documented_quota_configuration_validates() {
    envoy::assert_validates("envoy-rlqs.yaml");
}

// Three Envoys ask at 32, 4 and 4 a second for one API key (twice its 20 a second);
// two talk to one replica, one to another, both on one Redis. The application never
// sees more than one bucket of the policy admits in any window (20 + 20 a second of
// it, and 2 more for the time a request takes from Envoy to the application), and once
// the shares have followed the demand (two of Envoy's 5 s reports), most of the limit
// is used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_envoys_on_two_replicas_admit_no_more_than_the_limit() {
    let (app, stamps) = Stamps::serve().await;
    let redis = RedisServer::start();
    let file = File::new("rlqs-envoy", &limits(&redis.url()));
    let (first, grpc_a) = tollway(&file, "127.0.0.1:0".parse().unwrap()).await;
    let (second, grpc_b) = tollway(&file, "127.0.0.1:0".parse().unwrap()).await;
    let mut envoys = Vec::new();
    for grpc in [grpc_a, grpc_a, grpc_b] {
        let config = with_credentials(&envoy::documented_file("envoy-rlqs.yaml", app.addr(), grpc));
        envoys.push(Envoy::start(&config).await);
    }
    let started = Instant::now();
    let run = Duration::from_secs(22);
    let mut load = Vec::new();
    let mut refused = Vec::new();
    for (envoy, every_ms) in envoys.iter().zip([31u64, 250, 250]) {
        let client = envoy.client();
        let denied = Arc::new(std::sync::atomic::AtomicU64::new(0));
        refused.push(Arc::clone(&denied));
        load.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(every_ms));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while started.elapsed() < run {
                tick.tick().await;
                let client = client.clone();
                let denied = Arc::clone(&denied);
                tokio::spawn(async move {
                    let reply = client.get_with("/", &[("x-api-key", "k")]).await;
                    if reply.status == http::StatusCode::TOO_MANY_REQUESTS {
                        denied.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        }));
    }
    for task in load {
        task.await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sorted = stamps.since(started);
    for window in [1u64, 2, 5, 10, 20] {
        let most = most_within(&sorted, Duration::from_secs(window));
        let bound = 20 + 20 * window as usize + 2;
        assert!(
            most <= bound,
            "{most} passed within {window} s: at most {bound}"
        );
    }
    let late = sorted
        .iter()
        .filter(|t| **t >= Duration::from_secs(12) && **t < Duration::from_secs(22))
        .count();
    let denied: Vec<u64> = refused
        .iter()
        .map(|d| d.load(std::sync::atomic::Ordering::Relaxed))
        .collect();
    eprintln!(
        "passed {} in all, {late} in the last 10 s (at most 220); refused {denied:?}",
        sorted.len()
    );
    assert!(late >= 150, "{late} of 200 in the last 10 s");
    first.stop().await;
    second.stop().await;
}

/// The documented quota configuration with the API key filter's credentials filled in:
/// key `k` of client `k`, and keys `honest-1` to `honest-3` of clients of those names.
pub(super) fn with_credentials(config: &str) -> String {
    let credentials = "credentials:\n              - { key: k, client: k }\n              \
                       - { key: honest-1, client: honest-1 }\n              \
                       - { key: honest-2, client: honest-2 }\n              \
                       - { key: honest-3, client: honest-3 }";
    assert_eq!(config.matches("credentials: []").count(), 1);
    config.replace("credentials: []", credentials)
}
