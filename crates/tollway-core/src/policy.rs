//! A named rule: which algorithm, at which quota.

use std::sync::Arc;

use crate::algorithm::Algorithm;
use crate::error::ConfigError;
use crate::quota::Quota;

/// A named rate-limiting rule: an [`Algorithm`] applied at a [`Quota`].
///
/// The name namespaces the keys a store keeps for the policy. So two policies never share
/// state, even for the same caller: a per-user limit and a per-route limit, say, or the
/// Free and the Pro tier. Cloning is cheap.
///
/// # Examples
///
/// ```
/// use tollway_core::{Algorithm, Policy, Quota};
///
/// let free = Policy::new("free", Algorithm::TokenBucket, Quota::per_minute(100)?)?;
/// let pro = Policy::new("pro", Algorithm::Gcra, Quota::per_minute(10_000)?)?;
/// assert_eq!(free.name(), "free");
/// assert_eq!(pro.quota().limit(), 10_000);
///
/// // A burst means nothing to a window algorithm: say so now, not on a request.
/// let bursty = Quota::per_minute(100)?.with_burst(150)?;
/// let err = Policy::new("w", Algorithm::FixedWindow, bursty).unwrap_err();
/// assert!(err.to_string().contains("burst"));
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Policy {
    name: Arc<str>,
    algorithm: Algorithm,
    quota: Quota,
    id: u64,
    state_id: u64,
    rate: u64,
    rate_id: u64,
}

/// The longest policy name accepted, in bytes.
pub const MAX_POLICY_NAME: usize = 64;

/// The highest limit a sliding window log serves, in units a period.
///
/// The log keeps one entry a unit, and admits a request of cost `n` with `n` of them. In
/// Redis an entry is a sorted-set member of about 120 bytes. That is 1.2 MB for a caller
/// at this limit. For higher limits, the sliding window counter estimates the log in two
/// counters.
pub const MAX_SLIDING_LOG_LIMIT: u64 = 10_000;

/// The most units a sliding window log admits in one request, or takes in one charge.
///
/// In Redis each unit is a sorted-set member, written in the request's one script. At
/// this bound one call writes for about 3 ms, well inside the Redis store's stall watch.
/// A request of more is refused as [`Denial::CostExceedsCapacity`](crate::Denial), as
/// one over the limit is.
pub const MAX_SLIDING_LOG_COST: u64 = 1_000;

impl Policy {
    /// A policy named `name` (1 to 64 characters of `A-Z a-z 0-9 _ - .`).
    ///
    /// # Errors
    ///
    /// When the name is empty, too long or has other characters: it becomes part of
    /// store keys. When the quota's numbers form a product past 2^52 in the algorithm's
    /// arithmetic: limit × period and burst × period for the buckets, burst × emission
    /// interval for GCRA and the shaper, limit × period for the sliding window counter.
    /// When the quota sets a burst for a window algorithm. A window counts
    /// `limit` per window and has no use for one. When a sliding window log's limit
    /// passes [`MAX_SLIDING_LOG_LIMIT`].
    pub fn new(
        name: impl Into<String>,
        algorithm: Algorithm,
        quota: Quota,
    ) -> Result<Self, ConfigError> {
        let name: String = name.into();
        if name.is_empty() || name.len() > MAX_POLICY_NAME {
            return Err(ConfigError::new(format!(
                "policy name must be 1 to {MAX_POLICY_NAME} bytes long (got {} bytes)",
                name.len()
            )));
        }
        if let Some(bad) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
        {
            return Err(ConfigError::new(format!(
                "policy name {name:?} has the character {bad:?}: use only A-Z, a-z, 0-9, '_', '-' and '.'"
            )));
        }
        if algorithm == Algorithm::SlidingWindowLog && quota.limit() > MAX_SLIDING_LOG_LIMIT {
            return Err(ConfigError::new(format!(
                "policy {name:?}: a sliding window log keeps an entry for every unit, so it \
                 serves at most {MAX_SLIDING_LOG_LIMIT} a period (got {}); use the sliding \
                 window counter, or a token bucket or GCRA, for higher limits",
                quota.limit()
            )));
        }
        if let Some(calendar) = quota.calendar()
            && algorithm != Algorithm::FixedWindow
        {
            return Err(ConfigError::new(format!(
                "policy {name:?}: a {calendar} is a fixed window's period; {} needs a \
                 period of its own length (\"1h\", \"30d\"): use algorithm fixed_window, \
                 or a period",
                algorithm.name()
            )));
        }
        quota
            .check_exact(algorithm)
            .map_err(|e| ConfigError::new(format!("policy {name:?}: {e}")))?;
        if !algorithm.uses_burst() && quota.burst() != quota.limit() {
            return Err(ConfigError::new(format!(
                "policy {name:?}: {} counts at most `limit` per window and has no burst; \
                 remove with_burst({}) or use a bucket algorithm (token bucket, leaky bucket, GCRA)",
                algorithm.name(),
                quota.burst()
            )));
        }
        let id = fnv1a(
            name.bytes()
                .chain([0])
                .chain(algorithm.name().bytes())
                .chain(quota.limit().to_le_bytes())
                .chain(quota.burst().to_le_bytes())
                .chain(quota.period_micros().to_le_bytes()),
        );
        let state_id = state_id(&name, algorithm, &quota);
        let rate = rate(algorithm, &quota);
        Ok(Policy {
            name: name.into(),
            algorithm,
            quota,
            id,
            state_id,
            rate,
            rate_id: state_id ^ mix_rate(rate),
        })
    }

