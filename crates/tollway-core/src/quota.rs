//! How much traffic a policy admits: a limit per period, plus a burst.

use std::time::Duration;

use strength_reduce::StrengthReducedU64;

use crate::calendar::Calendar;
use crate::error::ConfigError;

/// The largest product of two quota numbers that every algorithm keeps exact.
///
/// Redis runs our Lua twins with doubles, which hold integers exactly only below 2^53.
/// The bucket algorithms multiply `burst × period` (in microseconds). The sliding window
/// counter multiplies `limit × period`. Keeping both at or below 2^52 leaves one bit of
/// headroom for the sums they form. So Rust and Lua never round differently.
pub(crate) const MAX_EXACT: u64 = 1 << 52;

/// The most units a limit or a burst may be: 2^53, the integers Lua's numbers (doubles)
/// hold exactly. The windows and calls in flight count up to it; the buckets and the
/// sliding window counter are held to less by their products (see
/// [`Policy::new`](crate::Policy::new)).
pub const MAX_UNITS: u64 = 1 << 53;

/// The most units a bucket may owe after charges that did not fit
/// ([`Operation::Charge`](crate::Operation::Charge)), given `per_unit`, what one unit is
/// in the algorithm's own measure (a token bucket's period in ticks, GCRA's emission
/// interval in µs): its state then runs at most [`MAX_EXACT`] past full, so Rust and Lua
/// still compute it exactly. That is far more than any capacity (75 million units for a
/// minute's token bucket, 142 years of GCRA's intervals): a debt is kept, not forgiven.
pub(crate) const fn most_owed(per_unit: u64) -> u64 {
    MAX_EXACT / per_unit
}

/// The longest period, in microseconds (about 35.7 years).
///
/// A window algorithm reaches two periods past now. Today's Unix time plus that stays
/// below 2^53, exact in Lua's doubles, until about 2170.
const MAX_PERIOD_US: u64 = 1 << 50;

/// A rate: `limit` units per `period`, with up to `burst` units at once.
///
/// The burst defaults to the limit. The bucket algorithms (token bucket, leaky bucket and
/// GCRA) use it as their capacity. The window algorithms count at most `limit` per
/// window. They reject a quota whose burst differs from its limit when the policy is
/// built.
///
/// Quotas are validated when they are made. A zero limit, a zero period, or a limit past
/// [`MAX_UNITS`] fail here, not on a request later. Numbers whose products an algorithm
/// cannot keep exact fail when the [`Policy`](crate::Policy) is made. The message says
/// what to change.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollway_core::Quota;
///
/// // The Free tier: 100 requests a minute, all of them usable at once.
/// let free = Quota::per_minute(100)?;
/// assert_eq!(free.limit(), 100);
/// assert_eq!(free.burst(), 100);
/// assert_eq!(free.period(), Duration::from_secs(60));
///
/// // 10 per second on average, but never more than 5 back to back.
/// let smooth = Quota::per_second(10)?.with_burst(5)?;
/// assert_eq!(smooth.burst(), 5);
///
/// // Nonsense fails at construction with a sentence that says what to change.
/// let err = Quota::per_minute(0).unwrap_err();
/// assert!(err.to_string().contains("limit must be at least 1"));
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
#[derive(Clone, Debug)]
pub struct Quota {
    limit: u64,
    period_us: u64,
    burst: u64,
    /// Microseconds per unit for the algorithms that space requests (GCRA, the shaper):
    /// `ceil(period / limit)`, rounded up so that they never admit faster than the quota.
    emission_us: u64,
    /// Microseconds for an empty token bucket to refill: `ceil(burst × period / limit)`.
    fill_us: u64,
    /// Microseconds in which a token bucket refills the most it can miss, 2^52 ticks:
    /// `ceil(2^52 / limit)`.
    owed_us: u64,
    /// The divisors of the hot path, reduced to a multiplication once: a hardware
    /// division costs more than the rest of a decision.
    by_limit: StrengthReducedU64,
    by_period: StrengthReducedU64,
    by_emission: StrengthReducedU64,
    /// `gcd(limit, period)`: a token bucket's ticks (see
    /// [`token_bucket`](crate::algorithm::token_bucket)) come and go in multiples of it,
    /// so its state packs in fewer bits (the memory store's cells).
    by_common: StrengthReducedU64,
    /// The bits of `limit / gcd(limit, period) − 1`, the most a token bucket's partial
    /// microsecond counts in whole multiples of the gcd.
    common_bits: u32,
    /// Windows of a calendar rather than of `period_us` (see
    /// [`per_calendar`](Self::per_calendar)); `period_us` is then the longest.
    calendar: Option<Calendar>,
}

