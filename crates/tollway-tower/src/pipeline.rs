//! The one decision path: request → key → limits → cost → store → decision → answer.
//!
//! The tower service, its response future and the gRPC interceptor all drive this
//! module and nothing else decides: [`Limiter::start`] reads a request and either decides
//! it at once (no key) or starts an [`Evaluation`]; the evaluation asks the store for each
//! of the request's limits in turn ([`Evaluation::advance`], [`Evaluation::resume`] when
//! the store had to wait) and ends in an [`Outcome`]; [`Limiter::next`] turns an outcome
//! into what the service does next: call the inner service with headers to add (perhaps
//! after a shaping delay), or answer in its place.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use smallvec::SmallVec;
use tollway_core::{Clock, Decision, Policy, Store, StoreError};

use crate::headers::{HeaderStyle, RateLimitHeaders};
use crate::key::{Key, KeyExtractor, PeerIp};
use crate::limits::{Limits, Selected};
use crate::rejection::{Refusal, Rejection, RejectionHandler};
use crate::verdict::{Verdict, most_restrictive};

/// What to do with a request for which the key extractor finds no key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Limit the caller by its peer address under the default policy (the default): an
    /// anonymous caller is still limited.
    FallbackToIp,
    /// Answer with this status and a JSON error body, without calling the service.
    Reject(StatusCode),
    /// Let the request through unlimited.
    Allow,
}

/// What to do when the store cannot decide (Redis down, a timeout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let the request through (fail open), without rate-limit headers. The default:
    /// an outage of the limiter's backend does not become an outage of the service.
    Allow,
    /// Answer 503 Service Unavailable (gRPC: `UNAVAILABLE`) (fail closed).
    Reject,
}

/// The cost of a request: how many units it takes from each of its limits.
pub(crate) type CostFn = Arc<dyn Fn(&Method, &Uri, &HeaderMap) -> u32 + Send + Sync>;

/// Everything a layer decides with but the key extractor, shared by its clones, its
/// services and their futures.
pub(crate) struct Limiter<St> {
    pub(crate) store: St,
    pub(crate) limits: Limits,
    pub(crate) cost: Option<CostFn>,
    pub(crate) missing: MissingKey,
    pub(crate) on_error: OnStoreError,
    pub(crate) header_style: HeaderStyle,
    /// Unix time for `X-RateLimit-Reset`.
    pub(crate) wall_clock: Arc<dyn Clock>,
    pub(crate) on_rejected: RejectionHandler,
}

/// How a request starts: decided before any limit is asked, or to be evaluated.
pub(crate) enum Start<'l> {
    Decided(Outcome<'l>),
    Evaluate(Evaluation),
}

/// A request being checked against its limits, one store decision at a time.
#[derive(Debug)]
pub(crate) struct Evaluation {
    key: Key,
    selected: Selected,
    cost: u32,
    /// `(policy index, decision)` of the limits decided so far, in `selected` order.
    decided: SmallVec<[(usize, Decision); 2]>,
    /// The policy whose decision the store's future will bring.
    waiting: usize,
}

/// Where an evaluation got to: decided, or waiting for the store's future.
// Matched as soon as it is returned: boxing the outcome would cost an allocation a request.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Step<'l, F> {
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

impl<St: Store> Limiter<St> {
    /// Reads `request`: its key found by `key` (or what to do without one), its limits
    /// and its cost.
    #[inline]
    pub(crate) fn start<B, K>(&self, key: &K, request: &Request<B>) -> Start<'_>
    where
        K: KeyExtractor<B>,
    {
        let key = match key.extract(request) {
            Some(key) => key,
            None => match self.missing {
                // Without a peer address every such caller shares one key: still limited.
                MissingKey::FallbackToIp => KeyExtractor::<B>::extract(&PeerIp::new(), request)
                    .unwrap_or_else(|| Key::new("ip", "unknown")),
                MissingKey::Allow => return Start::Decided(Outcome::pass()),
                MissingKey::Reject(status) => {
                    return Start::Decided(Outcome::Refuse(Refusal::NoKey(status)));
                }
            },
        };
        let selected = self
            .limits
            .select(&key, request.method(), request.uri().path());
        let cost = self.cost.as_ref().map_or(1, |cost| {
            cost(request.method(), request.uri(), request.headers())
        });
        Start::Evaluate(Evaluation {
            key,
            selected,
            cost,
            decided: SmallVec::new(),
            waiting: 0,
        })
    }

