//! The Redis store suites: the Lua script decides exactly like the Rust functions, for
//! one limit and for several at once, atomically across gateways; it survives `SCRIPT
//! FLUSH`; its keys expire, include the quota, and cannot be steered by a caller.
//!
//! Each suite is a function of a [`Target`] (one server or a cluster) that keeps to key
//! prefixes of its own, so that suites can share a server or a cluster, and returns the
//! Redis keys it used. The store-agnostic traces are `tollway_core::testing`'s; these
//! run them against Redis ([`conformance`]) and add what only Redis has (`script`).

use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use tollway_core::{ManualClock, RedisStore, RedisStoreBuilder};

mod concurrency;
mod conformance;
mod costs;
mod lease;
mod script;
mod share;

pub use concurrency::{concurrency_across_gateways, in_flight_across_gateways};
pub use conformance::{clock_skew, conformance, conformance_multi, conformance_server_time};
pub use costs::a_refused_token_takes_no_request_unit;
pub use lease::{Counted, leased_atomicity, lend_conformance, lend_conformance_server_time};
pub use script::{
    a_changed_limit_keeps_usage, atomicity, expiry, hostile_keys, one_round_trip, script_flush,
};
pub use share::share_conformance;

/// Where the suite's stores connect.
#[derive(Clone, Debug)]
pub enum Target {
    /// One `redis-server`.
    Server(String),
    /// A Redis Cluster, through every node's URL.
    Cluster(Vec<String>),
}

impl Target {
    /// A gateway: `builder`'s store on its own connection(s) to the target.
    pub async fn connect(&self, builder: RedisStoreBuilder) -> RedisStore {
        match self {
            Target::Server(url) => builder.connect(url).await.unwrap(),
            Target::Cluster(urls) => {
                let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
                builder.connect_cluster(&urls).await.unwrap()
            }
        }
    }

    /// A plain client for keyed commands (`GET`, `PTTL`, ...), sent to the node that
    /// owns the key.
    pub async fn admin(&self) -> Admin {
        match self {
            Target::Server(url) => Admin::Server(
                redis::Client::open(url.as_str())
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap(),
            ),
            Target::Cluster(urls) => Admin::Cluster(
                redis::cluster::ClusterClient::new(urls.clone())
                    .unwrap()
                    .get_async_connection()
                    .await
                    .unwrap(),
            ),
        }
    }

    /// A connection to every node, replicas included (`SCRIPT FLUSH`, `INFO`).
    pub async fn each_node(&self) -> Vec<MultiplexedConnection> {
        let urls = match self {
            Target::Server(url) => std::slice::from_ref(url),
            Target::Cluster(urls) => urls.as_slice(),
        };
        let mut nodes = Vec::new();
        for url in urls {
            nodes.push(
                redis::Client::open(url.as_str())
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap(),
            );
        }
        nodes
    }
}

/// A connection to one server, or a cluster client that routes each command by its key.
#[derive(Clone)]
#[allow(missing_debug_implementations)] // redis-rs's cluster connection has no Debug
pub enum Admin {
    /// One server's connection.
    Server(MultiplexedConnection),
    /// The cluster's client.
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for Admin {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Admin::Server(con) => con.req_packed_command(cmd),
            Admin::Cluster(con) => con.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Admin::Server(con) => con.req_packed_commands(pipeline, offset, count),
            Admin::Cluster(con) => con.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Admin::Server(con) => con.get_db(),
            Admin::Cluster(con) => con.get_db(),
        }
    }
}

/// A store on the caller's (manual) time, with a timeout no test should reach.
///
/// Redis expires keys by its own clock, which runs on while the manual one stands still:
/// an hour's grace keeps every key's state as long as the test runs, however slowly.
/// (State that becomes fresh is deleted at once either way.)
pub fn builder(clock: &ManualClock) -> RedisStoreBuilder {
    crate::redis_store()
        .without_local_fallback()
        .timeout(Duration::from_secs(5))
        .caller_time(clock.clone())
        .grace(Duration::from_secs(3_600))
}
