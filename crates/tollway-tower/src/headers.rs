//! The rate-limit headers: `X-RateLimit-*`, the IETF `RateLimit` fields, `Retry-After`.

use std::fmt::Write as _;

use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderName, HeaderValue};
use tollway_core::{Algorithm, Policy};

use crate::verdict::Verdict;

/// `X-RateLimit-Limit`: the capacity of the most restrictive limit.
pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`: unit-cost requests that would pass now.
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`: Unix time, in seconds, at which the caller is back to full capacity.
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// `RateLimit-Policy` (IETF draft): each applied policy's quota and window.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF draft): each applied policy's remaining units and reset time.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Which rate-limit headers responses carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` (Unix seconds),
    /// and `Retry-After` on denials. The default.
    Legacy,
    /// The IETF structured fields `RateLimit-Policy` and `RateLimit`
    /// (draft-ietf-httpapi-ratelimit-headers-10), and `Retry-After` on denials.
    ///
    /// ```text
    /// RateLimit-Policy: "api";q=20;w=60, "calls";q=4;qu="concurrent-requests"
    /// RateLimit: "api";r=0;t=3, "calls";r=3
    /// ```
    ///
    /// - `q`: the units a policy holds at most (its burst). `w`: the seconds they take to
    ///   come back from empty, so `q / w` is never faster than the quota. A calendar
    ///   period's `w` is its longest window (a month: 31 days and an hour); `t` says
    ///   when the current one ends.
    /// - A limit on calls in flight: `qu="concurrent-requests"`, no `w`.
    /// - `r`: the units left now.
    /// - `t`: the seconds until more units come. For a bucket and GCRA, the next unit;
    ///   for a fixed window, its end; for a sliding window, when it is whole again (an
    ///   upper bound). On a refusal, the wait it names, never later than `Retry-After`.
    ///   No `t` when a policy is whole, for calls in flight, or when no wait helps.
    Ietf,
    /// Both.
    Both,
    /// None but `Retry-After` on denials.
    None,
}

impl HeaderStyle {
    pub(crate) fn legacy(self) -> bool {
        matches!(self, HeaderStyle::Legacy | HeaderStyle::Both)
    }

    fn ietf(self) -> bool {
        matches!(self, HeaderStyle::Ietf | HeaderStyle::Both)
    }
}

/// The rate-limit headers of one response, decided with its request (so that a shaping
/// delay does not move `X-RateLimit-Reset`), written when the response is ready.
#[derive(Debug, Default)]
pub(crate) struct RateLimitHeaders {
    /// `Retry-After`, seconds: denials only.
    retry_after: Option<u64>,
    legacy: Option<Legacy>,
    /// `RateLimit-Policy` and `RateLimit`.
    ietf: Option<Box<(HeaderValue, HeaderValue)>>,
}

/// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
#[derive(Debug)]
struct Legacy {
    limit: HeaderValue,
    remaining: u64,
    reset: u64,
}

impl RateLimitHeaders {
    /// No headers.
    pub(crate) fn none() -> Self {
        Self::default()
    }

