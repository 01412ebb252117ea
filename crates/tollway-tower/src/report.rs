//! What the layer says about its decisions: a `tracing` event for each, metrics (feature
//! `metrics`), a [`DecisionListener`] of your own, and warnings about a failing store
//! that summarise instead of repeating.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tollway_core::Clock;

use crate::key::Key;
use crate::verdict::Verdict;

/// How the layer disposed of a request: the `outcome` label of the
/// `tollway_decisions_total` metric, the debug event's `outcome` field, and what a
/// [`DecisionListener`] is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DecisionOutcome {
    /// Every limit allowed it.
    Allowed,
    /// A limit refused it for now: a 429 with `Retry-After`.
    Limited,
    /// It costs more than a limit's capacity: refused, and no wait would help.
    CostExceedsCapacity,
    /// The store could not track a new caller (see the memory store's `WhenFull`).
    StoreFull,
    /// A limit in shadow mode would have refused it; it went through.
    ShadowLimited,
    /// The store failed; the request was answered per [`OnStoreError`](crate::OnStoreError).
    StoreError,
    /// The caller's tier lookup failed, and [`OnLookupError::Reject`](crate::OnLookupError::Reject)
    /// refused it with 503.
    LookupFailed,
    /// The caller is on the allow list: not limited.
    AllowListed,
    /// The caller is on the deny list: refused with 403 / `PERMISSION_DENIED`.
    DenyListed,
    /// No key was found for the request, and [`MissingKey`](crate::MissingKey) refused it.
    // The last: the metrics keep a counter an outcome, up to this one.
    NoKey,
}

impl DecisionOutcome {
    /// The outcome as a metric label: `allowed`, `limited`, `cost_exceeds_capacity`,
    /// `store_full`, `shadow_limited`, `store_error`, `lookup_failed`, `allow_listed`,
    /// `deny_listed`, `no_key`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            DecisionOutcome::Allowed => "allowed",
            DecisionOutcome::Limited => "limited",
            DecisionOutcome::CostExceedsCapacity => "cost_exceeds_capacity",
            DecisionOutcome::StoreFull => "store_full",
            DecisionOutcome::ShadowLimited => "shadow_limited",
            DecisionOutcome::StoreError => "store_error",
            DecisionOutcome::LookupFailed => "lookup_failed",
            DecisionOutcome::AllowListed => "allow_listed",
            DecisionOutcome::DenyListed => "deny_listed",
            DecisionOutcome::NoKey => "no_key",
        }
    }

    /// The outcome of a request the store decided: `allowed` when all of its limits
    /// allowed it, else what the reported (most restrictive) denial says.
    pub(crate) fn of(verdict: &Verdict<'_>, allowed: bool) -> Self {
        if allowed {
            return DecisionOutcome::Allowed;
        }
        match verdict.decision.denial() {
            Some(tollway_core::Denial::CostExceedsCapacity) => DecisionOutcome::CostExceedsCapacity,
            Some(tollway_core::Denial::StoreFull) => DecisionOutcome::StoreFull,
            _ => DecisionOutcome::Limited,
        }
    }
}

impl fmt::Display for DecisionOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One decision of the layer, as a [`DecisionListener`] sees it.
#[derive(Debug)]
pub struct DecisionEvent<'a> {
    key: Option<&'a Key>,
    outcome: DecisionOutcome,
    verdicts: &'a [Verdict<'a>],
    reported: Option<usize>,
}

impl<'a> DecisionEvent<'a> {
    pub(crate) fn new(
        key: Option<&'a Key>,
        outcome: DecisionOutcome,
        verdicts: &'a [Verdict<'a>],
        reported: Option<usize>,
    ) -> Self {
        DecisionEvent {
            key,
            outcome,
            verdicts,
            reported,
        }
    }

    /// The caller's key; `None` when the request had none.
    #[must_use]
    pub fn key(&self) -> Option<&Key> {
        self.key
    }

    /// How the request was disposed of.
    #[must_use]
    pub fn outcome(&self) -> DecisionOutcome {
        self.outcome
    }

    /// The decision the response reports (the most restrictive of the request's limits),
    /// with its policy; `None` when no limit decided (a list, a store failure, no key).
    #[must_use]
    pub fn verdict(&self) -> Option<&Verdict<'a>> {
        self.reported.map(|i| &self.verdicts[i])
    }

    /// Every limit's decision, the caller's own first; empty when no limit decided.
    #[must_use]
    pub fn verdicts(&self) -> &[Verdict<'a>] {
        self.verdicts
    }
}

