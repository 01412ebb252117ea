//! The random traces: a seeded generator, the quotas, the gaps and the costs.

use std::time::Duration;

use super::quota;
use crate::{Algorithm, Calendar, CalendarUnit, MAX_UNITS, Quota};

/// splitmix64: a small seeded generator, the same trace on every machine. So a failure
/// replays exactly.
///
/// # Examples
///
/// ```
/// use tollway_core::testing::Rng;
///
/// let (mut a, mut b) = (Rng(7), Rng(7));
/// assert_eq!(a.next_u64(), b.next_u64());
/// assert!(a.below(10) < 10);
/// ```
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        let z = crate::policy::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z
    }

    /// A number below `n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Quotas with uneven rates, short and long periods, bursts above and below the limit;
/// for the fixed window, a calendar day in Paris for the last (23 and 25 hours long on
/// the days the clocks change).
pub(super) fn quotas(algorithm: Algorithm) -> Vec<Quota> {
    let specs: [(u32, u64, u32); 5] = [
        (7, 3_000_000, 11),
        (100, 60_000_000, 100),
        (3, 1_000_000, 2),
        (50, 1_000, 64),
        (1, 86_400_000_000, 1),
    ];
    specs
        .iter()
        .map(|&(limit, period_us, burst)| {
            if algorithm == Algorithm::FixedWindow && period_us == 86_400_000_000 {
                let paris = Calendar::in_zone(CalendarUnit::Day, "Europe/Paris")
                    .expect("the bundled database has Paris");
                return Quota::per_calendar(limit.into(), paris).expect("a valid quota");
            }
            quota(algorithm, limit, Duration::from_micros(period_us), burst)
        })
        .collect()
}

/// `base` changed in the middle of a policy's part of a trace, as a reload or a change of
/// plan changes it: `phase` 0 is `base`, 1 raises its limit and burst, 2 cuts them, 3
/// changes the burst alone (the limit, for an algorithm with none). The period stays,
/// so callers' usage carries (see [`Policy::state_id`](crate::Policy::state_id)).
pub(super) fn changed(algorithm: Algorithm, base: &Quota, phase: u64) -> Quota {
    let (limit, burst) = (base.limit(), base.burst());
    let (limit, burst) = match phase {
        0 => (limit, burst),
        1 => (limit * 3, burst * 3 + 1),
        2 => ((limit / 3).max(1), (burst / 3).max(1)),
        _ if algorithm.uses_burst() => (limit, burst * 2),
        _ => (limit + 1, burst),
    };
    if let Some(calendar) = base.calendar() {
        return Quota::per_calendar(limit, calendar.clone()).expect("a valid quota");
    }
    let narrow = |n: u64| u32::try_from(n).expect("a trace's limits fit a u32");
    quota(algorithm, narrow(limit), base.period(), narrow(burst))
}

/// The next time gap: often none, often tiny, sometimes exactly to a period boundary,
/// sometimes a long idle stretch.
pub(super) fn gap(rng: &mut Rng, now: u64, quota: &Quota) -> u64 {
    let period = quota.period_micros();
    match rng.below(10) {
        0..=2 => 0,
        3..=4 => rng.below(quota.emission_micros() * 2) + 1,
        5 => period - now % period, // exactly on the next boundary
        6 => (period - now % period).saturating_sub(1).max(1), // one tick before it
        7 => quota.emission_micros(),
        8 => rng.below(period) + 1,
        _ => period * (1 + rng.below(20)), // long idle
    }
}

/// A random request's cost under `quota`: mostly 1, sometimes 0, sometimes over the
/// capacity. The suites' costs, for traces of your own.
pub fn cost(rng: &mut Rng, quota: &Quota, algorithm: Algorithm) -> u64 {
    let cap = if algorithm.uses_burst() {
        quota.burst()
    } else {
        quota.limit()
    };
    match rng.below(10) {
        0..=5 => 1,
        6 => 0,
        // Past the capacity: just past, past 2^53 (Lua's exact integers), or the most.
        7 => match rng.below(8) {
            0 => MAX_UNITS + 1,
            1 => u64::MAX,
            _ => cap + 1,
        },
        _ => 1 + rng.below(cap),
    }
}
