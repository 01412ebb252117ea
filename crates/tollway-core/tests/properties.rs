//! Property tests over random request traces for the pure algorithm functions.
//!
//! Every algorithm is replayed over random traces (non-decreasing times, costs mostly 1)
//! and, on every single decision, checked for the promises the `Decision` type makes:
//! the capacity it reports, that `remaining` and `reset_after` are exact, that
//! `retry_after` is exact to the microsecond, that a cost above capacity is refused for
//! good and that a denial consumes nothing. On top of that each algorithm has its own
//! bound on what it admits (checked over the admitted events) and an independent,
//! deliberately naive model of its rule that it must agree with.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::{Index, select};
use proptest::test_runner::TestCaseError;
use tollway_core::algorithm::{
    fixed_window, gcra, leaky_bucket, sliding_counter, sliding_log, token_bucket,
};
use tollway_core::{Decision, Denial, Quota};

// ---------------------------------------------------------------------------------------
// Quotas and traces
// ---------------------------------------------------------------------------------------

/// Periods in microseconds: a millisecond (the finest rates), a second, an uneven seven
/// seconds and a minute.
const PERIODS: [u64; 4] = [1_000, 1_000_000, 7_000_000, 60_000_000];

fn quota(limit: u32, period_us: u64, burst: u32) -> Quota {
    Quota::with_period(limit, Duration::from_micros(period_us))
        .unwrap()
        .with_burst(burst)
        .unwrap()
}

/// A quota for the bucket algorithms: limit, period and an independent burst.
fn bucket_quota() -> impl Strategy<Value = Quota> {
    (1u32..=50, select(&PERIODS[..]), 1u32..=60).prop_map(|(l, p, b)| quota(l, p, b))
}

/// A quota for the window algorithms, whose burst is always the limit.
fn window_quota() -> impl Strategy<Value = Quota> {
    (1u32..=50, select(&PERIODS[..])).prop_map(|(l, p)| quota(l, p, l))
}

/// A bucket quota whose limit divides its period, so that GCRA's emission interval
/// `period / limit` needs no rounding.
fn even_quota() -> impl Strategy<Value = Quota> {
    (select(&PERIODS[..]), any::<Index>(), 1u32..=60).prop_map(|(p, i, b)| {
        let divisors: Vec<u32> = (1..=50).filter(|&l| p % u64::from(l) == 0).collect();
        quota(*i.get(&divisors), p, b)
    })
}

/// The time between one request and the next, resolved against the quota.
#[derive(Clone, Copy, Debug)]
enum Gap {
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

fn gap() -> impl Strategy<Value = Gap> {
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
enum Cost {
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
    fn units(self, capacity: u64) -> u32 {
        let capacity = u32::try_from(capacity).unwrap();
        match self {
            Cost::Unit => 1,
            Cost::Nothing => 0,
            Cost::Share(x) => 1 + x % capacity,
            Cost::Over(k) => capacity + k,
        }
    }
}

fn cost() -> impl Strategy<Value = Cost> {
    prop_oneof![
        12 => Just(Cost::Unit),
        1 => Just(Cost::Nothing),
        4 => any::<u32>().prop_map(Cost::Share),
        1 => (1u32..=3).prop_map(Cost::Over),
    ]
}

/// Where a trace starts: at zero, somewhere early, or at a realistic Unix time in µs.
fn start() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        0u64..=200_000_000,
        1_700_000_000_000_000u64..=1_700_000_100_000_000,
    ]
}

type Steps = Vec<(Gap, Cost)>;

fn steps() -> impl Strategy<Value = Steps> {
    prop::collection::vec((gap(), cost()), 1..=300)
}

