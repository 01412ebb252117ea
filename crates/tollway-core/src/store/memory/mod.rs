//! The in-process store: sharded, bounded, and quick to forget idle keys.

use std::fmt;
use std::future::Ready;
use std::hash::BuildHasher;
use std::sync::Arc;

use hashbrown::HashTable;
use smallvec::SmallVec;
use spin::mutex::SpinMutex;
use spin::relax::Yield;

use self::cells::{Cells, Levels, Meta, Pinned};
use self::word::{Packs, packs};
use super::{Checked, Operation, Store};

mod cells;
mod word;
use crate::algorithm::sliding_log::{self, Log};
use crate::algorithm::{
    Algorithm, Slot, SlotState, fixed_window, gcra, leaky_bucket, packed, sliding_counter,
    token_bucket,
};
use crate::clock::{Clock, MonotonicClock};
use crate::error::ConfigError;
use crate::{Decision, Decisions, Denial, Policy, Quota, StoreError};

/// What the memory store does with a new key when it already holds `max_keys` keys and
/// none of them is idle enough to drop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum WhenFull {
    /// Deny the new key's request with [`Denial::StoreFull`]: callers already tracked
    /// keep their limits, new callers wait until old ones go idle. The default.
    #[default]
    Deny,
    /// Decide the request as if the key were fresh, without remembering it: nobody is
    /// turned away, but such callers are not limited until room frees up.
    AllowUntracked,
}

/// The default bound on tracked keys.
const DEFAULT_MAX_KEYS: usize = 1 << 20;
/// Below this many keys a shard never sweeps.
const MIN_SWEEP: usize = 256;

/// Limiter state in this process's memory.
///
/// Keys are arbitrary bytes. The store is split into shards. A state that fits one
/// 64-bit word lives in its shard's *cells*: GCRA's and the leaky bucket shaper's always
/// (one instant), the token bucket's, the leaky bucket meter's and the fixed window's
/// packed exactly while their instant is less than 2^(59 − b) µs after the store was made,
/// where `b` is the bits of the window's limit, or those a bucket's partial microsecond
/// needs (none for a limit that divides its period, as 100 a minute does): thousands of
/// years for such a bucket, 143 for a window of 100 a period, 51 days for a window of
/// 100,000 and 1.2 hours at worst (a window of 2^26); and the sliding window counter's,
/// for a limit up to 32,767, while its window ends less than 2^(49 − 2l) units of the
/// largest power of two of microseconds up to the period (and up to 2^24, 16.8 s: a
/// sweep takes such a key for fresh up to a unit late) after the store was made (`l`
/// the bits of the limit): 18,000 years for 100 a minute, 8.9 years for 1,000 a second,
/// 407 days for 10,000 a minute, 12.7 days for 10,000 a second, 2.4 hours at worst. A
/// check under one such limit, for
/// a key the store already holds, reads the key's cell and updates it by
/// compare-and-swap without taking a lock, and writes no memory but the state's own, so
/// threads deciding for different keys do not queue behind one another, nor behind a
/// sweep. Everything else — the sliding window log, a state past its packing's range
/// or a counter of a larger limit (moved to the shard's table,
/// exactly as it was), a request under several limits, a key's arrival and removal — is
/// decided under the shard's lock, which still reads and swaps the cells' states, so
/// both paths decide one key's requests as if one at a time (the lock-free transitions
/// are model-checked with `loom`). It is bounded: at most `max_keys` keys are tracked,
/// and a key whose state has become equivalent to a fresh one (its bucket refilled, its
/// windows passed) is dropped when its shard next sweeps, so a flood of unique keys — a
/// botnet rotating addresses — cannot grow memory without bound.
///
/// Keys are stored as a 64-bit hash (foldhash's quality hasher, seeded at random per
/// store, so which keys collide cannot be known without the seed, which no answer
/// reveals; it is a fast hash, not a cryptographic one); two distinct keys share state
/// only if their hashes collide, which for a million live keys happens with probability
/// about 5 × 10⁻⁸ (a cell keeps 63 of the 64 bits: the last says how its state is
/// written). A state in a cell costs 16 bytes (its key's hash and its state; each
/// level of a shard's cells half as large again as the one before, filled to three
/// quarters, so 21 to 33 bytes a key in the levels a shard uses once it holds a few
/// hundred, more while its neighbours have made a level it does not use), a two-word state
/// in its table 24 bytes, a sliding window log about 200 bytes with one entry and 16 to
/// 32 more an entry; `BENCHMARKS.md` has the measured bytes per key. A shard takes about
/// 400 bytes before any key (its lock and tables, 128 bytes; its first sixteen cells,
/// 256, made with the store for every shard), so the default store about 0.4 MB; its
/// later levels are made for up to 64 shards at a time (at most 4 MB), when the first of
/// them needs one. The
/// cells the shards grow are kept until the store is dropped: after a flood, a shard's
/// idle keys are swept and their cells reused, but its cell memory is not returned.
///
/// Clones share the same state.
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
    /// The notes posted on this store as a [`Board`](crate::Board): by topic, with the
    /// instant they expire.
    #[cfg(feature = "regions")]
    board: parking_lot::Mutex<std::collections::HashMap<String, Notes>>,
}

#[cfg(feature = "regions")]
struct Notes {
    expires: u64,
    notes: std::collections::HashMap<Vec<u8>, u64>,
}

/// A shard's lock and its tables (its cells are among the store's [`Levels`]), on cache
/// lines of their own so that two cores working on neighbouring shards do not contend.
///
/// The lock is `spin`'s spin lock, whose release is a plain store, with its `Yield`
/// strategy: a waiter yields its core until the lock is free, so a holder that was
/// preempted gets to run. A decision holds it for a few tens of nanoseconds, and taking
/// and releasing it costs one atomic operation where a parking mutex (`parking_lot`)
/// costs two: 4–5 ns of a 22–25 ns decision in the interleaved bench (BENCHMARKS.md). A
/// sweep holds it longer, O(keys and cells in the shard): with the default of a shard
/// per 1,024 keys of the bound, a few microseconds, once per doubling of the shard.
/// Checks in cells do not wait for it (but for a cell a locked decision has pinned). A
/// shard's cells keep the size its busiest moment gave them, so after a flood a sweep
/// walks cells the keys have left.
#[repr(align(128))]
struct Shard {
    table: SpinMutex<Table, Yield>,
}

struct Table {
    /// What the lock guards of the shard's cells.
    cells: Meta,
    /// Fixed-size states of two words not in a cell: a packing algorithm's that did not
    /// pack when written (kept until idle) or found every level full. `(key hash,
    /// slot)`, 24 bytes an entry.
    slots: HashTable<(u64, Slot)>,
    /// Sliding window logs.
    logs: HashTable<(u64, Log)>,
    /// Sweep for idle keys when this many are held.
    sweep_at: usize,
    /// No held key becomes idle before this instant: sweeping sooner frees nothing.
    earliest_expiry: u64,
    /// When the last sweep ran.
    swept_at: u64,
    /// The store's [`origin`](Shared::origin).
    origin: u64,
}

