//! Where limiter state lives.
//!
//! A [`Store`] decides a request for a key against each of its [`Policy`]s, all or
//! nothing. [`MemoryStore`] keeps state in this process, for one node; the Redis store
//! (feature `redis`) keeps it in Redis, for a fleet of nodes sharing one limit;
//! [`CircuitBreaker`] wraps a remote store; [`BoxStore`] is any of them, chosen at run
//! time.

mod boxed;
mod breaker;
#[cfg(feature = "leases")]
mod lease;
pub(crate) mod lend;
mod memory;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "regions")]
mod regions;
pub mod share;

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

pub use self::boxed::{BoxStore, BoxStoreFuture};
pub use self::breaker::{
    BreakerState, CircuitBreaker, CircuitBreakerBuilder, CircuitBreakerFuture,
};
#[cfg(feature = "leases")]
pub use self::lease::{Leased, LeasedBuilder};
pub use self::lend::{GiveBackFuture, Grant, LendFuture};
pub use self::memory::{MemoryStore, MemoryStoreBuilder, WhenFull};
#[cfg(feature = "redis")]
pub use self::redis::{MAX_LITERAL_KEY, RedisStore, RedisStoreBuilder, Sentinel};
#[cfg(feature = "regions")]
pub use self::regions::{Board, BoardFuture, SplitFuture, SplitStore, SplitStoreBuilder};
#[cfg(feature = "regions")]
pub use self::regions::{Recording, ReplicatedStore, ReplicatedStoreBuilder};
pub use self::share::{Share, ShareAsk, ShareFuture};

use crate::{ConfigError, Decisions, Policy, StoreError, StoreErrorKind};