impl PartialEq for Quota {
    fn eq(&self, other: &Self) -> bool {
        (self.limit, self.period_us, self.burst, &self.calendar)
            == (other.limit, other.period_us, other.burst, &other.calendar)
    }
}

impl Eq for Quota {}

impl std::hash::Hash for Quota {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.limit, self.period_us, self.burst, &self.calendar).hash(state);
    }
}

impl Quota {
    /// `limit` units per second.
    ///
    /// # Errors
    ///
    /// When `limit` is zero.
    pub fn per_second(limit: u64) -> Result<Self, ConfigError> {
        Self::with_period(limit, Duration::from_secs(1))
    }

    /// `limit` units per minute.
    ///
    /// # Errors
    ///
    /// When `limit` is zero.
    pub fn per_minute(limit: u64) -> Result<Self, ConfigError> {
        Self::with_period(limit, Duration::from_secs(60))
    }

    /// `limit` units per hour.
    ///
    /// # Errors
    ///
    /// When `limit` is zero or passes [`MAX_UNITS`].
    pub fn per_hour(limit: u64) -> Result<Self, ConfigError> {
        Self::with_period(limit, Duration::from_secs(3600))
    }

    /// `limit` units per `period`, which is counted in whole microseconds.
    ///
    /// # Errors
    ///
    /// When `limit` is zero or passes [`MAX_UNITS`]. When `period` is shorter than one
    /// microsecond, not a whole number of microseconds, or longer than 2^50 µs (about 35
    /// years).
    pub fn with_period(limit: u64, period: Duration) -> Result<Self, ConfigError> {
        if limit == 0 {
            return Err(ConfigError::new(
                "quota limit must be at least 1: a policy that admits nothing is a block, not a rate limit",
            ));
        }
        check_units(limit, "limit")?;
        let nanos = period.as_nanos();
        if nanos < 1_000 {
            return Err(ConfigError::new(format!(
                "quota period must be at least 1 microsecond (got {period:?})"
            )));
        }
        if !nanos.is_multiple_of(1_000) {
            return Err(ConfigError::new(format!(
                "quota period must be a whole number of microseconds (got {period:?})"
            )));
        }
        let period_us = u64::try_from(nanos / 1_000).unwrap_or(u64::MAX);
        if period_us > MAX_PERIOD_US {
            return Err(ConfigError::new(format!(
                "quota period {period:?} is longer than 2^50 microseconds (about 35 years): \
                 times a window reaches must stay exact in every store"
            )));
        }
        Ok(Quota::unchecked(limit, period_us))
    }

    /// `limit` per `period_us` (both above zero), burst `limit`, before the exactness
    /// check.
    fn unchecked(limit: u64, period_us: u64) -> Self {
        let emission_us = period_us.div_ceil(limit);
        let common = gcd(limit, period_us);
        Quota {
            limit,
            period_us,
            burst: limit,
            emission_us,
            fill_us: period_us,
            owed_us: MAX_EXACT.div_ceil(limit),
            by_limit: StrengthReducedU64::new(limit),
            by_period: StrengthReducedU64::new(period_us),
            by_emission: StrengthReducedU64::new(emission_us),
            by_common: StrengthReducedU64::new(common),
            common_bits: u64::BITS - (limit / common - 1).leading_zeros(),
            calendar: None,
        }
    }

