//! One limit across regions, each holding a share of it: see [`SplitStore`].
//!
//! The store and its request path are here; the shares in `shares.rs`, the exchange of
//! demand between the regions in `exchange.rs`, the builder in `builder.rs`.

mod builder;
mod exchange;
mod shares;
#[cfg(test)]
mod tests;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use parking_lot::Mutex;
use pin_project_lite::pin_project;
use smallvec::SmallVec;

pub use self::builder::SplitStoreBuilder;
use self::shares::Plan;
use super::board::Board;
use super::{Failing, one_region_only};
use crate::policy::fnv1a;
use crate::store::{Checked, Operation, Store};
use crate::{
    Algorithm, Clock, ConfigError, Decision, Decisions, Policy, Quota, StoreError, StoreErrorKind,
};

/// A region's store that admits only this region's share of each limit.
///
/// The regions together never admit more than the limit. Each decides against its own
/// store, one round trip to a nearby Redis. Nothing on the request path crosses to
/// another region.
///
/// # Shares
///
/// Under a fixed-window policy, each region counts what its callers ask of
/// each key in every window. It counts a request whether it is admitted or not.
/// [`Operation`]s are not demand. The region posts that demand a *lead* before the
/// window's end: a quarter of the window by default. It scales the demand to a whole
/// window. It posts on its own [`Board`] first, then on every other region's, all keys in
/// one post.
///
/// Half the lead later, the region reads its own board. From everyone's demand it fixes
/// its share of each key's limit for the next window. The shares are max-min fair. Where
/// all asks fit, each region gets its ask and an even part of what is left. Else each
/// region gets its ask, up to the highest level the limit allows. A region computes only
/// its own share. The shares of all regions, computed from the same asks, add up to at
/// most the limit.
///
/// # Never over-admits
///
/// A region may not hear from another: its post was lost, late,
/// cut off, or made with another list of regions. Then it counts that region as asking
/// for everything. A region that posted nothing for a window counts itself so too.
/// Asking more elsewhere can only shrink a region's share. So each region's share is at
/// most what it would be had everyone heard everything, and those shares add up to at
/// most the limit. In every window, the regions together admit at most the limit,
/// whatever is lost, late or cut off.
///
/// A window's shares are fixed before it begins. A window is counted under its own name
/// whatever the share. So a process may take over a region's name mid-window. It first
/// reads what its predecessor posted, from the region's board. Then it counts on from
/// where its predecessor stopped.
///
/// This holds under four conditions.
///
/// 1. The regions' clocks agree on the windows. `SystemClock`, kept by NTP, will do:
///    regions apart by ε shift their windows by ε. The local store's clock is within a
///    period of the store's. Redis `TIME` will do.
/// 2. Every region lists the same regions. A post made with another list is logged, and
///    counted as asking everything. But a change of the list takes a while to roll out.
///    Meanwhile, regions that list different sets can each take the share their own list
///    gives them. Together they can take more than the limit.
/// 3. One process at a time runs under a name. Its local store and board outlive it, and
///    keep what they acknowledged. Redis does. A memory store forgets its counts with the
///    process anyway.
/// 4. The local store counts every admission. A Redis store's local fallback admits on
///    its own while Redis is down. A memory store may admit untracked keys when full.
///    Either would admit past the share.
///
/// # What it costs: under-admission
///
/// Shares follow demand a window late. When a
/// region's callers arrive, it gets their share from the window after the one in which
/// their demand was posted. That is the next window when they arrive before that
/// window's post, else the one after. Meanwhile the region has what the others left.
///
/// A region's posts must be done within half the lead. That covers its own board's
/// write, then the way to the others. Else the others count it as asking everything.
///
/// A region may be cut off from the others, and they may not hear from it. It then
/// decides on the level it can count on whatever the others ask. That is about
/// `limit / regions` of a key it asked for, and nothing of a key it did not ask for. This
/// lasts until the link returns and a window's posts go through. A fleet starting afresh
/// takes `limit / regions` of every key in its first window.
///
/// # Only fixed windows split
///
/// A window ends everywhere at once. So a share changes
/// only where the count starts afresh anyway. A bucket's tokens or a log's entries would
/// carry over a share that no longer holds. Every policy a request names must be
/// declared to the builder. Other algorithms are refused when the store is built.
///
/// A policy is declared with its quota. A changed quota (a reload, a caller's own
/// quota, a descriptor's limit) is another policy, refused until a store declares it.
/// A window's count is named by the policy's state id, not its quota.
///
/// # Decisions
///
/// A decision reports this region's share as its limit. Its reset and
/// retry times end with the window. A share of zero cannot take a request at all. Such
/// a request is refused without asking the store, and its other limits then report
/// remaining 0. [`Store::operate`] acts on this region's share of the current window.
///
/// The local store keeps each window's counts a few periods after it ends (see the
/// builder's `max_keys`). With several gateways in a region, each is a region of its own
/// here. It has a name and a share of its own, and its peers are every other gateway.
///
/// # Examples
///
/// Three regions, each a memory store here (in production each region's Redis, and the
/// peers the others' Redis as this region reaches them). The posts and reads happen on
/// time by themselves; on a manual clock, `report_now` and `collect_now` make them.
///
/// ```
/// use std::time::Duration;
/// use tollway_core::{Algorithm, ManualClock, MemoryStore, Policy, Quota, SplitStore, Store};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let clock = ManualClock::new();
/// let store = || MemoryStore::builder().clock(clock.clone()).build();
/// let (eu, us, ap) = (store()?, store()?, store()?);
/// let policy = Policy::new("global", Algorithm::FixedWindow, Quota::per_minute(90)?)?;
/// let region = async |own: &MemoryStore<ManualClock>, name, peers: [(&str, &MemoryStore<ManualClock>); 2]| {
///     let mut builder = SplitStore::builder(name, own.clone(), clock.clone()).policy(&policy);
///     for (peer, store) in peers {
///         builder = builder.peer(peer, store.clone());
///     }
///     builder.build().await
/// };
/// let in_eu = region(&eu, "eu", [("us", &us), ("ap", &ap)]).await?;
/// let in_us = region(&us, "us", [("eu", &eu), ("ap", &ap)]).await?;
/// let in_ap = region(&ap, "ap", [("eu", &eu), ("us", &us)]).await?;
///
/// // Knowing nothing of each other, each region takes a third of the first window.
/// let mut admitted = 0;
/// while in_eu.check(b"customer-7", &[&policy], 1).await?.is_allowed() {
///     admitted += 1;
/// }
/// assert_eq!(admitted, 30);
///
/// // Each region posts its demand, then reads the others': the customer asks only in
/// // the EU, which gets the whole limit of the next window, and the others nothing of it.
/// for region in [&in_eu, &in_us, &in_ap] {
///     region.report_now().await;
/// }
/// for region in [&in_eu, &in_us, &in_ap] {
///     region.collect_now().await;
/// }
/// clock.advance(Duration::from_secs(60));
/// let next = in_eu.check(b"customer-7", &[&policy], 1).await?;
/// assert_eq!((next[0].limit(), next[0].remaining()), (90, 89));
/// assert!(!in_us.check(b"customer-7", &[&policy], 1).await?.is_allowed());
/// # Ok(())
/// # }
/// ```
pub struct SplitStore<S> {
    inner: Arc<Inner<S>>,
}

