//! The one place the memory store tells algorithms apart.
//!
//! [`visit`] says how the store keeps each [`Algorithm`]'s state, in one `match` with no
//! wildcard arm. A new algorithm stops the build there. It must pick one of three forms.
//! The trait of the form it picks then lists the functions it must give.
//!
//! | form | state | algorithms | kept |
//! |---|---|---|---|
//! | [`Instant`] | one instant | GCRA, the leaky bucket shaper | in a cell |
//! | [`Pair`] | two integers | the buckets, the windows, concurrency | packed in a cell while they fit one word (see [`word`](super::word)), else in the shard's table |
//! | the log | entries | the sliding window log | in the shard's table |
//!
//! Every decision, refund, charge and packing the store makes goes through a [`Visit`].
//! A visit is generic over the algorithm, so each algorithm's path is compiled on its own
//! and inlined, as a direct call would be.

use super::word::Packs;
use crate::algorithm::{
    Algorithm, concurrency, fixed_window, gcra, leaky_bucket, sliding_counter, token_bucket,
};
use crate::{Decision, Quota};

/// An algorithm whose state is one instant: the word in its cell.
pub(crate) trait Instant {
    /// Decides a request of `cost` units.
    fn check(state: gcra::State, now: u64, quota: &Quota, cost: u64) -> (Decision, gcra::State);
    /// Gives `units` back.
    fn refund(state: gcra::State, now: u64, quota: &Quota, units: u64) -> gcra::State;
    /// Takes `units` whether or not they fit.
    fn charge(state: gcra::State, now: u64, quota: &Quota, units: u64) -> gcra::State;
    /// The state written under `from`, as one under `to` (see [`gcra::carry`]).
    fn carry(state: gcra::State, now: u64, from: &Quota, to: &Quota) -> gcra::State {
        gcra::carry(state, now, from, to)
    }
}

/// An algorithm whose state is two integers, which pack into one word while they fit.
pub(crate) trait Pair {
    /// The algorithm's state.
    type State: Packs;
    /// Decides a request of `cost` units.
    fn check(state: Self::State, now: u64, quota: &Quota, cost: u64) -> (Decision, Self::State);
    /// Gives `units` back.
    fn refund(state: Self::State, now: u64, quota: &Quota, units: u64) -> Self::State;
    /// Takes `units` whether or not they fit: a bucket owes what does not fit; a window
    /// does not count past its limit.
    fn charge(state: Self::State, now: u64, quota: &Quota, units: u64) -> Self::State;
    /// Gives back a lease's unspent `units` to the window ending at `end`: a window's
    /// count drops while that window counts; a bucket keeps its state (its lent units go
    /// bad as it refills them).
    fn give_back(state: Self::State, now: u64, quota: &Quota, units: u64, end: u64) -> Self::State;
    /// The state written under `from`, as one under `to`. A count means the same under
    /// any limit, so the windows and concurrency keep it as it is; the buckets give
    /// [`token_bucket::carry`].
    fn carry(state: Self::State, _now: u64, _from: &Quota, _to: &Quota) -> Self::State {
        state
    }
}

/// One thing the store does, for any algorithm: [`visit`] calls the method for the
/// algorithm's form.
pub(crate) trait Visit {
    /// What it returns.
    type Out;
    /// Does it for an instant state.
    fn instant<A: Instant>(self) -> Self::Out;
    /// Does it for a state of two integers.
    fn pair<A: Pair>(self) -> Self::Out;
    /// Does it for the sliding window log.
    fn log(self) -> Self::Out;
}

/// Does `visit` for `algorithm`.
#[inline(always)]
pub(crate) fn visit<V: Visit>(algorithm: Algorithm, visit: V) -> V::Out {
    match algorithm {
        Algorithm::Gcra => visit.instant::<Gcra>(),
        Algorithm::LeakyBucketShaper => visit.instant::<Shaper>(),
        Algorithm::TokenBucket => visit.pair::<TokenBucket>(),
        Algorithm::LeakyBucket => visit.pair::<Meter>(),
        Algorithm::FixedWindow => visit.pair::<FixedWindow>(),
        Algorithm::SlidingWindowCounter => visit.pair::<SlidingCounter>(),
        Algorithm::SlidingWindowLog => visit.log(),
        Algorithm::Concurrency => visit.pair::<Concurrency>(),
    }
}

/// [`Algorithm::Gcra`].
pub(crate) struct Gcra;

impl Instant for Gcra {
    #[inline(always)]
    fn check(state: gcra::State, now: u64, quota: &Quota, cost: u64) -> (Decision, gcra::State) {
        gcra::check(state, now, quota, cost)
    }

    fn refund(state: gcra::State, now: u64, quota: &Quota, units: u64) -> gcra::State {
        gcra::refund(state, now, quota, units)
    }

    fn charge(state: gcra::State, now: u64, quota: &Quota, units: u64) -> gcra::State {
        gcra::charge(state, now, quota, units)
    }
}

/// [`Algorithm::LeakyBucketShaper`].
pub(crate) struct Shaper;

