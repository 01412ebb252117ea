//! The one decision path: request → key → limits → cost → store → decision → answer.
//!
//! The tower service, its response future and the gRPC interceptor all drive this
//! module and nothing else decides. There is one entry and one way back in:
//! [`Limiter::decide`] reads a request and comes to a [`Progress`]: [`Decided`] at once,
//! or [`Waiting`](Progress::Waiting) for the store or a tier lookup. The caller polls
//! the [`Wait`] and hands its [`Answer`] to [`Limiter::resume`], which comes to the
//! next `Progress`. A decided request's [`Outcome`] becomes what the service does next
//! through [`Limiter::next`]: call the inner service with headers to add (perhaps after
//! a shaping delay), or answer in its place. What to settle after the response
//! (`settle`) is decided here too: a [`Decided`] request carries its [`Reservation`],
//! which a [`Settlement`](crate::settle::Settlement) settles once the response ends.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use pin_project_lite::pin_project;
use smallvec::SmallVec;
use tollway_core::{
    Algorithm, Checked, Clock, Decisions, Policy, Store, StoreError, StoreErrorKind,
};

use crate::access::{AccessLists, Listed};
use crate::headers::{HeaderStyle, LimitValues, RateLimitHeaders};
use crate::key::{Key, KeyExtractor, peer_addr};
use crate::limits::{Limits, Selected, sent_uri};
use crate::lookup::{Found, LookupFuture, Lookups, OnLookupError, unknown_key};
use crate::rejection::{Refusal, Rejection, RejectionHandler};
use crate::report::{DecisionEvent, DecisionOutcome, Failures, Reporter};
use crate::settle::{Renewals, Reservation, Settle, Usage};
use crate::shadow::Shadow;
use crate::verdict::{Verdict, max_delay, most_restrictive, restriction};

/// What to do with a request for which the key extractor (and every fallback chained to
/// it with [`or`](crate::Fallback::or)) finds no key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Limit every such request together, under one key (`missing:`), by its caller's
    /// policy: they are still limited, and cannot outnumber one caller. The default.
    Shared,
    /// Answer with this status and a JSON error body, without calling the service.
    Reject(StatusCode),
    /// Let the request through unlimited.
    Allow,
}

/// What to do when the store cannot decide (Redis down, a timeout) and has no fallback
/// to decide instead: a `RedisStore` built
/// `without_local_fallback()`, or a store of your own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let the request through (fail open), without rate-limit headers. The default:
    /// an outage of the limiter's backend does not become an outage of the service.
    Allow,
    /// Answer 503 Service Unavailable (gRPC: `UNAVAILABLE`) (fail closed).
    Reject,
}

/// In whose terms the layer answers the requests it refuses.
///
/// That is an HTTP status and a JSON body. Or, with feature `tonic`, it is a gRPC status
/// in a trailers-only response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Protocol {
    /// gRPC for gRPC calls — HTTP/2 requests whose `content-type` is `application/grpc`
    /// or a subtype — and HTTP for the rest. The default.
    #[default]
    Detect,
    /// Always HTTP: for a service that serves no gRPC. There a request dressed as gRPC
    /// must still get its 429. A 200 with `grpc-status` would count as a success in
    /// status monitoring.
    Http,
    /// Always gRPC: for a gRPC service.
    Grpc,
}

impl Protocol {
    /// Whether `request` is answered in gRPC's terms.
    fn grpc<B>(self, request: &Request<B>) -> bool {
        match self {
            Protocol::Http => false,
            Protocol::Grpc => cfg!(feature = "tonic"),
            Protocol::Detect => {
                request.version() == http::Version::HTTP_2
                    && request
                        .headers()
                        .get(http::header::CONTENT_TYPE)
                        .is_some_and(|v| is_grpc_content_type(v.as_bytes()))
                    && cfg!(feature = "tonic")
            }
        }
    }
}

/// Whether a `content-type` is gRPC's: `application/grpc`, or a subtype such as
/// `application/grpc+proto`.
fn is_grpc_content_type(value: &[u8]) -> bool {
    value
        .strip_prefix(b"application/grpc")
        .is_some_and(|rest| rest.is_empty() || rest[0] == b'+' || rest[0] == b';')
}

