//! A fleet: two gateways sharing one Redis enforce one limit.

use axum::http::StatusCode;
use support::http::{Hits, assert_too_many, serve};
use support::stores::{EPOCH_US, memory_store, per_minute, redis_store_under};
use support::{unique_prefix, within};
use tollway_core::{ManualClock, Store};
use tollway_tower::RateLimitLayer;

/// Two gateways (two axum servers, each with its own Redis connection and layer) sharing
/// one Redis enforce one limit: 10 a minute, 6 concurrent requests to each, exactly 10
/// served, each of the 10 units handed out once. The same two gateways on memory stores
/// (one each) serve all 12: the shared store is what makes the limit one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_sharing_one_redis_enforce_one_limit() {
    async fn fleet<St: Store>(a: St, b: St, clock: &ManualClock) -> (Vec<u64>, usize, usize) {
        let hits = Hits::default();
        let mut servers = Vec::new();
        for store in [a, b] {
            let layer = RateLimitLayer::builder(store, per_minute("shared", 10))
                .wall_clock(clock.clone())
                .build()
                .unwrap();
            servers.push(serve(layer, &hits).await);
        }
        let requests: Vec<_> = servers
            .iter()
            .flat_map(|server| std::iter::repeat_n(server.client(), 6))
            .map(|client| tokio::spawn(async move { client.get("/").await }))
            .collect();
        let (mut remaining, mut denied) = (Vec::new(), 0);
        for request in requests {
            let reply = within("a request", 10, request).await.unwrap();
            if reply.status == StatusCode::OK {
                remaining.push(
                    reply
                        .header("x-ratelimit-remaining")
                        .unwrap()
                        .parse()
                        .unwrap(),
                );
            } else {
                assert_too_many(&reply, 6);
                denied += 1;
            }
        }
        remaining.sort_unstable();
        (remaining, denied, hits.get())
    }

    let clock = ManualClock::at_micros(EPOCH_US);
    // Two connections to one server, one key prefix: one limit.
    let prefix = unique_prefix("fleet");
    let (a, b) = (
        redis_store_under(&prefix, &clock).await,
        redis_store_under(&prefix, &clock).await,
    );
    let (remaining, denied, hits) = fleet(a, b, &clock).await;
    assert_eq!(remaining, (0..10).collect::<Vec<u64>>());
    assert_eq!((denied, hits), (2, 10));

    let (a, b) = (memory_store(&clock), memory_store(&clock));
    let (remaining, denied, hits) = fleet(a, b, &clock).await;
    assert_eq!(remaining.len(), 12, "{remaining:?}");
    assert_eq!((denied, hits), (0, 12));
}
