//! Token bucket: a bucket of `burst` tokens, refilled at `limit` per `period`.
//!
//! # Trade-off
//!
//! Allows a burst of up to the full capacity at once, then a steady `limit` per
//! `period`. In any window of one period, at most `burst + limit` units pass. The state
//! is two integers per key. The refill is exact. There is no rounding of the rate,
//! however unevenly the limit divides the period.
//!
//! # Arithmetic
//!
//! Tokens are counted in *ticks*. One token is `period` ticks, and one microsecond
//! refills `limit` ticks. So refilling `limit` tokens per `period` microseconds needs no
//! division.
//!
//! The state is the instant the bucket will be full again (`full_at`, microseconds),
//! and `frac`. `frac` is the part of a microsecond's refill already counted in it
//! (`0 <= frac < limit` ticks). The deficit at `now` is `(full_at - now) × limit - frac`.

use super::{Slot, SlotState};
use crate::quota::{MAX_EXACT, most_owed};
use crate::{Decision, Denial, Quota};

/// Token bucket state for one key. `Default` is a full bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// When the bucket is full again, in microseconds.
    pub full_at: u64,
    /// Ticks of the last microsecond before `full_at` already refilled.
    pub frac: u64,
}

impl State {
    /// Ticks missing from a full bucket at `now` (at most 2^52: the capacity and a debt,
    /// see [`charge`]), and the microseconds until it is full again: `ceil(ticks /
    /// limit)`, found without a division when it can be.
    #[inline]
    fn deficit(self, now: u64, quota: &Quota) -> (u64, u64) {
        if now >= self.full_at {
            return (0, 0);
        }
        // That many microseconds refill the most a bucket can miss.
        let ahead = (self.full_at - now).min(quota.owed_micros());
        let ticks = (ahead * quota.limit()).saturating_sub(self.frac);
        if ticks >= MAX_EXACT {
            return (MAX_EXACT, quota.owed_micros());
        }
        // Every state this module makes keeps `frac` below one microsecond's worth of
        // ticks (`limit`), so `ticks` needs all `ahead` microseconds to refill, no fewer.
        let us = if self.frac < quota.limit() {
            ahead
        } else {
            quota.per_limit_ceil(ticks)
        };
        (ticks, us)
    }

    /// The state with `deficit` ticks missing at `now`, and how long until it is full.
    #[inline]
    fn with_deficit(now: u64, deficit: u64, quota: &Quota) -> (Self, u64) {
        let us = quota.per_limit_ceil(deficit);
        let state = State {
            full_at: now + us,
            frac: us * quota.limit() - deficit,
        };
        (state, us)
    }
}

impl SlotState for State {
    fn to_slot(self) -> Slot {
        [self.full_at, self.frac]
    }
    fn from_slot(slot: Slot) -> Self {
        State {
            full_at: slot[0],
            frac: slot[1],
        }
    }
}

/// Decides one request of `cost` units at `now` (microseconds).
#[must_use]
#[inline]
pub fn check(state: State, now: u64, quota: &Quota, cost: u64) -> (Decision, State) {
    let period = quota.period_micros();
    let cap = quota.burst() * period;
    let (deficit, reset) = state.deficit(now, quota);
    let remaining = |deficit: u64| quota.per_period(cap.saturating_sub(deficit));
    if cost > quota.burst() {
        let d = Decision::refused(
            Denial::CostExceedsCapacity,
            quota.burst(),
            remaining(deficit),
            reset,
        );
        return (d, state);
    }
    let after = deficit + cost * period;
    if after <= cap {
        let (state, reset) = State::with_deficit(now, after, quota);
        let d = Decision::allow(quota.burst(), remaining(after), reset, 0);
        (d, state)
    } else {
        let retry = quota.per_limit_ceil(after - cap);
        let d = Decision::limited(quota.burst(), remaining(deficit), reset, retry);
        (d, state)
    }
}

/// Gives `units` back to the bucket at `now`, up to full: the state after a request of
/// `units` is undone (it failed, or cost less than charged). A debt is paid back first.
#[must_use]
pub fn refund(state: State, now: u64, quota: &Quota, units: u64) -> State {
    let (deficit, _) = state.deficit(now, quota);
    let period = quota.period_micros();
    // At most what a bucket can miss, so the product stays within 2^52.
    let back = units.min(most_owed(period)) * period;
    State::with_deficit(now, deficit.saturating_sub(back), quota).0
}

/// Takes `units` at `now` whether or not they fit: a cost learnt after the fact.
///
/// The bucket runs past empty. What did not fit is a debt the caller then waits out,
/// at the usual refill rate, before anything fits again. It is kept up to 2^52 ticks
/// missing in all ([`Operation::Charge`](crate::Operation::Charge)): 75 million units
/// for a minute's period.
#[must_use]
pub fn charge(state: State, now: u64, quota: &Quota, units: u64) -> State {
    let (deficit, _) = state.deficit(now, quota);
    let period = quota.period_micros();
    // Both terms are within 2^52, so their sum is exact in Lua too.
    let owed = units.min(most_owed(period)) * period;
    State::with_deficit(now, (deficit + owed).min(MAX_EXACT), quota).0
}

