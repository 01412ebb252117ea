//! Envoy with tollway-server's rate limit filter on, against the same Envoy with it off:
//! requests a second and latency of an application behind it, in interleaved rounds.
//!
//! ```sh
//! bash tests/setup   # Envoy 1.40 into target/envoy
//! cargo bench -p tests --bench envoy
//! ```
//!
//! The application answers `ok` (axum, 127.0.0.1). Three Envoys run the documented
//! configuration (`crates/tollway-server/envoy.yaml`): one without the rate limit
//! filter, one asking a tollway-server on the memory store, one asking a tollway-server
//! on a `redis-server` of its own. The limit (10^9 an hour by address) never refuses:
//! the bench measures the asking. Each round sends from 16 connections for 5 s, a
//! variant at a time, three rounds each in turn; the figures are the rounds' medians.
//! Everything shares this machine's cores: the load, the Envoys, the servers.

#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;
use std::time::Duration;

use axum::Router;
use metrics_exporter_prometheus::PrometheusBuilder;
use support::RedisServer;
use support::envoy::{self, Envoy};
use support::http::Server;

const CONNECTIONS: usize = 16;
const ROUND: Duration = Duration::from_secs(5);
const ROUNDS: usize = 3;

const LIMITS: &str = r#"
[layer]
default = "per_address"
headers = "legacy"

[policies.per_address]
algorithm = "gcra"
limit = 1_000_000_000
period = "1h"

[[descriptors]]
domain = "edge"
entries = [{ key = "remote_address" }]
policy = "per_address"
key = "ip"
"#;

/// A limits file in a directory of its own.
fn file(name: &str, text: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("tollway-bench-envoy-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("limits.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let metrics = PrometheusBuilder::new().install_recorder().unwrap();
        let app = Server::start(Router::new().fallback(|| async { "ok" })).await;
        let redis = RedisServer::start();
        let on_memory = file("memory", LIMITS);
        let store = format!("[store]\nkind = \"redis\"\nurl = \"{}\"\n", redis.url());
        let on_redis = file("redis", &format!("{store}{LIMITS}"));
        let mut servers = Vec::new();
        let mut envoys = Vec::new();
        for config in [&on_memory, &on_redis] {
            let any = support::server::any_port();
            let served = support::server::start(config, any, None, metrics.clone())
                .await
                .unwrap();
            servers.push(served.running);
            envoys.push(Envoy::start(&envoy::documented(app.addr(), served.grpc)).await);
        }
        // The same configuration without the rate limit filter.
        let documented = envoy::documented(app.addr(), "127.0.0.1:1".parse().unwrap());
        let (from, to) = (
            documented
                .find("          - name: envoy.filters.http.ratelimit")
                .unwrap(),
            documented
                .find("          - name: envoy.filters.http.router")
                .unwrap(),
        );
        let off = format!("{}{}", &documented[..from], &documented[to..]);
        envoys.insert(0, Envoy::start(&off).await);
        let names = [
            "filter off",
            "filter on, memory store",
            "filter on, Redis store",
        ];
        // Warm every path up: connections, scripts, pools.
        for envoy in &envoys {
            let client = envoy.client();
            for _ in 0..200 {
                assert!(client.get("/").await.status.is_success());
            }
        }
        let named: Vec<(&str, &Envoy)> = names.iter().copied().zip(envoys.iter()).collect();
        envoy::interleaved(&named, ROUNDS, CONNECTIONS, ROUND, &[]).await;
        for running in servers {
            running.stop().await;
        }
        drop(redis);
    });
}
