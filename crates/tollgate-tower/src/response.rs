//! What the layer answers: rate-limit headers, 429, 503.

use std::fmt::Write as _;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use tollgate_core::{Decision, Denial, Policy};

use crate::limits::HeaderStyle;

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

/// A response body the layer can write its own answers (429, 503, gRPC statuses) in.
///
/// Implemented for the bodies of axum (feature `axum`), tonic (feature `tonic`),
/// `http_body_util`'s `Full<Bytes>` and boxed bodies, and plain `Bytes`, `Vec<u8>` and
/// `String`.
pub trait RejectionBody: Sized {
    /// A body holding `bytes`.
    fn from_bytes(bytes: Bytes) -> Self;
}

impl RejectionBody for Bytes {
    fn from_bytes(bytes: Bytes) -> Self {
        bytes
    }
}

impl RejectionBody for Vec<u8> {
    fn from_bytes(bytes: Bytes) -> Self {
        bytes.into()
    }
}

impl RejectionBody for String {
    fn from_bytes(bytes: Bytes) -> Self {
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl RejectionBody for http_body_util::Full<Bytes> {
    fn from_bytes(bytes: Bytes) -> Self {
        http_body_util::Full::new(bytes)
    }
}

impl<E> RejectionBody for http_body_util::combinators::BoxBody<Bytes, E> {
    fn from_bytes(bytes: Bytes) -> Self {
        use http_body_util::BodyExt;
        http_body_util::Full::new(bytes)
            .map_err(|never| match never {})
            .boxed()
    }
}

impl<E: 'static> RejectionBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E> {
    fn from_bytes(bytes: Bytes) -> Self {
        use http_body_util::BodyExt;
        http_body_util::Full::new(bytes)
            .map_err(|never| match never {})
            .boxed_unsync()
    }
}

#[cfg(feature = "axum")]
impl RejectionBody for axum::body::Body {
    fn from_bytes(bytes: Bytes) -> Self {
        axum::body::Body::from(bytes)
    }
}

/// A decision, and the policy that made it.
#[derive(Clone, Debug)]
pub struct Verdict {
    /// The policy.
    pub policy: Policy,
    /// Its decision.
    pub decision: Decision,
}

/// A denied request, as handed to a custom rejection handler.
#[derive(Debug)]
pub struct Rejection<'a> {
    verdict: &'a Verdict,
    retry_after_secs: Option<u64>,
}

impl<'a> Rejection<'a> {
    pub(crate) fn new(verdict: &'a Verdict) -> Self {
        Rejection {
            verdict,
            retry_after_secs: retry_after_secs(&verdict.decision),
        }
    }

    /// The decision that denied the request.
    #[must_use]
    pub fn decision(&self) -> &Decision {
        &self.verdict.decision
    }

    /// The policy that denied it.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.verdict.policy
    }

    /// Whole seconds to wait, rounded up and never 0; `None` when waiting cannot help
    /// (the request costs more than the limit's capacity).
    #[must_use]
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after_secs
    }
}

/// Builds the response for a denied request; the layer adds the rate-limit headers.
pub type RejectionHandler = Arc<dyn Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync>;

/// `Retry-After` for a decision: whole seconds rounded up, never 0.
pub(crate) fn retry_after_secs(d: &Decision) -> Option<u64> {
    d.retry_after()
        .map(|r| r.as_micros().div_ceil(1_000_000).max(1) as u64)
}

/// The default body of a 429: `{"error":"Too Many Requests","message":"..."}`.
#[must_use]
pub fn default_rejection(rejection: &Rejection<'_>) -> Response<Bytes> {
    let message = match (rejection.retry_after_secs(), rejection.decision().denial()) {
        (Some(n), _) => format!("API rate limit exceeded. Please retry after {n} seconds."),
        (None, Some(Denial::StoreFull)) => {
            "The rate limiter is tracking too many callers to admit a new one. Please retry later."
                .to_owned()
        }
        _ => "This request costs more than the rate limit allows at once; it cannot succeed."
            .to_owned(),
    };
    json(StatusCode::TOO_MANY_REQUESTS, &message)
}

/// The layer's own refusal (a missing key, a failed store): JSON over HTTP, the matching
/// status code over gRPC.
pub(crate) fn refusal(status: StatusCode, message: &str, grpc: bool) -> Response<Bytes> {
    #[cfg(feature = "tonic")]
    if grpc {
        return crate::grpc::response(crate::grpc::status_for_http(status, message));
    }
    let _ = grpc;
    json(status, message)
}

/// A JSON error response `{"error": <reason>, "message": <message>}`.
pub(crate) fn json(status: StatusCode, message: &str) -> Response<Bytes> {
    let mut body = String::with_capacity(64 + message.len());
    body.push_str("{\"error\":\"");
    body.push_str(status.canonical_reason().unwrap_or(""));
    body.push_str("\",\"message\":\"");
    for c in message.chars() {
        match c {
            '"' => body.push_str("\\\""),
            '\\' => body.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(body, "\\u{:04x}", u32::from(c));
            }
            c => body.push(c),
        }
    }
    body.push_str("\"}");
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// Adds the rate-limit headers for `verdicts` (every limit checked, `most` the one
/// reported by the legacy headers) at wall time `now_us`.
pub(crate) fn add_headers(
    headers: &mut HeaderMap,
    style: HeaderStyle,
    verdicts: &[Verdict],
    most: &Verdict,
    now_us: u64,
) {
    let d = &most.decision;
    if !d.is_allowed() {
        if let Some(secs) = retry_after_secs(d) {
            headers.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
    }
    if matches!(style, HeaderStyle::Legacy | HeaderStyle::Both) {
        let reset = (now_us + d.reset_after_micros()).div_ceil(1_000_000);
        headers.insert(X_RATELIMIT_LIMIT.clone(), HeaderValue::from(d.limit()));
        headers.insert(
            X_RATELIMIT_REMAINING.clone(),
            HeaderValue::from(d.remaining()),
        );
        headers.insert(X_RATELIMIT_RESET.clone(), HeaderValue::from(reset));
    }
    if matches!(style, HeaderStyle::Ietf | HeaderStyle::Both) {
        let (mut policy, mut current) = (String::new(), String::new());
        for (i, v) in verdicts.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            let quota = v.policy.quota();
            let window = quota.period_micros().div_ceil(1_000_000);
            let reset = v.decision.reset_after_micros().div_ceil(1_000_000);
            let name = v.policy.name();
            let _ = write!(
                policy,
                "{sep}\"{name}\";q={};w={window}",
                v.decision.limit()
            );
            let _ = write!(
                current,
                "{sep}\"{name}\";r={};t={reset}",
                v.decision.remaining()
            );
        }
        // Policy names are A-Z a-z 0-9 _ - . and the rest are digits: always valid.
        if let Ok(value) = HeaderValue::from_str(&policy) {
            headers.insert(RATELIMIT_POLICY.clone(), value);
        }
        if let Ok(value) = HeaderValue::from_str(&current) {
            headers.insert(RATELIMIT.clone(), value);
        }
    }
}

/// Of several decisions, the one to report: a denial if any (the longest wait), else the
/// one with the fewest remaining (the soonest to deny).
pub(crate) fn most_restrictive(verdicts: &[Verdict]) -> Option<&Verdict> {
    verdicts.iter().min_by_key(|v| {
        let d = &v.decision;
        (
            d.is_allowed(),
            u64::MAX - d.retry_after_micros(),
            d.remaining(),
            u64::MAX - d.reset_after_micros(),
        )
    })
}
