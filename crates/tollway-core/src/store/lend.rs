//! Lending: a batch of units taken from a store's shared state in one step.
//!
//! A store that lends lets [`Leased`](crate::Leased) decide a hot key's requests
//! locally. Only the algorithms whose units may be spent later lend: see
//! [`Algorithm::lends`](crate::Algorithm::lends).

use std::future::Future;
use std::pin::Pin;

use crate::{Decision, Decisions, Policy};

/// The future of a [`Store::lend`](super::Store::lend).
pub type LendFuture =
    Pin<Box<dyn Future<Output = Result<Grant, crate::StoreError>> + Send + 'static>>;

/// The future of a [`Store::give_back`](super::Store::give_back).
pub type GiveBackFuture =
    Pin<Box<dyn Future<Output = Result<(), crate::StoreError>> + Send + 'static>>;

/// What a store lent: how many units, and the decisions the store made taking them.
///
/// The decisions are those of a request of [`units`](Self::units) units. When the store
/// refused even the request's own cost, they are the refusal, and `units` is 0.
///
/// # Examples
///
/// ```
/// use tollway_core::{Algorithm, ManualClock, MemoryStore, Policy, Quota, Store};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::builder().clock(ManualClock::new()).build()?;
/// let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(100)?)?;
///
/// // A request of 1 unit, and up to 30 more to spend later.
/// let grant = store.lend(b"hot", &[&policy], 1, 31).expect("the memory store lends").await?;
/// assert_eq!(grant.units(), 31);
/// assert_eq!(grant.decisions()[0].remaining(), 69);
///
/// // Near the limit, a store lends at most half of what is left.
/// let grant = store.lend(b"hot", &[&policy], 1, 100).expect("it lends").await?;
/// assert_eq!(grant.units(), 35);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    units: u64,
    decisions: Decisions,
    at: u64,
}

impl Grant {
    /// A grant of `units`, taken with these decisions at `at` µs on the store's clock.
    #[must_use]
    pub fn new(units: u64, decisions: Decisions, at: u64) -> Self {
        let units = if decisions.is_allowed() { units } else { 0 };
        Grant {
            units,
            decisions,
            at,
        }
    }

    /// When the store took the units, in µs on its own clock (Redis's `TIME`, by
    /// default). A window's end is this plus its decision's reset: what
    /// [`Store::give_back`](super::Store::give_back) names.
    #[must_use]
    pub fn at(&self) -> u64 {
        self.at
    }

    /// How many units were taken: the request's own cost and the rest, lent.
    #[must_use]
    pub fn units(&self) -> u64 {
        self.units
    }

    /// The decisions of taking them, one a policy.
    #[must_use]
    pub fn decisions(&self) -> &Decisions {
        &self.decisions
    }

    /// The decisions, taken out of the grant.
    #[must_use]
    pub fn into_decisions(self) -> Decisions {
        self.decisions
    }
}

/// How many units to lend for a request of `cost`, asked `ask`, when every limit still
/// holds `least` at most: `ask`, but at most half of `least` (rounded up), and at least
/// `cost`.
///
/// Halving keeps the last units of a period for the gateways that ask after; the last
/// unit goes to whoever asks. `lua/operate.lua` (its `lend`) computes the same.
pub(crate) fn grant_size(least: u64, cost: u64, ask: u64) -> u64 {
    let half = least.div_ceil(2);
    ask.min(half).max(cost)
}

/// The most units a request fits now, under every limit: the least of the
/// `remaining` of the decisions of a request of 0 units.
pub(crate) fn least_remaining(peek: &Decisions) -> u64 {
    peek.iter().map(Decision::remaining).min().unwrap_or(0)
}

/// Whether every one of `policies` may lend.
pub(crate) fn all_lend(policies: &[&Policy]) -> bool {
    policies.iter().all(|p| p.algorithm().lends())
}

/// Where `policy`'s window ends after a grant's `decision` for it, at `at` on the
/// store's clock; 0 for a bucket or GCRA, which has no window. The window's units go bad
/// there, and a give-back names it. (Only what spends grants later asks.)
#[cfg(any(test, feature = "leases", feature = "testing"))]
pub(crate) fn window_end(policy: &Policy, decision: &Decision, at: u64) -> u64 {
    use crate::Algorithm;
    let reset = decision.reset_after_micros();
    match policy.algorithm() {
        // The window ends `reset` from now once it has counted a unit.
        Algorithm::FixedWindow => at.saturating_add(reset),
        // With units in the current window, `reset` is its end and one period more.
        Algorithm::SlidingWindowCounter => {
            at.saturating_add(reset.saturating_sub(policy.quota().period_micros()))
        }
        Algorithm::TokenBucket
        | Algorithm::LeakyBucket
        | Algorithm::LeakyBucketShaper
        | Algorithm::SlidingWindowLog
        | Algorithm::Gcra
        | Algorithm::Concurrency => 0,
    }
}