/// The cost of a request: how many units it takes from each of its limits.
pub(crate) type CostFn = Arc<dyn Fn(&Method, &Uri, &HeaderMap) -> u32 + Send + Sync>;

/// What a request of `method` to `uri` with `headers` costs by `cost` (1 without one),
/// on the server side and the client side alike. `uri` is read only for a cost.
///
/// At least 1: a request that took nothing would pass an empty budget.
#[inline]
pub(crate) fn cost_of<'r>(
    cost: Option<&CostFn>,
    method: &Method,
    uri: impl FnOnce() -> &'r Uri,
    headers: &HeaderMap,
) -> u32 {
    cost.map_or(1, |cost| cost(method, uri(), headers).max(1))
}

/// What a request costs one policy, from its method, URI, headers and extensions.
pub(crate) type PolicyCostFn =
    Arc<dyn Fn(&Method, &Uri, &HeaderMap, &http::Extensions) -> u32 + Send + Sync>;

/// A layer's current limiter, swapped whole when its limits are replaced
/// ([`RateLimitLayer::swap_limits`](crate::RateLimitLayer::swap_limits)): a request takes
/// the one current when it starts and keeps it to the end.
pub(crate) type Current<St> = Arc<arc_swap::ArcSwap<Limiter<St>>>;

/// Everything a layer decides with but the key extractor, shared by its clones, its
/// services and their futures.
pub(crate) struct Limiter<St> {
    pub(crate) store: St,
    pub(crate) limits: Limits,
    pub(crate) cost: Option<CostFn>,
    /// A cost of its own for some policies, by index in `limits`; `None` when no policy
    /// has one (every limit costs `cost`).
    pub(crate) policy_costs: Option<Box<[Option<PolicyCostFn>]>>,
    pub(crate) missing: MissingKey,
    pub(crate) on_error: OnStoreError,
    pub(crate) protocol: Protocol,
    pub(crate) header_style: HeaderStyle,
    /// `X-RateLimit-Limit` of each policy of `limits`.
    pub(crate) limit_values: LimitValues,
    /// Unix time for `X-RateLimit-Reset`.
    pub(crate) wall_clock: Arc<dyn Clock>,
    pub(crate) on_rejected: RejectionHandler,
    pub(crate) lists: AccessLists,
    pub(crate) shadow: Shadow,
    pub(crate) reporter: Reporter,
    pub(crate) failures: Failures,
    /// Failures of the settlements after responses (`settle`).
    pub(crate) charge_failures: Failures,
    pub(crate) settle: Option<Settle>,
    /// The slots of calls in flight, renewed until their calls end.
    pub(crate) renewals: Renewals,
    pub(crate) lookups: Option<Lookups>,
    /// Load shedding before the limits.
    pub(crate) shed: Option<crate::shed::Shed>,
}

/// Where a request stands: decided, or waiting for the store or its caller's tier.
// Matched as soon as it is returned: boxing the outcome would cost an allocation a request.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Progress<'l, F> {
    Decided(Decided<'l>),
    /// Poll the [`Wait`], then hand its answer and the [`Resume`] to [`Limiter::resume`].
    Waiting(Wait<F>, Resume),
}

/// A decided request: its outcome, and what to settle after its response.
#[derive(Debug)]
pub(crate) struct Decided<'l> {
    pub(crate) outcome: Outcome<'l>,
    /// Only for a request let through, when the layer settles after responses, the
    /// settled policy is one of the request's, and the store decided it.
    pub(crate) charge: Option<Reservation>,
}

