//! A store that survives its backend: a circuit breaker and an optional local fallback.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::clock::{Clock, MonotonicClock};
use crate::error::ConfigError;
use crate::store::boxed::boxed;
use crate::store::{BoxStoreFuture, Checked, Cost, Operation, Store};
use crate::{Decisions, MemoryStore, Policy, Quota, StoreError, StoreErrorKind};

/// Where a [`CircuitBreaker`] store's circuit breaker stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BreakerState {
    /// The backend answers; every decision goes to it.
    Closed,
    /// The backend failed repeatedly; it is not called until the cool-down ends.
    Open,
    /// The cool-down ended; one probe decision goes to the backend, the rest do not.
    HalfOpen,
}

type Listener = Arc<dyn Fn(BreakerState) + Send + Sync>;

/// Wraps a remote store (Redis) so that its failure costs microseconds, not timeouts.
///
/// Each call goes to the primary store, whose own timeout bounds it. After `threshold`
/// consecutive failures, the breaker **opens**. For the cool-down, the primary is not
/// called at all. Then one probe decision is sent (**half-open**). Its success closes the
/// breaker. Its failure opens it again.
///
/// While the primary cannot answer, a decision comes from the local fallback, if one is
/// configured. The fallback is a memory store that gives this node `share` of each
/// quota: with ten gateways, 0.1. Without a fallback, the decision is the primary's
/// error. The caller turns it into "let through" (fail open) or "reject" (fail closed).
///
/// Every state change is logged with `tracing`, and reported to
/// [`CircuitBreakerBuilder::on_state_change`]. [`CircuitBreaker::state`] reads it at any
/// time.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollway_core::{Algorithm, BreakerState, MemoryStore, Policy, Quota, CircuitBreaker};
///
/// // Any store can be wrapped; in production the primary is a RedisStore.
/// let store = CircuitBreaker::builder(MemoryStore::new())
///     .threshold(3)
///     .cool_down(Duration::from_millis(250))
///     .local_fallback(0.1)
///     .build()?;
/// let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(100)?)?;
/// assert_eq!(store.state(), BreakerState::Closed);
/// # let _ = policy;
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
pub struct CircuitBreaker<S, C = MonotonicClock> {
    inner: Arc<Inner<S, C>>,
}

struct Inner<S, C> {
    primary: S,
    fallback: Option<Fallback<C>>,
    clock: C,
    /// Failures in a row that open the breaker; `None`: no breaker, every decision
    /// calls the primary (a fallback alone).
    threshold: Option<u32>,
    cool_down_us: u64,
    /// The longest cool-down: each failed probe doubles it up to this.
    max_cool_down_us: u64,
    /// The store's name, in the breaker's log lines and its gauge's `store` label.
    name: &'static str,
    breaker: Mutex<Breaker>,
    listener: Option<Listener>,
}

struct Fallback<C> {
    store: MemoryStore<C>,
    share: f64,
    /// Each policy scaled to this node's share, made on first use.
    scaled: Mutex<HashMap<u64, Policy>>,
}

#[derive(Debug)]
struct Breaker {
    state: BreakerState,
    failures: u32,
    open_until_us: u64,
    probing: bool,
    /// The cool-down now: doubled by each failed probe, reset when the store answers.
    cool_down_us: u64,
    /// When the breaker opened after the store last answered, microseconds.
    down_since_us: u64,
    /// When the outage was last logged, and the probes failed since.
    logged_at_us: u64,
    failed_probes: u64,
}

/// What the breaker lets one decision do.
enum Permit {
    /// Go to the primary store (closed).
    Call,
    /// Go to the primary store as the one probe of a half-open breaker.
    Probe,
    /// Not go to the primary store (open, or half-open with its probe under way).
    Skip,
}

