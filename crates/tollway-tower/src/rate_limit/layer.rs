//! The layer and its builder.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Method, Response, Uri};
use tollway_core::{Clock, ConfigError, Policy, Store, SystemClock};
use tower_layer::Layer;

use super::RateLimit;
use crate::headers::HeaderStyle;
use crate::key::PeerIp;
use crate::limits::{Limits, RouteLimit, Tiers};
use crate::pipeline::{CostFn, Limiter, MissingKey, OnStoreError, Protocol};
use crate::rejection::{Rejection, RejectionHandler, default_rejection};

/// Applies rate limits to a service: see the [module docs](super) for a tour.
///
/// Built with [`RateLimitLayer::builder`]; cloning it (and every service it builds)
/// shares one set of limits.
pub struct RateLimitLayer<St, K = PeerIp> {
    limiter: Arc<Limiter<St>>,
    key: Arc<K>,
}

impl<St, K> Clone for RateLimitLayer<St, K> {
    fn clone(&self) -> Self {
        RateLimitLayer {
            limiter: Arc::clone(&self.limiter),
            key: Arc::clone(&self.key),
        }
    }
}

impl<St, K> fmt::Debug for RateLimitLayer<St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limits", &self.limiter.limits)
            .finish_non_exhaustive()
    }
}

impl<St: Store> RateLimitLayer<St, PeerIp> {
    /// Starts a layer over `store` whose callers without a tier get `default_policy`;
    /// callers are keyed by peer address until [`RateLimitLayerBuilder::key`] says
    /// otherwise.
    pub fn builder(store: St, default_policy: Policy) -> RateLimitLayerBuilder<St, PeerIp> {
        RateLimitLayerBuilder {
            store,
            key: PeerIp::new(),
            policies: vec![default_policy],
            tier_names: Vec::new(),
            tiers: None,
            routes: Vec::new(),
            errors: Vec::new(),
            cost: None,
            missing: MissingKey::Shared,
            on_error: OnStoreError::Allow,
            protocol: Protocol::Detect,
            headers: HeaderStyle::Legacy,
            wall_clock: Arc::new(SystemClock),
            on_rejected: Arc::new(default_rejection),
        }
    }
}

#[cfg(feature = "tonic")]
impl<C: tollway_core::Clock, K> RateLimitLayer<tollway_core::MemoryStore<C>, K> {
    /// A tonic interceptor applying this layer's limits, sharing its state: see
    /// [`RateLimitInterceptor`](crate::RateLimitInterceptor).
    ///
    /// # Errors
    ///
    /// When one of the layer's policies shapes (delays) requests: an interceptor cannot
    /// hold a request, so it would admit them undelayed.
    pub fn interceptor(&self) -> Result<crate::RateLimitInterceptor<C, K>, ConfigError> {
        crate::RateLimitInterceptor::new(Arc::clone(&self.limiter), Arc::clone(&self.key))
    }
}

impl<S, St, K> Layer<S> for RateLimitLayer<St, K> {
    type Service = RateLimit<S, St, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.limiter), Arc::clone(&self.key))
    }
}

/// Builds a [`RateLimitLayer`]; every setting is checked by [`build`](Self::build).
#[must_use]
pub struct RateLimitLayerBuilder<St, K> {
    store: St,
    key: K,
    policies: Vec<Policy>,
    tier_names: Vec<(String, usize)>,
    tiers: Option<Box<dyn Tiers>>,
    routes: Vec<RouteLimit>,
    errors: Vec<ConfigError>,
    cost: Option<CostFn>,
    missing: MissingKey,
    on_error: OnStoreError,
    protocol: Protocol,
    headers: HeaderStyle,
    wall_clock: Arc<dyn Clock>,
    on_rejected: RejectionHandler,
}

impl<St, K> fmt::Debug for RateLimitLayerBuilder<St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field(
                "policies",
                &self.policies.iter().map(Policy::name).collect::<Vec<_>>(),
            )
            .field("routes", &self.routes)
            .finish_non_exhaustive()
    }
}

impl<St: Store, K> RateLimitLayerBuilder<St, K> {
    /// Keys callers with `key` (default: [`PeerIp`]).
    pub fn key<K2>(self, key: K2) -> RateLimitLayerBuilder<St, K2> {
        RateLimitLayerBuilder {
            store: self.store,
            key,
            policies: self.policies,
            tier_names: self.tier_names,
            tiers: self.tiers,
            routes: self.routes,
            errors: self.errors,
            cost: self.cost,
            missing: self.missing,
            on_error: self.on_error,
            protocol: self.protocol,
            headers: self.headers,
            wall_clock: self.wall_clock,
            on_rejected: self.on_rejected,
        }
    }

    /// Adds a tier: callers whose [`Tiers`] resolver names `policy.name()` are limited by
    /// `policy` instead of the default.
    pub fn tier(mut self, policy: Policy) -> Self {
        self.tier_names
            .push((policy.name().to_owned(), self.policies.len()));
        self.policies.push(policy);
        self
    }

