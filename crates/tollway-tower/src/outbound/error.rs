//! The error of an outbound request the limiter itself failed.

use std::error::Error;
use std::fmt;
use std::time::Duration;

use tollway_core::StoreError;

/// Why the limiter itself failed an outbound request (the inner service's own errors
/// pass through as they are). Downcast the service's boxed error to tell.
#[derive(Debug)]
#[non_exhaustive]
pub enum OutboundError {
    /// Over the limit for longer than the request may wait: the same request fits in
    /// `retry_after`.
    Limited {
        /// When the limit would admit the request.
        retry_after: Duration,
    },
    /// The request costs more than a limit holds at once: it never fits.
    CostExceedsCapacity,
    /// A memory store holding its bound of keys refused a new one.
    StoreFull,
    /// The store failed (Redis down, a timeout): nothing was sent.
    Store(StoreError),
}

impl fmt::Display for OutboundError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OutboundError::Limited { retry_after } => write!(
                f,
                "outbound rate limit reached: the request fits in {retry_after:?}, longer than it may wait"
            ),
            OutboundError::CostExceedsCapacity => {
                f.write_str("the request costs more than the outbound limit holds at once")
            }
            OutboundError::StoreFull => {
                f.write_str("the limiter's store is full and refused a new key")
            }
            OutboundError::Store(e) => write!(f, "the outbound limiter's store failed: {e}"),
        }
    }
}

impl Error for OutboundError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            OutboundError::Store(e) => Some(e),
            _ => None,
        }
    }
}