/// Decides requests against limiter state kept somewhere.
///
/// One method, [`Store::check`], decides a request of `cost` units for a caller's `key`.
/// It decides against every one of the request's policies: a tier and a route, say, or
/// a per-second and a per-hour band. The decision is **all or nothing**. When every
/// policy allows the request, each is charged. When any denies it, none is. The
/// policies that did not deny then report their state unchanged, as a request of cost 0
/// would get it. A refused request costs the caller nothing.
///
/// The answer is [`Checked::Ready`] when the store decided without waiting. The memory
/// store always does. The Redis store does when its local deny cache knows. Else the
/// answer is [`Checked::Pending`], with a future that owns everything it needs. Either
/// way it can be awaited.
///
/// State is kept per caller key and per policy: its name, algorithm and period
/// ([`Policy::state_id`]). Say a policy's limit changes, from 10/min to 1,000/min. Its
/// callers keep what they used, in every store: the raise gives each the difference. A
/// cut from 20 to 10 after 20 used refuses until usage is back below 10. Another
/// algorithm or period starts them afresh.
///
/// # Examples
///
/// ```
/// use tollway_core::{Algorithm, MemoryStore, Policy, Quota, Store};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let free = Policy::new("free", Algorithm::TokenBucket, Quota::per_minute(100)?)?;
/// let export = Policy::new("export", Algorithm::FixedWindow, Quota::per_minute(1)?)?;
///
/// let first = store.check(b"carol", &[&free, &export], 1).await?;
/// assert!(first.is_allowed());
/// assert_eq!((first[0].remaining(), first[1].remaining()), (99, 0));
///
/// // The export limit refuses the second call, and the tier is not charged for it.
/// let second = store.check(b"carol", &[&free, &export], 1).await?;
/// assert!(!second.is_allowed());
/// assert_eq!(second[0].remaining(), 99);
/// # Ok(())
/// # }
/// ```
pub trait Store: Send + Sync + 'static {
    /// The future of a decision the store could not make at once.
    type Future: Future<Output = Result<Decisions, StoreError>> + Send + 'static;

    /// Decides one request of `cost` units for `key` against every policy in
    /// `policies`, all or nothing; the decisions come in the order of `policies`.
    ///
    /// A cost is any `u64`. No capacity passes [`MAX_UNITS`](crate::MAX_UNITS), so a
    /// cost past it is refused as costing more than the capacity, in every store (a
    /// script reads it as 2^53 + 2, past every capacity and exact in Lua).
    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future>;

    /// Decides one request for `key` that costs each of `policies` its own units:
    /// `costs[i]` for `policies[i]` (1 request and 800 tokens, say). All or nothing, as
    /// [`check`](Self::check): a request refused by one limit charges none.
    ///
    /// The default decides a request whose limits all cost the same by `check`, and
    /// fails any other: a store of your own that keeps limits apart overrides it. The
    /// memory and Redis stores (one script call) decide any.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_core::{Algorithm, MemoryStore, Policy, Quota, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let requests = Policy::new("requests", Algorithm::FixedWindow, Quota::per_minute(60)?)?;
    /// let tokens = Policy::new("tokens", Algorithm::TokenBucket, Quota::per_minute(10_000)?)?;
    /// let d = store.check_each(b"team-7", &[&requests, &tokens], &[1, 800]).await?;
    /// assert_eq!((d[0].remaining(), d[1].remaining()), (59, 9_200));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// Through its future: when `costs` is not one a policy, or (the default) when the
    /// costs differ.
    fn check_each(&self, key: &[u8], policies: &[&Policy], costs: &[u64]) -> Checked<Self::Future> {
        match Cost::of(policies, costs) {
            Ok(Cost::Same(cost)) => self.check(key, policies, cost),
            Ok(Cost::Each(_)) => Checked::Ready(Err(StoreError::new(
                StoreErrorKind::Other,
                "this store decides one cost for all of a request's limits: \
                 give each limit the same cost, or use a store that implements check_each",
            ))),
            Err(e) => Checked::Ready(Err(e)),
        }
    }

    /// Looks at or corrects `key`'s state under each of `policies` without deciding a
    /// request: see [`Operation`]. The answer is one decision a policy, in their order.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_core::{Algorithm, ManualClock, MemoryStore, Operation, Policy, Quota, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::builder().clock(ManualClock::new()).build()?;
    /// let tokens = Policy::new("llm", Algorithm::TokenBucket, Quota::per_minute(1_000)?)?;
    ///
    /// // A response reports the 500 units it used, after the fact.
    /// let after = store.operate(b"team-7", &[&tokens], Operation::Charge(500)).await?;
    /// assert_eq!(after[0].remaining(), 500);
    ///
    /// // Peeking at a 600-unit request consumes nothing: it would be refused.
    /// let peek = store.operate(b"team-7", &[&tokens], Operation::Peek(600)).await?;
    /// assert!(!peek.is_allowed());
    ///
    /// // Support gives 100 back, then resets the caller altogether.
    /// let after = store.operate(b"team-7", &[&tokens], Operation::Refund(100)).await?;
    /// assert_eq!(after[0].remaining(), 600);
    /// let fresh = store.operate(b"team-7", &[&tokens], Operation::Reset).await?;
    /// assert_eq!(fresh[0].remaining(), 1_000);
    /// # Ok(())
    /// # }
    /// ```
    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future>;

    /// Whether this store can decide `policy`: `Err` says why not, and what to change.
    ///
    /// A rate-limit layer asks it about each of its policies when it is built. It
    /// refuses to build over a store that would fail their requests. The default
    /// `OnStoreError::Allow` would turn such a failure into no limit at all. The default
    /// accepts every policy. A store that decides only some says which. A [`SplitStore`]
    /// (feature `regions`) decides only those declared to it. A store that wraps another
    /// asks the one it wraps.
    ///
    /// # Errors
    ///
    /// When the store cannot decide `policy`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_core::{Algorithm, MemoryStore, Policy, Quota, Store};
    ///
    /// let policy = Policy::new("api", Algorithm::Gcra, Quota::per_minute(10)?)?;
    /// assert!(MemoryStore::new().supports(&policy).is_ok());
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    fn supports(&self, policy: &Policy) -> Result<(), ConfigError> {
        let _ = policy;
        Ok(())
    }

    /// Whether [`check_each`](Self::check_each) decides limits of different costs. A
    /// layer whose policies have costs of their own asks when it is built.
    ///
    /// # Errors
    ///
    /// The default: this store keeps one cost for all of a request's limits.
    fn supports_each_cost(&self) -> Result<(), ConfigError> {
        Err(ConfigError::new(
            "this store decides one cost for all of a request's limits: give no policy a cost \
             of its own, or use the memory or Redis store",
        ))
    }

    /// Takes a batch of units for `key` under every one of `policies`, in one step: a
    /// request of `cost` units, and up to `ask` units in all.
    ///
    /// The store takes as many as every limit fits, at most `ask`, and at most half of
    /// what the fullest-spent limit has left (rounded up). It takes the request's own `cost` at
    /// least, or nothing: then the grant holds the request's refusal. A grant is all
    /// or nothing like a check, and its decisions are those of a request of the units
    /// it took. [`Leased`](crate::Leased) spends the units beyond the request's cost
    /// later, in this process.
    ///
    /// `None`: the store does not lend these policies (or not now). The default lends
    /// nothing. The memory and Redis stores lend every policy whose algorithm
    /// [`lends`](crate::Algorithm::lends).
    fn lend(&self, key: &[u8], policies: &[&Policy], cost: u64, ask: u64) -> Option<LendFuture> {
        let _ = (key, policies, cost, ask);
        None
    }

    /// Gives back `units` of a loan that were never spent, to the windows they came
    /// from: `ends[i]` is where `policies[i]`'s window ends, on the store's clock (the
    /// grant's [`at`](Grant::at) plus its reset).
    ///
    /// A fixed window takes them off its count while that window is the current one; a
    /// sliding window counter off its current count, or off its previous one once the
    /// window has just ended. Anything else keeps its state: a window that ended forgot
    /// its count, and a bucket's lent units go bad as it refills them. So a give-back
    /// never frees a unit another window counted.
    ///
    /// Send each give-back once: a second would free units twice. `None`: the store takes
    /// nothing back (the default); the units go bad with their windows.
    fn give_back(
        &self,
        key: &[u8],
        policies: &[&Policy],
        units: u64,
        ends: &[u64],
    ) -> Option<GiveBackFuture> {
        let _ = (key, policies, units, ends);
        None
    }

    /// Divides `policy`'s rate for `key` among holders that each enforce a token bucket
    /// of their own, and decides `ask`'s share: see [`share`](crate::share) for the
    /// rule and what it bounds.
    ///
    /// `None`: the store does not share `policy` (the default shares nothing). The memory
    /// and Redis stores share what [`shareable`](crate::share::shareable) accepts.
    fn share(&self, key: &[u8], policy: &Policy, ask: &ShareAsk) -> Option<ShareFuture> {
        let _ = (key, policy, ask);
        None
    }
}

