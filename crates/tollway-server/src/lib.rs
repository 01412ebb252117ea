//! tollway as an Envoy rate limit service: Envoy, Istio and Envoy Gateway ask
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` with descriptors, and
//! tollway answers from the policies and the store of a limits file. An Envoy edge and
//! the axum or tonic services behind it (the tower layer) then share one limit in one
//! Redis.
//!
//! The limits file is the layer's (see `tollway_tower::config`), with
//! `[[descriptors]]` rules that map a descriptor's entries to a policy:
//!
//! ```toml
//! [layer]
//! default = "per_address"
//!
//! [policies.per_address]
//! algorithm = "gcra"
//! limit = 600
//! period = "1m"
//!
//! [[descriptors]]
//! domain = "edge"
//! entries = [{ key = "remote_address" }]   # any value, each counted apart
//! policy = "per_address"
//! key = "ip"                               # the layer's peer key: ip:<address>
//! ```
//!
//! What it answers:
//!
//! - Every descriptor of a request is decided, all or nothing. With several, the service
//!   looks at each first (a peek, charging nothing): one that would be over refuses the
//!   request and none is charged. Then each is charged; one refused then (another request
//!   came between) has the others' charges given back. The overall code is `OVER_LIMIT`
//!   when one enforcing limit refuses.
//! - A descriptor's own `hits_addend` is its cost (0 looks without charging); else the
//!   request's, at least 1.
//! - Each status has the policy's limit (`current_limit`, in Envoy's units), what
//!   remains, and the time until it is whole again. `response_headers_to_add` carries the
//!   `X-RateLimit-*` or IETF fields the layer would write (`[layer] headers`), and
//!   `Retry-After` when over the limit.
//! - A descriptor no rule matches is `OK`, with no limit: as envoyproxy/ratelimit answers.
//!   An `unlimited = true` rule answers `OK` with `limit_remaining` at its maximum.
//! - A policy in shadow mode (or the whole file) answers `OK` where it would be over,
//!   and counts it (`outcome="shadow_limited"`); its headers are not sent.
//! - A policy that shapes (`leaky_bucket_shaper`) or limits calls in flight
//!   (`concurrency`) cannot be a descriptor's: the file is refused.
//! - `key = "ip"` counts the one entry's address as the layer counts a peer. Values are
//!   escaped in keys: no value passes for another entry.
//! - When the store fails: `OK` by `[layer] on_store_error = "allow"` (the default),
//!   `UNAVAILABLE` by `"reject"` (Envoy's `failure_mode_deny` then decides). The Redis
//!   store's breaker and local fallback, from `[store]`, come first.
//!
//! [`start`] serves it; the `tollway-server` binary runs [`start`] from its arguments.

mod serve;
mod service;

pub use serve::{Options, Running, STOP_WITHIN, start};
pub use service::{RateLimitService, Rules};
