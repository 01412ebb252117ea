//! Leaky bucket, in both of its classic forms.
//!
//! A bucket of capacity `burst` leaks at `limit` per `period`; each request pours its
//! cost in.
//!
//! - **Meter** ([`meter`]): a request that would overflow the bucket is rejected. This is
//!   the token bucket seen from the other side: water poured in instead of tokens taken
//!   out. It decides identically. So it shares the token bucket's exact arithmetic and
//!   state. [`token_bucket::State`]'s `full_at` is the instant this bucket is empty.
//! - **Shaper** ([`shape`]): requests are not rejected but queued. They leave the queue
//!   at a steady `limit` per `period`. The decision carries the delay to hold the
//!   request for. At most `burst` units may be waiting: that bounds the queue. Beyond
//!   it, a request is rejected with the time at which it would fit. Output is perfectly
//!   smooth, with no bursts downstream, at the price of latency. The state is one
//!   timestamp, the time the queue drains, spaced like [GCRA](super::gcra).
//!
//! # Trade-off
//!
//! The meter protects like a token bucket. The shaper turns a burst into a steady
//! stream. That suits a fragile backend, or an outbound API with a strict rate. It costs
//! each queued request its wait, and a held connection.

use super::{gcra, token_bucket};
use crate::{Decision, Quota};

/// Leaky bucket (meter) state: the same as the token bucket's.
pub type MeterState = token_bucket::State;

/// Leaky bucket (shaper) state: when the queue drains, in microseconds.
pub type ShaperState = gcra::State;

/// The meter: admits a request of `cost` units at `now` if it fits in the bucket.
#[must_use]
#[inline]
pub fn meter(state: MeterState, now: u64, quota: &Quota, cost: u64) -> (Decision, MeterState) {
    token_bucket::check(state, now, quota, cost)
}

/// The shaper: admits a request of `cost` units at `now` with the delay that keeps the
/// output at a steady rate, or rejects it when the queue already holds `burst` units.
#[must_use]
#[inline]
pub fn shape(state: ShaperState, now: u64, quota: &Quota, cost: u64) -> (Decision, ShaperState) {
    let (decision, next) = gcra::check(state, now, quota, cost);
    if !decision.is_allowed() {
        return (decision, next);
    }
    let delay = state.tat.saturating_sub(now);
    let d = Decision::allow(
        decision.limit(),
        decision.remaining(),
        decision.reset_after_micros(),
        delay,
    );
    (d, next)
}

/// Pours `units` into the meter's bucket at `now` whether or not they fit: what
/// overflows is owed (the token bucket's charge).
#[must_use]
pub fn meter_charge(state: MeterState, now: u64, quota: &Quota, units: u64) -> MeterState {
    token_bucket::charge(state, now, quota, units)
}

/// Queues `units` in the shaper at `now` whether or not they fit: what is past full is
/// owed (GCRA's charge).
#[must_use]
pub fn shape_charge(state: ShaperState, now: u64, quota: &Quota, units: u64) -> ShaperState {
    gcra::charge(state, now, quota, units)
}

/// Empties `units` from the meter's bucket at `now` (the token bucket's refund).
#[must_use]
pub fn meter_refund(state: MeterState, now: u64, quota: &Quota, units: u64) -> MeterState {
    token_bucket::refund(state, now, quota, units)
}

/// Takes `units` out of the shaper's queue at `now` (GCRA's refund).
#[must_use]
pub fn shape_refund(state: ShaperState, now: u64, quota: &Quota, units: u64) -> ShaperState {
    gcra::refund(state, now, quota, units)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::testing::run;

    #[test]
    fn the_shaper_spaces_a_burst_into_a_steady_stream() {
        // 10 per second with room for 4 in the queue: a burst of 5 at t=0 gets delays
        // 0, 100, 200, 300 ms and the fifth is rejected until the first slot frees.
        let q = Quota::per_second(10).unwrap().with_burst(4).unwrap();
        let ds = run(shape, &q, &[(0, 1); 5]);
        let delays: Vec<u64> = ds[..4].iter().map(Decision::delay_micros).collect();
        assert_eq!(delays, [0, 100_000, 200_000, 300_000]);
        assert!(!ds[4].is_allowed());
        assert_eq!(ds[4].retry_after_micros(), 100_000);
        assert_eq!(ds[4].delay_micros(), 0);
    }

    #[test]
    fn an_idle_shaper_lets_the_next_request_through_at_once() {
        let q = Quota::per_second(10).unwrap().with_burst(4).unwrap();
        let ds = run(shape, &q, &[(0, 1), (100_000, 1), (150_000, 1)]);
        assert_eq!(ds[1].delay_micros(), 0);
        assert_eq!(ds[2].delay_micros(), 50_000);
    }

    #[test]
    fn the_meter_decides_like_the_token_bucket() {
        let q = Quota::per_second(5).unwrap();
        let trace = [(0, 3), (0, 3), (100_000, 1), (250_000, 2), (2_000_000, 5)];
        assert_eq!(run(meter, &q, &trace), run(token_bucket::check, &q, &trace));
    }
}
