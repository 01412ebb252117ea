//! One limit across regions, each holding a share of it: see [`SplitStore`].

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

use super::replicated::{Failing, one_region_only};
use crate::store::{Checked, Operation, Store};
use crate::policy::fnv1a;
use crate::{
    Algorithm, Clock, ConfigError, Decision, Decisions, Policy, Quota, StoreError, StoreErrorKind,
};

/// The future of a [`Board`] call.
pub type BoardFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send>>;

/// A region's notice board: where the regions post what they ask of a limit, for each
/// region's [`SplitStore`] to read.
///
/// A post adds its notes to a topic (a note of the same name is replaced) all at once: a
/// reader sees every note of a post or none of them. Implemented by
/// [`MemoryStore`](crate::MemoryStore) (notes kept beside its limits, for one process)
/// and by the Redis store (a hash a topic, written in one transaction with its expiry,
/// read with one `HGETALL`).
pub trait Board: Send + Sync + 'static {
    /// Adds `notes` (name, value) to `topic`, all at once; the topic is kept for `keep`
    /// after its last post.
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
/// ask of each key (admitted or not; [`Operation`]s are not demand), and a *lead* before
/// the window's end (a quarter of the window by default) posts that demand — scaled to a
/// whole window — on its own [`Board`] and then on every other region's, all keys in one
/// post. Half the lead later it reads its own board and fixes, for the next window, its
/// share of each key's limit from everyone's demand: max-min fair (where all asks fit,
/// each region gets its ask and an even part of what is left; else each gets its ask up
/// to the highest level the limit allows). A region computes only its own share; the
/// shares of all regions, computed from the same asks, add up to at most the limit.
///
/// **Never over-admits.** A region that has not heard from another — its post was lost,
/// late, cut off, or made with another list of regions — counts that region as asking
/// for everything; a region that posted nothing for a window counts itself so too.
/// Asking more elsewhere can only shrink a region's share, so each region's share is at
/// most what it would be had everyone heard everything, and those add up to at most the
/// limit: in every window, the regions together admit at most the limit, whatever is
/// lost, late or cut off. A window's shares are fixed before it begins, and a window is
/// counted under its own name whatever the share, so a process that takes over a
/// region's name mid-window — reading first what its predecessor posted, from the
/// region's board — counts on from where its predecessor stopped. The conditions:
/// - the regions' clocks agree on the windows (`SystemClock`, kept by NTP: regions apart
///   by ε shift their windows by ε), and the local store's clock is within a period of
///   the store's (Redis `TIME` will do);
/// - every region lists the same regions. A post made with another list is logged and
///   counted as asking everything, but while a change of the list rolls out, regions
///   that list different sets can each take the share their own list gives them —
///   together more than the limit;
/// - one process at a time under a name, with a local store and board that outlive it
///   and keep what they acknowledged (Redis; a memory store forgets its counts with the
///   process anyway);
/// - the local store counts every admission: a Redis store's local fallback (which
///   admits on its own while Redis is down) or a memory store that admits untracked keys
///   when full would admit past the share.
///
/// **What it costs: under-admission.** Shares follow demand a window late: a region
/// whose callers arrive gets its share from the window after the one in which its
/// demand was posted (the next window when they arrive before that window's post, else
/// the one after); meanwhile it has what the others left. A region's posts — its own
/// board's write, then the way to the others — must be done within half the lead, or
/// the others count it as asking everything. A region cut
/// off from the others (and they, not hearing from it) decides on the level it can count
/// on whatever the others ask: about `limit / regions` of a key it asked for, nothing of
/// a key it did not ask for (until the link returns and a window's posts go through). A
/// fleet starting afresh takes `limit / regions` of every key in its first window.
///
/// Only fixed windows split: a window ends everywhere at once, so a share changes only
/// where the count starts afresh anyway (a bucket's tokens or a log's entries would carry
/// a share over that no longer holds). Every policy a request names must be declared to
/// the builder; other algorithms are refused when the store is built.
///
/// Decisions report this region's share as their limit, and reset and retry times that
/// end with the window; a request the share cannot take at all (a share of zero) is
/// refused without asking the store, and the request's other limits then report
/// remaining 0. [`Store::operate`] acts on this region's share of the current window.
/// The local store keeps each window's counts a few periods after it ends (see the
/// builder's `max_keys`). With several gateways in a region, each is a region of its own
/// here (a name and a share of its own; its peers are every other gateway).
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