impl<S, C> Clone for CircuitBreaker<S, C> {
    fn clone(&self) -> Self {
        CircuitBreaker {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S, C> fmt::Debug for CircuitBreaker<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("breaker", &*self.inner.breaker.lock())
            .field("threshold", &self.inner.threshold)
            .field("cool_down_us", &self.inner.cool_down_us)
            .field(
                "fallback_share",
                &self.inner.fallback.as_ref().map(|f| f.share),
            )
            .finish_non_exhaustive()
    }
}

/// The default breaker: this many failed calls in a row open it...
pub(crate) const DEFAULT_THRESHOLD: u32 = 5;
/// ...for this long, doubled by each failed probe...
pub(crate) const DEFAULT_COOL_DOWN: Duration = Duration::from_millis(250);
/// ...up to this.
pub(crate) const DEFAULT_MAX_COOL_DOWN: Duration = Duration::from_secs(5);
/// How often an outage that lasts is summarised in the log.
const SUMMARY_EVERY_US: u64 = 10_000_000;

impl<S: Store> CircuitBreaker<S, MonotonicClock> {
    /// Wraps `primary`: 5 failures open the breaker for 250 ms; no local fallback.
    pub fn builder(primary: S) -> CircuitBreakerBuilder<S, MonotonicClock> {
        CircuitBreakerBuilder {
            primary,
            clock: MonotonicClock::new(),
            threshold: Some(DEFAULT_THRESHOLD),
            cool_down: DEFAULT_COOL_DOWN,
            max_cool_down: DEFAULT_MAX_COOL_DOWN,
            name: "store",
            share: None,
            listener: None,
        }
    }
}

impl<S: Store, C: Clock + Clone> CircuitBreaker<S, C> {
    /// The breaker's state now.
    #[must_use]
    pub fn state(&self) -> BreakerState {
        self.inner.breaker.lock().state
    }

    /// The wrapped store.
    pub fn primary(&self) -> &S {
        &self.inner.primary
    }
}

impl<S: Send + Sync + 'static, C: Clock + Send + Sync + 'static> CircuitBreaker<S, C> {
    /// A call for the store to make when it knows it can answer again (a Redis store
    /// that found a new primary): an open breaker then lets the next decision probe at
    /// once, not after its cool-down. The call holds the breaker weakly.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn probe_hint(&self) -> impl Fn() + Send + Sync + 'static {
        let inner = Arc::downgrade(&self.inner);
        move || {
            if let Some(inner) = inner.upgrade() {
                let mut b = inner.breaker.lock();
                if b.state == BreakerState::Open {
                    b.open_until_us = inner.clock.now_micros();
                }
            }
        }
    }
}

impl<S, C: Clock> Inner<S, C> {
    /// Moves the breaker to `state`. The log says when the store fails (one `warn`),
    /// summarises every 10 s while it stays down, and says when it answers again; the
    /// probes in between are `debug`.
    fn set(&self, b: &mut Breaker, state: BreakerState) {
        if b.state == state {
            return;
        }
        let (was, now) = (b.state, self.clock.now_micros());
        b.state = state;
        let store = self.name;
        match (was, state) {
            (BreakerState::Closed, BreakerState::Open) => {
                b.down_since_us = now;
                b.logged_at_us = now;
                b.failed_probes = 0;
                tracing::warn!(
                    store,
                    failures = b.failures,
                    "rate limit store failing: breaker open, decisions are local or per the \
                     failure policy until it answers (summarised every {} s)",
                    SUMMARY_EVERY_US / 1_000_000
                );
            }
            (_, BreakerState::Open) => {
                b.failed_probes += 1;
                tracing::debug!(store, cool_down_ms = b.cool_down_us / 1_000, "probe failed");
                if now.saturating_sub(b.logged_at_us) >= SUMMARY_EVERY_US {
                    b.logged_at_us = now;
                    tracing::warn!(
                        store,
                        down_s = (now - b.down_since_us) / 1_000_000,
                        failed_probes = b.failed_probes,
                        "rate limit store still failing: breaker open"
                    );
                }
            }
            (_, BreakerState::HalfOpen) => tracing::debug!(store, "breaker half-open: probing"),
            (_, BreakerState::Closed) => tracing::warn!(
                store,
                down_ms = now.saturating_sub(b.down_since_us) / 1_000,
                failed_probes = b.failed_probes,
                "rate limit store answering again: breaker closed"
            ),
        }
        #[cfg(feature = "metrics")]
        metrics::gauge!(crate::metric::BREAKER_STATE.name, "store" => store).set(match state {
            BreakerState::Closed => 0.0,
            BreakerState::HalfOpen => 1.0,
            BreakerState::Open => 2.0,
        });
        if let Some(listener) = &self.listener {
            listener(state);
        }
    }

