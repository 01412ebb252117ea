//! What a shard's table does for each form of state: one [`Visit`] for each of
//! [`Table`]'s reads, refunds and charges (see
//! [`dispatch`](crate::store::memory::dispatch)).

use super::{Bounds, Change, FRESH, Place, Table};
use crate::algorithm::{SlotState, gcra, sliding_log};
use crate::store::Operation;
use crate::store::memory::cells::Cells;
use crate::store::memory::dispatch::{Instant, Pair, Visit};
use crate::store::memory::word;
use crate::{Decision, Policy, Quota};

/// What a charge or drain (see [`Operation`]) takes as a request from a state with
/// `left` units, and what it then owes. (`remaining` units always fit.)
///
/// A charge takes whatever is left, if less, and owes what did not fit. A drain takes
/// what is left over its `keep`.
fn take_and_owe(operation: Operation, left: u64) -> (u64, u64) {
    match operation {
        Operation::Charge(units) => {
            let cost = units.min(left);
            (cost, units - cost)
        }
        Operation::Drain(keep) => (left.saturating_sub(keep), 0),
        Operation::Peek(_) | Operation::Refund(_) | Operation::Reset => (0, 0),
    }
}

/// A charge or drain (see [`Operation`]) on `state`, in one step: `check` decides a
/// request of a cost, `charge` takes units whether or not they fit.
pub(in crate::store::memory) fn operate<S: Copy>(
    state: S,
    operation: Operation,
    check: impl Fn(S, u64) -> (Decision, S),
    charge: impl Fn(S, u64) -> S,
) -> S {
    let left = check(state, 0).0.remaining();
    let (cost, owed) = take_and_owe(operation, left);
    let (decision, next) = check(state, cost);
    let taken = if decision.is_allowed() { next } else { state };
    if owed > 0 { charge(taken, owed) } else { taken }
}

/// A charge or drain on an instant state `tat`.
fn instant_operate<A: Instant>(tat: u64, now: u64, quota: &Quota, operation: Operation) -> u64 {
    let state = gcra::State { tat };
    let check = |s, cost| A::check(s, now, quota, cost);
    operate(state, operation, check, |s, units| {
        A::charge(s, now, quota, units)
    })
    .tat
}

/// A charge or drain on a state of two integers: the buckets owe what does not fit, the
/// windows do not count past their limit.
fn pair_operate<A: Pair>(
    state: A::State,
    now: u64,
    quota: &Quota,
    operation: Operation,
) -> A::State {
    let check = |s, cost| A::check(s, now, quota, cost);
    operate(state, operation, check, |s, units| {
        A::charge(s, now, quota, units)
    })
}

/// [`Table::read`] for one algorithm.
pub(super) struct Read<'t, 'a> {
    pub(super) table: &'t mut Table,
    pub(super) cells: Cells<'a>,
    pub(super) hash: u64,
    pub(super) now: u64,
    pub(super) policy: &'t Policy,
    pub(super) cost: u64,
}

impl<'a> Visit for Read<'_, 'a> {
    type Out = (Decision, Change<'a>);

    #[inline(always)]
    fn instant<A: Instant>(self) -> Self::Out {
        let Read {
            table,
            cells,
            hash,
            now,
            policy,
            cost,
        } = self;
        table.read_cell::<A>(cells, hash, now, policy, cost)
    }

    #[inline(always)]
    fn pair<A: Pair>(self) -> Self::Out {
        let Read {
            table,
            cells,
            hash,
            now,
            policy,
            cost,
        } = self;
        table.read_slot::<A>(cells, hash, now, policy, cost)
    }

    #[inline(always)]
    fn log(self) -> Self::Out {
        let Read {
            table,
            hash,
            now,
            policy,
            cost,
            ..
        } = self;
        table.read_log(hash, now, policy, cost)
    }
}

/// [`Table::give_back`] for one algorithm: only a window's count changes.
pub(super) struct GiveBack<'t, 'a> {
    pub(super) table: &'t mut Table,
    pub(super) cells: Cells<'a>,
    pub(super) hash: u64,
    pub(super) now: u64,
    pub(super) policy: &'t Policy,
    pub(super) units: u64,
    pub(super) end: u64,
}

impl Visit for GiveBack<'_, '_> {
    type Out = ();

    /// GCRA and the shaper keep their state: a lent unit goes bad as it refills.
    fn instant<A: Instant>(self) {}

    fn pair<A: Pair>(self) {
        let GiveBack {
            table,
            cells,
            hash,
            now,
            policy,
            units,
            end,
        } = self;
        let quota = policy.quota();
        table.update_slot::<A>(cells, hash, now, policy, |s| {
            A::give_back(s, now, quota, units, end)
        });
    }

