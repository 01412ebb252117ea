//! A shard's lock and what it guards: the tables of states that are not in a cell, and
//! the cells' bookkeeping. Every request the cells cannot answer alone is decided here.

use hashbrown::HashTable;
use smallvec::SmallVec;
use spin::mutex::SpinMutex;
use spin::relax::Yield;

use self::forms::{GiveBack, Operate, Read, Refund};
use super::WhenFull;
use super::cells::{Cells, Meta, Pinned};
use super::dispatch::{self, Instant, Pair};
use super::word::{self, Packs};
use crate::algorithm::sliding_log::{self, Log};
use crate::algorithm::{Slot, SlotState, gcra};
use crate::policy::{self, mix_rate};
use crate::store::Operation;
use crate::{Decision, Decisions, Denial, Policy, Quota};

mod forms;

#[cfg(test)]
pub(super) use self::forms::operate;

/// Below this many keys a shard never sweeps.
const MIN_SWEEP: usize = 256;

/// How many rates a shard remembers for a state id (see [`Table::earlier`]). A key last
/// written at a rate older than these starts afresh.
const RATES_KEPT: usize = 4;

/// The limits a state id was written at, newest first. (The period is the state id's:
/// a limit and the period make the quota, and the quota the rate.)
type Rates = SmallVec<[u64; RATES_KEPT]>;

/// A shard's lock and its tables (its cells are among the store's
/// [`Levels`](super::cells::Levels)), on cache lines of their own so that two cores
/// working on neighbouring shards do not contend.
///
/// The lock is `spin`'s spin lock, whose release is a plain store. It uses the `Yield`
/// strategy: a waiter yields its core until the lock is free. So a holder that was
/// preempted gets to run.
///
/// A decision holds the lock for a few tens of nanoseconds. Taking and releasing it
/// costs one atomic operation, where a parking mutex (`parking_lot`) costs two. The
/// interleaved `memory_store` bench shows the difference.
///
/// A sweep holds the lock longer: O(keys and cells in the shard). With the default of a
/// shard per 1,024 keys of the bound, that is a few microseconds, once per doubling of
/// the shard. Checks in cells do not wait for it, except for a cell a locked decision
/// has pinned. A shard's cells keep the size its busiest moment gave them. So after a
/// flood, a sweep walks cells the keys have left.
#[repr(align(128))]
pub(super) struct Shard {
    pub(super) table: SpinMutex<Table, Yield>,
}

pub(super) struct Table {
    /// What the lock guards of the shard's cells.
    cells: Meta,
    /// Fixed-size states of two words not in a cell: a packing algorithm's that did not
    /// pack when written (kept until idle) or found every level full. `(key hash,
    /// slot)`, 24 bytes an entry.
    pub(super) slots: HashTable<(u64, Slot)>,
    /// Sliding window logs.
    logs: HashTable<(u64, Log)>,
    /// Sweep for idle keys when this many are held.
    sweep_at: usize,
    /// No held key becomes idle before this instant: sweeping sooner frees nothing.
    earliest_expiry: u64,
    /// What is seldom used, boxed so that a shard stays on its 128 bytes.
    cold: Box<Cold>,
    /// The store's [`origin`](super::Shared::origin).
    origin: u64,
}

/// At the bound, a full shard sweeps at most once per this many nanoseconds for each
/// entry or cell a sweep walks.
///
/// That is about 20 µs for 1,024 keys in tables, and 1.4 to 3.2 times that in cells. A
/// flood of new keys at the bound then spends a bounded share of a core on sweeping.
/// And a key that expired makes room for a new one within that time.
const SWEEP_GAP_NS_PER_KEY: u64 = 20;

impl Shard {
    /// A shard with no key, whose cells' bookkeeping is `cells`.
    pub(super) fn new(cells: Meta, max_per_shard: usize, origin: u64) -> Self {
        Shard {
            table: SpinMutex::new(Table {
                cells,
                slots: HashTable::new(),
                logs: HashTable::new(),
                sweep_at: MIN_SWEEP.min(max_per_shard),
                earliest_expiry: 0,
                cold: Box::default(),
                origin,
            }),
        }
    }
}

