//! tower middleware for tollway: rate limiting for axum routers, tonic servers and any
//! tower stack.
//!
//! Start at [`RateLimitLayer`] (the [`rate_limit`] module has a tour). The algorithms,
//! quotas and stores come from [`tollway_core`], re-exported as [`core`].
//!
//! Features: `axum` reads peer addresses from axum's `ConnectInfo`; `tonic` answers gRPC
//! requests with `RESOURCE_EXHAUSTED` and retry details, reads tonic's `TcpConnectInfo`,
//! and adds a synchronous `Interceptor` (see `grpc`); `redis` re-exports the Redis store.
//!
//! When the store fails, [`OnStoreError`] lets requests through (the default) or answers
//! 503 / `UNAVAILABLE`; wrap a remote store in [`core::Resilient`] for a circuit breaker
//! and a local fallback limiter.

#[cfg(feature = "tonic")]
pub mod grpc;
mod key;
mod limits;
pub mod rate_limit;
mod response;

pub use key::{ClientIp, Global, Header, IpNet, Key, KeyExtractor, PeerIp, UserId, peer_addr};
pub use limits::{HeaderStyle, MissingKey, OnStoreError, Tiers};
pub use rate_limit::{RateLimit, RateLimitLayer, RateLimitLayerBuilder, ResponseFuture};
pub use response::{
    RATELIMIT, RATELIMIT_POLICY, Rejection, RejectionBody, RejectionHandler, Verdict,
    X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET, default_rejection,
};
pub use tollway_core as core;
