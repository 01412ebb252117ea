//! One limit across regions, each holding a share of it: see [`SplitStore`].

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use smallvec::SmallVec;

use super::{Checked, Operation, Store};
use crate::{
    Algorithm, Clock, ConfigError, Decision, Decisions, Policy, Quota, StoreError, StoreErrorKind,
};

/// The future of a [`Board`] call.
pub type BoardFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send>>;

/// A region's notice board: where the other regions post what they need of a limit, for
/// the region's [`SplitStore`] to read.
///
/// A post replaces nothing and is all or nothing: a reader sees every note of a post or
/// none of them. Implemented by [`MemoryStore`](crate::MemoryStore) (notes kept beside its
/// limits, for one process) and by the Redis store (a hash a topic, written with one
/// `HSET`, read with one `HGETALL`, expiring after `keep`).
pub trait Board: Send + Sync + 'static {
    /// Adds `notes` (name, value) under `topic`, all at once, kept for `keep`.
    fn post(&self, topic: &str, notes: Vec<(Vec<u8>, u64)>, keep: Duration) -> BoardFuture<()>;

    /// Every note under `topic` (none once it has expired).
    fn read(&self, topic: &str) -> BoardFuture<Vec<(Vec<u8>, u64)>>;
}

/// A region's store that admits only this region's share of each limit, so that the
/// regions together never admit more than the limit — each deciding against its own
/// store, one round trip to a nearby Redis, with nothing on the request path crossing to
/// another region.
///
/// **Shares.** Every window of a fixed-window policy, each region counts what its callers
/// ask of each key (admitted or not), and a quarter of the window before its end (the
/// *lead*, configurable) posts that demand — scaled to a whole window — on every other
/// region's [`Board`], all keys in one post. Half the lead later it reads its own board
/// and computes, for the next window, its share of each key's limit from everyone's
/// demand: max-min fair (each region gets what it asks, or an equal level where asks
/// exceed the limit, the level's remainder split evenly). A region computes only its own
/// share; all of them, computed from the same demands, add up to at most the limit.
///
/// **Never over-admits.** A region that has not heard from another — its post was lost,
/// late or cut off — counts that region as asking for everything. Asking more elsewhere
/// can only shrink a region's share, so each region's share is at most what it would be
/// if everyone had heard everything, and those add up to at most the limit: in every
/// window, the regions together admit at most the limit, whatever is lost, late or cut
/// off. (The windows are the clocks' windows: regions' clocks apart by ε shift their
/// windows by ε.)
///
/// **What it costs: under-admission.** Shares follow demand one window late: a region
/// whose callers arrive gets its share from the window after the one where its demand
/// was posted — from the next window when they arrive before that window's report, else
/// the one after. Meanwhile it has what the others left: in the windows in between, the
/// fleet admits less than the limit where demand moved. A region cut off from the
/// others (and they, not hearing from it) decides on the level it can count on whatever
/// the others ask: about `limit / regions` for a key it asked for, nothing for a key it
/// did not ask for in the last window (both until the link returns and a window's posts
/// go through). A region that starts afresh takes `limit / regions` of every key for its
/// first window.
///
/// Only fixed windows split: a window ends everywhere at once, so a share changes only
/// where the count starts afresh anyway (a bucket's tokens or a log's entries would carry
/// over a share that no longer holds). Every policy a request names must be declared to
/// the builder; other algorithms are refused when the store is built.
///
/// Decisions report this region's share as their limit. [`Store::operate`] acts on this
/// region's share of the current window. With several gateways in a region, each is a
/// region of its own here (a name and a share of its own; its peers are every other
/// gateway), so that no two share one count.
///
/// # Examples
///
/// Three regions, each a memory store here (in production each region's Redis, and the
/// peers the others' Redis as this region reaches them); on a manual clock, the posts
/// and reads are made by `exchange_now` instead of on time.
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
/// let region = |own: &MemoryStore<ManualClock>, name, peers: [(&str, &MemoryStore<ManualClock>); 2]| {
///     let mut builder = SplitStore::builder(name, own.clone(), clock.clone()).policy(&policy);
///     for (peer, store) in peers {
///         builder = builder.peer(peer, store.clone());
///     }
///     builder.build()
/// };
/// let in_eu = region(&eu, "eu", [("us", &us), ("ap", &ap)])?;
/// let in_us = region(&us, "us", [("eu", &eu), ("ap", &ap)])?;
/// let in_ap = region(&ap, "ap", [("eu", &eu), ("us", &us)])?;
///
/// // Knowing nothing of each other, each region takes a third of the first window.
/// let mut admitted = 0;
/// while in_eu.check(b"customer-7", &[&policy], 1).await?.is_allowed() {
///     admitted += 1;
/// }
/// assert_eq!(admitted, 30);
///
/// // Each region posts its demand and reads the others' (on time, a quarter of the
/// // window before its end): the customer asks only in the EU, which gets the whole
/// // limit of the next window, and the others nothing of it.
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
    local: S,
    peers: Vec<(String, S)>,
    clock: Arc<dyn Clock>,
    timeout: Duration,
    max_keys: usize,
    splits: Vec<Split>,
    /// The exchange tasks, aborted when the store goes.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// A declared policy and what this region knows of its windows.