/// A shard's fields that no request reads unless it sweeps or meets a key new at a rate.
#[derive(Default)]
struct Cold {
    /// When the last sweep ran.
    swept_at: u64,
    /// A look that writes nothing is being decided: a state carried to a new rate is
    /// read carried, and left where it was.
    peeking: bool,
    /// The rates ([`Policy::rate`]) the shard's keys were written at, by state id: a
    /// key's bucket or arrival time is kept under its rate, so a key with none at a
    /// policy's rate may have one at an earlier rate, to be carried to it.
    rates: HashTable<(u64, Rates)>,
}

/// What a key new at a rate found at an earlier one.
enum Carried<S> {
    /// Nothing, or a state that carries as a fresh one.
    Nothing,
    /// A state, carried and kept under the new rate.
    Kept(S),
    /// A state, carried for a look that moves nothing.
    Read(S),
}

/// A shard's bound on keys, and what to do at it.
pub(super) struct Bounds {
    pub(super) max: usize,
    pub(super) when_full: WhenFull,
}

/// The state one limit of a request would leave, to be written once every limit allowed.
enum Change<'a> {
    /// Nothing to write: the state is unchanged, or a fresh state that need not be kept.
    None,
    /// A fixed-size state, kept under `hash`, where `place` says; `word`: the state
    /// packed, if it packs (see [`Table::put_slot`]).
    Slot {
        hash: u64,
        next: Slot,
        word: Option<u64>,
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
/// cell. A bucket's, a fixed window's or a sliding window counter's state is packed while
/// it fits one word (see [`word`]).
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

/// What each limit of a request costs: the same for all, or one each.
#[derive(Clone, Copy, Debug)]
pub(super) enum Costs<'a> {
    Same(u64),
    Each(&'a [u64]),
}

impl Costs<'_> {
    /// Limit `i`'s cost.
    #[inline]
    fn of(self, i: usize) -> u64 {
        match self {
            Costs::Same(cost) => cost,
            Costs::Each(costs) => costs.get(i).copied().unwrap_or(0),
        }
    }
}

impl Table {
    pub(super) fn len(&self) -> usize {
        self.slots.len() + self.logs.len() + Cells::len(&self.cells)
    }

