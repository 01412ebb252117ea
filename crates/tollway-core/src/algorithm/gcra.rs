//! GCRA, the generic cell rate algorithm: one timestamp per key.
//!
//! # Trade-off
//!
//! GCRA decides like a token bucket of capacity `burst`: a burst, then a
//! steady rate. But it stores a single integer per key, the *theoretical arrival time*
//! (TAT). That is when the bucket would be full again.
//!
//! The spacing between units is `period / limit` rounded **up** to a whole microsecond.
//! So when the limit does not divide the period evenly, GCRA admits very slightly less
//! than the quota, never more. The token bucket is the exact choice then.
//!
//! # Arithmetic
//!
//! With emission interval `T` and capacity `B`, a request of cost `c`
//! at `now` moves the TAT to `max(tat, now) + c·T` and passes when that is no more than
//! `B·T` ahead of `now`.

use super::{Slot, SlotState};
use crate::quota::{MAX_EXACT, most_owed};
use crate::{Decision, Denial, Quota};

/// GCRA state for one key: the theoretical arrival time in microseconds. `Default` is a
/// fresh key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// The theoretical arrival time.
    pub tat: u64,
}

impl SlotState for State {
    fn to_slot(self) -> Slot {
        [self.tat, 0]
    }
    fn from_slot(slot: Slot) -> Self {
        State { tat: slot[0] }
    }
}

/// Decides one request of `cost` units at `now` (microseconds).
// Inline across crates: the memory store's lock-free check is generic over its clock,
// so it is compiled in the caller's crate, where a call here (its decision returned
// through memory) cost about a third of a check (BENCHMARKS.md, issue 19).
#[must_use]
#[inline]
pub fn check(state: State, now: u64, quota: &Quota, cost: u64) -> (Decision, State) {
    let t = quota.emission_micros();
    let window = quota.burst() * t;
    let start = state.tat.max(now);
    let remaining = |ahead: u64| quota.per_emission(window.saturating_sub(ahead));
    let ahead = start - now;
    if cost > quota.burst() {
        let d = Decision::refused(
            Denial::CostExceedsCapacity,
            quota.burst(),
            remaining(ahead),
            ahead,
        );
        return (d, state);
    }
    let tat = start + cost * t;
    let ahead_after = tat - now;
    if ahead_after <= window {
        let d = Decision::allow(quota.burst(), remaining(ahead_after), ahead_after, 0);
        (d, State { tat })
    } else {
        let d = Decision::limited(quota.burst(), remaining(ahead), ahead, ahead_after - window);
        (d, state)
    }
}

/// Gives `units` back at `now`, up to a fresh key's capacity: the theoretical arrival
/// time moves back by their emission intervals, never before `now`.
#[must_use]
pub fn refund(state: State, now: u64, quota: &Quota, units: u64) -> State {
    let t = quota.emission_micros();
    // At most what a key can owe, so the product stays within 2^52.
    let back = units.min(most_owed(t)) * t;
    State {
        tat: state.tat.saturating_sub(back).max(now),
    }
}

/// Takes `units` at `now` whether or not they fit: a cost learnt after the fact.
///
/// The arrival time moves on by their emission intervals, past empty. That is a debt the
/// caller then waits out before anything fits again. It is kept up to 2^52 µs ahead of
/// `now` (142 years: see [`Operation::Charge`](crate::Operation::Charge)).
#[must_use]
pub fn charge(state: State, now: u64, quota: &Quota, units: u64) -> State {
    let t = quota.emission_micros();
    // Both terms are within 2^52, so their sum is exact in Lua too.
    let ahead = state.tat.saturating_sub(now).min(MAX_EXACT) + units.min(most_owed(t)) * t;
    State {
        tat: now + ahead.min(MAX_EXACT),
    }
}

