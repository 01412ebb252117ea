//! Which limits apply to a request: the caller's tier (or the default), and the routes it
//! calls.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use http::Method;
use smallvec::SmallVec;
use tollway_core::{ConfigError, Policy};

use crate::Key;
use crate::lookup::{Found, Placed, Plan};

/// Names the tier of a caller: the name of one of the layer's tier policies, or `None`
/// for the default policy.
///
/// Implemented by closures `Fn(&Key) -> Option<&'static str>` and by a
/// `HashMap<String, String>` from key value (an API key, a user ID) to tier name.
///
/// # Examples
///
/// ```
/// use std::collections::HashMap;
/// use tollway_tower::{Key, Tiers};
///
/// let by_prefix = |key: &Key| key.value().starts_with(b"pro-").then_some("pro");
/// assert_eq!(by_prefix.tier(&Key::new("key", "pro-123")), Some("pro"));
///
/// let map = HashMap::from([("k-1".to_owned(), "free".to_owned())]);
/// assert_eq!(map.tier(&Key::new("key", "k-1")), Some("free"));
/// assert_eq!(map.tier(&Key::new("key", "k-2")), None);
/// ```
pub trait Tiers: Send + Sync + 'static {
    /// The tier name for `key`, or `None` for the default policy.
    fn tier(&self, key: &Key) -> Option<&str>;
}

impl<F> Tiers for F
where
    F: Fn(&Key) -> Option<&'static str> + Send + Sync + 'static,
{
    fn tier(&self, key: &Key) -> Option<&str> {
        self(key)
    }
}

impl Tiers for HashMap<String, String> {
    fn tier(&self, key: &Key) -> Option<&str> {
        let value = std::str::from_utf8(key.value()).ok()?;
        self.get(value).map(String::as_str)
    }
}

/// An extra limit for the requests to one route: a method (or any) and a path pattern.
#[derive(Clone)]
pub(crate) struct RouteLimit {
    route: Route,
    policy: usize,
}

impl RouteLimit {
    /// A limit by policy `policy` on `method` (`None`: any) and `pattern` (see
    /// [`Route::new`]).
    pub(crate) fn new(
        method: Option<Method>,
        pattern: &str,
        policy: usize,
    ) -> Result<Self, ConfigError> {
        let route = Route::new(method, pattern)?;
        Ok(RouteLimit { route, policy })
    }

    /// A limit on the gRPC method at `path` (see [`Route::grpc`]).
    pub(crate) fn grpc(path: &str, policy: usize) -> Result<Self, ConfigError> {
        let route = Route::grpc(path)?;
        Ok(RouteLimit { route, policy })
    }

    fn matches(&self, method: &Method, paths: &RequestPaths<'_>) -> bool {
        self.route.matches(method, paths)
    }
}

/// A route: a method (or any) and a path pattern.
#[derive(Clone, PartialEq)]
pub(crate) struct Route {
    method: Option<Method>,
    /// The pattern without its `/*`.
    path: String,
    /// Whether every path below `path` is on the route too.
    prefix: bool,
}

impl Route {
    /// The route of `method` (`None`: any) and `pattern`: an exact path, an axum route
    /// template (`/users/{id}`, `/files/{*path}`), or either followed by `/*` for
    /// everything below.
    pub(crate) fn new(method: Option<Method>, pattern: &str) -> Result<Self, ConfigError> {
        let bad = |why: &str| {
            Err(ConfigError::new(format!(
                "route pattern {pattern:?}: {why}; write \"/api/v1/checkout\", \"/users/{{id}}\" \
                 or \"/api/*\""
            )))
        };
        if !pattern.starts_with('/') {
            return bad("it must start with '/'");
        }
        let (path, prefix) = match pattern.strip_suffix("/*") {
            Some(p) => (p, true),
            None => (pattern, false),
        };
        let segments = path.split('/').collect::<Vec<_>>();
        for (i, segment) in segments.iter().enumerate() {
            let last = i + 1 == segments.len();
            match parameter(segment) {
                Some(Parameter::Bad) => {
                    return bad("a parameter is a whole segment, {name} or a final {*name}");
                }
                Some(Parameter::Rest) if !last || prefix => {
                    return bad("{*name} takes the rest of the path, so it comes last");
                }
                Some(_) => {}
                None if segment.contains('*') => {
                    return bad("'*' is only allowed as a final \"/*\" (every path below)");
                }
                None => {}
            }
        }
        Ok(Route {
            method,
            path: path.to_owned(),
            prefix,
        })
    }

