//! The in-process store: sharded, bounded, and quick to forget idle keys.
//!
//! Its parts, one a file:
//!
//! | part | holds |
//! |---|---|
//! | this file | [`MemoryStore`], its [`Store`] impl and its lock-free check |
//! | [`table`] | a shard's lock and what it guards, where other requests are decided |
//! | [`cells`] | the lock-free cells, for states of one word |
//! | [`word`] | how a state packs into one word |
//! | [`dispatch`] | the one place the store tells algorithms apart |
//! | [`builder`] | [`MemoryStoreBuilder`] |

use std::fmt;
use std::future::Ready;
use std::hash::BuildHasher;
use std::sync::Arc;

use self::cells::{Cells, Levels};
use self::dispatch::{Instant, Pair, Visit};
use self::table::{Bounds, Costs, Shard};
use self::word::Packs;
use super::{Checked, Operation, Store};

mod builder;
mod cells;
mod dispatch;
mod table;
#[cfg(test)]
mod tests;
mod word;

pub use self::builder::MemoryStoreBuilder;
use crate::algorithm::gcra;
use crate::clock::{Clock, MonotonicClock};
use crate::{Decision, Decisions, Policy, Quota, StoreError};

/// none of them is idle enough to drop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum WhenFull {
    /// Deny the new key's request with [`Denial::StoreFull`](crate::Denial::StoreFull):
    /// callers already tracked keep their limits, new callers wait until old ones go
    /// idle. The default.
    #[default]
    Deny,
    /// Decide the request as if the key were fresh, without remembering it: nobody is
    /// turned away, but such callers are not limited until room frees up.
    AllowUntracked,
}

