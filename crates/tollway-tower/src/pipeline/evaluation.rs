//! A request against its limits: the store's decisions, shadow mode, and the outcome.

use std::time::Duration;

use smallvec::SmallVec;
use tollway_core::{Algorithm, Checked, Decisions, Policy, Store, StoreError, StoreErrorKind};

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
    pub(super) cost: u32,
    /// Each selected limit's cost, in the order of `selected`, when some policy has a
    /// cost of its own; empty when every limit costs `cost`.
    pub(super) each: SmallVec<[u32; 4]>,
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
    /// A limit denied the request: `verdict` says which and why.
    Deny {
        verdict: Verdict<'l>,
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
        let slots: SmallVec<[(usize, u32); 1]> = evaluation
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
        Some(Reservation {
            key: evaluation.key,
            reserved,
            slots,
            usage: Usage::new(),
        })
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
        let policies = self.policies(limiter);
        let key = self.key.as_bytes();
        let checked = if self.each.is_empty() {
            limiter.ledger.store.check(key, &policies, self.cost)
        } else {
            limiter.ledger.store.check_each(key, &policies, &self.each)
        };
        match checked {
            Checked::Ready(answer) => self.decided(limiter, answer),
            Checked::Pending(future) => Step::Wait(future),
        }
    }

    fn policies<'l, St>(&self, limiter: &'l Limiter<St>) -> SmallVec<[&'l Policy; 4]> {
        self.selected
            .iter()
            .map(|&index| limiter.limits.policy(index))
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
        let verdicts: SmallVec<[Verdict<'l>; 2]> = self
            .selected
            .iter()
            .zip(decisions.iter())
            .map(|(&index, &decision)| Verdict {
                policy: limiter.limits.policy(index),
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
            return Step::Done(self.outcome(limiter, &self.selected, &verdicts, most, allowed));
        }
        // Limits in shadow mode are not enforced: they neither delay a request nor speak
        // in its headers. (A denial here is an enforcing limit's: shadow denials were
        // asked again above.)
        if shadow.layer() {
            return Step::Done(Outcome::pass());
        }
        let (selected, verdicts): (Selected, SmallVec<[Verdict<'l>; 2]>) = self
            .selected
            .iter()
            .zip(verdicts.iter())
            .filter(|&(&index, _)| !shadow.policy(index))
            .map(|(&index, verdict)| (index, *verdict))
            .unzip();
        match most_restrictive(&verdicts) {
            Some(most) => Step::Done(self.outcome(limiter, &selected, &verdicts, most, allowed)),
            None => Step::Done(Outcome::pass()),
        }
    }

    /// The outcome of the limits `selected`, whose `verdicts` are these (`most` the one to
    /// report): let through with their headers and the longest delay, or denied.
    fn outcome<'l, St: Store>(
        &self,
        limiter: &'l Limiter<St>,
        selected: &[usize],
        verdicts: &[Verdict<'l>],
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
            Outcome::Deny {
                verdict: verdicts[most],
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
