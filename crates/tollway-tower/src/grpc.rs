//! gRPC answers: `RESOURCE_EXHAUSTED` with `RetryInfo`, never a bare 429.
//!
//! A tonic client turns an HTTP 429 into `UNAVAILABLE`, a code clients commonly retry at
//! once — the opposite of what a limiter wants. So for requests whose `content-type` is
//! `application/grpc*` the layer answers in gRPC's own terms: a trailers-only response
//! with `grpc-status` 8 (`RESOURCE_EXHAUSTED`), a `grpc-message`, `retry-after` (whole
//! seconds, rounded up), `grpc-retry-pushback-ms` (gRFC A6; `-1`, "do not retry", when
//! waiting cannot help), and `grpc-status-details-bin` carrying `google.rpc.RetryInfo`
//! (the exact wait) and `google.rpc.QuotaFailure` (which policy). A store failure that is
//! configured to reject answers `UNAVAILABLE`.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use smallvec::SmallVec;
use tollway_core::{Algorithm, Clock, ConfigError, Denial, MemoryStore};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::key::{Key, KeyExtractor, PeerIp};
use crate::limits::MissingKey;
use crate::rate_limit::{RateLimitLayer, Shared};
use crate::response::{RejectionBody, Verdict, add_headers, most_restrictive, retry_after_secs};

/// `grpc-retry-pushback-ms` (gRFC A6).
pub static GRPC_RETRY_PUSHBACK_MS: http::HeaderName =
    http::HeaderName::from_static("grpc-retry-pushback-ms");

/// Whether a request is gRPC: its `content-type` is `application/grpc` or a subtype.
#[must_use]
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The status for a request denied by `verdict`: `RESOURCE_EXHAUSTED` with `RetryInfo`
/// (when a wait helps) and `QuotaFailure` details, and the `retry-after` and
/// `grpc-retry-pushback-ms` metadata.
#[must_use]
pub fn rejection_status(verdict: &Verdict<'_>) -> Status {
    let decision = &verdict.decision;
    let policy = verdict.policy;
    let retry = decision.retry_after();
    let mut details = ErrorDetails::with_retry_info(retry);
    let quota = policy.quota();
    let what = format!(
        "at most {} units per {} s ({})",
        decision.limit(),
        quota.period().as_secs_f64(),
        policy.algorithm().name()
    );
    details.add_quota_failure_violation(format!("policy:{}", policy.name()), what);
    let message = match (retry_after_secs(decision), decision.denial()) {
        (Some(n), _) => format!("rate limit exceeded; retry after {n} seconds"),
        (None, Some(Denial::StoreFull)) => "rate limiter is full; retry later".to_owned(),
        _ => "request costs more than the rate limit allows at once; it cannot succeed".to_owned(),
    };
    let mut status = Status::with_error_details(Code::ResourceExhausted, message, details);
    let metadata = status.metadata_mut();
    match (retry, retry_after_secs(decision)) {
        (Some(wait), Some(secs)) => {
            let ms = wait.as_micros().div_ceil(1_000);
            metadata.insert("retry-after", secs.into());
            if let Ok(value) = ms.to_string().parse() {
                metadata.insert(GRPC_RETRY_PUSHBACK_MS.as_str(), value);
            }
        }
        _ if decision.denial() == Some(Denial::CostExceedsCapacity) => {
            metadata.insert(
                GRPC_RETRY_PUSHBACK_MS.as_str(),
                tonic::metadata::MetadataValue::from_static("-1"),
            );
        }
        _ => {}
    }
    status
}

/// The status for a request the layer refuses with HTTP `status` outside rate limiting
/// (a missing key, a failed store).
pub(crate) fn status_for_http(status: StatusCode, message: &str) -> Status {
    let code = match status {
        StatusCode::UNAUTHORIZED => Code::Unauthenticated,
        StatusCode::FORBIDDEN => Code::PermissionDenied,
        StatusCode::BAD_REQUEST => Code::InvalidArgument,
        StatusCode::TOO_MANY_REQUESTS => Code::ResourceExhausted,
        StatusCode::SERVICE_UNAVAILABLE => Code::Unavailable,
        _ => Code::Unknown,
    };
    Status::new(code, message)
}

/// A trailers-only gRPC response carrying `status` (HTTP 200, `grpc-status` in the
/// headers).
pub(crate) fn response(status: Status) -> Response<Bytes> {
    status.into_http()
}

impl RejectionBody for tonic::body::Body {
    fn from_bytes(bytes: Bytes) -> Self {
        if bytes.is_empty() {
            tonic::body::Body::empty()
        } else {
            tonic::body::Body::new(http_body_util::Full::new(bytes))
        }
    }
}

