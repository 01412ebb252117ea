//! A request against its limits: the store's decisions, shadow mode, and the outcome.

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;
use tollway_core::{
    Algorithm, Checked, Decision, Decisions, Policy, Store, StoreError, StoreErrorKind,
};

use super::OnStoreError;
use super::{At, Decided, Limiter, Progress, Wait};
use crate::headers::{HeaderStyle, RateLimitHeaders};
use crate::key::Key;
use crate::limits::Selected;
use crate::rejection::Refusal;
use crate::report::{DecisionEvent, DecisionOutcome};
use crate::settle::{Reservation, Usage};
use crate::verdict::{Verdict, max_delay, most_restrictive, restriction};

/// A request to check against its limits: who, which limits, how many units.
#[derive(Debug)]
pub(crate) struct Evaluation {
    pub(super) key: Key,
    pub(super) selected: Selected,
    /// The policy of `selected[0]` at the caller's own quota, when it has one (a plan).
    pub(super) own: Option<Arc<Policy>>,
    pub(super) cost: u64,
    /// Each selected limit's cost, in the order of `selected`, when some policy has a
    /// cost of its own; empty when every limit costs `cost`.
    pub(super) each: SmallVec<[u64; 4]>,
    /// The store failed to decide it (nothing to charge after the response).
    pub(super) failed: bool,
}

/// Where an evaluation got to: decided, or waiting for the store's future.
// Matched as soon as it is returned: boxing the outcome would cost an allocation a request.
#[allow(clippy::large_enum_variant)]
pub(super) enum Step<'l, F> {
    Done(Outcome<'l>),
    Wait(F),
}

/// A decided request.
#[derive(Debug)]
pub(crate) enum Outcome<'l> {
    /// Call the service and add `headers` to its response; first wait `delay` (shaping).
    Allow {
        headers: RateLimitHeaders,
        delay: Option<Duration>,
    },
    /// A limit denied the request: `policy` and its `decision` say which and why.
    Deny {
        policy: Ruling<'l>,
        decision: Decision,
        headers: RateLimitHeaders,
    },
    /// The layer refuses the request without a limit's decision.
    Refuse(Refusal),
}

impl<St: Store> Limiter<St> {
    /// Where `evaluation` stands after `step`: decided (with its charge after the
    /// response), or waiting for the store.
    #[inline]
    pub(super) fn progress<'l>(
        &'l self,
        evaluation: Evaluation,
        step: Step<'l, St::Future>,
    ) -> Progress<'l, St::Future> {
        match step {
            Step::Done(outcome) => {
                let charge = match outcome {
                    Outcome::Allow { .. } => self.charge_for(evaluation),
                    Outcome::Deny { .. } | Outcome::Refuse(_) => None,
                };
                Progress::Decided(Decided { outcome, charge })
            }
            Step::Wait(future) => Progress::Waiting(Wait::Check { future }, At::Check(evaluation)),
        }
    }

    /// What the request of `evaluation`, let through, leaves for after its response:
    /// the reservation to settle, when the layer settles a policy of the request's, and
    /// the slots to give back, when it holds any. A request the store failed to decide
    /// reserved nothing and holds nothing.
    #[inline]
    fn charge_for(&self, evaluation: Evaluation) -> Option<Reservation> {
        if !self.ledger.keeps_books() || evaluation.failed {
            return None;
        }
        let cost_at = |at: usize| evaluation.each.get(at).copied().unwrap_or(evaluation.cost);
        let reserved = self.ledger.settle.as_ref().and_then(|settle| {
            let at = evaluation
                .selected
                .iter()
                .position(|&i| i == settle.policy)?;
            Some(cost_at(at))
        });
        let slots: SmallVec<[(usize, u64); 1]> = evaluation
            .selected
            .iter()
            .enumerate()
            .filter(|&(_, &i)| self.limits.policy(i).algorithm() == Algorithm::Concurrency)
            .map(|(at, &i)| (i, cost_at(at)))
            .filter(|&(_, cost)| cost > 0)
            .collect();
        if reserved.is_none() && slots.is_empty() {
            return None;
        }
        let own = evaluation.own.map(|own| (evaluation.selected[0], own));
        Some(Reservation {
            key: evaluation.key,
            reserved,
            slots,
            own,
            usage: Usage::new(),
        })
    }
}

/// The policy at position `at` of a request's limits, whose index is `index`: the
/// caller's `own` policy in the first place, when it has one, else the layer's.
fn policy_at<'a, St>(
    own: &'a Option<Arc<Policy>>,
    limiter: &'a Limiter<St>,
    at: usize,
    index: usize,
) -> &'a Policy {
    match own {
        Some(own) if at == 0 => own,
        _ => limiter.limits.policy(index),
    }
}