struct Inner<S> {
    region: String,
    /// A digest of every region's name (this one's and its peers'), in every post: a
    /// region configured with other peers is not heard from.
    fingerprint: u64,
    local: S,
    peers: Vec<(String, S)>,
    /// Whether this region's board, and each peer's, is failing (logged at warn when it
    /// starts and ends).
    board_failing: Failing,
    peers_failing: Vec<Arc<Failing>>,
    clock: Arc<dyn Clock>,
    timeout: Duration,
    max_keys: usize,
    splits: Vec<Split>,
    /// The exchange tasks, aborted when the store goes.
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

/// A declared policy and what this region knows of its windows.
struct Split {
    policy: Policy,
    /// How long before a window's end its demand is posted.
    lead: u64,
    plan: Mutex<Plan>,
}

impl<S> Clone for SplitStore<S> {
    fn clone(&self) -> Self {
        SplitStore {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S> fmt::Debug for SplitStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peers: Vec<&str> = self.inner.peers.iter().map(|p| p.0.as_str()).collect();
        f.debug_struct("SplitStore")
            .field("region", &self.inner.region)
            .field("peers", &peers)
            .finish_non_exhaustive()
    }
}

impl<S> Drop for Inner<S> {
    fn drop(&mut self) {
        for task in self.tasks.get_mut().iter() {
            task.abort();
        }
    }
}

impl<S: Store + Board + Clone> SplitStore<S> {
    /// A builder for the region `name`d, as its peers name it.
    ///
    /// The region's own store is `local`, which is also its board, where the others
    /// post. `clock` must be the clock `local` decides on: a memory store's, or a Redis
    /// store's caller time. Then windows start at the same instant for both.
    pub fn builder(name: impl Into<String>, local: S, clock: impl Clock) -> SplitStoreBuilder<S> {
        SplitStoreBuilder::new(name, local, clock)
    }