/// At the bound, a full shard sweeps at most once per this many nanoseconds an entry or
/// cell a sweep walks (about 20 µs for 1,024 keys in tables, 1.4 to 3.2 times that in
/// cells): a flood of new keys at the bound then spends a bounded share of a core on
/// sweeping, and a key that expired makes room for a new one within that time.
const SWEEP_GAP_NS_PER_KEY: u64 = 20;

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
    fn from_builder(builder: MemoryStoreBuilder<C>) -> Self {
        let shards = builder
            .shards
            .unwrap_or_else(|| default_shards(builder.max_keys));
        // Rounded down: together the shards never hold more than `max_keys`.
        let max_per_shard = builder.max_keys / shards;
        let origin = builder.clock.now_micros();
        let cells = Levels::new(shards, max_per_shard);
        let shards: Box<[Shard]> = (0..shards)
            .map(|_| Shard {
                table: SpinMutex::new(Table {
                    cells: cells.meta(),
                    slots: HashTable::new(),
                    logs: HashTable::new(),
                    sweep_at: MIN_SWEEP.min(max_per_shard),
                    earliest_expiry: 0,
                    swept_at: 0,
                    origin,
                }),
            })
            .collect();
        MemoryStore {
            shared: Arc::new(Shared {
                clock: builder.clock,
                origin,
                hasher: foldhash::quality::RandomState::default(),
                cells,
                shard_mask: shards.len() as u64 - 1,
                shards,
                max_per_shard,
                when_full: builder.when_full,
                #[cfg(feature = "metrics")]
                keys: std::sync::atomic::AtomicUsize::new(0),
                #[cfg(feature = "regions")]
                board: parking_lot::Mutex::default(),
            }),
        }
    }

    /// Decides one request of `cost` units for `key` against every policy in
    /// `policies`, all or nothing, without awaiting: what [`Store::check`] answers.
    ///
    /// This never fails: a store that is full answers per its [`WhenFull`] setting.
    pub fn decide(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Decisions {
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
        self.decide_locked(shard, key_hash, now, policies, cost)
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

    /// Decides under the shard's lock: several limits, a sliding window log, a state
    /// in the table, a packed state that would no longer pack or a quota past its
    /// packing's range, or a key that has no cell yet.
    fn decide_locked(
        &self,
        shard: usize,
        key_hash: u64,
        now: u64,
        policies: &[&Policy],
        cost: u32,
    ) -> Decisions {
        let mut table = self.shared.shards[shard].table.lock();
        #[cfg(feature = "metrics")]
        let held = table.len();
        let decisions = table.decide(
            self.shared.cells.shard(shard),
            key_hash,
            now,
            policies,
            cost,
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
    pub fn check_sync(&self, key: &[u8], policy: &Policy, cost: u32) -> Decision {
        let (shard, key_hash, now) = self.locate(key);
        let cells = self.shared.cells.shard(shard);
        if let Some(decision) =
            decide_in_cell(cells, key_hash, now, self.shared.origin, policy, cost)
        {
            return decision;
        }
        let decisions = self.decide_locked(shard, key_hash, now, &[policy], cost);
        // One policy, one decision.
        decisions
            .first()
            .copied()
            .unwrap_or(Decision::allow(0, 0, 0, 0))
    }

    /// Which of the store's shards keeps `key`'s states: for benches that place keys
    /// (`benches/scaling.rs`, pattern `apart`). Not a stable API.
    #[doc(hidden)]
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

    /// Drops every key whose state is now equivalent to a fresh one (a sliding window
    /// counter's in a cell: from the end of the unit its instant falls in, up to 16.8 s
    /// later), and returns how many keys remain. The store also does this by itself as
    /// it fills; call it to
    /// release memory after a flood without waiting for new keys (the two-word states'
    /// tables and the logs; cells are kept for new keys).
    pub fn sweep(&self) -> usize {
        let now = self.shared.clock.now_micros();
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
}

impl<C: Clock> Store for MemoryStore<C> {
    /// Never made: the memory store always answers at once.
    type Future = Ready<Result<Decisions, StoreError>>;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Checked<Self::Future> {
        Checked::Ready(Ok(self.decide(key, policies, cost)))
    }

    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        Checked::Ready(Ok(self.apply(key, policies, operation)))
    }
}

/// Notes kept beside the limits, for a [`SplitStore`](crate::SplitStore) in this process:
/// a post adds to its topic's notes, and a topic goes when its last post's `keep` is over.
#[cfg(feature = "regions")]
impl<C: Clock> crate::Board for MemoryStore<C> {
    fn post(
        &self,
        topic: &str,
        notes: Vec<(Vec<u8>, u64)>,
        keep: std::time::Duration,
    ) -> crate::BoardFuture<()> {
        let now = self.shared.clock.now_micros();
        let mut board = self.shared.board.lock();
        board.retain(|_, kept| kept.expires > now);
        let kept = board.entry(topic.to_owned()).or_insert_with(|| Notes {
            expires: 0,
            notes: std::collections::HashMap::new(),
        });
        let keep = u64::try_from(keep.as_micros()).unwrap_or(u64::MAX);
        kept.expires = now.saturating_add(keep);
        kept.notes.extend(notes);
        Box::pin(std::future::ready(Ok(())))
    }

    fn read(&self, topic: &str) -> crate::BoardFuture<Vec<(Vec<u8>, u64)>> {
        let now = self.shared.clock.now_micros();
        let board = self.shared.board.lock();
        let notes = match board.get(topic) {
            Some(kept) if kept.expires > now => kept
                .notes
                .iter()
                .map(|(name, &n)| (name.clone(), n))
                .collect(),
            _ => Vec::new(),
        };
        Box::pin(std::future::ready(Ok(notes)))
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
        metrics::gauge!("tollway_memory_store_keys").set(held as f64);
    }

    fn bounds(&self) -> Bounds {
        Bounds {
            max: self.max_per_shard,
            when_full: self.when_full,
        }
    }
}

/// Decides one limit kept in a cell the key already has, without the lock; `None`
/// for another algorithm, a key with no cell, a packed state that would no longer
/// pack, or a check at a time its quota's states cannot pack (see
/// [`Packs::may_pack`]).
#[inline(always)]
fn decide_in_cell(
    cells: Cells<'_>,
    key_hash: u64,
    now: u64,
    origin: u64,
    policy: &Policy,
    cost: u32,
) -> Option<Decision> {
    let hash = key_hash ^ policy.id();
    let (q, c, o) = (policy.quota(), cost, origin);
    match policy.algorithm() {
        Algorithm::Gcra | Algorithm::LeakyBucketShaper => {
            cells.update(word::instant_key(hash), |state| {
                let (decision, next) = word_check(policy, state, now, cost);
                (decision, decision.is_allowed().then_some(next))
            })
        }
        Algorithm::TokenBucket => decide_packed(cells, hash, now, q, o, |s| {
            token_bucket::check(s, now, q, c)
        }),
        Algorithm::LeakyBucket => decide_packed(cells, hash, now, q, o, |s| {
            leaky_bucket::meter(s, now, q, c)
        }),
        Algorithm::FixedWindow => decide_packed(cells, hash, now, q, o, |s| {
            fixed_window::check(s, now, q, c)
        }),
        Algorithm::SlidingWindowCounter => decide_packed(cells, hash, now, q, o, |s| {
            sliding_counter::check(s, now, q, c)
        }),
        Algorithm::SlidingWindowLog => None,
    }
}

/// [`decide_in_cell`] for a state packed in its cell (see
/// [`word`]), decided by `check`. Not inlined: GCRA's path stays as small as it was
/// (inlined, this cost GCRA's check 10% in the `memory_store` bench).
#[inline(never)]
fn decide_packed<S: Packs>(
    cells: Cells<'_>,
    hash: u64,
    now: u64,
    quota: &Quota,
    origin: u64,
    check: impl Fn(S) -> (Decision, S),
) -> Option<Decision> {
    if !S::may_pack(now, quota, origin) {
        return None;
    }
    cells
        .update(word::packed_key(hash), |state| {
            let (decision, next) = check(S::unpack(state, quota, origin));
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

/// A shard's bound on keys, and what to do at it.
struct Bounds {
    max: usize,
    when_full: WhenFull,
}

/// The state one limit of a request would leave, to be written once every limit allowed.
enum Change<'a> {
    /// Nothing to write: the state is unchanged, or a fresh state that need not be kept.
    None,
    /// A fixed-size state, kept under `hash`, where `place` says.
    Slot {
        hash: u64,
        next: Slot,
        place: Place<'a>,
    },
    /// An admission into the log kept under `hash` (`known`: the log exists).
    Log { hash: u64, known: bool },
    /// An instant state (GCRA's, the shaper's), in the cell `key`: `pinned` while the
    /// request is decided (see [`Cells::pin`]; `None`: the key has no cell yet, and gets
    /// one).
    Cell {
        key: u64,
        pinned: Option<Pinned<'a>>,
        next: u64,
    },
}

/// Where a fixed-size state is kept under the lock: in the shard's table, or packed in a
/// cell (a bucket's, a fixed window's or a sliding window counter's, while it fits one
/// word: see [`word`]).
enum Place<'a> {
    /// A key with no state yet.
    New,
    Table,
    /// The cell, pinned while the request is decided.
    Cell(Pinned<'a>),
}

impl Change<'_> {
    fn is_new_key(&self) -> bool {
        matches!(
            self,
            Change::Slot {
                place: Place::New,
                ..
            } | Change::Log { known: false, .. }
                | Change::Cell { pinned: None, .. }
        )
    }
}

/// The fixed-size state of a key no request has changed.
const FRESH: Slot = [0, 0];

/// Whether an algorithm's state is one instant, kept in the shard's lock-free cells.
fn in_cell(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::Gcra | Algorithm::LeakyBucketShaper)
}

/// Decides a request of `cost` under an instant policy (GCRA, the shaper) on the state
/// `tat`; returns the state admitting it would leave.
#[inline(always)]
fn word_check(policy: &Policy, tat: u64, now: u64, cost: u32) -> (Decision, u64) {
    let state = gcra::State { tat };
    let (decision, next) = match policy.algorithm() {
        Algorithm::LeakyBucketShaper => leaky_bucket::shape(state, now, policy.quota(), cost),
        _ => gcra::check(state, now, policy.quota(), cost),
    };
    (decision, next.tat)
}

/// What a charge or drain (see [`Operation`]) takes as a request from a state with
/// `left` units (`remaining` units always fit), and what it then owes: a charge takes
/// whatever is left, if less, and owes what did not fit; a drain takes what is left over
/// its `keep`.
fn take_and_owe(operation: Operation, left: u64) -> (u32, u32) {
    match operation {
        Operation::Charge(units) => {
            let cost = u32::try_from(left).map_or(units, |left| units.min(left));
            (cost, units - cost)
        }
        Operation::Drain(keep) => {
            let over = left.saturating_sub(u64::from(keep));
            (u32::try_from(over).unwrap_or(u32::MAX), 0)
        }
        Operation::Peek(_) | Operation::Refund(_) | Operation::Reset => (0, 0),
    }
}

/// A charge or drain (see [`Operation`]) on `state`, in one step: `check` decides a
/// request of a cost, `charge` takes units whether or not they fit.
fn operate<S: Copy>(
    state: S,
    operation: Operation,
    check: impl Fn(S, u32) -> (Decision, S),
    charge: impl Fn(S, u32) -> S,
) -> S {
    let left = check(state, 0).0.remaining();
    let (cost, owed) = take_and_owe(operation, left);
    let (decision, next) = check(state, cost);
    let taken = if decision.is_allowed() { next } else { state };
    if owed > 0 { charge(taken, owed) } else { taken }
}

/// A charge or drain on an instant state `tat` (GCRA's, the shaper's).
fn word_operate(policy: &Policy, tat: u64, now: u64, operation: Operation) -> u64 {
    operate(
        tat,
        operation,
        |tat, cost| word_check(policy, tat, now, cost),
        |tat, units| word_correct(policy, tat, now, units, true),
    )
}

/// A charge or drain on a state that [packs](word::packs), as a [`Slot`]: the buckets
/// owe what does not fit (up to a capacity), the windows do not count past their
/// limit.
fn slot_operate(policy: &Policy, slot: Slot, now: u64, operation: Operation) -> Slot {
    let q = policy.quota();
    match policy.algorithm() {
        Algorithm::LeakyBucket => operate(
            token_bucket::State::from_slot(slot),
            operation,
            |s, cost| leaky_bucket::meter(s, now, q, cost),
            |s, units| leaky_bucket::meter_charge(s, now, q, units),
        )
        .to_slot(),
        Algorithm::FixedWindow => operate(
            fixed_window::State::from_slot(slot),
            operation,
            |s, cost| fixed_window::check(s, now, q, cost),
            |s, _| s,
        )
        .to_slot(),
        Algorithm::SlidingWindowCounter => operate(
            sliding_counter::State::from_slot(slot),
            operation,
            |s, cost| sliding_counter::check(s, now, q, cost),
            |s, _| s,
        )
        .to_slot(),
        _ => operate(
            token_bucket::State::from_slot(slot),
            operation,
            |s, cost| token_bucket::check(s, now, q, cost),
            |s, units| token_bucket::charge(s, now, q, units),
        )
        .to_slot(),
    }
}

/// An instant policy's refund (`charge`: or charge) of `units` on the state `tat`.
fn word_correct(policy: &Policy, tat: u64, now: u64, units: u32, charge: bool) -> u64 {
    let (state, q) = (gcra::State { tat }, policy.quota());
    let next = match (policy.algorithm(), charge) {
        (Algorithm::LeakyBucketShaper, false) => leaky_bucket::shape_refund(state, now, q, units),
        (Algorithm::LeakyBucketShaper, true) => leaky_bucket::shape_charge(state, now, q, units),
        (_, false) => gcra::refund(state, now, q, units),
        (_, true) => gcra::charge(state, now, q, units),
    };
    next.tat
}

impl Table {
    fn len(&self) -> usize {
        self.slots.len() + self.logs.len() + Cells::len(&self.cells)
    }

    /// Decides a request against every policy (see [`MemoryStore::decide`]): each limit
    /// is decided first and nothing is written; then, if `commit`, either every limit's
    /// new state is written, or, when one denied, none is, and the limits that allowed
    /// report their state unchanged (a request of cost 0). A policy listed twice is
    /// decided once. Cells read are pinned until the request is done.
    #[allow(clippy::too_many_arguments)]
    fn decide(
        &mut self,
        cells: Cells<'_>,
        key_hash: u64,
        now: u64,
        policies: &[&Policy],
        cost: u32,
        bounds: &Bounds,
        commit: bool,
    ) -> Decisions {
        let Bounds { max, when_full } = *bounds;
        let mut decisions = Decisions::new();
        let mut changes: SmallVec<[Change<'_>; 2]> = SmallVec::new();
        let mut new_keys = 0;
        for (i, policy) in policies.iter().enumerate() {
            if let Some(first) = policies[..i].iter().position(|p| p.id() == policy.id()) {
                decisions.push(decisions[first]);
                changes.push(Change::None);
                continue;
            }
            // A policy's entries are the key's hash moved by the policy's id, which
            // covers its name, algorithm and quota: a changed quota starts afresh.
            let hash = key_hash ^ policy.id();
            let (mut decision, change) = self.read(cells, hash, now, policy, cost);
            if change.is_new_key() && decision.is_allowed() {
                new_keys += 1;
                if !self.has_room(cells, now, max, new_keys)
                    || matches!(change, Change::Cell { key, .. } if !cells.has_vacancy(&mut self.cells, key))
                {
                    decision = full(decision, when_full);
                }
            }
            decisions.push(decision);
            changes.push(change);
        }
        if decisions.is_allowed() {
            if commit {
                let room = self.len() + new_keys <= max;
                for (policy, change) in policies.iter().zip(changes) {
                    self.write(cells, change, now, policy, cost, room);
                }
            }
        } else {
            // The pinned cells go back as they were.
            drop(changes);
            for (i, policy) in policies.iter().enumerate() {
                if decisions[i].is_allowed() {
                    let hash = key_hash ^ policy.id();
                    decisions.replace(i, self.read(cells, hash, now, policy, 0).0);
                }
            }
        }
        decisions
    }

    /// Carries out `operation` (see [`Operation`]) on each policy's state.
    fn apply(
        &mut self,
        cells: Cells<'_>,
        key_hash: u64,
        now: u64,
        policies: &[&Policy],
        operation: Operation,
        bounds: &Bounds,
    ) -> Decisions {
        if let Operation::Peek(cost) = operation {
            return self.decide(cells, key_hash, now, policies, cost, bounds, false);
        }
        policies
            .iter()
            .map(|&policy| {
                let hash = key_hash ^ policy.id();
                // A charge or drain on a cell is one step on the pinned state (or, for a
                // key with no cell, on a fresh one, inserted whole): a check without the
                // lock cannot come between its parts.
                let one_step = matches!(operation, Operation::Charge(_) | Operation::Drain(_));
                if one_step && packs(policy.algorithm()) {
                    let (place, slot) = self.find_slot(cells, hash, now, policy);
                    let next = slot_operate(policy, slot, now, operation);
                    // A new key is kept if the operation leaves it other than fresh.
                    if !matches!(place, Place::New)
                        || (next[0] > now && self.has_room(cells, now, bounds.max, 1))
                    {
                        self.write_slot(cells, hash, next, place, policy, true);
                    }
                    return self.read(cells, hash, now, policy, 0).0;
                }
                if one_step && in_cell(policy.algorithm()) {
                    let key = word::instant_key(hash);
                    if let Some(mut pinned) = cells.pin(&self.cells, key) {
                        pinned.set(word_operate(policy, pinned.state(), now, operation));
                    } else {
                        let next = word_operate(policy, FRESH[0], now, operation);
                        if next > now
                            && self.has_room(cells, now, bounds.max, 1)
                            && cells.has_vacancy(&mut self.cells, key)
                            && cells.insert(&mut self.cells, key, next)
                        {
                            self.earliest_expiry = self.earliest_expiry.min(next);
                        }
                    }
                    return self.read(cells, hash, now, policy, 0).0;
                }
                match operation {
                    // The sliding window log (and a state of a policy that does not
                    // pack): what does not fit is not counted (its window is spent
                    // already).
                    Operation::Charge(_) | Operation::Drain(_) => {
                        let left = self.read(cells, hash, now, policy, 0).0.remaining();
                        let (cost, _) = take_and_owe(operation, left);
                        // A drain with nothing over `keep` takes nothing.
                        if cost > 0 || matches!(operation, Operation::Charge(_)) {
                            self.decide(cells, key_hash, now, &[policy], cost, bounds, true);
                        }
                    }
                    Operation::Refund(units) => self.refund(cells, hash, now, policy, units),
                    Operation::Reset => self.forget(cells, hash),
                    // Answered above.
                    Operation::Peek(_) => {}
                }
                self.read(cells, hash, now, policy, 0).0
            })
            .collect()
    }

    /// Gives `units` back to one policy's state, if the key has one.
    fn refund(&mut self, cells: Cells<'_>, hash: u64, now: u64, policy: &Policy, units: u32) {
        // The key may be idle sooner than the shard noted, from now on: a sweep at the
        // bound is not put off past that.
        self.earliest_expiry = self.earliest_expiry.min(now);
        let (q, u) = (policy.quota(), units);
        match policy.algorithm() {
            Algorithm::TokenBucket => self.update_slot(cells, hash, now, policy, |s| {
                repacked(token_bucket::refund, s, now, q, u)
            }),
            Algorithm::LeakyBucket => self.update_slot(cells, hash, now, policy, |s| {
                repacked(leaky_bucket::meter_refund, s, now, q, u)
            }),
            Algorithm::FixedWindow => self.update_slot(cells, hash, now, policy, |s| {
                repacked(fixed_window::refund, s, now, q, u)
            }),
            Algorithm::SlidingWindowCounter => self.update_slot(cells, hash, now, policy, |s| {
                repacked(sliding_counter::refund, s, now, q, u)
            }),
            Algorithm::Gcra | Algorithm::LeakyBucketShaper => {
                update_cell(cells, hash, |s| word_correct(policy, s, now, u, false))
            }
            Algorithm::SlidingWindowLog => {
                if let Some((_, log)) = self.logs.find_mut(hash, |e| e.0 == hash) {
                    sliding_log::refund(log, now, q, u);
                }
            }
        }
    }

    /// Replaces the fixed-size state kept under `hash`, if there is one, by `update`'s.
    fn update_slot(
        &mut self,
        cells: Cells<'_>,
        hash: u64,
        now: u64,
        policy: &Policy,
        update: impl FnOnce(Slot) -> Slot,
    ) {
        match self.find_slot(cells, hash, now, policy) {
            (Place::New, _) => {}
            (place, slot) => self.write_slot(cells, hash, update(slot), place, policy, true),
        }
    }

    /// Forgets one policy's state of the key.
    fn forget(&mut self, cells: Cells<'_>, hash: u64) {
        if let Ok(entry) = self.slots.find_entry(hash, |e| e.0 == hash) {
            entry.remove();
        }
        if let Ok(entry) = self.logs.find_entry(hash, |e| e.0 == hash) {
            entry.remove();
        }
        cells.remove(&mut self.cells, word::instant_key(hash));
        cells.remove(&mut self.cells, word::packed_key(hash));
    }

    /// The decision of one limit at `cost`, and what admitting it would change.
    fn read<'a>(
        &mut self,
        cells: Cells<'a>,
        hash: u64,
        now: u64,
        policy: &Policy,
        cost: u32,
    ) -> (Decision, Change<'a>) {
        let (q, c) = (policy.quota(), cost);
        // A direct call per algorithm (not a function pointer), so each is inlined.
        match policy.algorithm() {
            Algorithm::TokenBucket => self.read_slot(cells, hash, now, policy, |s| {
                packed(token_bucket::check, s, now, q, c)
            }),
            Algorithm::LeakyBucket => self.read_slot(cells, hash, now, policy, |s| {
                packed(leaky_bucket::meter, s, now, q, c)
            }),
            Algorithm::FixedWindow => self.read_slot(cells, hash, now, policy, |s| {
                packed(fixed_window::check, s, now, q, c)
            }),
            Algorithm::SlidingWindowCounter => self.read_slot(cells, hash, now, policy, |s| {
                packed(sliding_counter::check, s, now, q, c)
            }),
            Algorithm::Gcra | Algorithm::LeakyBucketShaper => {
                self.read_cell(cells, hash, now, policy, cost)
            }
            Algorithm::SlidingWindowLog => self.read_log(hash, now, policy, cost),
        }
    }

    #[inline(always)]
    fn read_slot<'a>(
        &mut self,
        cells: Cells<'a>,
        hash: u64,
        now: u64,
        policy: &Policy,
        run: impl FnOnce(Slot) -> (Decision, Slot),
    ) -> (Decision, Change<'a>) {
        let (place, state) = self.find_slot(cells, hash, now, policy);
        let (decision, next) = run(state);
        let change = match place {
            // A fresh state that the request leaves fresh is not worth keeping.
            Place::New if next[0] <= now => Change::None,
            place => Change::Slot { hash, next, place },
        };
        (decision, change)
    }

    /// Where the fixed-size state kept under `hash` is, and what it is (a fresh key's,
    /// if new). A cell it is packed in is pinned (see [`Cells::pin`]).
    ///
    /// A state in the table that is idle at `now` (a fresh key's, as a sweep would find
    /// it) is dropped here and counted as a new key: else a sweep that a later limit of
    /// the request makes room with could drop it between its read and its write, and
    /// with it what the request took.
    fn find_slot<'a>(
        &mut self,
        cells: Cells<'a>,
        hash: u64,
        now: u64,
        policy: &Policy,
    ) -> (Place<'a>, Slot) {
        if let Ok(entry) = self.slots.find_entry(hash, |e| e.0 == hash) {
            let slot = entry.get().1;
            if slot[0] > now {
                return (Place::Table, slot);
            }
            entry.remove();
        }
        if packs(policy.algorithm())
            && let Some(pinned) = cells.pin(&self.cells, word::packed_key(hash))
        {
            let (state, quota) = (pinned.state(), policy.quota());
            let slot = word::unpack_slot(policy.algorithm(), state, quota, self.origin);
            return (Place::Cell(pinned), slot);
        }
        (Place::New, FRESH)
    }

    /// Leaves a fixed-size state `next` where `place` says: in the table if it is
    /// there; in its cell while it packs, moving to the table when it no longer does; a
    /// new key in a cell if it packs and a level has room, else in the table; a new key
    /// only if `room` (else it goes untracked, as [`WhenFull::AllowUntracked`] asks).
    fn write_slot(
        &mut self,
        cells: Cells<'_>,
        hash: u64,
        next: Slot,
        place: Place<'_>,
        policy: &Policy,
        room: bool,
    ) {
        let packed = word::pack_slot(policy.algorithm(), next, policy.quota(), self.origin);
        match (place, packed) {
            (Place::Table, _) => {
                if let Some(entry) = self.slots.find_mut(hash, |e| e.0 == hash) {
                    entry.1 = next;
                }
                return;
            }
            (Place::Cell(mut pinned), Some(word)) => {
                pinned.set(word);
                return;
            }
            (Place::Cell(pinned), None) => pinned.remove(&mut self.cells),
            (Place::New, _) if !room => return,
            (Place::New, Some(word)) => {
                let key = word::packed_key(hash);
                // Into the table if every level is full.
                if cells.insert(&mut self.cells, key, word)
                    || (cells.has_vacancy(&mut self.cells, key)
                        && cells.insert(&mut self.cells, key, word))
                {
                    self.earliest_expiry = self.earliest_expiry.min(next[0]);
                    return;
                }
            }
            (Place::New, None) => {}
        }
        self.earliest_expiry = self.earliest_expiry.min(next[0]);
        self.slots.insert_unique(hash, (hash, next), |e| e.0);
    }

    fn read_cell<'a>(
        &self,
        cells: Cells<'a>,
        hash: u64,
        now: u64,
        policy: &Policy,
        cost: u32,
    ) -> (Decision, Change<'a>) {
        let key = word::instant_key(hash);
        let pinned = cells.pin(&self.cells, key);
        let state = pinned.as_ref().map_or(FRESH[0], Pinned::state);
        let (decision, next) = word_check(policy, state, now, cost);
        let change = if pinned.is_some() || next > now {
            Change::Cell { key, pinned, next }
        } else {
            // A fresh state that the request leaves fresh is not worth keeping.
            Change::None
        };
        (decision, change)
    }

    fn read_log<'a>(
        &mut self,
        hash: u64,
        now: u64,
        policy: &Policy,
        cost: u32,
    ) -> (Decision, Change<'a>) {
        let quota = policy.quota();
        // An idle log is dropped and counted as a new key, as in `find_slot`.
        let live = match self.logs.find_entry(hash, |e| e.0 == hash) {
            Ok(entry) if entry.get().1.expires_at() > now => Some(entry.into_mut()),
            Ok(entry) => {
                entry.remove();
                None
            }
            Err(_) => None,
        };
        match live {
            Some((_, log)) => {
                let d = sliding_log::decide(log, now, quota, cost);
                (d, Change::Log { hash, known: true })
            }
            None => {
                let d = sliding_log::decide(&mut Log::default(), now, quota, cost);
                let change = if cost > 0 {
                    Change::Log { hash, known: false }
                } else {
                    Change::None
                };
                (d, change)
            }
        }
    }

    /// Writes one limit's change; a new key only if `room` (else it goes untracked, as
    /// [`WhenFull::AllowUntracked`] asks).
    fn write(
        &mut self,
        cells: Cells<'_>,
        change: Change<'_>,
        now: u64,
        policy: &Policy,
        cost: u32,
        room: bool,
    ) {
        match change {
            Change::None => {}
            Change::Cell {
                pinned: Some(mut pinned),
                next,
                ..
            } => pinned.set(next),
            Change::Slot { hash, next, place } => {
                self.write_slot(cells, hash, next, place, policy, room);
            }
            Change::Cell {
                key,
                pinned: None,
                next,
            } => {
                // The read found a vacancy for the key; if another new key of the same
                // request took it, tombstones are emptied or keys moved to make one.
                if room
                    && (cells.insert(&mut self.cells, key, next)
                        || (cells.has_vacancy(&mut self.cells, key)
                            && cells.insert(&mut self.cells, key, next)))
                {
                    self.earliest_expiry = self.earliest_expiry.min(next);
                }
            }
            Change::Log { hash, known: true } => {
                if let Some((_, log)) = self.logs.find_mut(hash, |e| e.0 == hash) {
                    sliding_log::admit(log, now, policy.quota(), cost);
                }
            }
            Change::Log { hash, known: false } => {
                if room {
                    let mut log = Log::default();
                    sliding_log::admit(&mut log, now, policy.quota(), cost);
                    self.earliest_expiry = self.earliest_expiry.min(log.expires_at());
                    self.logs.insert_unique(hash, (hash, log), |e| e.0);
                }
            }
        }
    }

    /// Whether `needed` more keys fit, sweeping idle keys first when that could help:
    /// below the bound at every doubling of the shard (O(1) a key inserted, cells left by
    /// a flood aside); at the bound whenever a held key has expired, at most once per the
    /// shard's sweep gap.
    fn has_room(&mut self, cells: Cells<'_>, now: u64, max: usize, needed: usize) -> bool {
        let held = self.len() + needed;
        if held > self.sweep_at && now >= self.earliest_expiry {
            let walked = self.slots.len() + self.logs.len() + cells.cap();
            let gap_us = (walked as u64 * SWEEP_GAP_NS_PER_KEY).div_ceil(1_000);
            if held <= max || now.saturating_sub(self.swept_at) >= gap_us {
                self.sweep(cells, now, max);
            }
        }
        self.len() + needed <= max
    }

    /// Drops idle keys and sets when to sweep next: at twice what is left, so sweeping
    /// costs O(1) per key inserted (cells left by a flood aside), and never past the
    /// bound.
    fn sweep(&mut self, cells: Cells<'_>, now: u64, max: usize) {
        let mut earliest = cells.sweep(&mut self.cells, now, self.origin);
        self.slots.retain(|e| {
            let keep = e.1[0] > now;
            if keep {
                earliest = earliest.min(e.1[0]);
            }
            keep
        });
        self.logs.retain(|e| {
            let keep = e.1.expires_at() > now;
            if keep {
                earliest = earliest.min(e.1.expires_at());
            }
            keep
        });
        self.earliest_expiry = earliest;
        self.swept_at = now;
        self.sweep_at = (self.len() * 2).clamp(MIN_SWEEP.min(max), max);
        if self.slots.len() < self.slots.capacity() / 4 {
            self.slots.shrink_to_fit(|e| e.0);
        }
        if self.logs.len() < self.logs.capacity() / 4 {
            self.logs.shrink_to_fit(|e| e.0);
        }
    }
}

