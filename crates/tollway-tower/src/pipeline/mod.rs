//! The one decision path: request → load shedding → key → limits → cost → store →
//! decision → what to do.
//!
//! The tower service, its response future and the gRPC interceptor all drive this
//! module and nothing else decides. There is one entry and one way back in:
//! [`Limiter::decide`] reads a request and comes to an [`Action`]: call the inner
//! service ([`Call`]: the headers to add, a shaping delay, the [`Settlement`] to finish
//! after the response and the load shedder's [`Permit`]), answer in its place, or
//! wait. The caller polls the [`Wait`] and hands what it came to, with the [`Resume`],
//! to [`Limiter::resume`], which comes to the next `Action`. Each caller is one `match`
//! over it.
//!
//! Inside, a request is a [`Progress`] (decided, or waiting), an [`Evaluation`] against
//! its limits, and an [`Outcome`]; `reply` turns an outcome into the answer, HTTP or
//! gRPC.

mod evaluation;
mod reply;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, Method, Request, StatusCode, Uri};
use pin_project_lite::pin_project;
use smallvec::SmallVec;
use tollway_core::{Clock, Decisions, Store, StoreError};

use crate::access::{AccessLists, Listed};
use crate::headers::{HeaderStyle, LimitValues, RateLimitHeaders};
use crate::key::{Key, KeyExtractor, peer_addr};
use crate::limits::{Limits, sent_uri};
use crate::lookup::{Found, LookupFuture, Lookups, OnLookupError, Plan, unknown_key};
use crate::rejection::{Refusal, RejectionHandler};
use crate::report::{DecisionEvent, DecisionOutcome, Failures, Reporter};
use crate::settle::{Ledger, Settlement};
use crate::shadow::Shadow;
use crate::shed::{Permit, Shed};
use crate::verdict::Verdict;

pub(crate) use evaluation::{Evaluation, Outcome};
pub(crate) use reply::Reply;

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
pub(crate) type CostFn = Arc<dyn Fn(&Method, &Uri, &HeaderMap) -> u64 + Send + Sync>;

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
) -> u64 {
    cost.map_or(1, |cost| cost(method, uri(), headers).max(1))
}

/// What a request costs one policy, from its method, URI, headers and extensions.
pub(crate) type PolicyCostFn =
    Arc<dyn Fn(&Method, &Uri, &HeaderMap, &http::Extensions) -> u64 + Send + Sync>;

/// A layer's current limiter, swapped whole when its limits are replaced
/// ([`RateLimitLayer::swap_limits`](crate::RateLimitLayer::swap_limits)): a request takes
/// the one current when it starts and keeps it to the end.
pub(crate) type Current<St> = Arc<arc_swap::ArcSwap<Limiter<St>>>;

/// Everything a layer decides with but the key extractor, shared by its clones, its
/// services and their futures.
pub(crate) struct Limiter<St> {
    /// The store, and what settles calls after their responses.
    pub(crate) ledger: Arc<Ledger<St>>,
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
    pub(crate) lookups: Option<Lookups>,
    /// Load shedding before the limits.
    pub(crate) shed: Option<Shed>,
}

/// What to do with a request: the pipeline's one answer.
// Matched as soon as it is returned: boxing a call would cost an allocation a request.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Action<St: Store> {
    /// Call the inner service.
    Call(Call<St>),
    /// Answer in the service's place.
    Answer(Reply),
    /// Poll the [`Wait`], then hand what it came to and the [`Resume`] to
    /// [`Limiter::resume`].
    Wait(Wait<St::Future>, Resume),
}

/// How to call the inner service with an admitted request.
pub(crate) struct Call<St: Store> {
    /// The rate-limit headers to add to its response.
    pub(crate) headers: RateLimitHeaders,
    /// How long to hold the request first (a shaping policy).
    pub(crate) delay: Option<Duration>,
    /// What to finish after its response: the settlement and the slots to give back.
    pub(crate) after: Option<Box<Settlement<St>>>,
    /// The load shedder's count of the call, until the service answers.
    pub(crate) permit: Option<Permit>,
}

/// Where a waiting request goes on.
pub(crate) struct Resume {
    at: At,
    permit: Option<Permit>,
    /// Whether it is answered in gRPC's terms.
    grpc: bool,
}

/// What a waiting request had come to before it waited.
#[derive(Debug)]
pub(crate) enum At {
    /// Its limits are being decided.
    Check(Evaluation),
    /// Its caller's tier is being looked up.
    Lookup(Key),
}

