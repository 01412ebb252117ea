//! Fixed window: a counter per key that resets at every multiple of the period.
//!
//! # Trade-off
//!
//! The cheapest to understand and to store: one counter and the window's end. The
//! `X-RateLimit-Reset` time is the same for everyone.
//!
//! Its weakness is the boundary. A caller can spend the whole limit at the end of one
//! window, and again at the start of the next. So up to **twice the limit** passes
//! within one period. The sliding window algorithms exist to close that gap.
//!
//! Windows are aligned to multiples of the period on the clock that supplies `now`. In
//! Redis, that is the Unix epoch. A calendar quota's windows are its calendar's instead:
//! a day, a month, on a zone's wall clock (see [`calendar`](crate::calendar)). A node
//! whose clock runs ahead may write a state from a later window than `now`'s. That state is taken as the current window. So clock skew
//! between nodes shifts a window's end, but never starts a window afresh.

use super::{Slot, SlotState};
use crate::{Decision, Denial, Quota};

/// Fixed window state for one key. `Default` is a fresh key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// The end of the window `count` belongs to, in microseconds.
    pub end: u64,
    /// Units admitted in that window.
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

/// The end of the current window: `now`'s, or the state's when that is later. A
/// calendar quota's windows are its calendar's (see [`Quota::per_calendar`]).
fn window_end(state: State, now: u64, quota: &Quota) -> u64 {
    let end = match quota.calendar() {
        None => now - quota.rem_period(now) + quota.period_micros(),
        Some(calendar) => calendar.window(now).1,
    };
    end.max(state.end)
}

/// Decides one request of `cost` units at `now` (microseconds).
#[must_use]
#[inline]
pub fn check(state: State, now: u64, quota: &Quota, cost: u64) -> (Decision, State) {
    let limit = quota.limit();
    let end = window_end(state, now, quota);
    let count = if state.end == end { state.count } else { 0 };
    let reset = |count: u64| if count > 0 { end - now } else { 0 };
    if cost > limit {
        let d = Decision::refused(
            Denial::CostExceedsCapacity,
            limit,
            limit.saturating_sub(count),
            reset(count),
        );
        return (d, state);
    }
    if count + cost <= limit {
        let count = count + cost;
        let d = Decision::allow(limit, limit - count, reset(count), 0);
        // An empty window is a fresh key: keep nothing for it.
        let end = if count > 0 { end } else { 0 };
        (d, State { end, count })
    } else {
        let d = Decision::limited(limit, limit.saturating_sub(count), end - now, end - now);
        (d, state)
    }
}

/// Gives `units` back to the current window at `now` (a window that has ended is fresh
/// already).
#[must_use]
pub fn refund(state: State, now: u64, quota: &Quota, units: u64) -> State {
    let end = window_end(state, now, quota);
    match state.count.saturating_sub(units) {
        count if state.end == end && count > 0 => State { end, count },
        _ => State::default(),
    }
}

/// Gives back `units` taken from the window ending at `end` and never spent (a lease's
/// unspent units): off its count while it is still the current window. Once it has
/// ended its count is gone anyway, and a later window's count is left alone.
#[must_use]
pub fn give_back(state: State, now: u64, quota: &Quota, units: u64, end: u64) -> State {
    if state.end != end || window_end(state, now, quota) != end {
        return state;
    }
    match state.count.saturating_sub(units) {
        0 => State::default(),
        count => State { end, count },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::testing::run;

    /// Two nodes whose clocks are 0.5 s apart share a key. The one behind sees the
    /// window the one ahead wrote as the current one. It does not start a new count.
    /// (It once did, and together they admitted eight times the limit.)
    #[test]
    fn a_later_window_written_by_a_clock_ahead_is_the_current_one() {
        let q = Quota::per_second(10).unwrap();
        // Ahead: 1.2 s (window 1) takes all 10. Behind: 0.7 s (window 0) gets none, and
        // is told to wait for window 1's end, 1.3 s away.
        let ds = run(check, &q, &[(1_200_000, 10), (700_000, 1)]);
        assert!(ds[0].is_allowed());
        assert!(!ds[1].is_allowed());
        assert_eq!(ds[1].retry_after_micros(), 1_300_000);
    }

    #[test]
    fn the_window_boundary_admits_twice_the_limit_within_one_period() {
        // The documented weakness: 10 per second, 10 at 0.999 s and 10 more at 1.000 s —
        // twenty requests inside one millisecond.
        let q = Quota::per_second(10).unwrap();
        let ds = run(check, &q, &[(999_000, 10), (999_999, 1), (1_000_000, 10)]);
        assert!(ds[0].is_allowed());
        assert!(!ds[1].is_allowed());
        assert_eq!(ds[1].retry_after_micros(), 1);
        assert!(ds[2].is_allowed());
    }

    #[test]
    fn a_refund_counts_only_in_the_window_that_charged() {
        let q = Quota::per_second(10).unwrap();
        let (_, s) = check(State::default(), 100, &q, 6);
        assert_eq!(refund(s, 200, &q, 2).count, 4);
        assert_eq!(refund(s, 200, &q, 7), State::default());
        assert_eq!(refund(s, 1_000_000, &q, 1), State::default());
    }

    // A lease's unspent units go back to the window they came from, and to no other: a
    // later window's count is other requests' and stays.
    #[test]
    fn units_given_back_leave_only_their_own_window() {
        let q = Quota::per_second(10).unwrap();
        let (_, lent) = check(State::default(), 200_000, &q, 6);
        assert_eq!(
            lent,
            State {
                end: 1_000_000,
                count: 6
            }
        );
        let back = give_back(lent, 500_000, &q, 4, 1_000_000);
        assert_eq!(
            back,
            State {
                end: 1_000_000,
                count: 2
            }
        );
        assert_eq!(give_back(lent, 500_000, &q, 9, 1_000_000), State::default());
        // Too late: the window ended, and the next one's count is another's.
        let (_, next) = check(lent, 1_100_000, &q, 3);
        assert_eq!(give_back(next, 1_200_000, &q, 4, 1_000_000), next);
        assert_eq!(give_back(lent, 1_200_000, &q, 4, 1_000_000), lent);
    }

    #[test]
    fn reset_is_the_end_of_the_window() {
        let q = Quota::per_minute(100).unwrap();
        let ds = run(check, &q, &[(15_000_000, 1)]);
        assert_eq!(ds[0].reset_after_micros(), 45_000_000);
        assert_eq!(ds[0].remaining(), 99);
    }
}
