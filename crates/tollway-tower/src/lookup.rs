//! Tiers looked up at run time: a caller's tier from a database or an auth service,
//! asked once and cached.

use std::collections::HashMap;
use std::error::Error;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::Shared;
use parking_lot::Mutex;
use tokio::time::Instant;
use tollway_core::{Algorithm, ConfigError, MemoryStore, Policy, Quota};

use crate::clock::TokioClock;
use crate::key::Key;
use crate::limits::Limits;
use crate::report::Failures;

/// What a [`TierLookup`] answers: the caller's [`Plan`], `None` for a caller it does not
/// know, or why it could not tell.
pub type LookupFuture =
    Pin<Box<dyn Future<Output = Result<Option<Plan>, Box<dyn Error + Send + Sync>>> + Send>>;

/// A caller's tier, and perhaps a quota of its own: what a [`TierLookup`] answers, and
/// what [`RateLimitLayerBuilder::plan`](crate::RateLimitLayerBuilder::plan) gives a key.
///
/// A caller with a quota of its own is limited by its tier's policy at that quota (see
/// [`Policy::with_quota`]): the same name and algorithm, so the same state. A customer
/// whose quota changes (a plan upgraded, a contract cut) keeps what it used, as long as
/// the period stays the same. A change of tier is a change of policy, and starts afresh.
///
/// On the memory store, a quota's change carries what was used as far as
/// [`MemoryStore`](tollway_core::MemoryStore) remembers older limits (its shards keep a
/// policy's last four): with many customers on distinct quotas of one policy, a change
/// may start a customer afresh there. Redis keeps each state's rate, and always carries.
///
/// A client chooses none of this: only the key it sends, whose plan is the service's.
///
/// The quota must suit the tier's algorithm (a calendar only for a fixed window): a
/// lookup's answer that does not is a failed lookup (see
/// [`on_tier_lookup_error`](crate::RateLimitLayerBuilder::on_tier_lookup_error)), a
/// builder's an error of `build`.
///
/// # Examples
///
/// ```
/// use tollway_tower::{Plan, Quota};
///
/// let pro = Plan::tier("pro");
/// assert_eq!((pro.tier_name(), pro.quota()), ("pro", None));
/// // Acme's contract: the pro tier's policy, at 50,000 a minute.
/// let acme = Plan::tier("pro").with_quota(Quota::per_minute(50_000)?);
/// assert_eq!(acme.quota().map(Quota::limit), Some(50_000));
/// // A tier's name is a plan too.
/// assert_eq!(Plan::from("pro"), pro);
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    tier: String,
    quota: Option<Quota>,
}

impl Plan {
    /// The tier named `name`, on the tier's quota. A name that is none of the layer's
    /// tiers is the default policy.
    pub fn tier(name: impl Into<String>) -> Self {
        Plan {
            tier: name.into(),
            quota: None,
        }
    }

    /// The same tier, at `quota`: a quota of the caller's own.
    #[must_use]
    pub fn with_quota(mut self, quota: Quota) -> Self {
        self.quota = Some(quota);
        self
    }

    /// The tier's name.
    #[must_use]
    pub fn tier_name(&self) -> &str {
        &self.tier
    }

    /// The caller's own quota, if it has one.
    #[must_use]
    pub fn quota(&self) -> Option<&Quota> {
        self.quota.as_ref()
    }
}

impl From<String> for Plan {
    fn from(tier: String) -> Self {
        Plan::tier(tier)
    }
}

impl From<&str> for Plan {
    fn from(tier: &str) -> Self {
        Plan::tier(tier)
    }
}

/// Looks up a caller's tier where it takes a while: an API key in a database, a token at
/// an auth service. Set with
/// [`RateLimitLayerBuilder::tier_lookup`](crate::RateLimitLayerBuilder::tier_lookup).
///
/// Implemented by closures `Fn(Key) -> impl Future<Output = Result<Option<T>, E>>`, where
/// `T` is a [`Plan`] or a tier's name (`String`). The answer names one of the layer's
/// tiers (another name is the default policy, under the caller's own key), with the
/// caller's own quota if it has one; `None` says the key is not one the service knows,
/// and such a caller gets no budget of its own.
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
///
/// A customer's own limit, from the row that stores its contract:
///
/// ```
/// use tollway_tower::{Algorithm, Key, MemoryStore, Plan, Policy, Quota, RateLimitLayer};
///
/// let anonymous = Policy::new("anonymous", Algorithm::Gcra, Quota::per_minute(20)?)?;
/// let pro = Policy::new("pro", Algorithm::Gcra, Quota::per_minute(10_000)?)?;
/// let layer = RateLimitLayer::builder(MemoryStore::new(), anonymous)
///     .tier(pro)
///     .tier_lookup(|key: Key| async move {
///         // SELECT per_minute FROM contracts WHERE api_key = $1, in a real service.
///         let per_minute = (key.value() == b"k-acme").then_some(50_000);
///         let plan = match per_minute {
///             Some(limit) => Some(Plan::tier("pro").with_quota(Quota::per_minute(limit)?)),
///             None => None,
///         };
///         Ok::<_, tollway_core::ConfigError>(plan)
///     })
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
pub trait TierLookup: Send + Sync + 'static {
    /// Looks up `key`'s tier.
    fn lookup(&self, key: &Key) -> LookupFuture;
}

