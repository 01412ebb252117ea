//! Sliding window counter: the current window's count plus a weighted share of the
//! previous window's.
//!
//! # Trade-off
//!
//! Two counters per key, like a fixed window, but without its boundary burst. The
//! previous window's count is weighted by how much of it the sliding period still
//! covers: `prev × (period − elapsed) / period + current`.
//!
//! The estimate assumes the previous window's traffic was spread evenly. So it can
//! decide differently from the exact log. A caller whose traffic bunches at the end of a
//! window can get up to nearly twice the limit in one period. To see how often that
//! happens on API-like traffic, beside the fixed window and the exact log, run
//! `cargo run --release --example compare` in a clone of the repository. Its `BENCHMARKS.md` has the figures ("Sliding
//! window counter vs the exact log").
//!
//! # Arithmetic
//!
//! The admission test `prev × (P − e) / P + cur + cost ≤ limit` is
//! multiplied through by `P`, so it compares integers and never divides.

use super::{Slot, SlotState};
use crate::{Decision, Denial, Quota};

/// Sliding window counter state for one key. `Default` is a fresh key.
///
/// The state stores when it stops mattering (`expires_at`), rather than the window's
/// start. The start follows from it and the period. It is `expires_at − 2P` while `curr`
/// is non-zero, and `expires_at − P` when only `prev` is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// When both counts have slid out of the period, in microseconds.
    pub expires_at: u64,
    /// Units admitted in the window before the current one.
    pub prev: u32,
    /// Units admitted in the current window.
    pub curr: u32,
}

impl SlotState for State {
    fn to_slot(self) -> Slot {
        [
            self.expires_at,
            (u64::from(self.prev) << 32) | u64::from(self.curr),
        ]
    }
    fn from_slot(slot: Slot) -> Self {
        State {
            expires_at: slot[0],
            prev: (slot[1] >> 32) as u32,
            curr: slot[1] as u32,
        }
    }
}

impl State {
    /// The start of the window `curr` counts, if any count is kept.
    fn own_start(self, period: u64) -> Option<u64> {
        if self.curr > 0 {
            Some(self.expires_at.saturating_sub(2 * period))
        } else if self.prev > 0 {
            Some(self.expires_at.saturating_sub(period))
        } else {
            None
        }
    }

    /// The start of the current window: `now`'s, or the state's when that is later (a
    /// node whose clock runs ahead wrote it), so skew never starts a window afresh.
    fn current_start(self, now: u64, quota: &Quota) -> u64 {
        let start = now - quota.rem_period(now);
        self.own_start(quota.period_micros())
            .map_or(start, |own| own.max(start))
    }

    /// The (prev, curr) counts as seen from the window starting at `start`.
    fn counts_at(self, start: u64, period: u64) -> (u64, u64) {
        let (prev, curr) = (u64::from(self.prev), u64::from(self.curr));
        let Some(own_start) = self.own_start(period) else {
            return (0, 0);
        };
        if own_start == start {
            (prev, curr)
        } else if own_start + period == start {
            (curr, 0)
        } else {
            (0, 0)
        }
    }

    fn at(start: u64, period: u64, prev: u64, curr: u64) -> Self {
        let expires_at = match (prev, curr) {
            (_, c) if c > 0 => start + 2 * period,
            (p, _) if p > 0 => start + period,
            _ => 0,
        };
        // Counts never exceed the limit: at most 2^26, as the limit is at most the
        // period and limit × period at most 2^52 (`Policy::new`).
        State {
            expires_at,
            prev: u32::try_from(prev).unwrap_or(u32::MAX),
            curr: u32::try_from(curr).unwrap_or(u32::MAX),
        }
    }
}

/// Decides one request of `cost` units at `now` (microseconds).
#[must_use]
#[inline]
pub fn check(state: State, now: u64, quota: &Quota, cost: u64) -> (Decision, State) {
    let (limit, period) = (quota.limit(), quota.period_micros());
    let start = state.current_start(now, quota);
    let elapsed = now.saturating_sub(start);
    let (prev, curr) = state.counts_at(start, period);
    // Everything below is scaled by the period: `used` is the weighted count × P.
    let used = |curr: u64| prev * (period - elapsed) + curr * period;
    let remaining = |curr: u64| quota.per_period((limit * period).saturating_sub(used(curr)));
    let reset = |curr: u64| match (prev, curr) {
        (_, c) if c > 0 => start + 2 * period - now,
        (p, _) if p > 0 => start + period - now,
        _ => 0,
    };
    if cost > limit {
        let d = Decision::refused(
            Denial::CostExceedsCapacity,
            limit,
            remaining(curr),
            reset(curr),
        );
        return (d, state);
    }
    if used(curr + cost) <= limit * period {
        let curr = curr + cost;
        let d = Decision::allow(limit, remaining(curr), reset(curr), 0);
        return (d, State::at(start, period, prev, curr));
    }
    let retry = retry_at(start, period, limit, prev, curr, cost) - now;
    let d = Decision::limited(limit, remaining(curr), reset(curr), retry);
    (d, state)
}

/// Gives `units` back at `now`: from the current window's count first, then from the
/// previous window's (a request charged just before the boundary).
#[must_use]
pub fn refund(state: State, now: u64, quota: &Quota, units: u64) -> State {
    let period = quota.period_micros();
    let start = state.current_start(now, quota);
    let (prev, curr) = state.counts_at(start, period);
    let from_prev = units.saturating_sub(curr);
    State::at(
        start,
        period,
        prev.saturating_sub(from_prev),
        curr.saturating_sub(units),
    )
}