/// The policy that denied a request: one of the layer's, or a caller's own (a plan's
/// quota), held until the denial is answered.
#[derive(Debug)]
pub(crate) enum Ruling<'l> {
    Layer(&'l Policy),
    Own(Arc<Policy>),
}

impl Ruling<'_> {
    pub(crate) fn policy(&self) -> &Policy {
        match self {
            Ruling::Layer(policy) => policy,
            Ruling::Own(policy) => policy,
        }
    }
}

impl Outcome<'_> {
    /// Let through without limits or headers.
    pub(super) fn pass() -> Self {
        Outcome::Allow {
            headers: RateLimitHeaders::none(),
            delay: None,
        }
    }
}

impl Evaluation {
    /// Asks the store about every limit of the request at once: decided now, or the
    /// store's future, whose answer goes to `Evaluation::decided`.
    #[inline]
    pub(super) fn check<'l, St: Store>(
        &mut self,
        limiter: &'l Limiter<St>,
    ) -> Step<'l, St::Future> {
        let checked = {
            let policies = self.policies(limiter);
            let key = self.key.as_bytes();
            if self.each.is_empty() {
                limiter.ledger.store.check(key, &policies, self.cost)
            } else {
                limiter.ledger.store.check_each(key, &policies, &self.each)
            }
        };
        match checked {
            Checked::Ready(answer) => self.decided(limiter, answer),
            Checked::Pending(future) => Step::Wait(future),
        }
    }

    fn policies<'a, St>(&'a self, limiter: &'a Limiter<St>) -> SmallVec<[&'a Policy; 4]> {
        self.selected
            .iter()
            .enumerate()
            .map(|(at, &index)| policy_at(&self.own, limiter, at, index))
            .collect()
    }

    /// The outcome of the store's `answer`.
    ///
    /// When every limit allowed, the request is let through with the headers. When one
    /// did not, it is denied with the most restrictive denial. When a limit in shadow
    /// mode denied it, that is told as `shadow_limited`. The limits that enforce, if
    /// any, are then asked again on their own: all or nothing, the store charged none of
    /// them. So a limit in shadow never refuses a request. It never changes what the
    /// others count, and is never the one a 429 reports.
    pub(super) fn decided<'l, St: Store>(
        &mut self,
        limiter: &'l Limiter<St>,
        answer: Result<Decisions, StoreError>,
    ) -> Step<'l, St::Future> {
        let decisions = match answer {
            Ok(decisions) if decisions.len() == self.selected.len() => decisions,
            Ok(decisions) => {
                let error = StoreError::new(
                    StoreErrorKind::Script,
                    format!(
                        "the store answered {} decisions for {} limits",
                        decisions.len(),
                        self.selected.len()
                    ),
                );
                return Step::Done(self.store_failed(limiter, &error));
            }
            Err(error) => return Step::Done(self.store_failed(limiter, &error)),
        };
        limiter.failures.succeeded();
        // The caller's own policy, apart from `self`, which is asked again below.
        let own = self.own.clone();
        let allowed = decisions.is_allowed();
        let shadow = &limiter.shadow;
        let in_shadow = shadow.layer() || self.selected.iter().any(|&i| shadow.policy(i));
        if allowed
            && limiter.header_style == HeaderStyle::None
            && !limiter.reporter.active()
            && !in_shadow
        {
            return Step::Done(Outcome::Allow {
                headers: RateLimitHeaders::none(),
                delay: max_delay(decisions.iter()),
            });
        }
        let verdicts: SmallVec<[Verdict<'_>; 2]> = self
            .selected
            .iter()
            .enumerate()
            .zip(decisions.iter())
            .map(|((at, &index), &decision)| Verdict {
                policy: policy_at(&own, limiter, at, index),
                decision,
            })
            .collect();
        // One verdict a selected policy, and at least the caller's own.
        let Some(most) = most_restrictive(&verdicts) else {
            return Step::Done(Outcome::pass());
        };
        if let Some(shadowed) = self.shadow_denial(limiter, &verdicts) {
            let event = DecisionEvent::new(
                Some(&self.key),
                DecisionOutcome::ShadowLimited,
                &verdicts,
                Some(shadowed),
            );
            limiter
                .reporter
                .report(&event, Some(self.selected[shadowed]));
            if shadow.layer() {
                return Step::Done(Outcome::pass());
            }
            // Asked again without the shadow limits that denied; those that allowed stay,
            // to be charged with the rest.
            let keep: SmallVec<[bool; 4]> = self
                .selected
                .iter()
                .zip(decisions.iter())
                .map(|(&index, decision)| decision.is_allowed() || !shadow.policy(index))
                .collect();
            if !keep[0] {
                self.own = None;
            }
            let mut kept = keep.iter();
            self.selected.retain(|_| kept.next().is_none_or(|&k| k));
            if !self.each.is_empty() {
                let mut kept = keep.iter();
                self.each.retain(|_| kept.next().is_none_or(|&k| k));
            }
            if self.selected.iter().all(|&index| shadow.policy(index)) {
                return Step::Done(Outcome::pass());
            }
            return self.check(limiter);
        }
        if limiter.reporter.active() {
            let outcome = DecisionOutcome::of(&verdicts[most], allowed);
            let event = DecisionEvent::new(Some(&self.key), outcome, &verdicts, Some(most));
            limiter.reporter.report(&event, Some(self.selected[most]));
        }
        if !in_shadow {
            let outcome = self.outcome(
                limiter,
                own.as_ref(),
                &self.selected,
                &verdicts,
                most,
                allowed,
            );
            return Step::Done(outcome);
        }
        // Limits in shadow mode are not enforced: they neither delay a request nor speak
        // in its headers. (A denial here is an enforcing limit's: shadow denials were
        // asked again above.)
        if shadow.layer() {
            return Step::Done(Outcome::pass());
        }
        let (selected, verdicts): (Selected, SmallVec<[Verdict<'_>; 2]>) = self
            .selected
            .iter()
            .zip(verdicts.iter())
            .filter(|&(&index, _)| !shadow.policy(index))
            .map(|(&index, verdict)| (index, *verdict))
            .unzip();
        match most_restrictive(&verdicts) {
            Some(most) => {
                let outcome =
                    self.outcome(limiter, own.as_ref(), &selected, &verdicts, most, allowed);
                Step::Done(outcome)
            }
            None => Step::Done(Outcome::pass()),
        }
    }

    /// The outcome of the limits `selected`, whose `verdicts` are these (`most` the one to
    /// report; `own` the caller's own policy, if it has one): let through with their
    /// headers and the longest delay, or denied.
    fn outcome<'l, St: Store>(
        &self,
        limiter: &'l Limiter<St>,
        own: Option<&Arc<Policy>>,
        selected: &[usize],
        verdicts: &[Verdict<'_>],
        most: usize,
        allowed: bool,
    ) -> Outcome<'l> {
        let delay = || max_delay(verdicts.iter().map(|v| &v.decision));
        if allowed && limiter.header_style == HeaderStyle::None {
            return Outcome::Allow {
                headers: RateLimitHeaders::none(),
                delay: delay(),
            };
        }
        let headers = limiter.rate_limit_headers(selected, verdicts, most);
        if allowed {
            Outcome::Allow {
                headers,
                delay: delay(),
            }
        } else {
            let verdict = &verdicts[most];
            let policy = match own {
                Some(own) if std::ptr::eq(verdict.policy, &**own) => Ruling::Own(Arc::clone(own)),
                _ => Ruling::Layer(limiter.limits.policy(selected[most])),
            };
            Outcome::Deny {
                policy,
                decision: verdict.decision,
                headers,
            }
        }
    }

    /// The most restrictive denial by a limit in shadow mode (any limit, when the whole
    /// layer is), if there is one.
    fn shadow_denial<St>(&self, limiter: &Limiter<St>, verdicts: &[Verdict<'_>]) -> Option<usize> {
        let shadow = &limiter.shadow;
        let layer = shadow.layer();
        (0..verdicts.len())
            .filter(|&i| {
                !verdicts[i].decision.is_allowed() && (layer || shadow.policy(self.selected[i]))
            })
            .min_by_key(|&i| restriction(&verdicts[i]))
    }

    /// The outcome when the store failed to decide.
    fn store_failed<St: Store>(
        &mut self,
        limiter: &Limiter<St>,
        error: &StoreError,
    ) -> Outcome<'static> {
        self.failed = true;
        limiter.report(Some(&self.key), DecisionOutcome::StoreError);
        match limiter.on_error {
            OnStoreError::Allow => {
                limiter.failures.failed(error, "letting requests through");
                Outcome::pass()
            }
            OnStoreError::Reject => {
                limiter.failures.failed(error, "answering 503");
                Outcome::Refuse(Refusal::StoreFailed)
            }
        }
    }
}
