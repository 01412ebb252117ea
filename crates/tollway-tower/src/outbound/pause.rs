//! An upstream's 429, as a pause every worker sharing the key sees.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode, header};
use tollway_core::{Algorithm, ConfigError, Policy, Quota};

/// A pause no `Retry-After` states: a 429 without one, or with one that is not a
/// number of seconds or an HTTP date.
pub const DEFAULT_PAUSE: Duration = Duration::from_secs(1);

/// The pause store's policy for pauses up to `max_pause`. `None` for no pausing.
///
/// It is a GCRA of one unit a millisecond, whose capacity is the longest pause in
/// milliseconds. A request peeks at the whole capacity. It fits only while no pause runs,
/// and peeking charges nothing. A pause of `d` drains it to at most `capacity − d` units
/// (`Operation::Drain`). That is one atomic step. So racing pauses do not add up, and a
/// longer one running stands. The capacity is whole again `d` later, and the pause is
/// over, for every worker that shares the store.
pub(super) fn policy(max_pause: Duration) -> Result<Option<Policy>, ConfigError> {
    let ms = u32::try_from(max_pause.as_millis()).unwrap_or(u32::MAX);
    if ms == 0 {
        return Ok(None);
    }
    let quota = Quota::with_period(ms.into(), Duration::from_millis(u64::from(ms)))?;
    Policy::new("outbound-pause", Algorithm::Gcra, quota).map(Some)
}

/// The pause a response asks for, if it is a refusal: a 429, or a gRPC
/// `RESOURCE_EXHAUSTED` (`grpc-status: 8`).
///
/// The rule for its `Retry-After`:
///
/// - A whole number of seconds (digits only) is that long, however many digits.
/// - An HTTP date is the time from now until then. It is nothing if the date has passed:
///   the upstream says to retry now.
/// - Anything else is [`DEFAULT_PAUSE`]: missing, negative, signed, fractional, garbage.
///
/// Whatever it says, the pause is at most `max_pause`. So one bad answer cannot stall the
/// fleet for a day. A gRPC status is read from the response's headers. So it is a
/// trailers-only refusal, not one sent in trailers after a stream began.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use http::{HeaderMap, HeaderValue, StatusCode};
/// use tollway_tower::outbound::pause_of;
///
/// let max = Duration::from_secs(60);
/// let mut headers = HeaderMap::new();
/// assert_eq!(pause_of(StatusCode::OK, &headers, max), None);
/// assert_eq!(pause_of(StatusCode::TOO_MANY_REQUESTS, &headers, max), Some(Duration::from_secs(1)));
/// for (value, pause) in [("2", 2), ("-5", 1), ("+5", 1), ("soon", 1), ("86400", 60), ("99999999999999999999", 60)] {
///     headers.insert("retry-after", HeaderValue::from_static(value));
///     let got = pause_of(StatusCode::TOO_MANY_REQUESTS, &headers, max);
///     assert_eq!(got, Some(Duration::from_secs(pause)), "{value}");
/// }
/// ```
#[must_use]
pub fn pause_of(status: StatusCode, headers: &HeaderMap, max_pause: Duration) -> Option<Duration> {
    let refused = status == StatusCode::TOO_MANY_REQUESTS
        || headers
            .get("grpc-status")
            .is_some_and(|s| s.as_bytes() == b"8");
    if !refused {
        return None;
    }
    let stated = headers
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .and_then(|v| {
            if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
                // Too many digits for a u64 is longer than any pause.
                return Some(v.parse::<u64>().map_or(max_pause, Duration::from_secs));
            }
            let at = httpdate::parse_http_date(v).ok()?;
            Some(at.duration_since(SystemTime::now()).unwrap_or_default())
        });
    Some(stated.unwrap_or(DEFAULT_PAUSE).min(max_pause))
}
