//! The layer's builder: every setting, checked when the layer is built.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Extensions, HeaderMap, Method, Response, StatusCode, Uri};
use parking_lot::Mutex;
use tollway_core::{Clock, ConfigError, Policy, Quota, Store, SystemClock};

use crate::access::AccessLists;
use crate::headers::{HeaderStyle, LimitValues};
use crate::key::{ClientIp, Key, PeerIp};
use crate::limits::{Limits, RouteLimit, Tiers};
use crate::lookup::{LookupSettings, Lookups, OnLookupError, Plan, TierLookup};
use crate::pipeline::{CostFn, Limiter, MissingKey, OnStoreError, PolicyCostFn, Protocol};
use crate::rejection::{Rejection, RejectionHandler, default_rejection};
use crate::report::{DecisionListener, Failures, Reporter};
use crate::settle::{Ledger, Settle, Unsettled, UsedFn};
use crate::shadow::Shadow;
use crate::shed::Shed;

use super::layer::RateLimitLayer;

impl<St: Store> RateLimitLayer<St, PeerIp> {
    /// Starts a layer over `store` whose callers without a tier get `default_policy`;
    /// callers are keyed by peer address until [`RateLimitLayerBuilder::key`] says
    /// otherwise.
    pub fn builder(store: St, default_policy: Policy) -> RateLimitLayerBuilder<St, PeerIp> {
        RateLimitLayerBuilder {
            key: PeerIp::new(),
            settings: Settings {
                store,
                policies: vec![default_policy],
                tier_names: Vec::new(),
                tiers: None,
                plans: Vec::new(),
                routes: Vec::new(),
                errors: Vec::new(),
                cost: None,
                policy_costs: Vec::new(),
                missing: MissingKey::Shared,
                on_error: OnStoreError::Allow,
                protocol: Protocol::Detect,
                headers: HeaderStyle::Legacy,
                wall_clock: Arc::new(SystemClock),
                on_rejected: Arc::new(default_rejection),
                lists: AccessLists::default(),
                shadow: false,
                shadow_policies: Vec::new(),
                listener: None,
                settle: None,
                unsettled: Unsettled::Keep,
                lookup: None,
                lookup_settings: LookupSettings::default(),
                on_lookup_error: OnLookupError::Anonymous,
                shed: None,
                source: None,
            },
        }
    }
}

/// Builds a [`RateLimitLayer`]; every setting is checked by [`build`](Self::build).
#[must_use]
pub struct RateLimitLayerBuilder<St, K> {
    key: K,
    settings: Settings<St>,
}

/// Everything a builder sets but the key extractor, which `key` replaces with another
/// type.
struct Settings<St> {
    store: St,
    policies: Vec<Policy>,
    tier_names: Vec<(String, usize)>,
    tiers: Option<Box<dyn Tiers>>,
    plans: Vec<(String, Plan)>,
    routes: Vec<RouteLimit>,
    errors: Vec<ConfigError>,
    cost: Option<CostFn>,
    policy_costs: Vec<(String, PolicyCostFn)>,
    missing: MissingKey,
    on_error: OnStoreError,
    protocol: Protocol,
    headers: HeaderStyle,
    wall_clock: Arc<dyn Clock>,
    on_rejected: RejectionHandler,
    lists: AccessLists,
    shadow: bool,
    shadow_policies: Vec<String>,
    listener: Option<Arc<dyn DecisionListener>>,
    settle: Option<(String, UsedFn)>,
    unsettled: Unsettled,
    lookup: Option<Arc<dyn TierLookup>>,
    lookup_settings: LookupSettings,
    on_lookup_error: OnLookupError,
    shed: Option<Shed>,
    /// The limits file the settings come from, which `build`'s errors name.
    source: Option<String>,
}

impl<St, K> fmt::Debug for RateLimitLayerBuilder<St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field(
                "policies",
                &self
                    .settings
                    .policies
                    .iter()
                    .map(Policy::name)
                    .collect::<Vec<_>>(),
            )
            .field("routes", &self.settings.routes)
            .finish_non_exhaustive()
    }
}