    /// `limit` units a window of `calendar`: a minute, hour, day, week, month or year of
    /// a wall clock (see [`calendar`](crate::calendar)). Only a fixed window counts in
    /// one; its period is the longest such window.
    ///
    /// # Errors
    ///
    /// When `limit` is zero or passes [`MAX_UNITS`].
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_core::{Algorithm, Calendar, CalendarUnit, Policy, Quota};
    ///
    /// // 10^10 tokens a month, from the first, in New York.
    /// let month = Calendar::in_zone(CalendarUnit::Month, "America/New_York")?;
    /// let budget = Quota::per_calendar(10_000_000_000, month)?;
    /// let tokens = Policy::new("tokens", Algorithm::FixedWindow, budget.clone())?;
    /// assert_eq!(tokens.quota().calendar().unwrap().zone(), "America/New_York");
    /// // A bucket refills at a rate, which a calendar has not.
    /// assert!(Policy::new("bucket", Algorithm::TokenBucket, budget).is_err());
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    pub fn per_calendar(limit: u64, calendar: Calendar) -> Result<Self, ConfigError> {
        let mut quota = Quota::with_period(limit, calendar.unit().longest())?;
        quota.calendar = Some(calendar);
        Ok(quota)
    }

    /// `limit` units over the same period (or calendar), with a burst of `limit`: a
    /// customer's own limit on its plan's terms.
    ///
    /// # Errors
    ///
    /// When `limit` is zero or passes [`MAX_UNITS`].
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_core::Quota;
    ///
    /// let pro = Quota::per_minute(10_000)?;
    /// let contract = pro.with_limit(50_000)?;
    /// assert_eq!((contract.limit(), contract.period()), (50_000, pro.period()));
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    pub fn with_limit(&self, limit: u64) -> Result<Self, ConfigError> {
        match &self.calendar {
            Some(calendar) => Quota::per_calendar(limit, calendar.clone()),
            None => Quota::with_period(limit, Duration::from_micros(self.period_us)),
        }
    }

    /// The calendar its windows follow, if it has one (see
    /// [`per_calendar`](Self::per_calendar)).
    #[must_use]
    pub fn calendar(&self) -> Option<&Calendar> {
        self.calendar.as_ref()
    }

    /// A fixed window's count: `limit` units per `period_us`, for a window algorithm only
    /// (which needs neither the emission interval's nor a bucket's exactness, so `limit ×
    /// period` may pass 2^52 µs). `None` for a limit of zero, a period beyond 2^50 µs or
    /// finer than a unit a microsecond.
    #[cfg(feature = "regions")]
    pub(crate) fn counting(limit: u64, period_us: u64) -> Option<Self> {
        (limit > 0 && period_us <= MAX_PERIOD_US && period_us >= limit)
            .then(|| Quota::unchecked(limit, period_us))
    }

    /// The same rate with a burst (bucket capacity) of `burst` units.
    ///
    /// # Errors
    ///
    /// When `burst` is zero or passes [`MAX_UNITS`].
    pub fn with_burst(self, burst: u64) -> Result<Self, ConfigError> {
        if burst == 0 {
            return Err(ConfigError::new(
                "quota burst must be at least 1: a bucket that holds nothing admits nothing",
            ));
        }
        check_units(burst, "burst")?;
        let fill =
            (u128::from(burst) * u128::from(self.period_us)).div_ceil(u128::from(self.limit));
        Ok(Quota {
            burst,
            // Within u64 for every policy the algorithms accept (see `Policy::new`).
            fill_us: u64::try_from(fill).unwrap_or(u64::MAX),
            ..self
        })
    }