    /// The headers of `style` for a request decided by `verdicts`, of which `most` is the
    /// one to report; `legacy`, when the style sends `X-RateLimit-*`, is its
    /// `X-RateLimit-Limit` value and the wall time (microseconds since the Unix epoch). A
    /// denial carries `Retry-After` in every style.
    pub(crate) fn new(
        style: HeaderStyle,
        verdicts: &[Verdict<'_>],
        most: &Verdict<'_>,
        legacy: Option<(HeaderValue, u64)>,
    ) -> Self {
        let legacy = legacy.map(|(limit, now_us)| {
            let d = &most.decision;
            Legacy {
                limit,
                remaining: d.remaining(),
                reset: (now_us + d.reset_after_micros()).div_ceil(1_000_000),
            }
        });
        RateLimitHeaders {
            retry_after: most.retry_after_secs(),
            legacy,
            ietf: style
                .ietf()
                .then(|| Box::new(ietf_fields(verdicts, most.retry_after_secs()))),
        }
    }

    /// Adds the headers to `map`, replacing any of the same name.
    pub(crate) fn insert_into(self, map: &mut HeaderMap) {
        if let Some(secs) = self.retry_after {
            map.insert(RETRY_AFTER, number(secs));
        }
        if let Some(legacy) = self.legacy {
            map.insert(X_RATELIMIT_LIMIT.clone(), legacy.limit);
            map.insert(X_RATELIMIT_REMAINING.clone(), number(legacy.remaining));
            map.insert(X_RATELIMIT_RESET.clone(), number(legacy.reset));
        }
        if let Some(ietf) = self.ietf {
            let (policy, current) = *ietf;
            map.insert(RATELIMIT_POLICY.clone(), policy);
            map.insert(RATELIMIT.clone(), current);
        }
    }
}

/// The rate-limit headers the layer writes for a request decided by `verdicts`, in
/// `style`: the most restrictive verdict's, and `Retry-After` on a denial.
/// `now_unix_micros` is the wall time `X-RateLimit-Reset` counts from.
///
/// For a service that answers for a proxy: tollway-server adds these to an Envoy
/// response, as the layer would.
///
/// # Examples
///
/// ```
/// use tollway_tower::{Algorithm, HeaderStyle, MemoryStore, Policy, Quota, Verdict};
///
/// let policy = Policy::new("api", Algorithm::Gcra, Quota::per_minute(10)?)?;
/// let decision = MemoryStore::new().check_sync(b"ip:203.0.113.9", &policy, 1);
/// let verdicts = [Verdict { policy: &policy, decision }];
/// let headers = tollway_tower::rate_limit_headers(HeaderStyle::Legacy, &verdicts, 0);
/// assert_eq!(headers["x-ratelimit-limit"], "10");
/// assert_eq!(headers["x-ratelimit-remaining"], "9");
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
#[must_use]
pub fn rate_limit_headers(
    style: HeaderStyle,
    verdicts: &[Verdict<'_>],
    now_unix_micros: u64,
) -> HeaderMap {
    let mut map = HeaderMap::new();
    let Some(most) = crate::verdict::most_restrictive(verdicts) else {
        return map;
    };
    let verdict = &verdicts[most];
    let legacy = style
        .legacy()
        .then(|| (number(verdict.decision.limit()), now_unix_micros));
    RateLimitHeaders::new(style, verdicts, verdict, legacy).insert_into(&mut map);
    map
}

/// `X-RateLimit-Limit` of each of a layer's policies (its burst), made when the layer is
/// built, by the policy's index among the layer's.
#[derive(Debug)]
pub(crate) struct LimitValues(Box<[HeaderValue]>);

impl LimitValues {
    /// The values of `policies`, in their order.
    pub(crate) fn new(policies: &[Policy]) -> Self {
        LimitValues(policies.iter().map(|p| number(p.quota().burst())).collect())
    }

    /// `X-RateLimit-Limit` for a decision of `policy`, at `index`, whose limit is
    /// `limit`: the value made with the layer, unless the store decided with another
    /// capacity (a fallback limiter's share of the quota).
    pub(crate) fn get(&self, index: usize, policy: &Policy, limit: u64) -> HeaderValue {
        if policy.quota().burst() == limit {
            self.0[index].clone()
        } else {
            number(limit)
        }
    }
}

/// A header value of `n`'s decimal digits, in one allocation of their size:
/// `HeaderValue::from(u64)` makes two (a 20-byte buffer, then a handle to share it), which
/// on a 429 (three numbers) costs 3.4% more instructions a request (BENCHMARKS.md).
pub(crate) fn number(n: u64) -> HeaderValue {
    let mut digits = itoa::Buffer::new();
    // Decimal digits are always a valid header value.
    HeaderValue::from_str(digits.format(n)).unwrap_or_else(|_| HeaderValue::from(n))
}

/// The largest Integer a structured field may carry (RFC 9651, section 3.3.1): a larger
/// count is sent as this.
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// `RateLimit-Policy` and `RateLimit` for `verdicts`, as [`HeaderStyle::Ietf`] says;
/// `retry_after` is the response's `Retry-After`, if any.
fn ietf_fields(verdicts: &[Verdict<'_>], retry_after: Option<u64>) -> (HeaderValue, HeaderValue) {
    let (mut policy, mut current) = (String::new(), String::new());
    for (i, v) in verdicts.iter().enumerate() {
        let sep = if i == 0 { "" } else { ", " };
        let name = v.policy.name();
        let d = &v.decision;
        let q = d.limit().min(SF_INTEGER_MAX);
        let r = d.remaining().min(SF_INTEGER_MAX);
        // Writing to a String cannot fail.
        if v.policy.algorithm() == Algorithm::Concurrency {
            let _ = write!(policy, "{sep}\"{name}\";q={q};qu=\"concurrent-requests\"");
        } else {
            let window = v.policy.quota().fill_micros().div_ceil(1_000_000).max(1);
            let _ = write!(policy, "{sep}\"{name}\";q={q};w={window}");
        }
        let _ = write!(current, "{sep}\"{name}\";r={r}");
        if let Some(t) = more_in(v) {
            let t = retry_after.map_or(t, |wait| t.min(wait));
            let _ = write!(current, ";t={}", t.min(SF_INTEGER_MAX));
        }
    }
    // Policy names are A-Z a-z 0-9 _ - . and the rest are digits, quotes, `;`, `=`, `,`
    // and spaces: always a valid value.
    let value =
        |text: String| HeaderValue::try_from(text).unwrap_or_else(|_| HeaderValue::from_static(""));
    (value(policy), value(current))
}

/// Seconds, rounded up, until `verdict`'s policy has more units than now: the `t` of
/// `RateLimit`. `None` when it is whole, or refused by what no wait cures.
fn more_in(verdict: &Verdict<'_>) -> Option<u64> {
    let d = &verdict.decision;
    let micros = if !d.is_allowed() {
        d.retry_after_micros()
    } else if d.remaining() >= d.limit() || d.reset_after_micros() == 0 {
        return None;
    } else {
        match verdict.policy.algorithm() {
            // Units come back one at a time, one emission apart: the next one comes when
            // what is missing is a whole number of units.
            Algorithm::TokenBucket
            | Algorithm::LeakyBucket
            | Algorithm::LeakyBucketShaper
            | Algorithm::Gcra => {
                let each = verdict.policy.quota().emission_micros().max(1);
                match d.reset_after_micros() % each {
                    0 => each,
                    part => part,
                }
            }
            // A slot comes back when a call ends, which no clock says.
            Algorithm::Concurrency => return None,
            // A fixed window's units come back at its end; a sliding window's as its old
            // requests age, and all of them by when it is whole.
            _ => d.reset_after_micros(),
        }
    };
    (micros > 0).then(|| micros.div_ceil(1_000_000))
}
