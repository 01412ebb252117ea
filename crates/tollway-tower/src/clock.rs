//! Time as tokio keeps it.

use tollway_core::Clock;

/// A [`Clock`] reading tokio's clock, counted from when it was made.
///
/// In a running program, that is the monotonic clock. In a test under
/// `tokio::time::pause` (or `#[tokio::test(start_paused = true)]`), it is the paused clock
/// that the test moves. A store on it and the sleeps of a waiting request (see
/// [`outbound`](crate::outbound)) then agree about time, whether it is real or paused.
///
/// # Panics
///
/// When read outside a tokio runtime, as `tokio::time::Instant::now` does under a
/// paused clock; made and read inside one, never.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollway_tower::TokioClock;
/// use tollway_tower::tollway_core::{Algorithm, Clock, MemoryStore, Policy, Quota};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), tollway_tower::tollway_core::ConfigError> {
/// let clock = TokioClock::new();
/// let store = MemoryStore::builder().clock(clock.clone()).build()?;
/// let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(1)?)?;
/// assert!(store.check_sync(b"k", &policy, 1).is_allowed());
/// assert!(!store.check_sync(b"k", &policy, 1).is_allowed());
///
/// tokio::time::sleep(Duration::from_secs(1)).await; // paused: no real wait
/// assert_eq!(clock.now_micros(), 1_000_000);
/// assert!(store.check_sync(b"k", &policy, 1).is_allowed());
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// A clock at zero now.
    #[must_use]
    pub fn new() -> Self {
        TokioClock {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now_micros(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}