    /// A limit on the gRPC method at `path` (`/package.Service/Method`), whatever the
    /// request's HTTP method: gRPC calls are POSTs, but tonic serves any method.
    pub(crate) fn grpc(path: &str) -> Result<Self, ConfigError> {
        let parts: Vec<&str> = path.split('/').collect();
        let well_formed = parts.len() == 3
            && parts[0].is_empty()
            && parts[1].contains('.')
            && !parts[2].is_empty()
            && !path.contains(['*', '{', '}']);
        if !well_formed {
            return Err(ConfigError::new(format!(
                "gRPC method {path:?} must be written /package.Service/Method, like \
                 \"/demo.Catalog/Export\""
            )));
        }
        Self::new(None, path)
    }

    /// Whether a request of `method` to one of `paths` is on this route. HEAD is GET:
    /// servers answer HEAD with the GET handler (axum and hyper do), so a GET limit
    /// covers it; every other method is only itself.
    fn matches(&self, method: &Method, paths: &RequestPaths<'_>) -> bool {
        let method_ok = match &self.method {
            None => true,
            Some(m) => m == method || (*m == Method::GET && method == Method::HEAD),
        };
        method_ok && paths.iter().any(|path| self.covers(path))
    }

    /// Whether `path` (a request's path, or the template of the route it matched) is on
    /// this route: segment by segment, a `{name}` standing for any one segment and a
    /// `{*name}` for the rest.
    fn covers(&self, path: &str) -> bool {
        let mut given = path.split('/');
        for wanted in self.path.split('/') {
            let Some(segment) = given.next() else {
                return false;
            };
            let fits = match parameter(wanted) {
                Some(Parameter::Rest) => return !segment.is_empty(),
                Some(_) => !segment.is_empty(),
                None => segment == wanted,
            };
            if !fits {
                return false;
            }
        }
        given.next().is_none() || self.prefix
    }
}

/// What a `{...}` segment of a route pattern is.
enum Parameter {
    /// `{name}`: one segment.
    One,
    /// `{*name}`: the rest of the path.
    Rest,
    /// A brace in a segment that is neither.
    Bad,
}

fn parameter(segment: &str) -> Option<Parameter> {
    if !segment.contains(['{', '}']) {
        return None;
    }
    let inner = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}'));
    Some(match inner {
        Some(name) if name.contains(['{', '}']) || name.is_empty() => Parameter::Bad,
        Some(name) => match name.strip_prefix('*') {
            Some("") => Parameter::Bad,
            Some(_) => Parameter::Rest,
            None => Parameter::One,
        },
        None => Parameter::Bad,
    })
}

/// The paths a request is known by.
///
/// One is the whole path it was sent to: axum's `OriginalUri`, which a nested router
/// leaves whole, else the URI's. Inside an axum router, the other is the template of the
/// route that matched: `MatchedPath`, prefixes included.
pub(crate) struct RequestPaths<'r> {
    whole: &'r str,
    matched: Option<&'r str>,
}

/// The URI the request was sent to: axum's `OriginalUri`, which a nested router leaves
/// whole, else the request's own. Route limits and the cost closure both read it.
pub(crate) fn sent_uri<B>(request: &http::Request<B>) -> &http::Uri {
    #[cfg(feature = "axum")]
    if let Some(original) = request.extensions().get::<axum::extract::OriginalUri>() {
        return &original.0;
    }
    request.uri()
}

impl<'r> RequestPaths<'r> {
    pub(crate) fn of<B>(request: &'r http::Request<B>) -> Self {
        #[cfg(feature = "axum")]
        let matched = request
            .extensions()
            .get::<axum::extract::MatchedPath>()
            .map(axum::extract::MatchedPath::as_str);
        #[cfg(not(feature = "axum"))]
        let matched = None;
        RequestPaths {
            whole: sent_uri(request).path(),
            matched,
        }
    }

    fn iter(&self) -> impl Iterator<Item = &'r str> {
        std::iter::once(self.whole).chain(self.matched)
    }
}

