//! A store that survives its backend: a circuit breaker and an optional local fallback.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use smallvec::SmallVec;

use super::boxed::boxed;
use super::{BoxStoreFuture, Checked, Operation, Store};
use crate::clock::{Clock, MonotonicClock};
use crate::error::ConfigError;
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
/// consecutive failures the breaker **opens**: for the cool-down the primary is not
/// called at all, then one probe decision is sent (**half-open**); its success closes the
/// breaker, its failure opens it again. While the primary cannot answer, a decision comes
/// from the local fallback if one is configured — a memory store that gives this node
/// `share` of each quota (with ten gateways, 0.1) — or else is the primary's error, which
/// the caller turns into "let through" (fail open) or "reject" (fail closed). Every state
/// change is logged with `tracing` and reported to [`CircuitBreakerBuilder::on_state_change`];
/// [`CircuitBreaker::state`] reads it at any time.
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
        metrics::gauge!("tollway_breaker_state", "store" => store).set(match state {
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
        cost: u32,
    ) -> Result<Decisions, StoreError> {
        match &self.fallback {
            Some(fallback) => fallback.decide(key, policies, cost),
            None => Err(error),
        }
    }
}

impl<C: Clock> Fallback<C> {
    fn decide(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Result<Decisions, StoreError> {
        self.on_share(policies, |scaled| self.store.decide(key, scaled, cost))
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
    let part = |n: u64| ((n as f64 * share).ceil() as u64).clamp(1, u64::from(u32::MAX)) as u32;
    let mut quota = Quota::with_period(part(q.limit()), q.period())?;
    if q.burst() != q.limit() {
        quota = quota.with_burst(part(q.burst()))?;
    }
    Policy::new(policy.name(), policy.algorithm(), quota)
}

/// The boxed future of a [`CircuitBreaker`] decision that waits for the primary.
pub type CircuitBreakerFuture = BoxStoreFuture;

impl<S, C> Store for CircuitBreaker<S, C>
where
    S: Store,
    C: Clock + Clone,
{
    type Future = CircuitBreakerFuture;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Checked<Self::Future> {
        let inner = &self.inner;
        let probe = match inner.permit() {
            Permit::Call => false,
            Permit::Probe => true,
            Permit::Skip => {
                let error = StoreError::new(
                    StoreErrorKind::Other,
                    "rate limit store unavailable: breaker open, not calling it until the cool-down ends",
                );
                return Checked::Ready(inner.fall_back(error, key, policies, cost));
            }
        };
        match inner.primary.check(key, policies, cost) {
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
                Checked::Ready(inner.fall_back(error, key, policies, cost))
            }
            Checked::Pending(call) => {
                let inner = Arc::clone(&self.inner);
                // The request again, for the fallback: copied only when there is one.
                let request = inner.fallback.is_some().then(|| {
                    let policies: SmallVec<[Policy; 4]> =
                        policies.iter().map(|p| (*p).clone()).collect();
                    (key.to_vec(), policies)
                });
                let mut abandoned = AbandonedProbe(probe.then(|| Arc::clone(&inner)));
                Checked::Pending(Box::pin(async move {
                    let answer = call.await;
                    // Answered: `record` settles the probe.
                    abandoned.disarm();
                    inner.record(answer.is_ok(), probe);
                    match (answer, request) {
                        (Err(error), Some((key, policies))) => {
                            tracing::debug!(%error, "rate limit store failed; deciding locally");
                            let policies: SmallVec<[&Policy; 4]> = policies.iter().collect();
                            inner.fall_back(error, &key, &policies, cost)
                        }
                        (answer, _) => answer,
                    }
                }))
            }
        }
    }

    /// A peek, refund or reset goes straight to the primary store whatever the breaker
    /// says (an administrator's request): looking at or correcting a caller's shared
    /// state is something only the primary can do, and asking it of a dead primary gets
    /// its error. A charge or drain — part of serving a request, after its response —
    /// goes to the primary while the breaker is closed, and to the local fallback (if
    /// any) while it is not, so an outage does not lift a `charge_after` budget; without
    /// a fallback it fails at once. What the fallback charged stays local: it is not
    /// replayed to the primary when it answers again. The outcome does not move the
    /// breaker.
    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        if matches!(operation, Operation::Charge(_) | Operation::Drain(_))
            && self.state() != BreakerState::Closed
        {
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
}

/// Ends a probe whose future is dropped before it answers (its caller gave up: a client
/// disconnected, an outer timeout fired), so that the next call probes instead; without
/// it the breaker would stay half-open, skipping the primary, for good.
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
mod tests {
    use std::future::{IntoFuture, Ready, ready};
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    use super::*;
    use crate::{Algorithm, ManualClock};

    /// A store that fails while told to, and counts its calls.
    #[derive(Clone, Default)]
    struct Flaky {
        down: Arc<AtomicBool>,
        calls: Arc<AtomicU32>,
    }

    /// It answers through a future, as a store that calls out does.
    impl Store for Flaky {
        type Future = Ready<Result<Decisions, StoreError>>;
        fn check(&self, _: &[u8], policies: &[&Policy], _: u32) -> Checked<Self::Future> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                Checked::Pending(ready(Err(StoreError::new(
                    StoreErrorKind::Connection,
                    "down",
                ))))
            } else {
                let allowed = policies.iter().map(|p| {
                    let limit = p.quota().burst();
                    crate::Decision::allow(limit, limit, 0, 0)
                });
                Checked::Pending(ready(Ok(allowed.collect())))
            }
        }
        fn operate(&self, key: &[u8], policies: &[&Policy], _: Operation) -> Checked<Self::Future> {
            self.check(key, policies, 0)
        }
    }

