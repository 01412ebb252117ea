//! A store chosen at run time.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::{Checked, GiveBackFuture, LendFuture, Operation, ShareAsk, ShareFuture, Store};
use crate::{ConfigError, Decisions, Policy, StoreError};

/// The future of a [`BoxStore`] decision that waits.
pub type BoxStoreFuture = Pin<Box<dyn Future<Output = Result<Decisions, StoreError>> + Send>>;

/// Any [`Store`], its type erased: for choosing the store when the program runs (memory
/// or Redis, from the environment or a configuration file) with one layer type.
///
/// A ready answer passes through as it is; only a waiting decision's future is boxed.
/// Clones share the store.
///
/// # Examples
///
/// ```
/// use tollway_core::{Algorithm, BoxStore, CircuitBreaker, MemoryStore, Policy, Quota, Store};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let shared = std::env::var("TOLLWAY_SHARED").is_ok();
/// let store = if shared {
///     // In production: BoxStore::new(CircuitBreaker::builder(redis).build()?)
///     BoxStore::new(CircuitBreaker::builder(MemoryStore::new()).build()?)
/// } else {
///     BoxStore::new(MemoryStore::new())
/// };
/// let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(5)?)?;
/// assert!(store.check(b"dave", &[&policy], 1).await?.is_allowed());
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct BoxStore {
    inner: Arc<dyn ErasedStore>,
}

impl BoxStore {
    /// Erases `store`'s type.
    pub fn new<S: Store>(store: S) -> Self {
        BoxStore {
            inner: Arc::new(store),
        }
    }
}

impl fmt::Debug for BoxStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoxStore").finish_non_exhaustive()
    }
}

/// [`Store`] as a trait object: the same method, with the waiting future boxed.
trait ErasedStore: Send + Sync {
    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<BoxStoreFuture>;
    fn check_each(
        &self,
        key: &[u8],
        policies: &[&Policy],
        costs: &[u64],
    ) -> Checked<BoxStoreFuture>;
    fn operate(&self, key: &[u8], policies: &[&Policy], op: Operation) -> Checked<BoxStoreFuture>;
    fn supports(&self, policy: &Policy) -> Result<(), ConfigError>;
    fn supports_each_cost(&self) -> Result<(), ConfigError>;
    fn lend(&self, key: &[u8], policies: &[&Policy], cost: u64, ask: u64) -> Option<LendFuture>;
    fn give_back(
        &self,
        key: &[u8],
        policies: &[&Policy],
        units: u64,
        ends: &[u64],
    ) -> Option<GiveBackFuture>;
    fn share(&self, key: &[u8], policy: &Policy, ask: &ShareAsk) -> Option<ShareFuture>;
}

impl<S: Store> ErasedStore for S {
    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<BoxStoreFuture> {
        boxed(Store::check(self, key, policies, cost))
    }

    fn check_each(
        &self,
        key: &[u8],
        policies: &[&Policy],
        costs: &[u64],
    ) -> Checked<BoxStoreFuture> {
        boxed(Store::check_each(self, key, policies, costs))
    }

    fn operate(&self, key: &[u8], policies: &[&Policy], op: Operation) -> Checked<BoxStoreFuture> {
        boxed(Store::operate(self, key, policies, op))
    }

    fn supports(&self, policy: &Policy) -> Result<(), ConfigError> {
        Store::supports(self, policy)
    }

    fn supports_each_cost(&self) -> Result<(), ConfigError> {
        Store::supports_each_cost(self)
    }

    fn lend(&self, key: &[u8], policies: &[&Policy], cost: u64, ask: u64) -> Option<LendFuture> {
        Store::lend(self, key, policies, cost, ask)
    }

    fn give_back(
        &self,
        key: &[u8],
        policies: &[&Policy],
        units: u64,
        ends: &[u64],
    ) -> Option<GiveBackFuture> {
        Store::give_back(self, key, policies, units, ends)
    }

    fn share(&self, key: &[u8], policy: &Policy, ask: &ShareAsk) -> Option<ShareFuture> {
        Store::share(self, key, policy, ask)
    }
}

/// A store's answer with its future boxed.
pub(super) fn boxed<F>(answer: Checked<F>) -> Checked<BoxStoreFuture>
where
    F: Future<Output = Result<Decisions, StoreError>> + Send + 'static,
{
    match answer {
        Checked::Ready(answer) => Checked::Ready(answer),
        Checked::Pending(future) => Checked::Pending(Box::pin(future)),
    }
}

impl Store for BoxStore {
    type Future = BoxStoreFuture;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<BoxStoreFuture> {
        self.inner.check(key, policies, cost)
    }

    fn check_each(
        &self,
        key: &[u8],
        policies: &[&Policy],
        costs: &[u64],
    ) -> Checked<BoxStoreFuture> {
        self.inner.check_each(key, policies, costs)
    }

    fn operate(&self, key: &[u8], policies: &[&Policy], op: Operation) -> Checked<BoxStoreFuture> {
        self.inner.operate(key, policies, op)
    }

    fn supports(&self, policy: &Policy) -> Result<(), ConfigError> {
        self.inner.supports(policy)
    }

    fn supports_each_cost(&self) -> Result<(), ConfigError> {
        self.inner.supports_each_cost()
    }

    fn lend(&self, key: &[u8], policies: &[&Policy], cost: u64, ask: u64) -> Option<LendFuture> {
        self.inner.lend(key, policies, cost, ask)
    }

    fn give_back(
        &self,
        key: &[u8],
        policies: &[&Policy],
        units: u64,
        ends: &[u64],
    ) -> Option<GiveBackFuture> {
        self.inner.give_back(key, policies, units, ends)
    }

    fn share(&self, key: &[u8], policy: &Policy, ask: &ShareAsk) -> Option<ShareFuture> {
        self.inner.share(key, policy, ask)
    }
}