struct Split {
    policy: Policy,
    /// How long before a window's end its demand is posted.
    lead: u64,
    /// How many other regions share the limit.
    peers: usize,
    plan: Mutex<Plan>,
}

#[derive(Default)]
struct Plan {
    /// The window `demand` counts (its start over the period).
    window: u64,
    /// Units asked of each key in `window`.
    demand: HashMap<Box<[u8]>, u64>,
    /// The demand this region posted for a window (once a window): what the others take
    /// it to ask.
    reported: TwoWindows<HashMap<Box<[u8]>, u64>>,
    /// This region's shares of a window, fixed before it began.
    shares: TwoWindows<Shares>,
}

/// Something for each of at most two windows: the current one and the next, or the last
/// and the current. What is kept for a window never changes while it is current.
struct TwoWindows<T>([Option<(u64, T)>; 2]);

impl<T> Default for TwoWindows<T> {
    fn default() -> Self {
        TwoWindows([None, None])
    }
}

impl<T> TwoWindows<T> {
    fn get(&self, window: u64) -> Option<&T> {
        self.0
            .iter()
            .flatten()
            .find(|(w, _)| *w == window)
            .map(|(_, t)| t)
    }

    /// Keeps `t` for `window`, in place of what was kept for it or for the older window.
    fn put(&mut self, window: u64, t: T) {
        let slot = match &self.0 {
            [Some((w, _)), _] if *w == window => 0,
            [_, Some((w, _))] if *w == window => 1,
            [None, _] => 0,
            [_, None] => 1,
            [Some((a, _)), Some((b, _))] => usize::from(b < a),
        };
        self.0[slot] = Some((window, t));
    }
}

struct Shares {
    keys: HashMap<Box<[u8]>, u64>,
    /// The share of any key not in `keys`.
    other: u64,
}

/// Stands for the demand of a region not heard from: everything.
const UNKNOWN: u64 = u64::MAX;

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
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Region `own`'s share of `limit` when it asks for `own` units and the other regions
/// for `others` ([`UNKNOWN`] for a region not heard from): max-min fair. Where all asks
/// fit, each region gets its ask; else each gets its ask up to the highest level the
/// limit allows. Either way the remainder is split evenly (rounded down), so that a
/// region whose demand has just arrived finds some room.
///
/// Asking more elsewhere never grows a share, and the shares of all regions, computed
/// from the same asks, add up to at most `limit`: the two facts `SplitStore`'s "never
/// over-admits" rests on (checked exhaustively for small limits in the tests).
fn share(limit: u64, own: u64, others: &[u64]) -> u64 {
    let regions = others.len() as u64 + 1;
    let asked_at = |level: u64| {
        others.iter().fold(own.min(level), |sum, &ask| {
            sum.saturating_add(ask.min(level))
        })
    };
    // The highest level up to `limit` whose asks fit.
    let (mut fits, mut over) = (0, limit + 1);
    while over - fits > 1 {
        let mid = fits + (over - fits) / 2;
        if asked_at(mid) <= limit {
            fits = mid;
        } else {
            over = mid;
        }
    }
    own.min(fits) + (limit - asked_at(fits)) / regions
}

