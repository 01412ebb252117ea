//! Which limits apply to a request: tiers, routes, cost, and what to do when things go
//! wrong.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use tollway_core::{ConfigError, Policy};

use crate::Key;
use crate::response::{number, static_number};

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

/// What to do with a request for which the key extractor finds no key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Limit the caller by its peer address under the default policy (the default): an
    /// anonymous caller is still limited.
    FallbackToIp,
    /// Answer with this status and a JSON error body, without calling the service.
    Reject(StatusCode),
    /// Let the request through unlimited.
    Allow,
}

/// What to do when the store cannot decide (Redis down, a timeout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let the request through (fail open), without rate-limit headers. The default:
    /// an outage of the limiter's backend does not become an outage of the service.
    Allow,
    /// Answer 503 Service Unavailable (gRPC: `UNAVAILABLE`) (fail closed).
    Reject,
}

/// Which rate-limit headers responses carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` (Unix seconds),
    /// and `Retry-After` on denials. The default.
    Legacy,
    /// The IETF structured fields `RateLimit-Policy` and `RateLimit`
    /// (draft-ietf-httpapi-ratelimit-headers-10), and `Retry-After` on denials.
    Ietf,
    /// Both.
    Both,
    /// None but `Retry-After` on denials.
    None,
}

/// The cost of a request: how many units it takes from each of its limits.
pub(crate) type CostFn = Arc<dyn Fn(&Method, &Uri, &HeaderMap) -> u32 + Send + Sync>;

/// An extra limit for requests to one route.
#[derive(Clone)]
pub(crate) struct Route {
    method: Option<Method>,
    path: String,
    prefix: bool,
    pub(crate) policy: usize,
}

impl Route {
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
        Ok(Route {
            method,
            path,
            prefix,
            policy,
        })
    }

    pub(crate) fn matches(&self, method: &Method, path: &str) -> bool {
        self.method.as_ref().is_none_or(|m| m == method)
            && if self.prefix {
                path.starts_with(&self.path) || path == &self.path[..self.path.len() - 1]
            } else {
                path == self.path
            }
    }
}

impl fmt::Debug for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let method = self.method.as_ref().map_or("*", Method::as_str);
        let star = if self.prefix { "*" } else { "" };
        write!(f, "{method} {}{star}", self.path)
    }
}

/// Every policy a layer knows, and how a request picks its own.
pub(crate) struct Limits {
    /// Index 0 is the default policy; tiers and routes follow.
    pub(crate) policies: Vec<Policy>,
    pub(crate) tier_names: Vec<(String, usize)>,
    pub(crate) tiers: Option<Box<dyn Tiers>>,
    pub(crate) routes: Vec<Route>,
    /// `X-RateLimit-Limit` of each policy, made once.
    pub(crate) limit_headers: Vec<HeaderValue>,
}

/// The policies one request is checked against, by index into [`Limits::policies`].
pub(crate) type Plan = smallvec::SmallVec<[usize; 4]>;

impl Limits {
    pub(crate) fn new(
        policies: Vec<Policy>,
        tier_names: Vec<(String, usize)>,
        tiers: Option<Box<dyn Tiers>>,
        routes: Vec<Route>,
    ) -> Self {
        // A decision's limit is its quota's burst (which window algorithms keep equal to
        // their limit), so it is known for every policy before any request.
        let limit_headers = policies
            .iter()
            .map(|p| static_number(p.quota().burst()))
            .collect();
        Limits {
            policies,
            tier_names,
            tiers,
            routes,
            limit_headers,
        }
    }

    /// The `X-RateLimit-Limit` value for `limit`, reported by policy `index`.
    pub(crate) fn limit_header(&self, index: usize, limit: u64) -> HeaderValue {
        match (self.policies.get(index), self.limit_headers.get(index)) {
            (Some(policy), Some(value)) if policy.quota().burst() == limit => value.clone(),
            _ => number(limit),
        }
    }

    #[inline]
    pub(crate) fn plan(&self, key: &Key, method: &Method, path: &str) -> Plan {
        let mut plan = Plan::new();
        if self.tiers.is_none() && self.routes.is_empty() {
            // One policy for everyone: nothing to look up.
            plan.push(0);
            return plan;
        }
        let tier = self
            .tiers
            .as_ref()
            .and_then(|t| t.tier(key))
            .and_then(|name| self.tier_names.iter().find(|(n, _)| n == name))
            .map_or(0, |(_, i)| *i);
        plan.push(tier);
        plan.extend(
            self.routes
                .iter()
                .filter(|r| r.matches(method, path))
                .map(|r| r.policy),
        );
        plan
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
        let exact = Route::new(Some(Method::POST), "/api/v1/checkout", 1).unwrap();
        assert!(exact.matches(&Method::POST, "/api/v1/checkout"));
        assert!(!exact.matches(&Method::GET, "/api/v1/checkout"));
        assert!(!exact.matches(&Method::POST, "/api/v1/checkout/x"));
        let prefix = Route::new(None, "/api/*", 1).unwrap();
        assert!(prefix.matches(&Method::GET, "/api/v1"));
        assert!(prefix.matches(&Method::GET, "/api"));
        assert!(!prefix.matches(&Method::GET, "/apix"));
        assert!(Route::new(None, "api", 1).is_err());
        assert!(Route::new(None, "/a*b", 1).is_err());
    }
}