/// Limiter state in this process's memory.
///
/// Keys are arbitrary bytes. The store is split into shards. Clones share the same
/// state.
///
/// # Cells and the lock
///
/// A state that fits one 64-bit word lives in its shard's *cells*. GCRA's and the leaky
/// bucket shaper's state always fits: it is one instant.
///
/// The token bucket's, the leaky bucket meter's and the fixed window's states pack
/// exactly while their instant is less than 2^(59 − b) µs after the store was made. Here
/// `b` is the bits of the window's limit, or the bits a bucket's partial microsecond
/// needs. A limit that divides its period, as 100 a minute does, needs none. Such a
/// bucket packs for thousands of years. A window of 100 a period packs for 143 years. A
/// window of 100,000 packs for 51 days. The worst case, a window of 2^26, packs for 1.2
/// hours.
///
/// The sliding window counter's state packs for a limit up to 32,767. It packs while its
/// window ends less than 2^(49 − 2l) units after the store was made, `l` being the bits
/// of the limit. A unit is the largest power of two of microseconds up to the period,
/// and at most 2^24 µs (16.8 s). A sweep may take such a key for fresh up to a unit
/// late. This gives 18,000 years for 100 a minute and 8.9 years for 1,000 a second. It
/// gives 407 days for 10,000 a minute and 12.7 days for 10,000 a second. The worst case
/// is 2.4 hours.
///
/// A check under one such limit, for a key the store already holds, takes no lock. It
/// reads the key's cell and updates it by compare-and-swap. It writes no memory but the
/// state's own. So threads deciding for different keys do not queue behind one another,
/// nor behind a sweep.
///
/// Everything else is decided under the shard's lock. This covers the sliding window
/// log, a state past its packing's range and a counter of a larger limit. It also covers
/// a request under several limits, and a key's arrival and removal. A state past its range, or a
/// counter of a larger limit, moves to the shard's table exactly as it was. The lock path
/// still reads and swaps the cells' states. So both paths decide one key's requests as
/// if one at a time. The lock-free transitions are model-checked with `loom`.
///
/// # Bounds
///
/// The store tracks at most `max_keys` keys. A key whose state has become equivalent to
/// a fresh one is dropped when its shard next sweeps: its bucket has refilled, or its
/// windows have passed. So a flood of unique keys, such as a botnet rotating addresses,
/// cannot grow memory without bound.
///
/// # Changed limits
///
/// A caller keeps what it used when its policy's limit or burst changes (see
/// [`Policy::state_id`]). A bucket's or GCRA's state is kept at the rate it was
/// written at, and carried to a new rate by the first request under it. Each shard
/// remembers the last four limits a policy had there: a caller last seen under an
/// older one starts afresh.
///
/// # Keys
///
/// Keys are stored as a 64-bit hash. The hasher is foldhash's quality hasher, seeded at
/// random per store. Which keys collide cannot be known without the seed, and no answer
/// reveals the seed. It is a fast hash, not a cryptographic one.
///
/// Two distinct keys share state only if their hashes collide. For a million live keys
/// that happens with probability about 5 × 10⁻⁸. (A cell keeps 63 of the 64 bits. The
/// last bit says how its state is written.)
///
/// # Memory
///
/// A state in a cell costs 16 bytes: its key's hash and its state. Each level of a
/// shard's cells is half as large again as the one before, and is filled to three
/// quarters. So once a shard holds a few hundred keys, a key costs 21 to 33 bytes in the
/// levels it uses. It costs more while the shard's neighbours have made a level it does
/// not use. A two-word state in its table costs 24 bytes. A sliding window log costs
/// about 200 bytes with one entry, and 16 to 32 more for each further entry.
/// The repository's `BENCHMARKS.md` has the measured bytes per key.
///
/// A shard takes about 400 bytes before any key. Its lock and tables take 128 bytes (and
/// about 50 more, boxed, for each policy's limits it remembers). Its
/// first sixteen cells take 256, and are made with the store for every shard. So the
/// default store takes about 0.4 MB. Later levels are made for up to 64 shards at a time
/// (at most 4 MB), when the first of them needs one.
///
/// The cells the shards grow are kept until the store is dropped. After a flood, a
/// shard's idle keys are swept and their cells reused. But its cell memory is not
/// returned.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollway_core::{Algorithm, ManualClock, MemoryStore, Policy, Quota};
///
/// let clock = ManualClock::new();
/// let store = MemoryStore::builder().max_keys(10_000).clock(clock.clone()).build()?;
/// let policy = Policy::new("login", Algorithm::SlidingWindowLog, Quota::per_minute(3)?)?;
///
/// for _ in 0..3 {
///     assert!(store.check_sync(b"203.0.113.9", &policy, 1).is_allowed());
/// }
/// let denied = store.check_sync(b"203.0.113.9", &policy, 1);
/// assert_eq!(denied.retry_after(), Some(Duration::from_secs(60)));
///
/// clock.advance(Duration::from_secs(60));
/// assert!(store.check_sync(b"203.0.113.9", &policy, 1).is_allowed());
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
pub struct MemoryStore<C = MonotonicClock> {
    shared: Arc<Shared<C>>,
}

struct Shared<C> {
    clock: C,
    /// The clock when the store was made: packed states count their instants from it
    /// (see [`word`]).
    origin: u64,
    hasher: foldhash::quality::RandomState,
    /// The cells of every shard (see [`cells`]).
    cells: Levels,
    shards: Box<[Shard]>,
    shard_mask: u64,
    max_per_shard: usize,
    when_full: WhenFull,
    /// Keys held in all shards, for the `tollway_memory_store_keys` gauge.
    #[cfg(feature = "metrics")]
    keys: std::sync::atomic::AtomicUsize,
    /// The notes posted on this store as a [`Board`](crate::Board).
    #[cfg(feature = "regions")]
    board: super::regions::MemoryBoard,
    /// The ledgers of shared policies (see [`share`](super::share)), by key, policy
    /// name and state: only those with a holder.
    ledgers: parking_lot::Mutex<Ledgers>,
}

impl MemoryStore<MonotonicClock> {
    /// A store with the default bounds (about a million keys) on the monotonic clock.
    #[must_use]
    pub fn new() -> Self {
        MemoryStore::from_builder(MemoryStoreBuilder::default())
    }