    /// Resolves each caller's tier (by name) from its key.
    pub fn tiers(mut self, tiers: impl Tiers) -> Self {
        self.tiers = Some(Box::new(tiers));
        self
    }

    /// Adds a limit for requests to `pattern` with `method` (`None`: any method), checked
    /// as well as the caller's own limit, per caller. All of a request's limits are
    /// decided at once by the store, all or nothing: the request passes when every one
    /// allows it, and a request one of them refuses is charged by none. The headers
    /// report the most restrictive.
    ///
    /// `pattern` is an exact path (`/api/v1/checkout`), an axum-style route template
    /// (`/users/{id}` for any one segment, `/files/{*path}` for the rest of the path), or
    /// either followed by `/*` for everything below (`/api/*`: `/api` and every path
    /// under it). It is compared with the whole path the request was sent to — inside a
    /// nested axum router too, where the router strips its prefix from the URI — and
    /// with the template of the route axum matched, so a layer in a nested router, a
    /// `route_layer` and a layer around the whole router all see the same routes.
    ///
    /// A `GET` limit covers `HEAD`, which servers answer with the GET handler; any other
    /// method is only itself. For a gRPC method use
    /// [`grpc_method`](Self::grpc_method): tonic serves a method whatever the HTTP method.
    pub fn route(self, method: Option<Method>, pattern: &str, policy: Policy) -> Self {
        let route = RouteLimit::new(method, pattern, self.policies.len());
        self.with_route(route, policy)
    }

    /// Adds a limit on the gRPC method at `path` (`/package.Service/Method`), checked as
    /// well as the caller's own limit: see [`route`](Self::route). It applies whatever the
    /// request's HTTP method, since tonic does not check it.
    pub fn grpc_method(self, path: &str, policy: Policy) -> Self {
        let route = RouteLimit::grpc(path, self.policies.len());
        self.with_route(route, policy)
    }

    fn with_route(mut self, route: Result<RouteLimit, ConfigError>, policy: Policy) -> Self {
        match route {
            Ok(route) => {
                self.routes.push(route);
                self.policies.push(policy);
            }
            Err(e) => self.errors.push(e),
        }
        self
    }

    /// How many units a request costs (default 1), from its method, URI and headers.
    pub fn cost(
        mut self,
        cost: impl Fn(&Method, &Uri, &HeaderMap) -> u32 + Send + Sync + 'static,
    ) -> Self {
        self.cost = Some(Arc::new(cost));
        self
    }

    /// What to do when the key extractor finds no key (default [`MissingKey::Shared`]).
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.missing = missing;
        self
    }

    /// What to do when the store fails (default [`OnStoreError::Allow`]).
    pub fn on_store_error(mut self, on_error: OnStoreError) -> Self {
        self.on_error = on_error;
        self
    }

    /// In whose terms refusals are answered (default [`Protocol::Detect`]): set
    /// [`Protocol::Http`] for a service that serves no gRPC, [`Protocol::Grpc`] for one
    /// that serves only gRPC.
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// Which headers to send (default [`HeaderStyle::Legacy`]).
    pub fn headers(mut self, headers: HeaderStyle) -> Self {
        self.headers = headers;
        self
    }

    /// The wall clock `X-RateLimit-Reset` counts from (default [`SystemClock`], Unix
    /// time; tests pass a manual clock set to a Unix time). The stores keep their own
    /// clocks for the limits themselves.
    pub fn wall_clock(mut self, clock: impl Clock) -> Self {
        self.wall_clock = Arc::new(clock);
        self
    }

    /// Builds the body of a denial yourself; the rate-limit headers are added to it.
    pub fn on_rejected(
        mut self,
        handler: impl Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.on_rejected = Arc::new(handler);
        self
    }

    /// Checks the settings and builds the layer.
    ///
    /// # Errors
    ///
    /// When a route pattern is malformed, or two of the layer's policies share a name
    /// (the name keeps their state apart in the store).
    pub fn build(mut self) -> Result<RateLimitLayer<St, K>, ConfigError> {
        if !self.errors.is_empty() {
            return Err(self.errors.swap_remove(0));
        }
        let mut seen = HashSet::new();
        for policy in &self.policies {
            if !seen.insert(policy.name()) {
                return Err(ConfigError::new(format!(
                    "two policies are named {:?}: give every tier and route policy its own name, \
                     since the name keeps their counts apart",
                    policy.name()
                )));
            }
        }
        let limits = Limits::new(self.policies, self.tier_names, self.tiers, self.routes);
        Ok(RateLimitLayer {
            limiter: Arc::new(Limiter {
                store: self.store,
                limits,
                cost: self.cost,
                missing: self.missing,
                on_error: self.on_error,
                protocol: self.protocol,
                header_style: self.headers,
                wall_clock: self.wall_clock,
                on_rejected: self.on_rejected,
            }),
            key: Arc::new(self.key),
        })
    }
}