/// Runs `update` on an instant state in its cell, if the key has one (under the
/// shard's lock: a check without it may store first, and `update` runs again).
fn update_cell(cells: Cells<'_>, hash: u64, update: impl Fn(u64) -> u64) {
    cells.update(word::instant_key(hash), |s| ((), Some(update(s))));
}

/// Runs a fixed-size state's refund or charge on its packed [`Slot`].
fn repacked<S: SlotState>(
    refund: fn(S, u64, &Quota, u32) -> S,
    slot: Slot,
    now: u64,
    quota: &Quota,
    units: u32,
) -> Slot {
    refund(S::from_slot(slot), now, quota, units).to_slot()
}

fn full(decision: Decision, when_full: WhenFull) -> Decision {
    match when_full {
        WhenFull::AllowUntracked => decision,
        WhenFull::Deny => Decision::refused(Denial::StoreFull, decision.limit(), 0, 0),
    }
}

fn default_shards(max_keys: usize) -> usize {
    (max_keys / 1024).next_power_of_two().clamp(1, 1024)
}

/// Builds a [`MemoryStore`] with other bounds or another clock.
///
/// # Examples
///
/// ```
/// use tollway_core::{ManualClock, MemoryStore, WhenFull};
///
/// let store = MemoryStore::builder()
///     .max_keys(100_000)
///     .when_full(WhenFull::AllowUntracked)
///     .clock(ManualClock::new())
///     .build()?;
/// assert!(store.is_empty());
///
/// let err = MemoryStore::builder().max_keys(0).build().unwrap_err();
/// assert!(err.to_string().contains("max_keys"));
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct MemoryStoreBuilder<C = MonotonicClock> {
    max_keys: usize,
    shards: Option<usize>,
    when_full: WhenFull,
    clock: C,
}

