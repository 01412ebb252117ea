//! Leases: a hot key's requests decided here, from units lent by the shared store.
//!
//! [`Leased`] wraps a store that [lends](Store::lend), such as the
//! [`RedisStore`](crate::RedisStore). A key that is hot here takes a batch of units from
//! the shared state in one call. The units are debited there first. Its requests are
//! then decided in this process's memory, until the batch runs low. Then the next batch
//! is asked for in the background. A request never waits for it while units are left.
//! A key seen rarely is decided one call a request, as without leases.
//!
//! See the [`Leased`] docs for the bound it keeps, and why it is exact.

mod builder;
mod table;
#[cfg(test)]
mod tests;
mod units;

use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;

use smallvec::SmallVec;

pub use self::builder::LeasedBuilder;
use self::table::{Counts, Dry, Local, Request, Table};
use self::units::Loan;
use super::boxed::boxed;
use super::{BoxStoreFuture, Checked, GiveBackFuture, Grant, LendFuture, Operation, Store};
use crate::{Clock, ConfigError, MonotonicClock, Policy, StoreError};

/// A store whose hot keys are decided here, from units leased from `S`.
///
/// # How
///
/// Each key and set of policies keeps its demand here: the units its requests asked
/// for over the last *horizon* (200 ms by default). While that is under
/// [`min_units`](LeasedBuilder::min_units), each request is one call to `S`, as before.
/// Past it, the next request asks `S` to [lend](Store::lend) about one horizon's worth.
/// That call decides the request too: a cold key never pays a second round trip. A loan
/// holds at most [`max_share`](LeasedBuilder::max_share) of a limit's capacity, and the
/// store lends at most half of what a limit has left. So loans shrink to one unit as a
/// limit runs out, and the last units of a period go to whoever asks.
///
/// Requests then spend the loan's units in order, here. When half a loan is left, the
/// next one is asked for in the background (on the tokio runtime the request runs on).
/// A request with no good units left asks `S` itself, one call, as a cold key does.
///
/// # Never over the limit
///
/// Each unit is debited from the shared state before it is spent. A unit is good here
/// only while spending it could not pass the limit:
///
/// - a window's units until their window ends (fixed window, sliding window counter);
/// - a bucket's or GCRA's unit `j` of a loan until the state would have refilled unit
///   `j − 1` of it (token bucket, leaky bucket meter, GCRA). Spent later, the refill
///   would be there for another request too.
///
/// So in any interval, the units spent here and at the store are at most what the
/// algorithm admits in it, whatever the number of gateways. A unit gone bad is dropped
/// unspent. The sliding window log and the leaky bucket shaper do not lend
/// ([`Algorithm::lends`](crate::Algorithm::lends)): each of their admissions needs its
/// own instant in the shared state. A request under any of them is one call, as before.
///
/// The deadlines are counted on this process's clock from when a loan's call was sent.
/// The store read its time later. So a unit goes bad here no later than at the store,
/// whatever this clock reads. Only the rates must agree: a clock that runs slow by
/// 100 ppm keeps a unit 100 µs too long a second of its life.
///
/// That holds when the store decides on one clock for every gateway: Redis's `TIME`
/// (the Redis store's default), or one clock the gateways share. With the Redis store
/// on each caller's clock (`caller_time`) and gateways' clocks apart, a window's units
/// may be spent after a gateway ahead has started the next window: lease on the
/// server's clock.
///
/// # The cost: units left unspent
///
/// Units a gateway holds and does not spend are lost to the others until they go bad.
/// A gateway holds at most two loans of a key (one spent down to half, and its
/// renewal), each at most `max_share` of the smallest capacity. So with `g` gateways,
/// at most `2 × g × max_share` of a capacity is held unspent at once (60% for three
/// gateways at the default 0.1). A held unit goes bad within a loan's span: the refill
/// of its units for a bucket or GCRA (about a horizon), the rest of the window for a
/// window. A key unused here for two horizons gives its window units back to their
/// window ([`Store::give_back`]), once: a later window is never credited. A bucket's
/// units are not given back: they go bad as the state refills them.
///
/// The store lends at most half of what a limit has left, and a short store is asked
/// only in the background. So near the limit the loans shrink to a unit, and a contested
/// limit goes to whoever asks first. The repository's `BENCHMARKS.md` ("Leases") has the
/// measured calls, shares and latencies.
///
/// A full bucket lends units that go bad one a refill interval. So a loan of a bucket or
/// GCRA holds at least a horizon's refill: below the limit it spends a share of its
/// units about this gateway's share of the rate.
///
/// # When the store is away
///
/// A hot key keeps spending the units it holds, exactly. Loans that fail count as the
/// store's failures. Once its breaker opens, the store lends nothing. Then requests
/// without units are checked, and get the store's failure policy: the Redis store's
/// local fallback, say. Nothing is counted twice when it returns: the units were debited
/// before they were spent.
///
/// # Examples
///
/// Three gateways sharing one store (a memory store stands in for Redis here, on a
/// manual clock):
///
/// ```
/// use std::time::Duration;
/// use tollway_core::{Algorithm, Leased, ManualClock, MemoryStore, Policy, Quota, Store};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let clock = ManualClock::new();
/// let shared = MemoryStore::builder().clock(clock.clone()).build()?;
/// let policy = Policy::new("api", Algorithm::FixedWindow, Quota::per_second(1_000)?)?;
/// let gateways: Vec<_> = (0..3)
///     .map(|_| Leased::builder(shared.clone()).clock(clock.clone()).build())
///     .collect::<Result<_, _>>()?;
///
/// let mut admitted = 0;
/// for i in 0..3_000 {
///     clock.advance(Duration::from_micros(100));
///     let gateway = &gateways[i % 3];
///     if gateway.check(b"hot", &[&policy], 1).await?.is_allowed() {
///         admitted += 1;
///     }
/// }
/// // 300 ms of 10,000 a second against 1,000 a second: never more.
/// assert!(admitted <= 1_000);
/// assert!(admitted > 900);
/// # Ok(())
/// # }
/// ```
pub struct Leased<S, C = MonotonicClock> {
    inner: Arc<Inner<S, C>>,
}