impl<St: Store, K> RateLimitLayerBuilder<St, K> {
    /// Keys callers with `key` (default: [`PeerIp`]).
    pub fn key<K2>(self, key: K2) -> RateLimitLayerBuilder<St, K2> {
        RateLimitLayerBuilder {
            key,
            settings: self.settings,
        }
    }

    /// Names the limits file the settings come from in `build`'s errors.
    #[cfg(feature = "config")]
    pub(crate) fn named_by_file(mut self, name: &str) -> Self {
        self.settings.source = Some(name.to_owned());
        self
    }

    /// Adds a tier: callers whose [`Tiers`] resolver names `policy.name()` are limited by
    /// `policy` instead of the default.
    pub fn tier(mut self, policy: Policy) -> Self {
        self.settings
            .tier_names
            .push((policy.name().to_owned(), self.settings.policies.len()));
        self.settings.policies.push(policy);
        self
    }

    /// Resolves each caller's tier (by name) from its key.
    pub fn tiers(mut self, tiers: impl Tiers) -> Self {
        self.settings.tiers = Some(Box::new(tiers));
        self
    }

    /// Gives the caller whose key value (an API key, a user ID) is `value` the `plan`:
    /// its tier, and perhaps a quota of its own. Asked before [`tiers`](Self::tiers).
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_tower::{Algorithm, MemoryStore, Plan, Policy, Quota, RateLimitLayer};
    ///
    /// let anonymous = Policy::new("anonymous", Algorithm::Gcra, Quota::per_minute(20)?)?;
    /// let pro = Policy::new("pro", Algorithm::Gcra, Quota::per_minute(10_000)?)?;
    /// let layer = RateLimitLayer::builder(MemoryStore::new(), anonymous)
    ///     .tier(pro)
    ///     .plan("k-acme", Plan::tier("pro").with_quota(Quota::per_minute(50_000)?))
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    ///
    /// `build` fails when the plan's quota does not suit its tier's algorithm.
    pub fn plan(mut self, value: impl Into<String>, plan: Plan) -> Self {
        self.settings.plans.push((value.into(), plan));
        self
    }

    /// Looks each caller's tier up with `lookup` instead of [`tiers`](Self::tiers).
    ///
    /// The lookup may be a database or an auth service. A caller's first request waits
    /// for the answer, which is then cached (see [`tier_cache`](Self::tier_cache)). A
    /// caller the lookup does not know (`None`) gets no budget of its own. Every such
    /// caller shares one: the default policy's, under the key `unknown:`. So made-up keys
    /// cannot mint fresh limits. A lookup that fails is handled per
    /// [`on_tier_lookup_error`](Self::on_tier_lookup_error).
    pub fn tier_lookup(mut self, lookup: impl TierLookup) -> Self {
        self.settings.lookup = Some(Arc::new(lookup));
        self
    }

    /// Keeps at most `entries` looked-up tiers, each for `ttl` (default 100,000 for 60 s):
    /// a changed tier takes effect within `ttl`.
    pub fn tier_cache(mut self, entries: u64, ttl: Duration) -> Self {
        self.settings.lookup_settings.entries = entries;
        self.settings.lookup_settings.ttl = ttl;
        self
    }

    /// How long a tier lookup may take (default 1 s): one that takes longer fails, per
    /// [`on_tier_lookup_error`](Self::on_tier_lookup_error).
    pub fn tier_lookup_timeout(mut self, timeout: Duration) -> Self {
        self.settings.lookup_settings.timeout = timeout;
        self
    }

    /// How many tier lookups may be under way at once (default 64).
    ///
    /// While that many are under way, a caller whose key is not cached is not looked up.
    /// It is limited as an unknown caller, for that request only (not cached). So a flood
    /// of made-up keys costs the lookup's backend at most this many calls at a time.
    /// Requests of a caller whose lookup is under way wait for it, whatever the bound.
    pub fn tier_lookup_concurrency(mut self, lookups: usize) -> Self {
        self.settings.lookup_settings.concurrency = lookups;
        self
    }

