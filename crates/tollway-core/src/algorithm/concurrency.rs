//! Calls in flight: at most `limit` units held at once, each held from admission until
//! it is given back.
//!
//! A request takes `cost` slots when it is admitted and gives them back with a refund
//! when it ends (the tower layer does so when the response body ends). The quota's
//! `limit` is the number of slots. Its period is how long slots live past their last
//! renewal: a check or a charge of 0 renews them. So slots a caller never gives back (a
//! gateway that died with calls in flight) free themselves within one period, and a
//! long call keeps its slots by renewing them.
//!
//! # What a refusal can say
//!
//! A slot frees when a call ends, and no store can foresee that. So a refusal's retry
//! time is a guess: a second, or the period if that is shorter. Its reset time is when
//! the slots would expire if nobody renewed them: the latest they can all be free.
//!
//! # Several gateways
//!
//! The memory store keeps one count and one expiry a key. The Redis store keeps one a
//! gateway (a `RedisStore`), in a hash, and counts the fields that have not expired. A
//! gateway's renewals keep its own slots, never another's.

use super::{Slot, SlotState};
use crate::{Decision, Denial, Quota};

/// Slots held for one key. `Default` is a fresh key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// When the slots expire unless renewed, in microseconds.
    pub end: u64,
    /// Slots held.
    pub count: u64,
}

impl SlotState for State {
    fn to_slot(self) -> Slot {
        [self.end, self.count]
    }
    fn from_slot(slot: Slot) -> Self {
        State {
            end: slot[0],
            count: slot[1],
        }
    }
}

/// The longest a refusal asks the caller to wait: a second.
const RETRY_MICROS: u64 = 1_000_000;

/// The slots `state` still holds at `now`.
fn held(state: State, now: u64) -> u64 {
    if state.end > now { state.count } else { 0 }
}

/// Decides one request of `cost` slots at `now` (microseconds). An admitted request
/// renews the slots held, its own with them; so does a request of cost 0.
#[must_use]
#[inline]
pub fn check(state: State, now: u64, quota: &Quota, cost: u64) -> (Decision, State) {
    let limit = quota.limit();
    let held = held(state, now);
    let reset = if held > 0 { state.end - now } else { 0 };
    if cost > limit {
        let d = Decision::refused(
            Denial::CostExceedsCapacity,
            limit,
            limit - held.min(limit),
            reset,
        );
        return (d, state);
    }
    if held + cost <= limit {
        let count = held + cost;
        if count == 0 {
            return (Decision::allow(limit, limit, 0, 0), State::default());
        }
        let period = quota.period_micros();
        let d = Decision::allow(limit, limit - count, period, 0);
        return (
            d,
            State {
                end: now + period,
                count,
            },
        );
    }
    let retry = quota.period_micros().min(RETRY_MICROS);
    let d = Decision::limited(limit, limit.saturating_sub(held), reset, retry);
    (d, state)
}

/// Gives `units` slots back at `now`; their expiry stays.
#[must_use]
pub fn refund(state: State, now: u64, _quota: &Quota, units: u64) -> State {
    match held(state, now).saturating_sub(units) {
        0 => State::default(),
        count => State {
            end: state.end,
            count,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota() -> Quota {
        Quota::with_period(2, std::time::Duration::from_secs(30)).unwrap()
    }

    #[test]
    fn slots_are_held_until_given_back() {
        let q = quota();
        let (a, s) = check(State::default(), 0, &q, 1);
        let (b, s) = check(s, 10, &q, 1);
        let (c, full) = check(s, 20, &q, 1);
        assert!(a.is_allowed() && b.is_allowed() && !c.is_allowed());
        assert_eq!((b.remaining(), c.remaining()), (0, 0));
        assert_eq!(c.retry_after_micros(), 1_000_000);
        let s = refund(full, 30, &q, 1);
        let (d, _) = check(s, 40, &q, 1);
        assert!(d.is_allowed());
    }

    #[test]
    fn slots_never_renewed_free_themselves_after_a_period_and_renewal_keeps_them() {
        let q = quota();
        let (_, s) = check(State::default(), 0, &q, 2);
        assert!(!check(s, 29_999_999, &q, 1).0.is_allowed());
        assert!(check(s, 30_000_000, &q, 1).0.is_allowed());
        // A check of cost 0 renews.
        let (_, renewed) = check(s, 20_000_000, &q, 0);
        assert_eq!(renewed.end, 50_000_000);
        assert!(!check(renewed, 40_000_000, &q, 1).0.is_allowed());
    }

    #[test]
    fn a_cost_above_the_slots_never_fits() {
        let (d, _) = check(State::default(), 0, &quota(), 3);
        assert_eq!(d.denial(), Some(Denial::CostExceedsCapacity));
        assert_eq!(d.retry_after(), None);
    }
}
