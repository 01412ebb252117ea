//! What a limiter answers for one request.

use std::ops::Deref;
use std::time::Duration;

use smallvec::SmallVec;

/// Why a request was denied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Denial {
    /// Over the limit for now; [`Decision::retry_after`] says when the same request passes.
    Limited,
    /// The request costs more than the policy's capacity, so it can never pass: there is
    /// no retry time to give.
    CostExceedsCapacity,
    /// The store holds as many keys as it was allowed and none could be dropped, so a new
    /// key could not be tracked. Configurable: see the memory store's builder.
    StoreFull,
}

/// A limiter's answer: whether the request may pass, and everything a response header or
/// a gRPC status needs to say about it.
///
/// All durations are whole microseconds. `limit` is the policy's capacity (its burst);
/// `remaining` is how many more unit-cost requests would pass right now; `reset_after` is
/// how long until the caller is back to full capacity.
///
/// # Examples
///
/// ```
/// use tollway_core::{Algorithm, Denial, ManualClock, MemoryStore, Policy, Quota};
///
/// let clock = ManualClock::new();
/// let store = MemoryStore::builder().clock(clock.clone()).build()?;
/// let policy = Policy::new("demo", Algorithm::TokenBucket, Quota::per_second(1)?)?;
///
/// let first = store.check_sync(b"alice", &policy, 1);
/// assert!(first.is_allowed());
/// assert_eq!((first.limit(), first.remaining()), (1, 0));
///
/// let second = store.check_sync(b"alice", &policy, 1);
/// assert_eq!(second.denial(), Some(Denial::Limited));
/// assert_eq!(second.retry_after(), Some(std::time::Duration::from_secs(1)));
///
/// // Two units can never fit in a bucket of one: no retry time is promised.
/// let never = store.check_sync(b"bob", &policy, 2);
/// assert_eq!(never.denial(), Some(Denial::CostExceedsCapacity));
/// assert_eq!(never.retry_after(), None);
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Decision {
    denial: Option<Denial>,
    limit: u64,
    remaining: u64,
    reset_after_us: u64,
    retry_after_us: u64,
    delay_us: u64,
}

impl Decision {
    /// An admitted request, to be served after `delay_us` (zero unless shaping).
    #[inline]
    pub(crate) const fn allow(
        limit: u64,
        remaining: u64,
        reset_after_us: u64,
        delay_us: u64,
    ) -> Self {
        Decision {
            denial: None,
            limit,
            remaining,
            reset_after_us,
            retry_after_us: 0,
            delay_us,
        }
    }

    /// The same decision with its reset and retry times cut at `us` from now: for a
    /// count that starts afresh then, whatever the state said.
    #[cfg(feature = "regions")]
    pub(crate) fn within(mut self, us: u64) -> Self {
        self.reset_after_us = self.reset_after_us.min(us);
        self.retry_after_us = self.retry_after_us.min(us);
        self
    }

    /// A request over the limit that passes if sent again after `retry_after_us`.
    pub(crate) const fn limited(
        limit: u64,
        remaining: u64,
        reset_after_us: u64,
        retry_after_us: u64,
    ) -> Self {
        Decision {
            denial: Some(Denial::Limited),
            limit,
            remaining,
            reset_after_us,
            retry_after_us,
            delay_us: 0,
        }
    }

    /// A denial with no retry time (`CostExceedsCapacity`, `StoreFull`).
    pub(crate) const fn refused(
        denial: Denial,
        limit: u64,
        remaining: u64,
        reset_after_us: u64,
    ) -> Self {
        Decision {
            denial: Some(denial),
            limit,
            remaining,
            reset_after_us,
            retry_after_us: 0,
            delay_us: 0,
        }
    }

    /// An admitted request. `limit` is the policy's capacity. `remaining` is how many
    /// more unit-cost requests would pass now. `reset_after` is how long until the
    /// caller is back to full capacity, in whole microseconds (the rest is dropped).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollway_core::{Decision, Denial};
    ///
    /// // What a store of your own answers.
    /// let ok = Decision::allowed(100, 41, Duration::from_secs(35));
    /// assert!(ok.is_allowed() && ok.remaining() == 41);
    /// let shaped = ok.with_delay(Duration::from_millis(20));
    /// assert_eq!(shaped.delay(), Duration::from_millis(20));
    ///
    /// let no = Decision::denied(Denial::Limited, 100, 0, Duration::from_secs(60), Duration::from_secs(2));
    /// assert_eq!(no.retry_after(), Some(Duration::from_secs(2)));
    /// let never = Decision::denied(Denial::CostExceedsCapacity, 100, 7, Duration::ZERO, Duration::from_secs(2));
    /// assert_eq!(never.retry_after(), None); // no wait can help: the retry is dropped
    /// ```
    #[must_use]
    pub const fn allowed(limit: u64, remaining: u64, reset_after: Duration) -> Self {
        Decision::allow(limit, remaining, micros(reset_after), 0)
    }

    /// This decision with a shaping delay: the request passes after `delay`. A denial
    /// is returned unchanged (a denied request is never delayed).
    #[must_use]
    pub const fn with_delay(mut self, delay: Duration) -> Self {
        if self.denial.is_none() {
            self.delay_us = micros(delay);
        }
        self
    }

