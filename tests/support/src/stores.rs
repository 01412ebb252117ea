//! The stores the end-to-end tests run over: one manual clock at a realistic wall time,
//! a memory store and a Redis store reading it, and a macro that runs a test body over
//! both.

use std::time::Duration;

use tollway_core::{Algorithm, ManualClock, MemoryStore, Policy, Quota, RedisStore};

use crate::redis::{shared_server, unique_prefix};

/// 2025-11-30T05:20:00Z in microseconds: a realistic wall time, on a whole second.
pub const EPOCH_US: u64 = 1_764_480_000_000_000;
/// The same instant in Unix seconds, as `X-RateLimit-Reset` counts.
pub const EPOCH_S: u64 = EPOCH_US / 1_000_000;

/// Runs a test body over both stores, as `<name>::memory` and `<name>::redis`. The body
/// sees `$store` (a fresh store: the Redis one on this binary's shared server under a key
/// prefix of its own) and `$clock` (the manual clock that store reads, at [`EPOCH_US`]).
#[macro_export]
macro_rules! both_stores {
    ($(#[$meta:meta])* async fn $name:ident($store:ident, $clock:ident) $body:block) => {
        $(#[$meta])*
        mod $name {
            use super::*;

            async fn case<St: tollway_core::Store + Clone>(
                $store: St,
                $clock: tollway_core::ManualClock,
            ) $body

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                let clock = tollway_core::ManualClock::at_micros($crate::stores::EPOCH_US);
                case($crate::stores::memory_store(&clock), clock).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                let clock = tollway_core::ManualClock::at_micros($crate::stores::EPOCH_US);
                case($crate::stores::redis_store(&clock).await, clock).await;
            }
        }
    };
}

/// A memory store reading `clock`.
pub fn memory_store(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::builder().clock(clock.clone()).build().unwrap()
}

/// A Redis store on this binary's shared server, under a key prefix no other test uses,
/// passing `clock`'s time to the scripts.
pub async fn redis_store(clock: &ManualClock) -> RedisStore {
    redis_store_under(&unique_prefix("e2e"), clock).await
}

/// A Redis store on this binary's shared server under `prefix` (stores under one prefix
/// share their limits: gateways of one fleet), passing `clock`'s time to the scripts.
pub async fn redis_store_under(prefix: &str, clock: &ManualClock) -> RedisStore {
    crate::redis_store()
        .without_local_fallback()
        .timeout(Duration::from_secs(5))
        .prefix(prefix)
        .caller_time(clock.clone())
        .connect(&shared_server().url())
        .await
        .unwrap()
}

/// A token bucket of `n` per minute: one unit refills every `60 / n` seconds.
pub fn per_minute(name: &str, n: u64) -> Policy {
    Policy::new(name, Algorithm::TokenBucket, Quota::per_minute(n).unwrap()).unwrap()
}