    /// Whether the products `algorithm` forms stay within 2^52 (see [`MAX_EXACT`]): an
    /// error naming them if not.
    pub(crate) fn check_exact(&self, algorithm: crate::Algorithm) -> Result<(), ConfigError> {
        use crate::Algorithm;
        let fits = |n: u64, per: u64| n.checked_mul(per).is_some_and(|p| p <= MAX_EXACT);
        let (limit, burst, period) = (self.limit, self.burst, self.period_us);
        let (ok, products) = match algorithm {
            Algorithm::TokenBucket | Algorithm::LeakyBucket => (
                fits(limit, period) && fits(burst, period),
                "limit × period and burst × period",
            ),
            Algorithm::Gcra | Algorithm::LeakyBucketShaper => (
                fits(burst, self.emission_us),
                "burst × emission interval (period / limit)",
            ),
            Algorithm::SlidingWindowCounter => (fits(limit, period), "limit × period"),
            // Counts, compared with the limit: no product, and no unit spaced in time.
            Algorithm::FixedWindow | Algorithm::SlidingWindowLog | Algorithm::Concurrency => {
                return Ok(());
            }
        };
        if period < limit {
            return Err(ConfigError::new(format!(
                "quota of {limit} per {period} µs is finer than one unit per microsecond for \
                 {}: use a longer period with a proportionally larger limit, or a fixed window",
                algorithm.name()
            )));
        }
        if ok {
            return Ok(());
        }
        Err(ConfigError::new(format!(
            "quota of {limit} (burst {burst}) per {period} µs is too large for {}: {products} \
             must stay within 2^52 microseconds; use a shorter period with a proportionally \
             smaller limit, or a fixed window (which counts up to 2^53 in any period)",
            algorithm.name()
        )))
    }

    /// Units admitted per period.
    #[must_use]
    pub const fn limit(&self) -> u64 {
        self.limit
    }

    /// Units that may be used at once (the bucket capacity).
    #[must_use]
    pub const fn burst(&self) -> u64 {
        self.burst
    }

    /// The period over which `limit` units are admitted.
    #[must_use]
    pub const fn period(&self) -> Duration {
        Duration::from_micros(self.period_us)
    }

    /// The period in microseconds.
    #[must_use]
    pub const fn period_micros(&self) -> u64 {
        self.period_us
    }

    /// `ceil(n / limit)`.
    #[inline]
    pub(crate) fn per_limit_ceil(&self, n: u64) -> u64 {
        let (q, r) = StrengthReducedU64::div_rem(n, self.by_limit);
        q + u64::from(r != 0)
    }

    /// `n / period`.
    #[inline]
    pub(crate) fn per_period(&self, n: u64) -> u64 {
        n / self.by_period
    }

    /// `n % period`.
    #[inline]
    pub(crate) fn rem_period(&self, n: u64) -> u64 {
        n % self.by_period
    }

    /// `n / emission interval`.
    #[inline]
    pub(crate) fn per_emission(&self, n: u64) -> u64 {
        n / self.by_emission
    }

    /// `n / gcd(limit, period)` and `n % gcd(limit, period)`.
    #[inline]
    pub(crate) fn per_common(&self, n: u64) -> (u64, u64) {
        StrengthReducedU64::div_rem(n, self.by_common)
    }

    /// `gcd(limit, period)`.
    #[inline]
    pub(crate) fn common(&self) -> u64 {
        self.by_common.get()
    }

    /// The bits a number below `limit / gcd(limit, period)` takes.
    #[inline]
    pub(crate) fn common_bits(&self) -> u32 {
        self.common_bits
    }

    /// How long an empty token bucket takes to refill, in microseconds: `burst × period /
    /// limit`, rounded up.
    #[must_use]
    pub const fn fill_micros(&self) -> u64 {
        self.fill_us
    }

    /// How long a token bucket missing 2^52 ticks (its capacity and the most it may owe)
    /// takes to refill, in microseconds: `ceil(2^52 / limit)`.
    pub(crate) const fn owed_micros(&self) -> u64 {
        self.owed_us
    }

    /// The spacing between units for GCRA and the shaper, in microseconds: the period
    /// divided by the limit, rounded up.
    #[must_use]
    pub const fn emission_micros(&self) -> u64 {
        self.emission_us
    }
}

