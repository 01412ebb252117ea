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

impl Policy {
    /// A policy named `name` (1 to 64 characters of `A-Z a-z 0-9 _ - .`).
    ///
    /// # Errors
    ///
    /// When the name is empty, too long or has other characters: it becomes part of
    /// store keys. When the quota sets a burst for a window algorithm. A window counts
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
        Ok(Policy {
            name: name.into(),
            algorithm,
            quota,
            id,
        })
    }

    /// A policy whose state goes under `id` rather than its own digest: for a count whose
    /// limit may change while it lasts (a split store's share of a window).
    #[cfg(feature = "regions")]
    pub(crate) fn with_id(
        name: impl Into<String>,
        algorithm: Algorithm,
        quota: Quota,
        id: u64,
    ) -> Result<Self, ConfigError> {
        Policy::new(name, algorithm, quota).map(|policy| Policy { id, ..policy })
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

    /// A stable 64-bit digest of name, algorithm and quota: changing any of them starts
    /// the policy's callers afresh rather than reading state written under other rules.
    #[must_use]
    pub const fn id(&self) -> u64 {
        self.id
    }
}

/// FNV-1a, 64-bit: a stable digest (the same in every process), not a defence against
/// chosen collisions — the memory store seeds its own hasher for that.
pub(crate) fn fnv1a(bytes: impl Iterator<Item = u8>) -> u64 {
    bytes.fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
