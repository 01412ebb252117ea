//! Outbound limits end to end: workers calling a real upstream on 127.0.0.1 (an axum
//! server that enforces its own quota with tollway and answers 429 past it) through
//! `OutboundLayer` around hyper-util's client, on tokio's paused clock, which the
//! stores read through `TokioClock` so that waiting and limiting agree about time.
//!
//! By topic: a fleet sharing one budget (`fleet`), waiting for the limit and what fails
//! instead (`waiting`), an upstream's 429 pausing the clients that share its key
//! (`pauses`), and costs settled from the response (`costs`).

#![allow(clippy::unwrap_used)]

mod costs;
mod fleet;
mod pauses;
mod waiting;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::http::{Hits, Server, routes};
use tollway_core::{Algorithm, MemoryStore, Operation, Policy, Quota, Store};
use tollway_tower::outbound::{NoReplay, OutboundError, OutboundLayer};
use tollway_tower::{GlobalKey, Key, RateLimitLayer, TokioClock};
use tower::{Layer, Service, ServiceExt};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// An upstream that allows `per_second` requests a second (burst as many) from everyone
/// together, on tokio's clock, and answers 429 past it; with the count of requests it
/// received (those it refused are that less its `hits`).
async fn upstream(per_second: u32, hits: &Hits) -> (Server, Arc<AtomicU64>) {
    let store = paused_store();
    let policy = Policy::new(
        "upstream",
        Algorithm::Gcra,
        Quota::per_second(per_second.into()).unwrap(),
    )
    .unwrap();
    let layer = RateLimitLayer::builder(store, policy)
        .key(GlobalKey)
        .build()
        .unwrap();
    let received = Arc::new(AtomicU64::new(0));
    let count = Arc::clone(&received);
    let counted = tower::util::MapRequestLayer::new(move |request| {
        count.fetch_add(1, Ordering::Relaxed);
        request
    });
    let server = Server::start(routes(hits).layer(layer).layer(counted)).await;
    (server, received)
}

fn get(server: &Server) -> Request<Empty<Bytes>> {
    Request::get(format!("http://{}/", server.addr()))
        .body(Empty::new())
        .unwrap()
}

/// A memory store on tokio's (paused) clock.
fn paused_store() -> MemoryStore<TokioClock> {
    MemoryStore::builder()
        .clock(TokioClock::new())
        .build()
        .unwrap()
}

/// A client of its own of the shared `redis-server`, as a separate process would have,
/// under `prefix`, deciding on tokio's (paused) clock. An hour's timeout and grace: the
/// paused clock moves while a reply is on its way (see [`support::keep_time_moving`]), and Redis
/// expires keys by its own clock.
async fn redis_store(prefix: &str) -> tollway_core::RedisStore {
    support::redis_store()
        .prefix(prefix)
        .without_local_fallback()
        .caller_time(TokioClock::new())
        .timeout(Duration::from_secs(3_600))
        // The paused clock moves while a reply is on its way: no stall watch either.
        .without_stall_detection()
        .grace(Duration::from_secs(3_600))
        .connect(&support::shared_server().url())
        .await
        .unwrap()
}

/// One request through `client`.
async fn send<S>(client: &mut S, server: &Server) -> Result<S::Response, S::Error>
where
    S: Service<Request<Empty<Bytes>>>,
{
    client.ready().await?.call(get(server)).await
}

/// Statuses the upstream answered, and the limiter's own refusals.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    too_many: AtomicU64,
    refused_here: AtomicU64,
}
