//! What the layer answers: rate-limit headers, 429, 503.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::thread::LocalKey;

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use tollway_core::{Decision, Denial, Policy};

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
#[derive(Clone, Copy, Debug)]
pub struct Verdict<'a> {
    /// The policy.
    pub policy: &'a Policy,
    /// Its decision.
    pub decision: Decision,
}

/// A denied request, as handed to a custom rejection handler.
#[derive(Debug)]
pub struct Rejection<'a> {
    verdict: Verdict<'a>,
    retry_after_secs: Option<u64>,
}

impl<'a> Rejection<'a> {
    pub(crate) fn new(verdict: Verdict<'a>) -> Self {
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
        self.verdict.policy
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
        (Some(n), _) => return retry_after_body(n),
        (None, Some(Denial::StoreFull)) => {
            "The rate limiter is tracking too many callers to admit a new one. Please retry later."
        }
        _ => "This request costs more than the rate limit allows at once; it cannot succeed.",
    };
    json(StatusCode::TOO_MANY_REQUESTS, message)
}

/// The common 429, written without `core::fmt` or an escaping pass: during a flood this
/// is most of what the server answers.
fn retry_after_body(secs: u64) -> Response<Bytes> {
    // The same wait is answered to every caller denied in the same second: each thread
    // keeps the last body it wrote.
    thread_local! {
        static LAST: RefCell<Option<(u64, Bytes)>> = const { RefCell::new(None) };
    }
    let body = last_made(&LAST, secs, write_retry_after_body);
    json_body(StatusCode::TOO_MANY_REQUESTS, body)
}

/// What `make(n)` gave, kept in this thread's `last` and made again only when `n`
/// changes (and made afresh while the thread's locals are torn down).
fn last_made<T: Clone + 'static>(
    last: &'static LocalKey<RefCell<Option<(u64, T)>>>,
    n: u64,
    make: fn(u64) -> T,
) -> T {
    last.try_with(|last| {
        let mut last = last.borrow_mut();
        match &*last {
            Some((m, value)) if *m == n => value.clone(),
            _ => {
                let value = make(n);
                *last = Some((n, value.clone()));
                value
            }
        }
    })
    .unwrap_or_else(|_| make(n))
}

fn write_retry_after_body(secs: u64) -> Bytes {
    const HEAD: &[u8] =
        b"{\"error\":\"Too Many Requests\",\"message\":\"API rate limit exceeded. Please retry after ";
    const TAIL: &[u8] = b" seconds.\"}";
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(secs).as_bytes();
    let mut body = Vec::with_capacity(HEAD.len() + digits.len() + TAIL.len());
    body.extend_from_slice(HEAD);
    body.extend_from_slice(digits);
    body.extend_from_slice(TAIL);
    Bytes::from(body)
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
    if !message.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20) {
        body.push_str(message);
    } else {
        escape_into(&mut body, message);
    }
    body.push_str("\"}");
    json_body(status, Bytes::from(body))
}

/// A response of `status` with a JSON `body`.
fn json_body(status: StatusCode, body: Bytes) -> Response<Bytes> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn escape_into(body: &mut String, message: &str) {
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
}

/// The largest number whose header value is made once and shared.
const SHARED_NUMBERS: u64 = 4_096;

/// A header value for `n`: small numbers (remaining counts, retry seconds, limits) come
/// from a table made once, so the common case allocates nothing; larger ones are
/// [`written`] into a block shared with other values.
pub(crate) fn number(n: u64) -> HeaderValue {
    static TABLE: LazyLock<Box<[HeaderValue]>> = LazyLock::new(|| {
        let mut text = String::new();
        let mut ends = Vec::new();
        for n in 0..=SHARED_NUMBERS {
            let _ = write!(text, "{n}");
            ends.push(text.len());
        }
        // One string for the whole table, kept for the life of the process.
        let text: &'static str = Box::leak(text.into_boxed_str());
        let mut start = 0;
        ends.iter()
            .map(|&end| {
                let value = HeaderValue::from_static(&text[start..end]);
                start = end;
                value
            })
            .collect()
    });
    match usize::try_from(n).ok().and_then(|i| TABLE.get(i)) {
        Some(value) => value.clone(),
        None => written(n),
    }
}