impl Default for MemoryStoreBuilder<MonotonicClock> {
    fn default() -> Self {
        MemoryStoreBuilder {
            max_keys: DEFAULT_MAX_KEYS,
            shards: None,
            when_full: WhenFull::Deny,
            clock: MonotonicClock::new(),
        }
    }
}

impl<C: Clock> MemoryStoreBuilder<C> {
    /// The most keys held at once (default 1,048,576). Each of the store's shards holds
    /// an equal share, so a shard can fill a little before the store as a whole does.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The number of shards, a power of two from 1 to 1024 (default: one per 1,024 keys
    /// of `max_keys`, at most 1,024). A sweep for idle keys holds one shard's lock at a
    /// time, so fewer keys a shard keep the checks that meet it waiting less (measured:
    /// p99.9 2.6 µs with 1,024 shards, 84 µs with 64, `benches/scaling.rs`); more shards
    /// make each shard's share of `max_keys` smaller, so one fills sooner before the
    /// store as a whole: with a thousand keys a shard, keys spread at random fill the
    /// first shard at about 90% of `max_keys` (16,384 a shard: about 97%).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// What to do with a new key when the store is full (default [`WhenFull::Deny`]).
    pub fn when_full(mut self, when_full: WhenFull) -> Self {
        self.when_full = when_full;
        self
    }