impl<F, Fut, T, E> TierLookup for F
where
    F: Fn(Key) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Option<T>, E>> + Send + 'static,
    T: Into<Plan>,
    E: Into<Box<dyn Error + Send + Sync>>,
{
    fn lookup(&self, key: &Key) -> LookupFuture {
        let answer = self(key.clone());
        Box::pin(async move {
            match answer.await {
                Ok(plan) => Ok(plan.map(Into::into)),
                Err(error) => Err(error.into()),
            }
        })
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

/// Where a plan puts a caller: the index of its tier's policy, and that policy at the
/// caller's own quota when it has one.
pub(crate) type Placed = (usize, Option<Arc<Policy>>);

/// What a lookup found, as the layer keeps it.
#[derive(Clone, Debug)]
pub(crate) enum Found {
    /// A known caller, limited under its own key by the policy at this index, or by its
    /// own quota of that policy when it has one.
    Tier(usize, Option<Arc<Policy>>),
    /// A caller the lookup does not know.
    Unknown,
}

/// The key every unknown caller is limited under, together.
pub(crate) fn unknown_key() -> Key {
    Key::new("unknown", "")
}

/// A layer's tier lookup, its caches, its bounds and its rule for failures.
pub(crate) struct Lookups {
    lookup: Arc<dyn TierLookup>,
    /// Known callers' tiers with when they expire, by tokio's clock (so a test's paused
    /// clock moves them too); the cache also drops them then by its own.
    known: moka::sync::Cache<Key, (usize, Option<Arc<Policy>>, Instant)>,
    /// Keys the lookup does not know, apart, so that a flood of made-up keys cannot push
    /// the known callers out.
    unknown: moka::sync::Cache<Key, Instant>,
    ttl: Duration,
    /// How long a lookup may take before it counts as failed.
    timeout: Duration,
    /// Lookups under way, by key: the requests of one caller that arrive while its tier
    /// is being looked up wait for the same answer.
    in_flight: Mutex<HashMap<Key, Shared<Pending>>>,
    /// Calls to the lookup under way, and the most there may be.
    running: Arc<AtomicUsize>,
    max_running: usize,
    /// Lookups each source (a caller's address) may start, counted in a store of their
    /// own.
    per_source: (MemoryStore<TokioClock>, Policy),
    pub(crate) on_error: OnLookupError,
    pub(crate) failures: Failures,
}

/// How a layer looks tiers up: its cache, timeout and bounds.
#[derive(Clone, Debug)]
pub(crate) struct LookupSettings {
    pub(crate) entries: u64,
    pub(crate) ttl: Duration,
    pub(crate) timeout: Duration,
    pub(crate) concurrency: usize,
    /// `None`: [`DEFAULT_LOOKUPS_PER_SOURCE`] a minute.
    pub(crate) per_source: Option<Quota>,
}

/// How many lookups one address may start a minute, by default.
pub(crate) const DEFAULT_LOOKUPS_PER_SOURCE: u64 = 60;

impl Default for LookupSettings {
    fn default() -> Self {
        LookupSettings {
            entries: 100_000,
            ttl: Duration::from_secs(60),
            timeout: Duration::from_secs(1),
            concurrency: 64,
            per_source: None,
        }
    }
}

/// Why a lookup was not started.
#[derive(Clone, Copy, Debug)]
enum Refused {
    /// As many lookups as the layer allows are under way.
    Concurrency,
    /// The caller's address has started as many as it may for now.
    Source,
}

impl Refused {
    fn reason(self) -> &'static str {
        match self {
            Refused::Concurrency => "concurrency",
            Refused::Source => "source",
        }
    }
}

/// Counts a call to the lookup as under way until dropped.
struct Running(Arc<AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A lookup shared by the requests that wait for it.
type Pending = Pin<Box<dyn Future<Output = Result<Option<Plan>, Arc<str>>> + Send>>;

/// The most lookups kept to be joined at once.
const MAX_IN_FLIGHT: usize = 10_000;

/// The longest time to live the cache takes (moka's bound, less a margin).
pub(crate) const MAX_CACHE_TTL: Duration = Duration::from_secs(100 * 365 * 86_400);

impl Lookups {
    /// # Errors
    ///
    /// When the settings are out of range: a time to live beyond 100 years, a timeout of
    /// zero, no lookups at once.
    pub(crate) fn new(
        lookup: Arc<dyn TierLookup>,
        settings: LookupSettings,
        on_error: OnLookupError,
        failures: Failures,
    ) -> Result<Self, ConfigError> {
        if settings.ttl > MAX_CACHE_TTL || settings.timeout.is_zero() || settings.concurrency == 0 {
            return Err(ConfigError::new(format!(
                "tier_cache's time to live must be at most {} years (got {:?}), \
                 tier_lookup_timeout more than zero (got {:?}), and \
                 tier_lookup_concurrency at least 1 (got {})",
                MAX_CACHE_TTL.as_secs() / (365 * 86_400),
                settings.ttl,
                settings.timeout,
                settings.concurrency,
            )));
        }
        fn cache<V: Clone + Send + Sync + 'static>(
            settings: &LookupSettings,
        ) -> moka::sync::Cache<Key, V> {
            moka::sync::Cache::builder()
                .max_capacity(settings.entries)
                .time_to_live(settings.ttl)
                .build()
        }
        let sources = MemoryStore::builder().clock(TokioClock::new()).build()?;
        let quota = match settings.per_source.clone() {
            Some(quota) => quota,
            None => Quota::per_minute(DEFAULT_LOOKUPS_PER_SOURCE)?,
        };
        let per_source = Policy::new("tier-lookups", Algorithm::Gcra, quota)?;
        Ok(Lookups {
            lookup,
            known: cache(&settings),
            unknown: cache(&settings),
            ttl: settings.ttl,
            timeout: settings.timeout,
            in_flight: Mutex::default(),
            running: Arc::new(AtomicUsize::new(0)),
            max_running: settings.concurrency,
            per_source: (sources, per_source),
            on_error,
            failures,
        })
    }

    /// A cached answer for `key`.
    #[inline]
    pub(crate) fn cached(&self, key: &Key) -> Option<Found> {
        let now = Instant::now();
        if let Some((tier, own, expires)) = self.known.get(key) {
            return (now < expires).then_some(Found::Tier(tier, own));
        }
        let expires = self.unknown.get(key)?;
        (now < expires).then_some(Found::Unknown)
    }

    /// Starts a lookup of `key` for a caller at `source` (its address key), or joins the
    /// one under way. It fails the lookup if it takes longer than the layer's bound.
    ///
    /// `None`: not started. Either as many lookups as the layer allows are under way, or
    /// `source` has started as many as it may for now. The caller is then unknown, for
    /// this request only.
    pub(crate) fn start(&self, key: &Key, source: Option<&Key>) -> Option<LookupFuture> {
        let shared = {
            let mut in_flight = self.in_flight.lock();
            match in_flight.get(key) {
                Some(shared) => shared.clone(),
                None => {
                    if let Err(refused) = self.admit(source) {
                        tracing::debug!(
                            reason = refused.reason(),
                            "tier lookup not started: the caller is unknown for this request"
                        );
                        #[cfg(feature = "metrics")]
                        metrics::counter!(
                            tollway_core::metric::TIER_LOOKUPS_REFUSED.name,
                            "reason" => refused.reason()
                        )
                        .increment(1);
                        return None;
                    }
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
        Some(Box::pin(async move {
            shared.await.map_err(|e| e.to_string().into())
        }))
    }

    /// Whether a new call to the lookup may start for `source`: counted as under way if
    /// so, and charged to the source.
    fn admit(&self, source: Option<&Key>) -> Result<(), Refused> {
        if self.running.load(Ordering::Acquire) >= self.max_running {
            return Err(Refused::Concurrency);
        }
        if let Some(source) = source {
            let (store, policy) = &self.per_source;
            if !store.decide(source.as_bytes(), &[policy], 1).is_allowed() {
                return Err(Refused::Source);
            }
        }
        self.running.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// One lookup of `key`, bounded by the layer's timeout, its error shareable.
    /// Counted as under way (see [`admit`](Self::admit)) until it ends or is dropped.
    fn timed(&self, key: &Key) -> Pending {
        let lookup = self.lookup.lookup(key);
        let timeout = self.timeout;
        let running = Running(Arc::clone(&self.running));
        Box::pin(async move {
            let _running = running;
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
        answer: Result<Option<Plan>, Box<dyn Error + Send + Sync>>,
        limits: &Limits,
    ) -> Option<Found> {
        self.in_flight.lock().remove(key);
        let expires = Instant::now() + self.ttl;
        // A quota that does not suit its tier's algorithm is a failed answer.
        let answer = answer.and_then(|plan| match plan {
            Some(plan) => Ok(Some(limits.plan(&plan)?)),
            None => Ok(None),
        });
        let found = match answer {
            Ok(Some((tier, own))) => {
                self.known.insert(key.clone(), (tier, own.clone(), expires));
                Found::Tier(tier, own)
            }
            Ok(None) => {
                self.unknown.insert(key.clone(), expires);
                Found::Unknown
            }
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
        Some(found)
    }
}

impl fmt::Debug for Lookups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lookups")
            .field("known", &self.known.entry_count())
            .field("unknown", &self.unknown.entry_count())
            .field("running", &self.running.load(Ordering::Relaxed))
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
