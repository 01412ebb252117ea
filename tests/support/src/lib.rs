//! tollway's test harness, shared by the end-to-end tests, the benches and the examples.
//!
//! Real things only: `redis-server` processes on free loopback ports ([`redis`]), a local
//! Redis Cluster of six of them ([`cluster`]), axum and tonic servers on `127.0.0.1:0`
//! with real clients ([`http`], [`grpc`]), a loopback TCP proxy adding latency and
//! partitions ([`proxy`]) and simulated regions made of servers and proxies
//! ([`regions`]), the examples' gRPC service, counted ([`catalog`]),
//! stores on a manual clock ([`stores`]), and the store suites — conformance with the
//! Rust functions, atomicity across gateways, expiry, hostile keys — as functions of a
//! [`suites::Target`], run against one server and against a cluster.
//!
//! A test binary shares one Redis server ([`shared_server`]) and, where it is about the
//! cluster, one cluster ([`cluster::shared_cluster`]); each test keeps to its own key
//! prefix ([`unique_prefix`]). Tests that kill, pause or restart Redis start their own.

#![allow(clippy::unwrap_used)]

#[cfg(feature = "grpc")]
pub mod catalog;
pub mod cluster;
pub mod envoy;
#[cfg(feature = "grpc")]
pub mod grpc;
pub mod http;
pub mod proxy;
pub mod redis;
pub mod regions;
pub mod sentinel;
#[cfg(feature = "grpc")]
pub mod server;
pub mod stores;
pub mod suites;
pub mod tls;

pub use redis::{
    RedisServer, TlsFiles, command_calls, free_port, script_calls, shared_server, unique_prefix,
};

use std::future::Future;

use tollway_core::{Decision, Policy, Store, StoreError};

pub use tollway_core::testing::Rng;

/// The stall watch of the tests' Redis stores: far past any reply on a loaded machine
/// (where Redis may wait tens of milliseconds for a core), so that only a test about
/// stalls, which sets its own, sees one.
pub const STALL_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// A Redis store builder as the tests use it: the defaults but the stall watch
/// ([`STALL_AFTER`]).
pub fn redis_store() -> tollway_core::RedisStoreBuilder {
    tollway_core::RedisStore::builder().stall_after(STALL_AFTER)
}

/// One policy's decision, which is what most store tests ask.
pub trait CheckOne: Store {
    /// [`Store::check`] of one policy: its decision.
    fn check_one(
        &self,
        key: &[u8],
        policy: &Policy,
        cost: u64,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send + 'static {
        let checked = self.check(key, &[policy], cost);
        async move { checked.await.map(|decisions| decisions[0]) }
    }
}

impl<S: Store> CheckOne for S {}

/// `future`, or a panic naming `what` after `seconds`: a test that would hang fails.
pub async fn within<F: Future>(what: &str, seconds: u64, future: F) -> F::Output {
    tokio::time::timeout(std::time::Duration::from_secs(seconds), future)
        .await
        .unwrap_or_else(|_| panic!("{what} took more than {seconds} s"))
}

/// With tokio's clock paused, a runtime with nothing to do but wait for I/O moves the
/// clock to its next timer at once: without a nearer one, that is a Redis call's timeout,
/// and the call would time out before its reply came. This task keeps the runtime busy
/// for a while (yielding, which polls for I/O without moving the clock) before each
/// millisecond it lets pass, so that a reply on its way arrives within about a
/// millisecond of the paused clock. Aborted on drop.
#[derive(Debug)]
pub struct TimeKeeper(tokio::task::JoinHandle<()>);

/// Starts a [`TimeKeeper`] on the current (paused) runtime.
pub fn keep_time_moving() -> TimeKeeper {
    TimeKeeper(tokio::spawn(async {
        loop {
            for _ in 0..50 {
                tokio::task::yield_now().await;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }))
}

impl Drop for TimeKeeper {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A file in a directory of its own (a limits file, a certificate), removed with its
/// directory when dropped.
#[derive(Debug)]
pub struct TempFile(pub std::path::PathBuf);

impl TempFile {
    /// `limits.toml` holding `text`, in a new directory named after `name`.
    ///
    /// # Panics
    ///
    /// When the directory or the file cannot be written.
    pub fn new(name: &str, text: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tollway-{name}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory of its own");
        let file = TempFile(dir.join("limits.toml"));
        file.write(text);
        file
    }

    /// Replaces its text.
    ///
    /// # Panics
    ///
    /// When the file cannot be written.
    pub fn write(&self, text: &str) {
        std::fs::write(&self.0, text).expect("write the file");
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
