//! One limit across regions, each deciding against its own store: see
//! [`ReplicatedStore`].

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use parking_lot::Mutex;
use pin_project_lite::pin_project;
use smallvec::SmallVec;

use super::{Failing, one_region_only};
use crate::store::{Checked, Operation, Store};
use crate::{ConfigError, Decisions, Policy, StoreError};

/// A region's store that also tells the other regions what it admitted.
///
/// Each region decides against its own store, one round trip to a nearby Redis. It
/// still counts what the others admitted.
///
/// Every request this region admits is charged to each other region's store, in the
/// background. The charge is an [`Operation::Charge`] of its cost, under the same key
/// and policies. It arrives at most `sync_every` later (default 50 ms). Each peer has a
/// task of its own that sends its charges.
///
/// So a decision counts this region's own consumption, and every other region's as of
/// its last sync. The state in each region's store is the whole fleet's, late by the
/// *staleness* `S`. `S` is the sync interval plus the one-way latency to the peer.
/// Rounds do not wait for each other's answers.
///
/// # The bound
///
/// Compare this with one global store. A region admits too much only by what the other
/// regions admitted in the last `S`, that it has not heard of yet. In any period, that
/// is at most `(regions − 1) × (r × S + 1)` requests more than the quota allows. Here
/// `r` is the rate at which one region admits, at most its callers' rate. Traffic from
/// one region alone is decided exactly.
///
/// The same holds for every algorithm, since a charge is consumption arriving late:
///
/// - The token bucket, leaky bucket and GCRA owe what their budget cannot take. A
///   replayed backlog is cut at two capacities (a key owes at most one for it): after a
///   long partition, in which each region admitted up to its quota, a caller is not
///   locked out for as long as the partition lasted.
/// - A window algorithm counts up to its limit. A charge that arrives after its window
///   ended lands in the next one. So it refuses a little early, never late.
/// - The sliding log takes late charges as entries made now. They expire later than they
///   would have. Again it only ever refuses early.
///
/// # Failure
///
/// Nothing on the request path waits for another region. A peer may not be reachable:
/// a partition, a timeout. It keeps what it is owed, merged per key and policies, and
/// gets it when it can be reached again. Meanwhile each side decides on what it knows.
/// So a partition lets the regions admit up to a quota each.
///
/// A peer owed for more than `max_pending` keys drops the charges of further new keys.
/// [`dropped`](Self::dropped) counts them. So a long partition under a flood of new keys
/// cannot exhaust memory.
///
/// A peer that stops answering is logged at warn once, and once when it answers again.
///
/// # Operations
///
/// Only admissions are replicated. A peek, charge or drain through [`Store::operate`]
/// acts on this region's store alone. A reset or refund is refused with an error: in one
/// region, the others' state would undo it. Apply it to each region's own store.
///
/// The sync tasks run on the tokio runtime the store is built in. They stop when the
/// last clone of the store is dropped.
///
/// # Examples
///
/// Three regions, each a memory store here (in production: each region's Redis, and the
/// peers that region's view of the others' Redis).
///
/// ```
/// use std::time::Duration;
/// use tollway_core::{Algorithm, ManualClock, MemoryStore, Policy, Quota, ReplicatedStore, Store};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let clock = ManualClock::new();
/// let store = || MemoryStore::builder().clock(clock.clone()).build();
/// let (eu, us, ap) = (store()?, store()?, store()?);
/// let in_eu = ReplicatedStore::builder(eu.clone())
///     .peer("us", us.clone())
///     .peer("ap", ap.clone())
///     .sync_every(Duration::from_millis(50))
///     .build()?;
/// let in_us = ReplicatedStore::builder(us.clone()).peer("eu", eu).peer("ap", ap).build()?;
///
/// let policy = Policy::new("global", Algorithm::FixedWindow, Quota::per_minute(100)?)?;
/// for _ in 0..30 {
///     assert!(in_eu.check(b"customer-7", &[&policy], 1).await?.is_allowed());
/// }
/// // Once the EU region has told the others (every 50 ms, or now):
/// in_eu.sync_now().await;
/// let seen_in_us = in_us.check(b"customer-7", &[&policy], 1).await?;
/// assert_eq!(seen_in_us[0].remaining(), 69);
/// # Ok(())
/// # }
/// ```
pub struct ReplicatedStore<S> {
    inner: Arc<Inner<S>>,
}