    /// A policy whose id and state id are `id` rather than its own digests: for a count
    /// kept under a name of its own (a split store's share of a window).
    #[cfg(feature = "regions")]
    pub(crate) fn with_id(
        name: impl Into<String>,
        algorithm: Algorithm,
        quota: Quota,
        id: u64,
    ) -> Result<Self, ConfigError> {
        Policy::new(name, algorithm, quota).map(|policy| Policy {
            id,
            state_id: id,
            rate_id: id ^ mix_rate(policy.rate),
            ..policy
        })
    }

    /// The same policy at another quota: a customer's own limit (a contract, a plan kept
    /// in a database) under its tier's name and algorithm.
    ///
    /// Its state is the tier's when the period is the same: a customer whose quota
    /// changes keeps what it used, as a policy whose quota changes does.
    ///
    /// # Errors
    ///
    /// As [`Policy::new`], for this algorithm at `quota`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_core::{Algorithm, Policy, Quota};
    ///
    /// let pro = Policy::new("pro", Algorithm::Gcra, Quota::per_minute(10_000)?)?;
    /// let acme = pro.with_quota(pro.quota().with_limit(50_000)?)?;
    /// assert_eq!((acme.name(), acme.quota().limit()), ("pro", 50_000));
    /// assert_eq!(acme.state_id(), pro.state_id());
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    pub fn with_quota(&self, quota: Quota) -> Result<Self, ConfigError> {
        Policy::new(self.name(), self.algorithm, quota)
    }

    /// The policy's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The algorithm.
    #[must_use]
    pub const fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The quota.
    #[must_use]
    pub const fn quota(&self) -> &Quota {
        &self.quota
    }

    /// A stable 64-bit digest of name, algorithm and quota: the rule itself. Two
    /// policies with the same id decide alike.
    #[must_use]
    pub const fn id(&self) -> u64 {
        self.id
    }

    /// A stable 64-bit digest of what a caller's usage under this policy is kept as: the
    /// name, the algorithm and, but for [`Algorithm::Concurrency`], the period (or the
    /// calendar).
    ///
    /// Limit and burst are not part of it. So a changed limit or burst keeps what each
    /// caller used: a raise gives the difference, a cut refuses until usage is below the
    /// new limit. A changed algorithm or period starts every caller afresh.
    ///
    /// ```
    /// use tollway_core::{Algorithm, Policy, Quota};
    ///
    /// let free = Policy::new("plan", Algorithm::TokenBucket, Quota::per_minute(100)?)?;
    /// let pro = Policy::new("plan", Algorithm::TokenBucket, Quota::per_minute(10_000)?)?;
    /// assert_eq!(free.state_id(), pro.state_id());
    /// assert_ne!(free.id(), pro.id());
    /// let hourly = Policy::new("plan", Algorithm::TokenBucket, Quota::per_hour(6_000)?)?;
    /// assert_ne!(free.state_id(), hourly.state_id());
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    #[must_use]
    pub const fn state_id(&self) -> u64 {
        self.state_id
    }

    /// What the algorithm's state is measured by, where it is measured in time: a token
    /// bucket's (and the meter's) limit, GCRA's (and the shaper's) emission interval;
    /// 0 for the others, whose counts mean the same under any limit. A state written at
    /// one rate is carried to another by the algorithm's `carry`.
    #[must_use]
    pub(crate) const fn rate(&self) -> u64 {
        self.rate
    }

    /// The state id moved by the rate ([`mix_rate`]): where a store that keeps no rate
    /// beside a state (the memory store) keeps it.
    #[must_use]
    pub(crate) const fn rate_id(&self) -> u64 {
        self.rate_id
    }
}

/// What a state id is moved by for a `rate` (see [`Policy::rate_id`]): 0 for 0, else a
/// mix of its bits, so that two rates move it apart.
pub(crate) const fn mix_rate(rate: u64) -> u64 {
    if rate == 0 { 0 } else { splitmix64(rate) }
}

/// SplitMix64's output for the state `x`: a stable mix of its bits.
pub(crate) const fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The digest behind [`Policy::state_id`].
fn state_id(name: &str, algorithm: Algorithm, quota: &Quota) -> u64 {
    let period = match algorithm {
        Algorithm::Concurrency => 0,
        _ => quota.period_micros(),
    };
    // A calendar's windows are its unit on its zone's clock.
    let (unit, zone) = quota
        .calendar()
        .map_or(("", ""), |c| (c.unit().name(), c.zone()));
    fnv1a(
        name.bytes()
            .chain([1])
            .chain(algorithm.name().bytes())
            .chain(period.to_le_bytes())
            .chain(unit.bytes())
            .chain([0])
            .chain(zone.bytes()),
    )
}

/// The value behind [`Policy::rate`].
pub(crate) const fn rate(algorithm: Algorithm, quota: &Quota) -> u64 {
    match algorithm {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => quota.limit(),
        Algorithm::Gcra | Algorithm::LeakyBucketShaper => quota.emission_micros(),
        Algorithm::FixedWindow
        | Algorithm::SlidingWindowLog
        | Algorithm::SlidingWindowCounter
        | Algorithm::Concurrency => 0,
    }
}

/// FNV-1a, 64-bit: a stable digest (the same in every process), not a defence against
/// chosen collisions — the memory store seeds its own hasher for that.
pub(crate) fn fnv1a(bytes: impl Iterator<Item = u8>) -> u64 {
    bytes.fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
