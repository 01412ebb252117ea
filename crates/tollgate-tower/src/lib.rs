//! tower middleware for tollgate.
//!
//! This crate will hold `RateLimitLayer`, the key extractors, per-tier and per-route
//! policies, and the HTTP 429 and gRPC `RESOURCE_EXHAUSTED` responses. Until then it
//! re-exports [`tollgate_core`], the algorithms and stores those build on.
//!
//! # Examples
//!
//! ```
//! use tollgate_tower::core::{Algorithm, MemoryStore, Policy, Quota};
//!
//! let store = MemoryStore::new();
//! let policy = Policy::new("api", Algorithm::TokenBucket, Quota::per_second(5)?)?;
//! assert!(store.check_sync(b"key", &policy, 1).is_allowed());
//! # Ok::<(), tollgate_tower::core::ConfigError>(())
//! ```

pub use tollgate_core as core;
