//! The core of tollway: rate-limiting algorithms, quotas, decisions, clocks and stores.
//!
//! A [`Policy`] names an [`Algorithm`] at a [`Quota`]; a [`Store`] keeps per-key state
//! and answers each request with a [`Decision`]. The algorithms are pure integer
//! functions of `(state, now, quota, cost)` in [`algorithm`], so they are exact, cannot
//! drift between implementations, and are tested on a manual clock.
//!
//! # Examples
//!
//! The default memory store on the process's monotonic clock:
//!
//! ```
//! use tollway_core::{Algorithm, MemoryStore, Policy, Quota};
//!
//! let store = MemoryStore::new();
//! let free = Policy::new("free", Algorithm::TokenBucket, Quota::per_minute(100)?)?;
//!
//! let decision = store.check_sync(b"user-42", &free, 1);
//! assert!(decision.is_allowed());
//! assert_eq!(decision.remaining(), 99);
//! # Ok::<(), tollway_core::ConfigError>(())
//! ```
//!
//! A customised one: a manual clock (as in tests), a bound on keys, a weighted request:
//!
//! ```
//! use std::time::Duration;
//! use tollway_core::{Algorithm, ManualClock, MemoryStore, Policy, Quota};
//!
//! let clock = ManualClock::new();
//! let store = MemoryStore::builder().max_keys(50_000).clock(clock.clone()).build()?;
//! let export = Policy::new("export", Algorithm::Gcra, Quota::per_second(10)?)?;
//!
//! assert!(store.check_sync(b"team-7", &export, 10).is_allowed()); // one heavy call
//! let denied = store.check_sync(b"team-7", &export, 1);
//! assert_eq!(denied.retry_after(), Some(Duration::from_millis(100)));
//!
//! clock.advance(Duration::from_millis(100));
//! assert!(store.check_sync(b"team-7", &export, 1).is_allowed());
//! # Ok::<(), tollway_core::ConfigError>(())
//! ```
//!
//! # Feature flags
//!
//! None is on by default: without them the crate is the algorithms, the memory store and
//! the circuit breaker.
//!
//! - `redis`: the Redis store (`RedisStore`, `RedisStoreBuilder`, `MAX_LITERAL_KEY`),
//!   standalone or Cluster, one atomic Lua script a request. Optional dependencies
//!   `redis`, `sha2`, `tokio`.
//! - `deadpool`: `RedisStoreBuilder::with_pool`, a `deadpool_redis::Pool` as the Redis
//!   store's connections. Implies `redis`; optional dependency `deadpool-redis`.
//! - `tls`: `rediss://` URLs and `RedisStoreBuilder::tls_root_certificate`: TLS to Redis
//!   through rustls with the `ring` crypto provider. Implies `redis` and enables
//!   `redis/tokio-rustls-comp`; optional dependency `rustls`.
//! - `regions`: one limit across regions that each decide against their own store:
//!   `ReplicatedStore` (each tells the others what it admitted) and `SplitStore` (each
//!   holds a share, rebalanced every window from demand; never over-admits). Optional
//!   dependency `tokio` (with its runtime, for the background tasks).
//! - `metrics`: the stores' metrics through the `metrics` facade (Redis call latency,
//!   deny-cache hits, breaker state, keys held by the memory store). Optional dependency
//!   `metrics`.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod algorithm;
mod clock;
mod decision;
mod error;
mod policy;
mod quota;
mod store;
#[cfg(test)]
mod test_log;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

pub use algorithm::Algorithm;
pub use clock::{Clock, ManualClock, MonotonicClock, SystemClock};
pub use decision::{Decision, Decisions, Denial};
pub use error::{ConfigError, StoreError, StoreErrorKind};
pub use policy::{MAX_POLICY_NAME, MAX_SLIDING_LOG_LIMIT, Policy};
pub use quota::Quota;
#[cfg(feature = "regions")]
pub use store::{
    Board, BoardFuture, Recording, ReplicatedStore, ReplicatedStoreBuilder, SplitFuture,
    SplitStore, SplitStoreBuilder,
};
pub use store::{
    BoxStore, BoxStoreFuture, BreakerState, Checked, CheckedFuture, CircuitBreaker,
    CircuitBreakerBuilder, CircuitBreakerFuture, MemoryStore, MemoryStoreBuilder, Operation, Store,
    WhenFull,
};
#[cfg(feature = "redis")]
pub use store::{MAX_LITERAL_KEY, RedisStore, RedisStoreBuilder};