    fn poll<F: Future>(f: F) -> F::Output {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut f = std::pin::pin!(f);
        match f.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(v) => v,
            std::task::Poll::Pending => panic!("the test stores answer at once"),
        }
    }

    #[test]
    fn the_breaker_opens_skips_the_store_probes_and_closes() {
        let clock = ManualClock::new();
        let flaky = Flaky::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let store = CircuitBreaker::builder(flaky.clone())
            .threshold(3)
            .cool_down(Duration::from_millis(100))
            .on_state_change(move |s| log.lock().push(s))
            .clock(clock.clone())
            .build()
            .unwrap();
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(10).unwrap()).unwrap();
        flaky.down.store(true, Ordering::SeqCst);
        for _ in 0..3 {
            assert!(poll(store.check(b"k", &[&policy], 1).into_future()).is_err());
        }
        assert_eq!(store.state(), BreakerState::Open);
        // Open: the store is not called at all.
        for _ in 0..100 {
            assert!(poll(store.check(b"k", &[&policy], 1).into_future()).is_err());
        }
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 3);
        // An operation goes to the store all the same, and does not move the breaker —
        // but a charge (serving requests) is not sent while it is open (with no
        // fallback, it fails).
        let peek = store.operate(b"k", &[&policy], Operation::Peek(1));
        assert!(poll(peek.into_future()).is_err());
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 4);
        let charge = store.operate(b"k", &[&policy], Operation::Charge(5));
        assert!(poll(charge.into_future()).is_err());
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 4);
        flaky.calls.store(3, Ordering::SeqCst);
        // After the cool-down one probe goes through; it fails, so open again.
        clock.advance(Duration::from_millis(100));
        assert!(poll(store.check(b"k", &[&policy], 1).into_future()).is_err());
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 4);
        assert_eq!(store.state(), BreakerState::Open);
        // The store recovers; the next probe, after the doubled cool-down, closes it.
        flaky.down.store(false, Ordering::SeqCst);
        clock.advance(Duration::from_millis(100));
        assert!(poll(store.check(b"k", &[&policy], 1).into_future()).is_err());
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 4);
        clock.advance(Duration::from_millis(100));
        assert!(poll(store.check(b"k", &[&policy], 1).into_future()).is_ok());
        assert_eq!(store.state(), BreakerState::Closed);
        assert_eq!(
            *seen.lock(),
            [
                BreakerState::Open,
                BreakerState::HalfOpen,
                BreakerState::Open,
                BreakerState::HalfOpen,
                BreakerState::Closed
            ]
        );
    }

    #[test]
    fn the_local_fallback_gives_this_node_its_share() {
        let clock = ManualClock::new();
        let flaky = Flaky::default();
        flaky.down.store(true, Ordering::SeqCst);
        let store = CircuitBreaker::builder(flaky)
            .local_fallback(0.25)
            .clock(clock)
            .build()
            .unwrap();
        let policy =
            Policy::new("p", Algorithm::TokenBucket, Quota::per_minute(100).unwrap()).unwrap();
        let admitted = (0..100)
            .filter(|_| {
                poll(store.check(b"k", &[&policy], 1).into_future()).is_ok_and(|d| d.is_allowed())
            })
            .count();
        assert_eq!(admitted, 25);
    }

    // A primary that answers without waiting keeps answering so through the breaker:
    // wrapping a store must not cost its fast path.
    #[test]
    fn a_ready_answer_stays_ready_through_the_breaker() {
        let store = CircuitBreaker::builder(MemoryStore::new()).build().unwrap();
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(1).unwrap()).unwrap();
        match store.check(b"k", &[&policy], 1) {
            Checked::Ready(Ok(decisions)) => assert!(decisions.is_allowed()),
            Checked::Ready(Err(error)) => panic!("the memory store failed: {error}"),
            Checked::Pending(_) => panic!("a decision the memory store made at once waits"),
        }
    }

    /// A store that, while told to, never answers: its calls wait like a stalled Redis's.
    #[derive(Clone, Default)]
    struct Stalled {
        flaky: Flaky,
        stalled: Arc<AtomicBool>,
    }

    impl Store for Stalled {
        type Future = BoxStoreFuture;
        fn check(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Checked<Self::Future> {
            if self.stalled.load(Ordering::SeqCst) {
                self.flaky.calls.fetch_add(1, Ordering::SeqCst);
                return Checked::Pending(Box::pin(std::future::pending()));
            }
            boxed(self.flaky.check(key, policies, cost))
        }
        fn operate(
            &self,
            key: &[u8],
            policies: &[&Policy],
            op: Operation,
        ) -> Checked<Self::Future> {
            boxed(self.flaky.operate(key, policies, op))
        }
    }

    // While the probe waits for a stalled store, every other decision is the fallback's,
    // at once: only the probe's caller waits for the store.
    #[test]
    fn half_open_sends_one_probe_and_answers_the_rest_at_once() {
        let clock = ManualClock::new();
        let store = Stalled::default();
        let breaker = CircuitBreaker::builder(store.clone())
            .threshold(1)
            .local_fallback(1.0)
            .clock(clock.clone())
            .build()
            .unwrap();
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(1_000).unwrap()).unwrap();
        store.flaky.down.store(true, Ordering::SeqCst);
        assert!(poll(breaker.check(b"k", &[&policy], 1).into_future()).is_ok());
        assert_eq!(breaker.state(), BreakerState::Open);
        store.stalled.store(true, Ordering::SeqCst);
        clock.advance(DEFAULT_COOL_DOWN);
        let probe = breaker.check(b"k", &[&policy], 1);
        assert!(
            matches!(probe, Checked::Pending(_)),
            "the probe calls the store"
        );
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        for _ in 0..100 {
            match breaker.check(b"k", &[&policy], 1) {
                Checked::Ready(answer) => assert!(answer.is_ok_and(|d| d.is_allowed())),
                Checked::Pending(_) => panic!("a second call waits for the stalled store"),
            }
        }
        assert_eq!(
            store.flaky.calls.load(Ordering::SeqCst),
            2,
            "one failure, one probe"
        );
        drop(probe);
    }

    // Regression: the cool-down was fixed, so a dead store was probed (and a caller made
    // to wait for the probe's timeout) every 350 ms for as long as it was down. Each
    // failed probe now doubles it, up to the cap; an answer brings it back to the start.
    #[test]
    fn the_cool_down_doubles_while_probes_fail_up_to_a_cap_and_resets_on_success() {
        let clock = ManualClock::new();
        let flaky = Flaky::default();
        let store = CircuitBreaker::builder(flaky.clone())
            .threshold(1)
            .cool_down(Duration::from_millis(100))
            .max_cool_down(Duration::from_millis(1_000))
            .clock(clock.clone())
            .build()
            .unwrap();
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(10).unwrap()).unwrap();
        let check = || {
            let _ = poll(store.check(b"k", &[&policy], 1).into_future());
        };
        // How long, in ms stepped, until the store is called again.
        let next_probe = || {
            let before = flaky.calls.load(Ordering::SeqCst);
            let mut waited = 0;
            while flaky.calls.load(Ordering::SeqCst) == before {
                assert!(waited < 10_000, "no probe in 10 s");
                clock.advance(Duration::from_millis(1));
                waited += 1;
                check();
            }
            waited
        };
        flaky.down.store(true, Ordering::SeqCst);
        check();
        assert_eq!(store.state(), BreakerState::Open);
        let waits: Vec<u64> = (0..6).map(|_| next_probe()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1_000, 1_000]);
        flaky.down.store(false, Ordering::SeqCst);
        assert_eq!(next_probe(), 1_000);
        assert_eq!(store.state(), BreakerState::Closed);
        flaky.down.store(true, Ordering::SeqCst);
        check();
        assert_eq!(store.state(), BreakerState::Open);
        assert_eq!(
            next_probe(),
            100,
            "the next outage starts from the cool-down again"
        );
    }

    // Regression: charges after a response (an LLM's tokens) failed while the breaker was
    // open, so an outage lifted the budget: a caller spent 400 times its tokens in one
    // stall. They are charged to the local fallback now, which then refuses the caller.
    #[test]
    fn charges_while_the_breaker_is_open_reach_the_fallback() {
        let clock = ManualClock::new();
        let flaky = Flaky::default();
        let store = CircuitBreaker::builder(flaky.clone())
            .threshold(1)
            .local_fallback(1.0)
            .clock(clock)
            .build()
            .unwrap();
        let tokens = Policy::new(
            "t",
            Algorithm::TokenBucket,
            Quota::per_minute(1_000).unwrap(),
        )
        .unwrap();
        flaky.down.store(true, Ordering::SeqCst);
        let first = poll(store.check(b"k", &[&tokens], 0).into_future()).unwrap();
        assert!(first.is_allowed());
        assert_eq!(store.state(), BreakerState::Open);
        let calls = flaky.calls.load(Ordering::SeqCst);
        let charged = store.operate(b"k", &[&tokens], Operation::Charge(900));
        let charged = poll(charged.into_future()).unwrap();
        assert_eq!(charged[0].remaining(), 100);
        assert_eq!(
            flaky.calls.load(Ordering::SeqCst),
            calls,
            "not sent to the store"
        );
        // The fallback remembers: 200 more tokens do not fit.
        let next = poll(store.check(b"k", &[&tokens], 200).into_future()).unwrap();
        assert!(!next.is_allowed());
    }

    // Regression: a dead store logged an open/half-open pair every 350 ms for as long as
    // it was down. Now: one warning when it fails, one summary every 10 s while it stays
    // down, one line when it answers again, each naming the store.
    #[test]
    fn an_outage_is_logged_when_it_starts_every_10_s_and_when_it_ends() {
        let lines = crate::test_log::Lines::of("store");
        let clock = ManualClock::new();
        let flaky = Flaky::default();
        let store = CircuitBreaker::builder(flaky.clone())
            .threshold(1)
            .name("sessions")
            .clock(clock.clone())
            .build()
            .unwrap();
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(10).unwrap()).unwrap();
        tracing::subscriber::with_default(lines.clone(), || {
            flaky.down.store(true, Ordering::SeqCst);
            // 25 s down, a request every 10 ms.
            for _ in 0..2_500 {
                let _ = poll(store.check(b"k", &[&policy], 1).into_future());
                clock.advance(Duration::from_millis(10));
            }
            flaky.down.store(false, Ordering::SeqCst);
            while store.state() != BreakerState::Closed {
                let _ = poll(store.check(b"k", &[&policy], 1).into_future());
                clock.advance(Duration::from_millis(10));
            }
        });
        let warn = (tracing::Level::WARN, "sessions".to_owned());
        assert_eq!(
            *lines.seen.lock(),
            [warn.clone(), warn.clone(), warn.clone(), warn]
        );
    }

    #[test]
    fn bad_settings_fail_when_built() {
        assert!(
            CircuitBreaker::builder(Flaky::default())
                .threshold(0)
                .build()
                .is_err()
        );
        assert!(
            CircuitBreaker::builder(Flaky::default())
                .local_fallback(0.0)
                .build()
                .is_err()
        );
        assert!(
            CircuitBreaker::builder(Flaky::default())
                .local_fallback(1.5)
                .build()
                .is_err()
        );
    }
}