/// Where a request stands: decided, or waiting for the store or its caller's tier.
// Matched as soon as it is returned: boxing the outcome would cost an allocation a request.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Progress<'l, F> {
    Decided(Decided<'l>),
    /// Poll the [`Wait`], then hand what it came to and `At` to [`Limiter::waited`].
    Waiting(Wait<F>, At),
}

/// A decided request: its outcome, and what to settle after its response.
#[derive(Debug)]
pub(crate) struct Decided<'l> {
    pub(crate) outcome: Outcome<'l>,
    /// Only for a request let through, when the layer settles after responses, the
    /// settled policy is one of the request's, and the store decided it.
    pub(crate) charge: Option<crate::settle::Reservation>,
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
pub(crate) enum Waited {
    Checked(Result<Decisions, StoreError>),
    LookedUp(Result<Option<Plan>, Box<dyn std::error::Error + Send + Sync>>),
}

impl<F> Future for Wait<F>
where
    F: Future<Output = Result<Decisions, StoreError>>,
{
    type Output = Waited;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Waited> {
        match self.project() {
            WaitProj::Check { future } => future.poll(cx).map(Waited::Checked),
            WaitProj::Lookup { future } => future.as_mut().poll(cx).map(Waited::LookedUp),
        }
    }
}

impl<St: Store> Limiter<St> {
    /// What to do with `request`, whose key `extractor` finds; refusals answered as the
    /// layer's [`Protocol`] says.
    #[inline]
    pub(crate) fn decide<B, K>(&self, extractor: &K, request: &Request<B>) -> Action<St>
    where
        K: KeyExtractor<B>,
    {
        self.decide_in(extractor, request, self.protocol.grpc(request))
    }

    /// What to do with `request`, refusals answered in gRPC's terms when `grpc` says.
    #[inline]
    pub(crate) fn decide_in<B, K>(
        &self,
        extractor: &K,
        request: &Request<B>,
        grpc: bool,
    ) -> Action<St>
    where
        K: KeyExtractor<B>,
    {
        // A full service refuses before any key or store is asked.
        let permit = match &self.shed {
            None => None,
            Some(shed) => match shed.admit(request, source(extractor, request)) {
                Ok(permit) => Some(permit),
                Err(full) => {
                    return Action::Answer(reply::refuse(
                        Refusal::Overloaded(full.retry_after),
                        grpc,
                    ));
                }
            },
        };
        let progress = self.decision(extractor, request);
        self.act(progress, permit, grpc)
    }

    /// What to do with `request`, which waited at `resume`, now that its wait came to
    /// `waited`.
    pub(crate) fn resume<B>(
        &self,
        resume: Resume,
        waited: Waited,
        request: &Request<B>,
    ) -> Action<St> {
        let Resume { at, permit, grpc } = resume;
        let progress = self.waited(at, waited, request);
        self.act(progress, permit, grpc)
    }

    /// What `progress` comes to for the service: a call (with its settlement and the
    /// shedder's `permit`), an answer, or another wait.
    #[inline]
    fn act(
        &self,
        progress: Progress<'_, St::Future>,
        permit: Option<Permit>,
        grpc: bool,
    ) -> Action<St> {
        let Decided { outcome, charge } = match progress {
            Progress::Decided(decided) => decided,
            Progress::Waiting(wait, at) => return Action::Wait(wait, Resume { at, permit, grpc }),
        };
        match outcome {
            Outcome::Allow { headers, delay } => Action::Call(Call {
                headers,
                delay,
                after: charge.map(|charge| Box::new(Settlement::new(&self.ledger, charge))),
                permit,
            }),
            Outcome::Deny {
                policy,
                decision,
                headers,
            } => {
                discard(permit);
                let verdict = Verdict {
                    policy: policy.policy(),
                    decision,
                };
                Action::Answer(self.deny(verdict, headers, grpc))
            }
            Outcome::Refuse(refusal) => {
                discard(permit);
                Action::Answer(reply::refuse(refusal, grpc))
            }
        }
    }