impl Shares {
    fn of(&self, key: &[u8]) -> u64 {
        self.keys.get(key).copied().unwrap_or(self.other)
    }
}

impl Plan {
    /// What the others take this region to ask of `key` in `window`: its post, or
    /// everything when it posted nothing (nobody can have heard less).
    fn asked(&self, window: u64, key: &[u8]) -> u64 {
        match self.reported.get(window) {
            Some(asked) => asked.get(key).copied().unwrap_or(0),
            None => UNKNOWN,
        }
    }
}

impl<S: Store + Board + Clone> SplitStore<S> {
    /// A builder for the region `name`d (as its peers name it), whose own store is
    /// `local` (and its board, where the others post), on `clock` — the clock `local`
    /// decides on (a memory store's, or a Redis store's caller time), so that windows
    /// start at the same instant for both.
    pub fn builder(name: impl Into<String>, local: S, clock: impl Clock) -> SplitStoreBuilder<S> {
        SplitStoreBuilder {
            region: name.into(),
            local,
            clock: Arc::new(clock),
            peers: Vec::new(),
            policies: Vec::new(),
            lead: None,
            timeout: Duration::from_secs(1),
            max_keys: 100_000,
        }
    }

    /// Posts this region's demand for the current window on every peer's board now, and
    /// returns when each has answered or failed (for tests on a manual clock; the store
    /// does it on time, `lead` before each window's end).
    pub async fn report_now(&self) {
        let now = self.inner.clock.now_micros();
        for i in 0..self.inner.splits.len() {
            let window = now / self.inner.splits[i].policy.quota().period_micros();
            self.inner.report(i, window).await;
        }
    }

    /// Reads this region's board now and fixes its shares of the next window (for tests
    /// on a manual clock; the store does it on time, half the lead before each window's
    /// end).
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
        Ok(split.share(key, now, 0, self.inner.max_keys))
    }
}

impl Split {
    /// This region's share of `key` in the window of `now`, counting `cost` units of
    /// demand for it.
    fn share(&self, key: &[u8], now: u64, cost: u32, max_keys: usize) -> u64 {
        let period = self.policy.quota().period_micros();
        let window = now / period;
        let mut plan = self.plan.lock();
        if plan.window != window {
            plan.window = window;
            plan.demand.clear();
        }
        if cost > 0 {
            if let Some(asked) = plan.demand.get_mut(key) {
                *asked += u64::from(cost);
            } else if plan.demand.len() < max_keys {
                plan.demand.insert(key.into(), u64::from(cost));
            }
        }
        match plan.shares.get(window) {
            Some(shares) => shares.of(key),
            // Nothing fixed before the window began: what this region can count on
            // whatever the others ask.
            _ => {
                let others = vec![UNKNOWN; self.peers];
                let own = plan.asked(window.wrapping_sub(1), key);
                share(self.policy.quota().limit(), own, &others)
            }
        }
    }
}

/// The topic of a policy's window on the boards.
fn topic(policy: &Policy, window: u64) -> String {
    format!("split:{:016x}:{window}", policy.id())
}

