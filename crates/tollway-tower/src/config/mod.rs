//! Limits as configuration (feature `config`): a TOML file, validated as a whole before
//! anything uses it, and reloaded while the service runs.
//!
//! A [`LimitsFile`] is a file read and checked: every policy, tier, route, list entry
//! and setting. Its error names the file, the line and the column. It says what is wrong
//! and what to write instead. [`LimitsFile::layer`] builds the same layer the builder
//! does.
//!
//! [`Reloader`] reads the file again and swaps the new limits in. It reads on demand
//! with [`Reloader::reload`], for a SIGHUP or an admin endpoint. Or it reads whenever
//! the file changes, with [`Reloader::watch`]. Requests already being decided finish
//! under the old limits. A file that fails to validate leaves the running limits in
//! place, and is reported. A policy keeps its callers' state when its limit or burst
//! changes. A changed algorithm or period starts them afresh.
//!
//! What a reload can change: policies, tiers, routes, lists, shadow flags, headers, the
//! protocol, what to do on a store failure or a missing key, and load shedding (an
//! unchanged `[shed]` keeps its running shedder; a changed one starts from its limit). The store and how keys
//! are found (`[store]`, `[key]`) take effect at the next start: a reload that changes
//! them is refused.
//!
//! A `[store]` naming Redis needs the `redis` feature. Without it, the file is refused
//! at its `kind`, with the feature to enable. So do its `leases` (a Redis store's hot
//! keys decided here, see [`Leased`](tollway_core::Leased)), with the `leases` feature.
//!
//! # The file
//!
//! ```toml
//! [store]                       # optional: memory is the default
//! kind = "memory"               # or "redis", with url = "redis://...", nodes = [...]
//!                               # or sentinel = { master = "name", nodes = [...] }
//!                               # (and the primary's username, password, db, tls)
//! max_keys = 1_000_000
//! # Redis only: leases = true, or { horizon_ms = 200, min_units = 8, max_share = 0.1 }
//! # timeout_ms = 100, stall_after_ms = 20 (0: each call waits its timeout),
//! # breaker = { threshold = 5, cool_down_ms = 250 }, local_fallback = 1.0
//!
//! [layer]
//! default = "anonymous"         # the policy of callers without a tier
//! headers = "both"              # legacy | ietf | both | none
//! on_store_error = "allow"      # allow | reject
//!
//! [key]                         # optional: the peer address is the default
//! api_key = { header = "x-api-key", only_known = true }
//! # client_ip = { header = "x-forwarded-for", trusted_proxies = ["10.0.0.0/8"] }
//! # behind a CDN, counted: trusted_hops = 2, hops_through = ["<the CDN's ranges>"]
//!
//! [policies.anonymous]
//! algorithm = "token_bucket"    # token_bucket, leaky_bucket, leaky_bucket_shaper,
//! limit = 20                    # fixed_window, sliding_window_log,
//! period = "1m"                 # sliding_window_counter, gcra
//!
//! [policies.pro]
//! algorithm = "gcra"
//! limit = 10_000
//! period = "1m"
//!
//! [tiers]                       # API key = its tier's policy
//! "demo-pro-key" = "pro"
//!
//! [plans]                       # API key = its tier's policy at its own limit
//! "demo-acme-key" = { tier = "pro", limit = 50_000 }   # burst = ... for a bucket
//!
//! [policies.checkout]          # a route's policy is its own
//! algorithm = "sliding_window_log"
//! limit = 5
//! period = "1m"
//!
//! [[routes]]
//! path = "/api/v1/checkout"     # or grpc_method = "/package.Service/Method"
//! method = "POST"               # optional: any method
//! policy = "checkout"
//!
//! [policies.tokens]            # an LLM token budget beside the request rate
//! algorithm = "token_bucket"
//! limit = 100_000
//! period = "1m"
//! # reserved: a cost of its own, from a header a layer before tollway writes
//! cost = { header = "x-max-tokens", default = 1_000, max = 4_096, written_by = "gateway" }
//! settle = { header = "x-tokens-used", unsettled = "refund" }  # or "keep" (default)
//!
//! [policies.monthly]           # a billing budget: resets at midnight on the first
//! algorithm = "fixed_window"    # a calendar period is a fixed window's
//! limit = 10_000_000_000        # up to 2^53
//! period = "calendar month"     # or calendar minute, hour, day, week, year
//! zone = "Europe/Paris"         # an IANA zone; UTC if unsaid
//!
//! [[routes]]
//! path = "/v1/completions"
//! policy = "tokens"
//!
//! [[routes]]
//! path = "/v1/batches"
//! policy = "monthly"
//!
//! [lists]                       # optional
//! allow_networks = ["10.0.0.0/8"]
//! deny_keys = ["key:stolen-key"]
//!
//! [shed]                        # optional: load shedding, see the shed module
//! floor = 20                    # calls in flight: the limit adapts between these
//! ceiling = 1_000
//! tolerance = 1.5               # latency up to 1.5 times the learnt baseline is fine
//! window = "1s"
//!
//! [[shed.priorities]]           # the most important first
//! name = "checkout"
//! share = 0.4                   # of the limit, always theirs
//! routes = ["POST /api/v1/checkout"]
//!
//! [[shed.priorities]]
//! name = "paying"
//! share = 0.4
//! headers = { x-plan = ["gold", "platinum"] }  # or tiers = ["pro"]: known values
//! # the rest are "other", with what is left (0.2)
//! ```
//!
//! A key's plan keeps its tier's policy (name, algorithm, period) at a limit of its own.
//! A changed limit keeps what the key used, as a changed policy does. A key is in
//! `[tiers]` or in `[plans]`, not both.
//!
//! A policy's `cost` is its own: the number in a request header, else its `default`.
//! A request charges each of its policies its own cost, all or nothing. `settle`
//! reserves that cost, then settles the policy to the number in a response header,
//! or to what the handler reports through [`Usage`](crate::Usage). One policy of a
//! layer is settled, and it keeps a debt (a token bucket, a leaky bucket or GCRA). See
//! [`RateLimitLayerBuilder::settle`](crate::RateLimitLayerBuilder::settle).
//!
//! A cost read from a request is the client's to choose, unless a layer before tollway
//! writes the header (the LLM example writes it from the body's `max_tokens`). So it
//! is kept between `min` (1 unless said: a request that cost nothing would pass an
//! empty budget) and `max` (none unless said: a cost above the capacity is refused).
//! A number above `max` costs `max`; a missing or malformed one costs `default`.
//! `written_by = "gateway"` says a layer before tollway writes it; without it,
//! `tollway check` warns ([`LimitsFile::warnings`]).
//!
//! A shedding priority's `headers` take a request by a header's known values. Any
//! client can send any header: `headers_present = ["authorization"]` takes a request
//! that merely carries one, and is claimable by anyone. `per_address` in `[shed]` is
//! the part of a priority's share one address may hold (0.25 unless said): see
//! [`shed`](crate::shed).
//!
//! # Examples
//!
//! ```
//! use tollway_tower::config::LimitsFile;
//!
//! let file = LimitsFile::parse("limits.toml", r#"
//! [layer]
//! default = "api"
//!
//! [policies.api]
//! algorithm = "gcra"
//! limit = 0
//! period = "1s"
//! "#);
//! let err = file.unwrap_err().to_string();
//! assert!(err.starts_with("limits.toml:7:9: "), "{err}");
//! assert!(err.contains("limit"), "{err}");
//! ```

mod buckets;
mod build;
mod descriptors;
mod file;
mod follow;
mod key;
mod reload;
mod schema;
mod store;
mod summary;
mod watch;

pub use descriptors::{DescriptorKey, DescriptorRule, EntryValue};
pub use file::LimitsFile;
pub use follow::{Follower, LiveConfig, Reloaded};
pub use key::ConfigKey;
pub use reload::Reloader;
pub use watch::Watcher;

#[cfg(test)]
mod shed_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod validation_tests;
