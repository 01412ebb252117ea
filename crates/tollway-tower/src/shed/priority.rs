//! Priorities: which requests a shedder keeps, and how much of its limit each may count on.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::{Extensions, HeaderMap, HeaderValue, Method, Request, Uri};
use tollway_core::ConfigError;

use crate::limits::Route;

/// A class of requests, with its share of the limit.
///
/// A request takes the first priority, in the order given to
/// [`ShedBuilder::priority`](super::ShedBuilder::priority), that one of its [`Match`]es
/// fits. The first priority is the most important. Requests that fit none take the last,
/// `other`, whose share is what the others leave.
///
/// # Examples
///
/// ```
/// use http::Method;
/// use tollway_tower::shed::{Match, Priority};
///
/// let checkout = Priority::new("checkout", 0.4)
///     .when(Match::route(Some(Method::POST), "/api/v1/checkout")?);
/// let paying = Priority::new("paying", 0.4).when(Match::header_in(
///     http::HeaderName::from_static("x-api-key"),
///     ["pro-key-1", "pro-key-2"],
/// ));
/// # let _ = (checkout, paying);
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
#[derive(Clone, PartialEq)]
pub struct Priority {
    pub(super) name: String,
    pub(super) share: f64,
    pub(super) matches: Vec<Match>,
}

impl Priority {
    /// A priority called `name` that may count on `share` of the limit (0 to 1), with no
    /// match yet.
    pub fn new(name: impl Into<String>, share: f64) -> Self {
        Priority {
            name: name.into(),
            share,
            matches: Vec::new(),
        }
    }

    /// Adds a kind of request this priority takes.
    #[must_use]
    pub fn when(mut self, matched: Match) -> Self {
        self.matches.push(matched);
        self
    }

    /// Its name, as metrics label it.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its share of the limit.
    #[must_use]
    pub fn share(&self) -> f64 {
        self.share
    }

    /// Whether `request` is of this priority.
    pub(super) fn takes<B>(&self, request: &Request<B>) -> bool {
        self.matches.iter().any(|m| m.fits(request))
    }
}

impl fmt::Debug for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Priority")
            .field("name", &self.name)
            .field("share", &self.share)
            .field("matches", &self.matches)
            .finish()
    }
}

/// What a request must be for a [`Priority`] to take it.
///
/// Everything a request carries is the client's to choose. A match on a route or on a
/// header's known value (an API key of a tier) is won only by a request that has it. A
/// header's presence alone ([`header_present`](Self::header_present)) is won by any
/// client that sends it.
#[derive(Clone)]
pub struct Match(Rule);

/// Whether a request's method, URI, headers and extensions make it fit.
type MatchFn = Arc<dyn Fn(&Method, &Uri, &HeaderMap, &Extensions) -> bool + Send + Sync>;

#[derive(Clone)]
enum Rule {
    Route(Route),
    Header(HeaderName),
    HeaderValue(HeaderName, HeaderValue),
    HeaderIn(HeaderName, Arc<HashSet<String>>),
    Custom(MatchFn),
}

impl Match {
    /// Requests of `method` (`None`: any) to `pattern`: an exact path, an axum route
    /// template (`/users/{id}`), or either followed by `/*` for everything below.
    ///
    /// # Errors
    ///
    /// When the pattern is malformed.
    pub fn route(method: Option<Method>, pattern: &str) -> Result<Self, ConfigError> {
        Ok(Match(Rule::Route(Route::new(method, pattern)?)))
    }

    /// Requests that carry the header `name`, whatever its value: **claimable**.
    ///
    /// Any client can send any header, so any client can win this priority: bots that
    /// send a made-up `x-api-key` fill it as well as customers do. Match a header's
    /// values instead ([`header_in`](Self::header_in): a tier's API keys), or a header
    /// that a layer before this one checked or your proxy overwrites.
    #[must_use]
    pub fn header_present(name: HeaderName) -> Self {
        Match(Rule::Header(name))
    }

    /// Requests whose header `name` is `value`.
    #[must_use]
    pub fn header_value(name: HeaderName, value: HeaderValue) -> Self {
        Match(Rule::HeaderValue(name, value))
    }

    /// Requests whose header `name` is one of `values`: the API keys of a tier, say.
    ///
    /// ```
    /// use tollway_tower::shed::Match;
    ///
    /// let pro = Match::header_in(
    ///     http::HeaderName::from_static("x-api-key"),
    ///     ["pro-key-1", "pro-key-2"],
    /// );
    /// # let _ = pro;
    /// ```
    pub fn header_in<I>(name: HeaderName, values: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let values = values.into_iter().map(Into::into).collect();
        Match(Rule::HeaderIn(name, Arc::new(values)))
    }

    /// Requests for which `fits` says yes, from their method, URI, headers and
    /// extensions (where an auth layer puts who the caller is).
    ///
    /// ```
    /// use tollway_tower::shed::Match;
    ///
    /// #[derive(Clone)]
    /// struct Customer { paying: bool }
    ///
    /// let paying = Match::custom(|_, _, _, extensions| {
    ///     extensions.get::<Customer>().is_some_and(|c| c.paying)
    /// });
    /// # let _ = paying;
    /// ```
    pub fn custom<F>(fits: F) -> Self
    where
        F: Fn(&Method, &Uri, &HeaderMap, &Extensions) -> bool + Send + Sync + 'static,
    {
        Match(Rule::Custom(Arc::new(fits)))
    }

    fn fits<B>(&self, request: &Request<B>) -> bool {
        match &self.0 {
            Rule::Route(route) => route.matches_request(request),
            Rule::Header(name) => request.headers().contains_key(name),
            Rule::HeaderValue(name, value) => request.headers().get(name) == Some(value),
            Rule::HeaderIn(name, values) => request
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| values.contains(v)),
            Rule::Custom(fits) => fits(
                request.method(),
                crate::limits::sent_uri(request),
                request.headers(),
                request.extensions(),
            ),
        }
    }
}

impl PartialEq for Match {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Rule::Route(a), Rule::Route(b)) => a == b,
            (Rule::Header(a), Rule::Header(b)) => a == b,
            (Rule::HeaderValue(a, x), Rule::HeaderValue(b, y)) => a == b && x == y,
            (Rule::HeaderIn(a, x), Rule::HeaderIn(b, y)) => a == b && x == y,
            (Rule::Custom(a), Rule::Custom(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl fmt::Debug for Match {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Rule::Route(route) => write!(f, "route {route:?}"),
            Rule::Header(name) => write!(f, "header {name} present"),
            Rule::HeaderValue(name, _) => write!(f, "header {name} with a value"),
            // The values may be API keys: never printed.
            Rule::HeaderIn(name, values) => write!(f, "header {name} in {} values", values.len()),
            Rule::Custom(_) => f.write_str("custom"),
        }
    }
}
