//! The core of tollway: rate-limiting algorithms, quotas, decisions, clocks and stores.
//!
//! A [`Policy`] names an [`Algorithm`] at a [`Quota`]. A [`Store`] keeps each key's
//! state and answers each request with a [`Decision`]. The algorithms are pure integer
//! functions of `(state, now, quota, cost)` in [`algorithm`]. So they are exact, they
//! cannot drift between implementations, and tests run them on a manual clock.
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
//! # Guides
//!
//! ## Algorithms
//!
//! Each algorithm has a Lua twin in `lua/` that decides identically. A conformance test
//! replays 10,000-event traces through both.
//!
//! | algorithm | bursts | state a key | boundary | limits it serves |
//! |---|---|---|---|---|
//! | token bucket | up to `burst` at once, then the rate | 2 integers | exact refill | any |
//! | leaky bucket (meter) | as the token bucket: the same bucket, seen from the other side | 2 integers | exact | any |
//! | leaky bucket (shaper) | none: requests are delayed to a steady rate, bounded queue | 1 integer | smooth output | any |
//! | fixed window | up to 2× the limit across a window boundary | 2 integers | weak | any |
//! | sliding window log | never more than the limit in any window | 1 entry a unit | exact | ≤ 10,000 a period (refused when built) |
//! | sliding window counter | an estimate of the log: a window may pass the limit | 2 counters and a time | approximate | any |
//! | GCRA | as the token bucket | 1 integer | interval rounded up to 1 µs | any |
//!
//! How far the sliding counter strays from the log on API-like traffic: run
//! `cargo run --release --example compare` in a clone of the repository, or read its
//! `BENCHMARKS.md`, section "Sliding
//! window counter vs the exact log".
//!
//! ## Quotas
//!
//! A [`Quota`] is validated when made: `Quota::per_minute(100)?.with_burst(20)?`. Zero,
//! overflow and nonsense fail with a sentence that says what to change. A request may
//! cost more than 1. A cost that can never fit is refused with its own reason
//! ([`Denial::CostExceedsCapacity`]), not with a retry time that lies.
//!
//! ```
//! use tollway_core::Quota;
//!
//! assert!(Quota::per_minute(100)?.with_burst(20).is_ok());
//! let zero = Quota::per_minute(0).unwrap_err();
//! println!("{zero}"); // says what to write instead
//! # Ok::<(), tollway_core::ConfigError>(())
//! ```
//!
//! ## Stores
//!
//! [`Store::check`] decides all of a request's limits at once, **all or nothing**: a
//! request refused by its route limit costs its tier nothing. It answers at once, or
//! with a future ([`Checked`]). [`Store::operate`] peeks at, charges, refunds, resets or
//! drains a caller's state ([`Operation`]).
//!
//! - [`MemoryStore`] is sharded by caller and bounded in keys ([`WhenFull`] says what
//!   happens at the bound). It forgets idle keys and decides synchronously
//!   ([`MemoryStore::decide`], [`MemoryStore::check_sync`]). A single limit under GCRA,
//!   the leaky buckets, the token bucket, the fixed window or the sliding counter is
//!   checked without a lock while its state packs in one word.
//! - `RedisStore` (feature `redis`) runs one atomic Lua script a request, whatever its
//!   limits. It calls `EVALSHA` and reloads the script after `NOSCRIPT`. It reads the
//!   server's `TIME` by default, so gateways' clocks cannot skew a limit.
//! - [`CircuitBreaker`] puts a breaker and a local fallback around any store.
//! - [`BoxStore`] holds any store chosen at run time.
//!
//! [`StoreError::kind`] tells a timeout from a lost connection from a script error.
//!
//! **Redis keys.** A key is `prefix:{caller}:policy:id`. The hash tag is the caller, so
//! one script's keys never cross Cluster slots. The id is the policy's
//! [`state_id`](Policy::state_id): name, algorithm and period, not the limit, so a
//! changed limit keeps what callers used. User keys are escaped, or hashed past
//! `MAX_LITERAL_KEY` bytes.
//!
//! **Redis connections.** One multiplexed connection by default. Also a
//! `deadpool_redis::Pool` (feature `deadpool`), a Redis Cluster (`connect_cluster`), or
//! the primary Redis Sentinel names, followed through failovers (`connect_sentinel`).
//! `redis://user:password@...` authenticates. `rediss://` needs feature `tls`; it trusts
//! the system's roots or `tls_root_certificate(pem)`, for one server or every cluster
//! node.
//!
//! **When Redis fails.** Each call has a timeout (100 ms). A local cache of unit-cost
//! refusals means a one-key flood costs Redis about one call a node per retry period. By
//! default a breaker stops calling Redis after 5 failures in a row. A local fallback then
//! decides in memory, with this node's share of each quota: with ten gateways, give
//! each a tenth.
//!
//! ```no_run
//! # #[tokio::main]
//! # async fn main() -> Result<(), tollway_core::StoreError> {
//! use tollway_core::RedisStore;
//!
//! // Ten gateways share this Redis: during an outage each decides with a tenth.
//! let store = RedisStore::builder().local_fallback(0.1).connect("redis://127.0.0.1:6379").await?;
//! let cluster = RedisStore::builder()
//!     .connect_cluster(&["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"])
//!     .await?;
//! # let _ = (store, cluster);
//! # Ok(())
//! # }
//! ```
//!
//! ## Leases
//!
//! One key on one Redis shard has one Redis core's ceiling, and each request pays the
//! round trip. `Leased` (feature `leases`) decides a hot key's requests in this
//! process, from units the store lends in batches ([`Store::lend`]). A batch is debited
//! at the store before any unit is spent, and a unit is spent only while spending it
//! could not pass the limit. So a fleet of leasing gateways never admits more than one
//! store deciding every request would. Cold keys keep one call a request. The sliding
//! window log and the shaper do not lend.
//!
//! ```no_run
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tollway_core::{Leased, RedisStore};
//!
//! let redis = RedisStore::builder().connect("redis://127.0.0.1:6379").await?;
//! let store = Leased::new(redis)?; // a Store: hand it to the layer
//! # let _ = store;
//! # Ok(())
//! # }
//! ```
//!
//! `Leased`'s docs give the rule that keeps it exact and what it costs. The repository's
//! `BENCHMARKS.md` ("Leases") measures the store calls, the Redis CPU, the shares
//! admitted and the latency (`cargo bench -p tests --bench leases`).
//!
//! ## Regions
//!
//! Four ways hold one limit across regions. The repository's `BENCHMARKS.md`
//! ("Multi-region") measures each on simulated regions
//! (`cargo bench -p tests --bench regions`).
//!
//! | | a decision costs | over the limit | under the limit | a region cut off |
//! |---|---|---|---|---|
//! | one global Redis | the round trip to its region | never | never | cannot decide: the breaker's fallback does |
//! | leases from one global Redis | local, from units held; a round trip while a key turns hot or the limit is short | never | by the units held unspent, and while contested | decides from the units it holds, then the breaker's fallback |
//! | `ReplicatedStore` | a local round trip | by what others admitted in the last sync plus one way | never | up to a quota on each side, settled on heal |
//! | `SplitStore` (fixed windows) | a local round trip | never | while demand moves (a window or two), and while regions cannot hear each other | about limit ÷ regions of a key it asked for |
//!
//! **`ReplicatedStore`** (feature `regions`). Each region decides against its own
//! store. Every `sync_every` (50 ms by default) it tells the others what it admitted.
//! It may admit more than the quota by what the other regions admitted in the last S:
//! the sync interval plus one way. That is at most `(regions − 1) × (r × S + 1)` in a
//! period, where r is what one region admits a second, for every algorithm. Traffic
//! from one region is exact.
//!
//! **`SplitStore`** (feature `regions`) gives each region a share of a fixed window's
//! limit, decided on its own store. Each window, a region posts its demand on its own
//! board and the others' a *lead* before the end (a quarter window by default). It reads
//! the others' posts half the lead later and fixes its share of the next window,
//! max-min fair. A region it has not heard from counts as asking for everything. So the
//! shares never add up past the limit: lost posts, late posts and partitions only cost
//! admissions. Shares follow demand a window late. Half the lead must cover a post's way.
//!
//! **Leases from one global Redis** (features `redis` and `leases`). A region's hot keys
//! are decided locally from units leased from the one Redis. The horizon must span a
//! renewal's round trip: `Leased::builder(store).horizon(..)` at three round trips or
//! more.
//!
//! Choose the global Redis where a region's round trip to it is acceptable. Choose
//! leases from it where the hot keys carry the traffic and the limit must hold. Choose
//! replicated where a few percent over is fine and the latency is not. Choose split where
//! the limit is a contract (an upstream's quota, a paid tier) and refusing a little while
//! demand moves is the lesser harm.
//!
//! `Reset` and `Refund` on either regional store are refused: the other regions would
//! undo them. Apply them to each region's store.
//!
//! # Feature flags
//!
//! None is on by default: without them the crate is the algorithms, the memory store and
//! the circuit breaker.
//!
//! - `redis`: the Redis store (`RedisStore`, `RedisStoreBuilder`, `Sentinel`,
//!   `MAX_LITERAL_KEY`), standalone, Cluster or through Sentinel, one atomic Lua script a
//!   request. Optional dependencies `redis`, `sha2`, `tokio`, `futures-util`.
//! - `deadpool`: `RedisStoreBuilder::with_pool`, a `deadpool_redis::Pool` as the Redis
//!   store's connections. Implies `redis`; optional dependency `deadpool-redis`.
//! - `tls`: `rediss://` URLs and `RedisStoreBuilder::tls_root_certificate`: TLS to Redis
//!   through rustls with the `ring` crypto provider. Implies `redis` and enables
//!   `redis/tokio-rustls-comp`; optional dependency `rustls`.
//! - `regions`: one limit across regions that each decide against their own store:
//!   `ReplicatedStore` (each tells the others what it admitted) and `SplitStore` (each
//!   holds a share, rebalanced every window from demand; never over-admits). Optional
//!   dependency `tokio` (with its runtime, for the background tasks).
//! - `leases`: `Leased`, a store that decides hot keys here from units another store
//!   lends. Optional dependency `tokio` (its runtime renews loans in the background).
//! - `metrics`: the stores' metrics through the `metrics` facade (Redis call latency,
//!   deny-cache hits, breaker state, keys held by the memory store). Optional dependency
//!   `metrics`.
//! - `testing`: `testing::Conformance`, the suites that prove a store of your own
//!   decides like the memory store: every algorithm, all or nothing. No dependencies.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod algorithm;
pub mod calendar;
mod clock;
mod decision;
mod error;
pub mod metric;
mod policy;
mod quota;
mod store;
#[cfg(test)]
mod test_log;
#[cfg(any(test, feature = "testing"))]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