/// Hears every decision of a layer: to report it somewhere the layer does not (an audit
/// log, a billing system, your own metrics).
///
/// Called once per decision, on the request's task, before the response is sent: keep
/// it quick, and hand slow work to a channel. A request makes one decision, except one
/// that a policy in shadow mode would have refused while others enforce: it is told as
/// `shadow_limited`, then as the enforcing policies decided it. Implemented by closures
/// `Fn(&DecisionEvent<'_>)`.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use tollway_tower::{Algorithm, DecisionEvent, DecisionOutcome, MemoryStore, Policy, Quota, RateLimitLayer};
///
/// let refused = Arc::new(AtomicU64::new(0));
/// let count = Arc::clone(&refused);
/// let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(10)?)?;
/// let layer = RateLimitLayer::builder(MemoryStore::new(), policy)
///     .on_decision(move |event: &DecisionEvent<'_>| {
///         if event.outcome() == DecisionOutcome::Limited {
///             count.fetch_add(1, Ordering::Relaxed);
///         }
///     })
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), tollway_core::ConfigError>(())
/// ```
pub trait DecisionListener: Send + Sync + 'static {
    /// Hears one decision.
    fn on_decision(&self, event: &DecisionEvent<'_>);
}

impl<F> DecisionListener for F
where
    F: Fn(&DecisionEvent<'_>) + Send + Sync + 'static,
{
    fn on_decision(&self, event: &DecisionEvent<'_>) {
        self(event);
    }
}

/// Tells every decision: the debug event, the metric (feature `metrics`), the listener.
pub(crate) struct Reporter {
    listener: Option<Arc<dyn DecisionListener>>,
    #[cfg(feature = "metrics")]
    counters: Counters,
}

impl Reporter {
    /// A reporter for a layer whose policies are `policies`.
    pub(crate) fn new(
        listener: Option<Arc<dyn DecisionListener>>,
        policies: &[tollway_core::Policy],
    ) -> Self {
        #[cfg(feature = "metrics")]
        tollway_core::metric::describe();
        #[cfg(not(feature = "metrics"))]
        let _ = policies;
        Reporter {
            listener,
            #[cfg(feature = "metrics")]
            counters: Counters::new(policies),
        }
    }

    /// Whether a decision must be told: to a listener, to metrics, or to a subscriber
    /// listening at debug level.
    #[inline]
    pub(crate) fn active(&self) -> bool {
        self.listener.is_some()
            || cfg!(feature = "metrics")
            || tracing::enabled!(tracing::Level::DEBUG)
    }

    /// Tells `event`, whose reported verdict (if any) is of the layer's policy at
    /// `policy`.
    pub(crate) fn report(&self, event: &DecisionEvent<'_>, policy: Option<usize>) {
        #[cfg(feature = "metrics")]
        self.counters.get(policy, event.outcome).increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = policy;
        let verdict = event.verdict();
        tracing::debug!(
            policy = verdict.map(|v| v.policy.name()),
            outcome = event.outcome.as_str(),
            remaining = verdict.map(|v| v.decision.remaining()),
            retry_after_ms = verdict
                .and_then(|v| v.decision.retry_after())
                .map(|wait| wait.as_millis()),
            "rate limit decision"
        );
        if let Some(listener) = &self.listener {
            listener.on_decision(event);
        }
    }
}

impl fmt::Debug for Reporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reporter")
            .field("listener", &self.listener.is_some())
            .finish_non_exhaustive()
    }
}

/// How many [`DecisionOutcome`]s there are: `NoKey` is the last.
#[cfg(feature = "metrics")]
const OUTCOMES: usize = DecisionOutcome::NoKey as usize + 1;

/// `tollway_decisions_total`, one counter a policy and outcome, registered with the
/// recorder on first use and kept: a request then costs an increment, not a lookup of
/// its labels. A counter is bound to the recorder installed when the layer first counts
/// its policy and outcome, so install the recorder before serving.
#[cfg(feature = "metrics")]
struct Counters {
    names: Box<[String]>,
    by_policy: Box<[[std::sync::OnceLock<metrics::Counter>; OUTCOMES]]>,
    /// Outcomes no policy decided (lists, store failures, no key).
    unlabelled: [std::sync::OnceLock<metrics::Counter>; OUTCOMES],
}

#[cfg(feature = "metrics")]
impl Counters {
    fn new(policies: &[tollway_core::Policy]) -> Self {
        let row = || std::array::from_fn(|_| std::sync::OnceLock::new());
        Counters {
            names: policies.iter().map(|p| p.name().to_owned()).collect(),
            by_policy: policies.iter().map(|_| row()).collect(),
            unlabelled: row(),
        }
    }

    fn get(&self, policy: Option<usize>, outcome: DecisionOutcome) -> &metrics::Counter {
        let at = outcome as usize;
        match policy {
            Some(p) => self.by_policy[p][at].get_or_init(|| {
                metrics::counter!(
                    tollway_core::metric::DECISIONS.name,
                    "policy" => self.names[p].clone(),
                    "outcome" => outcome.as_str(),
                )
            }),
            None => self.unlabelled[at].get_or_init(
                || metrics::counter!(tollway_core::metric::DECISIONS.name, "outcome" => outcome.as_str()),
            ),
        }
    }
}