/// The `(now, cost)` events of a trace for an algorithm of the given capacity.
fn trace(start: u64, steps: &[(Gap, Cost)], q: &Quota, capacity: u64) -> Vec<(u64, u32)> {
    let mut now = start;
    steps
        .iter()
        .map(|&(gap, cost)| {
            now = gap.after(now, q);
            (now, cost.units(capacity))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Replaying a trace, with the checks every algorithm must pass on every decision
// ---------------------------------------------------------------------------------------

type CheckFn<S> = fn(S, u64, &Quota, u32) -> (Decision, S);

/// One algorithm as the replay sees it.
struct Algo<S> {
    check: CheckFn<S>,
    /// The capacity the decisions report: the burst for buckets, the limit for windows.
    capacity: u64,
    /// Whether allowed decisions may carry a delay (the shaper).
    shapes: bool,
    /// Whether `after` is what a denial at `now` should leave of `before`: unchanged.
    kept: fn(before: &S, after: &S, now: u64, q: &Quota) -> bool,
}

fn unchanged<S: PartialEq>(before: &S, after: &S, _: u64, _: &Quota) -> bool {
    before == after
}

/// The sliding window log with the `(state, now, quota, cost)` shape of the others.
fn log_check(
    mut log: sliding_log::Log,
    now: u64,
    q: &Quota,
    cost: u32,
) -> (Decision, sliding_log::Log) {
    let d = sliding_log::check(&mut log, now, q, cost);
    (d, log)
}

/// A denial may only forget the log's entries that have slid out of the period.
fn log_kept(before: &sliding_log::Log, after: &sliding_log::Log, now: u64, q: &Quota) -> bool {
    let live = before
        .entries()
        .filter(|&(at, _)| at + q.period_micros() > now);
    after.entries().eq(live)
}

fn token_bucket_algo(q: &Quota) -> Algo<token_bucket::State> {
    Algo {
        check: token_bucket::check,
        capacity: q.burst(),
        shapes: false,
        kept: unchanged,
    }
}

fn meter_algo(q: &Quota) -> Algo<leaky_bucket::MeterState> {
    Algo {
        check: leaky_bucket::meter,
        capacity: q.burst(),
        shapes: false,
        kept: unchanged,
    }
}

fn gcra_algo(q: &Quota) -> Algo<gcra::State> {
    Algo {
        check: gcra::check,
        capacity: q.burst(),
        shapes: false,
        kept: unchanged,
    }
}

fn shaper_algo(q: &Quota) -> Algo<leaky_bucket::ShaperState> {
    Algo {
        check: leaky_bucket::shape,
        capacity: q.burst(),
        shapes: true,
        kept: unchanged,
    }
}

fn fixed_window_algo(q: &Quota) -> Algo<fixed_window::State> {
    Algo {
        check: fixed_window::check,
        capacity: q.limit(),
        shapes: false,
        kept: unchanged,
    }
}

fn sliding_counter_algo(q: &Quota) -> Algo<sliding_counter::State> {
    Algo {
        check: sliding_counter::check,
        capacity: q.limit(),
        shapes: false,
        kept: unchanged,
    }
}

fn sliding_log_algo(q: &Quota) -> Algo<sliding_log::Log> {
    Algo {
        check: log_check,
        capacity: q.limit(),
        shapes: false,
        kept: log_kept,
    }
}

/// One decided request.
#[derive(Clone, Copy, Debug)]
struct Event {
    now: u64,
    cost: u32,
    decision: Decision,
}

/// Replays `trace` from a fresh state, checking on every decision:
///
/// - capacity (property 2): `limit()` is the capacity, `remaining() <= limit()`, and an
///   allowed request of cost `c` leaves `remaining + c <= limit`;
/// - `remaining` is exact (property 2): from the state after the decision, at the same
///   instant, a request of `remaining` units passes and one of `remaining + 1` does not;
/// - `reset_after` is exact: from the state after the decision, the full capacity passes
///   at `now + reset` and not one microsecond sooner;
/// - `retry_after` is exact (property 3): when it is `r > 0`, the same request on the
///   same (pre-decision) state passes at `now + r` and is denied at `now + r - 1`;
/// - refusals (property 4): `CostExceedsCapacity` exactly when `cost > capacity`, with no
///   retry time; otherwise a denial is `Limited` with a retry time, and nothing else;
/// - a denial leaves the state as it was (the log may only drop expired entries);
/// - only the shaper delays, and only allowed requests.
fn replay<S: Clone + Default>(
    algo: &Algo<S>,
    q: &Quota,
    trace: &[(u64, u32)],
) -> Result<Vec<Event>, TestCaseError> {
    let (check, cap) = (algo.check, algo.capacity);
    let passes = |state: &S, now: u64, cost: u64| {
        check(state.clone(), now, q, u32::try_from(cost).unwrap())
            .0
            .is_allowed()
    };
    let mut state = S::default();
    let mut events = Vec::with_capacity(trace.len());
    for (i, &(now, cost)) in trace.iter().enumerate() {
        let before = state.clone();
        let (d, after) = check(before.clone(), now, q, cost);
        let at = format!("event {i} (now {now}, cost {cost}): {d:?}");
        let units = u64::from(cost);

        prop_assert_eq!(d.limit(), cap, "limit is not the capacity at {}", at);
        prop_assert!(d.remaining() <= cap, "remaining above capacity at {}", at);
        if d.is_allowed() {
            prop_assert!(
                d.remaining() + units <= cap,
                "remaining + cost above capacity at {}",
                at
            );
        }

        let too_big = units > cap;
        prop_assert_eq!(
            d.denial() == Some(Denial::CostExceedsCapacity),
            too_big,
            "at {}",
            at
        );
        if too_big {
            prop_assert_eq!(
                d.retry_after(),
                None,
                "a refusal with a retry time at {}",
                at
            );
        } else if !d.is_allowed() {
            prop_assert_eq!(d.denial(), Some(Denial::Limited), "at {}", at);
        }
        let has_retry = d.retry_after_micros() > 0;
        prop_assert_eq!(
            has_retry,
            d.denial() == Some(Denial::Limited),
            "retry time at {}",
            at
        );
        if !(algo.shapes && d.is_allowed()) {
            prop_assert_eq!(d.delay_micros(), 0, "a delay at {}", at);
        }
        if !d.is_allowed() {
            prop_assert!(
                (algo.kept)(&before, &after, now, q),
                "a denial changed the state at {}",
                at
            );
        }

        let r = d.remaining();
        if r > 0 {
            prop_assert!(
                passes(&after, now, r),
                "remaining {} units do not pass at {}",
                r,
                at
            );
        }
        prop_assert!(
            !passes(&after, now, r + 1),
            "more than remaining passes at {}",
            at
        );

        let reset = d.reset_after_micros();
        prop_assert!(
            passes(&after, now + reset, cap),
            "not full at reset, {}",
            at
        );
        if reset > 0 {
            prop_assert!(
                !passes(&after, now + reset - 1, cap),
                "full before reset, {}",
                at
            );
        }

        let wait = d.retry_after_micros();
        if wait > 0 {
            prop_assert!(
                passes(&before, now + wait, units),
                "denied at the retry time, {}",
                at
            );
            prop_assert!(
                !passes(&before, now + wait - 1, units),
                "passes before the retry time, {}",
                at
            );
        }

        events.push(Event {
            now,
            cost,
            decision: d,
        });
        state = after;
    }
    Ok(events)
}

/// The admitted `(time, units)`, in order.
fn admitted(events: &[Event]) -> Vec<(u64, u64)> {
    events
        .iter()
        .filter(|e| e.decision.is_allowed() && e.cost > 0)
        .map(|e| (e.now, u64::from(e.cost)))
        .collect()
}

// ---------------------------------------------------------------------------------------
// Bounds on what passes
// ---------------------------------------------------------------------------------------

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
fn check_bucket_bound(
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
fn check_sliding_bound(adm: &[(u64, u64)], q: &Quota) -> Result<(), TestCaseError> {
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
fn check_aligned_bound(adm: &[(u64, u64)], q: &Quota) -> Result<(), TestCaseError> {
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

// ---------------------------------------------------------------------------------------
// Naive models: the rule of each algorithm, recomputed from the admitted history
// ---------------------------------------------------------------------------------------

/// The token bucket as the textbook describes it: `tokens` in ticks (one unit is `period`
/// ticks), `limit` ticks refilled per microsecond up to `burst × period`.
fn check_token_bucket_model(events: &[Event], q: &Quota) -> Result<(), TestCaseError> {
    let (limit, period) = (u128::from(q.limit()), u128::from(q.period_micros()));
    let cap = u128::from(q.burst()) * period;
    let (mut tokens, mut last) = (cap, 0u64);
    for e in events {
        tokens = cap.min(tokens + limit * u128::from(e.now - last));
        last = e.now;
        let need = u128::from(e.cost) * period;
        let d = e.decision;
        let fits = u64::from(e.cost) <= q.burst() && need <= tokens;
        prop_assert_eq!(d.is_allowed(), fits, "model disagrees at {:?}", e);
        if fits {
            tokens -= need;
        } else if u64::from(e.cost) <= q.burst() {
            let retry = (need - tokens).div_ceil(limit);
            prop_assert_eq!(
                u128::from(d.retry_after_micros()),
                retry,
                "retry at {:?}",
                e
            );
        }
        prop_assert_eq!(
            u128::from(d.remaining()),
            tokens / period,
            "remaining at {:?}",
            e
        );
        let reset = (cap - tokens).div_ceil(limit);
        prop_assert_eq!(
            u128::from(d.reset_after_micros()),
            reset,
            "reset at {:?}",
            e
        );
    }
    Ok(())
}

/// A fixed window: admitted units per aligned window.
fn check_fixed_window_model(events: &[Event], q: &Quota) -> Result<(), TestCaseError> {
    let (limit, period) = (q.limit(), q.period_micros());
    let mut count: HashMap<u64, u64> = HashMap::new();
    for e in events {
        let n = count.entry(e.now / period).or_default();
        let cost = u64::from(e.cost);
        let fits = cost <= limit && *n + cost <= limit;
        prop_assert_eq!(e.decision.is_allowed(), fits, "model disagrees at {:?}", e);
        if fits {
            *n += cost;
        }
        prop_assert_eq!(e.decision.remaining(), limit - *n, "remaining at {:?}", e);
    }
    Ok(())
}

/// The exact sliding log: units admitted in `(now − period, now]`.
fn check_sliding_log_model(events: &[Event], q: &Quota) -> Result<(), TestCaseError> {
    let (limit, period) = (q.limit(), q.period_micros());
    let mut history: Vec<(u64, u64)> = Vec::new();
    for e in events {
        let used: u64 = history
            .iter()
            .filter(|&&(t, _)| t + period > e.now)
            .map(|&(_, c)| c)
            .sum();
        let cost = u64::from(e.cost);
        let fits = cost <= limit && used + cost <= limit;
        prop_assert_eq!(e.decision.is_allowed(), fits, "model disagrees at {:?}", e);
        let used = if fits { used + cost } else { used };
        if fits {
            history.push((e.now, cost));
        }
        prop_assert_eq!(e.decision.remaining(), limit - used, "remaining at {:?}", e);
    }
    Ok(())
}

/// The sliding window counter's rule, from per-window totals of the admitted history: at
/// `elapsed` into window `w`, `prev(w − 1) × (P − elapsed) + (curr(w) + cost) × P <=
/// limit × P`. Catches a counter that loses or misattributes counts across windows.
fn check_sliding_counter_model(events: &[Event], q: &Quota) -> Result<(), TestCaseError> {
    let (limit, period) = (q.limit(), q.period_micros());
    let mut count: HashMap<u64, u64> = HashMap::new();
    for e in events {
        let (w, elapsed) = (e.now / period, e.now % period);
        let prev = if w == 0 {
            0
        } else {
            count.get(&(w - 1)).copied().unwrap_or(0)
        };
        let curr = count.get(&w).copied().unwrap_or(0);
        let cost = u64::from(e.cost);
        let used = |curr: u64| prev * (period - elapsed) + curr * period;
        let fits = cost <= limit && used(curr + cost) <= limit * period;
        prop_assert_eq!(e.decision.is_allowed(), fits, "model disagrees at {:?}", e);
        let curr = if fits { curr + cost } else { curr };
        if fits {
            count.insert(w, curr);
        }
        let remaining = (limit * period).saturating_sub(used(curr)) / period;
        prop_assert_eq!(e.decision.remaining(), remaining, "remaining at {:?}", e);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The properties
// ---------------------------------------------------------------------------------------

proptest! {
    // Proptest finds no place for a regressions file beside an integration test (and
    // says so on every run); a failure prints its shrunk case instead.
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Token bucket: per-decision checks, the bucket bound, the textbook model, and the
    /// leaky bucket meter deciding identically (property 5).
    #[test]
    fn token_bucket_and_meter(q in bucket_quota(), start in start(), steps in steps()) {
        let trace = trace(start, &steps, &q, q.burst());
        let events = replay(&token_bucket_algo(&q), &q, &trace)?;
        check_bucket_bound(&admitted(&events), &q, q.period_micros(), q.limit())?;
        check_token_bucket_model(&events, &q)?;

        let meter = replay(&meter_algo(&q), &q, &trace)?;
        for (m, t) in meter.iter().zip(&events) {
            prop_assert_eq!(m.decision, t.decision, "the meter differs at {:?}", t);
        }
    }

    /// GCRA: per-decision checks and the bucket bound with the rounded-up emission
    /// interval. The shaper: the same admissions as GCRA, and the delays of a FIFO queue
    /// draining one unit per emission interval.
    #[test]
    fn gcra_and_shaper(q in bucket_quota(), start in start(), steps in steps()) {
        let trace = trace(start, &steps, &q, q.burst());
        // The emission interval as documented, derived here rather than trusted.
        let t = q.period_micros().div_ceil(q.limit());
        prop_assert_eq!(q.emission_micros(), t);
        let events = replay(&gcra_algo(&q), &q, &trace)?;
        check_bucket_bound(&admitted(&events), &q, t, 1)?;

        let shaped = replay(&shaper_algo(&q), &q, &trace)?;
        let mut drains_at = 0;
        for (s, g) in shaped.iter().zip(&events) {
            let (ds, dg) = (s.decision, g.decision);
            prop_assert_eq!(ds.is_allowed(), dg.is_allowed(), "the shaper differs at {:?}", s);
            prop_assert_eq!(ds.denial(), dg.denial());
            prop_assert_eq!(ds.remaining(), dg.remaining());
            prop_assert_eq!(ds.retry_after_micros(), dg.retry_after_micros());
            prop_assert_eq!(ds.reset_after_micros(), dg.reset_after_micros());
            if ds.is_allowed() {
                // Served when the queue ahead of it has drained, never sooner or later;
                // at most `burst` units, this one included, are queued.
                let served = drains_at.max(s.now);
                prop_assert_eq!(s.now + ds.delay_micros(), served, "delay at {:?}", s);
                prop_assert!(ds.delay_micros() + u64::from(s.cost) * t <= q.burst() * t);
                drains_at = served + u64::from(s.cost) * t;
            }
        }
    }

    /// Property 5, GCRA against the token bucket when `limit` divides `period`.
    ///
    /// On paper: with `T = period / limit` exactly, one unit is `T × limit` ticks, so the
    /// token bucket's deficit starts at 0 and only ever changes by multiples of `limit`
    /// ticks (`cost × period` on admission, `limit` per microsecond of refill, clamped
    /// at 0). Its `frac` is therefore always 0 and `full_at` is `now + deficit / limit`,
    /// which is GCRA's TAT: both admit when `max(tat − now, 0) + cost × T <= burst × T`,
    /// both move the TAT to `max(tat, now) + cost × T`, and remaining, reset and retry are
    /// the same expressions. So the decisions are identical field for field, not just
    /// allow/deny, and the states correspond.
    #[test]
    fn gcra_is_the_token_bucket_when_the_rate_is_exact(
        q in even_quota(),
        start in start(),
        steps in steps(),
    ) {
        let trace = trace(start, &steps, &q, q.burst());
        let (mut g, mut tb) = (gcra::State::default(), token_bucket::State::default());
        for &(now, cost) in &trace {
            let (dg, ng) = gcra::check(g, now, &q, cost);
            let (dt, nt) = token_bucket::check(tb, now, &q, cost);
            prop_assert_eq!(dg, dt, "at now {} cost {}", now, cost);
            prop_assert_eq!((ng.tat, 0), (nt.full_at, nt.frac), "at now {} cost {}", now, cost);
            (g, tb) = (ng, nt);
        }
    }

    /// Sliding window log: per-decision checks, at most `limit` in any window of one
    /// period (property 1), and the exact-count model.
    #[test]
    fn sliding_log(q in window_quota(), start in start(), steps in steps()) {
        let trace = trace(start, &steps, &q, q.limit());
        let events = replay(&sliding_log_algo(&q), &q, &trace)?;
        check_sliding_bound(&admitted(&events), &q)?;
        check_sliding_log_model(&events, &q)?;
    }

    /// Fixed window: per-decision checks, at most `limit` per aligned window (property
    /// 6), and the per-window count model.
    #[test]
    fn fixed_window(q in window_quota(), start in start(), steps in steps()) {
        let trace = trace(start, &steps, &q, q.limit());
        let events = replay(&fixed_window_algo(&q), &q, &trace)?;
        check_aligned_bound(&admitted(&events), &q)?;
        check_fixed_window_model(&events, &q)?;
    }

    /// Sliding window counter: per-decision checks, at most `limit` per aligned window
    /// (property 7), and its weighted rule recomputed from the admitted history.
    #[test]
    fn sliding_counter(q in window_quota(), start in start(), steps in steps()) {
        let trace = trace(start, &steps, &q, q.limit());
        let events = replay(&sliding_counter_algo(&q), &q, &trace)?;
        check_aligned_bound(&admitted(&events), &q)?;
        check_sliding_counter_model(&events, &q)?;
    }
}

// ---------------------------------------------------------------------------------------
// The sliding window counter against the exact log on a long bursty trace
// ---------------------------------------------------------------------------------------

/// splitmix64: a fixed-seed generator, so the trace (and the measurement) never changes.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (the modulo bias is irrelevant here).
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// Request times (µs) for a limit of 100 per second, in stretches of four kinds with idle
/// gaps (up to 3 s) between them: quiet traffic well under the limit (~30/s), bursts far
/// over it (~1000/s), traffic hovering around it (~100/s), and bursts straddling a window
/// boundary (starting up to 0.2 s before a whole second), the case the counter's weighting
/// of the previous window exists for.
fn bursty_trace(seed: u64, at_least: usize) -> Vec<u64> {
    const SECOND: u64 = 1_000_000;
    let mut rng = SplitMix64(seed);
    let mut now = 0;
    let mut times = Vec::with_capacity(at_least + 1_000);
    while times.len() < at_least {
        let (count, min_gap, max_gap) = match rng.between(0, 3) {
            0 => (rng.between(20, 200), 5_000, 60_000),
            1 => (rng.between(50, 500), 0, 2_000),
            2 => (rng.between(100, 600), 7_000, 13_000),
            _ => {
                now = (now / SECOND + 1) * SECOND - rng.between(0, 200_000);
                (rng.between(100, 250), 0, 3_000)
            }
        };
        for _ in 0..count {
            now += rng.between(min_gap, max_gap);
            times.push(now);
        }
        now += rng.between(0, 3 * SECOND);
    }
    times
}

fn percent(part: usize, whole: usize) -> f64 {
    100.0 * part as f64 / whole as f64
}

/// How often the sliding window counter decides differently from the exact log, on a
/// fixed bursty trace of 100,000 unit requests at 100 per second.
///
/// Measured: 5,268 of 100,114 requests (5.262%; the counter admitted 69,171, the log
/// 68,083), against 9,667 (9.656%) for the fixed window, which is the counter with its
/// previous-window term dropped. Broken counters measured on this same trace: weighting
/// the previous window by 3/4 of its share gives 6.638%, by half 7.849%. The bound, 6%,
/// leaves the correct counter about 15% headroom for harmless changes (rounding,
/// tie-breaking) and fails all of those. The trace is fixed, so the measurement is too;
/// the fixed window's share is asserted above the bound so that a change to the trace
/// that stops telling the algorithms apart fails as well.
#[test]
fn sliding_counter_error_against_the_exact_log() {
    const BOUND_PERCENT: f64 = 6.0;
    let q = Quota::per_second(100).unwrap();
    let times = bursty_trace(0x7011_6A7E, 100_000);
    assert!(times.len() >= 100_000);

    let mut log = sliding_log::Log::default();
    let mut counter = sliding_counter::State::default();
    let mut window = fixed_window::State::default();
    let (mut differ, mut window_differ) = (0, 0);
    let (mut by_counter, mut by_log) = (0, 0);
    for &now in &times {
        let exact = sliding_log::check(&mut log, now, &q, 1).is_allowed();
        let (d, next) = sliding_counter::check(counter, now, &q, 1);
        counter = next;
        let (w, next) = fixed_window::check(window, now, &q, 1);
        window = next;
        by_log += usize::from(exact);
        by_counter += usize::from(d.is_allowed());
        differ += usize::from(d.is_allowed() != exact);
        window_differ += usize::from(w.is_allowed() != exact);
    }
    let n = times.len();
    let (share, window_share) = (percent(differ, n), percent(window_differ, n));
    println!(
        "sliding window counter vs exact log: {differ} of {n} requests decided differently \
         ({share:.3}%); admitted: counter {by_counter}, log {by_log}"
    );
    println!(
        "(baseline) fixed window vs exact log: {window_differ} of {n} requests decided \
         differently ({window_share:.3}%)"
    );
    assert!(
        share < BOUND_PERCENT,
        "the counter strays too far from the log: {share:.3}%"
    );
    assert!(
        window_share > BOUND_PERCENT,
        "the trace no longer tells the algorithms apart"
    );
}