    fn permit(&self) -> Permit {
        if self.threshold.is_none() {
            return Permit::Call;
        }
        let mut b = self.breaker.lock();
        match b.state {
            BreakerState::Closed => Permit::Call,
            BreakerState::Open if self.clock.now_micros() >= b.open_until_us => {
                self.set(&mut b, BreakerState::HalfOpen);
                b.probing = true;
                Permit::Probe
            }
            BreakerState::HalfOpen if !b.probing => {
                b.probing = true;
                Permit::Probe
            }
            BreakerState::Open | BreakerState::HalfOpen => Permit::Skip,
        }
    }

    fn record(&self, ok: bool, probe: bool) {
        let Some(threshold) = self.threshold else {
            return;
        };
        let mut b = self.breaker.lock();
        if probe {
            b.probing = false;
        }
        if ok {
            b.failures = 0;
            b.cool_down_us = self.cool_down_us;
            if probe || b.state == BreakerState::HalfOpen {
                self.set(&mut b, BreakerState::Closed);
            }
            return;
        }
        b.failures = b.failures.saturating_add(1);
        if probe || (b.state == BreakerState::Closed && b.failures >= threshold) {
            if probe {
                // The store is still down: wait twice as long before the next probe.
                b.cool_down_us = b.cool_down_us.saturating_mul(2).min(self.max_cool_down_us);
            }
            b.open_until_us = self.clock.now_micros().saturating_add(b.cool_down_us);
            self.set(&mut b, BreakerState::Open);
        }
    }
}

impl<S, C: Clock> Inner<S, C> {
    /// The answer to a decision the primary did not make (it failed with `error`, or
    /// was not called): the fallback's, or `error`.
    fn fall_back(
        &self,
        error: StoreError,
        key: &[u8],
        policies: &[&Policy],
        cost: &Cost,
    ) -> Result<Decisions, StoreError> {
        match &self.fallback {
            Some(fallback) => fallback.decide(key, policies, cost),
            None => Err(error),
        }
    }
}

impl<C: Clock> Fallback<C> {
    fn decide(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: &Cost,
    ) -> Result<Decisions, StoreError> {
        self.on_share(policies, |scaled| match cost {
            Cost::Same(cost) => self.store.decide(key, scaled, *cost),
            Cost::Each(costs) => self.store.decide_each(key, scaled, costs),
        })
    }

    /// A charge or drain, on this node's share of each policy.
    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Result<Decisions, StoreError> {
        self.on_share(policies, |scaled| self.store.apply(key, scaled, operation))
    }

    /// `then` of `policies` scaled to this node's share.
    fn on_share(
        &self,
        policies: &[&Policy],
        then: impl FnOnce(&[&Policy]) -> Decisions,
    ) -> Result<Decisions, StoreError> {
        let scaled = self.scaled(policies)?;
        let scaled: SmallVec<[&Policy; 4]> = scaled.iter().collect();
        Ok(then(&scaled))
    }

    /// `policies` scaled to this node's share, each made once.
    fn scaled(&self, policies: &[&Policy]) -> Result<SmallVec<[Policy; 4]>, StoreError> {
        let scaled: SmallVec<[Policy; 4]> = {
            let mut scaled = self.scaled.lock();
            policies
                .iter()
                .map(|policy| match scaled.get(&policy.id()) {
                    Some(p) => Ok(p.clone()),
                    None => {
                        let p = scale(policy, self.share).map_err(|e| {
                            StoreError::with_source(
                                StoreErrorKind::Other,
                                "cannot scale the policy to this node's share",
                                e,
                            )
                        })?;
                        scaled.insert(policy.id(), p.clone());
                        Ok(p)
                    }
                })
                .collect::<Result<_, StoreError>>()?
        };
        Ok(scaled)
    }
}

/// `policy` with its limit and burst multiplied by `share`, rounded up, at least 1.
fn scale(policy: &Policy, share: f64) -> Result<Policy, ConfigError> {
    let q = policy.quota();
    let part = |n: u64| ((n as f64 * share).ceil() as u64).clamp(1, crate::quota::MAX_UNITS);
    let mut quota = Quota::with_period(part(q.limit()), q.period())?;
    if q.burst() != q.limit() {
        quota = quota.with_burst(part(q.burst()))?;
    }
    Policy::new(policy.name(), policy.algorithm(), quota)
}