    /// How many tier lookups one address may start (default 60 a minute, GCRA, in a
    /// memory store of the layer's own). Past it, its callers whose keys are not cached
    /// are limited as unknown, for that request only. The address is the one the key
    /// extractor knows the caller by (`ip:` among its
    /// [`identities`](crate::KeyExtractor::identities): the client behind trusted
    /// proxies with `ClientIp`), else the peer's.
    pub fn tier_lookups_per_source(mut self, quota: Quota) -> Self {
        self.settings.lookup_settings.per_source = Some(quota);
        self
    }

    /// What to do with a request whose tier lookup failed (default
    /// [`OnLookupError::Anonymous`]). Failures are logged at warn when they start and end,
    /// and summarised in between.
    pub fn on_tier_lookup_error(mut self, rule: OnLookupError) -> Self {
        self.settings.on_lookup_error = rule;
        self
    }

    /// Adds a limit for requests to `pattern` with `method` (`None`: any method).
    ///
    /// It is checked as well as the caller's own limit, per caller. The store decides all
    /// of a request's limits at once, all or nothing. The request passes when every one
    /// allows it. A request one of them refuses is charged by none. The headers report
    /// the most restrictive.
    ///
    /// `pattern` is one of:
    ///
    /// - an exact path: `/api/v1/checkout`;
    /// - an axum-style route template: `/users/{id}` for any one segment, `/files/{*path}`
    ///   for the rest of the path;
    /// - either followed by `/*` for everything below: `/api/*` is `/api` and every path
    ///   under it.
    ///
    /// It is compared with the whole path the request was sent to. That holds inside a
    /// nested axum router too, where the router strips its prefix from the URI. It is
    /// also compared with the template of the route axum matched. So a layer in a nested
    /// router, a `route_layer` and a layer around the whole router all see the same
    /// routes.
    ///
    /// A `GET` limit covers `HEAD`, which servers answer with the GET handler; any other
    /// method is only itself. For a gRPC method use
    /// [`grpc_method`](Self::grpc_method): tonic serves a method whatever the HTTP method.
    pub fn route(self, method: Option<Method>, pattern: &str, policy: Policy) -> Self {
        let route = RouteLimit::new(method, pattern, self.settings.policies.len());
        self.with_route(route, policy)
    }

    /// Adds a limit on the gRPC method at `path` (`/package.Service/Method`), checked as
    /// well as the caller's own limit: see [`route`](Self::route). It applies whatever the
    /// request's HTTP method, since tonic does not check it.
    pub fn grpc_method(self, path: &str, policy: Policy) -> Self {
        let route = RouteLimit::grpc(path, self.settings.policies.len());
        self.with_route(route, policy)
    }

    fn with_route(mut self, route: Result<RouteLimit, ConfigError>, policy: Policy) -> Self {
        match route {
            Ok(route) => {
                self.settings.routes.push(route);
                self.settings.policies.push(policy);
            }
            Err(e) => self.settings.errors.push(e),
        }
        self
    }

    /// How many units a request costs (default 1), from its method, URI and headers.
    ///
    /// The URI is the one the client sent, as route limits see it: inside a nested axum
    /// router, its prefix included. A cost above a limit's capacity is refused with a 429
    /// that has no `Retry-After` (it can never pass). A cost of 0 counts as 1: a request
    /// that took nothing would pass an empty budget. A cost read from what the client
    /// sends is the client's to choose: give it a floor and a ceiling, or write it in a
    /// layer before this one (the limits file's `cost` has `min` and `max`).
    pub fn cost(
        mut self,
        cost: impl Fn(&Method, &Uri, &HeaderMap) -> u64 + Send + Sync + 'static,
    ) -> Self {
        self.settings.cost = Some(Arc::new(cost));
        self
    }