impl Route {
    /// Whether `request` is on this route, by its method and the paths it is known by.
    pub(crate) fn matches_request<B>(&self, request: &http::Request<B>) -> bool {
        self.matches(request.method(), &RequestPaths::of(request))
    }
}

impl fmt::Debug for RouteLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.route)
    }
}

impl fmt::Debug for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let method = self.method.as_ref().map_or("*", Method::as_str);
        let star = if self.prefix { "/*" } else { "" };
        write!(f, "{method} {}{star}", self.path)
    }
}

/// The policies one request is checked against, by index into [`Limits`], the caller's
/// own first.
pub(crate) type Selected = SmallVec<[usize; 4]>;

/// Every policy a layer knows, and how a request picks its own.
pub(crate) struct Limits {
    /// Index 0 is the default policy; tiers and routes follow.
    policies: Arc<[Policy]>,
    tier_names: Vec<(String, usize)>,
    tiers: Option<Box<dyn Tiers>>,
    /// Callers given a plan by key value: their tier, and their own policy when the
    /// plan has a quota. Asked before `tiers`.
    plans: HashMap<Box<[u8]>, Placed>,
    routes: Vec<RouteLimit>,
}

impl Limits {
    /// The limits of a layer whose default policy is `policies[0]`, with callers given
    /// `plans` by key value.
    ///
    /// # Errors
    ///
    /// When a plan's quota does not suit its tier's algorithm.
    pub(crate) fn new(
        policies: Vec<Policy>,
        tier_names: Vec<(String, usize)>,
        tiers: Option<Box<dyn Tiers>>,
        plans: Vec<(String, Plan)>,
        routes: Vec<RouteLimit>,
    ) -> Result<Self, ConfigError> {
        let mut limits = Limits {
            policies: policies.into(),
            tier_names,
            tiers,
            plans: HashMap::new(),
            routes,
        };
        for (value, plan) in plans {
            let found = limits.plan(&plan).map_err(|e| {
                ConfigError::new(format!(
                    "the plan of a key (tier {:?}) does not fit its tier: {e}",
                    plan.tier_name()
                ))
            })?;
            limits.plans.insert(value.into_bytes().into(), found);
        }
        Ok(limits)
    }

    /// The policy at `index`.
    pub(crate) fn policy(&self, index: usize) -> &Policy {
        &self.policies[index]
    }

    /// Every policy.
    /// The policies, shared: what a settlement settles, by the same index.
    pub(crate) fn shared_policies(&self) -> Arc<[Policy]> {
        Arc::clone(&self.policies)
    }

    pub(crate) fn policies(&self) -> &[Policy] {
        &self.policies
    }

    /// The index of the policy named `name`.
    pub(crate) fn index_of(&self, name: &str) -> Result<usize, ConfigError> {
        self.policies
            .iter()
            .position(|p| p.name() == name)
            .ok_or_else(|| {
                let known: Vec<&str> = self.policies.iter().map(Policy::name).collect();
                ConfigError::new(format!(
                    "the layer has no policy named {name:?}; its policies are {known:?}"
                ))
            })
    }

    /// The tier of `key`'s caller: its plan if it has one, else by the layer's [`Tiers`]
    /// (the default's, 0, without one or for a caller in no tier).
    pub(crate) fn tier_for(&self, key: &Key) -> Found {
        if !self.plans.is_empty()
            && let Some((tier, own)) = self.plans.get(key.value())
        {
            return Found::Tier(*tier, own.clone());
        }
        let tier = match &self.tiers {
            None => 0,
            Some(tiers) => tiers.tier(key).map_or(0, |name| self.tier_index(name)),
        };
        Found::Tier(tier, None)
    }

    /// Where `plan` puts a caller: the index of its tier's policy, and the policy at the
    /// caller's own quota when the plan has one.
    ///
    /// # Errors
    ///
    /// When the quota does not suit the tier's algorithm.
    pub(crate) fn plan(&self, plan: &Plan) -> Result<Placed, ConfigError> {
        let tier = self.tier_index(plan.tier_name());
        let own = match plan.quota() {
            None => None,
            Some(quota) => Some(Arc::new(self.policy(tier).with_quota(quota.clone())?)),
        };
        Ok((tier, own))
    }