/// Failures of something the layer asks: its store, or a tier lookup.
///
/// They are told at `warn` when they start and stop. In between they are told as a
/// summary every [`SUMMARY_EVERY_US`], rather than a line a request. A 5 s Redis stall
/// under load is thousands of failed requests, and one of them says as much as all.
pub(crate) struct Failures {
    /// What fails: "rate limit store", "tier lookup".
    subject: &'static str,
    clock: Arc<dyn Clock>,
    failing: AtomicBool,
    /// Failures since the last warning.
    unreported: AtomicU64,
    /// When the last warning was written, microseconds.
    warned_at: AtomicU64,
}

/// How often a store that keeps failing is summarised.
const SUMMARY_EVERY_US: u64 = 10_000_000;

impl Failures {
    pub(crate) fn new(subject: &'static str, clock: Arc<dyn Clock>) -> Self {
        Failures {
            subject,
            clock,
            failing: AtomicBool::new(false),
            unreported: AtomicU64::new(0),
            warned_at: AtomicU64::new(0),
        }
    }

    /// A request it failed; `action` is what the layer did instead.
    pub(crate) fn failed(&self, error: &dyn fmt::Display, action: &'static str) {
        let subject = self.subject;
        let now = self.clock.now_micros();
        if !self.failing.swap(true, Ordering::Relaxed) {
            self.warned_at.store(now, Ordering::Relaxed);
            tracing::warn!(
                %error,
                "{subject} failed; {action} until it answers again (further failures are \
                 summarised every {} s)",
                SUMMARY_EVERY_US / 1_000_000
            );
            return;
        }
        self.unreported.fetch_add(1, Ordering::Relaxed);
        let warned_at = self.warned_at.load(Ordering::Relaxed);
        if now.saturating_sub(warned_at) >= SUMMARY_EVERY_US
            && self
                .warned_at
                .compare_exchange(warned_at, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let failures = self.unreported.swap(0, Ordering::Relaxed);
            tracing::warn!(
                failures,
                %error,
                "{subject} still failing: {failures} more requests in the last {} s; {action}",
                (now - warned_at) / 1_000_000
            );
        }
    }

    /// A request it answered: the end of a failure, if there was one.
    #[inline]
    pub(crate) fn succeeded(&self) {
        if self.failing.load(Ordering::Relaxed) && self.failing.swap(false, Ordering::Relaxed) {
            let failures = self.unreported.swap(0, Ordering::Relaxed);
            let subject = self.subject;
            tracing::warn!(
                failures,
                "{subject} answering again ({failures} more failed requests since the last warning)"
            );
        }
    }
}

impl fmt::Debug for Failures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Failures")
            .field("subject", &self.subject)
            .field("failing", &self.failing.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use tollway_core::{ManualClock, StoreError, StoreErrorKind};
    use tracing::subscriber::with_default;
    use tracing::{Event, Level, Metadata, Subscriber, span};

    use super::*;

    /// Keeps the warnings written: their `failures` fields.
    #[derive(Clone, Default)]
    struct Warnings(Arc<Mutex<Vec<Option<u64>>>>);

    struct Counted(Option<u64>);

    impl tracing::field::Visit for Counted {
        fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
            if field.name() == "failures" {
                self.0 = Some(value);
            }
        }
        fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn fmt::Debug) {}
    }

    impl Subscriber for Warnings {
        fn enabled(&self, metadata: &Metadata<'_>) -> bool {
            *metadata.level() <= Level::WARN
        }
        fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
            span::Id::from_u64(1)
        }
        fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
        fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
        fn event(&self, event: &Event<'_>) {
            let mut counted = Counted(None);
            event.record(&mut counted);
            self.0.lock().unwrap().push(counted.0);
        }
        fn enter(&self, _: &span::Id) {}
        fn exit(&self, _: &span::Id) {}
    }

    // During a stall every request fails: one warning when it starts, a summary every
    // 10 s with the count, one when the store answers again — not a line a request (the
    // axum example once wrote 1,570 in 5 s).
    #[test]
    fn a_failing_store_is_told_when_it_starts_then_summarised_then_when_it_ends() {
        let warnings = Warnings::default();
        let clock = ManualClock::new();
        let failures = Failures::new("rate limit store", Arc::new(clock.clone()));
        let error = StoreError::new(StoreErrorKind::Timeout, "stalled");
        with_default(warnings.clone(), || {
            failures.succeeded();
            // 5 s of failures, 1,000 a second.
            for _ in 0..5_000 {
                failures.failed(&error, "letting requests through");
                clock.advance(Duration::from_millis(1));
            }
            assert_eq!(*warnings.0.lock().unwrap(), [None]);
            // 6 s more: the summary at 10 s counts the 10,000 after the first.
            for _ in 0..6_000 {
                failures.failed(&error, "letting requests through");
                clock.advance(Duration::from_millis(1));
            }
            failures.succeeded();
            failures.succeeded();
        });
        assert_eq!(*warnings.0.lock().unwrap(), [None, Some(10_000), Some(999)]);
    }
}