/// The state written at `from`'s rate, as a state at `to`'s: what was missing at `now`
/// stays missing, and refills at `to`'s rate from then on. A debt is kept; a bucket
/// missing more than `to`'s capacity refuses until it is back within it.
///
/// The two quotas have the same period: a token is `period` ticks in both.
#[must_use]
pub fn carry(state: State, now: u64, from: &Quota, to: &Quota) -> State {
    let (deficit, _) = state.deficit(now, from);
    State::with_deficit(now, deficit, to).0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::testing::run;

    #[test]
    fn a_charge_past_empty_is_owed_and_waited_out() {
        // 2 a second, capacity 4: 7 charged at once leave 3 owed, so one unit fits
        // 2 s later (the 3 owed and its own), and 20 owe 16, waited out for 8.5 s.
        let q = Quota::per_second(2).unwrap().with_burst(4).unwrap();
        let owed = charge(State::default(), 0, &q, 7);
        let (d, _) = check(owed, 0, &q, 1);
        assert!(!d.is_allowed());
        assert_eq!(d.remaining(), 0);
        assert_eq!(d.retry_after_micros(), 2_000_000);
        assert_eq!(d.reset_after_micros(), 3_500_000);
        assert!(check(owed, 2_000_000, &q, 1).0.is_allowed());
        let most = charge(State::default(), 0, &q, 20);
        assert_eq!(check(most, 0, &q, 0).0.reset_after_micros(), 10_000_000);
        assert_eq!(check(most, 0, &q, 1).0.retry_after_micros(), 8_500_000);
        // A refund pays the debt back first: 3 back leave the bucket empty, 4 a unit.
        assert!(!check(refund(owed, 0, &q, 3), 0, &q, 1).0.is_allowed());
        assert!(check(refund(owed, 0, &q, 4), 0, &q, 1).0.is_allowed());
    }

    #[test]
    fn a_full_bucket_lets_a_burst_through_then_the_refill_rate() {
        let q = Quota::per_second(2).unwrap().with_burst(5).unwrap();
        // Five at t=0 pass, the sixth is told to come back in exactly 0.5 s.
        let ds = run(check, &q, &[(0, 1); 6]);
        assert!(ds[..5].iter().all(Decision::is_allowed));
        assert_eq!(ds[4].remaining(), 0);
        assert_eq!(ds[5].retry_after_micros(), 500_000);
        // One token per 0.5 s afterwards: 499_999 µs is one tick too early.
        let ds = run(
            check,
            &q,
            &[
                (0, 5),
                (499_999, 1),
                (500_000, 1),
                (500_001, 1),
                (1_000_000, 1),
            ],
        );
        let allowed: Vec<bool> = ds.iter().map(Decision::is_allowed).collect();
        assert_eq!(allowed, [true, false, true, false, true]);
    }

    #[test]
    fn refill_is_exact_when_the_limit_does_not_divide_the_period() {
        // 3 per second: a token every 333_333.3… µs, so three tokens are back at exactly
        // 1 s. (GCRA, which rounds its interval up to 333_334 µs, needs 1_000_002 µs.)
        let q = Quota::per_second(3).unwrap();
        let ds = run(check, &q, &[(0, 3), (999_999, 3), (1_000_000, 3)]);
        let allowed: Vec<bool> = ds.iter().map(Decision::is_allowed).collect();
        assert_eq!(allowed, [true, false, true]);
        assert_eq!(ds[1].retry_after_micros(), 1);
        assert_eq!(ds[1].remaining(), 2);
    }

    #[test]
    fn a_long_idle_gap_refills_to_capacity_and_no_further() {
        let q = Quota::per_minute(10).unwrap();
        let ds = run(check, &q, &[(0, 10), (u64::MAX / 4, 10), (u64::MAX / 4, 1)]);
        assert!(ds[1].is_allowed());
        assert_eq!(ds[2].denial(), Some(Denial::Limited));
        assert_eq!(ds[2].retry_after_micros(), 6_000_000);
    }

    #[test]
    fn a_refund_gives_back_what_a_request_took_and_no_more() {
        let q = Quota::per_second(10).unwrap();
        let (_, s) = check(State::default(), 0, &q, 4);
        let back = refund(s, 0, &q, 3);
        assert_eq!(check(back, 0, &q, 0).0.remaining(), 9);
        let full = refund(s, 0, &q, u64::MAX);
        assert_eq!(check(full, 0, &q, 0).0, check(State::default(), 0, &q, 0).0);
    }

    #[test]
    fn a_carried_bucket_keeps_what_was_used_at_the_new_rate() {
        // 20 a minute, all 20 used; cut to 10: 20 missing of 10 refuses for a minute,
        // then refills at 10 a minute. Raised to 100 instead: 80 left at once.
        let twenty = Quota::per_minute(20).unwrap();
        let ten = Quota::per_minute(10).unwrap();
        let hundred = Quota::per_minute(100).unwrap();
        let (_, used) = check(State::default(), 0, &twenty, 20);
        let cut = carry(used, 0, &twenty, &ten);
        let (d, _) = check(cut, 0, &ten, 1);
        assert_eq!(d.retry_after_micros(), 66_000_000);
        assert!(!check(cut, 65_999_999, &ten, 1).0.is_allowed());
        assert!(check(cut, 66_000_000, &ten, 1).0.is_allowed());
        let raised = carry(used, 0, &twenty, &hundred);
        assert_eq!(check(raised, 0, &hundred, 0).0.remaining(), 80);
        // Half a minute at the old rate refills 10 before the carry.
        let later = carry(used, 30_000_000, &twenty, &hundred);
        assert_eq!(check(later, 30_000_000, &hundred, 0).0.remaining(), 90);
        // A full bucket carries as a fresh one.
        assert_eq!(carry(used, 60_000_000, &twenty, &ten).full_at, 60_000_000);
    }

    #[test]
    fn reset_after_is_the_time_to_refill_completely() {
        let q = Quota::per_second(10).unwrap();
        let ds = run(check, &q, &[(0, 4)]);
        assert_eq!(ds[0].reset_after_micros(), 400_000);
        assert_eq!(ds[0].remaining(), 6);
    }
}