    /// The log does not lend.
    fn log(self) {}
}

/// [`Table::refund`] for one algorithm.
pub(super) struct Refund<'t, 'a> {
    pub(super) table: &'t mut Table,
    pub(super) cells: Cells<'a>,
    pub(super) hash: u64,
    pub(super) now: u64,
    pub(super) policy: &'t Policy,
    pub(super) units: u64,
}

impl Visit for Refund<'_, '_> {
    type Out = ();

    fn instant<A: Instant>(self) {
        let Refund {
            table,
            cells,
            hash,
            now,
            policy,
            units,
        } = self;
        let quota = policy.quota();
        if let Ok(mut pinned) = table.pin_cell::<A>(cells, hash, now, policy) {
            let tat = A::refund(
                gcra::State {
                    tat: pinned.state(),
                },
                now,
                quota,
                units,
            )
            .tat;
            pinned.set(tat);
        }
    }

    fn pair<A: Pair>(self) {
        let Refund {
            table,
            cells,
            hash,
            now,
            policy,
            units,
        } = self;
        let quota = policy.quota();
        table.update_slot::<A>(cells, hash, now, policy, |s| {
            A::refund(s, now, quota, units)
        });
    }

    fn log(self) {
        let Refund {
            table,
            hash,
            now,
            policy,
            units,
            ..
        } = self;
        if let Some((_, log)) = table.logs.find_mut(hash, |e| e.0 == hash) {
            sliding_log::refund(log, now, policy.quota(), units);
        }
    }
}

/// A charge or drain (see [`Operation`]) in [`Table::apply`], for one algorithm.
pub(super) struct Operate<'t, 'a> {
    pub(super) table: &'t mut Table,
    pub(super) cells: Cells<'a>,
    pub(super) key_hash: u64,
    pub(super) now: u64,
    pub(super) policy: &'t Policy,
    pub(super) operation: Operation,
    pub(super) bounds: &'t Bounds,
}

impl Visit for Operate<'_, '_> {
    type Out = ();

    /// One step on the pinned state (or, for a key with no cell, on a fresh one,
    /// inserted whole): a check without the lock cannot come between its parts.
    fn instant<A: Instant>(self) {
        let Operate {
            table,
            cells,
            key_hash,
            now,
            policy,
            operation,
            bounds,
        } = self;
        let (hash, quota) = (key_hash ^ policy.rate_id(), policy.quota());
        let key = word::instant_key(hash);
        if let Ok(mut pinned) = table.pin_cell::<A>(cells, hash, now, policy) {
            pinned.set(instant_operate::<A>(pinned.state(), now, quota, operation));
        } else {
            let next = instant_operate::<A>(FRESH[0], now, quota, operation);
            if next > now
                && table.has_room(cells, now, bounds.max, 1)
                && cells.has_vacancy(&mut table.cells, key)
                && cells.insert(&mut table.cells, key, next)
            {
                table.earliest_expiry = table.earliest_expiry.min(next);
            }
        }
    }

    /// One step on the state, wherever it is kept (a packed cell stays pinned).
    fn pair<A: Pair>(self) {
        let Operate {
            table,
            cells,
            key_hash,
            now,
            policy,
            operation,
            bounds,
        } = self;
        let (hash, quota) = (key_hash ^ policy.rate_id(), policy.quota());
        let (place, state) = table.find_pair::<A>(cells, hash, now, policy);
        let next = pair_operate::<A>(state, now, quota, operation);
        // A new key is kept if the operation leaves it other than fresh.
        if !matches!(place, Place::New)
            || (next.to_slot()[0] > now && table.has_room(cells, now, bounds.max, 1))
        {
            table.write_slot(cells, hash, next, place, quota, true);
        }
    }

    /// What does not fit is not counted (its window is spent already).
    fn log(self) {
        let Operate {
            table,
            cells,
            key_hash,
            now,
            policy,
            operation,
            bounds,
        } = self;
        let hash = key_hash ^ policy.rate_id();
        let left = table.read_log(hash, now, policy, 0).0.remaining();
        let (cost, _) = take_and_owe(operation, left);
        // A charge or drain takes at most what one request may (as `lua/operate.lua`).
        let cost = cost.min(crate::policy::MAX_SLIDING_LOG_COST);
        // A drain with nothing over `keep` takes nothing.
        if cost > 0 || matches!(operation, Operation::Charge(_)) {
            table.decide(
                cells,
                key_hash,
                now,
                &[policy],
                super::Costs::Same(cost),
                bounds,
                true,
            );
        }
    }
}
