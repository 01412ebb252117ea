//! Replaying a trace, with the checks every algorithm must pass on every decision.

use super::*;

pub(crate) type CheckFn<S> = fn(S, u64, &Quota, u64) -> (Decision, S);

/// One algorithm as the replay sees it.
pub(crate) struct Algo<S> {
    pub(crate) check: CheckFn<S>,
    /// The capacity the decisions report: the burst for buckets, the limit for windows.
    pub(crate) capacity: u64,
    /// Whether allowed decisions may carry a delay (the shaper).
    pub(crate) shapes: bool,
    /// Whether `after` is what a denial at `now` should leave of `before`: unchanged.
    pub(crate) kept: fn(before: &S, after: &S, now: u64, q: &Quota) -> bool,
}

pub(crate) fn unchanged<S: PartialEq>(before: &S, after: &S, _: u64, _: &Quota) -> bool {
    before == after
}

/// The sliding window log with the `(state, now, quota, cost)` shape of the others.
pub(crate) fn log_check(
    mut log: sliding_log::Log,
    now: u64,
    q: &Quota,
    cost: u64,
) -> (Decision, sliding_log::Log) {
    let d = sliding_log::check(&mut log, now, q, cost);
    (d, log)
}

/// A denial may only forget the log's entries that have slid out of the period.
pub(crate) fn log_kept(
    before: &sliding_log::Log,
    after: &sliding_log::Log,
    now: u64,
    q: &Quota,
) -> bool {
    let live = before
        .entries()
        .filter(|&(at, _)| at + q.period_micros() > now);
    after.entries().eq(live)
}

pub(crate) fn token_bucket_algo(q: &Quota) -> Algo<token_bucket::State> {
    Algo {
        check: token_bucket::check,
        capacity: q.burst(),
        shapes: false,
        kept: unchanged,
    }
}

pub(crate) fn meter_algo(q: &Quota) -> Algo<leaky_bucket::MeterState> {
    Algo {
        check: leaky_bucket::meter,
        capacity: q.burst(),
        shapes: false,
        kept: unchanged,
    }
}

pub(crate) fn gcra_algo(q: &Quota) -> Algo<gcra::State> {
    Algo {
        check: gcra::check,
        capacity: q.burst(),
        shapes: false,
        kept: unchanged,
    }
}

pub(crate) fn shaper_algo(q: &Quota) -> Algo<leaky_bucket::ShaperState> {
    Algo {
        check: leaky_bucket::shape,
        capacity: q.burst(),
        shapes: true,
        kept: unchanged,
    }
}

pub(crate) fn fixed_window_algo(q: &Quota) -> Algo<fixed_window::State> {
    Algo {
        check: fixed_window::check,
        capacity: q.limit(),
        shapes: false,
        kept: unchanged,
    }
}

pub(crate) fn sliding_counter_algo(q: &Quota) -> Algo<sliding_counter::State> {
    Algo {
        check: sliding_counter::check,
        capacity: q.limit(),
        shapes: false,
        kept: unchanged,
    }
}

pub(crate) fn sliding_log_algo(q: &Quota) -> Algo<sliding_log::Log> {
    Algo {
        check: log_check,
        capacity: q.limit(),
        shapes: false,
        kept: log_kept,
    }
}

/// One decided request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Event {
    pub(crate) now: u64,
    pub(crate) cost: u64,
    pub(crate) decision: Decision,
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
pub(crate) fn replay<S: Clone + Default>(
    algo: &Algo<S>,
    q: &Quota,
    trace: &[(u64, u64)],
) -> Result<Vec<Event>, TestCaseError> {
    let (check, cap) = (algo.check, algo.capacity);
    let passes = |state: &S, now: u64, cost: u64| check(state.clone(), now, q, cost).0.is_allowed();
    let mut state = S::default();
    let mut events = Vec::with_capacity(trace.len());
    for (i, &(now, cost)) in trace.iter().enumerate() {
        let before = state.clone();
        let (d, after) = check(before.clone(), now, q, cost);
        let at = format!("event {i} (now {now}, cost {cost}): {d:?}");
        let units = cost;

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
pub(crate) fn admitted(events: &[Event]) -> Vec<(u64, u64)> {
    events
        .iter()
        .filter(|e| e.decision.is_allowed() && e.cost > 0)
        .map(|e| (e.now, e.cost))
        .collect()
}
