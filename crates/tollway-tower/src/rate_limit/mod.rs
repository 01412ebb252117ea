//! Rate limiting for tower services.
//!
//! [`RateLimitLayer`] decides, per caller, whether a request may reach the service:
//!
//! 1. It finds the caller's [`Key`](crate::Key) with a
//!    [`KeyExtractor`](crate::KeyExtractor).
//! 2. It picks the caller's policies: a tier, or the default, plus any route limits.
//! 3. It asks the [`Store`](tollway_core::Store) about all of them at once.
//! 4. It calls the service, and adds `X-RateLimit-*` headers to its response. Or it
//!    answers `429 Too Many Requests`, with `Retry-After` and a JSON body.
//!
//! A shaping policy holds the request for its delay first.
//!
//! A denial is a response, not an error. So the layer fits axum, which wants
//! `Infallible`, and keeps connections open. The response body is a
//! [`ResponseBody`](crate::ResponseBody): the service's own, or the layer's answer. Clones
//! share their limits. The state lives in the store, never in a service instance.
//!
//! The store may answer without waiting, as the memory store always does. Then the
//! service calls the ready inner service at once. Otherwise the request and the ready
//! service travel in the [`ResponseFuture`] until the store has answered.
//!
//! # Examples
//!
//! A default: every peer address at 2 requests a second.
//!
//! ```
//! use std::net::SocketAddr;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use tollway_core::{Algorithm, MemoryStore, Policy, Quota};
//! use tollway_tower::RateLimitLayer;
//! use tower::{Service, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let policy = Policy::new("per-ip", Algorithm::TokenBucket, Quota::per_second(2)?)?;
//! let layer = RateLimitLayer::builder(MemoryStore::new(), policy).build()?;
//! let mut service = ServiceBuilder::new().layer(layer).service_fn(|_req: Request<()>| async {
//!     Ok::<_, std::convert::Infallible>(Response::new(Bytes::from("hello")))
//! });
//!
//! let request = || {
//!     let mut req = Request::new(());
//!     req.extensions_mut().insert("198.51.100.7:50000".parse::<SocketAddr>().unwrap());
//!     req
//! };
//! let first = service.ready().await?.call(request()).await?;
//! assert_eq!(first.headers()["x-ratelimit-remaining"], "1");
//! service.ready().await?.call(request()).await?;
//! let third = service.ready().await?.call(request()).await?;
//! assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(third.headers()["retry-after"], "1");
//! # Ok(())
//! # }
//! ```
//!
//! Customised: issued API keys with Free and Pro tiers, everyone else (a made-up key
//! too) by IP, a tighter limit on checkout, and the IETF headers beside the legacy ones.
//!
//! ```
//! use std::collections::HashMap;
//! use http::Method;
//! use tollway_core::{Algorithm, MemoryStore, Policy, Quota};
//! use tollway_tower::{ApiKey, Fallback, HeaderStyle, PeerIp, RateLimitLayer};
//!
//! # fn main() -> Result<(), tollway_core::ConfigError> {
//! let anonymous = Policy::new("anonymous", Algorithm::TokenBucket, Quota::per_minute(20)?)?;
//! let free = Policy::new("free", Algorithm::TokenBucket, Quota::per_minute(100)?)?;
//! let pro = Policy::new("pro", Algorithm::TokenBucket, Quota::per_minute(10_000)?)?;
//! let checkout = Policy::new("checkout", Algorithm::SlidingWindowLog, Quota::per_minute(5)?)?;
//! let keys = HashMap::from([
//!     ("demo-free-key".to_owned(), "free".to_owned()),
//!     ("demo-pro-key".to_owned(), "pro".to_owned()),
//! ]);
//! let layer = RateLimitLayer::builder(MemoryStore::new(), anonymous)
//!     .key(ApiKey::header("x-api-key")?.known(keys.clone()).or(PeerIp::new()))
//!     .tier(free)
//!     .tier(pro)
//!     .tiers(keys)
//!     .route(Some(Method::POST), "/api/v1/checkout", checkout)
//!     .headers(HeaderStyle::Both)
//!     .build()?;
//! # let _ = layer;
//! # Ok(())
//! # }
//! ```

mod builder;
mod future;
mod layer;
mod service;

pub use builder::RateLimitLayerBuilder;
pub use future::ResponseFuture;
pub use layer::{RateLimitLayer, ShadowState};
pub use service::RateLimit;