struct Inner<S, C> {
    store: S,
    clock: C,
    table: Table,
    /// A task gives idle keys' window units back (see `Leased::sweep`).
    sweeping: std::sync::atomic::AtomicBool,
}

impl<S, C> Clone for Leased<S, C> {
    fn clone(&self) -> Self {
        Leased {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S: fmt::Debug, C> fmt::Debug for Leased<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leased")
            .field("store", &self.inner.store)
            .field("keys", &self.inner.table.len())
            .finish_non_exhaustive()
    }
}

impl<S: Store> Leased<S> {
    /// Leases from `store`, with the default sizes (see [`LeasedBuilder`]).
    ///
    /// # Errors
    ///
    /// Never with the defaults; see [`LeasedBuilder::build`].
    pub fn new(store: S) -> Result<Self, ConfigError> {
        Leased::builder(store).build()
    }

    /// A builder for leases from `store`.
    pub fn builder(store: S) -> LeasedBuilder<S> {
        LeasedBuilder::new(store)
    }
}

impl<S, C> Leased<S, C> {
    /// The store it leases from.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// How many keys (each with its set of policies) it tracks: hot, or seen lately.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.table.len()
    }

    /// Whether it tracks no key.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<S: Store, C: Clock> Leased<S, C> {
    /// Starts the task that gives back what idle keys hold, once, on the runtime the
    /// request runs on: every horizon, the loans of keys unused for two horizons are
    /// taken out; a window's good units go back to their window, the rest go bad. The
    /// task ends with the last clone of this store.
    fn sweep(&self) {
        use std::sync::atomic::Ordering;
        let inner = &self.inner;
        if inner.sweeping.load(Ordering::Relaxed) || inner.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            inner.sweeping.store(false, Ordering::Relaxed);
            return;
        };
        let every = std::time::Duration::from_micros(inner.table.horizon());
        let weak = Arc::downgrade(inner);
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(inner) = weak.upgrade() else {
                    break;
                };
                inner.give_back_idle().await;
            }
        });
    }

    /// Asks the store for `ask` more units of `key` in the background, if a runtime
    /// runs one.
    fn renew(&self, key: &[u8], ids: SmallVec<[u64; 2]>, policies: &[&Policy], loan: Ask) {
        let inner = &self.inner;
        let loan = Ask {
            origin: inner.clock.now_micros(),
            ..loan
        };
        let call = tokio::runtime::Handle::try_current()
            .ok()
            .and_then(|runtime| Some((runtime, inner.store.lend(key, policies, 0, loan.ask)?)));
        let Some((runtime, call)) = call else {
            // Never sent: nothing will land to clear the key's shortness.
            inner.table.unask(key, &ids, loan.generation, true);
            return;
        };
        self.sweep();
        let asking = Asking::new(Arc::clone(inner), key, ids, policies, loan);
        runtime.spawn(async move {
            if let Err(error) = asking.finish(call.await) {
                tracing::debug!(%error, "a lease was not renewed");
            }
        });
    }
}