impl Instant for Shaper {
    #[inline(always)]
    fn check(state: gcra::State, now: u64, quota: &Quota, cost: u64) -> (Decision, gcra::State) {
        leaky_bucket::shape(state, now, quota, cost)
    }

    fn refund(state: gcra::State, now: u64, quota: &Quota, units: u64) -> gcra::State {
        leaky_bucket::shape_refund(state, now, quota, units)
    }

    fn charge(state: gcra::State, now: u64, quota: &Quota, units: u64) -> gcra::State {
        leaky_bucket::shape_charge(state, now, quota, units)
    }
}

/// [`Algorithm::TokenBucket`].
pub(crate) struct TokenBucket;

impl Pair for TokenBucket {
    type State = token_bucket::State;

    fn carry(state: Self::State, now: u64, from: &Quota, to: &Quota) -> Self::State {
        token_bucket::carry(state, now, from, to)
    }

    #[inline(always)]
    fn check(state: Self::State, now: u64, quota: &Quota, cost: u64) -> (Decision, Self::State) {
        token_bucket::check(state, now, quota, cost)
    }

    fn refund(state: Self::State, now: u64, quota: &Quota, units: u64) -> Self::State {
        token_bucket::refund(state, now, quota, units)
    }

    fn charge(state: Self::State, now: u64, quota: &Quota, units: u64) -> Self::State {
        token_bucket::charge(state, now, quota, units)
    }

    fn give_back(state: Self::State, _: u64, _: &Quota, _: u64, _: u64) -> Self::State {
        state
    }
}

/// [`Algorithm::LeakyBucket`]: the meter, whose state is a token bucket's.
pub(crate) struct Meter;

impl Pair for Meter {
    type State = token_bucket::State;

    fn carry(state: Self::State, now: u64, from: &Quota, to: &Quota) -> Self::State {
        token_bucket::carry(state, now, from, to)
    }

    #[inline(always)]
    fn check(state: Self::State, now: u64, quota: &Quota, cost: u64) -> (Decision, Self::State) {
        leaky_bucket::meter(state, now, quota, cost)
    }

    fn refund(state: Self::State, now: u64, quota: &Quota, units: u64) -> Self::State {
        leaky_bucket::meter_refund(state, now, quota, units)
    }

    fn charge(state: Self::State, now: u64, quota: &Quota, units: u64) -> Self::State {
        leaky_bucket::meter_charge(state, now, quota, units)
    }

    fn give_back(state: Self::State, _: u64, _: &Quota, _: u64, _: u64) -> Self::State {
        state
    }
}

/// [`Algorithm::FixedWindow`].
pub(crate) struct FixedWindow;

impl Pair for FixedWindow {
    type State = fixed_window::State;

    #[inline(always)]
    fn check(state: Self::State, now: u64, quota: &Quota, cost: u64) -> (Decision, Self::State) {
        fixed_window::check(state, now, quota, cost)
    }

    fn refund(state: Self::State, now: u64, quota: &Quota, units: u64) -> Self::State {
        fixed_window::refund(state, now, quota, units)
    }

    fn charge(state: Self::State, _: u64, _: &Quota, _: u64) -> Self::State {
        state
    }

    fn give_back(state: Self::State, now: u64, quota: &Quota, units: u64, end: u64) -> Self::State {
        fixed_window::give_back(state, now, quota, units, end)
    }
}

/// [`Algorithm::SlidingWindowCounter`].
pub(crate) struct SlidingCounter;

impl Pair for SlidingCounter {
    type State = sliding_counter::State;

    #[inline(always)]
    fn check(state: Self::State, now: u64, quota: &Quota, cost: u64) -> (Decision, Self::State) {
        sliding_counter::check(state, now, quota, cost)
    }

    fn refund(state: Self::State, now: u64, quota: &Quota, units: u64) -> Self::State {
        sliding_counter::refund(state, now, quota, units)
    }

    fn charge(state: Self::State, _: u64, _: &Quota, _: u64) -> Self::State {
        state
    }

    fn give_back(state: Self::State, now: u64, quota: &Quota, units: u64, end: u64) -> Self::State {
        sliding_counter::give_back(state, now, quota, units, end)
    }
}

/// [`Algorithm::Concurrency`]: slots held, and when they expire.
pub(crate) struct Concurrency;

impl Pair for Concurrency {
    type State = concurrency::State;

    #[inline(always)]
    fn check(state: Self::State, now: u64, quota: &Quota, cost: u64) -> (Decision, Self::State) {
        concurrency::check(state, now, quota, cost)
    }

    fn refund(state: Self::State, now: u64, quota: &Quota, units: u64) -> Self::State {
        concurrency::refund(state, now, quota, units)
    }

    /// No slot past the limit: a charge takes what is free (and renews), as a window.
    fn charge(state: Self::State, _: u64, _: &Quota, _: u64) -> Self::State {
        state
    }

    fn give_back(state: Self::State, _: u64, _: &Quota, _: u64, _: u64) -> Self::State {
        state
    }
}
