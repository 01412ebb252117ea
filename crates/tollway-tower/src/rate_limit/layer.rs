//! The layer: the limits every clone shares, and their run-time switches.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use tollway_core::{Clock, ConfigError, Policy};
use tower_layer::Layer;

use super::RateLimit;
use crate::key::{Key, PeerIp};
use crate::pipeline::{Current, Limiter};
use crate::report::{DecisionEvent, DecisionOutcome};
use crate::verdict::Verdict;

/// Applies rate limits to a service: see the [module docs](super) for a tour.
///
/// Built with [`RateLimitLayer::builder`]; cloning it (and every service it builds)
/// shares one set of limits.
pub struct RateLimitLayer<St, K = PeerIp> {
    pub(super) limiter: Current<St>,
    pub(super) key: Arc<K>,
    /// Taken by run-time shadow switches and swaps of limits, so that neither loses the
    /// other.
    pub(super) switching: Arc<Mutex<()>>,
    /// Whether an interceptor was made from the layer: then every swap of limits must
    /// be one it can apply.
    pub(super) intercepted: Arc<AtomicBool>,
}

impl<St, K> Clone for RateLimitLayer<St, K> {
    fn clone(&self) -> Self {
        RateLimitLayer {
            limiter: Arc::clone(&self.limiter),
            key: Arc::clone(&self.key),
            switching: Arc::clone(&self.switching),
            intercepted: Arc::clone(&self.intercepted),
        }
    }
}

/// A limit's shadow mode as it stands: on or off.
///
/// It also says whether a run-time switch put it there, against what the layer was built
/// with. The switches are [`RateLimitLayer::set_shadow`] and
/// [`RateLimitLayer::set_policy_shadow`]. For a [`Reloader`](crate::config::Reloader),
/// what the layer was built with is its limits file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShadowState {
    policy: Option<String>,
    on: bool,
    switched: bool,
}

impl ShadowState {
    /// The policy, or `None` for the whole layer.
    #[must_use]
    pub fn policy(&self) -> Option<&str> {
        self.policy.as_deref()
    }

    /// Whether it is in shadow mode (decided and counted, never enforced).
    #[must_use]
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// Whether a run-time switch says so, against what the layer was built with.
    #[must_use]
    pub fn is_switched(&self) -> bool {
        self.switched
    }

    /// What the limit is called in messages: `policy "api"`, or `the whole layer`.
    fn what(&self) -> String {
        match &self.policy {
            Some(name) => format!("policy {name:?}"),
            None => "the whole layer".to_owned(),
        }
    }

    fn mode(on: bool) -> &'static str {
        if on { "in shadow mode" } else { "enforcing" }
    }
}

impl<St, K> fmt::Debug for RateLimitLayer<St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limits", &self.limiter.load().limits)
            .finish_non_exhaustive()
    }
}

impl<St, K> RateLimitLayer<St, K> {
    /// The limiter current now, for the pipeline's own tests.
    #[cfg(test)]
    pub(crate) fn limiter(&self) -> Arc<Limiter<St>> {
        self.limiter.load_full()
    }

    /// The store the layer decides with: for looking at or correcting a caller's state
    /// with [`Store::operate`](tollway_core::Store::operate) (an admin endpoint's peek and reset). Stores are handles:
    /// the clone shares the layer's state.
    pub fn store(&self) -> St
    where
        St: Clone,
    {
        self.limiter.load().ledger.store.clone()
    }

    /// The layer's load shedder, if it has one: see
    /// [`RateLimitLayerBuilder::shed`](super::RateLimitLayerBuilder::shed).
    #[must_use]
    pub fn shed(&self) -> Option<crate::shed::Shed> {
        self.limiter.load().shed.clone()
    }

    /// The layer's policy named `name` (the default, a tier, or a route's).
    #[must_use]
    pub fn policy(&self, name: &str) -> Option<Policy> {
        let limiter = self.limiter.load();
        let policies = limiter.limits.policies();
        policies.iter().find(|p| p.name() == name).cloned()
    }

    /// Every policy of the layer: the default first, then tiers and routes.
    #[must_use]
    pub fn policies(&self) -> Vec<Policy> {
        self.limiter.load().limits.policies().to_vec()
    }