impl<S: Store, C: Clock> Inner<S, C> {
    /// Takes the loans of the keys unused for two horizons out of the table, and gives
    /// a window's good units back. Each give-back is sent once.
    async fn give_back_idle(&self) {
        let now = self.clock.now_micros();
        let since = now.saturating_sub(2 * self.table.horizon());
        let mut counts = Counts::default();
        let back = self.table.idle_loans(since, now, &mut counts);
        record::expired(counts.expired);
        for loan in back {
            let policies: SmallVec<[&Policy; 2]> = loan.policies.iter().collect();
            let units = loan.units;
            match self
                .store
                .give_back(&loan.key, &policies, loan.units, &loan.ends)
            {
                Some(call) => match call.await {
                    Ok(()) => record::returned(units),
                    Err(error) => {
                        tracing::debug!(%error, "a lease's units were not given back");
                        record::expired(units);
                    }
                },
                None => record::expired(units),
            }
        }
    }
}

impl<S: Store, C: Clock> Leased<S, C> {
    /// Decides a request from a loan, or asks the store. `waited`: it waited for a loan
    /// already, and does not wait again.
    fn decide(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u64,
        waited: bool,
    ) -> Checked<BoxStoreFuture> {
        let inner = &self.inner;
        let ids = ids_of(policies);
        let mut counts = Counts::default();
        let request = Request {
            key,
            ids: &ids,
            policies,
            cost,
        };
        let local = inner
            .table
            .spend(&request, &inner.clock, waited, &mut counts);
        record::expired(counts.expired);
        let (now, generation) = (counts.now, counts.generation);
        let background = |ask| Ask {
            origin: now,
            cost: 0,
            ask,
            generation,
        };
        match local {
            Local::Spent { decisions, renew } => {
                record::spent(cost);
                if let Some(ask) = renew {
                    self.renew(key, ids, policies, background(ask));
                }
                Checked::Ready(Ok(decisions))
            }
            Local::Refused { decisions, renew } => {
                record::refused();
                if let Some(ask) = renew {
                    self.renew(key, ids, policies, background(ask));
                }
                Checked::Ready(Ok(decisions))
            }
            Local::Wait(mut landed) => {
                let (this, key) = (self.clone(), key.to_vec());
                let policies: SmallVec<[Policy; 2]> = policies.iter().map(|&p| p.clone()).collect();
                Checked::Pending(Box::pin(async move {
                    // Woken when the loan lands (or its call is dropped).
                    let _ = landed.changed().await;
                    let policies: SmallVec<[&Policy; 2]> = policies.iter().collect();
                    this.decide(&key, &policies, cost, true).await
                }))
            }
            Local::Pass => {
                record::called();
                boxed(inner.store.check(key, policies, cost))
            }
            Local::Lend(ask) => {
                record::called();
                let Some(call) = inner.store.lend(key, policies, cost, ask) else {
                    inner.table.unask(key, &ids, generation, true);
                    return boxed(inner.store.check(key, policies, cost));
                };
                self.sweep();
                let loan = Ask {
                    origin: now,
                    cost,
                    ask,
                    generation,
                };
                let asking = Asking::new(Arc::clone(inner), key, ids, policies, loan);
                Checked::Pending(Box::pin(async move {
                    asking.finish(call.await).map(Grant::into_decisions)
                }))
            }
        }
    }
}

