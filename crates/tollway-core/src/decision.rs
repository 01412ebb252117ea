//! What a limiter answers for one request.

use std::time::Duration;

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

    /// Rebuilds a decision from its wire fields (a store's reply); `None` when the fields
    /// contradict each other.
    ///
    /// `denial` is 0 for allowed, 1 for [`Denial::Limited`], 2 for
    /// [`Denial::CostExceedsCapacity`], 3 for [`Denial::StoreFull`]: the same codes
    /// [`Decision::denial_code`] gives.
    #[must_use]
    pub fn from_parts(
        denial: u8,
        limit: u64,
        remaining: u64,
        reset_after_us: u64,
        retry_after_us: u64,
        delay_us: u64,
    ) -> Option<Self> {
        let denial = match denial {
            0 => None,
            1 => Some(Denial::Limited),
            2 => Some(Denial::CostExceedsCapacity),
            3 => Some(Denial::StoreFull),
            _ => return None,
        };
        let retry_ok = (denial == Some(Denial::Limited)) == (retry_after_us > 0);
        let delay_ok = denial.is_none() || delay_us == 0;
        (retry_ok && delay_ok).then_some(Decision {
            denial,
            limit,
            remaining,
            reset_after_us,
            retry_after_us,
            delay_us,
        })
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

    /// The wire code of [`Decision::denial`]: 0 allowed, 1 limited, 2 cost exceeds
    /// capacity, 3 store full.
    #[must_use]
    pub const fn denial_code(&self) -> u8 {
        match self.denial {
            None => 0,
            Some(Denial::Limited) => 1,
            Some(Denial::CostExceedsCapacity) => 2,
            Some(Denial::StoreFull) => 3,
        }
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
