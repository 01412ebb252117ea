//! An upstream's 429, as a pause every worker sharing the key sees.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode, Uri, header};
use sha2::{Digest, Sha256};
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
    let quota = Quota::with_period(ms, Duration::from_millis(u64::from(ms)))?;
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

/// The headers that say which account a request is made for, in the order they are
/// read: the first one present names it.
pub const ACCOUNT_HEADERS: [&str; 3] = ["authorization", "x-api-key", "api-key"];

/// The default pause key: the upstream (the URI's authority), and the account the
/// request names in one of the [`ACCOUNT_HEADERS`], as a digest: `api.example.com`, or
/// `api.example.com#account:3f1c…`. So one account's 429 pauses that account only. The
/// credentials themselves never reach the store: only 16 bytes of their SHA-256.
pub(super) fn account_key(uri: &Uri, headers: &HeaderMap) -> String {
    let upstream = uri.authority().map_or("", |a| a.as_str());
    let Some((name, value)) = ACCOUNT_HEADERS
        .iter()
        .find_map(|&name| Some((name, headers.get(name)?)))
    else {
        return upstream.to_owned();
    };
    let digest = Sha256::new()
        .chain_update(name)
        .chain_update(b":")
        .chain_update(value.as_bytes())
        .finalize();
    let mut key = String::with_capacity(upstream.len() + 41);
    key.push_str(upstream);
    key.push_str("#account:");
    for byte in &digest[..16] {
        // Writing to a String cannot fail.
        let _ = write!(key, "{byte:02x}");
    }
    key
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn the_pause_key_names_the_account_by_a_digest_never_its_credentials() {
        let uri: Uri = "https://api.example.com/v1/charges"
            .parse()
            .unwrap_or_default();
        let mut headers = HeaderMap::new();
        assert_eq!(account_key(&uri, &headers), "api.example.com");
        headers.insert("x-api-key", HeaderValue::from_static("key-b"));
        let by_key = account_key(&uri, &headers);
        headers.insert("authorization", HeaderValue::from_static("Bearer sk-a"));
        let by_bearer = account_key(&uri, &headers);
        assert!(
            by_bearer.starts_with("api.example.com#account:"),
            "{by_bearer}"
        );
        assert_eq!(by_bearer.len(), "api.example.com#account:".len() + 32);
        assert!(!by_bearer.contains("sk-a"), "{by_bearer}");
        assert_ne!(by_key, by_bearer);
        // The same credentials, the same key, in every process.
        assert_eq!(account_key(&uri, &headers), by_bearer);
    }
}