    /// Replaces this layer's limits with `other`'s, for the next request.
    ///
    /// The limits are the policies, tiers, routes, lists, shadow flags, headers, and what
    /// to do on a store failure. They change in this layer, its clones and every service
    /// they built. A request already being decided finishes under the limits it started
    /// with. The key extractor stays this layer's.
    ///
    /// Build `other` over a clone of this layer's store. Then a policy of the same name,
    /// algorithm and period keeps its callers' state, whatever its limit and burst (see
    /// [`Policy::state_id`](tollway_core::Policy::state_id)). Another starts afresh.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_tower::{Algorithm, MemoryStore, Policy, Quota, RateLimitLayer};
    ///
    /// let store = MemoryStore::new();
    /// let ten = Policy::new("api", Algorithm::Gcra, Quota::per_minute(10)?)?;
    /// let layer = RateLimitLayer::builder(store.clone(), ten).build()?;
    ///
    /// // A customer's raise, without a restart.
    /// let thousand = Policy::new("api", Algorithm::Gcra, Quota::per_minute(1_000)?)?;
    /// layer.swap_limits(RateLimitLayer::builder(store, thousand).build()?)?;
    /// assert_eq!(layer.policy("api").map(|p| p.quota().limit()), Some(1_000));
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    ///
    /// Run-time shadow switches ([`set_shadow`](Self::set_shadow),
    /// [`set_policy_shadow`](Self::set_policy_shadow)) outlive the swap. A switch that
    /// `other` contradicts is kept, logged at warn and returned. A switch that `other`
    /// agrees with is done: the limit follows its builder again. A switch whose policy
    /// `other` lacks is dropped, at warn. [`reset_shadow`](Self::reset_shadow) drops them
    /// all.
    ///
    /// # Errors
    ///
    /// When an interceptor was made from this layer ([`interceptor`](Self::interceptor))
    /// and cannot apply `other` (a limit on calls in flight, say: it never sees a
    /// response). The running limits stay.
    pub fn swap_limits<K2>(
        &self,
        other: RateLimitLayer<St, K2>,
    ) -> Result<Vec<ShadowState>, ConfigError> {
        let _switching = self.switching.lock();
        let (old, new) = (self.limiter.load(), other.limiter.load_full());
        if self.intercepted.load(Ordering::Acquire) {
            new.interceptable().map_err(|e| {
                ConfigError::new(format!(
                    "a tonic interceptor made from this layer cannot apply the new limits, \
                     which are not swapped in: {e}"
                ))
            })?;
        }
        let mut kept = Vec::new();
        for was in shadow_states(&old).into_iter().filter(|s| s.switched) {
            let (what, now) = (was.what(), ShadowState::mode(was.on));
            // Where the switch's limit is in the new limits: `None` inside, the layer.
            let index = match &was.policy {
                None => Some(None),
                Some(name) => new.limits.index_of(name).ok().map(Some),
            };
            match index {
                None => tracing::warn!(
                    "{what} was switched {now} at run time and is not in the new limits: \
                     the switch is dropped"
                ),
                Some(at) if new.shadow.built(at) == was.on => tracing::info!(
                    "{what}: the new limits say what its run-time switch said ({now}); \
                     it follows its limits again"
                ),
                Some(at) => {
                    new.shadow.set(at, was.on);
                    tracing::warn!(
                        "{what}: the new limits put it {}, but it was switched {now} at run \
                         time: it stays {now} (set it again, or reset the switches, to \
                         follow the limits)",
                        ShadowState::mode(new.shadow.built(at)),
                    );
                    kept.push(was);
                }
            }
        }
        self.limiter.store(new);
        Ok(kept)
    }

    /// Puts the whole layer in shadow mode, or takes it out: see
    /// [`RateLimitLayerBuilder::shadow`](super::RateLimitLayerBuilder::shadow). Takes effect for the next request, in every
    /// clone of the layer and every service it built, and outlives a
    /// [`swap_limits`](Self::swap_limits) (a reload) until
    /// [`reset_shadow`](Self::reset_shadow).
    pub fn set_shadow(&self, on: bool) {
        let _switching = self.switching.lock();
        self.limiter.load().shadow.set_layer(on);
    }

    /// Puts one policy in shadow mode, or takes it out: see
    /// [`RateLimitLayerBuilder::shadow_policy`](super::RateLimitLayerBuilder::shadow_policy). Its callers' state is kept either way.
    /// Like [`set_shadow`](Self::set_shadow), it outlives a swap of limits.
    ///
    /// # Errors
    ///
    /// When the layer has no policy of that name.
    pub fn set_policy_shadow(&self, policy: &str, on: bool) -> Result<(), ConfigError> {
        let _switching = self.switching.lock();
        let limiter = self.limiter.load();
        let index = limiter.limits.index_of(policy)?;
        limiter.shadow.set_policy(index, on);
        Ok(())
    }

