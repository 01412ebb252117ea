//! Where limiter state lives.
//!
//! A [`Store`] decides a request for a key under a [`Policy`]. [`MemoryStore`] keeps
//! state in this process, for one node; the Redis store (feature `redis`) keeps it in
//! Redis, for a fleet of nodes sharing one limit.

mod breaker;
mod memory;
#[cfg(feature = "redis")]
mod redis;

use std::future::Future;

#[cfg(feature = "redis")]
pub use self::redis::{MAX_LITERAL_KEY, RedisFuture, RedisStore, RedisStoreBuilder};
pub use breaker::{BreakerState, CircuitBreaker, CircuitBreakerBuilder, CircuitBreakerFuture};
pub use memory::{MemoryStore, MemoryStoreBuilder, WhenFull};

use crate::{Decision, Policy, StoreError};

/// Decides requests against limiter state kept somewhere.
///
/// `check` takes what it needs from its arguments before it returns, so the future owns
/// everything and can be held by a response future across an await.
///
/// # Examples
///
/// ```
/// use tollway_core::{Algorithm, MemoryStore, Policy, Quota, Store};
///
/// async fn admit<S: Store>(store: &S, user: &str, policy: &Policy) -> bool {
///     match store.check(user.as_bytes(), policy, 1).await {
///         Ok(decision) => decision.is_allowed(),
///         Err(_) => true, // this caller fails open
///     }
/// }
///
/// let store = MemoryStore::new();
/// let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(1)?)?;
/// let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
/// let mut first = std::pin::pin!(admit(&store, "carol", &policy));
/// assert_eq!(first.as_mut().poll(&mut cx), std::task::Poll::Ready(true));
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
pub trait Store: Send + Sync + 'static {
    /// The future of one decision.
    type Future: Future<Output = Result<Decision, StoreError>> + Send + 'static;

    /// Decides one request of `cost` units for `key` under `policy`.
    fn check(&self, key: &[u8], policy: &Policy, cost: u32) -> Self::Future;

    /// Decides at once when this store can without waiting (no I/O), else `None` — then
    /// the caller uses [`Store::check`]. The memory store always can; the Redis store can
    /// when its local deny cache holds the answer. A middleware that gets an answer here
    /// calls its service directly instead of holding it across an await.
    fn check_now(
        &self,
        key: &[u8],
        policy: &Policy,
        cost: u32,
    ) -> Option<Result<Decision, StoreError>> {
        let _ = (key, policy, cost);
        None
    }
}