    /// Posts this region's demand for the current window now, if it has not yet.
    ///
    /// Returns when each peer has answered or failed. This is for tests on a manual
    /// clock. The store does it on time, `lead` before each window's end.
    pub async fn report_now(&self) {
        let now = self.inner.clock.now_micros();
        for i in 0..self.inner.splits.len() {
            let window = now / self.inner.splits[i].policy.quota().period_micros();
            let mut posts = self.inner.report(i, window).await;
            while posts.join_next().await.is_some() {}
        }
    }

    /// Reads this region's board now and fixes its shares of the next window.
    ///
    /// A window this region has not posted for yet is then closed: it posts nothing for
    /// it. This is for tests on a manual clock. The store does it on time, half the lead
    /// before each window's end.
    pub async fn collect_now(&self) {
        let now = self.inner.clock.now_micros();
        for i in 0..self.inner.splits.len() {
            let window = now / self.inner.splits[i].policy.quota().period_micros();
            self.inner.collect(i, window).await;
        }
    }

    /// This region's share of `key` under `policy` in the current window, without
    /// counting a request.
    ///
    /// # Errors
    ///
    /// When `policy` was not declared to the builder.
    pub fn share_of(&self, key: &[u8], policy: &Policy) -> Result<u64, StoreError> {
        let now = self.inner.clock.now_micros();
        let split = self.inner.split_of(policy)?;
        Ok(self.inner.share(split, key, now, 0))
    }
}

/// How many periods long the fixed window is that keeps a region's count of `window`.
///
/// The count is kept under a policy named for the window. The span is the smallest `m`
/// from 3 such that neither `window` nor `window + 1` is a multiple of `m`. So no
/// `m`-period window starts between one period before `window` and one after it.
///
/// The count is then the same one whichever instant of that span the local store reads
/// from its own clock. Say the split store places a request just before a window's end,
/// and the store decides it just after: it is counted with its window. And a local store
/// whose clock is apart from the split store's by less than a period counts each window
/// whole. Redis's `TIME` is such a clock.
fn span(window: u64) -> u64 {
    (3..=MAX_SPAN)
        .find(|&m| (window == 0 || !window.is_multiple_of(m)) && !(window + 1).is_multiple_of(m))
        .unwrap_or(MAX_SPAN)
}

/// The longest span: 64 periods.
///
/// For every `m` up to it to divide `window` or `window + 1`, `window × (window + 1)`
/// must be a multiple of lcm(1..64). That is about 2^90, so the window number must be
/// past 2^44. A window of a millisecond reaches that 557 years after its clock's origin.
/// Below 2 million, no span passes 19.
const MAX_SPAN: u64 = 64;

impl<S: Store + Board + Clone> Inner<S> {
    fn split_of(&self, policy: &Policy) -> Result<&Split, StoreError> {
        self.splits
            .iter()
            .find(|split| split.policy.id() == policy.id())
            .ok_or_else(|| {
                StoreError::new(
                    StoreErrorKind::Other,
                    format!(
                        "policy {:?} was not declared to the split store of region {:?}: \
                         declare every policy its requests name with .policy(..)",
                        policy.name(),
                        self.region
                    ),
                )
            })
    }