pub use algorithm::Algorithm;
pub use calendar::{Calendar, CalendarUnit};
pub use clock::{Clock, ManualClock, MonotonicClock, SystemClock};
pub use decision::{Decision, Decisions, Denial};
pub use error::{ConfigError, StoreError, StoreErrorKind};
pub use policy::{MAX_POLICY_NAME, MAX_SLIDING_LOG_COST, MAX_SLIDING_LOG_LIMIT, Policy};
pub use quota::{MAX_UNITS, Quota};
#[cfg(feature = "regions")]
pub use store::{
    Board, BoardFuture, Recording, ReplicatedStore, ReplicatedStoreBuilder, SplitFuture,
    SplitStore, SplitStoreBuilder,
};
pub use store::{
    BoxStore, BoxStoreFuture, BreakerState, Checked, CheckedFuture, CircuitBreaker,
    CircuitBreakerBuilder, CircuitBreakerFuture, GiveBackFuture, Grant, LendFuture, MemoryStore,
    MemoryStoreBuilder, Operation, Share, ShareAsk, ShareFuture, Store, WhenFull, share,
};
#[cfg(feature = "leases")]
pub use store::{Leased, LeasedBuilder};
#[cfg(feature = "redis")]
pub use store::{MAX_LITERAL_KEY, RedisStore, RedisStoreBuilder, Sentinel};