    /// Drops every run-time shadow switch: each limit is in shadow mode again exactly
    /// when its builder (or limits file) says so.
    pub fn reset_shadow(&self) {
        let _switching = self.switching.lock();
        let limiter = self.limiter.load();
        let shadow = &limiter.shadow;
        let policies = (0..limiter.limits.policies().len()).map(Some);
        for at in std::iter::once(None).chain(policies) {
            shadow.set(at, shadow.built(at));
        }
    }

    /// The shadow mode of the whole layer, then of each policy: what is live, and which
    /// of it a run-time switch says.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_tower::{Algorithm, MemoryStore, Policy, Quota, RateLimitLayer};
    ///
    /// let api = Policy::new("api", Algorithm::Gcra, Quota::per_minute(10)?)?;
    /// let layer = RateLimitLayer::builder(MemoryStore::new(), api)
    ///     .shadow_policy("api")
    ///     .build()?;
    /// layer.set_policy_shadow("api", false)?;
    /// let api = &layer.shadow_states()[1];
    /// assert_eq!(api.policy(), Some("api"));
    /// assert!(!api.is_on() && api.is_switched());
    /// layer.reset_shadow();
    /// assert!(layer.shadow_states()[1].is_on());
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    #[must_use]
    pub fn shadow_states(&self) -> Vec<ShadowState> {
        shadow_states(&self.limiter.load())
    }

    /// Tells a decision made outside the layer's own requests as the layer tells its
    /// own: `tollway_decisions_total{policy, outcome}` (feature `metrics`), the debug
    /// event, and the decision listener. tollway-server tells each Envoy descriptor's
    /// decision so. A verdict of a policy the layer does not have is not counted.
    pub fn tell(&self, key: &Key, verdict: Verdict<'_>, outcome: DecisionOutcome) {
        let limiter = self.limiter.load();
        let Ok(index) = limiter.limits.index_of(verdict.policy.name()) else {
            return;
        };
        let verdicts = [verdict];
        let event = DecisionEvent::new(Some(key), outcome, &verdicts, Some(0));
        limiter.reporter.report(&event, Some(index));
    }

    /// The clock the layer reads the time of day from: `X-RateLimit-Reset` is counted on
    /// it ([`wall_clock`](super::RateLimitLayerBuilder::wall_clock)).
    #[must_use]
    pub fn wall_clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.limiter.load().wall_clock)
    }

    /// Whether the whole layer (`None`) or the named policy is in shadow mode.
    #[must_use]
    pub fn is_shadow(&self, policy: Option<&str>) -> bool {
        let limiter = self.limiter.load();
        match policy {
            None => limiter.shadow.layer(),
            Some(name) => limiter
                .limits
                .index_of(name)
                .is_ok_and(|index| limiter.shadow.policy(index)),
        }
    }
}

/// The shadow mode of a limiter's whole layer, then of each of its policies.
fn shadow_states<St>(limiter: &Limiter<St>) -> Vec<ShadowState> {
    let shadow = &limiter.shadow;
    let state = |policy: Option<&Policy>, at: Option<usize>| {
        let on = at.map_or_else(|| shadow.layer(), |i| shadow.policy(i));
        ShadowState {
            policy: policy.map(|p| p.name().to_owned()),
            on,
            switched: on != shadow.built(at),
        }
    };
    let policies = limiter.limits.policies().iter().enumerate();
    std::iter::once(state(None, None))
        .chain(policies.map(|(i, policy)| state(Some(policy), Some(i))))
        .collect()
}

#[cfg(feature = "tonic")]
impl<C: tollway_core::Clock, K> RateLimitLayer<tollway_core::MemoryStore<C>, K> {
    /// A tonic interceptor applying this layer's limits, sharing its state: see
    /// [`RateLimitInterceptor`](crate::RateLimitInterceptor).
    ///
    /// # Errors
    ///
    /// When one of the layer's policies shapes (delays) requests: an interceptor cannot
    /// hold a request, so it would admit them undelayed. When one limits calls in flight,
    /// the layer settles after responses, or it sheds load: an interceptor never sees the
    /// response.
    pub fn interceptor(&self) -> Result<crate::RateLimitInterceptor<C, K>, ConfigError> {
        let _switching = self.switching.lock();
        let made =
            crate::RateLimitInterceptor::new(Arc::clone(&self.limiter), Arc::clone(&self.key));
        if made.is_ok() {
            self.intercepted.store(true, Ordering::Release);
        }
        made
    }
}

impl<S, St, K> Layer<S> for RateLimitLayer<St, K> {
    type Service = RateLimit<S, St, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.limiter), Arc::clone(&self.key))
    }
}