/// Whether the store was short when it answered `grant` to `loan`: it refused a
/// request of a unit, or lent less than asked. Until a loan comes back whole, a request
/// with no units here is refused here. It waits until the refusal's retry time, or for a
/// limit left empty its next unit (a bucket's or GCRA's refill, a fixed window's end).
/// The loan is asked for again only then.
///
/// A refusal of a larger request says nothing of smaller ones, and a breaker's fallback
/// (a grant at time 0) nothing of the store: neither makes the key short.
fn short(policies: &[&Policy], grant: &Grant, loan: Ask) -> Option<Dry> {
    let decisions = grant.decisions();
    if grant.at() == 0 || (decisions.is_allowed() && grant.units() >= loan.ask) {
        return None;
    }
    let wait = if decisions.is_allowed() {
        policies
            .iter()
            .zip(decisions.iter())
            .map(|(p, d)| match (p.algorithm(), d.remaining()) {
                (a, _) if a.uses_burst() => p.quota().emission_micros(),
                // A fixed window's next unit comes with the next window. A sliding
                // counter's comes as the previous window slides out: when, only a
                // refusal says, so it is asked for again at once.
                (crate::Algorithm::FixedWindow, 0) => d.reset_after_micros(),
                _ => 0,
            })
            .max()
            .unwrap_or(0)
    } else if loan.cost <= 1 {
        decisions
            .iter()
            .filter_map(|d| d.retry_after())
            .max()
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    } else {
        return None;
    };
    Some(Dry {
        origin: loan.origin,
        until: loan.origin.saturating_add(wait),
        decisions: decisions.clone(),
    })
}

/// The key-and-policies' identity in the table: each policy's name and quota.
fn ids_of(policies: &[&Policy]) -> SmallVec<[u64; 2]> {
    let hasher = foldhash::fast::FixedState::with_seed(0x1ea5e);
    policies
        .iter()
        .map(|p| hasher.hash_one((p.name(), p.id())))
        .collect()
}

impl<S: Store, C: Clock> Store for Leased<S, C> {
    type Future = BoxStoreFuture;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<BoxStoreFuture> {
        if cost == 0 || !super::lend::all_lend(policies) {
            return boxed(self.inner.store.check(key, policies, cost));
        }
        self.decide(key, policies, cost, false)
    }

    /// Leased like a check when every limit costs the same; else straight to the store
    /// (a loan's units are one count for all of its limits).
    fn check_each(
        &self,
        key: &[u8],
        policies: &[&Policy],
        costs: &[u64],
    ) -> Checked<BoxStoreFuture> {
        match super::Cost::of(policies, costs) {
            Ok(super::Cost::Same(cost)) => self.check(key, policies, cost),
            _ => boxed(self.inner.store.check_each(key, policies, costs)),
        }
    }

    /// Straight to the store. Anything but a peek also drops this process's loans of
    /// the key: a refund, charge, drain or reset moves the state its units' deadlines
    /// were priced against. Other gateways keep theirs until they go bad, so a refund
    /// or reset while others hold loans may let them spend a loan's worth more.
    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<BoxStoreFuture> {
        // A correction moves the state the loans' deadlines were priced against.
        if !matches!(operation, Operation::Peek(_)) {
            record::expired(self.inner.table.forget(key));
        }
        boxed(self.inner.store.operate(key, policies, operation))
    }

    fn supports(&self, policy: &Policy) -> Result<(), ConfigError> {
        self.inner.store.supports(policy)
    }

    fn supports_each_cost(&self) -> Result<(), ConfigError> {
        self.inner.store.supports_each_cost()
    }

    fn lend(&self, key: &[u8], policies: &[&Policy], cost: u64, ask: u64) -> Option<LendFuture> {
        self.inner.store.lend(key, policies, cost, ask)
    }

