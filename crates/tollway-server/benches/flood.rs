//! A CPU flood of tollway-server against a healthy Redis: does the stall watch see a
//! stall that is not there, and does a victim key stay at its bound?
//!
//! ```text
//! bash crates/tollway-server/benches/flood.sh    (env: SECONDS=26 CALLERS=64)
//! ```
//!
//! The script starts a redis-server and the release tollway-server (each its own
//! process), then runs this client: `CALLERS` tasks over 8 HTTP/2 connections sending
//! requests of 64 descriptors (each a key of its own, far under its limit) as fast as the
//! server answers, and one victim key asking every 20 ms against 100 a minute. It prints
//! what each got; the script prints the stalls the server declared.

#![allow(clippy::unwrap_used, missing_docs)]

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

fn descriptor(key: String) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: vec![Entry {
            key: "api_key".to_owned(),
            value: key,
        }],
        ..Default::default()
    }
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let addr: String = std::env::var("GRPC").expect("GRPC=host:port of tollway-server");
    let seconds: u64 = env("SECONDS", 26);
    let callers: usize = env("CALLERS", 64);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut channels = Vec::new();
        for _ in 0..8 {
            channels.push(
                Channel::from_shared(format!("http://{addr}"))
                    .unwrap()
                    .connect()
                    .await
                    .unwrap(),
            );
        }
        let until = Instant::now() + Duration::from_secs(seconds);
        let mut flood = Vec::new();
        for caller in 0..callers {
            let mut client = RateLimitServiceClient::new(channels[caller % 8].clone());
            flood.push(tokio::spawn(async move {
                let (mut calls, mut n) = (0u64, caller as u64 * 1_000_000);
                while Instant::now() < until {
                    let descriptors = (0..64)
                        .map(|_| {
                            n += 1;
                            descriptor(format!("flood-{}", n % 50_000))
                        })
                        .collect();
                    let request = RateLimitRequest {
                        domain: "edge".to_owned(),
                        descriptors,
                        hits_addend: 1,
                    };
                    if client.should_rate_limit(request).await.is_ok() {
                        calls += 1;
                    }
                }
                calls
            }));
        }
        let mut victim = RateLimitServiceClient::new(channels[0].clone());
        let (mut admitted, mut refused, mut errors) = (0u64, 0u64, 0u64);
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        let started = Instant::now();
        while Instant::now() < until {
            tick.tick().await;
            let request = RateLimitRequest {
                domain: "edge".to_owned(),
                descriptors: vec![descriptor("victim".to_owned())],
                hits_addend: 1,
            };
            match victim.should_rate_limit(request).await {
                Ok(answer) if answer.get_ref().overall_code == Code::Ok as i32 => admitted += 1,
                Ok(_) => refused += 1,
                Err(_) => errors += 1,
            }
        }
        let elapsed = started.elapsed().as_secs_f64();
        let mut calls = 0;
        for task in flood {
            calls += task.await.unwrap();
        }
        // 100 a minute, a burst of 100: the most one bucket of it passes in the time.
        let bound = 100.0 + 100.0 * elapsed / 60.0;
        println!(
            "flood: {calls} requests of 64 descriptors in {elapsed:.1} s ({:.0} a second)",
            calls as f64 / elapsed
        );
        println!(
            "victim (100 a minute, asking every 20 ms): {admitted} admitted (bound {bound:.0}), \
             {refused} refused, {errors} errors"
        );
    });
}