    /// A builder for a store with other bounds or another clock.
    pub fn builder() -> MemoryStoreBuilder<MonotonicClock> {
        MemoryStoreBuilder::default()
    }
}

impl Default for MemoryStore<MonotonicClock> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C> Clone for MemoryStore<C> {
    fn clone(&self) -> Self {
        MemoryStore {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<C> fmt::Debug for MemoryStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shared.shards.len())
            .field(
                "max_keys",
                &(self.shared.max_per_shard * self.shared.shards.len()),
            )
            .field("when_full", &self.shared.when_full)
            .finish_non_exhaustive()
    }
}

impl<C: Clock> MemoryStore<C> {
    /// Decides one request of `cost` units for `key` against every policy in
    /// `policies`, all or nothing, without awaiting: what [`Store::check`] answers.
    ///
    /// This never fails: a store that is full answers per its [`WhenFull`] setting.
    pub fn decide(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Decisions {
        let (shard, key_hash, now) = self.locate(key);
        if let [policy] = policies
            && let Some(decision) = decide_in_cell(
                self.shared.cells.shard(shard),
                key_hash,
                now,
                self.shared.origin,
                policy,
                cost,
            )
        {
            return Decisions::from(decision);
        }
        self.decide_locked(shard, key_hash, now, policies, Costs::Same(cost))
    }

    /// Decides one request for `key` that costs each of `policies` its own units,
    /// `costs[i]` for `policies[i]`, all or nothing, without awaiting: what
    /// [`Store::check_each`] answers.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_core::{Algorithm, MemoryStore, Policy, Quota};
    ///
    /// let store = MemoryStore::new();
    /// let requests = Policy::new("requests", Algorithm::TokenBucket, Quota::per_minute(60)?)?;
    /// let tokens = Policy::new("tokens", Algorithm::TokenBucket, Quota::per_minute(1_000)?)?;
    /// // One request of 800 tokens: both limits charged, each its own cost.
    /// let d = store.decide_each(b"team-7", &[&requests, &tokens], &[1, 800]);
    /// assert_eq!((d[0].remaining(), d[1].remaining()), (59, 200));
    /// // 300 more tokens do not fit: the request limit is not charged either.
    /// let d = store.decide_each(b"team-7", &[&requests, &tokens], &[1, 300]);
    /// assert!(!d.is_allowed());
    /// assert_eq!(d[0].remaining(), 59);
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    pub fn decide_each(&self, key: &[u8], policies: &[&Policy], costs: &[u64]) -> Decisions {
        if let ([_], [cost]) = (policies, costs) {
            return self.decide(key, policies, *cost);
        }
        let (shard, key_hash, now) = self.locate(key);
        self.decide_locked(shard, key_hash, now, policies, Costs::Each(costs))
    }

    /// The key's shard (its place), its hash, and the time now.
    #[inline(always)]
    fn locate(&self, key: &[u8]) -> (usize, u64, u64) {
        let shared = &*self.shared;
        let now = shared.clock.now_micros();
        // Every state of one key lives in the key's shard, so one lock covers all of a
        // request's limits.
        let key_hash = shared.hasher.hash_one(key);
        let shard = ((key_hash >> 32) & shared.shard_mask) as usize;
        (shard, key_hash, now)
    }

    /// Decides under the shard's lock. This is for several limits, a sliding window log,
    /// or a state in the table. It is also for a packed state that would no longer pack,
    /// a quota past its packing's range, or a key that has no cell yet.
    fn decide_locked(
        &self,
        shard: usize,
        key_hash: u64,
        now: u64,
        policies: &[&Policy],
        costs: Costs<'_>,
    ) -> Decisions {
        let mut table = self.shared.shards[shard].table.lock();
        #[cfg(feature = "metrics")]
        let held = table.len();
        let decisions = table.decide(
            self.shared.cells.shard(shard),
            key_hash,
            now,
            policies,
            costs,
            &self.shared.bounds(),
            true,
        );
        #[cfg(feature = "metrics")]
        self.shared.count_keys(held, table.len());
        decisions
    }

    /// Looks at or corrects `key`'s state under each policy, without awaiting: what
    /// [`Store::operate`] answers.
    pub fn apply(&self, key: &[u8], policies: &[&Policy], operation: Operation) -> Decisions {
        let (shard, key_hash, now) = self.locate(key);
        let shared = &*self.shared;
        let mut table = shared.shards[shard].table.lock();
        #[cfg(feature = "metrics")]
        let held = table.len();
        let decisions = table.apply(
            shared.cells.shard(shard),
            key_hash,
            now,
            policies,
            operation,
            &shared.bounds(),
        );
        #[cfg(feature = "metrics")]
        shared.count_keys(held, table.len());
        decisions
    }

    /// Decides one request of `cost` units for `key` under one `policy`, without
    /// awaiting.
    ///
    /// This never fails: a store that is full answers per its [`WhenFull`] setting.
    pub fn check_sync(&self, key: &[u8], policy: &Policy, cost: u64) -> Decision {
        let (shard, key_hash, now) = self.locate(key);
        let cells = self.shared.cells.shard(shard);
        if let Some(decision) =
            decide_in_cell(cells, key_hash, now, self.shared.origin, policy, cost)
        {
            return decision;
        }
        let decisions = self.decide_locked(shard, key_hash, now, &[policy], Costs::Same(cost));
        // One policy, one decision.
        decisions
            .first()
            .copied()
            .unwrap_or(Decision::allow(0, 0, 0, 0))
    }

    /// Which of the store's shards keeps `key`'s states: for benches and tests that place
    /// keys (feature `testing`).
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    #[must_use]
    pub fn shard_of(&self, key: &[u8]) -> usize {
        self.locate(key).0
    }

    /// The number of keys held, idle ones not yet swept included.
    #[must_use]
    pub fn len(&self) -> usize {
        self.shared
            .shards
            .iter()
            .map(|s| s.table.lock().len())
            .sum()
    }

    /// Whether no key is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every key whose state is now equivalent to a fresh one, and returns how
    /// many keys remain.
    ///
    /// A sliding window counter's state in a cell counts as fresh from the end of the
    /// unit its instant falls in, up to 16.8 s later. The store also sweeps by itself as
    /// it fills. Call this to release memory after a flood without waiting for new keys.
    /// It releases the two-word states' tables and the logs, and the ledgers of shared
    /// policies surely fresh again (which it does not count). Cells are kept for new keys.
    pub fn sweep(&self) -> usize {
        let now = self.shared.clock.now_micros();
        self.shared.ledgers.lock().sweep(now / 1_000);
        self.shared
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut table = s.table.lock();
                #[cfg(feature = "metrics")]
                let held = table.len();
                table.sweep(self.shared.cells.shard(i), now, self.shared.max_per_shard);
                #[cfg(feature = "metrics")]
                self.shared.count_keys(held, table.len());
                table.len()
            })
            .sum()
    }

    /// The store's clock.
    #[must_use]
    pub fn clock(&self) -> &C {
        &self.shared.clock
    }

    /// The notes posted on this store as a [`Board`](crate::Board).
    #[cfg(feature = "regions")]
    pub(crate) fn board(&self) -> &super::regions::MemoryBoard {
        &self.shared.board
    }
}