/// A synchronous tonic `Interceptor` that applies a layer's limits, for users who wrap
/// services with `InterceptedService` (or `Server::add_service(Svc::with_interceptor(..))`)
/// rather than a layer. Made by [`RateLimitLayer::interceptor`] from a layer over a
/// [`MemoryStore`], whose decisions need no I/O; it shares that layer's state.
///
/// An interceptor sees the request's metadata and extensions but not its path, so route
/// (per-method) limits apply only where a `tonic::GrpcMethod` extension names the method;
/// it cannot add headers to responses or hold a request, so shaping policies are refused
/// when it is made. Denials are [`rejection_status`]: `RESOURCE_EXHAUSTED` with
/// `RetryInfo`, `QuotaFailure`, `retry-after` and `grpc-retry-pushback-ms`.
pub struct RateLimitInterceptor<C, K> {
    shared: Arc<Shared<MemoryStore<C>>>,
    key: Arc<K>,
}

impl<C, K> Clone for RateLimitInterceptor<C, K> {
    fn clone(&self) -> Self {
        RateLimitInterceptor {
            shared: Arc::clone(&self.shared),
            key: Arc::clone(&self.key),
        }
    }
}

impl<C, K> std::fmt::Debug for RateLimitInterceptor<C, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitInterceptor")
            .field("limits", &self.shared.limits)
            .finish_non_exhaustive()
    }
}

impl<C: Clock, K> RateLimitLayer<MemoryStore<C>, K> {
    /// A tonic interceptor applying this layer's limits, sharing its state.
    ///
    /// # Errors
    ///
    /// When one of the layer's policies shapes (delays) requests: an interceptor cannot
    /// hold a request, so it would admit them undelayed.
    pub fn interceptor(&self) -> Result<RateLimitInterceptor<C, K>, ConfigError> {
        let (shared, key) = self.parts();
        if let Some(p) = shared
            .limits
            .policies
            .iter()
            .find(|p| p.algorithm() == Algorithm::LeakyBucketShaper)
        {
            return Err(ConfigError::new(format!(
                "policy {:?} shapes requests by delaying them, which an interceptor cannot do: \
                 use the layer (Server::builder().layer(..)) for shaping",
                p.name()
            )));
        }
        Ok(RateLimitInterceptor { shared, key })
    }
}

impl<C, K> tonic::service::Interceptor for RateLimitInterceptor<C, K>
where
    C: Clock,
    K: KeyExtractor<()>,
{
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        let shared = &*self.shared;
        let (metadata, extensions, ()) = request.into_parts();
        // The call as the layer sees it, for the key extractor and the cost function: a
        // POST, to the method's path when a `GrpcMethod` extension names it.
        let path = extensions
            .get::<tonic::GrpcMethod<'static>>()
            .map(|m| format!("/{}/{}", m.service(), m.method()))
            .unwrap_or_default();
        let mut http = http::Request::new(());
        *http.method_mut() = http::Method::POST;
        if let Ok(uri) = http::Uri::try_from(path.as_str()) {
            *http.uri_mut() = uri;
        }
        *http.headers_mut() = metadata.into_headers();
        *http.extensions_mut() = extensions;
        let key = match self.key.extract(&http) {
            Some(key) => Some(key),
            None => match shared.missing {
                MissingKey::FallbackToIp => Some(
                    KeyExtractor::<()>::extract(&PeerIp::new(), &http)
                        .unwrap_or_else(|| Key::new("ip", "unknown")),
                ),
                MissingKey::Allow => None,
                MissingKey::Reject(status) => {
                    return Err(status_for_http(
                        status,
                        "No rate-limit key could be determined for this request.",
                    ));
                }
            },
        };
        if let Some(key) = key {
            let plan = shared.limits.plan(&key, http.method(), &path);
            let cost = shared
                .cost
                .as_ref()
                .map_or(1, |cost| cost(http.method(), http.uri(), http.headers()));
            let mut verdicts: SmallVec<[Verdict<'_>; 2]> = SmallVec::new();
            for index in plan {
                let policy = &shared.limits.policies[index];
                let decision = shared.store.check_sync(key.as_bytes(), policy, cost);
                verdicts.push(Verdict { policy, decision });
                if !decision.is_allowed() {
                    let most = most_restrictive(&verdicts).unwrap_or(&verdicts[verdicts.len() - 1]);
                    let mut status = rejection_status(most);
                    let mut headers = HeaderMap::new();
                    add_headers(
                        &mut headers,
                        shared.headers,
                        &verdicts,
                        most,
                        shared.clock.now_micros(),
                    );
                    let metadata = status.metadata_mut();
                    for (name, value) in &headers {
                        let key =
                            tonic::metadata::AsciiMetadataKey::from_bytes(name.as_str().as_bytes());
                        let value = value.to_str().ok().and_then(|v| v.parse().ok());
                        if let (Ok(key), Some(value)) = (key, value) {
                            metadata.insert(key, value);
                        }
                    }
                    return Err(status);
                }
            }
        }
        let (parts, ()) = http.into_parts();
        Ok(tonic::Request::from_parts(
            tonic::metadata::MetadataMap::from_headers(parts.headers),
            parts.extensions,
            (),
        ))
    }
}