    /// What to do with `request` now that it is decided: a gRPC request is answered
    /// with gRPC statuses.
    #[inline]
    pub(crate) fn next<B>(&self, outcome: Outcome<'_>, request: &Request<B>) -> Next {
        match outcome {
            Outcome::Allow { headers, delay } => Next::Call { headers, delay },
            Outcome::Deny { verdict, headers } => {
                Next::Answer(self.deny(verdict, headers, is_grpc(request)))
            }
            Outcome::Refuse(refusal) => Next::Answer(refuse(refusal, is_grpc(request))),
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

    /// The rate-limit headers for `decided` (every limit asked so far, a denial last),
    /// reporting the most restrictive decision.
    fn rate_limit_headers(&self, decided: &[(usize, Decision)]) -> RateLimitHeaders {
        let verdicts: SmallVec<[Verdict<'_>; 2]> = decided
            .iter()
            .map(|&(index, decision)| Verdict {
                policy: self.limits.policy(index),
                decision,
            })
            .collect();
        let Some(most) = most_restrictive(&verdicts) else {
            return RateLimitHeaders::none();
        };
        let verdict = &verdicts[most];
        let limit = self
            .limits
            .limit_value(decided[most].0, verdict.decision.limit());
        let now = self.wall_clock.now_micros();
        RateLimitHeaders::new(self.header_style, &verdicts, verdict, limit, now)
    }
}

/// Whether `request` is a gRPC call, answered with gRPC statuses instead of HTTP ones.
fn is_grpc<B>(request: &Request<B>) -> bool {
    #[cfg(feature = "tonic")]
    return crate::grpc::is_grpc(request.headers());
    #[cfg(not(feature = "tonic"))]
    {
        let _ = request;
        false
    }
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
    /// Asks the store for each limit not yet decided, as long as it answers without
    /// waiting; returns the store's future for the first one it cannot.
    #[inline]
    pub(crate) fn advance<'l, St: Store>(
        &mut self,
        limiter: &'l Limiter<St>,
    ) -> Step<'l, St::Future> {
        while let Some(&index) = self.selected.get(self.decided.len()) {
            let policy = limiter.limits.policy(index);
            match limiter
                .store
                .check_now(self.key.as_bytes(), policy, self.cost)
            {
                Some(result) => {
                    if let Some(outcome) = self.record(limiter, index, result) {
                        return Step::Done(outcome);
                    }
                }
                None => {
                    self.waiting = index;
                    return Step::Wait(limiter.store.check(self.key.as_bytes(), policy, self.cost));
                }
            }
        }
        Step::Done(self.allowed(limiter))
    }

    /// Takes the store's answer to the future [`Evaluation::advance`] returned, and
    /// advances.
    pub(crate) fn resume<'l, St: Store>(
        &mut self,
        limiter: &'l Limiter<St>,
        result: Result<Decision, StoreError>,
    ) -> Step<'l, St::Future> {
        match self.record(limiter, self.waiting, result) {
            Some(outcome) => Step::Done(outcome),
            None => self.advance(limiter),
        }
    }

    /// Decides every limit with `decide`, which answers at once (the interceptor's
    /// memory store).
    #[cfg(feature = "tonic")]
    pub(crate) fn decide_all<'l, St: Store>(
        &mut self,
        limiter: &'l Limiter<St>,
        mut decide: impl FnMut(&[u8], &Policy, u32) -> Decision,
    ) -> Outcome<'l> {
        while let Some(&index) = self.selected.get(self.decided.len()) {
            let decision = decide(self.key.as_bytes(), limiter.limits.policy(index), self.cost);
            if let Some(outcome) = self.record(limiter, index, Ok(decision)) {
                return outcome;
            }
        }
        self.allowed(limiter)
    }

    /// Records the decision of policy `index`: the outcome when it ends the evaluation (a
    /// denial, a failed store), `None` when the next limit is to be asked.
    #[inline]
    fn record<'l, St: Store>(
        &mut self,
        limiter: &'l Limiter<St>,
        index: usize,
        result: Result<Decision, StoreError>,
    ) -> Option<Outcome<'l>> {
        match result {
            Ok(decision) => {
                self.decided.push((index, decision));
                if decision.is_allowed() {
                    return None;
                }
                // Evaluation stops at the first denial, so it is the most restrictive
                // decision: the one the answer reports.
                let verdict = Verdict {
                    policy: limiter.limits.policy(index),
                    decision,
                };
                let headers = limiter.rate_limit_headers(&self.decided);
                Some(Outcome::Deny { verdict, headers })
            }
            Err(error) => Some(store_failed(limiter, limiter.limits.policy(index), &error)),
        }
    }

    /// The outcome once every limit allowed the request.
    #[inline]
    fn allowed<St: Store>(&self, limiter: &Limiter<St>) -> Outcome<'static> {
        let headers = match limiter.header_style {
            HeaderStyle::None => RateLimitHeaders::none(),
            HeaderStyle::Legacy | HeaderStyle::Ietf | HeaderStyle::Both => {
                limiter.rate_limit_headers(&self.decided)
            }
        };
        let delay_us = self.decided.iter().map(|(_, d)| d.delay_micros()).max();
        let delay = delay_us.filter(|&us| us > 0).map(Duration::from_micros);
        Outcome::Allow { headers, delay }
    }
}

/// The outcome when the store failed to decide for `policy`.
fn store_failed<St>(
    limiter: &Limiter<St>,
    policy: &Policy,
    error: &StoreError,
) -> Outcome<'static> {
    match limiter.on_error {
        OnStoreError::Allow => {
            tracing::warn!(%error, policy = policy.name(), "rate limit store failed; letting the request through");
            Outcome::pass()
        }
        OnStoreError::Reject => {
            tracing::warn!(%error, policy = policy.name(), "rate limit store failed; answering 503");
            Outcome::Refuse(Refusal::StoreFailed)
        }
    }
}