/// The ledgers of shared policies by key, policy name and state, each with when it is
/// surely fresh again (ms), and past how many the next share sweeps them.
#[derive(Default)]
struct Ledgers {
    map: std::collections::HashMap<LedgerId, (super::share::Ledger, u64)>,
    sweep_past: usize,
}

type LedgerId = (Vec<u8>, String, u64);

impl Ledgers {
    /// Forgets the ledgers surely fresh again at `now` (ms).
    fn sweep(&mut self, now: u64) {
        self.map.retain(|_, (_, forgotten)| *forgotten > now);
        self.map.shrink_to_fit();
        self.sweep_past = (2 * self.map.len()).max(SWEEP_LEDGERS);
    }
}

/// Past this many ledgers (or twice as many as the last sweep kept), a share forgets
/// those that are surely fresh again.
const SWEEP_LEDGERS: usize = 1_024;

impl<C: Clock> Store for MemoryStore<C> {
    /// Never made: the memory store always answers at once.
    type Future = Ready<Result<Decisions, StoreError>>;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future> {
        Checked::Ready(Ok(self.decide(key, policies, cost)))
    }

    fn check_each(&self, key: &[u8], policies: &[&Policy], costs: &[u64]) -> Checked<Self::Future> {
        Checked::Ready(
            super::Cost::of(policies, costs).map(|_| self.decide_each(key, policies, costs)),
        )
    }

