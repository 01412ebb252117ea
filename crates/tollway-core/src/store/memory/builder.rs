//! [`MemoryStoreBuilder`]: a memory store's bounds and clock.

use std::sync::Arc;

use super::cells::{self, Levels};
use super::table::Shard;
use super::{MemoryStore, Shared, WhenFull};
use crate::clock::{Clock, MonotonicClock};
use crate::error::ConfigError;

/// The default bound on tracked keys.
const DEFAULT_MAX_KEYS: usize = 1 << 20;

impl<C: Clock> MemoryStore<C> {
    pub(super) fn from_builder(builder: MemoryStoreBuilder<C>) -> Self {
        let shards = builder
            .shards
            .unwrap_or_else(|| default_shards(builder.max_keys));
        // Rounded down: together the shards never hold more than `max_keys`.
        let max_per_shard = builder.max_keys / shards;
        let origin = builder.clock.now_micros();
        let cells = Levels::new(shards, max_per_shard);
        let shards: Box<[Shard]> = (0..shards)
            .map(|_| Shard::new(cells.meta(), max_per_shard, origin))
            .collect();
        MemoryStore {
            shared: Arc::new(Shared {
                clock: builder.clock,
                origin,
                hasher: foldhash::quality::RandomState::default(),
                cells,
                shard_mask: shards.len() as u64 - 1,
                shards,
                max_per_shard,
                when_full: builder.when_full,
                #[cfg(feature = "metrics")]
                keys: std::sync::atomic::AtomicUsize::new(0),
                #[cfg(feature = "regions")]
                board: Default::default(),
                ledgers: Default::default(),
            }),
        }
    }
}

fn default_shards(max_keys: usize) -> usize {
    (max_keys / 1024).next_power_of_two().clamp(1, 1024)
}

/// Builds a [`MemoryStore`] with other bounds or another clock.
///
/// # Examples
///
/// ```
/// use tollway_core::{ManualClock, MemoryStore, WhenFull};
///
/// let store = MemoryStore::builder()
///     .max_keys(100_000)
///     .when_full(WhenFull::AllowUntracked)
///     .clock(ManualClock::new())
///     .build()?;
/// assert!(store.is_empty());
///
/// let err = MemoryStore::builder().max_keys(0).build().unwrap_err();
/// assert!(err.to_string().contains("max_keys"));
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct MemoryStoreBuilder<C = MonotonicClock> {
    max_keys: usize,
    shards: Option<usize>,
    when_full: WhenFull,
    clock: C,
}

impl Default for MemoryStoreBuilder<MonotonicClock> {
    fn default() -> Self {
        MemoryStoreBuilder {
            max_keys: DEFAULT_MAX_KEYS,
            shards: None,
            when_full: WhenFull::Deny,
            clock: MonotonicClock::new(),
        }
    }
}

impl<C: Clock> MemoryStoreBuilder<C> {
    /// The most keys held at once (default 1,048,576). Each of the store's shards holds
    /// an equal share, so a shard can fill a little before the store as a whole does.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The number of shards, a power of two from 1 to 1024 (default: one per 1,024 keys
    /// of `max_keys`, at most 1,024). A sweep for idle keys holds one shard's lock at a
    /// time, so fewer keys a shard keep the checks that meet it waiting less (the
    /// repository's `cargo bench -p tollway-core --features testing --bench scaling`).
    /// More shards make each shard's share of `max_keys` smaller, so one shard fills
    /// before the store as a whole does.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// What to do with a new key when the store is full (default [`WhenFull::Deny`]).
    pub fn when_full(mut self, when_full: WhenFull) -> Self {
        self.when_full = when_full;
        self
    }

    /// Reads time from `clock` instead of the monotonic clock.
    pub fn clock<D: Clock>(self, clock: D) -> MemoryStoreBuilder<D> {
        MemoryStoreBuilder {
            max_keys: self.max_keys,
            shards: self.shards,
            when_full: self.when_full,
            clock,
        }
    }

    /// Builds the store.
    ///
    /// # Errors
    ///
    /// When `max_keys` is zero, or `shards` is not a power of two from 1 to 1024 or is
    /// more than `max_keys`, or leaves a shard more than 245,736 keys.
    pub fn build(self) -> Result<MemoryStore<C>, ConfigError> {
        if self.max_keys == 0 {
            return Err(ConfigError::new(
                "memory store max_keys must be at least 1: a store that can hold no key limits nobody",
            ));
        }
        if let Some(shards) = self.shards
            && (!shards.is_power_of_two() || shards > 1024 || shards > self.max_keys)
        {
            return Err(ConfigError::new(format!(
                "memory store shards must be a power of two from 1 to 1024 and at most max_keys ({}); got {shards}",
                self.max_keys
            )));
        }
        let shards = self.shards.unwrap_or_else(|| default_shards(self.max_keys));
        if self.max_keys / shards > cells::MAX_SHARD_KEYS {
            return Err(ConfigError::new(format!(
                "memory store shards may hold at most {} keys each; max_keys {} needs more shards than {shards}",
                cells::MAX_SHARD_KEYS,
                self.max_keys
            )));
        }
        Ok(MemoryStore::from_builder(self))
    }
}