    /// Reads time from `clock` instead of the monotonic clock.
    pub fn clock<D: Clock>(self, clock: D) -> MemoryStoreBuilder<D> {
        MemoryStoreBuilder {
            max_keys: self.max_keys,
            shards: self.shards,
            when_full: self.when_full,
            clock,
        }
    }

    /// Builds the store.
    ///
    /// # Errors
    ///
    /// When `max_keys` is zero, or `shards` is not a power of two from 1 to 1024 or is
    /// more than `max_keys`, or leaves a shard more than 245,736 keys.
    pub fn build(self) -> Result<MemoryStore<C>, ConfigError> {
        if self.max_keys == 0 {
            return Err(ConfigError::new(
                "memory store max_keys must be at least 1: a store that can hold no key limits nobody",
            ));
        }
        if let Some(shards) = self.shards
            && (!shards.is_power_of_two() || shards > 1024 || shards > self.max_keys)
        {
            return Err(ConfigError::new(format!(
                "memory store shards must be a power of two from 1 to 1024 and at most max_keys ({}); got {shards}",
                self.max_keys
            )));
        }
        let shards = self.shards.unwrap_or_else(|| default_shards(self.max_keys));
        if self.max_keys / shards > cells::MAX_SHARD_KEYS {
            return Err(ConfigError::new(format!(
                "memory store shards may hold at most {} keys each; max_keys {} needs more shards than {shards}",
                cells::MAX_SHARD_KEYS,
                self.max_keys
            )));
        }
        Ok(MemoryStore::from_builder(self))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Algorithm, ManualClock, Quota};