/// `asked` in `elapsed` of a window of `period`, as a whole window's worth (rounded up).
fn whole_window(asked: u64, period: u64, elapsed: u64) -> u64 {
    let scaled = (u128::from(asked) * u128::from(period)).div_ceil(u128::from(elapsed.max(1)));
    u64::try_from(scaled).unwrap_or(u64::MAX)
}

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

    /// Posts this region's demand of `window` under split `i` on every peer's board,
    /// once a window and only within it. The post is never repeated: a peer sees it
    /// whole or not at all, and never two versions of it.
    async fn report(&self, i: usize, window: u64) {
        let split = &self.splits[i];
        let period = split.policy.quota().period_micros();
        let asked = {
            let mut plan = split.plan.lock();
            let now = self.clock.now_micros();
            if now / period != window || plan.reported.get(window).is_some() {
                return;
            }
            let elapsed = now - window * period;
            let asked: HashMap<Box<[u8]>, u64> = if plan.window == window {
                plan.demand
                    .iter()
                    .map(|(key, &n)| (key.clone(), whole_window(n, period, elapsed)))
                    .collect()
            } else {
                HashMap::new()
            };
            plan.reported.put(window, asked.clone());
            asked
        };
        // The region's own name says it posted (so a key it did not name asked nothing);
        // each key's ask is under the name, a zero byte, and the key.
        let mut notes = Vec::with_capacity(asked.len() + 1);
        notes.push((self.region.as_bytes().to_vec(), 1));
        for (key, n) in asked {
            let mut name = Vec::with_capacity(self.region.len() + 1 + key.len());
            name.extend_from_slice(self.region.as_bytes());
            name.push(0);
            name.extend_from_slice(&key);
            notes.push((name, n));
        }
        let topic = topic(&split.policy, window);
        let keep = Duration::from_micros(period.saturating_mul(3));
        let mut posts = tokio::task::JoinSet::new();
        for (peer, board) in &self.peers {
            let post = board.post(&topic, notes.clone(), keep);
            let (peer, timeout) = (peer.clone(), self.timeout);
            posts.spawn(async move {
                if !matches!(tokio::time::timeout(timeout, post).await, Ok(Ok(()))) {
                    tracing::debug!(%peer, "split store: a demand post to a peer failed");
                }
            });
        }
        while posts.join_next().await.is_some() {}
    }

    /// Reads this region's board for `window` under split `i` and fixes this region's
    /// shares of the next window — only while `window` lasts, so that a window's shares
    /// never change once it has begun.
    async fn collect(&self, i: usize, window: u64) {
        let split = &self.splits[i];
        let period = split.policy.quota().period_micros();
        let read = self.local.read(&topic(&split.policy, window));
        let notes = match tokio::time::timeout(self.timeout, read).await {
            Ok(Ok(notes)) => notes,
            _ => {
                tracing::debug!(region = %self.region, "split store: reading the board failed");
                Vec::new()
            }
        };
        // Each peer that posted, and what it asked of each key; `None`: not heard from.
        let peer = |name: &[u8]| self.peers.iter().position(|p| p.0.as_bytes() == name);
        let mut asks: Vec<Option<HashMap<&[u8], u64>>> = vec![None; self.peers.len()];
        for (name, _) in &notes {
            if let Some(p) = peer(name) {
                asks[p].get_or_insert_with(HashMap::new);
            }
        }
        for (name, n) in &notes {
            let Some(zero) = name.iter().position(|&b| b == 0) else {
                continue;
            };
            if let Some(asked) = peer(&name[..zero]).and_then(|p| asks[p].as_mut()) {
                asked.insert(&name[zero + 1..], *n);
            }
        }
        let own = split.plan.lock().reported.get(window).cloned();
        let limit = split.policy.quota().limit();
        let share_of = |key: Option<&[u8]>| {
            let others: SmallVec<[u64; 4]> = asks
                .iter()
                .map(|asked| match (asked, key) {
                    (None, _) => UNKNOWN,
                    (Some(asked), Some(key)) => asked.get(key).copied().unwrap_or(0),
                    (Some(_), None) => 0,
                })
                .collect();
            let mine = match (&own, key) {
                (None, _) => UNKNOWN,
                (Some(asked), Some(key)) => asked.get(key).copied().unwrap_or(0),
                (Some(_), None) => 0,
            };
            share(limit, mine, &others)
        };
        let mut keys: HashMap<Box<[u8]>, u64> = HashMap::new();
        let named = own
            .iter()
            .flat_map(|asked| asked.keys().map(|k| &k[..]))
            .chain(
                asks.iter()
                    .flatten()
                    .flat_map(|asked| asked.keys().copied()),
            );
        for key in named {
            if !keys.contains_key(key) {
                keys.insert(key.into(), share_of(Some(key)));
            }
        }
        let shares = Shares {
            keys,
            other: share_of(None),
        };
        let mut plan = split.plan.lock();
        if self.clock.now_micros() / period == window {
            plan.shares.put(window + 1, shares);
        }
    }

    /// The policies a request gets in this region: each declared policy at this
    /// region's share of `key`, or `Err` with the refusal when a share is zero.
    fn shares(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u32,
    ) -> Result<SmallVec<[Policy; 2]>, Result<Decisions, StoreError>> {
        let now = self.clock.now_micros();
        let mut derived = SmallVec::new();
        let mut refused = false;
        let mut decisions = Decisions::new();
        for policy in policies {
            let split = self.split_of(policy).map_err(Err)?;
            let share = split.share(key, now, cost, self.max_keys);
            let period = split.policy.quota().period_micros();
            let until_end = period - now % period;
            decisions.push(Decision::limited(share, 0, until_end, until_end));
            refused |= share == 0;
            if !refused {
                let quota = u32::try_from(share)
                    .map_err(|_| ())
                    .and_then(|limit| {
                        Quota::with_period(limit, Duration::from_micros(period)).map_err(|_| ())
                    })
                    .and_then(|quota| {
                        Policy::new(policy.name(), Algorithm::FixedWindow, quota).map_err(|_| ())
                    });
                match quota {
                    Ok(policy) => derived.push(policy),
                    Err(()) => {
                        return Err(Err(StoreError::new(
                            StoreErrorKind::Other,
                            format!("split store: no quota of {share} for {:?}", policy.name()),
                        )));
                    }
                }
            }
        }
        if refused {
            // Nothing to ask the store: this region has none of a limit this window. The
            // other limits say remaining 0 too (a little low, never high).
            return Err(Ok(decisions));
        }
        Ok(derived)
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

impl<S: Store + Board + Clone> Store for SplitStore<S> {
    type Future = S::Future;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Checked<Self::Future> {
        match self.inner.shares(key, policies, cost) {
            Ok(derived) => {
                let derived: SmallVec<[&Policy; 2]> = derived.iter().collect();
                self.inner
                    .local
                    .check(&self.inner.local_key(key), &derived, cost)
            }
            Err(answer) => Checked::Ready(answer),
        }
    }

    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        match self.inner.shares(key, policies, 0) {
            Ok(derived) => {
                let derived: SmallVec<[&Policy; 2]> = derived.iter().collect();
                self.inner
                    .local
                    .operate(&self.inner.local_key(key), &derived, operation)
            }
            Err(answer) => Checked::Ready(answer),
        }
    }
}

