//! tower middleware for tollgate: rate limiting for axum routers, tonic servers and any
//! tower stack.
//!
//! Start at [`RateLimitLayer`]. The algorithms, quotas and stores come from
//! [`tollgate_core`], re-exported as [`core`].

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
pub use tollgate_core as core;
