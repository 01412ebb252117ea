//! Tiers looked up at run time: a caller's tier from a database or an auth service,
//! asked once and cached.

use std::collections::HashMap;
use std::error::Error;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::Shared;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::key::Key;
use crate::limits::Limits;
use crate::report::Failures;

/// What a [`TierLookup`] answers: the caller's tier by name, `None` for a caller it does
/// not know, or why it could not tell.
pub type LookupFuture =
    Pin<Box<dyn Future<Output = Result<Option<String>, Box<dyn Error + Send + Sync>>> + Send>>;

/// Looks up a caller's tier where it takes a while: an API key in a database, a token at
/// an auth service. Set with
/// [`RateLimitLayerBuilder::tier_lookup`](crate::RateLimitLayerBuilder::tier_lookup).
///
/// Implemented by closures `Fn(Key) -> impl Future<Output = Result<Option<String>, E>>`.
/// The answer names one of the layer's tiers (another name is the default policy, under
/// the caller's own key); `None` says the key is not one the service knows, and such a
/// caller gets no budget of its own.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollway_tower::{Algorithm, Key, MemoryStore, Policy, Quota, RateLimitLayer};
///
/// let anonymous = Policy::new("anonymous", Algorithm::Gcra, Quota::per_minute(20)?)?;
/// let pro = Policy::new("pro", Algorithm::Gcra, Quota::per_minute(10_000)?)?;
/// let layer = RateLimitLayer::builder(MemoryStore::new(), anonymous)
///     .tier(pro)
///     .tier_lookup(|key: Key| async move {
///         // A database query, in a real service.
///         let tier = (key.value() == b"k-123").then(|| "pro".to_owned());
///         Ok::<_, std::io::Error>(tier)
///     })
///     .tier_cache(100_000, Duration::from_secs(300))
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
pub trait TierLookup: Send + Sync + 'static {
    /// Looks up `key`'s tier.
    fn lookup(&self, key: &Key) -> LookupFuture;
}

impl<F, Fut, E> TierLookup for F
where
    F: Fn(Key) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Option<String>, E>> + Send + 'static,
    E: Into<Box<dyn Error + Send + Sync>>,
{
    fn lookup(&self, key: &Key) -> LookupFuture {
        let answer = self(key.clone());
        Box::pin(async move { answer.await.map_err(Into::into) })
    }
}

/// What to do with a request whose tier lookup failed (the database is down).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLookupError {
    /// Limit it as an unknown caller: the default policy, in the one budget all unknown
    /// callers share. Not cached: the next request asks again. The default.
    #[default]
    Anonymous,
    /// Answer 503 Service Unavailable (gRPC `UNAVAILABLE`).
    Reject,
}

/// What a lookup found, as the layer keeps it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Found {
    /// A known caller, limited under its own key by the policy at this index.
    Tier(usize),
    /// A caller the lookup does not know.
    Unknown,
}

/// The key every unknown caller is limited under, together.
pub(crate) fn unknown_key() -> Key {
    Key::new("unknown", "")
}

/// A layer's tier lookup, its cache and its rule for failures.
pub(crate) struct Lookups {
    lookup: Arc<dyn TierLookup>,
    /// Answers with when they expire, by tokio's clock (so a test's paused clock moves
    /// them too); the cache also drops them then by its own.
    cache: moka::sync::Cache<Key, (Found, Instant)>,
    ttl: Duration,
    /// How long a lookup may take before it counts as failed.
    timeout: Duration,
    /// Lookups under way, by key: the requests of one caller that arrive while its tier
    /// is being looked up wait for the same answer.
    in_flight: Mutex<HashMap<Key, Shared<Pending>>>,
    pub(crate) on_error: OnLookupError,
    pub(crate) failures: Failures,
}

/// A lookup shared by the requests that wait for it.
type Pending = Pin<Box<dyn Future<Output = Result<Option<String>, Arc<str>>> + Send>>;

/// The most lookups kept to be joined at once.
const MAX_IN_FLIGHT: usize = 10_000;

/// The default bound on cached answers.
pub(crate) const DEFAULT_CACHE_ENTRIES: u64 = 100_000;
/// How long a cached answer is kept by default.
pub(crate) const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(60);
/// How long a lookup may take by default.
pub(crate) const DEFAULT_LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);
/// The longest time to live the cache takes (moka's bound, less a margin).
pub(crate) const MAX_CACHE_TTL: Duration = Duration::from_secs(100 * 365 * 86_400);

impl Lookups {
    pub(crate) fn new(
        lookup: Arc<dyn TierLookup>,
        (entries, ttl, timeout): (u64, Duration, Duration),
        on_error: OnLookupError,
        failures: Failures,
    ) -> Self {
        Lookups {
            lookup,
            cache: moka::sync::Cache::builder()
                .max_capacity(entries)
                .time_to_live(ttl)
                .build(),
            ttl,
            timeout,
            in_flight: Mutex::default(),
            on_error,
            failures,
        }
    }

    /// A cached answer for `key`.
    #[inline]
    pub(crate) fn cached(&self, key: &Key) -> Option<Found> {
        let (found, expires) = self.cache.get(key)?;
        (Instant::now() < expires).then_some(found)
    }

    /// Starts a lookup of `key`, or joins the one under way, failing it if it takes
    /// longer than the layer's bound.
    pub(crate) fn start(&self, key: &Key) -> LookupFuture {
        let shared = {
            let mut in_flight = self.in_flight.lock();
            match in_flight.get(key) {
                Some(shared) => shared.clone(),
                None => {
                    let shared = self.timed(key).shared();
                    // Bounded: past it (requests given up while their lookup ran leave
                    // entries until their key comes again), lookups run alone.
                    if in_flight.len() < MAX_IN_FLIGHT {
                        in_flight.insert(key.clone(), shared.clone());
                    }
                    shared
                }
            }
        };
        Box::pin(async move { shared.await.map_err(|e| e.to_string().into()) })
    }

    /// One lookup of `key`, bounded by the layer's timeout, its error shareable.
    fn timed(&self, key: &Key) -> Pending {
        let lookup = self.lookup.lookup(key);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, lookup).await {
                Ok(answer) => answer.map_err(|e| Arc::from(e.to_string())),
                Err(_) => Err(Arc::from(format!("no answer within {timeout:?}"))),
            }
        })
    }

    /// What the lookup of `key` found, kept for the next requests; `None` when it
    /// failed.
    pub(crate) fn found(
        &self,
        key: &Key,
        answer: Result<Option<String>, Box<dyn Error + Send + Sync>>,
        limits: &Limits,
    ) -> Option<Found> {
        self.in_flight.lock().remove(key);
        let found = match answer {
            Ok(Some(tier)) => Found::Tier(limits.tier_index(&tier)),
            Ok(None) => Found::Unknown,
            Err(error) => {
                let action = match self.on_error {
                    OnLookupError::Anonymous => "limiting its callers as unknown",
                    OnLookupError::Reject => "answering 503",
                };
                self.failures.failed(&LookupFailed(error), action);
                return None;
            }
        };
        self.failures.succeeded();
        self.cache
            .insert(key.clone(), (found, Instant::now() + self.ttl));
        Some(found)
    }
}

impl fmt::Debug for Lookups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lookups")
            .field("cached", &self.cache.entry_count())
            .field("on_error", &self.on_error)
            .finish_non_exhaustive()
    }
}

/// A failed lookup, as the failure log tells it.
struct LookupFailed(Box<dyn Error + Send + Sync>);

impl fmt::Display for LookupFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tier lookup failed: {}", self.0)
    }
}