/// Builds a [`SplitStore`].
#[must_use]
pub struct SplitStoreBuilder<S> {
    region: String,
    local: S,
    clock: Arc<dyn Clock>,
    peers: Vec<(String, S)>,
    policies: Vec<Policy>,
    lead: Option<Duration>,
    timeout: Duration,
    max_keys: usize,
}

impl<S> fmt::Debug for SplitStoreBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peers: Vec<&str> = self.peers.iter().map(|p| p.0.as_str()).collect();
        f.debug_struct("SplitStoreBuilder")
            .field("region", &self.region)
            .field("peers", &peers)
            .field("policies", &self.policies)
            .field("lead", &self.lead)
            .field("timeout", &self.timeout)
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}

impl<S: Store + Board + Clone> SplitStoreBuilder<S> {
    /// Another region, `name`d as it names itself, and its store (its board) as this
    /// region reaches it. A peer named otherwise is never heard from, and this region
    /// then counts it as asking for everything (safe, but this region's shares shrink).
    pub fn peer(mut self, name: impl Into<String>, store: S) -> Self {
        self.peers.push((name.into(), store));
        self
    }

    /// A policy whose limit the regions split: a fixed window. Every policy a request
    /// names must be declared.
    pub fn policy(mut self, policy: &Policy) -> Self {
        self.policies.push(policy.clone());
        self
    }

    /// How long before each window's end this region posts its demand (default: a
    /// quarter of the policy's period); it reads the others' half of that later. Must
    /// leave the posts time to cross between regions.
    pub fn lead(mut self, lead: Duration) -> Self {
        self.lead = Some(lead);
        self
    }

    /// How long a post to a peer, or a read of this region's board, may take (default
    /// 1 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many keys a window's demand is counted for (default 100,000); further new
    /// keys are taken to ask nothing, so their shares come from the others' asks.
    pub fn max_keys(mut self, keys: usize) -> Self {
        self.max_keys = keys;
        self
    }