impl<S, C> CircuitBreaker<S, C>
where
    S: Store,
    C: Clock + Clone,
{
    /// A request through the breaker: to the primary while it may be called, else (or
    /// when it fails) to the fallback.
    fn decide(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: Cost,
    ) -> Checked<CircuitBreakerFuture> {
        let inner = &self.inner;
        let probe = match inner.permit() {
            Permit::Call => false,
            Permit::Probe => true,
            Permit::Skip => {
                let error = StoreError::new(
                    StoreErrorKind::Other,
                    "rate limit store unavailable: breaker open, not calling it until the cool-down ends",
                );
                return Checked::Ready(inner.fall_back(error, key, policies, &cost));
            }
        };
        let answer = match &cost {
            Cost::Same(cost) => inner.primary.check(key, policies, *cost),
            Cost::Each(costs) => inner.primary.check_each(key, policies, costs),
        };
        match answer {
            // Decided without calling out (the Redis store's deny cache): nothing was
            // learned about the primary's health, so it is not recorded, and a probe
            // is left to the next decision that calls out.
            Checked::Ready(Ok(decisions)) => {
                if probe {
                    inner.breaker.lock().probing = false;
                }
                Checked::Ready(Ok(decisions))
            }
            Checked::Ready(Err(error)) => {
                inner.record(false, probe);
                Checked::Ready(inner.fall_back(error, key, policies, &cost))
            }
            Checked::Pending(call) => {
                let inner = Arc::clone(&self.inner);
                // The request again, for the fallback: copied only when there is one.
                let request = inner.fallback.is_some().then(|| {
                    let policies: SmallVec<[Policy; 4]> =
                        policies.iter().map(|p| (*p).clone()).collect();
                    (key.to_vec(), policies, cost)
                });
                let mut abandoned = AbandonedProbe(probe.then(|| Arc::clone(&inner)));
                Checked::Pending(Box::pin(async move {
                    let answer = call.await;
                    // Answered: `record` settles the probe.
                    abandoned.disarm();
                    inner.record(answer.is_ok(), probe);
                    match (answer, request) {
                        (Err(error), Some((key, policies, cost))) => {
                            tracing::debug!(%error, "rate limit store failed; deciding locally");
                            let policies: SmallVec<[&Policy; 4]> = policies.iter().collect();
                            inner.fall_back(error, &key, &policies, &cost)
                        }
                        (answer, _) => answer,
                    }
                }))
            }
        }
    }
}

/// The boxed future of a [`CircuitBreaker`] decision that waits for the primary.
pub type CircuitBreakerFuture = BoxStoreFuture;

