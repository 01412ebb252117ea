//! tower middleware for tollway: rate limiting for axum routers, tonic servers and any
//! tower stack.
//!
//! Start at [`RateLimitLayer`] (the [`rate_limit`] module has a tour). The algorithms,
//! quotas and stores come from [`tollway_core`]; the ones a layer needs are re-exported
//! here, and the whole crate is too.
//!
//! A request goes one way through the layer: its [`Key`] (from a [`KeyExtractor`]), its
//! limits (the caller's tier or the default policy, and the routes it calls), its cost,
//! the [`Store`]'s decisions, and then the answer: the inner service's response with the
//! rate-limit headers ([`HeaderStyle`]), or the layer's own — a 429 with `Retry-After`
//! and a JSON body ([`default_rejection`]), or over gRPC a `RESOURCE_EXHAUSTED` status.
//!
//! A Redis store has a circuit breaker and a local fallback limiter by default, so a slow
//! or gone Redis costs a few timeouts and then decisions in this node's memory. A store
//! without a fallback that fails is answered per [`OnStoreError`]: the request goes
//! through (the default) or gets 503 / `UNAVAILABLE`; [`CircuitBreaker`] adds the breaker
//! and fallback to any store.
//!
//! Operating it: every decision is a `debug` event and, with feature `metrics`, counted
//! in `tollway_decisions_total` by policy and outcome (see the README's "Operating
//! tollway" for every metric); a [`DecisionListener`] hears each one; shadow mode
//! ([`RateLimitLayerBuilder::shadow`], [`RateLimitLayerBuilder::shadow_policy`]) decides
//! and counts without refusing, switchable at run time; allow and deny lists
//! ([`RateLimitLayerBuilder::allow_network`], [`RateLimitLayerBuilder::deny_key`], ...)
//! exempt or forbid callers; [`RateLimitLayerBuilder::charge_after`] charges a policy what
//! a response reports it used; and [`Store::operate`] peeks at, charges, refunds or resets
//! a caller's state (an admin endpoint's work: `examples/axum_app.rs`).
//!
//! Who a caller is, which routes a request is on, and what a client can or cannot
//! influence: see the README's "Security model", and [`ClientIp`], [`ApiKey::known`],
//! [`Fallback::or`] and [`MissingKey`].
//!
//! # Feature flags
//!
//! None is on by default: without them the layer serves any tower stack over the memory
//! store (or any `Store`), the peer address read from a plain `SocketAddr` in the
//! request's extensions ([`peer_addr`]).
//!
//! - `axum`: peer addresses from axum's `ConnectInfo<SocketAddr>`, and route limits
//!   matched against axum's `MatchedPath` (route templates) and `OriginalUri` (nested
//!   routers). Optional dependency `axum`.
//! - `tonic`: the `grpc` module (a refusal as `RESOURCE_EXHAUSTED` with `RetryInfo` and
//!   `QuotaFailure` details), peer addresses from tonic's `TcpConnectInfo`, and the
//!   synchronous `RateLimitInterceptor` (`RateLimitLayer::interceptor`). Optional
//!   dependencies `tonic`, `tonic-types`.
//! - `redis`: re-exports the Redis store, `RedisStore`. Enables `tollway-core/redis`.
//! - `metrics`: decisions counted in `tollway_decisions_total` by policy and outcome
//!   (and, with `config`, failed reloads in `tollway_config_reload_errors_total`), and
//!   the stores' metrics through `tollway-core/metrics`. Optional dependency `metrics`.
//! - `config`: the `config` module: limits from a TOML file, validated as a whole
//!   (`LimitsFile`, each error at its line and column), and reloaded on demand or when
//!   the file changes (`Reloader`). Implies `redis` (a file's `[store]` may name Redis);
//!   optional dependencies `serde`, `toml`, `notify`.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod access;
mod body;
mod clock;
#[cfg(feature = "config")]
pub mod config;
#[cfg(feature = "tonic")]
pub mod grpc;
mod headers;
#[cfg(feature = "tonic")]
mod interceptor;
mod key;
mod limits;
mod lookup;
pub mod outbound;
mod pipeline;
pub mod rate_limit;
mod rejection;
mod report;
mod shadow;
mod verdict;

pub use body::ResponseBody;
pub use clock::TokioClock;
pub use headers::{
    HeaderStyle, RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING,
    X_RATELIMIT_RESET,
};
#[cfg(feature = "tonic")]
pub use interceptor::RateLimitInterceptor;
pub use key::{
    AnyValue, ApiKey, ClientIp, Fallback, ForwardedHeader, GlobalKey, Key, KeyExtractor, KnownKeys,
    Or, PeerIp, UserId, peer_addr,
};
pub use limits::Tiers;
pub use lookup::{LookupFuture, OnLookupError, TierLookup};
pub use pipeline::{MissingKey, OnStoreError, Protocol};
pub use rate_limit::{
    RateLimit, RateLimitLayer, RateLimitLayerBuilder, ResponseFuture, ShadowState,
};
pub use rejection::{Rejection, default_rejection};
pub use report::{DecisionEvent, DecisionListener, DecisionOutcome};
pub use tollway_core;
#[cfg(feature = "redis")]
pub use tollway_core::RedisStore;
pub use tollway_core::{
    Algorithm, BoxStore, CircuitBreaker, ConfigError, Decision, Decisions, Denial, MemoryStore,
    Operation, Policy, Quota, Store, StoreError,
};
pub use verdict::Verdict;
