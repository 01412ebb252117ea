//! tower middleware for tollway: rate limiting for axum routers, tonic servers and any
//! tower stack.
//!
//! Start at [`RateLimitLayer`]; the [`rate_limit`] module has a tour. The algorithms,
//! quotas and stores come from [`tollway_core`](https://docs.rs/tollway-core). The ones
//! a layer needs are re-exported here, and so is the whole crate.
//!
//! # Quick start
//!
//! An axum server, every peer address at 100 requests a minute (features `axum` here,
//! and tokio's `macros`, `rt-multi-thread` and `net`):
//!
//! ```no_run
//! use std::net::SocketAddr;
//!
//! use axum::{Router, routing::get};
//! use tollway_tower::{Algorithm, MemoryStore, Policy, Quota, RateLimitLayer};
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let per_ip = Policy::new("per-ip", Algorithm::TokenBucket, Quota::per_minute(100)?)?;
//!     let limits = RateLimitLayer::builder(MemoryStore::new(), per_ip).build()?; // keyed by peer IP
//!     let app = Router::new().route("/", get(|| async { "hello" })).layer(limits);
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//!     axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//!     Ok(())
//! }
//! ```
//!
//! # Guides
//!
//! ## The layer
//!
//! A request goes one way through the layer:
//!
//! 1. its [`Key`], from a [`KeyExtractor`];
//! 2. its limits: the caller's tier or the default policy, plus the routes it calls;
//! 3. its cost (1 unless [`cost`](RateLimitLayerBuilder::cost) says otherwise);
//! 4. the [`Store`]'s decisions, all of its limits at once, all or nothing;
//! 5. the answer.
//!
//! An allowed request reaches the inner service. Its response gets the rate-limit
//! headers ([`HeaderStyle`]): `X-RateLimit-Limit`, `X-RateLimit-Remaining` and
//! `X-RateLimit-Reset` (Unix seconds) by default, the IETF `RateLimit` and
//! `RateLimit-Policy` fields, both, or none. A refused request gets the layer's own
//! answer: a 429 with `Retry-After` (whole seconds, rounded up, never 0) and a JSON body
//! ([`default_rejection`]; your own with
//! [`on_rejected`](RateLimitLayerBuilder::on_rejected)). A shaping policy delays the
//! request instead. [`Protocol`] says when to answer in gRPC: by default, for an HTTP/2
//! request with a gRPC content type.
//!
//! Over gRPC (feature `tonic`) a refusal is a trailers-only `RESOURCE_EXHAUSTED`. It
//! carries `retry-after`, `grpc-retry-pushback-ms` and `google.rpc.RetryInfo` and
//! `QuotaFailure` details. It is never a bare 429, which tonic clients read as a
//! retryable `UNAVAILABLE`. [`RateLimitLayer::interceptor`] gives a synchronous tonic
//! interceptor over the memory store.
//!
//! A Redis store has a circuit breaker and a local fallback by default. A slow or gone
//! Redis then costs a few timeouts, and decisions move to this node's memory. A store
//! without a fallback that fails is answered per [`OnStoreError`]: through (the
//! default), or 503 / `UNAVAILABLE`. [`CircuitBreaker`] adds the breaker and fallback to
//! any store.
//!
//! ## Keys
//!
//! [`PeerIp`] is the default: the TCP peer, IPv6 grouped by /64. The others:
//!
//! | extractor | the caller is |
//! |---|---|
//! | [`ClientIp`] | the client behind trusted proxies, from the one header they write |
//! | [`ApiKey`] | an API key from a header; with [`known`](ApiKey::known), only one you issued |
//! | [`UserId`] | a user ID an auth layer put in the request's extensions |
//! | [`GlobalKey`] | everyone, one key |
//! | a closure | whatever `Fn(&Request<B>) -> Option<Key>` returns |
//!
//! Chain them with [`Fallback::or`]. Behind load balancers at 10.0.0.0/8 that append
//! `X-Forwarded-For`, callers with an issued key are limited by key, everyone else by
//! their own address:
//!
//! ```
//! use std::collections::HashSet;
//! use tollway_tower::{ApiKey, ClientIp, Fallback, ForwardedHeader};
//!
//! let issued = HashSet::from(["k-123".to_owned()]);
//! let key = ApiKey::header("x-api-key")?
//!     .known(issued)
//!     .or(ClientIp::new(ForwardedHeader::XForwardedFor, ["10.0.0.0/8"])?);
//! # let _ = key;
//! # Ok::<(), tollway_tower::ConfigError>(())
//! ```
//!
//! Which headers to believe, and what a caller cannot forge: the repository's
//! `SECURITY.md`, [`ClientIp`], [`ApiKey::known`] and [`MissingKey`].
//!
//! ## Tiers
//!
//! A tier is a policy of its own. Register it with
//! [`tier`](RateLimitLayerBuilder::tier), then map keys to tiers with
//! [`tiers`](RateLimitLayerBuilder::tiers): a `HashMap` of key to tier name, or a
//! closure. A key that maps to no tier gets the default policy.
//!
//! ```
//! use std::collections::HashMap;
//! use tollway_tower::{Algorithm, ApiKey, Fallback, MemoryStore, PeerIp, Policy, Quota, RateLimitLayer};
//!
//! let anonymous = Policy::new("anonymous", Algorithm::TokenBucket, Quota::per_minute(20)?)?;
//! let free = Policy::new("free", Algorithm::TokenBucket, Quota::per_minute(100)?)?;
//! let pro = Policy::new("pro", Algorithm::TokenBucket, Quota::per_minute(10_000)?)?;
//! let keys = HashMap::from([("k-free".to_owned(), "free".to_owned()), ("k-pro".to_owned(), "pro".to_owned())]);
//!
//! let layer = RateLimitLayer::builder(MemoryStore::new(), anonymous)
//!     .key(ApiKey::header("x-api-key")?.known(keys.clone()).or(PeerIp::new()))
//!     .tier(free)
//!     .tier(pro)
//!     .tiers(keys)
//!     .build()?;
//! # let _ = layer;
//! # Ok::<(), tollway_tower::ConfigError>(())
//! ```
//!
//! **Tiers looked up at run time.** [`tier_lookup`](RateLimitLayerBuilder::tier_lookup)
//! asks a database or an auth service on a caller's first request. Requests that arrive
//! meanwhile wait for the same lookup. The answer is cached
//! ([`tier_cache`](RateLimitLayerBuilder::tier_cache): 100,000 entries for 60 s by
//! default; unknown keys in a cache of their own).
//!
//! - A key the lookup does not know gets no budget of its own. Every unknown key shares
//!   one, the default policy's.
//! - A lookup that fails limits the caller as unknown, or answers 503
//!   ([`on_tier_lookup_error`](RateLimitLayerBuilder::on_tier_lookup_error)).
//! - A lookup may take 1 s ([`tier_lookup_timeout`](RateLimitLayerBuilder::tier_lookup_timeout)).
//! - At most 64 run at once
//!   ([`tier_lookup_concurrency`](RateLimitLayerBuilder::tier_lookup_concurrency)).
//! - An address starts at most 60 a minute
//!   ([`tier_lookups_per_source`](RateLimitLayerBuilder::tier_lookups_per_source)).
//!   Past either bound, the caller is unknown for that request.
//! - A lookup may answer a [`Plan`]: a tier with a quota of the caller's own (a contract
//!   in a database). A known key may have one in the builder too
//!   ([`plan`](RateLimitLayerBuilder::plan)), or in the limits file (`[plans]`). A
//!   customer whose quota changes keeps what it used.
//!
//! ```
//! use tollway_tower::{Algorithm, ApiKey, Key, MemoryStore, Policy, Quota, RateLimitLayer};
//!
//! let anonymous = Policy::new("anonymous", Algorithm::Gcra, Quota::per_minute(20)?)?;
//! let pro = Policy::new("pro", Algorithm::Gcra, Quota::per_minute(10_000)?)?;
//! let layer = RateLimitLayer::builder(MemoryStore::new(), anonymous)
//!     .key(ApiKey::header("x-api-key")?)
//!     .tier(pro)
//!     .tier_lookup(|key: Key| async move {
//!         // Ask your accounts service here.
//!         let tier = (key.value() == b"k-pro").then(|| "pro".to_owned());
//!         Ok::<_, std::io::Error>(tier)
//!     })
//!     .build()?;
//! # let _ = layer;
//! # Ok::<(), tollway_tower::ConfigError>(())
//! ```
//!
//! ## Routes and costs
//!
//! A route limit applies to requests to one path, as well as the caller's own limit.
//! [`route`](RateLimitLayerBuilder::route) takes an exact path, an axum route template
//! (`/users/{id}`), or either followed by `/*` for everything below. It holds in nested
//! routers too. [`grpc_method`](RateLimitLayerBuilder::grpc_method) limits one gRPC
//! method. A request refused by its route limit costs its tier nothing.
//!
//! [`cost`](RateLimitLayerBuilder::cost) weighs a request by its method, URI and
//! headers. [`policy_cost`](RateLimitLayerBuilder::policy_cost) gives one policy a cost
//! of its own: 1 request and 800 tokens, all or nothing, so a request its token limit
//! refuses takes no request unit.
//! [`settle`](RateLimitLayerBuilder::settle) reserves that cost when the request is
//! admitted and settles the policy to what the call used once its response ends, such
//! as an LLM API's tokens: the rest is charged, or the difference refunded. The
//! response says what it used, or the handler does through [`Usage`] as it streams. The
//! next request is refused once the budget is spent, with the exact `Retry-After`.
//!
//! ```
//! use http::Method;
//! use tollway_tower::{Algorithm, MemoryStore, Policy, Quota, RateLimitLayer};
//!
//! let per_ip = Policy::new("per-ip", Algorithm::TokenBucket, Quota::per_minute(100)?)?;
//! let checkout = Policy::new("checkout", Algorithm::SlidingWindowLog, Quota::per_minute(5)?)?;
//! let exports = Policy::new("exports", Algorithm::Gcra, Quota::per_hour(10)?)?;
//! let tokens = Policy::new("tokens", Algorithm::TokenBucket, Quota::per_minute(20_000)?)?;
//!
//! let layer = RateLimitLayer::builder(MemoryStore::new(), per_ip)
//!     .route(Some(Method::POST), "/api/v1/checkout", checkout)
//!     .route(None, "/exports/*", exports)
//!     .route(None, "/api/v1/completions", tokens)
//!     .cost(|method, _, _| if method == Method::DELETE { 5 } else { 1 })
//!     // Reserve what the call may use (a header the gateway wrote from the body, within
//!     // a floor and a ceiling), then settle to what was used.
//!     .policy_cost("tokens", |_, _, headers, _| {
//!         let asked = headers.get("x-max-tokens").and_then(|v| v.to_str().ok()?.parse().ok());
//!         asked.map_or(500, |n: u64| n.clamp(1, 4_096))
//!     })
//!     .settle("tokens", |status, headers, _| {
//!         if !status.is_success() {
//!             return Some(0);
//!         }
//!         headers.get("x-tokens-used")?.to_str().ok()?.parse().ok()
//!     })
//!     .build()?;
//! # let _ = layer;
//! # Ok::<(), tollway_tower::ConfigError>(())
//! ```
//!
//! ## Calls in flight
//!
//! A policy of [`Algorithm::Concurrency`] limits how many of a caller's requests are
//! in flight: from admission to the end of the response body. A streamed answer (SSE,
//! chunked, a gRPC server stream) holds its slot until its last chunk. A dropped body
//! or a cancelled request frees it. The quota's limit is the slots; its period is how
//! long a slot lives unrenewed. The layer renews the slots it holds, so a long stream
//! keeps its own. A gateway that dies frees its slots in Redis within one period.
//!
//! It is decided with the request's rate limits, all or nothing: a request refused by
//! a rate takes no slot, and one refused for want of a slot charges no rate. Tiers and
//! routes take it like any policy.
//!
//! ```
//! use std::time::Duration;
//! use tollway_tower::{Algorithm, GlobalKey, MemoryStore, Policy, Quota, RateLimitLayer};
//!
//! let requests = Policy::new("requests", Algorithm::Gcra, Quota::per_minute(60)?)?;
//! // 4 streams at once; a slot nobody renews lives 30 s.
//! let streams = Quota::with_period(4, Duration::from_secs(30))?;
//! let streams = Policy::new("streams", Algorithm::Concurrency, streams)?;
//! let layer = RateLimitLayer::builder(MemoryStore::new(), requests)
//!     .route(None, "/v1/chat/*", streams)
//!     .build()?;
//! # let _ = layer;
//! # Ok::<(), tollway_tower::ConfigError>(())
//! ```
//!
//! A refusal is a 429 (gRPC `RESOURCE_EXHAUSTED`) like a rate's. What its fields can
//! say differs. `X-RateLimit-Limit` (`q`) is the slots and `Remaining` (`r`) the free
//! ones. No store can foresee when a call ends, so `Retry-After` is a guess: 1 second
//! (the period if shorter). The IETF fields describe a quota over a window, and calls in
//! flight have none. Their `w` and `t`, and `X-RateLimit-Reset`, say when the slots held
//! would expire unrenewed: the latest they can all be free, not when one will be. A
//! client backs off by `Retry-After` and watches `r`.
//!
//! ## Load shedding
//!
//! Per-key limits stop callers who send too much. A [`Shed`](shed::Shed) guards the
//! service itself: a limit on its calls in flight that follows its latency. Requests are
//! sorted into priorities, each with a share of the limit; the least important are
//! refused first, with 503 before any key or store is asked. See [`shed`].
//!
//! ```
//! use tollway_tower::shed::{Match, Priority, Shed};
//! use tollway_tower::{Algorithm, MemoryStore, Policy, Quota, RateLimitLayer};
//!
//! let pro = Match::header_in(http::HeaderName::from_static("x-api-key"), ["pro-key"]);
//! let shed = Shed::builder()
//!     .limits(20, 1_000)
//!     .priority(Priority::new("pro", 0.5).when(pro))
//!     .build()?;
//! let policy = Policy::new("api", Algorithm::Gcra, Quota::per_minute(600)?)?;
//! let layer = RateLimitLayer::builder(MemoryStore::new(), policy)
//!     .shed(shed)
//!     .build()?;
//! # let _ = layer;
//! # Ok::<(), tollway_tower::ConfigError>(())
//! ```
//!
//! ## Operating it
//!
//! Everything here works for the memory store and Redis alike. The repository's
//! `examples/axum_app.rs` wires all of it.
//!
//! **Metrics** (feature `metrics`) go through the `metrics` facade. Install any
//! exporter, such as `metrics-exporter-prometheus`, before serving.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `tollway_decisions_total` | counter | `policy` (absent when no limit decided); `outcome`, one of [`DecisionOutcome`]'s: `allowed`, `limited`, `cost_exceeds_capacity`, `store_full`, `shadow_limited`, `store_error`, `allow_listed`, `deny_listed`, `no_key` |
//! | `tollway_store_duration_seconds` | histogram | `store`: `redis`, `redis_cluster`, `redis_pool` (a Redis call) |
//! | `tollway_deny_cache_hits_total` | counter | — |
//! | `tollway_breaker_state` | gauge | `store`; 0 closed, 1 half-open, 2 open |
//! | `tollway_memory_store_keys` | gauge | — (keys held, idle ones not yet swept included) |
//! | `tollway_tier_lookups_refused_total` | counter | `reason`: why a tier lookup was not started |
//! | `tollway_config_reloads_total` | counter | — (feature `config`) |
//! | `tollway_config_reload_errors_total` | counter | — (feature `config`) |
//! | `tollway_config_info` | gauge | `version`: 1 for the live file (feature `config`) |
//! | `tollway_config_loaded_timestamp_seconds` | gauge | — (feature `config`) |
//!
//! No label ever carries a caller's key: keys are unbounded, and private. The same list,
//! with each help text, is `tollway_core::metric::ALL`.
//!
//! **Tracing.** Each decision is one `debug` event (`policy`, `outcome`, `remaining`,
//! `retry_after_ms`) in the request's span. A failing store is a `warn` when it starts,
//! a summary every 10 s while it lasts, and a `warn` when it answers again: never a line
//! a request. The breaker logs its changes of state at `warn` and `info`.
//!
//! **A decision listener.** [`on_decision`](RateLimitLayerBuilder::on_decision) hears
//! every decision as a [`DecisionEvent`]: the caller's key, the outcome, each policy's
//! decision.
//!
//! **Shadow mode.** [`shadow`](RateLimitLayerBuilder::shadow) for the layer,
//! [`shadow_policy`](RateLimitLayerBuilder::shadow_policy) for one policy. A policy in
//! shadow decides and counts as usual (`shadow_limited`) but never refuses. It never
//! changes what the enforcing policies count, and a 429 never reports it. Switch it at
//! run time with [`set_shadow`](RateLimitLayer::set_shadow) and
//! [`set_policy_shadow`](RateLimitLayer::set_policy_shadow); callers keep their state.
//!
//! **Allow and deny lists.** [`allow_network`](RateLimitLayerBuilder::allow_network) and
//! [`allow_key`](RateLimitLayerBuilder::allow_key) skip limiting (`allow_listed`).
//! [`deny_network`](RateLimitLayerBuilder::deny_network) and
//! [`deny_key`](RateLimitLayerBuilder::deny_key) answer 403 (gRPC `PERMISSION_DENIED`)
//! with the usual JSON body. Networks match the peer, or the client behind proxies with
//! [`list_address`](RateLimitLayerBuilder::list_address).
//!
//! ```
//! use tollway_tower::{Algorithm, DecisionEvent, Key, MemoryStore, Policy, Quota, RateLimitLayer};
//!
//! let per_ip = Policy::new("per-ip", Algorithm::Gcra, Quota::per_minute(100)?)?;
//! let layer = RateLimitLayer::builder(MemoryStore::new(), per_ip)
//!     .shadow(true) // watch what it would refuse before enforcing
//!     .allow_network("10.0.0.0/8")
//!     .deny_key(Key::new("key", "stolen-key"))
//!     .on_decision(|event: &DecisionEvent<'_>| {
//!         if let Some(key) = event.key() {
//!             println!("{key:?}: {:?}", event.outcome());
//!         }
//!     })
//!     .build()?;
//! layer.set_shadow(false); // now enforce
//! # Ok::<(), tollway_tower::ConfigError>(())
//! ```
//!
//! **Store operations.** Beyond checks, [`Store::operate`] looks at or corrects a
//! caller's state under the policies you give: one, or [`RateLimitLayer::policies`] for
//! all. Every store has them, and each has a Lua twin in `lua/operate.lua`.
//!
//! - [`Operation::Peek`] decides, consuming nothing.
//! - [`Operation::Reset`] makes the state fresh.
//! - [`Operation::Charge`] takes units after the fact. What a bucket or GCRA cannot
//!   take is owed, and waited out before anything fits again.
//! - [`Operation::Refund`] gives units back, up to full.
//! - [`Operation::Drain`] leaves at most so many, in one step (the outbound layer's
//!   pause).
//!
//! **In the axum example** (`cargo run --example axum_server`):
//!
//! - `GET /metrics`.
//! - `GET` and `DELETE /admin/limits/{policy}/{key}`: peek and reset (`all` for every
//!   policy).
//! - `PUT /admin/shadow/{policy|all}` with the body `on` or `off`.
//! - `POST /admin/reload`: the limits file read again.
//! - `POST /api/v1/completions?tokens=N`, charged after the response.
//!
//! The admin API needs `Authorization: Bearer $ADMIN_TOKEN`. It exists only when you set
//! `ADMIN_TOKEN` to a secret of your own, and an address gets 30 a minute. No token is a
//! 401, a wrong one a 403. `demo-partner-key` is allow-listed, `demo-banned-key`
//! deny-listed.
//!
//! ```sh
//! curl localhost:3000/metrics | grep tollway_
//! curl -H "Authorization: Bearer $ADMIN_TOKEN" localhost:3000/admin/limits/anonymous/ip:127.0.0.1
//! curl -X DELETE -H "Authorization: Bearer $ADMIN_TOKEN" localhost:3000/admin/limits/anonymous/ip:127.0.0.1
//! curl -X PUT -H "Authorization: Bearer $ADMIN_TOKEN" -d on localhost:3000/admin/shadow/all
//! ```
//!
//! **The live lab** is at `http://localhost:3000/lab`. Pick one of the seven
//! algorithms, send one request or a burst of 15, and watch your state refill. Burst
//! across a window boundary: a fixed window of 10 per 5 s admits 20 in a quarter of a
//! second, the sliding log 10. Or race 30 requests through two gateways sharing a limit
//! of 10: tollway admits 10, a naive read-then-write limiter all 30. With `REDIS_URL`,
//! both run on Redis. A test drives the page in headless Chromium and checks its numbers
//! against the server's.
//!
//! ## Limits from a file
//!
//! With feature `config`, limits live in a TOML file: policies, tiers, routes, keys,
//! headers, the store, lists and shadow flags. The [`config`] module shows the format.
//! The whole file is validated before anything uses it. A bad one is refused at its
//! line and column, with what to write instead. `tollway check` (the `tollway-cli`
//! crate) says so before you deploy:
//!
//! ```text
//! $ tollway check limits.toml
//! limits.toml: valid
//!   policy anonymous: token_bucket of 20 per 60s, burst 20 (default)
//!   ...
//! $ tollway check broken.toml
//! broken.toml:6:9: policy "api": limit = 0 lets nothing through: write a limit of 1 to 9007199254740992 (2^53 units a period)
//! ```
//!
//! `config::Reloader` builds the layer from the file and reloads it. It reloads on demand
//! (`reloader.reload().await`, for SIGHUP or an admin endpoint) or whenever the file
//! changes (`reloader.watch()`). The new limits serve the next request:
//!
//! - Requests already being decided finish under the old limits.
//! - A policy keeps its callers' state, in memory and in Redis, when its limit or burst
//!   changes: a raise gives the difference, a cut refuses until usage is below it.
//! - A changed algorithm or period starts its callers afresh; the reload warns, naming
//!   each policy.
//! - A file that fails to validate keeps the running limits. It is logged at warn and
//!   counted in `tollway_config_reload_errors_total`.
//! - `[store]` and `[key]` are chosen at start. A reload that changes them is refused.
//! - Run-time shadow switches outlive a reload.
//!
//! `reloader.live()` says which file is live: its SHA-256, when it was loaded, its
//! reloads and failures. Any layer can take another's limits with
//! [`swap_limits`](RateLimitLayer::swap_limits).
//!
//! ```
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tollway_tower::MemoryStore;
//! use tollway_tower::config::Reloader;
//!
//! let file = |limit: u32, period: &str| {
//!     format!(
//!         "[layer]\ndefault = \"anonymous\"\n\n\
//!          [policies.anonymous]\nalgorithm = \"token_bucket\"\nlimit = {limit}\nperiod = \"{period}\"\n"
//!     )
//! };
//! let path = std::env::temp_dir().join(format!("tollway-guide-{}.toml", std::process::id()));
//! std::fs::write(&path, file(20, "1m"))?;
//! let reloader = Reloader::new(&path, MemoryStore::new())?;
//! let layer = reloader.layer(); // put this on the router
//!
//! std::fs::write(&path, file(1_000, "1m"))?;
//! let reloaded = reloader.reload().await?; // or keep `reloader.watch()?` to follow the file
//! assert!(reloaded.reset_policies().is_empty()); // a raise keeps what callers used
//!
//! std::fs::write(&path, file(60_000, "1h"))?;
//! let reloaded = reloader.reload().await?;
//! assert_eq!(reloaded.reset_policies(), ["anonymous"]); // a new period starts afresh
//!
//! std::fs::write(&path, file(0, "1h"))?;
//! assert!(reloader.reload().await.is_err()); // refused: 60,000 an hour stays
//! # std::fs::remove_file(&path)?;
//! # let _ = layer;
//! # Ok(())
//! # }
//! ```
//!
//! The repository's axum example (`cargo run --example axum_server` in a clone) serves
//! its `examples/tollway.toml` and watches it: change a limit, save, and the next
//! response's `x-ratelimit-limit` says the new one.
//!
//! ## Outbound limits
//!
//! The same policies and stores work on the client side. A fleet sharing a store stays
//! under a third-party API's quota together. [`outbound::OutboundLayer`] wraps any tower
//! HTTP client, such as hyper-util's `Client`. It is keyed by a [`KeyExtractor`], as on
//! the server side: per upstream by default ([`outbound::Upstream`]).
//!
//! - A request over the limit waits its turn (the retry time plus up to 10% jitter, at
//!   most `max_wait`, 30 s by default), or fails at once with `fail_fast`.
//! - A request dropped while it waits costs nothing.
//! - An upstream 429 (or gRPC `RESOURCE_EXHAUSTED`) pauses every worker sharing the
//!   store, for its `Retry-After`: seconds or an HTTP date, never more than `max_pause`
//!   (60 s by default). Garbage or a negative value means 1 s.
//! - After the pause the refused request is sent once more, if it is idempotent (or
//!   `replay` allows it) and the pause ends within its `max_wait`.
//! - With `cost` as an estimate and `settle` reading what the response used, the
//!   difference is charged or refunded after the call. What an empty token bucket or
//!   GCRA cannot take is owed and waited out.
//! - A layer's cost applies to each of its limits. For requests a second and tokens a
//!   minute, stack two layers.
//!
//! Give the clients a capacity a little under the upstream's. The [`outbound`] module
//! has the details and a reqwest adapter; the repository's `BENCHMARKS.md` ("Outbound
//! limits") has the figures.
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response};
//! use tollway_tower::outbound::OutboundLayer;
//! use tollway_tower::{Algorithm, MemoryStore, Policy, Quota};
//! use tower_layer::Layer;
//!
//! let upstream = Policy::new("upstream", Algorithm::Gcra, Quota::per_second(50)?.with_burst(8)?)?;
//! let client = tower::service_fn(|_req: Request<()>| async { Ok::<_, Infallible>(Response::new(())) });
//! let limited = OutboundLayer::builder(MemoryStore::new(), upstream).build()?.layer(client);
//! # let _ = limited;
//! # Ok::<(), tollway_tower::ConfigError>(())
//! ```
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
//! - `leases`: re-exports `Leased`, a store whose hot keys are decided in memory from
//!   units leased from another (see its docs), and lets a limits file ask for it
//!   (`[store] leases`). Enables `tollway-core/leases`.
//! - `metrics`: decisions counted in `tollway_decisions_total` by policy and outcome
//!   (and, with `config`, failed reloads in `tollway_config_reload_errors_total`), and
//!   the stores' metrics through `tollway-core/metrics`. Optional dependency `metrics`.
//! - `config`: the `config` module: limits from a TOML file, validated as a whole
//!   (`LimitsFile`, each error at its line and column), and reloaded on demand or when
//!   the file changes (`Reloader`). A `[store]` naming Redis needs `redis` too;
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
mod settle;
mod shadow;
pub mod shed;
mod verdict;