struct Inner<S> {
    local: S,
    peers: Vec<Peer<S>>,
    timeout: Duration,
    max_pending: usize,
    /// The sync tasks, aborted when the store goes.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Another region's store, and what it is owed.
struct Peer<S> {
    name: String,
    store: S,
    owed: Mutex<HashMap<Owing, Owed>>,
    dropped: std::sync::atomic::AtomicU64,
    failing: Failing,
}

/// A key and its policies (by id), as a request named them.
type Owing = (Box<[u8]>, SmallVec<[u64; 2]>);

struct Owed {
    policies: SmallVec<[Policy; 2]>,
    units: u64,
}

impl<S> Clone for ReplicatedStore<S> {
    fn clone(&self) -> Self {
        ReplicatedStore {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S> fmt::Debug for ReplicatedStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peers: Vec<&str> = self.inner.peers.iter().map(|p| p.name.as_str()).collect();
        f.debug_struct("ReplicatedStore")
            .field("peers", &peers)
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

impl<S> Drop for Inner<S> {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl<S: Store + Clone> ReplicatedStore<S> {
    /// A builder for the region whose own store is `local`.
    pub fn builder(local: S) -> ReplicatedStoreBuilder<S> {
        ReplicatedStoreBuilder {
            local,
            peers: Vec::new(),
            sync_every: Duration::from_millis(50),
            timeout: Duration::from_secs(1),
            max_pending: 100_000,
        }
    }

    /// Tells every peer now what it is owed, and returns when each has answered or
    /// failed. What failed stays owed. For tests, and before a planned shutdown.
    pub async fn sync_now(&self) {
        let mut all = tokio::task::JoinSet::new();
        for i in 0..self.inner.peers.len() {
            let inner = Arc::clone(&self.inner);
            all.spawn(async move { inner.sync(i).await });
        }
        while all.join_next().await.is_some() {}
    }

    /// Keys the peers are owed charges for, summed over the peers: zero once every
    /// admission reached every region.
    pub fn owed(&self) -> usize {
        self.inner.peers.iter().map(|p| p.owed.lock().len()).sum()
    }

    /// Charges a peer never got because it was owed for `max_pending` keys already,
    /// summed over the peers.
    pub fn dropped(&self) -> u64 {
        self.inner
            .peers
            .iter()
            .map(|p| p.dropped.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }
}

impl<S: Store + Clone> Inner<S> {
    /// Owes every peer `cost` units of `key` under `policies`.
    fn admitted(&self, key: &[u8], policies: &[&Policy], cost: u64) {
        if cost == 0 {
            return;
        }
        let owing: Owing = (key.into(), policies.iter().map(|p| p.id()).collect());
        for peer in &self.peers {
            let mut owed = peer.owed.lock();
            if let Some(entry) = owed.get_mut(&owing) {
                entry.units += cost;
                continue;
            }
            if owed.len() >= self.max_pending {
                peer.dropped
                    .fetch_add(cost, std::sync::atomic::Ordering::Relaxed);
                continue;
            }
            owed.insert(
                owing.clone(),
                Owed {
                    policies: policies.iter().map(|&p| p.clone()).collect(),
                    units: cost,
                },
            );
        }
    }

    /// Charges peer `i` what it is owed (see [`replayed_at_most`]), every key at once;
    /// what fails stays owed.
    async fn sync(self: &Arc<Self>, i: usize) {
        let peer = &self.peers[i];
        let owed = std::mem::take(&mut *peer.owed.lock());
        if owed.is_empty() {
            return;
        }
        let mut charges = tokio::task::JoinSet::new();
        for ((key, ids), owed) in owed {
            let (store, timeout) = (peer.store.clone(), self.timeout);
            charges.spawn(async move {
                let failed = {
                    let policies: SmallVec<[&Policy; 2]> = owed.policies.iter().collect();
                    let units = owed.units.min(replayed_at_most(&policies));
                    let charge = store.operate(&key, &policies, Operation::Charge(units));
                    let done = tokio::time::timeout(timeout, charge.into_future()).await;
                    !matches!(done, Ok(Ok(_)))
                };
                ((key, ids), owed, failed)
            });
        }
        let mut failures = 0usize;
        while let Some(done) = charges.join_next().await {
            let Ok((owing, owed, failed)) = done else {
                continue;
            };
            if failed {
                failures += 1;
                let mut pending = peer.owed.lock();
                match pending.get_mut(&owing) {
                    Some(entry) => entry.units += owed.units,
                    None => {
                        pending.insert(owing, owed);
                    }
                }
            }
        }
        if failures == 0 {
            if peer.failing.answered() {
                tracing::warn!(peer = %peer.name, "replicated store: the peer answers again");
            }
        } else if peer.failing.failed() {
            tracing::warn!(
                peer = %peer.name,
                failures,
                "replicated store: charges to a peer failed; they stay owed until it answers"
            );
        } else {
            tracing::debug!(
                peer = %peer.name,
                failures,
                "replicated store: charges to a peer failed and stay owed"
            );
        }
    }
}

/// Builds a [`ReplicatedStore`].
#[must_use]
pub struct ReplicatedStoreBuilder<S> {
    local: S,
    peers: Vec<(String, S)>,
    sync_every: Duration,
    timeout: Duration,
    max_pending: usize,
}

impl<S> fmt::Debug for ReplicatedStoreBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peers: Vec<&str> = self.peers.iter().map(|p| p.0.as_str()).collect();
        f.debug_struct("ReplicatedStoreBuilder")
            .field("peers", &peers)
            .field("sync_every", &self.sync_every)
            .field("timeout", &self.timeout)
            .field("max_pending", &self.max_pending)
            .finish_non_exhaustive()
    }
}

impl<S: Store + Clone> ReplicatedStoreBuilder<S> {
    /// Another region, `name`d for logs, and its store as this region reaches it.
    pub fn peer(mut self, name: impl Into<String>, store: S) -> Self {
        self.peers.push((name.into(), store));
        self
    }

    /// How often each peer is told what this region admitted (default 50 ms): part of
    /// the staleness that bounds over-admission.
    pub fn sync_every(mut self, every: Duration) -> Self {
        self.sync_every = every;
        self
    }

    /// How long a charge to a peer may take before it counts as failed and stays owed
    /// (default 1 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many keys a peer may be owed for at once (default 100,000).
    pub fn max_pending(mut self, keys: usize) -> Self {
        self.max_pending = keys;
        self
    }

    /// Builds the store and starts its sync tasks, one a peer, on the current tokio
    /// runtime.
    ///
    /// # Errors
    ///
    /// Without a peer, with a sync interval or timeout of zero, with `max_pending` zero,
    /// or outside a tokio runtime.
    pub fn build(self) -> Result<ReplicatedStore<S>, ConfigError> {
        if self.peers.is_empty() {
            return Err(ConfigError::new(
                "a replicated store needs at least one peer: add the other regions with .peer(name, store)",
            ));
        }
        if self.sync_every.is_zero() || self.timeout.is_zero() || self.max_pending == 0 {
            return Err(ConfigError::new(format!(
                "a replicated store's sync interval, timeout and max_pending must be above \
                 zero; got {:?}, {:?} and {}",
                self.sync_every, self.timeout, self.max_pending
            )));
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            ConfigError::new(
                "build a replicated store inside a tokio runtime: its sync tasks run on it",
            )
        })?;
        let sync_every = self.sync_every;
        let inner = Arc::new_cyclic(|weak: &Weak<Inner<S>>| {
            let tasks = (0..self.peers.len())
                .map(|i| runtime.spawn(sync_forever(Weak::clone(weak), i, sync_every)))
                .collect();
            Inner {
                local: self.local,
                peers: self
                    .peers
                    .into_iter()
                    .map(|(name, store)| Peer {
                        name,
                        store,
                        owed: Mutex::new(HashMap::new()),
                        dropped: std::sync::atomic::AtomicU64::new(0),
                        failing: Failing::default(),
                    })
                    .collect(),
                timeout: self.timeout,
                max_pending: self.max_pending,
                tasks,
            }
        });
        Ok(ReplicatedStore { inner })
    }
}

/// Peer `i`'s sync task: every `every`, what it is owed, while the store lives.
///
/// A round does not wait for the one before to be answered: a round trip can be longer
/// than the interval. Each round takes what is owed when it starts. So rounds in flight
/// never carry the same units. What a round fails to deliver is owed again for a later
/// one. A peer that does not answer has at most `timeout / every` rounds in flight.
async fn sync_forever<S: Store + Clone>(store: Weak<Inner<S>>, i: usize, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(inner) = store.upgrade() else {
            return;
        };
        tokio::spawn(async move { inner.sync(i).await });
    }
}

impl<S: Store + Clone> Store for ReplicatedStore<S> {
    type Future = Recording<S>;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future> {
        match self.inner.local.check(key, policies, cost) {
            Checked::Ready(answer) => {
                if matches!(&answer, Ok(decisions) if decisions.is_allowed()) {
                    self.inner.admitted(key, policies, cost);
                }
                Checked::Ready(answer)
            }
            Checked::Pending(future) => Checked::Pending(Recording {
                future,
                admitted: Some(Admitted {
                    inner: Arc::clone(&self.inner),
                    key: key.into(),
                    policies: policies.iter().map(|&p| p.clone()).collect(),
                    cost,
                }),
            }),
        }
    }

    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        if let Some(refused) = one_region_only("ReplicatedStore", operation) {
            return Checked::Ready(Err(refused));
        }
        match self.inner.local.operate(key, policies, operation) {
            Checked::Ready(answer) => Checked::Ready(answer),
            Checked::Pending(future) => Checked::Pending(Recording {
                future,
                admitted: None,
            }),
        }
    }