#[derive(Default)]
struct Plan {
    /// The window `demand` counts (its start over the period).
    window: u64,
    /// Units asked of each key in `window`.
    demand: HashMap<Box<[u8]>, u64>,
    /// What this region posted for a window (once a window): what the others take it to
    /// ask.
    reported: TwoWindows<Posted>,
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

/// What a region posted for a window, as far as this process knows.
enum Posted {
    /// These asks (a key not named asked nothing): the others read them or nothing.
    Asks(HashMap<Box<[u8]>, u64>),
    /// Nothing, and nothing will be: the others count it as asking everything.
    Nothing,
    /// Unknown: an earlier process under this name may have posted anything (its board
    /// could not be read at start), so count this region as asking nothing.
    Unsure,
}

impl Posted {
    /// What the others take this region to ask of `key` (`None`: a key it did not name).
    fn ask(&self, key: Option<&[u8]>) -> u64 {
        match (self, key) {
            (Posted::Asks(asks), Some(key)) => asks.get(key).copied().unwrap_or(0),
            (Posted::Asks(_) | Posted::Unsure, _) => 0,
            (Posted::Nothing, _) => UNKNOWN,
        }
    }
}

/// A region's post, as read from a board.
struct Post {
    /// The fingerprint of the regions it splits with.
    fingerprint: u64,
    asks: HashMap<Box<[u8]>, u64>,
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
        for task in self.tasks.get_mut().iter() {
            task.abort();
        }
    }
}