    fn store(max_keys: usize, when_full: WhenFull) -> (MemoryStore<ManualClock>, ManualClock) {
        let clock = ManualClock::new();
        let store = MemoryStore::builder()
            .max_keys(max_keys)
            .shards(1)
            .when_full(when_full)
            .clock(clock.clone())
            .build()
            .unwrap();
        (store, clock)
    }

    #[test]
    fn a_full_store_denies_new_keys_and_keeps_limiting_known_ones() {
        let (store, _clock) = store(300, WhenFull::Deny);
        let policy =
            Policy::new("p", Algorithm::TokenBucket, Quota::per_minute(2).unwrap()).unwrap();
        for i in 0..300u32 {
            assert!(store.check_sync(&i.to_le_bytes(), &policy, 1).is_allowed());
        }
        assert_eq!(store.len(), 300);
        let stranger = store.check_sync(b"stranger", &policy, 1);
        assert_eq!(stranger.denial(), Some(Denial::StoreFull));
        // Known keys keep their state: key 0 has one token left, then none.
        assert!(
            store
                .check_sync(&0u32.to_le_bytes(), &policy, 1)
                .is_allowed()
        );
        assert!(
            !store
                .check_sync(&0u32.to_le_bytes(), &policy, 1)
                .is_allowed()
        );
    }