    fn supports_each_cost(&self) -> Result<(), crate::ConfigError> {
        Ok(())
    }

    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        Checked::Ready(Ok(self.apply(key, policies, operation)))
    }

    /// A peek at every limit, then a decision at the grant's size: two steps, so a
    /// request between them may shrink the grant to the request's own cost.
    fn lend(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u64,
        ask: u64,
    ) -> Option<super::LendFuture> {
        if !super::lend::all_lend(policies) {
            return None;
        }
        let peek = self.apply(key, policies, Operation::Peek(0));
        let units = super::lend::grant_size(super::lend::least_remaining(&peek), cost, ask);
        let at = self.shared.clock.now_micros();
        let mut decisions = self.decide(key, policies, units);
        let mut granted = units;
        if !decisions.is_allowed() && units > cost {
            decisions = self.decide(key, policies, cost);
            granted = cost;
        }
        Some(Box::pin(std::future::ready(Ok(super::Grant::new(
            granted, decisions, at,
        )))))
    }

    /// Decided at once, under one lock for all keys: holders ask once in seconds.
    ///
    /// Ledgers are bounded by the store's key bound, apart from the keys it decides:
    /// past it, those surely fresh again are forgotten, and a new ledger is then
    /// refused (a share of nothing) or, with [`WhenFull::AllowUntracked`], decided
    /// fresh and not kept.
    fn share(
        &self,
        key: &[u8],
        policy: &Policy,
        ask: &super::ShareAsk,
    ) -> Option<super::ShareFuture> {
        super::share::shareable(policy).ok()?;
        let shared = &*self.shared;
        let now = shared.clock.now_micros() / 1_000;
        let terms = super::share::Terms::of(policy);
        let id = (key.to_vec(), policy.name().to_owned(), policy.state_id());
        let most = shared.max_per_shard.saturating_mul(shared.shards.len());
        let mut ledgers = shared.ledgers.lock();
        if !ledgers.map.contains_key(&id) && ledgers.map.len() >= most.min(ledgers.sweep_past) {
            ledgers.sweep(now);
        }
        let full = !ledgers.map.contains_key(&id) && ledgers.map.len() >= most;
        let share = if full {
            match shared.when_full {
                WhenFull::Deny => super::Share::new(0, 0, false, now),
                WhenFull::AllowUntracked => {
                    super::share::decide(&mut super::share::Ledger::default(), now, terms, ask)
                }
            }
        } else {
            let (ledger, forgotten) = ledgers.map.entry(id.clone()).or_default();
            let share = super::share::decide(ledger, now, terms, ask);
            *forgotten = ledger.forgotten_at(terms);
            // A ledger that decides as a fresh one is forgotten at once; one whose pool
            // the reserve alone has refilled since its last share ended, when the sweep
            // comes.
            if ledger.is_fresh(terms) {
                ledgers.map.remove(&id);
            }
            share
        };
        if ledgers.map.len() > ledgers.sweep_past {
            ledgers.sweep(now);
        }
        Some(Box::pin(std::future::ready(Ok(share))))
    }

    fn give_back(
        &self,
        key: &[u8],
        policies: &[&Policy],
        units: u64,
        ends: &[u64],
    ) -> Option<super::GiveBackFuture> {
        let (shard, key_hash, now) = self.locate(key);
        let shared = &*self.shared;
        let mut table = shared.shards[shard].table.lock();
        table.give_back(
            shared.cells.shard(shard),
            key_hash,
            now,
            policies,
            units,
            ends,
        );
        Some(Box::pin(std::future::ready(Ok(()))))
    }
}