/// A region's share of `limit` when it asks for `own` units and the other regions for
/// `others` ([`UNKNOWN`] for a region not heard from): max-min fair. Where all asks fit,
/// each region gets its ask and an even part (rounded down) of what is left, so that a
/// region whose demand has just arrived finds some room; else each gets its ask up to
/// the highest level the limit allows (what is left then is less than a unit a region).
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
    /// everything when it posted nothing (nobody can have heard less). A window this
    /// process has no record of is one it did not post for: the store read what an
    /// earlier process had posted for the windows before it started.
    fn asked(&self, window: u64, key: &[u8]) -> u64 {
        self.reported
            .get(window)
            .map_or(UNKNOWN, |posted| posted.ask(Some(key)))
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

    /// Posts this region's demand for the current window now (if it has not yet), and
    /// returns when each peer has answered or failed: for tests on a manual clock; the
    /// store does it on time, `lead` before each window's end.
    pub async fn report_now(&self) {
        let now = self.inner.clock.now_micros();
        for i in 0..self.inner.splits.len() {
            let window = now / self.inner.splits[i].policy.quota().period_micros();
            let mut posts = self.inner.report(i, window).await;
            while posts.join_next().await.is_some() {}
        }
    }

    /// Reads this region's board now and fixes its shares of the next window (a window
    /// this region has not posted for yet is then closed: it posts nothing for it): for
    /// tests on a manual clock; the store does it on time, half the lead before each
    /// window's end.
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

impl<S> Inner<S> {
    /// This region's share of `key` under `split` in the window of `now`, counting
    /// `cost` units of demand for it.
    fn share(&self, split: &Split, key: &[u8], now: u64, cost: u32) -> u64 {
        let period = split.policy.quota().period_micros();
        let window = now / period;
        let mut plan = split.plan.lock();
        if plan.window != window {
            plan.window = window;
            plan.demand.clear();
        }
        if cost > 0 {
            if let Some(asked) = plan.demand.get_mut(key) {
                *asked += u64::from(cost);
            } else if plan.demand.len() < self.max_keys {
                plan.demand.insert(key.into(), u64::from(cost));
            }
        }
        match plan.shares.get(window) {
            Some(shares) => shares.of(key),
            // Nothing fixed before the window began: what this region can count on
            // whatever the others ask.
            _ => {
                let others: SmallVec<[u64; 4]> = smallvec::smallvec![UNKNOWN; self.peers.len()];
                let own = plan.asked(window.wrapping_sub(1), key);
                share(split.policy.quota().limit(), own, &others)
            }
        }
    }
}

/// How many periods long the fixed window is that a region's count of `window` is kept
/// in (under a policy named for the window): the smallest `m` from 3 with neither
/// `window` nor `window + 1` a multiple of it, so that no `m`-period window starts
/// between one period before `window` and one after it. The count is then the same one
/// whichever instant of that span the local store reads from its own clock: a request
/// the split store placed just before a window's end, decided by the store just after,
/// is counted with its window, and a local store whose clock (Redis's `TIME`, say) is
/// apart from the split store's by less than a period counts each window whole.
fn span(window: u64) -> u64 {
    (3..=MAX_SPAN)
        .find(|&m| (window == 0 || !window.is_multiple_of(m)) && !(window + 1).is_multiple_of(m))
        .unwrap_or(MAX_SPAN)
}

/// The longest span: 64 periods. Every `m` up to it dividing `window` or `window + 1`
/// needs `window × (window + 1)` to be a multiple of lcm(1..64), about 2^90, so a window
/// number past 2^44: a window of a millisecond reaches that 557 years after its clock's
/// origin. (Below 2 million, no span passes 19.)
const MAX_SPAN: u64 = 64;

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

    /// Posts this region's demand of `window` under split `i`, once a window and only
    /// within it: first on its own board (where a later process under its name reads
    /// it), then — only once that is written — on every peer's. The post is never
    /// repeated: a peer sees it whole or not at all, and never two versions of it. The
    /// peers' posts are under way when this returns (the collection does not wait for
    /// their answers, which take a round trip): the set ends when each has been answered
    /// or has failed.
    async fn report(&self, i: usize, window: u64) -> tokio::task::JoinSet<()> {
        let mut posts = tokio::task::JoinSet::new();
        let split = &self.splits[i];
        let period = split.policy.quota().period_micros();
        let asked = {
            let mut plan = split.plan.lock();
            let now = self.clock.now_micros();
            if now / period != window || plan.reported.get(window).is_some() {
                return posts;
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
            // Claimed before it is posted, and kept whatever becomes of the posts: a
            // peer reads these asks or counts this region as asking everything.
            plan.reported.put(window, Posted::Asks(asked.clone()));
            asked
        };
        // The region's own name, with the fingerprint of the regions it splits with,
        // says it posted (so a key it did not name asked nothing); each key's ask is
        // under the name, a zero byte, and the key.
        let mut notes = Vec::with_capacity(asked.len() + 1);
        notes.push((self.region.as_bytes().to_vec(), self.fingerprint));
        for (key, n) in asked {
            let mut name = Vec::with_capacity(self.region.len() + 1 + key.len());
            name.extend_from_slice(self.region.as_bytes());
            name.push(0);
            name.extend_from_slice(&key);
            notes.push((name, n));
        }
        let topic = topic(&split.policy, window);
        let keep = Duration::from_micros(period.saturating_mul(3));
        let own = self.local.post(&topic, notes.clone(), keep);
        if !matches!(tokio::time::timeout(self.timeout, own).await, Ok(Ok(()))) {
            let region = &self.region;
            tell(&self.board_failing, false, || {
                format!("region {region}'s own board")
            });
            return posts;
        }
        for ((peer, board), failing) in self.peers.iter().zip(&self.peers_failing) {
            let post = board.post(&topic, notes.clone(), keep);
            let (peer, timeout, failing) = (peer.clone(), self.timeout, Arc::clone(failing));
            posts.spawn(async move {
                let posted = matches!(tokio::time::timeout(timeout, post).await, Ok(Ok(())));
                tell(&failing, posted, || format!("peer {peer}'s board"));
            });
        }
        posts
    }

    /// The posts on this region's board for `window` under split `i`, by region: the
    /// fingerprint of the region set each poster splits with, and its asks; `Err` when
    /// the board could not be read.
    async fn read_board(&self, i: usize, window: u64) -> Result<HashMap<Vec<u8>, Post>, ()> {
        let read = self.local.read(&topic(&self.splits[i].policy, window));
        let Ok(Ok(notes)) = tokio::time::timeout(self.timeout, read).await else {
            let region = &self.region;
            tell(&self.board_failing, false, || {
                format!("region {region}'s own board")
            });
            return Err(());
        };
        tell(&self.board_failing, true, String::new);
        let mut posted: HashMap<Vec<u8>, Post> = HashMap::new();
        for (name, n) in &notes {
            if !name.contains(&0) {
                posted.insert(
                    name.clone(),
                    Post {
                        fingerprint: *n,
                        asks: HashMap::new(),
                    },
                );
            }
        }
        for (name, n) in notes {
            let Some(zero) = name.iter().position(|&b| b == 0) else {
                continue;
            };
            if let Some(post) = posted.get_mut(&name[..zero]) {
                post.asks.insert(name[zero + 1..].into(), n);
            }
        }
        Ok(posted)
    }

    /// Reads this region's board for `window` under split `i` and fixes this region's
    /// shares of the next window — only while `window` lasts, so that a window's shares
    /// never change once it has begun. A window this region has not posted for by then
    /// is closed: it will post nothing for it.
    async fn collect(&self, i: usize, window: u64) {
        let split = &self.splits[i];
        let period = split.policy.quota().period_micros();
        let mut posted = self.read_board(i, window).await.unwrap_or_default();
        // Each peer's asks; `None`: not heard from, or splitting with other regions.
        let asks: Vec<Option<HashMap<Box<[u8]>, u64>>> = self
            .peers
            .iter()
            .map(|(name, _)| {
                let post = posted.remove(name.as_bytes())?;
                if post.fingerprint != self.fingerprint {
                    tracing::warn!(
                        region = %self.region,
                        peer = %name,
                        "split store: a peer splits with other regions than this one does; \
                         counting it as asking for everything"
                    );
                    return None;
                }
                Some(post.asks)
            })
            .collect();
        let own = {
            let mut plan = split.plan.lock();
            if plan.reported.get(window).is_none() {
                plan.reported.put(window, Posted::Nothing);
            }
            match plan.reported.get(window) {
                Some(Posted::Asks(asks)) => Posted::Asks(asks.clone()),
                Some(Posted::Unsure) => Posted::Unsure,
                _ => Posted::Nothing,
            }
        };
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
            share(limit, own.ask(key), &others)
        };
        let mut keys: HashMap<Box<[u8]>, u64> = HashMap::new();
        let own_keys = match &own {
            Posted::Asks(asks) => Some(asks.keys()),
            _ => None,
        };
        let named = own_keys
            .into_iter()
            .flatten()
            .chain(asks.iter().flatten().flat_map(HashMap::keys));
        for key in named {
            if !keys.contains_key(key) {
                keys.insert(key.clone(), share_of(Some(key)));
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

    /// What an earlier process under this region's name posted for the window before
    /// `now`'s and for `now`'s, from this region's board (where a post goes before any
    /// peer's): so that this one neither posts a second version nor counts a post the
    /// others read as none.
    async fn recover(&self, i: usize) {
        let period = self.splits[i].policy.quota().period_micros();
        let window = self.clock.now_micros() / period;
        for w in [window.saturating_sub(1), window] {
            let posted = match self.read_board(i, w).await {
                // Whatever region set it was posted with: the others may have read it.
                Ok(mut posted) => match posted.remove(self.region.as_bytes()) {
                    Some(post) => Posted::Asks(post.asks),
                    // Nothing posted: this process may post for the window.
                    None => continue,
                },
                Err(()) => Posted::Unsure,
            };
            self.splits[i].plan.lock().reported.put(w, posted);
        }
    }

    /// The policies a request gets in this region — each declared policy at this
    /// region's share of `key` — and how long each one's window lasts; or `Err` with the
    /// refusal when a share is zero.
    fn shares(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u32,
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
                        .id()
                        .to_le_bytes()
                        .into_iter()
                        .chain(window.to_le_bytes())
                        .chain(span.to_le_bytes()),
                );
                let counted = Quota::counting(share, period * span)
                    .and_then(|quota| {
                        let name = format!("s{window:x}-{:x}", policy.id());
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

/// Logs a board's answer: at warn when it starts failing and when it answers again,
/// at debug for each failure in between. `board` names it.
fn tell(failing: &Failing, ok: bool, board: impl FnOnce() -> String) {
    if ok {
        if failing.answered() {
            tracing::warn!(board = %board(), "split store: the board answers again");
        }
    } else if failing.failed() {
        tracing::warn!(
            board = %board(),
            "split store: the board failed; this region decides on what it knows until it answers"
        );
    } else {
        tracing::debug!(board = %board(), "split store: the board failed again");
    }
}

/// Microseconds to the end of each of a request's windows.
type Ends = SmallVec<[u64; 2]>;

/// The policies a request's windows are counted under in the local store.
type Counted = SmallVec<[Policy; 2]>;

impl<S: Store + Board + Clone> Store for SplitStore<S> {
    type Future = SplitFuture<S::Future>;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Checked<Self::Future> {
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
        cost: u32,
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
    /// quarter of the policy's period; at most half of it); it reads the others' half
    /// the lead later, so half the lead must cover a post: the write on this region's
    /// board, then the way to the others'.
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
    /// keys are taken to ask nothing, so their shares come from the others' asks. (The
    /// local store's own bound wants room for about three windows of keys: a window's
    /// counts are kept until a span of 3 or more periods around it ends, rarely more
    /// than 5.)
    pub fn max_keys(mut self, keys: usize) -> Self {
        self.max_keys = keys;
        self
    }

    /// Builds the store: reads what an earlier process under this region's name posted
    /// (from this region's board; if it cannot be read, this region counts itself as
    /// asking nothing for this window and the next), then starts the exchange, a task a
    /// policy, on the current tokio runtime.
    ///
    /// # Errors
    ///
    /// Without a peer or a policy; with a policy that is not a fixed window, declared
    /// twice, or whose period times 64 passes 2^50 µs; with a region or peer name that
    /// is empty, has a zero byte, or repeats; with a lead of zero or over half a
    /// policy's period; with a timeout or `max_keys` of zero; outside a tokio runtime.
    pub async fn build(self) -> Result<SplitStore<S>, ConfigError> {
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
            if Quota::counting(policy.quota().limit(), period.saturating_mul(MAX_SPAN)).is_none() {
                return Err(ConfigError::new(format!(
                    "policy {:?}: a split store counts each window under a fixed window up to \
                     {MAX_SPAN} periods long, which must stay within 2^50 µs; use a period of \
                     at most {:?}",
                    policy.name(),
                    Duration::from_micros((1 << 50) / MAX_SPAN)
                )));
            }
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
        let mut names: Vec<&str> = self.peers.iter().map(|p| p.0.as_str()).collect();
        names.push(&self.region);
        names.sort_unstable();
        let fingerprint = fnv1a(names.iter().flat_map(|n| n.bytes().chain([0])));
        let inner = Arc::new(Inner {
            region: self.region,
            fingerprint,
            local: self.local,
            peers_failing: self.peers.iter().map(|_| Arc::default()).collect(),
            board_failing: Failing::default(),
            peers: self.peers,
            clock: self.clock,
            timeout: self.timeout,
            max_keys: self.max_keys,
            splits,
            tasks: Mutex::new(Vec::new()),
        });
        for i in 0..inner.splits.len() {
            inner.recover(i).await;
        }
        let tasks = (0..inner.splits.len())
            .map(|i| runtime.spawn(exchange_forever(Arc::downgrade(&inner), i)))
            .collect();
        *inner.tasks.lock() = tasks;
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
            inner.report(i, window).await.detach_all();
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
    use crate::{ManualClock, MemoryStore};

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
        use std::task::{Context, Poll, Waker};
        let window =
            Policy::new("w", Algorithm::FixedWindow, Quota::per_minute(90).unwrap()).unwrap();
        let bucket =
            Policy::new("b", Algorithm::TokenBucket, Quota::per_minute(90).unwrap()).unwrap();
        let store = MemoryStore::new();
        let region = || {
            SplitStore::builder("eu", store.clone(), ManualClock::new()).peer("us", store.clone())
        };
        // Every refusal comes before the build waits on anything: one poll answers it.
        let refused = |builder: SplitStoreBuilder<MemoryStore>| {
            let build = std::pin::pin!(builder.build());
            match build.poll(&mut Context::from_waker(Waker::noop())) {
                Poll::Ready(Err(e)) => e.to_string(),
                _ => panic!("built"),
            }
        };
        assert!(refused(region().policy(&bucket)).contains("fixed windows only"));
        assert!(refused(region()).contains("needs a peer and a policy"));
        let twice = region().peer("eu", store.clone()).policy(&window);
        assert!(refused(twice).contains("named twice"));
        assert!(refused(region().peer("", store.clone()).policy(&window)).contains("non-empty"));
        assert!(refused(region().policy(&window).policy(&window)).contains("declared twice"));
        let long = region().policy(&window).lead(Duration::from_secs(31));
        assert!(refused(long).contains("at most half"));
        let years = Policy::new(
            "y",
            Algorithm::FixedWindow,
            Quota::with_period(1, Duration::from_secs(3 * 365 * 86_400)).unwrap(),
        )
        .unwrap();
        assert!(refused(region().policy(&years)).contains("use a period of at most"));
        assert!(refused(region().policy(&window)).contains("inside a tokio runtime"));
    }

    /// A memory store whose posts to it can be lost, and whose board can be unreadable.
    #[derive(Clone)]
    struct Lossy {
        store: MemoryStore<ManualClock>,
        lost: Arc<std::sync::atomic::AtomicBool>,
        unreadable: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Store for Lossy {
        type Future = <MemoryStore<ManualClock> as Store>::Future;
        fn check(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Checked<Self::Future> {
            self.store.check(key, policies, cost)
        }
        fn operate(
            &self,
            key: &[u8],
            policies: &[&Policy],
            op: Operation,
        ) -> Checked<Self::Future> {
            self.store.operate(key, policies, op)
        }
    }

    impl Board for Lossy {
        fn post(&self, topic: &str, notes: Vec<(Vec<u8>, u64)>, keep: Duration) -> BoardFuture<()> {
            if self.lost.load(std::sync::atomic::Ordering::Relaxed) {
                let lost = StoreError::new(StoreErrorKind::Connection, "lost");
                return Box::pin(std::future::ready(Err(lost)));
            }
            self.store.post(topic, notes, keep)
        }
        fn read(&self, topic: &str) -> BoardFuture<Vec<(Vec<u8>, u64)>> {
            if self.unreadable.load(std::sync::atomic::Ordering::Relaxed) {
                let down = StoreError::new(StoreErrorKind::Connection, "down");
                return Box::pin(std::future::ready(Err(down)));
            }
            self.store.read(topic)
        }
    }

    /// Three regions at 10 a minute; region `r` reaches region `p`'s board through
    /// `links[r][p]` (its own through `links[r][r]`, never lost).
    struct Fleet {
        clock: ManualClock,
        policy: Policy,
        regions: Vec<SplitStore<Lossy>>,
        links: Vec<Vec<Lossy>>,
    }

    impl Fleet {
        async fn new() -> Self {
            let clock = ManualClock::new();
            let policy =
                Policy::new("k", Algorithm::FixedWindow, Quota::per_minute(10).unwrap()).unwrap();
            let stores: Vec<_> = (0..3)
                .map(|_| MemoryStore::builder().clock(clock.clone()).build().unwrap())
                .collect();
            let links: Vec<Vec<Lossy>> = (0..3)
                .map(|_| {
                    stores
                        .iter()
                        .map(|store| Lossy {
                            store: store.clone(),
                            lost: Arc::default(),
                            unreadable: Arc::default(),
                        })
                        .collect()
                })
                .collect();
            let mut fleet = Fleet {
                clock,
                policy,
                regions: Vec::new(),
                links,
            };
            for r in 0..3 {
                let region = fleet.region(r).await;
                fleet.regions.push(region);
            }
            fleet
        }

        async fn region(&self, r: usize) -> SplitStore<Lossy> {
            let mut builder = SplitStore::builder(
                format!("r{r}"),
                self.links[r][r].clone(),
                self.clock.clone(),
            )
            .policy(&self.policy);
            for p in (0..3).filter(|&p| p != r) {
                builder = builder.peer(format!("r{p}"), self.links[r][p].clone());
            }
            builder.build().await.unwrap()
        }

        /// What the three regions admit of `key` now, each asking until refused.
        async fn admit(&self, key: &[u8]) -> u64 {
            let mut admitted = 0;
            for region in &self.regions {
                while region
                    .check(key, &[&self.policy], 1)
                    .await
                    .unwrap()
                    .is_allowed()
                {
                    admitted += 1;
                }
            }
            admitted
        }
    }

    // Issue 34: a board that failed was logged at debug only, on every try, so an
    // operator never saw it. Now one warning when it starts failing and one when it
    // answers again, naming it; the tries in between stay at debug.
    #[tokio::test]
    async fn a_failing_board_is_logged_when_it_fails_and_when_it_answers_again() {
        let fleet = Fleet::new().await;
        let lines = crate::test_log::Lines::of("board");
        let _logging = tracing::subscriber::set_default(lines.clone());
        let down = |lost: bool| {
            fleet.links[0][1]
                .lost
                .store(lost, std::sync::atomic::Ordering::Relaxed);
        };
        down(true);
        for _ in 0..5 {
            fleet.clock.advance(Duration::from_secs(60));
            let _ = fleet.regions[0].check(b"k", &[&fleet.policy], 1).await;
            fleet.regions[0].report_now().await;
        }
        down(false);
        for _ in 0..3 {
            fleet.clock.advance(Duration::from_secs(60));
            let _ = fleet.regions[0].check(b"k", &[&fleet.policy], 1).await;
            fleet.regions[0].report_now().await;
        }
        let warn = (tracing::Level::WARN, "peer r1's board".to_owned());
        assert_eq!(*lines.seen.lock(), [warn.clone(), warn]);
    }

    /// Every way the nine posts of three regions (each on its own board and the two
    /// others') can be lost, with region 2 reading before or after it posts, and five
    /// patterns of asks (0, 3 and 30 a window from each): in
    /// the next window, the three admit at most the limit of the key they asked for and
    /// of a key nobody asked for.
    #[tokio::test]
    async fn no_loss_of_posts_lets_the_regions_admit_past_the_limit() {
        for lost in 0u32..512 {
            for asks in [[0, 3, 30], [30, 30, 30], [3, 0, 0], [0, 0, 0], [30, 3, 3]] {
                for reads_first in [false, true] {
                    let fleet = Fleet::new().await;
                    let mut link = 0;
                    for r in 0..3 {
                        for p in 0..3 {
                            let down = lost & (1 << link) != 0;
                            fleet.links[r][p]
                                .lost
                                .store(down, std::sync::atomic::Ordering::Relaxed);
                            link += 1;
                        }
                    }
                    fleet.clock.advance(Duration::from_secs(10));
                    for (region, &ask) in fleet.regions.iter().zip(&asks) {
                        for _ in 0..ask {
                            let _ = region.check(b"asked", &[&fleet.policy], 1).await.unwrap();
                        }
                    }
                    fleet.clock.advance(Duration::from_secs(35));
                    if reads_first {
                        fleet.regions[2].collect_now().await;
                    }
                    for region in &fleet.regions {
                        region.report_now().await;
                    }
                    for region in &fleet.regions {
                        region.collect_now().await;
                    }
                    fleet.clock.advance(Duration::from_secs(60));
                    let case = format!("lost {lost:09b}, asks {asks:?}, reads first {reads_first}");
                    let shares: u64 = fleet
                        .regions
                        .iter()
                        .map(|r| r.share_of(b"asked", &fleet.policy).unwrap())
                        .sum();
                    assert!(shares <= 10, "{case}: shares {shares}");
                    if lost == 0 && !reads_first && asks != [0, 0, 0] {
                        // Everyone heard everyone: the limit is shared out (but for
                        // what rounds down).
                        assert!(shares >= 9, "{case}: shares {shares}");
                    }
                    assert!(fleet.admit(b"asked").await <= 10, "{case}");
                    assert!(fleet.admit(b"nobody asked").await <= 10, "{case}");
                }
            }
        }
    }

    /// A region's process replaced after it posted: the new one reads what the old one
    /// posted before deciding, so it does not take the share the others left it on the
    /// assumption that it asked for everything. (Here region 0 asked nothing, the others
    /// 30 each: the others take 5 each, and region 0 — knowing it asked nothing — none.)
    #[tokio::test]
    async fn a_replaced_process_keeps_to_what_its_predecessor_posted() {
        let mut fleet = Fleet::new().await;
        fleet.clock.advance(Duration::from_secs(10));
        for region in &fleet.regions[1..] {
            for _ in 0..30 {
                let _ = region.check(b"asked", &[&fleet.policy], 1).await.unwrap();
            }
        }
        fleet.clock.advance(Duration::from_secs(35));
        for region in &fleet.regions {
            region.report_now().await;
        }
        drop(fleet.regions.remove(0));
        let replaced = fleet.region(0).await;
        fleet.regions.insert(0, replaced);
        for region in &fleet.regions {
            region.collect_now().await;
        }
        fleet.clock.advance(Duration::from_secs(60));
        let shares: Vec<u64> = fleet
            .regions
            .iter()
            .map(|r| r.share_of(b"asked", &fleet.policy).unwrap())
            .collect();
        assert_eq!(shares, [0, 5, 5]);
        assert_eq!(fleet.admit(b"asked").await, 10);
    }

    /// Region 0 asked alone in window 0, so it has the whole limit of window 1 and
    /// spends it; replaced mid-window, the new process (its share now what it can count on
    /// whatever the others ask) counts on from its predecessor's count: nothing more.
    #[tokio::test]
    async fn a_process_replaced_mid_window_counts_on_from_its_predecessor() {
        let mut fleet = Fleet::new().await;
        fleet.clock.advance(Duration::from_secs(10));
        for _ in 0..30 {
            let _ = fleet.regions[0]
                .check(b"asked", &[&fleet.policy], 1)
                .await
                .unwrap();
        }
        fleet.clock.advance(Duration::from_secs(35));
        for region in &fleet.regions {
            region.report_now().await;
        }
        for region in &fleet.regions {
            region.collect_now().await;
        }
        fleet.clock.advance(Duration::from_secs(20));
        assert_eq!(fleet.admit(b"asked").await, 10);
        // Refused until the window ends, 55 s on (its count is kept longer: see `span`).
        let refused = fleet.regions[0]
            .check(b"asked", &[&fleet.policy], 1)
            .await
            .unwrap();
        assert_eq!(refused[0].retry_after(), Some(Duration::from_secs(55)));
        assert_eq!(refused[0].reset_after(), Duration::from_secs(55));
        drop(fleet.regions.remove(0));
        let replaced = fleet.region(0).await;
        assert_eq!(replaced.share_of(b"asked", &fleet.policy).unwrap(), 3);
        fleet.regions.insert(0, replaced);
        assert_eq!(fleet.admit(b"asked").await, 0);
    }

    /// A process whose board cannot be read when it starts does not know what its
    /// predecessor posted: it counts itself as asking nothing (so takes nothing, the
    /// others counting it as asking everything) and posts nothing for that window.
    #[tokio::test]
    async fn a_process_that_cannot_read_its_board_at_start_takes_nothing() {
        let mut fleet = Fleet::new().await;
        fleet.clock.advance(Duration::from_secs(105));
        drop(fleet.regions.remove(0));
        fleet.links[0][0]
            .unreadable
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let replaced = fleet.region(0).await;
        assert_eq!(replaced.share_of(b"asked", &fleet.policy).unwrap(), 0);
        replaced.report_now().await;
        fleet.links[0][0]
            .unreadable
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let topic = topic(&fleet.policy, 1);
        assert!(fleet.links[1][1].read(&topic).await.unwrap().is_empty());
        assert!(fleet.links[0][0].read(&topic).await.unwrap().is_empty());
    }

    /// No `span`-period window starts within a period of a window, either side, for
    /// the first million windows; and none needs more than 19 periods.
    #[test]
    fn a_window_has_a_period_of_slack_on_each_side_of_its_count() {
        for window in 0..1_000_000u64 {
            let m = span(window);
            assert!((3..=19).contains(&m), "{window}: {m}");
            // Starts of m-period windows in ((window - 1), (window + 2)) periods: at
            // window or window + 1 (window 0 starts at the clock's origin, with nothing
            // before it).
            assert!(window == 0 || !window.is_multiple_of(m), "{window}: {m}");
            assert!(!(window + 1).is_multiple_of(m), "{window}: {m}");
        }
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
