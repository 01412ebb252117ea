//! Bounds on what passes.

use super::*;

/// The bucket bound (property 1) for the token bucket and GCRA.
///
/// A bucket holds at most `burst` units and refills `rate` sub-units per microsecond,
/// where one unit is `unit` sub-units: ticks for the token bucket (`unit = period`,
/// `rate = limit`, exact) and microseconds for GCRA (`unit = T`, the emission interval
/// `ceil(period / limit)`, `rate = 1`). Between two admitted requests at `t_i <= t_j`,
/// everything admitted in `[t_i, t_j]` came out of a bucket holding at most `burst` at
/// `t_i` plus what refilled since, so
///
/// ```text
/// units(t_i ..= t_j) × unit <= burst × unit + rate × (t_j − t_i)
/// ```
///
/// for every pair, however far apart: the burst plus the exact refill, with no slack, so
/// a refill even one sub-unit too generous fails on a trace that drains the bucket.
///
/// For a half-open window `[t, t + period)` the span is at most `period − 1`, so the
/// refill is under `limit` units (`limit × (period − 1) / period` for the token bucket,
/// `(period − 1) / T` with `T >= period / limit` for GCRA): at most `burst + limit − 1`
/// units, one less than the documented `burst + limit`. That is checked too.
pub(crate) fn check_bucket_bound(
    adm: &[(u64, u64)],
    q: &Quota,
    unit: u64,
    rate: u64,
) -> Result<(), TestCaseError> {
    let (burst, limit, period) = (q.burst(), q.limit(), q.period_micros());
    for (i, &(ti, _)) in adm.iter().enumerate() {
        let mut units = 0;
        for &(tj, c) in &adm[i..] {
            units += c;
            prop_assert!(
                units * unit <= burst * unit + rate * (tj - ti),
                "{} units admitted in [{}, {}]: more than the burst {} plus the refill",
                units,
                ti,
                tj,
                burst
            );
            if tj < ti + period {
                prop_assert!(
                    units < burst + limit,
                    "{} units admitted in [{}, {} + period)",
                    units,
                    ti,
                    ti
                );
            }
        }
    }
    Ok(())
}

/// At most `limit` units with times in any half-open `[t_i, t_i + period)` (property 1
/// for the sliding log). Only windows starting at an admission need checking: sliding a
/// window's start forward to its first admission loses nothing.
pub(crate) fn check_sliding_bound(adm: &[(u64, u64)], q: &Quota) -> Result<(), TestCaseError> {
    for (i, &(ti, _)) in adm.iter().enumerate() {
        let units: u64 = adm[i..]
            .iter()
            .take_while(|&&(tj, _)| tj < ti + q.period_micros())
            .map(|&(_, c)| c)
            .sum();
        prop_assert!(
            units <= q.limit(),
            "{} units admitted in [{}, {} + period)",
            units,
            ti,
            ti
        );
    }
    Ok(())
}

/// At most `limit` units in each aligned window `[k × period, (k + 1) × period)`
/// (properties 6 and 7).
pub(crate) fn check_aligned_bound(adm: &[(u64, u64)], q: &Quota) -> Result<(), TestCaseError> {
    let mut per_window: HashMap<u64, u64> = HashMap::new();
    for &(t, c) in adm {
        *per_window.entry(t / q.period_micros()).or_default() += c;
    }
    for (w, units) in per_window {
        prop_assert!(
            units <= q.limit(),
            "{} units admitted in aligned window {}",
            units,
            w
        );
    }
    Ok(())
}