    /// How many units a request costs the policy named `policy`, instead of
    /// [`cost`](Self::cost): from its method, URI, headers and extensions.
    ///
    /// Each limit of a request is charged its own cost, all or nothing: 1 request and
    /// 800 tokens, say. A request one limit refuses charges none, so a request refused by
    /// its token limit takes no request unit. In Redis it is one script call still. The
    /// headers and a 429 report the limit that refused. An extension lets an earlier
    /// layer that read the body (an LLM call's `max_tokens`) say the cost. A name the
    /// layer does not know fails [`build`](Self::build), and so does a store that keeps
    /// one cost a request ([`Store::check_each`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_tower::{Algorithm, MemoryStore, Policy, Quota, RateLimitLayer};
    ///
    /// let requests = Policy::new("requests", Algorithm::Gcra, Quota::per_minute(60)?)?;
    /// let tokens = Policy::new("tokens", Algorithm::TokenBucket, Quota::per_minute(100_000)?)?;
    /// let layer = RateLimitLayer::builder(MemoryStore::new(), requests)
    ///     .route(None, "/v1/completions", tokens)
    ///     // A layer before this one read the body and wrote its max_tokens here, over
    ///     // whatever the client sent: within 1 and 4,096, 1,000 when it said none.
    ///     .policy_cost("tokens", |_method, _uri, headers, _extensions| {
    ///         let asked = headers.get("x-max-tokens").and_then(|v| v.to_str().ok()?.parse().ok());
    ///         asked.map_or(1_000, |n: u64| n.clamp(1, 4_096))
    ///     })
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    pub fn policy_cost(
        mut self,
        policy: impl Into<String>,
        cost: impl Fn(&Method, &Uri, &HeaderMap, &Extensions) -> u64 + Send + Sync + 'static,
    ) -> Self {
        self.settings
            .policy_costs
            .push((policy.into(), Arc::new(cost)));
        self
    }

