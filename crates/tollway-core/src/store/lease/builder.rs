//! How big loans are, and how many keys are tracked.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::table::{Sizing, Table};
use super::{Inner, Leased};
use crate::{Clock, ConfigError, MonotonicClock, Store};

/// Builds a [`Leased`] store: every setting is checked by [`build`](Self::build).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollway_core::{Leased, MemoryStore};
///
/// let leased = Leased::builder(MemoryStore::new())
///     .horizon(Duration::from_millis(100))
///     .min_units(16)
///     .max_share(0.05)
///     .build()?;
/// # let _ = leased;
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
#[must_use]
pub struct LeasedBuilder<S, C = MonotonicClock> {
    store: S,
    clock: C,
    horizon: Duration,
    min_units: u64,
    max_share: f64,
    idle: Duration,
    max_keys: usize,
}

impl<S, C> fmt::Debug for LeasedBuilder<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeasedBuilder")
            .field("horizon", &self.horizon)
            .field("min_units", &self.min_units)
            .field("max_share", &self.max_share)
            .field("idle", &self.idle)
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}

impl<S: Store> LeasedBuilder<S> {
    pub(super) fn new(store: S) -> Self {
        LeasedBuilder {
            store,
            clock: MonotonicClock::new(),
            horizon: Duration::from_millis(200),
            min_units: 8,
            max_share: 0.1,
            idle: Duration::from_secs(10),
            max_keys: 10_000,
        }
    }
}

impl<S: Store, C: Clock> LeasedBuilder<S, C> {
    /// How long a loan should last at a key's demand here (default 200 ms). A loan asks
    /// for the units the key's requests asked for over the last horizon.
    pub fn horizon(mut self, horizon: Duration) -> Self {
        self.horizon = horizon;
        self
    }

    /// The smallest loan worth a call (default 8 units). A key whose requests ask
    /// for fewer over a horizon is decided one call a request.
    pub fn min_units(mut self, units: u64) -> Self {
        self.min_units = units;
        self
    }

    /// The largest share of a limit's capacity one loan may hold (default 0.1). The
    /// capacity is a bucket's or GCRA's burst, a window's limit.
    pub fn max_share(mut self, share: f64) -> Self {
        self.max_share = share;
        self
    }

    /// How long a key goes unseen before it may be forgotten (default 10 s).
    pub fn idle(mut self, idle: Duration) -> Self {
        self.idle = idle;
        self
    }

    /// The most keys (each with its set of policies) tracked at once (default 10,000).
    /// Past it, a new key is decided one call a request until an idle one is forgotten.
    pub fn max_keys(mut self, keys: usize) -> Self {
        self.max_keys = keys;
        self
    }

    /// The clock loans count their deadlines on (default [`MonotonicClock`]).
    pub fn clock<D: Clock>(self, clock: D) -> LeasedBuilder<S, D> {
        LeasedBuilder {
            store: self.store,
            clock,
            horizon: self.horizon,
            min_units: self.min_units,
            max_share: self.max_share,
            idle: self.idle,
            max_keys: self.max_keys,
        }
    }

    /// Builds the store.
    ///
    /// # Errors
    ///
    /// When the horizon is zero, `min_units` is 0, `max_share` is not a share above 0
    /// and at most 1, or `max_keys` is 0.
    pub fn build(self) -> Result<Leased<S, C>, ConfigError> {
        if self.horizon.is_zero() {
            return Err(ConfigError::new(
                "a lease horizon must be above zero: 200 ms holds a fifth of a second of a key's demand",
            ));
        }
        if self.min_units == 0 {
            return Err(ConfigError::new(
                "a lease's min_units must be at least 1 (8: lease once a key asks for 8 units a horizon)",
            ));
        }
        if !(self.max_share > 0.0 && self.max_share <= 1.0) {
            return Err(ConfigError::new(format!(
                "a lease's max_share must be above 0 and at most 1 (0.1: a tenth of a limit's capacity); got {}",
                self.max_share
            )));
        }
        if self.max_keys == 0 {
            return Err(ConfigError::new(
                "a lease table's max_keys must be at least 1",
            ));
        }
        let shards = 64.min(self.max_keys.next_power_of_two());
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1);
        let sizing = Sizing {
            horizon: micros(self.horizon),
            min_units: self.min_units,
            max_share: self.max_share,
            idle: micros(self.idle),
            per_shard: self.max_keys.div_ceil(shards),
        };
        Ok(Leased {
            inner: Arc::new(Inner {
                store: self.store,
                clock: self.clock,
                table: Table::new(shards, sizing),
                sweeping: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }
}
