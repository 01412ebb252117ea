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
//!   request's, at least 1; at least its rule's `min_hits` (then 0 charges that many, and
//!   never looks), at most its `max_hits`. With Envoy's `is_negative_hits`, the hits are
//!   given back to the policy (its refund, up to full).
//! - A reservation comes in an entry, not in `hits_addend`: Envoy drops a descriptor
//!   whose `hits_addend` format finds no header, or not a number, so a request without
//!   one would reserve nothing. A rule with `hits_entry = "tokens"` and
//!   `default_hits = 1_000` reads a descriptor's hits from its `tokens` entry (neither
//!   matched nor in the key): a missing entry, or one that is not a whole number,
//!   reserves the default, and 0 reserves 1. Envoy's rate limit filter sends it with
//!   `request_headers: { header_name: x-max-tokens, descriptor_key: tokens,
//!   skip_if_absent: true }` beside the key's action, and gives back what the response
//!   did not use with `apply_on_stream_done: true` and `hits_addend: { format:
//!   "%RESP(x-tokens-unused)%", is_negative_hits: true }` (the `envoy` tests run both).
//!   A give-back is never refused, is no decision (not counted, no headers), and is not
//!   undone when another descriptor refuses.
//! - Whoever writes the reservation sets the price: let the proxy write it (a filter
//!   that reads the request's body, such as ext_proc or Lua) over anything the client
//!   sent, never the client. A client that writes its own pays its own number: `max_hits`
//!   caps it, and `min_hits` keeps it from being 0.
//! - A descriptor's own `limit` (`requests_per_unit` a unit; a month is 30 days, a year
//!   365) decides in place of its rule's policy: the same name and algorithm at that
//!   limit, burst the limit. It is how a customer gets a limit of its own. Under the same
//!   period as the file's policy, the caller keeps what it used, either way. A `limit`
//!   of 0 or an unknown unit is ignored: the file's policy decides. Envoy sends `limit`
//!   when a route's rate limit action sets it (`limit: { dynamic_metadata: .. }`), so
//!   whatever writes that metadata chooses the limit. Never let it come from a client's
//!   header, and keep the service's port off the clients' network: anyone who can call
//!   the service can ask for any limit.
//! - Each status has the policy's limit (`current_limit`, in Envoy's units, never more
//!   than the policy passes in one unit: 5 per 10 s is 5 a minute), what remains, and
//!   the time until it is whole again. `response_headers_to_add` carries the
//!   `X-RateLimit-*` or IETF fields the layer would write (`[layer] headers`), and
//!   `Retry-After` when over the limit. Envoy's fields are 32 bits: a limit past them
//!   is stated in a shorter unit (10^10 a 31-day month is 2,258,064,516 a week), and
//!   `limit_remaining` past them is 4,294,967,295, at least what remains; the headers
//!   carry the whole number.
//! - A descriptor no rule matches is `OK`, with no limit: as envoyproxy/ratelimit answers.
//!   An `unlimited = true` rule answers `OK` with `limit_remaining` at its maximum.
//! - A policy in shadow mode (or the whole file) answers `OK` where it would be over,
//!   and counts it (`outcome="shadow_limited"`); its headers are not sent.
//! - A policy that shapes (`leaky_bucket_shaper`) or limits calls in flight
//!   (`concurrency`) cannot be a descriptor's: the file is refused.
//! - `key = "ip"` counts the one entry's address as the layer counts a peer. Values are
//!   escaped in keys: no value passes for another entry.
//! - A request past the [`bounds`] (64 descriptors, 16 entries each, keys of 256 bytes,
//!   values of 64 KiB, 4 MiB in all: far past what Envoy sends) is refused
//!   `INVALID_ARGUMENT` before the store is asked, and counted
//!   (`tollway_rls_requests_refused_total{reason}`).
//! - When the store fails: `OK` by `[layer] on_store_error = "allow"` (the default),
//!   `UNAVAILABLE` by `"reject"` (Envoy's `failure_mode_deny` then decides). The Redis
//!   store's breaker and local fallback, from `[store]`, come first.
//!
//! It decides by the file's limits as a layer over them decides: the same store, shadow
//! switches, decision counters (`tollway_decisions_total`) and clock. One follower of the
//! file ([`Follower`](tollway_tower::config::Follower)) puts a new version in force for
//! both, or neither: the limits first (a changed `[store]` or `[key]` is refused there),
//! then the descriptors.
//!
//! Its own counters, on `/metrics`, label by the file's policy names (a bounded set,
//! never a descriptor's values): `tollway_rls_decisions_total{policy,outcome}` (allowed,
//! limited, shadow_limited) for every descriptor's policy, the layer's or not;
//! `tollway_rls_near_limit_total{policy}`, allowed with under a fifth of the capacity
//! left; `tollway_rls_requests_refused_total{reason}`, past the [`bounds`].
//! `tollway_decisions_total` counts the layer's own policies only.
//!
//! [`start`] serves it; the `tollway-server` binary runs [`start`] from its arguments:
//! `tollway-server --config limits.toml --grpc 0.0.0.0:8081 --http 0.0.0.0:9090`.
//!
//! # Envoy
//!
//! Envoy points at it with the rate limit filter and a cluster, and a route's actions
//! make the descriptors. This is `envoy.yaml`, in this package beside `limits.toml`
//! (whose descriptors it asks for). Envoy 1.40 accepts it (`envoy --mode validate`), and
//! the project's tests run it in front of an application (`tests/envoy`):
//!
//! ```yaml
#![doc = include_str!("../envoy.yaml")]
//! ```
//!
//! - `rate_limits` go on the route's action (`route:`) or the virtual host, not on the
//!   route itself: Envoy 1.40 refuses them there.
//! - tollway-server writes the rate-limit headers (`[layer] headers` in the limits file).
//!   Leave the filter's `enable_x_ratelimit_headers` off, or set `headers = "none"`:
//!   with both, a client gets each header twice, with different meanings (tollway's
//!   reset is a Unix time, Envoy's draft-03 one a number of seconds).
//! - `failure_mode_deny: false` lets requests through while the service cannot answer;
//!   `true` answers them 500.
//!
//! # Who can call it
//!
//! Whoever reaches the gRPC port speaks for Envoy. Such a caller can read any budget
//! (`hits_addend = 0` looks without charging), spend it (a large `hits_addend` empties
//! a caller's budget in one call), and ask for any limit (a descriptor's `limit`). So:
//!
//! - Keep the gRPC port where only the proxies reach it, and serve it over mutual TLS
//!   ([`Tls`], `--tls-cert`, `--tls-key`, `--tls-client-ca`): a client without a
//!   certificate the client CA signed is refused in the handshake. Envoy's cluster
//!   presents one with an `UpstreamTlsContext` (the `envoy` test suite runs it).
//! - Bind the HTTP port (`/metrics`, `/ready`, `/live`) where the scraper and the probes
//!   are: `--http 127.0.0.1:9090` keeps it on the host. `/metrics` names every policy.
//! - Requests past the [`bounds`] are refused before the store is asked.
//! - Each port holds a bounded number of connections ([`Connections`],
//!   `--max-connections`: 1,024 on the gRPC port, 64 on the HTTP port). A new gRPC
//!   connection has 10 s (`--handshake-timeout`) to finish its TLS handshake and send the
//!   HTTP/2 preface, and an HTTP request to send its headers; then it is closed. When
//!   the gRPC port is full, the oldest connection still in its handshake is closed for a
//!   new one: silent connections cannot keep a certified Envoy out. When the process is
//!   out of descriptors, the accept loop waits 50 ms and tries again instead of spinning.
//!   The binary raises its descriptor limit to the hard one, and lowers the cap when the
//!   limit leaves no room for it. Dropped connections are counted
//!   (`tollway_server_connections_dropped_total{port,reason}`).
//! - A rule's `max_hits` caps what one descriptor charges or gives back: a caller of
//!   the port drains or refills at most that much a call.
//!
//! Of envoyproxy/ratelimit's configuration it has domains, nested descriptors (a path of
//! entries), exact values, a key without a value (each value counted apart), `*`
//! patterns, `unlimited`, shadow mode (a policy's, the file's, or a rule's
//! `shadow_mode`), request and descriptor `hits_addend`, `is_negative_hits` (the hits
//! given back: a reservation settled, see below), and any period and algorithm of
//! tollway's but the shaper and calls in flight, `replaces` (a rule's `name`, and
//! another's `replaces = ["<name>"]`: a request that matches the second skips the first's
//! limit, so key the second on a value the client cannot claim, such as the client name
//! an authentication filter writes, never a key the client picks: a made-up
//! `partner-*` key would otherwise skip the address limit). It does not have `detailed_metric`,
//! `value_to_metric`, `share_threshold` or `quota_mode`. The bench
//! is in the repository's `BENCHMARKS.md`.
//!
//! # Envoy deciding locally: the quota service (RLQS)
//!
//! The same gRPC port serves Envoy's rate limit quota service
//! (`envoy.service.rate_limit_quota.v3.RateLimitQuotaService`). Each Envoy puts requests
//! in buckets, reports what it allowed and denied, and enforces the token bucket the
//! server assigns: no call a request. `[[buckets]]` rules map a bucket id to a policy:
//!
//! ```toml
//! [policies.quota_per_key]
//! algorithm = "token_bucket"   # or gcra, leaky_bucket: a steady rate and a burst
//! limit = 100
//! period = "1s"                # whole seconds: Envoy reads a fill interval so
//!
//! [[buckets]]
//! domain = "edge"
//! entries = [{ key = "client" }]   # a bucket id's keys, in any order
//! policy = "quota_per_key"
//! ```
//!
//! Every Envoy's assignment is a share of the policy, held in the store (see
//! [`tollway_core::share`]). The rates of all Envoys on all replicas sharing a store sum
//! to the limit less a reserve (a 64th). Their buckets and a pool sum to the burst. A new
//! bucket starts full in Envoy, so the pool pays for each. So the fleet passes no more
//! than one bucket of the policy would, in any window, when:
//!
//! - Envoy admits nothing without an assignment (`no_assignment_behavior` DENY_ALL) and
//!   has no `expired_assignment_behavior`: `envoy-rlqs.yaml` below;
//! - an assignment reaches Envoy within [`quota::TRANSIT`] of the server deciding it.
//!
//! How it follows Envoy 1.40:
//!
//! - A bucket's first request is reported at once and answered at once: the whole limit
//!   is asked for, and the others' demands share it out (what none takes is divided
//!   evenly). That request is refused while Envoy asks (one round trip). A new key's
//!   first holder may hold all of it until the others' next reports (5 s).
//! - Envoy reports every bucket every 5 s, whatever `reporting_interval` says. Each
//!   report asks for the demand it shows (allowed and denied) and renews the share.
//!   The same assignment again keeps Envoy's bucket (and what is left in it).
//! - An assignment lives [`quota::ASSIGNMENT_TTL`] (two reports and more); the share
//!   one second longer. A closed stream's shares end with their time: Envoy enforces its
//!   assignments until then, and reconnects on its next report.
//! - A quiet bucket keeps a share of what no demand takes, so its caller is admitted at
//!   once when it comes back. After [`quota::IDLE_REPORTS`] reports of no requests (a
//!   minute) it is abandoned and its share given back; Envoy forgets the bucket, and its
//!   next request asks again.
//! - A reload decides every open stream's buckets again: a changed policy is assigned
//!   anew, a rule that went abandons its buckets.
//! - A bucket no rule names, or an `unlimited` one, is allowed all (`ALLOW_ALL`), and
//!   so is one whose policy is in shadow mode (Envoy cannot count what it would have
//!   refused). When the store fails, `[layer] on_store_error` picks `ALLOW_ALL` or
//!   `DENY_ALL`.
//! - Counters: `tollway_rlqs_buckets_total{policy}` (new buckets, each starting full),
//!   `tollway_rlqs_reported_requests_total{policy,outcome}` (what Envoys reported).
//!
//! What a caller can do, and what bounds it:
//!
//! - Only keys Envoy trusts should make buckets. The documented configuration checks
//!   `x-api-key` with Envoy's API key filter (or put ext_authz or jwt_authn in its
//!   place), refuses a missing or unknown key 401, and buckets by the client name that
//!   filter writes. A configuration that buckets a header the client writes lets it make
//!   a bucket of every value it invents, each with a share of its own.
//! - A stream keeps at most [`quota::MAX_BUCKETS`]. A new bucket past it takes the place
//!   of the quietest (the least demand, the most reports of no requests, the oldest),
//!   which Envoy is told to abandon. A bucket that showed a demand keeps its place
//!   against any number of new ones. A bucket no rule limits is not kept.
//! - A bucket id past the [`bounds`] is abandoned; the report's other buckets are
//!   answered. An id longer than [`quota::KEPT_ID_BYTES`] is kept as its hash, and a
//!   long key's share is held under its hash.
//! - A report is read up to [`quota::MESSAGE_BYTES`]; past it the stream ends
//!   `RESOURCE_EXHAUSTED`. At most [`quota::MAX_STREAMS`] streams are open, and
//!   [`quota::STREAMS_PER_CONNECTION`] a connection. The counts a report gives are capped
//!   at [`quota::MAX_REPORTED`] each.
//! - Counted: `tollway_rlqs_buckets_abandoned_total{reason}` (idle, unknown, bounds,
//!   evicted), `tollway_rlqs_streams_ended_total{reason}` (every stream that ended on an
//!   error, also logged), `tollway_rls_requests_refused_total{reason}`.
//! - `tollway_rlqs_reported_requests_total` is what Envoys say they decided: a caller of
//!   the port moves it at will, within the cap. Alert on the store's decisions, not on it.
//! - Whoever reaches the port can hold shares and starve the Envoys: keep it behind
//!   mutual TLS, as for RLS.
//!
//! ```yaml
#![doc = include_str!("../envoy-rlqs.yaml")]
//! ```

mod accept;
mod descriptors;
pub mod quota;
mod serve;
mod service;

pub use accept::Connections;
pub use quota::{Buckets, QuotaService};
pub use serve::{Options, Running, STOP_WITHIN, Tls, start};
pub use service::{RateLimitService, Rules, bounds};
