//! Where time comes from.
//!
//! The algorithms never read a clock: they are handed `now` as whole microseconds. A
//! [`Clock`] supplies it to the memory store: [`MonotonicClock`] in production,
//! [`ManualClock`] in tests, which moves only when told to.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A source of monotonic time in whole microseconds since the clock's own origin.
pub trait Clock: Send + Sync + 'static {
    /// Microseconds since this clock's origin. Never decreases.
    fn now_micros(&self) -> u64;
}

/// The process's monotonic clock, counted from when it was made.
///
/// It reads the CPU's time-stamp counter where that is reliable, and the OS monotonic
/// clock otherwise. The counter is read through the `quanta` crate, calibrated once per
/// process against the OS clock. A read then costs a few nanoseconds rather than a
/// system call's worth. That matters on a path taken for every request.
#[derive(Clone, Debug)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    origin: u64,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    #[must_use]
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        MonotonicClock { clock, origin }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now_micros(&self) -> u64 {
        self.clock.delta_as_nanos(self.origin, self.clock.raw()) / 1_000
    }
}

/// A clock that moves only when told to; clones share one time.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollway_core::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// let view = clock.clone();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(view.now_micros(), 1_500_000);
/// ```
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    now_us: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at zero.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A clock at `micros`.
    #[must_use]
    pub fn at_micros(micros: u64) -> Self {
        ManualClock {
            now_us: Arc::new(AtomicU64::new(micros)),
        }
    }

    /// Moves the clock forward by `by` (whole microseconds; the rest is dropped).
    pub fn advance(&self, by: Duration) {
        let us = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        self.now_us.fetch_add(us, Ordering::SeqCst);
    }

    /// Sets the clock to `micros`. Setting it backwards breaks the [`Clock`] promise; the
    /// algorithms tolerate it (a time before a state's own is treated as that time).
    pub fn set_micros(&self, micros: u64) {
        self.now_us.store(micros, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_micros(&self) -> u64 {
        self.now_us.load(Ordering::SeqCst)
    }
}

/// Wall-clock time: microseconds since the Unix epoch.
///
/// For stores shared by several processes that pass their own time (the Redis store's
/// caller-time mode), where every node must count from the same origin. It can step
/// backwards when the system clock is corrected; the algorithms tolerate that, and the
/// Redis store's default, the server's own clock, avoids it.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_micros(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| {
                d.as_secs()
                    .saturating_mul(1_000_000)
                    .saturating_add(u64::from(d.subsec_micros()))
            })
    }
}