/// An error if `n` passes [`MAX_UNITS`].
fn check_units(n: u64, what: &str) -> Result<(), ConfigError> {
    if n > MAX_UNITS {
        return Err(ConfigError::new(format!(
            "quota {what} {n} passes 2^53 ({MAX_UNITS}), the most units every store counts \
             exactly: count in larger units (kilobytes rather than bytes, say)"
        )));
    }
    Ok(())
}

/// Euclid's greatest common divisor of two numbers above zero.
const fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_limit_period_and_burst_are_rejected_with_a_reason() {
        assert!(Quota::per_second(0).is_err());
        assert!(Quota::with_period(1, Duration::ZERO).is_err());
        assert!(Quota::with_period(1, Duration::from_nanos(1500)).is_err());
        assert!(Quota::per_second(1).unwrap().with_burst(0).is_err());
    }

    #[test]
    fn rates_finer_than_a_microsecond_are_rejected_where_units_are_spaced() {
        use crate::Algorithm;
        let fine = Quota::with_period(1001, Duration::from_millis(1)).unwrap();
        let err = fine.check_exact(Algorithm::Gcra).unwrap_err();
        assert!(
            err.to_string()
                .contains("finer than one unit per microsecond")
        );
        assert!(fine.check_exact(Algorithm::FixedWindow).is_ok());
        assert!(fine.check_exact(Algorithm::Concurrency).is_ok());
        let even = Quota::with_period(1000, Duration::from_millis(1)).unwrap();
        assert!(even.check_exact(Algorithm::Gcra).is_ok());
    }

    #[test]
    fn products_past_two_to_the_fifty_two_are_rejected_where_an_algorithm_forms_them() {
        use crate::Algorithm;
        // 2^52 µs is about 142 years; a million per day is 8.64e16 > 2^52.
        let day = Duration::from_secs(86_400);
        let million = Quota::with_period(1_000_000, day).unwrap();
        let err = million.check_exact(Algorithm::TokenBucket).unwrap_err();
        assert!(err.to_string().contains("2^52"), "{err}");
        assert!(million.check_exact(Algorithm::FixedWindow).is_ok());
        assert!(million.check_exact(Algorithm::Gcra).is_ok());
        let fifty = Quota::with_period(50_000, day).unwrap();
        assert!(fifty.check_exact(Algorithm::SlidingWindowCounter).is_ok());
        let deep = Quota::per_hour(1).unwrap().with_burst(1 << 40).unwrap();
        let err = deep.check_exact(Algorithm::Gcra).unwrap_err();
        assert!(err.to_string().contains("burst"), "{err}");
    }

    #[test]
    fn units_past_two_to_the_fifty_three_are_rejected() {
        let month = Duration::from_secs(31 * 86_400);
        assert!(Quota::with_period(10_000_000_000, month).is_ok());
        assert!(Quota::with_period(MAX_UNITS, Duration::from_secs(1)).is_ok());
        let err = Quota::with_period(MAX_UNITS + 1, month).unwrap_err();
        assert!(err.to_string().contains("2^53"), "{err}");
        let err = Quota::per_second(1)
            .unwrap()
            .with_burst(MAX_UNITS + 1)
            .unwrap_err();
        assert!(err.to_string().contains("burst"), "{err}");
    }

    #[test]
    fn periods_past_two_to_the_fifty_are_rejected() {
        assert!(Quota::with_period(1, Duration::from_micros(1 << 50)).is_ok());
        let err = Quota::with_period(1, Duration::from_micros((1 << 50) + 1)).unwrap_err();
        assert!(err.to_string().contains("35 years"), "{err}");
        assert!(Quota::with_period(1, Duration::MAX).is_err());
    }

    #[test]
    fn emission_interval_rounds_up() {
        let q = Quota::per_second(3).unwrap();
        assert_eq!(q.emission_micros(), 333_334);
        assert_eq!(Quota::per_minute(100).unwrap().emission_micros(), 600_000);
    }
}