    /// Where `request`, whose key `extractor` finds, stands: decided at once, or waiting
    /// for the store or a tier lookup (see [`waited`](Self::waited)).
    #[inline]
    pub(crate) fn decision<B, K>(
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
            None => self.limits.tier_for(&key),
            Some(lookups) => match lookups.cached(&key) {
                Some(found) => found,
                None => match lookups.start(&key, source(extractor, request).as_ref()) {
                    Some(future) => {
                        return Progress::Waiting(Wait::Lookup { future }, At::Lookup(key));
                    }
                    // Not looked up (a bound): unknown, this time.
                    None => Found::Unknown,
                },
            },
        };
        self.evaluate(key, found, request)
    }

    /// Where `request`, which waited at `at`, stands now that its wait came to
    /// `waited`.
    pub(crate) fn waited<B>(
        &self,
        at: At,
        waited: Waited,
        request: &Request<B>,
    ) -> Progress<'_, St::Future> {
        match (at, waited) {
            (At::Check(mut evaluation), Waited::Checked(answer)) => {
                let step = evaluation.decided(self, answer);
                self.progress(evaluation, step)
            }
            (At::Lookup(key), Waited::LookedUp(answer)) => self.looked_up(key, answer, request),
            // A wait's answer comes back with what it was waiting for.
            (At::Check(_), Waited::LookedUp(_)) | (At::Lookup(_), Waited::Checked(_)) => {
                unreachable!("a wait answered for another")
            }
        }
    }

    /// Goes on with `request` once its caller's tier lookup answered.
    fn looked_up<B>(
        &self,
        key: Key,
        answer: Result<Option<Plan>, Box<dyn std::error::Error + Send + Sync>>,
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
                    self.report(Some(&key), DecisionOutcome::LookupFailed);
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
        let (key, tier, own) = match found {
            Found::Tier(tier, own) => (key, tier, own),
            Found::Unknown => (unknown_key(), 0, None),
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
            own,
            cost,
            each,
            failed: false,
        };
        let step = evaluation.check(self);
        self.progress(evaluation, step)
    }

    /// Tells a decision no limit made (a list, a store failure, no key).
    fn report(&self, key: Option<&Key>, outcome: DecisionOutcome) {
        let event = DecisionEvent::new(key, outcome, &[], None);
        self.reporter.report(&event, None);
    }
}

impl<St> Limiter<St> {
    /// Whether a tonic interceptor can apply these limits: one sees neither the
    /// response nor the request's body, cannot hold a request or wait for a lookup, and
    /// answers in gRPC's terms.
    ///
    /// # Errors
    ///
    /// When a policy shapes (delays) requests or limits calls in flight, a policy is
    /// settled after responses, the layer sheds load, looks tiers up, or answers only
    /// in HTTP's terms: with what to use instead.
    pub(crate) fn interceptable(&self) -> Result<(), tollway_core::ConfigError> {
        use tollway_core::{Algorithm, ConfigError};
        let policies = self.limits.policies();
        let refused = |why: String| Err(ConfigError::new(why));
        let layer = "use the layer (Server::builder().layer(..))";
        if let Some(p) = policies
            .iter()
            .find(|p| p.algorithm() == Algorithm::LeakyBucketShaper)
        {
            return refused(format!(
                "policy {:?} shapes requests by delaying them, which an interceptor cannot \
                 do: {layer} for shaping",
                p.name()
            ));
        }
        // It never sees the response: a slot would never be given back, a reservation
        // never settled.
        if let Some(p) = policies
            .iter()
            .find(|p| p.algorithm() == Algorithm::Concurrency)
        {
            return refused(format!(
                "policy {:?} limits calls in flight until their responses end, which an \
                 interceptor never sees: {layer}",
                p.name()
            ));
        }
        if self.ledger.settle.is_some() {
            return refused(format!(
                "the layer settles a policy after responses, which an interceptor never \
                 sees: {layer}"
            ));
        }
        if self.shed.is_some() {
            return refused(format!(
                "the layer sheds load, counting calls until their responses, which an \
                 interceptor never sees: {layer}"
            ));
        }
        if self.lookups.is_some() {
            return refused(format!(
                "the layer looks tiers up, which takes a wait an interceptor cannot take: \
                 {layer}, or tiers() with a map"
            ));
        }
        if self.protocol == Protocol::Http {
            return refused(
                "the layer answers in HTTP's terms only (Protocol::Http), and an interceptor \
                 answers gRPC calls: build it with Protocol::Detect or Protocol::Grpc"
                    .to_owned(),
            );
        }
        Ok(())
    }
}

/// A call refused by a limit ends the shedder's count of it, untimed: its time says
/// nothing of the service's latency.
fn discard(permit: Option<Permit>) {
    if let Some(permit) = permit {
        permit.discard();
    }
}

/// A request decided before any limit was asked: nothing to charge after it.
fn decided<F>(outcome: Outcome<'_>) -> Progress<'_, F> {
    Progress::Decided(Decided {
        outcome,
        charge: None,
    })
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