/// What each of a request's limits costs: the same for all, or one each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Cost {
    Same(u64),
    Each(smallvec::SmallVec<[u64; 4]>),
}

impl Cost {
    /// The costs of `policies`: the same when every one is, else each.
    ///
    /// # Errors
    ///
    /// When there is not one cost a policy.
    pub(crate) fn of(policies: &[&Policy], costs: &[u64]) -> Result<Cost, StoreError> {
        if costs.len() != policies.len() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!(
                    "a request under {} limits has {} costs: give one a limit",
                    policies.len(),
                    costs.len()
                ),
            ));
        }
        Ok(match costs.split_first() {
            None => Cost::Same(0),
            Some((&first, rest)) if rest.iter().all(|&c| c == first) => Cost::Same(first),
            Some(_) => Cost::Each(costs.into()),
        })
    }
}

/// What [`Store::operate`] does to a caller's state, besides deciding a request.
///
/// Each answers one [`Decision`](crate::Decision) a policy. `Peek` answers what
/// [`Store::check`] would, all or nothing. The others act on each policy on its own.
/// They correct what happened, so nothing is refused. They answer what a request of cost
/// 0 then gets: how much remains, and when the caller is back to full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Operation {
    /// The decisions a request of this cost would get, consuming nothing.
    Peek(u64),
    /// Takes this many units from every policy after the fact, whether or not they fit:
    /// a cost the response reported.
    ///
    /// Under the token bucket, both leaky buckets and GCRA, what does not fit is owed.
    /// The caller waits it out, at the refill rate, before anything fits again. So usage
    /// beyond the budget is paid back rather than forgiven. The debt is kept up to 2^52
    /// of the algorithm's own measure (ticks, µs), so Rust and Lua compute it exactly:
    /// 75 million units for a minute's token bucket, far beyond any capacity. The window
    /// algorithms count at most their limit. Their window is spent either way, and what
    /// did not fit is forgiven when it ends.
    Charge(u64),
    /// Gives this many units back to every policy, up to full (paying back what is owed
    /// first): a request that failed, or cost less than it was charged.
    Refund(u64),
    /// Forgets the caller's state: every policy as for a new caller.
    Reset,
    /// Takes units from every policy until at most this many remain, in one atomic
    /// step. A policy with no more than that left loses none. It means "at least this
    /// empty". Callers racing with different amounts can ask it without adding up. The
    /// outbound layer's pause is one.
    Drain(u64),
}

/// A store's answer: ready now, or a future to wait for.
///
/// It can be awaited either way (it is [`IntoFuture`]); a caller that can act at once
/// on a ready answer matches on it instead.
#[derive(Debug)]
pub enum Checked<F> {
    /// Decided without waiting.
    Ready(Result<Decisions, StoreError>),
    /// Decided when the future completes.
    Pending(F),
}

impl<F> IntoFuture for Checked<F>
where
    F: Future<Output = Result<Decisions, StoreError>>,
{
    type Output = Result<Decisions, StoreError>;
    type IntoFuture = CheckedFuture<F>;

    fn into_future(self) -> CheckedFuture<F> {
        let state = match self {
            Checked::Ready(answer) => State::Ready {
                answer: Some(answer),
            },
            Checked::Pending(future) => State::Pending { future },
        };
        CheckedFuture { state }
    }
}

pin_project! {
    /// A [`Checked`] answer as a future.
    ///
    /// # Panics
    ///
    /// When a ready answer is polled again after it was returned.
    #[derive(Debug)]
    pub struct CheckedFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    #[derive(Debug)]
    enum State<F> {
        Ready { answer: Option<Result<Decisions, StoreError>> },
        Pending { #[pin] future: F },
    }
}

impl<F> Future for CheckedFuture<F>
where
    F: Future<Output = Result<Decisions, StoreError>>,
{
    type Output = Result<Decisions, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Ready { answer } => Poll::Ready(
                answer
                    .take()
                    .expect("CheckedFuture polled after it completed"),
            ),
            StateProj::Pending { future } => future.poll(cx),
        }
    }
}