/// Gives back `units` counted in the window ending at `end` and never spent (a lease's
/// unspent units): off the current window's count while it is that window, off the
/// previous window's once it has just ended. An older window's units weigh nothing.
#[must_use]
pub fn give_back(state: State, now: u64, quota: &Quota, units: u64, end: u64) -> State {
    let period = quota.period_micros();
    let start = state.current_start(now, quota);
    let (prev, curr) = state.counts_at(start, period);
    if start + period == end {
        State::at(start, period, prev, curr.saturating_sub(units))
    } else if start == end {
        State::at(start, period, prev.saturating_sub(units), curr)
    } else {
        state
    }
}

/// The first instant at which `cost` more units fit, given counts that do not fit now.
fn retry_at(start: u64, period: u64, limit: u64, prev: u64, curr: u64, cost: u64) -> u64 {
    // Later in this window, as the previous window's weight shrinks:
    // prev × (P − e) ≤ (limit − curr − cost) × P  ⇔  e ≥ P − ⌊(limit − curr − cost) × P / prev⌋.
    if prev > 0 && curr + cost <= limit {
        let e = period - (limit - curr - cost) * period / prev;
        if e < period {
            return start + e;
        }
    }
    // In the next window, where this window's count becomes the weighted one:
    // curr × (P − e) ≤ (limit − cost) × P. At e = P this is the window after, where
    // nothing is left to weigh, so the answer is never further away than that.
    let e = ((limit - cost) * period)
        .checked_div(curr)
        .map_or(0, |room| period - room.min(period));
    start + period + e
}

#[cfg(test)]
mod tests {
    use super::*;

    // A lease's unspent units come off the window they were counted in: the current one,
    // or the previous one once it has just ended; never a later window's count.
    #[test]
    fn units_given_back_leave_only_their_own_window() {
        let q = Quota::per_second(10).unwrap();
        let (_, lent) = check(State::default(), 200_000, &q, 6);
        assert_eq!((lent.prev, lent.curr), (0, 6));
        let back = give_back(lent, 500_000, &q, 4, 1_000_000);
        assert_eq!((back.prev, back.curr), (0, 2));
        // A window later, they are the previous window's.
        let later = give_back(lent, 1_300_000, &q, 4, 1_000_000);
        assert_eq!((later.prev, later.curr), (2, 0));
        assert!(check(later, 1_300_000, &q, 8).0.is_allowed());
        // Two windows later they weigh nothing: the state is left alone.
        assert_eq!(give_back(lent, 2_300_000, &q, 4, 1_000_000), lent);
        // A window's end that is not this one's or the last's changes nothing.
        assert_eq!(give_back(lent, 500_000, &q, 4, 2_000_000), lent);
    }
    use crate::algorithm::testing::run;

    /// Two nodes whose clocks are 0.5 s apart share a key. The one behind sees the
    /// window the one ahead wrote as the current one, at its very start. It does not
    /// start a new count. (It once did, and together they admitted nine times the
    /// limit.)
    #[test]
    fn a_later_window_written_by_a_clock_ahead_is_the_current_one() {
        let q = Quota::per_second(10).unwrap();
        let ds = run(check, &q, &[(1_200_000, 10), (700_000, 1)]);
        assert!(ds[0].is_allowed());
        assert!(!ds[1].is_allowed());
        assert_eq!(ds[1].remaining(), 0);
    }

    #[test]
    fn the_previous_window_is_weighted_by_how_much_of_it_is_still_in_the_period() {
        // 10 per second. 10 at the end of window 0; a quarter into window 1 the previous
        // window still weighs 7.5, so 2 more pass and the third is refused.
        let q = Quota::per_second(10).unwrap();
        let ds = run(check, &q, &[(999_000, 10), (1_250_000, 2), (1_250_000, 1)]);
        assert!(ds[1].is_allowed());
        assert_eq!(ds[1].remaining(), 0);
        assert!(!ds[2].is_allowed());
        // 10 × (1 − e) + 3 ≤ 10 first holds at e = 0.3 s.
        assert_eq!(ds[2].retry_after_micros(), 50_000);
    }

    #[test]
    fn no_boundary_burst_like_the_fixed_window() {
        let q = Quota::per_second(10).unwrap();
        let ds = run(check, &q, &[(999_000, 10), (1_000_000, 1)]);
        assert!(!ds[1].is_allowed());
        assert_eq!(ds[1].retry_after_micros(), 100_000);
    }

    #[test]
    fn a_refund_takes_from_this_window_then_the_last() {
        let q = Quota::per_second(10).unwrap();
        let (_, s) = check(State::default(), 900_000, &q, 6);
        let (_, s) = check(s, 1_000_000, &q, 2);
        let back = refund(s, 1_000_000, &q, 3);
        assert_eq!((back.prev, back.curr), (5, 0));
        assert_eq!(refund(s, 1_000_000, &q, 8), State::default());
    }

    #[test]
    fn a_full_current_window_waits_into_the_next() {
        let q = Quota::per_second(4).unwrap();
        let ds = run(check, &q, &[(0, 4), (500_000, 1)]);
        // In window 1, 4 × (1 − e) + 1 ≤ 4 from e = 0.25 s.
        assert_eq!(ds[1].retry_after_micros(), 750_000);
        assert_eq!(ds[1].reset_after_micros(), 1_500_000);
    }
}