    /// The policies a request gets in this region, and how long each one's window lasts.
    ///
    /// Each declared policy comes at this region's share of `key`. `Err` holds the
    /// refusal when a share is zero.
    fn shares(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u64,
    ) -> Result<(Counted, Ends), Result<Decisions, StoreError>> {
        let now = self.clock.now_micros();
        let mut derived = SmallVec::new();
        let mut ends = Ends::new();
        let mut refused = false;
        let mut decisions = Decisions::new();
        for policy in policies {
            let split = self.split_of(policy).map_err(Err)?;
            let share = self.share(split, key, now, cost);
            let period = split.policy.quota().period_micros();
            let until_end = period - now % period;
            decisions.push(Decision::limited(share, 0, until_end, until_end));
            refused |= share == 0;
            if !refused {
                // Named and kept for the window, whatever the share: a process that takes
                // over the region mid-window, with a share no larger, counts on.
                let window = now / period;
                let span = span(window);
                let id = fnv1a(
                    policy
                        .state_id()
                        .to_le_bytes()
                        .into_iter()
                        .chain(window.to_le_bytes())
                        .chain(span.to_le_bytes()),
                );
                let counted = Quota::counting(share, period * span)
                    .and_then(|quota| {
                        let name = format!("s{window:x}-{:x}", policy.state_id());
                        Policy::with_id(name, Algorithm::FixedWindow, quota, id).ok()
                    })
                    .ok_or_else(|| {
                        StoreError::new(
                            StoreErrorKind::Other,
                            format!("split store: no count of {share} for {:?}", policy.name()),
                        )
                    })
                    .map_err(Err)?;
                derived.push(counted);
                ends.push(until_end);
            }
        }
        if refused {
            // Nothing to ask the store: this region has none of a limit this window. The
            // other limits say remaining 0 too (a little low, never high).
            return Err(Ok(decisions));
        }
        Ok((derived, ends))
    }

    /// The key this region's counts are kept under in its store.
    fn local_key(&self, key: &[u8]) -> Vec<u8> {
        let mut local = Vec::with_capacity(7 + self.region.len() + key.len());
        local.extend_from_slice(b"split\0");
        local.extend_from_slice(self.region.as_bytes());
        local.push(0);
        local.extend_from_slice(key);
        local
    }
}

/// Microseconds to the end of each of a request's windows.
type Ends = SmallVec<[u64; 2]>;

/// The policies a request's windows are counted under in the local store.
type Counted = SmallVec<[Policy; 2]>;

impl<S: Store + Board + Clone> Store for SplitStore<S> {
    type Future = SplitFuture<S::Future>;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future> {
        self.decide(key, policies, cost, |local, key, derived| {
            local.check(key, derived, cost)
        })
    }

    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        if let Some(refused) = one_region_only("SplitStore", operation) {
            return Checked::Ready(Err(refused));
        }
        self.decide(key, policies, 0, |local, key, derived| {
            local.operate(key, derived, operation)
        })
    }

    /// Only the policies declared to the builder: another would fail every request.
    fn supports(&self, policy: &Policy) -> Result<(), ConfigError> {
        self.inner
            .split_of(policy)
            .map(|_| ())
            .map_err(|error| ConfigError::new(error.to_string()))
    }
}

impl<S: Store + Board + Clone> SplitStore<S> {
    /// Asks the local store, through `ask`, under the request's policies at this
    /// region's shares (counting `cost` as demand), or refuses at once for a share of
    /// zero. The answer's reset and retry times end with this region's windows.
    fn decide(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u64,
        ask: impl FnOnce(&S, &[u8], &[&Policy]) -> Checked<S::Future>,
    ) -> Checked<SplitFuture<S::Future>> {
        let (derived, ends) = match self.inner.shares(key, policies, cost) {
            Ok(shares) => shares,
            Err(answer) => return Checked::Ready(answer),
        };
        let derived: SmallVec<[&Policy; 2]> = derived.iter().collect();
        match ask(&self.inner.local, &self.inner.local_key(key), &derived) {
            Checked::Ready(answer) => Checked::Ready(answer.map(|d| within(d, &ends))),
            Checked::Pending(future) => Checked::Pending(SplitFuture { future, ends }),
        }
    }
}

/// `decisions` with each one's reset and retry times cut at the end of its window (the
/// count it is kept in lasts longer: see [`span`]).
fn within(decisions: Decisions, ends: &[u64]) -> Decisions {
    decisions
        .iter()
        .zip(ends)
        .map(|(decision, &end)| decision.within(end))
        .collect()
}

pin_project! {
    /// The future of a [`SplitStore`] decision: the local store's, its reset and retry
    /// times ending with this region's windows.
    pub struct SplitFuture<F> {
        #[pin]
        future: F,
        ends: Ends,
    }
}

impl<F> fmt::Debug for SplitFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SplitFuture").finish_non_exhaustive()
    }
}

impl<F: Future<Output = Result<Decisions, StoreError>>> Future for SplitFuture<F> {
    type Output = Result<Decisions, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = ready!(this.future.poll(cx));
        Poll::Ready(answer.map(|decisions| within(decisions, this.ends)))
    }
}
