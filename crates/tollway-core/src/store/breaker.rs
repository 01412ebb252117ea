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
/// ...for this long.
pub(crate) const DEFAULT_COOL_DOWN: Duration = Duration::from_millis(250);

impl<S: Store> CircuitBreaker<S, MonotonicClock> {
    /// Wraps `primary`: 5 failures open the breaker for 250 ms; no local fallback.
    pub fn builder(primary: S) -> CircuitBreakerBuilder<S, MonotonicClock> {
        CircuitBreakerBuilder {
            primary,
            clock: MonotonicClock::new(),
            threshold: Some(DEFAULT_THRESHOLD),
            cool_down: DEFAULT_COOL_DOWN,
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
    fn set(&self, breaker: &mut Breaker, state: BreakerState) {
        if breaker.state == state {
            return;
        }
        breaker.state = state;
        match state {
            BreakerState::Open => tracing::warn!(
                failures = breaker.failures,
                cool_down_ms = self.cool_down_us / 1_000,
                "rate limit store failing: breaker open, decisions are local or per the failure policy"
            ),
            BreakerState::HalfOpen => {
                tracing::info!("rate limit store breaker half-open: probing the store")
            }
            BreakerState::Closed => {
                tracing::info!("rate limit store answering again: breaker closed")
            }
        }
        #[cfg(feature = "metrics")]
        metrics::gauge!("tollway_breaker_state").set(match state {
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
            if probe || b.state == BreakerState::HalfOpen {
                self.set(&mut b, BreakerState::Closed);
            }
            return;
        }
        b.failures = b.failures.saturating_add(1);
        if probe || (b.state == BreakerState::Closed && b.failures >= threshold) {
            b.open_until_us = self.clock.now_micros() + self.cool_down_us;
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
        let scaled: SmallVec<[&Policy; 4]> = scaled.iter().collect();
        Ok(self.store.decide(key, &scaled, cost))
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

    /// Straight to the primary store, never to the fallback: looking at or correcting a
    /// caller's shared state is something only the primary can do, and asking it of a
    /// dead primary gets its error. A peek, refund or reset goes whatever the breaker
    /// says (an administrator's request); a charge — part of serving a request, after
    /// its response — is not sent while the breaker is not closed, and fails at once.
    /// The outcome does not move the breaker.
    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        if matches!(operation, Operation::Charge(_) | Operation::Drain(_))
            && self.state() != BreakerState::Closed
        {
            return Checked::Ready(Err(StoreError::new(
                StoreErrorKind::Other,
                "rate limit store unavailable: breaker open, the charge is not sent",
            )));
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
    pub fn cool_down(mut self, cool_down: Duration) -> Self {
        self.cool_down = cool_down;
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
        Ok(CircuitBreaker {
            inner: Arc::new(Inner {
                primary: self.primary,
                fallback,
                cool_down_us: u64::try_from(self.cool_down.as_micros()).unwrap_or(u64::MAX),
                clock: self.clock,
                threshold: self.threshold,
                breaker: Mutex::new(Breaker {
                    state: BreakerState::Closed,
                    failures: 0,
                    open_until_us: 0,
                    probing: false,
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
        // but a charge (serving requests) is not sent while it is open.
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
        // The store recovers; the next probe closes the breaker.
        flaky.down.store(false, Ordering::SeqCst);
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