impl<C> Shared<C> {
    /// Reports a shard's change from `before` to `after` keys in the
    /// `tollway_memory_store_keys` gauge (idle keys not yet swept included).
    #[cfg(feature = "metrics")]
    fn count_keys(&self, before: usize, after: usize) {
        use std::sync::atomic::Ordering;
        if before == after {
            return;
        }
        let held = if after > before {
            self.keys.fetch_add(after - before, Ordering::Relaxed) + (after - before)
        } else {
            self.keys.fetch_sub(before - after, Ordering::Relaxed) - (before - after)
        };
        metrics::gauge!(crate::metric::MEMORY_STORE_KEYS.name).set(held as f64);
    }

    fn bounds(&self) -> Bounds {
        Bounds {
            max: self.max_per_shard,
            when_full: self.when_full,
        }
    }
}

/// Decides one limit kept in a cell the key already has, without the lock; `None`
/// for the sliding window log, a key with no cell, a packed state that would no longer
/// pack, or a check at a time its quota's states cannot pack (see
/// [`Packs::may_pack`]).
#[inline(always)]
fn decide_in_cell(
    cells: Cells<'_>,
    key_hash: u64,
    now: u64,
    origin: u64,
    policy: &Policy,
    cost: u64,
) -> Option<Decision> {
    let check = InCell {
        cells,
        hash: key_hash ^ policy.rate_id(),
        now,
        origin,
        quota: policy.quota(),
        cost,
    };
    dispatch::visit(policy.algorithm(), check)
}

/// [`decide_in_cell`] for one algorithm.
struct InCell<'a, 'q> {
    cells: Cells<'a>,
    /// The key's hash moved by the policy's id.
    hash: u64,
    now: u64,
    origin: u64,
    quota: &'q Quota,
    cost: u64,
}

impl Visit for InCell<'_, '_> {
    type Out = Option<Decision>;

    #[inline(always)]
    fn instant<A: Instant>(self) -> Option<Decision> {
        let InCell {
            now, quota, cost, ..
        } = self;
        self.cells.update(word::instant_key(self.hash), |tat| {
            let (decision, next) = A::check(gcra::State { tat }, now, quota, cost);
            (decision, decision.is_allowed().then_some(next.tat))
        })
    }

    #[inline(always)]
    fn pair<A: Pair>(self) -> Option<Decision> {
        let InCell {
            cells,
            hash,
            now,
            origin,
            quota,
            cost,
        } = self;
        decide_packed::<A>(cells, hash, now, quota, origin, cost)
    }

    #[inline(always)]
    fn log(self) -> Option<Decision> {
        None
    }
}

/// [`decide_in_cell`] for a state packed in its cell (see [`word`]). Not inlined: GCRA's
/// path stays as small as it was (inlining this slowed GCRA's check in the
/// `memory_store` bench).
#[inline(never)]
fn decide_packed<A: Pair>(
    cells: Cells<'_>,
    hash: u64,
    now: u64,
    quota: &Quota,
    origin: u64,
    cost: u64,
) -> Option<Decision> {
    if !A::State::may_pack(now, quota, origin) {
        return None;
    }
    cells
        .update(word::packed_key(hash), |state| {
            let state = A::State::unpack(state, quota, origin);
            let (decision, next) = A::check(state, now, quota, cost);
            if !decision.is_allowed() {
                return (Some(decision), None);
            }
            match next.pack(quota, origin) {
                Some(next) => (Some(decision), Some(next)),
                // It takes the lock, to move the state out of its cell.
                None => (None, None),
            }
        })
        .flatten()
}