    #[test]
    fn a_full_store_can_let_new_keys_through_untracked() {
        let (store, _clock) = store(256, WhenFull::AllowUntracked);
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_minute(1).unwrap()).unwrap();
        for i in 0..256u32 {
            store.check_sync(&i.to_le_bytes(), &policy, 1);
        }
        for _ in 0..3 {
            assert!(store.check_sync(b"stranger", &policy, 1).is_allowed());
        }
        assert_eq!(store.len(), 256);
    }

    #[test]
    fn idle_keys_are_dropped_so_a_flood_of_unique_keys_stays_bounded() {
        // Every key spends one token; a second later its bucket is full again and the
        // key is equivalent to a fresh one, so the store may forget it.
        let (store, clock) = store(1_000, WhenFull::Deny);
        let policy =
            Policy::new("p", Algorithm::TokenBucket, Quota::per_second(10).unwrap()).unwrap();
        for i in 0..100_000u32 {
            let d = store.check_sync(&i.to_le_bytes(), &policy, 1);
            assert!(d.is_allowed(), "request {i} was denied: {d:?}");
            clock.advance(Duration::from_micros(1_000));
            assert!(store.len() <= 1_000);
        }
        clock.advance(Duration::from_secs(1));
        assert_eq!(store.sweep(), 0);
    }

    #[test]
    fn a_request_that_changes_nothing_stores_nothing() {
        let (store, _clock) = store(100, WhenFull::Deny);
        let policy = Policy::new(
            "p",
            Algorithm::SlidingWindowLog,
            Quota::per_second(1).unwrap(),
        )
        .unwrap();
        assert_eq!(
            store.check_sync(b"k", &policy, 2).denial(),
            Some(Denial::CostExceedsCapacity)
        );
        assert!(store.check_sync(b"k", &policy, 0).is_allowed());
        assert!(store.is_empty());
    }

    #[test]
    fn policies_do_not_share_state_for_the_same_key() {
        let (store, _clock) = store(100, WhenFull::Deny);
        let a = Policy::new("a", Algorithm::FixedWindow, Quota::per_minute(1).unwrap()).unwrap();
        let b = Policy::new("b", Algorithm::FixedWindow, Quota::per_minute(1).unwrap()).unwrap();
        assert!(store.check_sync(b"k", &a, 1).is_allowed());
        assert!(store.check_sync(b"k", &b, 1).is_allowed());
        assert!(!store.check_sync(b"k", &a, 1).is_allowed());
    }

    #[test]
    fn clones_share_one_limit() {
        let (store, _clock) = store(100, WhenFull::Deny);
        let other = store.clone();
        let p = Policy::new(
            "p",
            Algorithm::SlidingWindowCounter,
            Quota::per_minute(1).unwrap(),
        )
        .unwrap();
        assert!(store.check_sync(b"k", &p, 1).is_allowed());
        assert!(!other.check_sync(b"k", &p, 1).is_allowed());
    }

    #[test]
    fn a_request_refused_by_one_limit_is_charged_by_none() {
        let (store, _clock) = store(100, WhenFull::Deny);
        let tier = Policy::new(
            "tier",
            Algorithm::TokenBucket,
            Quota::per_minute(10).unwrap(),
        )
        .unwrap();
        let route = Policy::new(
            "route",
            Algorithm::SlidingWindowLog,
            Quota::per_minute(1).unwrap(),
        )
        .unwrap();
        let first = store.decide(b"k", &[&tier, &route], 1);
        assert!(first.is_allowed());
        assert_eq!((first[0].remaining(), first[1].remaining()), (9, 0));
        for _ in 0..5 {
            let refused = store.decide(b"k", &[&tier, &route], 1);
            assert_eq!(refused[1].denial(), Some(Denial::Limited));
            // The tier reports its state as it is: not charged.
            assert!(refused[0].is_allowed());
            assert_eq!(refused[0].remaining(), 9);
        }
        assert_eq!(store.check_sync(b"k", &tier, 1).remaining(), 8);
    }

    #[test]
    fn a_new_key_that_does_not_fit_refuses_the_whole_request() {
        let (store, _clock) = store(1, WhenFull::Deny);
        let a = Policy::new("a", Algorithm::Gcra, Quota::per_minute(5).unwrap()).unwrap();
        let b = Policy::new("b", Algorithm::Gcra, Quota::per_minute(5).unwrap()).unwrap();
        let refused = store.decide(b"k", &[&a, &b], 1);
        assert_eq!(refused[1].denial(), Some(Denial::StoreFull));
        assert!(store.is_empty(), "nothing was charged");
        assert!(store.decide(b"k", &[&a], 1).is_allowed());
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn a_changed_quota_starts_afresh() {
        let (store, _clock) = store(100, WhenFull::Deny);
        let before =
            Policy::new("api", Algorithm::FixedWindow, Quota::per_minute(1).unwrap()).unwrap();
        let after = Policy::new(
            "api",
            Algorithm::FixedWindow,
            Quota::per_minute(100).unwrap(),
        )
        .unwrap();
        assert!(store.check_sync(b"k", &before, 1).is_allowed());
        assert!(!store.check_sync(b"k", &before, 1).is_allowed());
        assert_eq!(store.check_sync(b"k", &after, 1).remaining(), 99);
    }

    // Regression: a store filled by a flood refused new callers for an eighth of its
    // bound after every key had expired, waiting out a sweep credit. Expired keys make
    // room at once.
    #[test]
    fn expired_keys_make_room_for_new_callers_at_once() {
        let (store, clock) = store(1_024, WhenFull::Deny);
        let policy =
            Policy::new("p", Algorithm::TokenBucket, Quota::per_minute(10).unwrap()).unwrap();
        for i in 0..1_024u32 {
            assert!(store.check_sync(&i.to_le_bytes(), &policy, 1).is_allowed());
        }
        let stranger = store.check_sync(b"stranger", &policy, 1);
        assert_eq!(stranger.denial(), Some(Denial::StoreFull));
        clock.advance(Duration::from_secs(61));
        for i in 0..200u32 {
            let d = store.check_sync(format!("new-{i}").as_bytes(), &policy, 1);
            assert!(d.is_allowed(), "new caller {i}: {d:?}");
        }
    }

    // At the bound with nothing expired, a new caller is turned away without a sweep
    // each time, and a key that expires later still makes room once the shard's sweep
    // gap has passed.
    #[test]
    fn a_full_store_sweeps_at_most_once_per_gap() {
        let (store, clock) = store(256, WhenFull::Deny);
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(1).unwrap()).unwrap();
        for i in 0..256u32 {
            assert!(store.check_sync(&i.to_le_bytes(), &policy, 1).is_allowed());
            clock.advance(Duration::from_micros(10));
        }
        // Key 0 expires 1 s after it was set; the others a little later each.
        clock.set_micros(1_000_000);
        assert!(store.check_sync(b"first", &policy, 1).is_allowed());
        assert_eq!(
            store.check_sync(b"second", &policy, 1).denial(),
            Some(Denial::StoreFull),
            "nothing else has expired"
        );
        // 10 µs later key 1 has expired; the gap has passed (384 cells a sweep walks,
        // 7.68 µs, rounded up to 8).
        clock.advance(Duration::from_micros(10));
        assert!(store.check_sync(b"second", &policy, 1).is_allowed());
    }

    // Keys that come and are reset beside long-lived ones leave tombstones in a small
    // shard's cells; a new key must still get a cell, never go untracked.
    #[test]
    fn keys_reset_over_and_over_leave_room_for_new_ones() {
        let (store, _clock) = store(4, WhenFull::Deny);
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_minute(1).unwrap()).unwrap();
        for stays in [b"a", b"b", b"c"] {
            assert!(store.check_sync(stays, &policy, 1).is_allowed());
        }
        for i in 0..10_000u32 {
            let key = i.to_le_bytes();
            assert!(store.check_sync(&key, &policy, 1).is_allowed());
            assert!(
                !store.check_sync(&key, &policy, 1).is_allowed(),
                "key {i} is tracked"
            );
            store.apply(&key, &[&policy], Operation::Reset);
        }
        assert_eq!(store.len(), 3);
    }

    // A policy listed twice in one request is decided once, and charges once.
    #[test]
    fn a_policy_listed_twice_counts_once() {
        let (store, _clock) = store(100, WhenFull::Deny);
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_minute(5).unwrap()).unwrap();
        for left in [4, 3] {
            let both = store.decide(b"k", &[&policy, &policy], 1);
            assert!(both.is_allowed());
            assert_eq!((both[0].remaining(), both[1].remaining()), (left, left));
        }
        assert_eq!(store.len(), 1);
        assert_eq!(store.check_sync(b"k", &policy, 1).remaining(), 2);
    }

    // A request under two limits whose second is a new key may sweep to make room for
    // it after the first limit was read. The first limit's state, idle but not yet
    // dropped, counts as a new key too: a sweep cannot drop it between its read and its
    // write (it did, and what the request took was lost: the next request had a whole
    // limit again), and the keys never pass the bound. (A log is in the shard's table; a
    // sliding counter's state in its cell, which the read pins, so a sweep passes it.)
    #[test]
    fn an_idle_state_read_by_a_request_counts_as_a_new_key() {
        for algorithm in [Algorithm::SlidingWindowCounter, Algorithm::SlidingWindowLog] {
            let first = Policy::new("first", algorithm, Quota::per_second(1).unwrap()).unwrap();
            let second = Policy::new("second", algorithm, Quota::per_hour(1).unwrap()).unwrap();
            // Four keys, the shard's bound, all idle 2 s on: a sweep makes room.
            let (idle, clock) = store(4, WhenFull::Deny);
            for key in [b"k", b"a", b"b", b"c"] {
                assert!(idle.check_sync(key, &first, 1).is_allowed());
            }
            clock.set_micros(2_500_000);
            assert!(idle.decide(b"k", &[&first, &second], 1).is_allowed());
            let again = idle.check_sync(b"k", &first, 1);
            assert!(
                !again.is_allowed(),
                "{algorithm:?}: the first limit counted it"
            );
            assert_eq!(idle.len(), 2);
            // Four keys, three of them live for an hour: no room for two.
            let (full, full_clock) = store(4, WhenFull::Deny);
            assert!(full.check_sync(b"k", &first, 1).is_allowed());
            for key in [b"a", b"b", b"c"] {
                assert!(full.check_sync(key, &second, 1).is_allowed());
            }
            full_clock.set_micros(2_500_000);
            let both = full.decide(b"k", &[&first, &second], 1);
            assert!(!both.is_allowed());
            assert_eq!(both[1].denial(), Some(Denial::StoreFull), "{algorithm:?}");
            assert!(full.len() <= 4, "{algorithm:?}: {} keys", full.len());
        }
    }

    // A refund can leave a key idle sooner than its shard noted when it last swept: at
    // the bound, a new key then gets the room a sweep makes (it was refused until the
    // key's old expiry: six minutes on for GCRA and the token bucket, an hour for the
    // fixed window and the log).
    #[test]
    fn a_refund_that_idles_a_key_makes_room_at_the_bound() {
        for algorithm in [
            Algorithm::Gcra,
            Algorithm::TokenBucket,
            Algorithm::FixedWindow,
            Algorithm::SlidingWindowLog,
        ] {
            let (store, clock) = store(1, WhenFull::Deny);
            let policy = Policy::new("p", algorithm, Quota::per_hour(10).unwrap()).unwrap();
            assert!(store.check_sync(b"a", &policy, 1).is_allowed());
            assert_eq!(store.sweep(), 1, "a sweep notes when the key goes idle");
            store.apply(b"a", &[&policy], Operation::Refund(1));
            clock.set_micros(1_000);
            let b = store.check_sync(b"b", &policy, 1);
            assert!(b.is_allowed(), "{algorithm:?}: {b:?}");
            assert_eq!(store.len(), 1);
        }
    }

    /// Token bucket states held in the store's tables (the rest are in cells).
    fn in_tables<C>(store: &MemoryStore<C>) -> usize {
        let shards = store.shared.shards.iter();
        shards.map(|shard| shard.table.lock().slots.len()).sum()
    }

    /// Replays checks, refunds and charges of one key under `policy` through the store
    /// and through the algorithm's functions, from `start` in steps of 150 ms, and
    /// asserts every decision the same; and that the state sits in a cell until its
    /// instant first reaches `edge`, where it stops packing, and in the table while it
    /// is past it.
    #[allow(clippy::type_complexity)]
    fn replay_across_the_edge<S: SlotState + Default>(
        policy: &Policy,
        start: u64,
        edge: u64,
        check: fn(S, u64, &Quota, u32) -> (Decision, S),
        refund: fn(S, u64, &Quota, u32) -> S,
        charge: fn(S, u64, &Quota, u32) -> S,
    ) {
        let quota = *policy.quota();
        let (store, clock) = store(100, WhenFull::Deny);
        let (mut state, mut moved) = (S::default(), false);
        for step in 0..60u32 {
            let now = start + u64::from(step) * 150_000;
            clock.set_micros(now);
            let units = 1 + step % 3;
            if step % 7 == 6 {
                store.apply(b"k", &[policy], Operation::Refund(units));
                state = refund(state, now, &quota, units);
            } else if step % 11 == 10 {
                store.apply(b"k", &[policy], Operation::Charge(units));
                state = operate(
                    state,
                    Operation::Charge(units),
                    |s, cost| check(s, now, &quota, cost),
                    |s, units| charge(s, now, &quota, units),
                );
            } else {
                let (want, next) = check(state, now, &quota, units);
                if want.is_allowed() {
                    state = next;
                }
                let got = store.check_sync(b"k", policy, units);
                assert_eq!(got, want, "{policy:?}, step {step}");
            }
            // In a cell until it reaches the edge; in the table while past it, and
            // after, until an access finds it idle and drops it.
            let instant = state.to_slot()[0];
            moved |= instant >= edge;
            let tables = in_tables(&store);
            if instant >= edge || !moved {
                assert_eq!(tables, usize::from(moved), "{policy:?}, step {step}");
            }
            assert!(store.len() <= 1);
        }
        assert!(moved, "the key moved out of its cell");
    }

    // A token bucket's state, or a fixed window's, is packed in a cell while it fits one
    // word, and moves to the table when it no longer does. On both sides of the move
    // every decision, refund and charge is the algorithm's.
    #[test]
    fn packed_states_decide_exactly_in_their_cells_and_after_moving_out() {
        // 3 a second: `limit / gcd` takes 2 bits, so a state packs while it is full
        // again before 2^57 µs.
        let quota = Quota::per_second(3).unwrap().with_burst(5).unwrap();
        let (start, edge) = ((1 << 57) - 4_000_000, 1 << 57);
        let policy = Policy::new("tb", Algorithm::TokenBucket, quota).unwrap();
        replay_across_the_edge(
            &policy,
            start,
            edge,
            token_bucket::check,
            token_bucket::refund,
            token_bucket::charge,
        );
        let policy = Policy::new("lb", Algorithm::LeakyBucket, quota).unwrap();
        replay_across_the_edge(
            &policy,
            start,
            edge,
            leaky_bucket::meter,
            leaky_bucket::meter_refund,
            leaky_bucket::meter_charge,
        );
        // 5 a second: a count takes 3 bits, so a window packs while it ends before 2^56
        // µs. A charge does not count past the limit.
        let quota = Quota::per_second(5).unwrap();
        let policy = Policy::new("fw", Algorithm::FixedWindow, quota).unwrap();
        replay_across_the_edge(
            &policy,
            (1 << 56) - 4_000_000,
            1 << 56,
            fixed_window::check,
            fixed_window::refund,
            |s, _, _, _| s,
        );
        // 32,767 a second: counts of 15 bits each, so a counter packs while its instant
        // is within 2^19 units of 2^19 µs (the largest power of two up to the period):
        // up to 2^38 − 2^19 µs. A charge does not count past the limit.
        let quota = Quota::per_second(32_767).unwrap();
        let policy = Policy::new("swc", Algorithm::SlidingWindowCounter, quota).unwrap();
        let edge = (1 << 38) - (1 << 19) + 1;
        replay_across_the_edge(
            &policy,
            edge - 4_000_000,
            edge,
            sliding_counter::check,
            sliding_counter::refund,
            |s, _, _, _| s,
        );
    }

    // A sliding window counter in a cell says when it is fresh again to the end of the
    // unit its window's end falls in (its word keeps the instant in units of the largest
    // power of two up to the period): a sweep keeps it up to a period longer than the
    // table would, never less.
    #[test]
    fn packed_sliding_counters_are_swept_by_the_end_of_their_unit() {
        let quota = Quota::per_second(10).unwrap();
        let policy = Policy::new("swc", Algorithm::SlidingWindowCounter, quota).unwrap();
        let (store, clock) = store(1_000, WhenFull::Deny);
        clock.set_micros(1_200_000);
        assert!(store.check_sync(b"k", &policy, 3).is_allowed());
        assert_eq!((store.len(), in_tables(&store)), (1, 0));
        // Its window [1 s, 2 s) weighs on the next: fresh at 3 s, which falls in the unit
        // of 2^19 µs ending at 6 × 524,288 µs.
        clock.set_micros(2_999_999);
        assert_eq!(store.check_sync(b"k", &policy, 0).remaining(), 9);
        clock.set_micros(3_000_000);
        assert_eq!(store.sweep(), 1);
        clock.set_micros(3_145_727);
        assert_eq!(store.sweep(), 1);
        clock.set_micros(3_145_728);
        assert_eq!(store.sweep(), 0);
        assert_eq!(store.check_sync(b"k", &policy, 0).remaining(), 10);
        // Past the cells' range, in the table, it is swept at its instant.
        clock.set_micros(1 << 62);
        assert!(store.check_sync(b"k", &policy, 1).is_allowed());
        assert_eq!((store.len(), in_tables(&store)), (1, 1));
        let fresh = (1 << 62) / 1_000_000 * 1_000_000 + 2_000_000;
        clock.set_micros(fresh - 1);
        assert_eq!(store.sweep(), 1);
        clock.set_micros(fresh);
        assert_eq!(store.sweep(), 0);
    }

    // Packed instants count from the store's origin, its clock when made: on an epoch
    // clock a window of 1,000 a minute (a count of 10 bits, so 2^49 µs, 17.8 years, from
    // the origin) packs as it does on a clock from zero. A state from before the origin
    // (a clock set back) is kept in the table.
    #[test]
    fn packed_states_count_from_the_stores_origin() {
        let origin = 1_780_000_000_000_000;
        let clock = ManualClock::at_micros(origin);
        let store = MemoryStore::builder()
            .max_keys(1_000)
            .shards(1)
            .clock(clock.clone())
            .build()
            .unwrap();
        let quota = Quota::per_minute(1_000).unwrap();
        let policy = Policy::new("fw", Algorithm::FixedWindow, quota).unwrap();
        for _ in 0..1_000 {
            assert!(store.check_sync(b"k", &policy, 1).is_allowed());
        }
        assert!(!store.check_sync(b"k", &policy, 1).is_allowed());
        assert_eq!((store.len(), in_tables(&store)), (1, 0));
        clock.set_micros(origin - 120_000_000);
        assert!(store.check_sync(b"early", &policy, 1).is_allowed());
        assert_eq!((store.len(), in_tables(&store)), (2, 1));
        clock.set_micros(origin + 60_000_000);
        assert_eq!(store.sweep(), 0, "both windows over");
    }

    // Keys whose token buckets are packed in cells are swept once full again, as the
    // table's are: a sweep reads a packed cell's instant, not its word.
    #[test]
    fn packed_token_buckets_are_swept_once_full_again() {
        // 7 a second: packed with 3 bits of a partial microsecond.
        let quota = Quota::per_second(7).unwrap();
        let policy = Policy::new("tb", Algorithm::TokenBucket, quota).unwrap();
        let (store, clock) = store(1_000, WhenFull::Deny);
        clock.set_micros(1_000_000);
        for i in 0..100u32 {
            let cost = 1 + i % 7;
            assert!(
                store
                    .check_sync(&i.to_le_bytes(), &policy, cost)
                    .is_allowed()
            );
        }
        assert_eq!((store.len(), in_tables(&store)), (100, 0));
        // Key i is full again (1 + i % 7) / 7 s on, rounded up to a microsecond: those
        // of cost 1 to 3 at 428,572 µs, and not a microsecond sooner.
        let costing = |most: u32| (0..100u32).filter(|i| i % 7 < most).count();
        clock.advance(Duration::from_micros(428_571));
        assert_eq!(
            store.sweep(),
            100 - costing(2),
            "cost 3 is a microsecond short"
        );
        clock.advance(Duration::from_micros(1));
        assert_eq!(store.sweep(), 100 - costing(3), "keys left");
        clock.advance(Duration::from_secs(1));
        assert_eq!(store.sweep(), 0);
    }

    // What the docs say a shard takes before any key.
    #[test]
    fn a_shard_is_128_bytes() {
        assert_eq!(std::mem::size_of::<Shard>(), 128);
    }

    #[test]
    fn bad_bounds_fail_when_the_store_is_built() {
        let err = MemoryStore::builder().shards(3).build().unwrap_err();
        assert!(err.to_string().contains("power of two"), "{err}");
        assert!(MemoryStore::builder().max_keys(0).build().is_err());
        let err = MemoryStore::builder()
            .max_keys(1_000_000)
            .shards(1)
            .build()
            .unwrap_err();
        assert!(
            err.to_string().contains("at most 245736 keys each"),
            "{err}"
        );
    }
}