/// The state written at `from`'s emission interval, as a state at `to`'s: the units
/// still ahead at `now` (a part of one counted whole) stay ahead, at `to`'s interval.
/// A debt is kept, up to 2^52 µs ahead.
#[must_use]
pub fn carry(state: State, now: u64, from: &Quota, to: &Quota) -> State {
    let ahead = state.tat.saturating_sub(now).min(MAX_EXACT);
    let units = ahead.div_ceil(from.emission_micros());
    let t = to.emission_micros();
    State {
        tat: now + (units.min(most_owed(t)) * t).min(MAX_EXACT),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::testing::run;

    #[test]
    fn a_charge_past_empty_is_owed_and_waited_out() {
        // 10 a second, capacity 10: 15 charged at once leave 5 owed, so the next unit
        // fits 0.6 s later (the 5 owed and its own), and 300 owe 290: a debt is kept.
        let q = Quota::per_second(10).unwrap();
        let owed = charge(State::default(), 0, &q, 15);
        assert_eq!(owed.tat, 1_500_000);
        let (d, _) = check(owed, 0, &q, 1);
        assert!(!d.is_allowed());
        assert_eq!((d.remaining(), d.retry_after_micros()), (0, 600_000));
        let (d, _) = check(owed, 600_000, &q, 1);
        assert!(d.is_allowed());
        assert_eq!(charge(State::default(), 0, &q, 300).tat, 30_000_000);
        // It is kept up to 2^52 µs ahead, whatever is charged.
        let most = charge(State { tat: 1 << 53 }, 0, &q, u64::MAX);
        assert_eq!(most.tat, 1 << 52);
        // A request of cost 0 passes an empty limit, not one that owes.
        assert!(
            check(charge(State::default(), 0, &q, 10), 0, &q, 0)
                .0
                .is_allowed()
        );
        assert!(!check(owed, 0, &q, 0).0.is_allowed());
    }

    #[test]
    fn a_burst_of_capacity_passes_then_one_per_emission_interval() {
        let q = Quota::per_second(4).unwrap().with_burst(2).unwrap();
        let ds = run(
            check,
            &q,
            &[(0, 1), (0, 1), (0, 1), (249_999, 1), (250_000, 1)],
        );
        let allowed: Vec<bool> = ds.iter().map(Decision::is_allowed).collect();
        assert_eq!(allowed, [true, true, false, false, true]);
        assert_eq!(ds[2].retry_after_micros(), 250_000);
        assert_eq!(ds[3].retry_after_micros(), 1);
    }

    #[test]
    fn uneven_rates_round_the_interval_up_and_never_admit_faster() {
        let q = Quota::per_second(3).unwrap().with_burst(1).unwrap();
        let ds = run(check, &q, &[(0, 1), (333_333, 1), (333_334, 1)]);
        assert!(!ds[1].is_allowed());
        assert!(ds[2].is_allowed());
    }

    #[test]
    fn a_refund_moves_the_arrival_time_back_and_no_further_than_now() {
        let q = Quota::per_second(4).unwrap();
        let (_, s) = check(State::default(), 0, &q, 3);
        assert_eq!(refund(s, 0, &q, 1).tat, 500_000);
        assert_eq!(refund(s, 100_000, &q, 9).tat, 100_000);
    }

    #[test]
    fn a_carried_arrival_time_keeps_the_units_ahead() {
        // 100 a minute, 30 used; raised to 10,000: 9,970 left. Cut to 20: 10 owed.
        let free = Quota::per_minute(100).unwrap();
        let pro = Quota::per_minute(10_000).unwrap();
        let cut = Quota::per_minute(20).unwrap();
        let (_, used) = check(State::default(), 0, &free, 30);
        let raised = carry(used, 0, &free, &pro);
        assert_eq!(check(raised, 0, &pro, 0).0.remaining(), 9_970);
        let lowered = carry(used, 0, &free, &cut);
        assert_eq!(lowered.tat, 30 * 3_000_000);
        assert_eq!(
            check(lowered, 0, &cut, 1).0.retry_after_micros(),
            33_000_000
        );
        // A part of a unit still ahead counts whole: never more than was left.
        assert_eq!(carry(used, 17_999_999, &free, &pro).tat, 17_999_999 + 6_000);
    }

    #[test]
    fn cost_above_capacity_is_refused_without_a_retry_time() {
        let q = Quota::per_second(10).unwrap();
        let ds = run(check, &q, &[(0, 11)]);
        assert_eq!(ds[0].denial(), Some(Denial::CostExceedsCapacity));
        assert_eq!(ds[0].retry_after(), None);
        assert_eq!(ds[0].remaining(), 10);
    }
}