impl<S, C> Store for CircuitBreaker<S, C>
where
    S: Store,
    C: Clock + Clone,
{
    type Future = CircuitBreakerFuture;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future> {
        self.decide(key, policies, Cost::Same(cost))
    }

    fn check_each(&self, key: &[u8], policies: &[&Policy], costs: &[u64]) -> Checked<Self::Future> {
        match Cost::of(policies, costs) {
            Ok(cost) => self.decide(key, policies, cost),
            Err(e) => Checked::Ready(Err(e)),
        }
    }

    /// A peek, refund or reset is an administrator's request. It goes straight to the
    /// primary store, whatever the breaker says. Only the primary can look at or correct
    /// a caller's shared state. Asking it of a dead primary gets its error.
    ///
    /// A charge or drain is part of serving a request, after its response. So is a
    /// refund of slots of calls in flight ([`Algorithm::Concurrency`](crate::Algorithm::Concurrency)
    /// only): a call giving its slots back. These go to the primary while the breaker is
    /// closed. While it is not, they go to the local fallback, if any. So an outage does
    /// not lift a settled budget, and slots taken in the fallback are given back there.
    /// (Slots the primary holds lapse there a lease after their last renewal.) Without a
    /// fallback, they fail at once. What the fallback charged stays local. It is not
    /// replayed to the primary when it answers again.
    ///
    /// The outcome does not move the breaker.
    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        let serving = match operation {
            Operation::Charge(_) | Operation::Drain(_) => true,
            Operation::Refund(_) => policies
                .iter()
                .all(|p| p.algorithm() == crate::Algorithm::Concurrency),
            Operation::Peek(_) | Operation::Reset => false,
        };
        if serving && self.state() != BreakerState::Closed {
            return Checked::Ready(match &self.inner.fallback {
                Some(fallback) => fallback.operate(key, policies, operation),
                None => Err(StoreError::new(
                    StoreErrorKind::Other,
                    "rate limit store unavailable: breaker open, the charge is not sent",
                )),
            });
        }
        boxed(self.inner.primary.operate(key, policies, operation))
    }

    fn supports(&self, policy: &Policy) -> Result<(), ConfigError> {
        self.inner.primary.supports(policy)
    }

    /// The fallback decides each cost too: it is a memory store.
    fn supports_each_cost(&self) -> Result<(), ConfigError> {
        self.inner.primary.supports_each_cost()
    }

    /// Lends through the primary while the breaker is closed. Otherwise `None`: the
    /// request is then checked as usual, and probes or falls back.
    ///
    /// A loan that fails counts as a failure. Its request is decided by the fallback, if
    /// any, as a grant of its own cost.
    fn lend(
        &self,
        key: &[u8],
        policies: &[&Policy],
        cost: u64,
        ask: u64,
    ) -> Option<super::LendFuture> {
        if self.state() != BreakerState::Closed {
            return None;
        }
        let call = self.inner.primary.lend(key, policies, cost, ask)?;
        let inner = Arc::clone(&self.inner);
        let request = inner.fallback.is_some().then(|| {
            let policies: SmallVec<[Policy; 4]> = policies.iter().map(|p| (*p).clone()).collect();
            (key.to_vec(), policies)
        });
        Some(Box::pin(async move {
            let answer = call.await;
            inner.record(answer.is_ok(), false);
            match (answer, request) {
                (Err(error), Some((key, policies))) => {
                    tracing::debug!(%error, "rate limit store failed a loan; deciding locally");
                    let policies: SmallVec<[&Policy; 4]> = policies.iter().collect();
                    let decisions = inner.fall_back(error, &key, &policies, &Cost::Same(cost))?;
                    Ok(super::Grant::new(cost, decisions, 0))
                }
                (answer, _) => answer,
            }
        }))
    }

    /// Gives back through the primary while the breaker is closed; else `None`: the
    /// units go bad with their windows. The outcome does not move the breaker.
    fn give_back(
        &self,
        key: &[u8],
        policies: &[&Policy],
        units: u64,
        ends: &[u64],
    ) -> Option<super::GiveBackFuture> {
        if self.state() != BreakerState::Closed {
            return None;
        }
        self.inner.primary.give_back(key, policies, units, ends)
    }

    /// Asks the primary while the breaker is closed; a failure counts. There is no
    /// fallback: a share is the fleet's, or none.
    fn share(
        &self,
        key: &[u8],
        policy: &Policy,
        ask: &super::ShareAsk,
    ) -> Option<super::ShareFuture> {
        if self.state() != BreakerState::Closed {
            return None;
        }
        let call = self.inner.primary.share(key, policy, ask)?;
        let inner = Arc::clone(&self.inner);
        Some(Box::pin(async move {
            let answer = call.await;
            inner.record(answer.is_ok(), false);
            answer
        }))
    }
}

/// Ends a probe whose future is dropped before it answers.
///
/// Its caller gave up: a client disconnected, or an outer timeout fired. The next call
/// then probes instead. Without this, the breaker would stay half-open, skipping the
/// primary, for good.
struct AbandonedProbe<S, C>(Option<Arc<Inner<S, C>>>);

impl<S, C> AbandonedProbe<S, C> {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl<S, C> Drop for AbandonedProbe<S, C> {
    fn drop(&mut self) {
        if let Some(inner) = &self.0 {
            inner.breaker.lock().probing = false;
        }
    }
}

/// Builds a [`CircuitBreaker`] store.
#[must_use]
pub struct CircuitBreakerBuilder<S, C> {
    primary: S,
    clock: C,
    threshold: Option<u32>,
    cool_down: Duration,
    max_cool_down: Duration,
    name: &'static str,
    share: Option<f64>,
    listener: Option<Listener>,
}

impl<S, C> fmt::Debug for CircuitBreakerBuilder<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreakerBuilder")
            .field("threshold", &self.threshold)
            .field("cool_down", &self.cool_down)
            .field("share", &self.share)
            .finish_non_exhaustive()
    }
}