    /// What to do when the key extractor finds no key (default [`MissingKey::Shared`]).
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.settings.missing = missing;
        self
    }

    /// What to do when the store fails (default [`OnStoreError::Allow`]).
    pub fn on_store_error(mut self, on_error: OnStoreError) -> Self {
        self.settings.on_error = on_error;
        self
    }

    /// In whose terms refusals are answered (default [`Protocol::Detect`]): set
    /// [`Protocol::Http`] for a service that serves no gRPC, [`Protocol::Grpc`] for one
    /// that serves only gRPC.
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.settings.protocol = protocol;
        self
    }

    /// Which headers to send (default [`HeaderStyle::Legacy`]).
    pub fn headers(mut self, headers: HeaderStyle) -> Self {
        self.settings.headers = headers;
        self
    }

    /// The wall clock `X-RateLimit-Reset` counts from (default [`SystemClock`], Unix
    /// time; tests pass a manual clock set to a Unix time). The stores keep their own
    /// clocks for the limits themselves.
    pub fn wall_clock(mut self, clock: impl Clock) -> Self {
        self.settings.wall_clock = Arc::new(clock);
        self
    }

    /// Builds the body of a denial yourself; the rate-limit headers are added to it.
    pub fn on_rejected(
        mut self,
        handler: impl Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.settings.on_rejected = Arc::new(handler);
        self
    }

    /// Lets callers from `network` (`10.0.0.0/8`, `2001:db8::/32`, or one address)
    /// through without limiting them: health checks, your own services. They are counted
    /// (`allow_listed`). The address is the peer's, or the client's behind proxies when
    /// [`list_address`](Self::list_address) says how to find it. A network that does not
    /// parse fails [`build`](Self::build).
    pub fn allow_network(mut self, network: &str) -> Self {
        if let Err(e) = self.settings.lists.allow_network(network) {
            self.settings.errors.push(e);
        }
        self
    }

    /// Refuses callers from `network` with 403 Forbidden (gRPC `PERMISSION_DENIED`) and
    /// a JSON body like the 429's. The deny list wins over the allow list.
    pub fn deny_network(mut self, network: &str) -> Self {
        if let Err(e) = self.settings.lists.deny_network(network) {
            self.settings.errors.push(e);
        }
        self
    }

    /// Lets the caller known by `key` through without limiting it (a partner's API
    /// key: `Key::new("key", "partner-key")`). Matched like [`deny_key`](Self::deny_key).
    pub fn allow_key(mut self, key: Key) -> Self {
        self.settings.lists.allow_key(key);
        self
    }

    /// Refuses the caller known by `key` with 403 Forbidden.
    ///
    /// A caller is known by every key its key extractor's chain could name it by, not
    /// only the one that limits it (see
    /// [`KeyExtractor::identities`](crate::KeyExtractor::identities)). Take
    /// `api_key.or(client_ip)`. Then `Key::new("ip", "203.0.113.9")` refuses that address,
    /// whatever API key it sends. And `Key::new("key", "k-stolen")` refuses that key from
    /// any address. An address key is written as the chain writes it: IPv6 grouped by its
    /// prefix (`ip:2001:db8:1:2::/64`). To refuse a network, use
    /// [`deny_network`](Self::deny_network).
    pub fn deny_key(mut self, key: Key) -> Self {
        self.settings.lists.deny_key(key);
        self
    }

    /// Matches the allow and deny networks against the client's address behind trusted
    /// proxies, found as `client_ip` finds it, instead of the peer's.
    pub fn list_address(mut self, client_ip: ClientIp) -> Self {
        self.settings.lists.address_from(client_ip);
        self
    }

    /// Shadow mode for the whole layer (default off): every request is decided and
    /// counted as usual, and none is refused. A request a limit would have refused goes
    /// to the service. It goes without rate-limit headers: they would announce a limit
    /// that is not enforced. It is told as `shadow_limited` to metrics, the debug event
    /// and the listener. Switch it at run time with [`RateLimitLayer::set_shadow`].
    pub fn shadow(mut self, on: bool) -> Self {
        self.settings.shadow = on;
        self
    }

    /// Shadow mode for the policy named `policy` alone.
    ///
    /// When only policies in shadow refuse a request, it goes through. The policies that
    /// enforce are then asked again on their own, since all or nothing charged none of
    /// them. So a policy in shadow never changes what the others count. Switch it at run
    /// time with [`RateLimitLayer::set_policy_shadow`]. A name the layer does not know
    /// fails [`build`](Self::build).
    pub fn shadow_policy(mut self, policy: impl Into<String>) -> Self {
        self.settings.shadow_policies.push(policy.into());
        self
    }

    /// Hears every decision: see [`DecisionListener`].
    pub fn on_decision(mut self, listener: impl DecisionListener) -> Self {
        self.settings.listener = Some(Arc::new(listener));
        self
    }

    /// Reserves, then settles, the policy named `policy`: a request reserves its cost
    /// when it is admitted, and once its response has ended the policy is settled to
    /// what the call used.
    ///
    /// The cost reserved is the policy's ([`policy_cost`](Self::policy_cost), say an LLM
    /// call's `max_tokens`), else the layer's. What the call used comes from `used`,
    /// read from the response's status, headers and extensions. Or the handler reports
    /// it through the [`Usage`](crate::Usage) the layer puts in the request's extensions,
    /// as it streams. More than reserved is charged: what the budget cannot take is owed
    /// and waited out before the caller is admitted again (see
    /// [`Operation::Charge`](tollway_core::Operation::Charge)). Less is refunded. Only
    /// requests that `policy` applies to are settled: usually a route's token budget
    /// beside the caller's request rate.
    ///
    /// The settlement is made when the response body ends, before its last frame is
    /// handed on: at once in memory, a round trip in Redis. So a client that read the
    /// answer finds the budget settled. A call that stops short (the service fails, the
    /// client goes away, the body is dropped) is settled at once to what was reported,
    /// else by [`on_unsettled`](Self::on_unsettled). A response that started is never
    /// refunded because its client left: see [`Unsettled`](crate::Unsettled). A
    /// settlement the store fails is dropped, and told like a store failure.
    ///
    /// A name the layer does not know fails [`build`](Self::build). So does a policy
    /// whose algorithm forgets a debt
    /// ([`Algorithm::keeps_debt`](tollway_core::Algorithm::keeps_debt)): a window would
    /// let go of a call's usage beyond it when the window ends.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_tower::{Algorithm, MemoryStore, Policy, Quota, RateLimitLayer, Unsettled};
    ///
    /// let requests = Policy::new("requests", Algorithm::Gcra, Quota::per_second(10)?)?;
    /// let tokens = Policy::new("tokens", Algorithm::TokenBucket, Quota::per_minute(100_000)?)?;
    /// let layer = RateLimitLayer::builder(MemoryStore::new(), requests)
    ///     .route(None, "/v1/completions", tokens)
    ///     // Reserve the most a call may use (the gateway wrote it, within 1 and 4,096)...
    ///     .policy_cost("tokens", |_, _, headers, _| {
    ///         let asked = headers.get("x-max-tokens").and_then(|v| v.to_str().ok()?.parse().ok());
    ///         asked.map_or(1_000, |n: u64| n.clamp(1, 4_096))
    ///     })
    ///     // ...then settle to what it used, or give it all back if the call failed.
    ///     .settle("tokens", |_status, headers, _extensions| {
    ///         headers.get("x-tokens-used")?.to_str().ok()?.parse().ok()
    ///     })
    ///     .on_unsettled(Unsettled::Refund)
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    pub fn settle(
        mut self,
        policy: impl Into<String>,
        used: impl Fn(StatusCode, &HeaderMap, &Extensions) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.settings.settle = Some((policy.into(), Arc::new(used)));
        self
    }

    /// What a settled call's reservation comes to when nothing reported what it used
    /// (default [`Unsettled::Keep`]): see [`settle`](Self::settle).
    pub fn on_unsettled(mut self, unsettled: Unsettled) -> Self {
        self.settings.unsettled = unsettled;
        self
    }

    /// Sheds load with `shed` before any limit is asked: an adaptive limit on the
    /// service's calls in flight, with priorities (see [`shed`](crate::shed)).
    ///
    /// A request over it is refused at once with 503 and `Retry-After` (gRPC
    /// `UNAVAILABLE`): no key, no store call. A request it admits is then decided by the
    /// layer's limits, and counts as in flight until the service answers.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_tower::shed::{Match, Priority, Shed};
    /// use tollway_tower::{Algorithm, MemoryStore, Policy, Quota, RateLimitLayer};
    ///
    /// let key = http::HeaderName::from_static("x-api-key");
    /// let paying = Priority::new("paying", 0.5).when(Match::header_in(key, ["pro-key"]));
    /// let shed = Shed::builder().priority(paying).build()?;
    /// let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(10)?)?;
    /// let layer = RateLimitLayer::builder(MemoryStore::new(), policy)
    ///     .shed(shed)
    ///     .build()?;
    /// assert!(layer.shed().is_some());
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    pub fn shed(mut self, shed: Shed) -> Self {
        self.settings.shed = Some(shed);
        self
    }

    /// Checks the settings and builds the layer.
    ///
    /// # Errors
    ///
    /// When a route pattern or a listed network is malformed. When two of the layer's
    /// policies share a name: the name keeps their state apart in the store. When a
    /// policy put in shadow mode, given a cost of its own, or settled after responses, is
    /// not one of the layer's. When the store cannot decide one of the policies
    /// ([`Store::supports`]). A `SplitStore`, say, decides only the policies declared to
    /// it. When a policy has a cost of its own and the store keeps one cost a request
    /// ([`Store::supports_each_cost`]).
    pub fn build(self) -> Result<RateLimitLayer<St, K>, ConfigError> {
        let source = self.settings.source.clone();
        self.build_here().map_err(|e| match source {
            Some(name) if !e.to_string().starts_with(&format!("{name}:")) => {
                ConfigError::new(format!("{name}: {e}"))
            }
            _ => e,
        })
    }

    fn build_here(self) -> Result<RateLimitLayer<St, K>, ConfigError> {
        let RateLimitLayerBuilder { key, mut settings } = self;
        if !settings.errors.is_empty() {
            return Err(settings.errors.swap_remove(0));
        }
        let mut seen = HashSet::new();
        for policy in &settings.policies {
            if !seen.insert(policy.name()) {
                return Err(ConfigError::new(format!(
                    "two policies are named {:?}: give every tier and route policy its own name, \
                     since the name keeps their counts apart",
                    policy.name()
                )));
            }
        }
        for policy in &settings.policies {
            settings.store.supports(policy)?;
        }
        let limits = Limits::new(
            settings.policies,
            settings.tier_names,
            settings.tiers,
            settings.plans,
            settings.routes,
        )?;
        let mut in_shadow = vec![false; limits.policies().len()];
        for name in &settings.shadow_policies {
            in_shadow[limits.index_of(name)?] = true;
        }
        let policy_costs = if settings.policy_costs.is_empty() {
            None
        } else {
            let mut costs: Vec<Option<PolicyCostFn>> = vec![None; limits.policies().len()];
            for (name, cost) in settings.policy_costs {
                costs[limits.index_of(&name)?] = Some(cost);
            }
            settings.store.supports_each_cost()?;
            Some(costs.into_boxed_slice())
        };
        let settle = match settings.settle {
            Some((name, used)) => {
                let policy = limits.index_of(&name)?;
                let algorithm = limits.policy(policy).algorithm();
                if !algorithm.keeps_debt() {
                    return Err(ConfigError::new(format!(
                        "policy {name:?} is settled after responses, but a {} forgets at the \
                         end of its window what a call used beyond it: settle a token_bucket, \
                         leaky_bucket or gcra, which keep it as a debt",
                        algorithm.name()
                    )));
                }
                Some(Settle {
                    policy,
                    used,
                    unsettled: settings.unsettled,
                })
            }
            None => None,
        };
        // Without tonic there is no gRPC status to answer with: a layer told to answer
        // only in gRPC's terms would answer in HTTP's, silently.
        #[cfg(not(feature = "tonic"))]
        if settings.protocol == Protocol::Grpc {
            return Err(ConfigError::new(
                "Protocol::Grpc answers with gRPC statuses, which need tollway-tower's feature \
                 \"tonic\": turn it on, or use Protocol::Detect",
            ));
        }
        let failures = Failures::new("rate limit store", Arc::clone(&settings.wall_clock));
        let charge_failures =
            Failures::new("post-response settlement", Arc::clone(&settings.wall_clock));
        let reporter = Reporter::new(settings.listener, limits.policies());
        let ledger = Ledger::new(
            settings.store,
            limits.shared_policies(),
            settle,
            charge_failures,
        );
        let limit_values = LimitValues::new(limits.policies());
        let lookups = match settings.lookup {
            Some(lookup) => {
                let failures = Failures::new("tier lookup", Arc::clone(&settings.wall_clock));
                Some(Lookups::new(
                    lookup,
                    settings.lookup_settings,
                    settings.on_lookup_error,
                    failures,
                )?)
            }
            None => None,
        };
        Ok(RateLimitLayer {
            limiter: Arc::new(ArcSwap::from_pointee(Limiter {
                ledger: Arc::new(ledger),
                limits,
                cost: settings.cost,
                policy_costs,
                missing: settings.missing,
                on_error: settings.on_error,
                protocol: settings.protocol,
                header_style: settings.headers,
                limit_values,
                wall_clock: settings.wall_clock,
                on_rejected: settings.on_rejected,
                lists: settings.lists,
                shadow: Shadow::new(settings.shadow, in_shadow.into_iter()),
                reporter,
                failures,
                lookups,
                shed: settings.shed,
            })),
            key: Arc::new(key),
            switching: Arc::new(Mutex::new(())),
            intercepted: Arc::new(AtomicBool::new(false)),
        })
    }
}
