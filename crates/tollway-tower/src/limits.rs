//! Which limits apply to a request: the caller's tier (or the default), and the routes it
//! calls.

use std::collections::HashMap;
use std::fmt;

use http::{HeaderValue, Method};
use smallvec::SmallVec;
use tollway_core::{ConfigError, Policy};

use crate::Key;

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
    method: Option<Method>,
    path: String,
    prefix: bool,
    policy: usize,
}

impl RouteLimit {
    /// A limit by policy `policy` on `method` (`None`: any) and `pattern`: an exact path,
    /// or a prefix ending in `/*`.
    pub(crate) fn new(
        method: Option<Method>,
        pattern: &str,
        policy: usize,
    ) -> Result<Self, ConfigError> {
        if !pattern.starts_with('/') {
            return Err(ConfigError::new(format!(
                "route pattern {pattern:?} must start with '/': write \"/api/v1/checkout\" or \"/api/*\""
            )));
        }
        let (path, prefix) = match pattern.strip_suffix("/*") {
            Some(p) => (format!("{p}/"), true),
            None => (pattern.to_owned(), false),
        };
        if path.contains('*') {
            return Err(ConfigError::new(format!(
                "route pattern {pattern:?}: '*' is only allowed as a final \"/*\" (every path below)"
            )));
        }
        Ok(RouteLimit {
            method,
            path,
            prefix,
            policy,
        })
    }

    fn matches(&self, method: &Method, path: &str) -> bool {
        self.method.as_ref().is_none_or(|m| m == method)
            && if self.prefix {
                path.starts_with(&self.path) || path == &self.path[..self.path.len() - 1]
            } else {
                path == self.path
            }
    }
}

impl fmt::Debug for RouteLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let method = self.method.as_ref().map_or("*", Method::as_str);
        let star = if self.prefix { "*" } else { "" };
        write!(f, "{method} {}{star}", self.path)
    }
}

/// The policies one request is checked against, by index into [`Limits`], the caller's
/// own first.
pub(crate) type Selected = SmallVec<[usize; 4]>;

/// Every policy a layer knows, and how a request picks its own.
pub(crate) struct Limits {
    /// Index 0 is the default policy; tiers and routes follow.
    policies: Vec<Policy>,
    /// `X-RateLimit-Limit` of each policy (its burst), made when the layer is built.
    limit_values: Vec<HeaderValue>,
    tier_names: Vec<(String, usize)>,
    tiers: Option<Box<dyn Tiers>>,
    routes: Vec<RouteLimit>,
}

impl Limits {
    /// The limits of a layer whose default policy is `policies[0]`.
    pub(crate) fn new(
        policies: Vec<Policy>,
        tier_names: Vec<(String, usize)>,
        tiers: Option<Box<dyn Tiers>>,
        routes: Vec<RouteLimit>,
    ) -> Self {
        let limit_values = policies
            .iter()
            .map(|p| HeaderValue::from(p.quota().burst()))
            .collect();
        Limits {
            policies,
            limit_values,
            tier_names,
            tiers,
            routes,
        }
    }

    /// The policy at `index`.
    pub(crate) fn policy(&self, index: usize) -> &Policy {
        &self.policies[index]
    }

    /// Every policy.
    #[cfg(feature = "tonic")]
    pub(crate) fn policies(&self) -> &[Policy] {
        &self.policies
    }

    /// `X-RateLimit-Limit` for a decision of policy `index` whose limit is `limit`: the
    /// value made with the layer, unless the store decided with another capacity (a
    /// fallback limiter's share of the quota).
    pub(crate) fn limit_value(&self, index: usize, limit: u64) -> HeaderValue {
        if self.policies[index].quota().burst() == limit {
            self.limit_values[index].clone()
        } else {
            HeaderValue::from(limit)
        }
    }

    /// The limits for a request from `key` to `method path`: the caller's tier (or the
    /// default), then every matching route limit in the order they were added.
    pub(crate) fn select(&self, key: &Key, method: &Method, path: &str) -> Selected {
        let tier = match &self.tiers {
            None => 0,
            Some(tiers) => tiers
                .tier(key)
                .and_then(|name| self.tier_names.iter().find(|(n, _)| n == name))
                .map_or(0, |(_, index)| *index),
        };
        let mut selected = Selected::new();
        selected.push(tier);
        for route in &self.routes {
            if route.matches(method, path) {
                selected.push(route.policy);
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

    #[test]
    fn routes_match_exactly_or_by_prefix() {
        let exact = RouteLimit::new(Some(Method::POST), "/api/v1/checkout", 1).unwrap();
        assert!(exact.matches(&Method::POST, "/api/v1/checkout"));
        assert!(!exact.matches(&Method::GET, "/api/v1/checkout"));
        assert!(!exact.matches(&Method::POST, "/api/v1/checkout/x"));
        let prefix = RouteLimit::new(None, "/api/*", 1).unwrap();
        assert!(prefix.matches(&Method::GET, "/api/v1"));
        assert!(prefix.matches(&Method::GET, "/api"));
        assert!(!prefix.matches(&Method::GET, "/apix"));
        assert!(RouteLimit::new(None, "api", 1).is_err());
        assert!(RouteLimit::new(None, "/a*b", 1).is_err());
    }
}