impl<S: Store, C: Clock + Clone> CircuitBreakerBuilder<S, C> {
    /// Consecutive failures that open the breaker (default 5).
    pub fn threshold(mut self, failures: u32) -> Self {
        self.threshold = Some(failures);
        self
    }

    /// How long an open breaker keeps calls away from the primary (default 250 ms).
    /// Each failed probe doubles it, up to [`max_cool_down`](Self::max_cool_down); the
    /// primary's next answer resets it.
    pub fn cool_down(mut self, cool_down: Duration) -> Self {
        self.cool_down = cool_down;
        self
    }

    /// The longest cool-down that failed probes double it to (default 5 s; never below
    /// the cool-down itself).
    pub fn max_cool_down(mut self, max: Duration) -> Self {
        self.max_cool_down = max;
        self
    }

    /// The store's name in the breaker's log lines and the `store` label of its
    /// `tollway_breaker_state` gauge (default `store`; a Redis store's is its kind,
    /// `redis`, `redis_cluster` or `redis_pool`).
    pub fn name(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }

    /// No breaker: every decision calls the primary, and only its failures go to the
    /// fallback (the Redis store's `without_breaker()` with a fallback).
    #[cfg(feature = "redis")]
    pub(crate) fn without_breaker(mut self) -> Self {
        self.threshold = None;
        self
    }

    /// Decides locally while the primary cannot, giving this node `share` (0 to 1] of
    /// every quota: with ten gateways sharing a limit, 0.1.
    pub fn local_fallback(mut self, share: f64) -> Self {
        self.share = Some(share);
        self
    }

    /// Called with every new breaker state (after it is logged).
    pub fn on_state_change(
        mut self,
        listener: impl Fn(BreakerState) + Send + Sync + 'static,
    ) -> Self {
        self.listener = Some(Arc::new(listener));
        self
    }

    /// Reads time from `clock` (the breaker's cool-down and the fallback's limits).
    pub fn clock<D: Clock + Clone>(self, clock: D) -> CircuitBreakerBuilder<S, D> {
        CircuitBreakerBuilder {
            primary: self.primary,
            clock,
            threshold: self.threshold,
            cool_down: self.cool_down,
            max_cool_down: self.max_cool_down,
            name: self.name,
            share: self.share,
            listener: self.listener,
        }
    }

    /// Builds the store.
    ///
    /// # Errors
    ///
    /// When the threshold is zero, or the share is not in (0, 1].
    pub fn build(self) -> Result<CircuitBreaker<S, C>, ConfigError> {
        if let Some(threshold) = self.threshold {
            check_threshold(threshold)?;
        }
        let fallback = match self.share {
            None => None,
            Some(share) => Some(Fallback {
                store: MemoryStore::builder().clock(self.clock.clone()).build()?,
                share: check_share(share)?,
                scaled: Mutex::default(),
            }),
        };
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let cool_down_us = micros(self.cool_down);
        Ok(CircuitBreaker {
            inner: Arc::new(Inner {
                primary: self.primary,
                fallback,
                cool_down_us,
                max_cool_down_us: micros(self.max_cool_down).max(cool_down_us),
                name: self.name,
                clock: self.clock,
                threshold: self.threshold,
                breaker: Mutex::new(Breaker {
                    state: BreakerState::Closed,
                    failures: 0,
                    open_until_us: 0,
                    probing: false,
                    cool_down_us,
                    down_since_us: 0,
                    logged_at_us: 0,
                    failed_probes: 0,
                }),
                listener: self.listener,
            }),
        })
    }
}

/// A breaker's threshold: at least one failure.
pub(crate) fn check_threshold(failures: u32) -> Result<u32, ConfigError> {
    if failures == 0 {
        return Err(ConfigError::new(
            "breaker threshold must be at least 1 failure: 0 would never call the store",
        ));
    }
    Ok(failures)
}

/// A local fallback's share of each quota: more than 0, at most 1.
pub(crate) fn check_share(share: f64) -> Result<f64, ConfigError> {
    if share > 0.0 && share <= 1.0 {
        return Ok(share);
    }
    Err(ConfigError::new(format!(
        "local fallback share must be more than 0 and at most 1 (got {share}): with N \
         gateways sharing a limit, use 1/N"
    )))
}

#[cfg(test)]
mod tests;
