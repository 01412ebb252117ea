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
//!
//! The same statuses come from the layer (`Server::builder().layer(..)`) and from the
//! synchronous [`RateLimitInterceptor`](crate::RateLimitInterceptor).

use http::StatusCode;
use tollway_core::Denial;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::headers::RateLimitHeaders;
use crate::rejection::Refusal;
use crate::verdict::Verdict;

/// `grpc-retry-pushback-ms` (gRFC A6).
pub static GRPC_RETRY_PUSHBACK_MS: http::HeaderName =
    http::HeaderName::from_static("grpc-retry-pushback-ms");

/// The status for a request denied by `verdict`: `RESOURCE_EXHAUSTED` with `RetryInfo`
/// (when a wait helps) and `QuotaFailure` details, and the `retry-after` and
/// `grpc-retry-pushback-ms` metadata.
#[must_use]
pub fn rejection_status(verdict: &Verdict<'_>) -> Status {
    let decision = &verdict.decision;
    let policy = verdict.policy;
    let retry = decision.retry_after();
    let mut details = ErrorDetails::with_retry_info(retry);
    let what = format!(
        "at most {} units per {} s ({})",
        decision.limit(),
        policy.quota().period().as_secs_f64(),
        policy.algorithm().name()
    );
    details.add_quota_failure_violation(format!("policy:{}", policy.name()), what);
    let secs = verdict.retry_after_secs();
    let message = verdict.denial_message(&mut itoa::Buffer::new()).concat();
    let mut status = Status::with_error_details(Code::ResourceExhausted, message, details);
    let metadata = status.metadata_mut();
    match (retry, secs) {
        (Some(wait), Some(secs)) => {
            metadata.insert("retry-after", secs.into());
            let ms = u64::try_from(wait.as_micros().div_ceil(1_000)).unwrap_or(u64::MAX);
            metadata.insert(GRPC_RETRY_PUSHBACK_MS.as_str(), ms.into());
        }
        _ if decision.denial() == Some(Denial::CostExceedsCapacity) => {
            metadata.insert(
                GRPC_RETRY_PUSHBACK_MS.as_str(),
                MetadataValue::from_static("-1"),
            );
        }
        _ => {}
    }
    status
}

/// [`rejection_status`] with the rate-limit `headers` in its metadata.
pub(crate) fn denial_status(verdict: &Verdict<'_>, headers: RateLimitHeaders) -> Status {
    let mut status = rejection_status(verdict);
    headers.insert_into(status.metadata_mut().as_mut());
    status
}

/// The status for a request the layer refuses on its own (a missing key, a failed
/// store): the gRPC code of the HTTP status it would answer.
pub(crate) fn refusal_status(refusal: Refusal) -> Status {
    let (status, message) = refusal.status_and_message();
    let code = match status {
        StatusCode::UNAUTHORIZED => Code::Unauthenticated,
        StatusCode::FORBIDDEN => Code::PermissionDenied,
        StatusCode::BAD_REQUEST => Code::InvalidArgument,
        StatusCode::TOO_MANY_REQUESTS => Code::ResourceExhausted,
        StatusCode::SERVICE_UNAVAILABLE => Code::Unavailable,
        _ => Code::Unknown,
    };
    let Some(secs) = refusal.retry_after() else {
        return Status::new(code, message);
    };
    let details = ErrorDetails::with_retry_info(Some(std::time::Duration::from_secs(secs)));
    let mut status = Status::with_error_details(code, message, details);
    let metadata = status.metadata_mut();
    metadata.insert("retry-after", secs.into());
    metadata.insert(GRPC_RETRY_PUSHBACK_MS.as_str(), (secs * 1_000).into());
    status
}
