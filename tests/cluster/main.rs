//! The Redis store against a local Redis Cluster (three masters, three replicas, all
//! real `redis-server` processes): the same store suites as on one server, now spread
//! over the masters, each script sent to the master that owns its caller's slot.
//!
//! The tests share one cluster, each under key prefixes of its own. The failover test,
//! which kills a master, is in the faults binary with a cluster of its own.

#![allow(clippy::unwrap_used)]

use support::cluster::shared_cluster;
use support::suites::{self, Target};

fn cluster() -> Target {
    Target::Cluster(shared_cluster().urls())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_decides_exactly_like_the_rust_functions() {
    let keys = suites::conformance(&cluster(), 2_500).await;
    shared_cluster().assert_on_every_master(&keys).await;
}

/// On the servers' clocks too (each master reads its own `TIME`; here they share the
/// machine's clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_servers_clocks_the_cluster_decides_exactly_like_the_rust_functions() {
    suites::conformance_server_time(&cluster(), 200).await;
}

/// All of a caller's limits share its hash tag, so one script decides them on the master
/// that owns the caller's slot: no `CROSSSLOT`, whatever limits a request has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_several_limits_decide_on_the_cluster_in_one_script() {
    suites::conformance_multi(&cluster(), 1_500).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_the_cluster_never_admit_more_than_the_model() {
    let keys = suites::atomicity(&cluster()).await;
    shared_cluster().assert_on_every_master(&keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clusters_loans_are_the_memory_stores() {
    suites::lend_conformance(&cluster(), 1_500).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clusters_shares_are_the_memory_stores() {
    suites::share_conformance(&cluster(), 1_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_leasing_gateways_on_the_cluster_never_admit_more_than_the_capacity() {
    let keys = suites::leased_atomicity(&cluster()).await;
    shared_cluster().assert_on_every_master(&keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_survive_script_flush_on_every_cluster_node() {
    let keys = suites::script_flush(&cluster()).await;
    shared_cluster().assert_on_every_master(&keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_expire_when_their_state_is_fresh_again() {
    let keys = suites::expiry(&cluster()).await;
    shared_cluster().assert_on_every_master(&keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_limit_keeps_usage_on_the_cluster() {
    suites::a_changed_limit_keeps_usage(&cluster()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_keys_cannot_choose_their_cluster_slot() {
    suites::hostile_keys(&cluster()).await;
}

/// A request refused by its token limit takes no request unit: both limits under the
/// caller's hash tag, on one master, in one script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_by_its_token_limit_takes_no_request_unit() {
    let clock = tollway_core::ManualClock::at_micros(support::stores::EPOCH_US);
    let store = cluster()
        .connect(suites::builder(&clock).prefix(support::unique_prefix("costs")))
        .await;
    suites::a_refused_token_takes_no_request_unit(store, "cluster").await;
}

/// Calls in flight on the Cluster: one hash a caller, on its master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_share_slots_on_the_cluster() {
    suites::concurrency_across_gateways(&cluster()).await;
}

/// Three gateways on the Cluster, 3 × 64 callers at once: never more than the slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_the_cluster_never_have_more_calls_inside_than_the_slots() {
    suites::in_flight_across_gateways(&cluster()).await;
}