    /// The index of the tier policy named `name`; the default's (0) for a name that is
    /// not one of the layer's tiers.
    pub(crate) fn tier_index(&self, name: &str) -> usize {
        self.tier_names
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, index)| *index)
    }

    /// The limits for a request of the caller whose tier policy is at `tier`: it, then
    /// every route limit the request matches.
    pub(crate) fn select_tier<B>(&self, tier: usize, request: &http::Request<B>) -> Selected {
        let mut selected = Selected::new();
        selected.push(tier);
        if !self.routes.is_empty() {
            let paths = RequestPaths::of(request);
            for route in &self.routes {
                if route.matches(request.method(), &paths) {
                    selected.push(route.policy);
                }
            }
        }
        selected
    }
}

impl fmt::Debug for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limits")
            .field("default", &self.policies[0].name())
            .field(
                "tiers",
                &self.tier_names.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("routes", &self.routes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(whole: &str) -> RequestPaths<'_> {
        RequestPaths {
            whole,
            matched: None,
        }
    }

    #[test]
    fn routes_match_exactly_or_by_prefix() {
        let exact = RouteLimit::new(Some(Method::POST), "/api/v1/checkout", 1).unwrap();
        assert!(exact.matches(&Method::POST, &paths("/api/v1/checkout")));
        assert!(!exact.matches(&Method::GET, &paths("/api/v1/checkout")));
        assert!(!exact.matches(&Method::POST, &paths("/api/v1/checkout/x")));
        let prefix = RouteLimit::new(None, "/api/*", 1).unwrap();
        assert!(prefix.matches(&Method::GET, &paths("/api/v1")));
        assert!(prefix.matches(&Method::GET, &paths("/api")));
        assert!(!prefix.matches(&Method::GET, &paths("/apix")));
        assert!(RouteLimit::new(None, "api", 1).is_err());
        assert!(RouteLimit::new(None, "/a*b", 1).is_err());
    }

    #[test]
    fn a_get_limit_covers_head_and_nothing_else() {
        let get = RouteLimit::new(Some(Method::GET), "/items", 1).unwrap();
        assert!(get.matches(&Method::HEAD, &paths("/items")));
        assert!(!get.matches(&Method::POST, &paths("/items")));
        let head = RouteLimit::new(Some(Method::HEAD), "/items", 1).unwrap();
        assert!(!head.matches(&Method::GET, &paths("/items")));
    }

    #[test]
    fn a_grpc_method_limit_applies_to_every_http_method() {
        let export = RouteLimit::grpc("/demo.Catalog/Export", 1).unwrap();
        for method in [Method::POST, Method::GET, Method::PUT, Method::DELETE] {
            assert!(export.matches(&method, &paths("/demo.Catalog/Export")));
        }
        for bad in [
            "demo.Catalog/Export",
            "/Catalog/Export",
            "/demo.Catalog/",
            "/a.b/c/d",
        ] {
            assert!(RouteLimit::grpc(bad, 1).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_route_template_matches_paths_and_the_matched_template() {
        let user = RouteLimit::new(None, "/users/{id}", 1).unwrap();
        assert!(user.matches(&Method::GET, &paths("/users/42")));
        assert!(!user.matches(&Method::GET, &paths("/users/")));
        assert!(!user.matches(&Method::GET, &paths("/users/42/orders")));
        let nested = RequestPaths {
            whole: "/v2/people/42",
            matched: Some("/users/{user_id}"),
        };
        assert!(user.matches(&Method::GET, &nested));
        let files = RouteLimit::new(None, "/files/{*path}", 1).unwrap();
        assert!(files.matches(&Method::GET, &paths("/files/a/b.txt")));
        assert!(!files.matches(&Method::GET, &paths("/files/")));
        let below = RouteLimit::new(None, "/users/{id}/*", 1).unwrap();
        assert!(below.matches(&Method::GET, &paths("/users/42/orders/7")));
        assert!(below.matches(&Method::GET, &paths("/users/42")));
        for bad in [
            "/users/{}",
            "/users/x{id}",
            "/files/{*path}/x",
            "/f/{*}",
            "/{*p}/*",
        ] {
            assert!(RouteLimit::new(None, bad, 1).is_err(), "{bad}");
        }
    }
}