    /// Builds the store and starts its exchange, a task a policy, on the current tokio
    /// runtime.
    ///
    /// # Errors
    ///
    /// Without a peer or a policy; with a policy that is not a fixed window, or declared
    /// twice; with a region or peer name that is empty, has a zero byte, or repeats;
    /// with a lead of zero or not under half a policy's period; with a timeout or
    /// `max_keys` of zero; outside a tokio runtime.
    pub fn build(self) -> Result<SplitStore<S>, ConfigError> {
        if self.peers.is_empty() || self.policies.is_empty() {
            return Err(ConfigError::new(
                "a split store needs a peer and a policy: add the other regions with \
                 .peer(name, store) and the limits they split with .policy(&policy)",
            ));
        }
        let mut names: Vec<&str> = self.peers.iter().map(|p| p.0.as_str()).collect();
        names.push(&self.region);
        if let Some(bad) = names.iter().find(|n| n.is_empty() || n.contains('\0')) {
            return Err(ConfigError::new(format!(
                "split store region names must be non-empty, without a zero byte; got {bad:?}"
            )));
        }
        names.sort_unstable();
        if let Some(twice) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(ConfigError::new(format!(
                "split store region {:?} is named twice: each region (this one and every \
                 peer) needs a name of its own",
                twice[0]
            )));
        }
        let mut splits = Vec::with_capacity(self.policies.len());
        for policy in &self.policies {
            if policy.algorithm() != Algorithm::FixedWindow {
                return Err(ConfigError::new(format!(
                    "policy {:?} is a {}: a split store splits fixed windows only (a share \
                     changes when a window starts afresh; a bucket or a log would carry a \
                     share over that no longer holds); use a fixed window, or a \
                     ReplicatedStore",
                    policy.name(),
                    policy.algorithm().name()
                )));
            }
            if splits.iter().any(|s: &Split| s.policy.id() == policy.id()) {
                return Err(ConfigError::new(format!(
                    "policy {:?} is declared twice to the split store",
                    policy.name()
                )));
            }
            let period = policy.quota().period_micros();
            let lead = self.lead.map_or(period / 4, |lead| {
                u64::try_from(lead.as_micros()).unwrap_or(u64::MAX)
            });
            if lead == 0 || lead.saturating_mul(2) > period {
                return Err(ConfigError::new(format!(
                    "split store lead must be above zero and at most half of policy {:?}'s \
                     period ({:?}); got {lead} µs",
                    policy.name(),
                    policy.quota().period()
                )));
            }
            splits.push(Split {
                policy: policy.clone(),
                lead,
                peers: self.peers.len(),
                plan: Mutex::new(Plan::default()),
            });
        }
        if self.timeout.is_zero() || self.max_keys == 0 {
            return Err(ConfigError::new(format!(
                "a split store's timeout and max_keys must be above zero; got {:?} and {}",
                self.timeout, self.max_keys
            )));
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            ConfigError::new("build a split store inside a tokio runtime: its exchange runs on it")
        })?;
        let inner = Arc::new_cyclic(|weak: &Weak<Inner<S>>| {
            let tasks = (0..splits.len())
                .map(|i| runtime.spawn(exchange_forever(Weak::clone(weak), i)))
                .collect();
            Inner {
                region: self.region,
                local: self.local,
                peers: self.peers,
                clock: self.clock,
                timeout: self.timeout,
                max_keys: self.max_keys,
                splits,
                tasks,
            }
        });
        Ok(SplitStore { inner })
    }
}

