//! A decided request's answer, when the layer answers in the service's place: an HTTP
//! response (the rejection handler's, or a refusal's JSON), or a gRPC status.

use bytes::Bytes;
use http::Response;
use tollway_core::Store;

use super::Limiter;
use crate::headers::RateLimitHeaders;
use crate::rejection::{Refusal, Rejection};
use crate::verdict::Verdict;

/// The layer's answer in the service's place.
pub(crate) enum Reply {
    Http(Response<Bytes>),
    /// A gRPC status, for a gRPC call.
    #[cfg(feature = "tonic")]
    Grpc(tonic::Status),
}

impl Reply {
    /// As a gRPC status: an HTTP answer (which a call answered in gRPC's terms never
    /// gets) by what its headers say, else as `UNKNOWN`.
    #[cfg(feature = "tonic")]
    pub(crate) fn into_status(self) -> tonic::Status {
        match self {
            Reply::Grpc(status) => status,
            Reply::Http(response) => tonic::Status::from_header_map(response.headers())
                .unwrap_or_else(|| {
                    tonic::Status::unknown(format!("answered {}", response.status()))
                }),
        }
    }

    /// As an HTTP response: a gRPC status as a trailers-only response.
    pub(crate) fn into_response(self) -> Response<Bytes> {
        match self {
            Reply::Http(response) => response,
            #[cfg(feature = "tonic")]
            Reply::Grpc(status) => status.into_http(),
        }
    }
}

impl<St: Store> Limiter<St> {
    /// The response to a request denied by `verdict`: the rejection handler's (over
    /// gRPC, the status), with `headers`.
    pub(super) fn deny(
        &self,
        verdict: Verdict<'_>,
        headers: RateLimitHeaders,
        grpc: bool,
    ) -> Reply {
        #[cfg(feature = "tonic")]
        if grpc {
            return Reply::Grpc(crate::grpc::denial_status(&verdict, headers));
        }
        let _ = grpc;
        let mut response = (self.on_rejected)(&Rejection::new(verdict));
        headers.insert_into(response.headers_mut());
        Reply::Http(response)
    }

    /// The rate-limit headers for `verdicts` (of the policies `selected`), reporting the
    /// one at `most`.
    pub(super) fn rate_limit_headers(
        &self,
        selected: &[usize],
        verdicts: &[Verdict<'_>],
        most: usize,
    ) -> RateLimitHeaders {
        let verdict = &verdicts[most];
        // `X-RateLimit-Limit` and the wall time for `X-RateLimit-Reset`, when sent.
        let legacy = self.header_style.legacy().then(|| {
            let index = selected[most];
            let policy = self.limits.policy(index);
            let limit = self
                .limit_values
                .get(index, policy, verdict.decision.limit());
            (limit, self.wall_clock.now_micros())
        });
        RateLimitHeaders::new(self.header_style, verdicts, verdict, legacy)
    }
}

/// The answer to a refusal: JSON over HTTP, the matching status over gRPC.
pub(super) fn refuse(refusal: Refusal, grpc: bool) -> Reply {
    #[cfg(feature = "tonic")]
    if grpc {
        return Reply::Grpc(crate::grpc::refusal_status(refusal));
    }
    let _ = grpc;
    Reply::Http(refusal.response())
}
