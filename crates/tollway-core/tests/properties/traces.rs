//! Quotas and traces: the strategies that generate them.

use super::*;

/// Periods in microseconds: a millisecond (the finest rates), a second, an uneven seven
/// seconds and a minute.
pub(crate) const PERIODS: [u64; 4] = [1_000, 1_000_000, 7_000_000, 60_000_000];

pub(crate) fn quota(limit: u32, period_us: u64, burst: u32) -> Quota {
    Quota::with_period(limit.into(), Duration::from_micros(period_us))
        .unwrap()
        .with_burst(burst.into())
        .unwrap()
}

/// A quota for the bucket algorithms: limit, period and an independent burst.
pub(crate) fn bucket_quota() -> impl Strategy<Value = Quota> {
    (1u32..=50, select(&PERIODS[..]), 1u32..=60).prop_map(|(l, p, b)| quota(l, p, b))
}

/// A quota for the window algorithms, whose burst is always the limit.
pub(crate) fn window_quota() -> impl Strategy<Value = Quota> {
    (1u32..=50, select(&PERIODS[..])).prop_map(|(l, p)| quota(l, p, l))
}

/// A bucket quota whose limit divides its period, so that GCRA's emission interval
/// `period / limit` needs no rounding.
pub(crate) fn even_quota() -> impl Strategy<Value = Quota> {
    (select(&PERIODS[..]), any::<Index>(), 1u32..=60).prop_map(|(p, i, b)| {
        let divisors: Vec<u32> = (1..=50).filter(|&l| p % u64::from(l) == 0).collect();
        quota(*i.get(&divisors), p, b)
    })
}

/// The time between one request and the next, resolved against the quota.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Gap {
    /// The same microsecond.
    Zero,
    /// A few microseconds.
    Small(u64),
    /// One emission interval, give or take a microsecond or two.
    NearEmission(i64),
    /// Anywhere from nothing to four emission intervals (in 250ths of one).
    Spread(u64),
    /// To the next multiple of the period (the window boundary), give or take one.
    ToBoundary(i64),
    /// Exactly one period, give or take one microsecond.
    Period(i64),
    /// An idle stretch of whole periods plus a fraction (in 1000ths) of one.
    Idle(u64, u64),
}

impl Gap {
    fn after(self, now: u64, q: &Quota) -> u64 {
        let (p, t) = (q.period_micros(), q.emission_micros());
        let shift = |base: u64, d: i64| base.saturating_add_signed(d).max(now);
        match self {
            Gap::Zero => now,
            Gap::Small(us) => now + us,
            Gap::NearEmission(d) => shift(now + t, d),
            Gap::Spread(k) => now + t * k / 250,
            Gap::ToBoundary(d) => shift((now / p + 1) * p, d),
            Gap::Period(d) => shift(now + p, d),
            Gap::Idle(n, f) => now + n * p + p * f / 1000,
        }
    }
}

pub(crate) fn gap() -> impl Strategy<Value = Gap> {
    prop_oneof![
        3 => Just(Gap::Zero),
        3 => (1u64..=10).prop_map(Gap::Small),
        4 => (-2i64..=2).prop_map(Gap::NearEmission),
        4 => (0u64..=1_000).prop_map(Gap::Spread),
        2 => (-1i64..=1).prop_map(Gap::ToBoundary),
        2 => (-1i64..=1).prop_map(Gap::Period),
        1 => (2u64..=1_000, 0u64..1_000).prop_map(|(n, f)| Gap::Idle(n, f)),
    ]
}

/// A request's cost, resolved against the algorithm's capacity.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Cost {
    /// One unit, the common case.
    Unit,
    /// Zero units: a pure look at the state.
    Nothing,
    /// Between 1 and the capacity.
    Share(u32),
    /// More than the capacity, by 1 to 3.
    Over(u32),
}

impl Cost {
    fn units(self, capacity: u64) -> u64 {
        match self {
            Cost::Unit => 1,
            Cost::Nothing => 0,
            Cost::Share(x) => 1 + u64::from(x) % capacity,
            Cost::Over(k) => capacity + u64::from(k),
        }
    }
}

pub(crate) fn cost() -> impl Strategy<Value = Cost> {
    prop_oneof![
        12 => Just(Cost::Unit),
        1 => Just(Cost::Nothing),
        4 => any::<u32>().prop_map(Cost::Share),
        1 => (1u32..=3).prop_map(Cost::Over),
    ]
}

/// Where a trace starts: at zero, somewhere early, or at a realistic Unix time in µs.
pub(crate) fn start() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        0u64..=200_000_000,
        1_700_000_000_000_000u64..=1_700_000_100_000_000,
    ]
}

pub(crate) type Steps = Vec<(Gap, Cost)>;

pub(crate) fn steps() -> impl Strategy<Value = Steps> {
    prop::collection::vec((gap(), cost()), 1..=300)
}

/// The `(now, cost)` events of a trace for an algorithm of the given capacity.
pub(crate) fn trace(
    start: u64,
    steps: &[(Gap, Cost)],
    q: &Quota,
    capacity: u64,
) -> Vec<(u64, u64)> {
    let mut now = start;
    steps
        .iter()
        .map(|&(gap, cost)| {
            now = gap.after(now, q);
            (now, cost.units(capacity))
        })
        .collect()
}