/// A header value for `n` that is cloned without touching a reference count, for the
/// numbers a layer reports on every response (its policies' limits): made when the layer
/// is built. Past the shared table, each distinct number is kept once for the life of the
/// process (up to 1,024 of them), so building layers again and again adds nothing after
/// the first.
pub(crate) fn static_number(n: u64) -> HeaderValue {
    // Past this many distinct numbers (layers rebuilt from ever-changing quotas), values
    // are made per layer instead: cloned with a reference count, never leaked.
    const MAX_INTERNED: usize = 1_024;
    static INTERNED: Mutex<Vec<(u64, &'static str)>> = Mutex::new(Vec::new());
    if n <= SHARED_NUMBERS {
        return number(n);
    }
    let mut interned = INTERNED.lock().unwrap_or_else(PoisonError::into_inner);
    let text = match interned.iter().find(|(m, _)| *m == n) {
        Some((_, text)) => *text,
        None if interned.len() >= MAX_INTERNED => return HeaderValue::from(n),
        None => {
            let text: &'static str = Box::leak(n.to_string().into_boxed_str());
            interned.push((n, text));
            text
        }
    };
    HeaderValue::from_static(text)
}

/// The value of `X-RateLimit-Reset`, Unix seconds: the same for every response this
/// thread answers within a second or so, so the last one is kept and shared.
fn unix_seconds(n: u64) -> HeaderValue {
    thread_local! {
        static LAST: RefCell<Option<(u64, HeaderValue)>> = const { RefCell::new(None) };
    }
    last_made(&LAST, n, number)
}

/// A header value for a large number, written into a block this thread shares between
/// the values it makes: a remaining count past the table (a big quota's, different on
/// every response) then costs a reference count, not an allocation and a free. A block
/// is 2 KiB, about two hundred values; it is freed when the last response holding one of
/// its values has been written.
fn written(n: u64) -> HeaderValue {
    const BLOCK: usize = 2_048;
    thread_local! {
        static SPARE: RefCell<BytesMut> = RefCell::new(BytesMut::new());
    }
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(n).as_bytes();
    // `try_with`: while the thread's locals are torn down, make the value on its own.
    let bytes = SPARE
        .try_with(|spare| {
            let mut spare = spare.borrow_mut();
            if spare.capacity() < digits.len() {
                *spare = BytesMut::with_capacity(BLOCK);
            }
            spare.extend_from_slice(digits);
            spare.split().freeze()
        })
        .unwrap_or_else(|_| Bytes::copy_from_slice(digits));
    // Decimal digits are always a valid header value.
    HeaderValue::from_maybe_shared(bytes).unwrap_or_else(|_| HeaderValue::from(n))
}

/// The rate-limit headers an allowed response will carry, decided with the request so
/// that the response future needs nothing shared to add them.
#[derive(Debug)]
pub(crate) enum Added {
    /// No headers ([`HeaderStyle::None`], or no limit was checked).
    Nothing,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` (Unix seconds).
    Legacy {
        limit: HeaderValue,
        remaining: u64,
        reset: u64,
    },
    /// Headers made when the request was decided (the IETF fields).
    Built(Box<HeaderMap>),
}

impl Added {
    /// The legacy headers for `d`, decided at wall time `now_us`; `limit` is the value
    /// of `d.limit()`.
    pub(crate) fn legacy(d: &Decision, limit: HeaderValue, now_us: u64) -> Self {
        Added::Legacy {
            limit,
            remaining: d.remaining(),
            reset: (now_us + d.reset_after_micros()).div_ceil(1_000_000),
        }
    }

    /// Adds the headers to `headers`, once.
    pub(crate) fn add_to(&mut self, headers: &mut HeaderMap) {
        match std::mem::replace(self, Added::Nothing) {
            Added::Nothing => {}
            Added::Legacy {
                limit,
                remaining,
                reset,
            } => {
                headers.insert(X_RATELIMIT_LIMIT.clone(), limit);
                headers.insert(X_RATELIMIT_REMAINING.clone(), number(remaining));
                headers.insert(X_RATELIMIT_RESET.clone(), unix_seconds(reset));
            }
            Added::Built(built) => headers.extend(*built),
        }
    }
}

/// Adds the rate-limit headers for `verdicts` (every limit checked, `most` the one
/// reported by the legacy headers) at wall time `now_us`.
pub(crate) fn add_headers(
    headers: &mut HeaderMap,
    style: HeaderStyle,
    verdicts: &[Verdict<'_>],
    most: &Verdict<'_>,
    now_us: u64,
) {
    let d = &most.decision;
    if !d.is_allowed() {
        if let Some(secs) = retry_after_secs(d) {
            headers.insert(RETRY_AFTER, number(secs));
        }
    }
    if matches!(style, HeaderStyle::Legacy | HeaderStyle::Both) {
        Added::legacy(d, number(d.limit()), now_us).add_to(headers);
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

/// How restrictive a decision is, least first: a denial (the longest wait first), then
/// the fewest remaining (the soonest to deny), then the latest reset.
pub(crate) fn restrictiveness(d: &Decision) -> (bool, u64, u64, u64) {
    (
        d.is_allowed(),
        u64::MAX - d.retry_after_micros(),
        d.remaining(),
        u64::MAX - d.reset_after_micros(),
    )
}

/// Of several decisions, the one to report: the most restrictive.
pub(crate) fn most_restrictive<'a, 'p>(verdicts: &'a [Verdict<'p>]) -> Option<&'a Verdict<'p>> {
    verdicts.iter().min_by_key(|v| restrictiveness(&v.decision))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_exactly_across_blocks() {
        // Enough large values to fill several of a thread's 2 KiB blocks, all kept alive
        // at once: each value stays its own digits while later ones are written.
        let values: Vec<(u64, HeaderValue)> = (0..1_000u64)
            .map(|i| {
                let n = 4_097 + i * 7_919_113;
                (n, number(n))
            })
            .collect();
        for (n, value) in &values {
            assert_eq!(value.to_str().unwrap(), n.to_string());
        }
        assert_eq!(number(u64::MAX).to_str().unwrap(), u64::MAX.to_string());
        assert_eq!(number(4_096).to_str().unwrap(), "4096");
        assert_eq!(number(0).to_str().unwrap(), "0");
    }

    #[test]
    fn reset_seconds_follow_the_clock() {
        assert_eq!(unix_seconds(1_764_583_200).to_str().unwrap(), "1764583200");
        assert_eq!(unix_seconds(1_764_583_200).to_str().unwrap(), "1764583200");
        assert_eq!(unix_seconds(1_764_583_201).to_str().unwrap(), "1764583201");
        assert_eq!(unix_seconds(7).to_str().unwrap(), "7");
    }
}