    /// Decides a request against every policy (see
    /// [`MemoryStore::decide`](super::MemoryStore::decide)).
    ///
    /// Each limit is decided first, and nothing is written. Then, if `commit`, every
    /// limit's new state is written. But when one limit denied, none is. The limits that
    /// allowed then report their state unchanged, as a request of cost 0. A policy
    /// listed twice is decided once. Cells read are pinned until the request is done.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decide(
        &mut self,
        cells: Cells<'_>,
        key_hash: u64,
        now: u64,
        policies: &[&Policy],
        costs: Costs<'_>,
        bounds: &Bounds,
        commit: bool,
    ) -> Decisions {
        let Bounds { max, when_full } = *bounds;
        if !commit {
            self.cold.peeking = true;
        }
        let mut decisions = Decisions::new();
        let mut changes: SmallVec<[Change<'_>; 2]> = SmallVec::new();
        let mut new_keys = 0;
        for (i, policy) in policies.iter().enumerate() {
            if let Some(first) = policies[..i].iter().position(|p| p.id() == policy.id()) {
                decisions.push(decisions[first]);
                changes.push(Change::None);
                continue;
            }
            // A policy's entries are the key's hash moved by the policy's state id and
            // rate: a changed limit is carried on from the earlier rate's entry.
            let hash = key_hash ^ policy.rate_id();
            let (mut decision, change) = self.read(cells, hash, now, policy, costs.of(i));
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
                for (i, (policy, change)) in policies.iter().zip(changes).enumerate() {
                    self.write(cells, change, now, policy, costs.of(i), room);
                }
            }
        } else {
            // The pinned cells go back as they were.
            drop(changes);
            for (i, policy) in policies.iter().enumerate() {
                if decisions[i].is_allowed() {
                    let hash = key_hash ^ policy.rate_id();
                    decisions.replace(i, self.read(cells, hash, now, policy, 0).0);
                }
            }
        }
        if !commit {
            self.cold.peeking = false;
        }
        decisions
    }

    /// Carries out `operation` (see [`Operation`]) on each policy's state.
    pub(super) fn apply(
        &mut self,
        cells: Cells<'_>,
        key_hash: u64,
        now: u64,
        policies: &[&Policy],
        operation: Operation,
        bounds: &Bounds,
    ) -> Decisions {
        if let Operation::Peek(cost) = operation {
            return self.decide(
                cells,
                key_hash,
                now,
                policies,
                Costs::Same(cost),
                bounds,
                false,
            );
        }
        policies
            .iter()
            .map(|&policy| {
                let hash = key_hash ^ policy.rate_id();
                match operation {
                    Operation::Charge(_) | Operation::Drain(_) => {
                        let operate = Operate {
                            table: &mut *self,
                            cells,
                            key_hash,
                            now,
                            policy,
                            operation,
                            bounds,
                        };
                        dispatch::visit(policy.algorithm(), operate);
                    }
                    Operation::Refund(units) => self.refund(cells, hash, now, policy, units),
                    Operation::Reset => self.forget(cells, hash, policy),
                    // Answered above.
                    Operation::Peek(_) => {}
                }
                self.read(cells, hash, now, policy, 0).0
            })
            .collect()
    }

    /// Gives a lease's unspent `units` back to each policy's window ending at `ends[i]`
    /// (see [`Store::give_back`](crate::Store::give_back)).
    pub(super) fn give_back(
        &mut self,
        cells: Cells<'_>,
        key_hash: u64,
        now: u64,
        policies: &[&Policy],
        units: u64,
        ends: &[u64],
    ) {
        for (&policy, &end) in policies.iter().zip(ends) {
            let give_back = GiveBack {
                table: &mut *self,
                cells,
                hash: key_hash ^ policy.rate_id(),
                now,
                policy,
                units,
                end,
            };
            dispatch::visit(policy.algorithm(), give_back);
        }
    }

    /// Gives `units` back to one policy's state, if the key has one.
    fn refund(&mut self, cells: Cells<'_>, hash: u64, now: u64, policy: &Policy, units: u64) {
        // The key may be idle sooner than the shard noted, from now on: a sweep at the
        // bound is not put off past that.
        self.earliest_expiry = self.earliest_expiry.min(now);
        let refund = Refund {
            table: self,
            cells,
            hash,
            now,
            policy,
            units,
        };
        dispatch::visit(policy.algorithm(), refund);
    }

    /// Replaces the fixed-size state kept under `hash`, if there is one, by `update`'s.
    fn update_slot<A: Pair>(
        &mut self,
        cells: Cells<'_>,
        hash: u64,
        now: u64,
        policy: &Policy,
        update: impl FnOnce(A::State) -> A::State,
    ) {
        let quota = policy.quota();
        match self.find_pair::<A>(cells, hash, now, policy) {
            (Place::New, _) => {}
            (place, state) => self.write_slot(cells, hash, update(state), place, quota, true),
        }
    }

    /// Forgets one policy's state of the key (`hash`), at every rate remembered.
    fn forget(&mut self, cells: Cells<'_>, hash: u64, policy: &Policy) {
        self.forget_at(cells, hash);
        for (old, _) in self.earlier(hash, policy) {
            self.forget_at(cells, old);
        }
    }

    /// Forgets the state kept under `hash`.
    fn forget_at(&mut self, cells: Cells<'_>, hash: u64) {
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
        cost: u64,
    ) -> (Decision, Change<'a>) {
        let read = Read {
            table: self,
            cells,
            hash,
            now,
            policy,
            cost,
        };
        dispatch::visit(policy.algorithm(), read)
    }

    /// [`read`](Self::read) for a state of two integers.
    #[inline(always)]
    fn read_slot<'a, A: Pair>(
        &mut self,
        cells: Cells<'a>,
        hash: u64,
        now: u64,
        policy: &Policy,
        cost: u64,
    ) -> (Decision, Change<'a>) {
        let quota = policy.quota();
        let (place, state) = self.find_pair::<A>(cells, hash, now, policy);
        let (decision, next) = A::check(state, now, quota, cost);
        let change = match place {
            // A fresh state that the request leaves fresh is not worth keeping.
            Place::New if next.to_slot()[0] <= now => Change::None,
            Place::Table => Change::Slot {
                hash,
                next: next.to_slot(),
                word: None,
                place: Place::Table,
            },
            place => Change::Slot {
                hash,
                next: next.to_slot(),
                word: next.pack(quota, self.origin),
                place,
            },
        };
        (decision, change)
    }

    /// [`find_slot`](Self::find_slot) for `policy`: a key with no state at the policy's
    /// rate has its state at an earlier rate carried to it, if it has one (see
    /// [`carry_slot`](Self::carry_slot)).
    #[inline(always)]
    fn find_pair<'a, A: Pair>(
        &mut self,
        cells: Cells<'a>,
        hash: u64,
        now: u64,
        policy: &Policy,
    ) -> (Place<'a>, A::State) {
        match self.find_slot::<A::State>(cells, hash, now, policy.quota()) {
            (Place::New, fresh) if policy.rate() != 0 => {
                match self.carry_slot::<A>(cells, hash, now, policy) {
                    Carried::Kept(state) => (Place::Table, state),
                    Carried::Read(state) => (Place::New, state),
                    Carried::Nothing => (Place::New, fresh),
                }
            }
            found => found,
        }
    }

    /// Moves the key's state at an earlier rate of `policy`'s state id, carried to the
    /// policy's rate, under `hash` (in the table: it need not pack). The first request
    /// at a new rate does this, whatever it is then decided: a refusal keeps the carried
    /// state. A look (a peek) reads it carried and moves nothing.
    #[inline(never)]
    fn carry_slot<A: Pair>(
        &mut self,
        cells: Cells<'_>,
        hash: u64,
        now: u64,
        policy: &Policy,
    ) -> Carried<A::State> {
        let peeking = self.cold.peeking;
        for (old, from) in self.earlier(hash, policy) {
            let (place, state) = self.find_slot::<A::State>(cells, old, now, &from);
            match place {
                Place::New => continue,
                // Unpinned as it was.
                _ if peeking => {}
                Place::Table => self.forget_at(cells, old),
                Place::Cell(pinned) => pinned.remove(&mut self.cells),
            }
            let carried = A::carry(state, now, &from, policy.quota());
            let slot = carried.to_slot();
            if slot[0] <= now {
                return Carried::Nothing;
            }
            if peeking {
                return Carried::Read(carried);
            }
            self.earliest_expiry = self.earliest_expiry.min(slot[0]);
            self.slots.insert_unique(hash, (hash, slot), |e| e.0);
            return Carried::Kept(carried);
        }
        Carried::Nothing
    }

    /// Where a key kept under `hash` at `policy`'s rate keeps its state at the other
    /// rates its state id was written at in this shard, newest first, each with a quota
    /// of that rate; `policy`'s own limit is noted as the newest.
    fn earlier(&mut self, hash: u64, policy: &Policy) -> SmallVec<[(u64, Quota); 2]> {
        let (id, quota) = (policy.state_id(), policy.quota());
        let entry = self
            .cold
            .rates
            .entry(id, |e| e.0 == id, |e| e.0)
            .or_insert_with(|| (id, Rates::new()))
            .into_mut();
        let limits = &mut entry.1;
        let earlier = limits
            .iter()
            .filter_map(|&limit| {
                let then = Quota::with_period(limit, quota.period()).ok()?;
                let rate = policy::rate(policy.algorithm(), &then);
                let old = hash ^ mix_rate(policy.rate()) ^ mix_rate(rate);
                (rate != policy.rate()).then_some((old, then))
            })
            .collect();
        if limits.first() != Some(&quota.limit()) {
            limits.retain(|limit| *limit != quota.limit());
            // Within the inline four: no allocation.
            limits.truncate(RATES_KEPT - 1);
            limits.insert(0, quota.limit());
        }
        earlier
    }

    /// Where the fixed-size state kept under `hash` is, and what it is (a fresh key's,
    /// if new). A cell it is packed in is pinned (see [`Cells::pin`]).
    ///
    /// A state in the table may be idle at `now`: a fresh key's, as a sweep would find
    /// it. It is dropped here and counted as a new key. Else a later limit of the
    /// request could make room with a sweep. That sweep could drop the state between its
    /// read and its write, and with it what the request took.
    fn find_slot<'a, S: Packs>(
        &mut self,
        cells: Cells<'a>,
        hash: u64,
        now: u64,
        quota: &Quota,
    ) -> (Place<'a>, S) {
        if let Ok(entry) = self.slots.find_entry(hash, |e| e.0 == hash) {
            let slot = entry.get().1;
            if slot[0] > now {
                return (Place::Table, S::from_slot(slot));
            }
            entry.remove();
        }
        if let Some(pinned) = cells.pin(&self.cells, word::packed_key(hash)) {
            let state = S::unpack(pinned.state(), quota, self.origin);
            return (Place::Cell(pinned), state);
        }
        (Place::New, S::from_slot(FRESH))
    }

    /// Leaves a fixed-size state `next` where `place` says.
    ///
    /// A state in the table stays there. A state in its cell stays while it packs, and
    /// moves to the table when it no longer does. A new key goes in a cell if it packs
    /// and a level has room, else in the table. A new key is kept only if `room`. Else
    /// it goes untracked, as [`WhenFull::AllowUntracked`] asks.
    fn write_slot<S: Packs>(
        &mut self,
        cells: Cells<'_>,
        hash: u64,
        next: S,
        place: Place<'_>,
        quota: &Quota,
        room: bool,
    ) {
        let word = next.pack(quota, self.origin);
        self.put_slot(cells, hash, next.to_slot(), word, place, room);
    }

    /// [`write_slot`](Self::write_slot) for a state `next` whose word (`None`: it does
    /// not pack) is `word`.
    fn put_slot(
        &mut self,
        cells: Cells<'_>,
        hash: u64,
        next: Slot,
        word: Option<u64>,
        place: Place<'_>,
        room: bool,
    ) {
        match (place, word) {
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
                // Into the table if every level is full.
                if self.insert_cell(cells, word::packed_key(hash), word) {
                    self.earliest_expiry = self.earliest_expiry.min(next[0]);
                    return;
                }
            }
            (Place::New, None) => {}
        }
        self.earliest_expiry = self.earliest_expiry.min(next[0]);
        self.slots.insert_unique(hash, (hash, next), |e| e.0);
    }

    /// Puts `word` in a new cell for `key`, making room in a level if one has none;
    /// `false` when every level is full.
    fn insert_cell(&mut self, cells: Cells<'_>, key: u64, word: u64) -> bool {
        cells.insert(&mut self.cells, key, word)
            || (cells.has_vacancy(&mut self.cells, key) && cells.insert(&mut self.cells, key, word))
    }

    /// [`read`](Self::read) for an instant state.
    #[inline(always)]
    fn read_cell<'a, A: Instant>(
        &mut self,
        cells: Cells<'a>,
        hash: u64,
        now: u64,
        policy: &Policy,
        cost: u64,
    ) -> (Decision, Change<'a>) {
        let quota = policy.quota();
        let key = word::instant_key(hash);
        let (pinned, tat) = match self.pin_cell::<A>(cells, hash, now, policy) {
            Ok(pinned) => {
                let tat = pinned.state();
                (Some(pinned), tat)
            }
            Err(tat) => (None, tat),
        };
        let (decision, next) = A::check(gcra::State { tat }, now, quota, cost);
        let next = next.tat;
        let change = if pinned.is_some() || next > now {
            Change::Cell { key, pinned, next }
        } else {
            // A fresh state that the request leaves fresh is not worth keeping.
            Change::None
        };
        (decision, change)
    }

    /// Pins the key's cell of an instant state kept under `hash`; a key with none has its
    /// state at an earlier rate carried to it first, if it has one. `Err`: no cell, and
    /// the state to read (a fresh key's, or one carried for a look).
    #[inline(always)]
    fn pin_cell<'a, A: Instant>(
        &mut self,
        cells: Cells<'a>,
        hash: u64,
        now: u64,
        policy: &Policy,
    ) -> Result<Pinned<'a>, u64> {
        let key = word::instant_key(hash);
        if let Some(pinned) = cells.pin(&self.cells, key) {
            return Ok(pinned);
        }
        match self.carry_cell::<A>(cells, hash, now, policy) {
            Carried::Kept(_) => cells.pin(&self.cells, key).ok_or(FRESH[0]),
            Carried::Read(tat) => Err(tat),
            Carried::Nothing => Err(FRESH[0]),
        }
    }

    /// [`carry_slot`](Self::carry_slot) for an instant state, kept in a cell. Nothing is
    /// kept when every level of the shard is full.
    #[inline(never)]
    fn carry_cell<A: Instant>(
        &mut self,
        cells: Cells<'_>,
        hash: u64,
        now: u64,
        policy: &Policy,
    ) -> Carried<u64> {
        let peeking = self.cold.peeking;
        for (old, from) in self.earlier(hash, policy) {
            let Some(pinned) = cells.pin(&self.cells, word::instant_key(old)) else {
                continue;
            };
            let tat = pinned.state();
            if !peeking {
                pinned.remove(&mut self.cells);
            }
            let carried = A::carry(gcra::State { tat }, now, &from, policy.quota()).tat;
            if carried <= now {
                return Carried::Nothing;
            }
            if peeking {
                return Carried::Read(carried);
            }
            if !self.insert_cell(cells, word::instant_key(hash), carried) {
                return Carried::Nothing;
            }
            self.earliest_expiry = self.earliest_expiry.min(carried);
            return Carried::Kept(carried);
        }
        Carried::Nothing
    }

    fn read_log<'a>(
        &mut self,
        hash: u64,
        now: u64,
        policy: &Policy,
        cost: u64,
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
        cost: u64,
        room: bool,
    ) {
        match change {
            Change::None => {}
            Change::Cell {
                pinned: Some(mut pinned),
                next,
                ..
            } => pinned.set(next),
            Change::Slot {
                hash,
                next,
                word,
                place,
            } => self.put_slot(cells, hash, next, word, place, room),
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

    /// Whether `needed` more keys fit, sweeping idle keys first when that could help.
    ///
    /// Below the bound, it sweeps at every doubling of the shard. That is O(1) a key
    /// inserted, cells left by a flood aside. At the bound, it sweeps whenever a held
    /// key has expired, at most once per the shard's sweep gap.
    fn has_room(&mut self, cells: Cells<'_>, now: u64, max: usize, needed: usize) -> bool {
        let held = self.len() + needed;
        if held > self.sweep_at && now >= self.earliest_expiry {
            let walked = self.slots.len() + self.logs.len() + cells.cap();
            let gap_us = (walked as u64 * SWEEP_GAP_NS_PER_KEY).div_ceil(1_000);
            if held <= max || now.saturating_sub(self.cold.swept_at) >= gap_us {
                self.sweep(cells, now, max);
            }
        }
        self.len() + needed <= max
    }

    /// Drops idle keys and sets when to sweep next: at twice what is left, so sweeping
    /// costs O(1) per key inserted (cells left by a flood aside), and never past the
    /// bound.
    pub(super) fn sweep(&mut self, cells: Cells<'_>, now: u64, max: usize) {
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
        self.cold.swept_at = now;
        self.sweep_at = (self.len() * 2).clamp(MIN_SWEEP.min(max), max);
        if self.slots.len() < self.slots.capacity() / 4 {
            self.slots.shrink_to_fit(|e| e.0);
        }
        if self.logs.len() < self.logs.capacity() / 4 {
            self.logs.shrink_to_fit(|e| e.0);
        }
    }
}

fn full(decision: Decision, when_full: WhenFull) -> Decision {
    match when_full {
        WhenFull::AllowUntracked => decision,
        WhenFull::Deny => Decision::refused(Denial::StoreFull, decision.limit(), 0, 0),
    }
}