/// Split `i`'s exchange: in every window, its report `lead` before the end and its
/// collection half the lead later, while the store lives. Times are the store's clock's,
/// waited out on tokio's timer.
async fn exchange_forever<S: Store + Board + Clone>(store: Weak<Inner<S>>, i: usize) {
    let wait = |micros: u64| tokio::time::sleep(Duration::from_micros(micros));
    loop {
        let Some((now, period, lead)) = store.upgrade().map(|inner| {
            let split = &inner.splits[i];
            let period = split.policy.quota().period_micros();
            (inner.clock.now_micros(), period, split.lead)
        }) else {
            return;
        };
        let window = now / period;
        let end = (window + 1) * period;
        if now < end - lead {
            wait(end - lead - now).await;
            let Some(inner) = store.upgrade() else { return };
            inner.report(i, window).await;
            let now = inner.clock.now_micros();
            drop(inner);
            wait((end - lead / 2).saturating_sub(now)).await;
            let Some(inner) = store.upgrade() else { return };
            inner.collect(i, window).await;
        }
        let Some(now) = store.upgrade().map(|inner| inner.clock.now_micros()) else {
            return;
        };
        // On to the next window (at least a microsecond on: a clock that does not move
        // with tokio's timer must not make this spin).
        wait(end.saturating_sub(now).max(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two facts "never over-admits" rests on, for every ask of three regions up to
    /// one past the limit (an ask above the limit is the same as one at it) and
    /// [`UNKNOWN`]: the shares add up to at most the limit, and a region's share never
    /// grows when another asks more.
    #[test]
    fn shares_add_up_to_at_most_the_limit_and_shrink_when_others_ask_more() {
        for limit in 0..=13u64 {
            let asks: Vec<u64> = (0..=limit + 1).chain([UNKNOWN]).collect();
            for &a in &asks {
                for &b in &asks {
                    for &c in &asks {
                        let total = share(limit, a, &[b, c])
                            + share(limit, b, &[a, c])
                            + share(limit, c, &[a, b]);
                        assert!(total <= limit, "{limit}: {a} {b} {c} → {total}");
                        for &more in asks.iter().filter(|&&m| m >= b) {
                            assert!(
                                share(limit, a, &[more, c]) <= share(limit, a, &[b, c]),
                                "{limit}: {a} with {b}→{more}, {c}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn shares_follow_demand() {
        // All asks fit: each gets its ask and a third of what is left.
        assert_eq!(share(100, 10, &[20, 30]), 10 + 13);
        // Not all fit: the level is 45 (10 + 45 + 45 = 100): a region asking less gets
        // its ask, one asking more the level.
        assert_eq!(share(100, 10, &[600, 600]), 10);
        assert_eq!(share(100, 600, &[10, 600]), 45);
        // Alone, a region gets it all; not having heard from anyone, a third.
        assert_eq!(share(100, 600, &[0, 0]), 100);
        assert_eq!(share(100, 600, &[UNKNOWN, UNKNOWN]), 33);
        assert_eq!(share(100, 0, &[UNKNOWN, UNKNOWN]), 0);
        assert_eq!(share(100, UNKNOWN, &[UNKNOWN, UNKNOWN]), 33);
    }

    #[test]
    fn bad_settings_fail_when_the_store_is_built() {
        use crate::MemoryStore;
        let window =
            Policy::new("w", Algorithm::FixedWindow, Quota::per_minute(90).unwrap()).unwrap();
        let bucket =
            Policy::new("b", Algorithm::TokenBucket, Quota::per_minute(90).unwrap()).unwrap();
        let store = MemoryStore::new();
        let region = || {
            SplitStore::builder("eu", store.clone(), crate::ManualClock::new())
                .peer("us", store.clone())
        };
        let refused =
            |builder: SplitStoreBuilder<MemoryStore>| builder.build().unwrap_err().to_string();
        assert!(refused(region().policy(&bucket)).contains("fixed windows only"));
        assert!(refused(region()).contains("needs a peer and a policy"));
        assert!(
            refused(region().peer("eu", store.clone()).policy(&window)).contains("named twice")
        );
        assert!(refused(region().peer("", store.clone()).policy(&window)).contains("non-empty"));
        assert!(refused(region().policy(&window).policy(&window)).contains("declared twice"));
        let long = region().policy(&window).lead(Duration::from_secs(31));
        assert!(refused(long).contains("at most half"));
        assert!(refused(region().policy(&window)).contains("inside a tokio runtime"));
    }

    #[test]
    fn two_windows_keep_the_newest_two() {
        let mut kept = TwoWindows::default();
        kept.put(4, 'a');
        kept.put(5, 'b');
        assert_eq!((kept.get(4), kept.get(5)), (Some(&'a'), Some(&'b')));
        kept.put(6, 'c');
        assert_eq!(
            (kept.get(4), kept.get(5), kept.get(6)),
            (None, Some(&'b'), Some(&'c'))
        );
        kept.put(6, 'd');
        assert_eq!((kept.get(5), kept.get(6)), (Some(&'b'), Some(&'d')));
    }
}