    /// Not a limit on calls in flight: a slot is held and given back where the call
    /// runs, and replicating the taking without the giving back would hold it everywhere.
    fn supports(&self, policy: &Policy) -> Result<(), ConfigError> {
        if policy.algorithm() == crate::Algorithm::Concurrency {
            return Err(ConfigError::new(format!(
                "policy {:?}: a ReplicatedStore cannot limit calls in flight: keep \
                 concurrency limits on each region's own store",
                policy.name()
            )));
        }
        self.inner.local.supports(policy)
    }
}

/// A request the local store is deciding, to owe the peers if it is admitted.
struct Admitted<S> {
    inner: Arc<Inner<S>>,
    key: Box<[u8]>,
    policies: SmallVec<[Policy; 2]>,
    cost: u64,
}

pin_project! {
    /// The future of a [`ReplicatedStore`] decision: the local store's, then the
    /// admission owed to the peers.
    pub struct Recording<S: Store> {
        #[pin]
        future: S::Future,
        admitted: Option<Admitted<S>>,
    }
}

impl<S: Store> fmt::Debug for Recording<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recording").finish_non_exhaustive()
    }
}

impl<S: Store + Clone> Future for Recording<S> {
    type Output = Result<Decisions, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = ready!(this.future.poll(cx));
        if let (Ok(decisions), Some(admitted)) = (&answer, this.admitted.take())
            && decisions.is_allowed()
        {
            let policies: SmallVec<[&Policy; 2]> = admitted.policies.iter().collect();
            admitted
                .inner
                .admitted(&admitted.key, &policies, admitted.cost);
        }
        Poll::Ready(answer)
    }
}

/// The most units one replay charges a key under `policies`: two of the smallest
/// capacity. What the regions admitted past that while they could not reach each other
/// is not made a debt: each admitted at most its quota then.
fn replayed_at_most(policies: &[&Policy]) -> u64 {
    policies
        .iter()
        .map(|p| {
            let q = p.quota();
            2 * if p.algorithm().uses_burst() {
                q.burst()
            } else {
                q.limit()
            }
        })
        .min()
        .unwrap_or(u64::MAX)
}