    fn give_back(
        &self,
        key: &[u8],
        policies: &[&Policy],
        units: u64,
        ends: &[u64],
    ) -> Option<GiveBackFuture> {
        self.inner.store.give_back(key, policies, units, ends)
    }
}

/// What a loan's call asks: sent at `origin` (this process's clock), for a request of
/// `cost` (0 for a renewal) and `ask` units in all, for the entry of `generation`.
#[derive(Clone, Copy, Debug)]
struct Ask {
    origin: u64,
    cost: u64,
    ask: u64,
    generation: u64,
}

/// A loan's call on its way: keeps what it lends, and ends the key's asking even if it
/// is dropped unanswered.
struct Asking<S, C> {
    inner: Arc<Inner<S, C>>,
    key: Box<[u8]>,
    ids: SmallVec<[u64; 2]>,
    policies: SmallVec<[Policy; 2]>,
    loan: Ask,
    done: bool,
}

impl<S, C> Asking<S, C> {
    fn new(
        inner: Arc<Inner<S, C>>,
        key: &[u8],
        ids: SmallVec<[u64; 2]>,
        policies: &[&Policy],
        loan: Ask,
    ) -> Self {
        Asking {
            inner,
            key: key.into(),
            ids,
            policies: policies.iter().map(|&p| p.clone()).collect(),
            loan,
            done: false,
        }
    }

    /// Keeps the units the store lent past the request's cost, and whether it had any
    /// left.
    fn finish(mut self, answer: Result<Grant, StoreError>) -> Result<Grant, StoreError> {
        self.done = true;
        let policies: SmallVec<[&Policy; 2]> = self.policies.iter().collect();
        let Ask {
            origin,
            cost,
            generation,
            ..
        } = self.loan;
        match &answer {
            Ok(grant) => {
                let loan = Loan::new(origin, &policies, grant, cost);
                if let Some(loan) = &loan {
                    record::lent(loan.unspent());
                }
                let dry = short(&policies, grant, self.loan);
                let table = &self.inner.table;
                table.lent(&self.key, &self.ids, generation, loan, dry);
            }
            Err(_) => self
                .inner
                .table
                .unask(&self.key, &self.ids, generation, false),
        }
        answer
    }
}

impl<S, C> Drop for Asking<S, C> {
    fn drop(&mut self) {
        if !self.done {
            let generation = self.loan.generation;
            self.inner
                .table
                .unask(&self.key, &self.ids, generation, false);
        }
    }
}

/// The lease metrics (feature `metrics`): see [`crate::metric::LEASE_UNITS`] and
/// [`crate::metric::LEASE_DECISIONS`].
mod record {
    #[cfg(feature = "metrics")]
    use crate::metric::{LEASE_DECISIONS, LEASE_UNITS};

    pub(super) fn lent(units: u64) {
        #[cfg(feature = "metrics")]
        metrics::counter!(LEASE_UNITS.name, "event" => "lent").increment(units);
        let _ = units;
    }

    pub(super) fn spent(cost: u64) {
        #[cfg(feature = "metrics")]
        {
            metrics::counter!(LEASE_UNITS.name, "event" => "spent").increment(cost);
            metrics::counter!(LEASE_DECISIONS.name, "where" => "local").increment(1);
        }
        let _ = cost;
    }

    pub(super) fn expired(units: u64) {
        #[cfg(feature = "metrics")]
        if units > 0 {
            metrics::counter!(LEASE_UNITS.name, "event" => "expired").increment(units);
        }
        let _ = units;
    }

    pub(super) fn refused() {
        #[cfg(feature = "metrics")]
        metrics::counter!(LEASE_DECISIONS.name, "where" => "local").increment(1);
    }

    pub(super) fn returned(units: u64) {
        #[cfg(feature = "metrics")]
        metrics::counter!(LEASE_UNITS.name, "event" => "returned").increment(units);
        let _ = units;
    }

    pub(super) fn called() {
        #[cfg(feature = "metrics")]
        metrics::counter!(LEASE_DECISIONS.name, "where" => "store").increment(1);
    }
}