pub use body::ResponseBody;
pub use clock::TokioClock;
pub use headers::{
    HeaderStyle, RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING,
    X_RATELIMIT_RESET, rate_limit_headers,
};
#[cfg(feature = "tonic")]
pub use interceptor::RateLimitInterceptor;
pub use key::{
    AnyValue, ApiKey, ClientIp, Fallback, ForwardedHeader, GlobalKey, Key, KeyExtractor, KnownKeys,
    Or, PeerIp, UserId, peer_addr,
};
pub use limits::Tiers;
pub use lookup::{LookupFuture, OnLookupError, Plan, TierLookup};
pub use pipeline::{MissingKey, OnStoreError, Protocol};
pub use rate_limit::{
    RateLimit, RateLimitLayer, RateLimitLayerBuilder, ResponseFuture, ShadowState,
};
pub use rejection::{Rejection, default_rejection};
pub use report::{DecisionEvent, DecisionListener, DecisionOutcome};
pub use settle::{Unsettled, Usage};
pub use tollway_core;
#[cfg(feature = "leases")]
pub use tollway_core::Leased;
#[cfg(feature = "redis")]
pub use tollway_core::RedisStore;
pub use tollway_core::{
    Algorithm, BoxStore, CircuitBreaker, ConfigError, Decision, Decisions, Denial, MemoryStore,
    Operation, Policy, Quota, Store, StoreError,
};
pub use verdict::Verdict;