pin_project! {
    /// What a request waits for: the store's decision, or its caller's tier.
    #[project = WaitProj]
    pub(crate) enum Wait<F> {
        Check { #[pin] future: F },
        Lookup { future: LookupFuture },
    }
}

/// What a [`Wait`] came to, for [`Limiter::resume`].
pub(crate) enum Answer {
    Checked(Result<Decisions, StoreError>),
    LookedUp(Result<Option<String>, Box<dyn std::error::Error + Send + Sync>>),
}

impl<F> Future for Wait<F>
where
    F: Future<Output = Result<Decisions, StoreError>>,
{
    type Output = Answer;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answer> {
        match self.project() {
            WaitProj::Check { future } => future.poll(cx).map(Answer::Checked),
            WaitProj::Lookup { future } => future.as_mut().poll(cx).map(Answer::LookedUp),
        }
    }
}

/// Where a waiting request goes on: what it had come to before it waited.
#[derive(Debug)]
pub(crate) enum Resume {
    /// Its limits are being decided.
    Check(Evaluation),
    /// Its caller's tier is being looked up.
    Lookup(Key),
}

/// A request to check against its limits: who, which limits, how many units.
#[derive(Debug)]
pub(crate) struct Evaluation {
    key: Key,
    selected: Selected,
    cost: u32,
    /// Each selected limit's cost, in the order of `selected`, when some policy has a
    /// cost of its own; empty when every limit costs `cost`.
    each: SmallVec<[u32; 4]>,
    /// The store failed to decide it (nothing to charge after the response).
    failed: bool,
}

/// Where an evaluation got to: decided, or waiting for the store's future.
// Matched as soon as it is returned: boxing the outcome would cost an allocation a request.
#[allow(clippy::large_enum_variant)]
enum Step<'l, F> {
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

/// What the service does with a decided request.
pub(crate) enum Next {
    /// Calls the inner service, after `delay`, and adds `headers` to its response.
    Call {
        headers: RateLimitHeaders,
        delay: Option<Duration>,
    },
    /// Answers this instead.
    Answer(Response<Bytes>),
}

impl<St> Limiter<St> {
    /// Asks the load shedder, if any, to admit `request`: its permit (to drop when the
    /// service has answered), or the refusal to answer with [`refused`](Self::refused).
    #[inline]
    pub(crate) fn shed<B, K: KeyExtractor<B>>(
        &self,
        extractor: &K,
        request: &Request<B>,
    ) -> Result<Option<crate::shed::Permit>, Refusal> {
        let Some(shed) = &self.shed else {
            return Ok(None);
        };
        match shed.admit(request, source(extractor, request)) {
            Ok(permit) => Ok(Some(permit)),
            Err(overloaded) => Err(Refusal::Overloaded(overloaded.retry_after)),
        }
    }

    /// The answer to `request`, refused by the layer on its own.
    pub(crate) fn refused<B>(&self, refusal: Refusal, request: &Request<B>) -> Response<Bytes> {
        refuse(refusal, self.protocol.grpc(request))
    }
}

impl<St: Store> Limiter<St> {
    /// Decides `request`, whose key `extractor` finds: at once, or after a wait for the
    /// store or a tier lookup (see [`resume`](Self::resume)).
    #[inline]
    pub(crate) fn decide<B, K>(
        &self,
        extractor: &K,
        request: &Request<B>,
    ) -> Progress<'_, St::Future>
    where
        K: KeyExtractor<B>,
    {
        let key = extractor.extract(request);
        if let Some(listed) = self.lists.find(extractor, key.as_ref(), request) {
            return decided(match listed {
                Listed::Allowed => {
                    self.report(key.as_ref(), DecisionOutcome::AllowListed);
                    Outcome::pass()
                }
                Listed::Denied => {
                    self.report(key.as_ref(), DecisionOutcome::DenyListed);
                    Outcome::Refuse(Refusal::Denied)
                }
            });
        }
        let key = match key {
            Some(key) => key,
            None => match self.missing {
                MissingKey::Shared => Key::new("missing", ""),
                MissingKey::Allow => return decided(Outcome::pass()),
                MissingKey::Reject(status) => {
                    self.report(None, DecisionOutcome::NoKey);
                    return decided(Outcome::Refuse(Refusal::NoKey(status)));
                }
            },
        };
        let found = match &self.lookups {
            None => Found::Tier(self.limits.tier_for(&key)),
            Some(lookups) => match lookups.cached(&key) {
                Some(found) => found,
                None => match lookups.start(&key, source(extractor, request).as_ref()) {
                    Some(future) => {
                        return Progress::Waiting(Wait::Lookup { future }, Resume::Lookup(key));
                    }
                    // Not looked up (a bound): unknown, this time.
                    None => Found::Unknown,
                },
            },
        };
        self.evaluate(key, found, request)
    }

    /// Goes on with `request`, which waited at `at`, now that its wait came to `answer`.
    pub(crate) fn resume<B>(
        &self,
        at: Resume,
        answer: Answer,
        request: &Request<B>,
    ) -> Progress<'_, St::Future> {
        match (at, answer) {
            (Resume::Check(mut evaluation), Answer::Checked(answer)) => {
                let step = evaluation.decided(self, answer);
                self.progress(evaluation, step)
            }
            (Resume::Lookup(key), Answer::LookedUp(answer)) => self.looked_up(key, answer, request),
            // A wait's answer comes back with what it was waiting for.
            (Resume::Check(_), Answer::LookedUp(_)) | (Resume::Lookup(_), Answer::Checked(_)) => {
                unreachable!("a wait answered for another")
            }
        }
    }

    /// Goes on with `request` once its caller's tier lookup answered.
    fn looked_up<B>(
        &self,
        key: Key,
        answer: Result<Option<String>, Box<dyn std::error::Error + Send + Sync>>,
        request: &Request<B>,
    ) -> Progress<'_, St::Future> {
        // Only a lookup this limiter started comes back here.
        let Some(lookups) = &self.lookups else {
            unreachable!("a lookup answered for a limiter that looks nothing up")
        };
        match lookups.found(&key, answer, &self.limits) {
            Some(found) => self.evaluate(key, found, request),
            None => match lookups.on_error {
                OnLookupError::Reject => {
                    self.report(Some(&key), DecisionOutcome::StoreError);
                    decided(Outcome::Refuse(Refusal::LookupFailed))
                }
                // `Anonymous`, and any rule added later: the caller is not known.
                _ => self.evaluate(key, Found::Unknown, request),
            },
        }
    }

    /// Checks `request` from the caller of `key`, whose tier is `found`: an unknown
    /// caller is limited by the default policy, in the budget every unknown caller
    /// shares.
    #[inline]
    fn evaluate<B>(
        &self,
        key: Key,
        found: Found,
        request: &Request<B>,
    ) -> Progress<'_, St::Future> {
        let (key, tier) = match found {
            Found::Tier(tier) => (key, tier),
            Found::Unknown => (unknown_key(), 0),
        };
        let selected = self.limits.select_tier(tier, request);
        // The URI the client sent, as route limits see it.
        let uri = || sent_uri(request);
        let cost = cost_of(self.cost.as_ref(), request.method(), uri, request.headers());
        let each = match &self.policy_costs {
            None => SmallVec::new(),
            Some(costs) => selected
                .iter()
                .map(|&index| match &costs[index] {
                    // At least 1, as `cost_of`.
                    Some(of) => of(
                        request.method(),
                        uri(),
                        request.headers(),
                        request.extensions(),
                    )
                    .max(1),
                    None => cost,
                })
                .collect(),
        };
        let mut evaluation = Evaluation {
            key,
            selected,
            cost,
            each,
            failed: false,
        };
        let step = evaluation.check(self);
        self.progress(evaluation, step)
    }

    /// Where `evaluation` stands after `step`: decided (with its charge after the
    /// response), or waiting for the store.
    #[inline]
    fn progress<'l>(
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
            Step::Wait(future) => {
                Progress::Waiting(Wait::Check { future }, Resume::Check(evaluation))
            }
        }
    }

    /// What the request of `evaluation`, let through, leaves for after its response:
    /// the reservation to settle, when the layer settles a policy of the request's, and
    /// the slots to give back, when it holds any. A request the store failed to decide
    /// reserved nothing and holds nothing.
    #[inline]
    fn charge_for(&self, evaluation: Evaluation) -> Option<Reservation> {
        if (self.settle.is_none() && !self.renewals.any()) || evaluation.failed {
            return None;
        }
        let cost_at = |at: usize| evaluation.each.get(at).copied().unwrap_or(evaluation.cost);
        let reserved = self.settle.as_ref().and_then(|settle| {
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

    /// Tells a failed settlement the way a failed decision is told (apart: the
    /// decisions may go on from a fallback while settlements fail).
    pub(crate) fn charged(&self, answer: Result<Decisions, StoreError>) {
        match answer {
            Ok(_) => self.charge_failures.succeeded(),
            Err(error) => self
                .charge_failures
                .failed(&error, "responses go unsettled for what they used"),
        }
    }

    /// Tells a decision no limit made (a list, a store failure, no key).
    fn report(&self, key: Option<&Key>, outcome: DecisionOutcome) {
        let event = DecisionEvent::new(key, outcome, &[], None);
        self.reporter.report(&event, None);
    }

    /// What to do with `request` now that it is decided: a gRPC request is answered
    /// with gRPC statuses.
    #[inline]
    pub(crate) fn next<B>(&self, outcome: Outcome<'_>, request: &Request<B>) -> Next {
        match outcome {
            Outcome::Allow { headers, delay } => Next::Call { headers, delay },
            Outcome::Deny { verdict, headers } => {
                Next::Answer(self.deny(verdict, headers, self.protocol.grpc(request)))
            }
            Outcome::Refuse(refusal) => Next::Answer(refuse(refusal, self.protocol.grpc(request))),
        }
    }

    /// The response to a request denied by `verdict`: the rejection handler's (over
    /// gRPC, the status), with `headers`.
    fn deny(&self, verdict: Verdict<'_>, headers: RateLimitHeaders, grpc: bool) -> Response<Bytes> {
        #[cfg(feature = "tonic")]
        if grpc {
            return crate::grpc::denial_status(&verdict, headers).into_http();
        }
        let _ = grpc;
        let mut response = (self.on_rejected)(&Rejection::new(verdict));
        headers.insert_into(response.headers_mut());
        response
    }

    /// The rate-limit headers for `verdicts` (of the policies `selected`), reporting the
    /// one at `most`.
    fn rate_limit_headers(
        &self,
        selected: &[usize],
        verdicts: &[Verdict<'_>],
        most: usize,
    ) -> RateLimitHeaders {
        let verdict = &verdicts[most];
        // `X-RateLimit-Limit` and the wall time for `X-RateLimit-Reset`, when sent.
        let legacy = self.header_style.legacy().then(|| {
            let index = selected[most];
            let policy = self.limits.policy(index);
            let limit = self
                .limit_values
                .get(index, policy, verdict.decision.limit());
            (limit, self.wall_clock.now_micros())
        });
        RateLimitHeaders::new(self.header_style, verdicts, verdict, legacy)
    }
}

/// A request decided before any limit was asked: nothing to charge after it.
fn decided<F>(outcome: Outcome<'_>) -> Progress<'_, F> {
    Progress::Decided(Decided {
        outcome,
        charge: None,
    })
}

/// The answer to a refusal: JSON over HTTP, the matching status over gRPC.
fn refuse(refusal: Refusal, grpc: bool) -> Response<Bytes> {
    #[cfg(feature = "tonic")]
    if grpc {
        return crate::grpc::refusal_status(refusal).into_http();
    }
    let _ = grpc;
    refusal.response()
}

impl Outcome<'_> {
    /// Let through without limits or headers.
    fn pass() -> Self {
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
    fn check<'l, St: Store>(&mut self, limiter: &'l Limiter<St>) -> Step<'l, St::Future> {
        let policies = self.policies(limiter);
        let key = self.key.as_bytes();
        let checked = if self.each.is_empty() {
            limiter.store.check(key, &policies, self.cost)
        } else {
            limiter.store.check_each(key, &policies, &self.each)
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
    fn decided<'l, St: Store>(
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

/// The address a request comes from, as its key extractor knows the caller (the first
/// `ip:` key among its identities: the client behind trusted proxies), else the peer's.
fn source<B, K: KeyExtractor<B>>(extractor: &K, request: &Request<B>) -> Option<Key> {
    let mut address = None;
    extractor.identities(request, &mut |key| {
        if address.is_none() && key.namespace() == "ip" {
            address = Some(key);
        }
    });
    address.or_else(|| peer_addr(request).map(|peer| Key::ip(peer, 64)))
}

#[cfg(test)]
mod tests;
