//! The ways around the limit an adversarial review found, each attacked over real HTTP
//! or gRPC (and real Redis where the attack is on Redis), each asserting the limit holds.
//!
//! A server here sees every request come from 127.0.0.1. Where a test needs a trusted
//! proxy in front, the test's client plays the proxy: it connects from 127.0.0.1, which
//! the layer trusts, and sends the header that proxy would write — with the client's own
//! forgeries beside it, as a real proxy would pass them on.

#![allow(clippy::unwrap_used)]

mod headers;
mod identity;
mod memory;
mod redis;
mod routes;

use support::http::{Hits, Reply, serve};
use support::stores::{EPOCH_US, memory_store, per_minute};
use tollway_core::ManualClock;
use tollway_tower::{KeyExtractor, RateLimitLayer};

/// Serves `routes` behind a layer over a memory store: `per_minute` (`limit`) keyed by
/// `key`, on a manual clock that does not move.
async fn limited<K>(key: K, limit: u32, hits: &Hits) -> support::http::Server
where
    K: KeyExtractor<axum::body::Body>,
{
    let clock = ManualClock::at_micros(EPOCH_US);
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("attacked", limit))
        .key(key)
        .wall_clock(clock)
        .build()
        .unwrap();
    serve(layer, hits).await
}

/// How many of `replies` the handler answered.
fn admitted(replies: &[Reply]) -> usize {
    replies
        .iter()
        .filter(|r| r.status == axum::http::StatusCode::OK)
        .count()
}
