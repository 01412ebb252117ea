//! Sliding window log: the time of every admitted unit in the last period.
//!
//! # Trade-off
//!
//! Exact: in *any* window of one period, at most `limit` units pass, whatever the
//! alignment. The retry time is the moment the oldest blocking entry slides out.
//!
//! The price is memory that grows with the limit. There is one entry per admitted
//! request still inside the period. Requests at the same microsecond share an entry.
//! The log suits low limits on expensive operations. For high limits, prefer the
//! sliding window counter or a bucket.

use std::collections::VecDeque;

use crate::{Decision, Denial, Quota};

/// Sliding window log state for one key: admitted requests still inside the period, as
/// `(time in microseconds, units)`, oldest first. `Default` is a fresh key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Log {
    entries: VecDeque<(u64, u64)>,
    total: u64,
    expires_at: u64,
}

impl Log {
    /// When every entry has slid out of the period, in microseconds.
    #[must_use]
    pub fn expires_at(&self) -> u64 {
        self.expires_at
    }

    /// Admitted requests still remembered, as `(time, units)`, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.entries.iter().copied()
    }

    /// Drops the entries that have slid out of the period ending at `now`.
    fn trim(&mut self, now: u64, period: u64) {
        while let Some(&(at, units)) = self.entries.front() {
            if at + period > now {
                break;
            }
            self.entries.pop_front();
            self.total -= units;
        }
    }
}

/// Decides one request of `cost` units at `now` (microseconds), updating `log` in place
/// (a log can be long, so it is not copied the way the fixed-size states are).
pub fn check(log: &mut Log, now: u64, quota: &Quota, cost: u64) -> Decision {
    let decision = decide(log, now, quota, cost);
    if decision.is_allowed() {
        admit(log, now, quota, cost);
    }
    decision
}

/// Decides one request of `cost` units at `now` without admitting it.
///
/// The decision is the one an admission would give, so an allowed one counts the
/// request as admitted. Meanwhile `log` only loses the entries that have slid out.
/// [`admit`] then records the request. A store that decides several limits at once
/// admits into each log only when all of them allow.
pub fn decide(log: &mut Log, now: u64, quota: &Quota, cost: u64) -> Decision {
    let (limit, period) = (quota.limit(), quota.period_micros());
    log.trim(now, period);
    let reset = log
        .entries
        .back()
        .map_or(0, |&(at, _)| (at + period).saturating_sub(now));
    if cost > limit || cost > crate::policy::MAX_SLIDING_LOG_COST {
        return Decision::refused(
            Denial::CostExceedsCapacity,
            limit,
            limit.saturating_sub(log.total),
            reset,
        );
    }
    if log.total + cost <= limit {
        // Admitted now, the newest entry is now's, unless the request is free (or a clock
        // behind wrote a newer one).
        let reset = if cost > 0 { reset.max(period) } else { reset };
        return Decision::allow(limit, limit - log.total - cost, reset, 0);
    }
    // Wait until enough of the oldest entries have slid out.
    let mut left = log.total;
    let mut retry = 0;
    for &(at, units) in &log.entries {
        left -= units;
        if left + cost <= limit {
            retry = at + period - now;
            break;
        }
    }
    Decision::limited(limit, limit.saturating_sub(log.total), reset, retry)
}

/// Records a request of `cost` units at `now` that [`decide`] allowed.
pub fn admit(log: &mut Log, now: u64, quota: &Quota, cost: u64) {
    if cost == 0 {
        return;
    }
    // Entries stay in time order even when `now` is before the newest (a node whose
    // clock runs behind another's), as in Redis's sorted set.
    let at = match log.entries.back() {
        Some(&(newest, _)) if newest > now => log.entries.partition_point(|&(t, _)| t <= now),
        _ => log.entries.len(),
    };
    match at.checked_sub(1).and_then(|i| log.entries.get_mut(i)) {
        Some((t, units)) if *t == now => *units += cost,
        _ => log.entries.insert(at, (now, cost)),
    }
    log.total += cost;
    log.expires_at = log.expires_at.max(now + quota.period_micros());
}

/// Gives back the `units` admitted last (the newest entries), as of `now`.
pub fn refund(log: &mut Log, now: u64, quota: &Quota, units: u64) {
    let period = quota.period_micros();
    log.trim(now, period);
    let mut left = units;
    while left > 0 {
        let Some((_, newest)) = log.entries.back_mut() else {
            break;
        };
        let taken = left.min(*newest);
        *newest -= taken;
        log.total -= taken;
        left -= taken;
        if *newest == 0 {
            log.entries.pop_back();
        }
    }
    log.expires_at = log.entries.back().map_or(0, |&(at, _)| at + period);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(q: &Quota, trace: &[(u64, u64)]) -> Vec<Decision> {
        let mut log = Log::default();
        trace
            .iter()
            .map(|&(now, cost)| check(&mut log, now, q, cost))
            .collect()
    }

    /// An entry from a clock behind the newest entry's goes where its time sorts, as in
    /// Redis's sorted set: it slides out first, and the reset time is the newest entry's.
    #[test]
    fn an_entry_from_a_clock_behind_sorts_by_its_time() {
        let q = Quota::per_second(2).unwrap();
        let ds = run(&q, &[(1_500_000, 1), (1_000_000, 1), (2_100_000, 1)]);
        assert!(ds[1].is_allowed());
        assert_eq!(ds[1].reset_after_micros(), 1_500_000);
        // At 2.1 s the 1.0 s entry has slid out, the 1.5 s one has not.
        assert!(ds[2].is_allowed());
        assert_eq!(ds[2].remaining(), 0);
    }

    #[test]
    fn no_window_of_one_period_admits_more_than_the_limit_even_across_a_boundary() {
        let q = Quota::per_second(10).unwrap();
        let ds = run(
            &q,
            &[
                (999_000, 10),
                (1_000_000, 1),
                (1_998_999, 1),
                (1_999_000, 1),
            ],
        );
        assert!(!ds[1].is_allowed());
        assert_eq!(ds[1].retry_after_micros(), 999_000);
        assert!(!ds[2].is_allowed());
        assert_eq!(ds[2].retry_after_micros(), 1);
        assert!(ds[3].is_allowed());
    }

    #[test]
    fn the_retry_time_is_when_enough_old_entries_slide_out() {
        let q = Quota::per_second(5).unwrap();
        let ds = run(&q, &[(0, 2), (100, 2), (200, 1), (300, 3)]);
        // 3 more units need the entries at 0 and 100 gone: at 1_000_100.
        assert_eq!(ds[3].retry_after_micros(), 1_000_100 - 300);
    }

    #[test]
    fn a_refund_forgets_the_newest_units() {
        let q = Quota::per_second(5).unwrap();
        let mut log = Log::default();
        let _ = check(&mut log, 0, &q, 2);
        let _ = check(&mut log, 100, &q, 2);
        refund(&mut log, 100, &q, 3);
        assert_eq!(log.entries().collect::<Vec<_>>(), [(0, 1)]);
        assert_eq!(log.expires_at(), 1_000_000);
        refund(&mut log, 100, &q, 3);
        assert_eq!(log, Log::default());
    }

    #[test]
    fn requests_in_one_microsecond_share_an_entry() {
        let q = Quota::per_second(5).unwrap();
        let mut log = Log::default();
        for _ in 0..5 {
            assert!(check(&mut log, 7, &q, 1).is_allowed());
        }
        assert_eq!(log.entries().collect::<Vec<_>>(), [(7, 5)]);
    }
}