    /// A request denied for `denial`. `retry_after` is kept for [`Denial::Limited`] (at
    /// least one microsecond: a limited request can pass later) and dropped for the
    /// denials no wait can cure.
    #[must_use]
    pub const fn denied(
        denial: Denial,
        limit: u64,
        remaining: u64,
        reset_after: Duration,
        retry_after: Duration,
    ) -> Self {
        let reset_after_us = micros(reset_after);
        match denial {
            Denial::Limited => {
                let retry = micros(retry_after);
                let retry = if retry == 0 { 1 } else { retry };
                Decision::limited(limit, remaining, reset_after_us, retry)
            }
            Denial::CostExceedsCapacity | Denial::StoreFull => {
                Decision::refused(denial, limit, remaining, reset_after_us)
            }
        }
    }

    /// Whether the request may pass (perhaps after [`Decision::delay`]).
    #[must_use]
    pub const fn is_allowed(&self) -> bool {
        self.denial.is_none()
    }

    /// Why the request was denied, or `None` when it was allowed.
    #[must_use]
    pub const fn denial(&self) -> Option<Denial> {
        self.denial
    }

    /// The policy's capacity: the most units that can pass at once.
    #[must_use]
    pub const fn limit(&self) -> u64 {
        self.limit
    }

    /// Unit-cost requests that would pass right now, after this decision.
    #[must_use]
    pub const fn remaining(&self) -> u64 {
        self.remaining
    }

    /// How long until the caller is back to full capacity.
    #[must_use]
    pub const fn reset_after(&self) -> Duration {
        Duration::from_micros(self.reset_after_us)
    }

    /// [`Decision::reset_after`] in microseconds.
    #[must_use]
    pub const fn reset_after_micros(&self) -> u64 {
        self.reset_after_us
    }

    /// For a request denied as [`Denial::Limited`]: how long until the same request
    /// passes, exactly (one microsecond sooner it would still be denied). `None` for an
    /// allowed request and for a denial that waiting cannot cure.
    #[must_use]
    pub const fn retry_after(&self) -> Option<Duration> {
        if self.retry_after_us > 0 {
            Some(Duration::from_micros(self.retry_after_us))
        } else {
            None
        }
    }

    /// [`Decision::retry_after`] in microseconds, 0 when there is none.
    #[must_use]
    pub const fn retry_after_micros(&self) -> u64 {
        self.retry_after_us
    }

    /// For an allowed request under a shaping policy: how long to hold it before serving
    /// it so that requests leave at a steady rate. Zero otherwise.
    #[must_use]
    pub const fn delay(&self) -> Duration {
        Duration::from_micros(self.delay_us)
    }

    /// [`Decision::delay`] in microseconds.
    #[must_use]
    pub const fn delay_micros(&self) -> u64 {
        self.delay_us
    }
}

/// Whole microseconds of `d`, saturating.
const fn micros(d: Duration) -> u64 {
    let us = d.as_micros();
    if us > u64::MAX as u128 {
        u64::MAX
    } else {
        us as u64
    }
}

/// The decisions of one request's limits, in the order the limits were given to the
/// store.
///
/// Either all allowed: the request passes, and every limit is charged. Or at least one
/// denied: the request is refused, and no limit is charged.
///
/// Derefs to `[Decision]`; build one with `collect()` or `From<Decision>`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollway_core::{Decision, Decisions, Denial};
///
/// let decisions: Decisions = [
///     Decision::allowed(100, 99, Duration::from_secs(1)),
///     Decision::denied(Denial::Limited, 3, 0, Duration::from_secs(60), Duration::from_secs(20)),
/// ]
/// .into_iter()
/// .collect();
/// assert!(!decisions.is_allowed());
/// assert_eq!(decisions.len(), 2);
/// assert_eq!(decisions[1].retry_after(), Some(Duration::from_secs(20)));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decisions {
    decisions: SmallVec<[Decision; 2]>,
}

impl Decisions {
    /// No decisions yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the decision of the next limit.
    pub fn push(&mut self, decision: Decision) {
        self.decisions.push(decision);
    }

    /// Replaces the decision at `index` (which must be in bounds).
    pub(crate) fn replace(&mut self, index: usize, decision: Decision) {
        if let Some(slot) = self.decisions.get_mut(index) {
            *slot = decision;
        }
    }

    /// Whether every limit allowed the request.
    #[must_use]
    pub fn is_allowed(&self) -> bool {
        self.decisions.iter().all(Decision::is_allowed)
    }
}

impl Deref for Decisions {
    type Target = [Decision];

    fn deref(&self) -> &[Decision] {
        &self.decisions
    }
}

impl From<Decision> for Decisions {
    fn from(decision: Decision) -> Self {
        let mut decisions = Decisions::new();
        decisions.push(decision);
        decisions
    }
}

impl FromIterator<Decision> for Decisions {
    fn from_iter<I: IntoIterator<Item = Decision>>(iter: I) -> Self {
        Decisions {
            decisions: iter.into_iter().collect(),
        }
    }
}

impl<'a> IntoIterator for &'a Decisions {
    type Item = &'a Decision;
    type IntoIter = std::slice::Iter<'a, Decision>;

    fn into_iter(self) -> Self::IntoIter {
        self.decisions.iter()
    }
}
