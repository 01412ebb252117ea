//! The bodies of the layer's own answers: a denial (429) and a refusal (a missing key, a
//! failed store, a caller on the deny list, a full service).

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};
use tollway_core::{Decision, Policy};

use crate::verdict::Verdict;

/// A denied request, as handed to a custom rejection handler
/// ([`RateLimitLayerBuilder::on_rejected`](crate::RateLimitLayerBuilder::on_rejected)).
#[derive(Debug)]
pub struct Rejection<'a> {
    verdict: Verdict<'a>,
}

impl<'a> Rejection<'a> {
    pub(crate) fn new(verdict: Verdict<'a>) -> Self {
        Rejection { verdict }
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
        self.verdict.retry_after_secs()
    }
}

/// Builds the response to a denied request; the layer adds the rate-limit headers.
pub(crate) type RejectionHandler =
    std::sync::Arc<dyn Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync>;

/// The default body of a 429: `{"error":"Too Many Requests","message":"..."}`.
///
/// # Examples
///
/// ```
/// use tollway_core::{Algorithm, MemoryStore, Policy, Quota};
/// use tollway_tower::{RateLimitLayer, Rejection, default_rejection};
///
/// // A handler that keeps the default body and adds a link to the docs.
/// let handler = |rejection: &Rejection<'_>| {
///     let mut response = default_rejection(rejection);
///     response.headers_mut().insert("link", "<https://example.com/limits>".parse().unwrap());
///     response
/// };
/// let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(10)?)?;
/// let layer = RateLimitLayer::builder(MemoryStore::new(), policy).on_rejected(handler).build()?;
/// # let _ = layer;
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
#[must_use]
pub fn default_rejection(rejection: &Rejection<'_>) -> Response<Bytes> {
    let mut digits = itoa::Buffer::new();
    let message = rejection.verdict.denial_message(&mut digits);
    json(StatusCode::TOO_MANY_REQUESTS, &message)
}

/// Why the layer refused a request on its own, without a limit's decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No key could be found, and the layer answers this status.
    NoKey(StatusCode),
    /// The store failed, and the layer fails closed.
    StoreFailed,
    /// The caller is on the deny list.
    Denied,
    /// The caller's tier lookup failed, and the layer refuses such requests.
    LookupFailed,
    /// The load shedder refused it: the service is full. Retry after this many seconds.
    Overloaded(u64),
}

/// The JSON body of [`Refusal::Overloaded`], which needs no allocation.
const OVERLOADED: &str = "{\"error\":\"Service Unavailable\",\"message\":\"The service is \
                          overloaded. Please retry later.\"}";

impl Refusal {
    /// The HTTP status and the message the refusal is answered with.
    pub(crate) fn status_and_message(self) -> (StatusCode, &'static str) {
        match self {
            Refusal::NoKey(status) => (
                status,
                "No rate-limit key could be determined for this request.",
            ),
            Refusal::StoreFailed => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Rate limiting is unavailable. Please retry later.",
            ),
            Refusal::Denied => (
                StatusCode::FORBIDDEN,
                "This client may not call this service.",
            ),
            Refusal::LookupFailed => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Rate limiting cannot tell this caller's tier now. Please retry later.",
            ),
            Refusal::Overloaded(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "The service is overloaded. Please retry later.",
            ),
        }
    }

    /// Seconds the caller should wait, for `Retry-After`, when the refusal says.
    pub(crate) fn retry_after(self) -> Option<u64> {
        match self {
            Refusal::Overloaded(secs) => Some(secs),
            _ => None,
        }
    }

    /// The JSON response to the refusal.
    pub(crate) fn response(self) -> Response<Bytes> {
        let (status, message) = self.status_and_message();
        let Some(secs) = self.retry_after() else {
            return json(status, &[message, "", ""]);
        };
        let mut response = Response::new(Bytes::from_static(OVERLOADED.as_bytes()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
        response
    }
}

/// A JSON error response `{"error": <reason>, "message": <message>}`, the message made
/// of three pieces: this crate's own sentences and numbers, which need no escaping.
fn json(status: StatusCode, message: &[&str; 3]) -> Response<Bytes> {
    let reason = status.canonical_reason().unwrap_or("Error");
    let pieces = [
        "{\"error\":\"",
        reason,
        "\",\"message\":\"",
        message[0],
        message[1],
        message[2],
        "\"}",
    ];
    let mut body = String::with_capacity(pieces.iter().map(|p| p.len()).sum());
    for piece in pieces {
        body.push_str(piece);
    }
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
