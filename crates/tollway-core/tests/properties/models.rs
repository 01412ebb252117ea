//! Naive models: the rule of each algorithm, recomputed from the admitted history.

use super::*;

/// The token bucket as the textbook describes it: `tokens` in ticks (one unit is `period`
/// ticks), `limit` ticks refilled per microsecond up to `burst × period`.
pub(crate) fn check_token_bucket_model(events: &[Event], q: &Quota) -> Result<(), TestCaseError> {
    let (limit, period) = (u128::from(q.limit()), u128::from(q.period_micros()));
    let cap = u128::from(q.burst()) * period;
    let (mut tokens, mut last) = (cap, 0u64);
    for e in events {
        tokens = cap.min(tokens + limit * u128::from(e.now - last));
        last = e.now;
        let need = u128::from(e.cost) * period;
        let d = e.decision;
        let fits = e.cost <= q.burst() && need <= tokens;
        prop_assert_eq!(d.is_allowed(), fits, "model disagrees at {:?}", e);
        if fits {
            tokens -= need;
        } else if e.cost <= q.burst() {
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
pub(crate) fn check_fixed_window_model(events: &[Event], q: &Quota) -> Result<(), TestCaseError> {
    let (limit, period) = (q.limit(), q.period_micros());
    let mut count: HashMap<u64, u64> = HashMap::new();
    for e in events {
        let n = count.entry(e.now / period).or_default();
        let cost = e.cost;
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
pub(crate) fn check_sliding_log_model(events: &[Event], q: &Quota) -> Result<(), TestCaseError> {
    let (limit, period) = (q.limit(), q.period_micros());
    let mut history: Vec<(u64, u64)> = Vec::new();
    for e in events {
        let used: u64 = history
            .iter()
            .filter(|&&(t, _)| t + period > e.now)
            .map(|&(_, c)| c)
            .sum();
        let cost = e.cost;
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
pub(crate) fn check_sliding_counter_model(
    events: &[Event],
    q: &Quota,
) -> Result<(), TestCaseError> {
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
        let cost = e.cost;
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
