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

mod bounds;
mod counter_error;
mod models;
mod replay;
mod traces;

use bounds::*;
use models::*;
use replay::*;
use traces::*;

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
                prop_assert!(ds.delay_micros() + s.cost * t <= q.burst() * t);
                drains_at = served + s.cost * t;
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
