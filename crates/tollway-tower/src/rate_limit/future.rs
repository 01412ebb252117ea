//! The response future: wait for the store or a shaping delay if the decision needs
//! them, then call the service, or answer in its place.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tollway_core::{Checked, Decisions, Operation, Store, StoreError};
use tower_service::Service;

use crate::body::ResponseBody;
use crate::headers::RateLimitHeaders;
use crate::key::Key;
use crate::lookup::LookupFuture;
use crate::pipeline::{Evaluation, Limiter, Lookup, Next, Start, Step};

pin_project! {
    /// The future of a [`RateLimit`](super::RateLimit) service's response.
    ///
    /// A state machine: `LookingUp` (the caller's tier, when the layer looks tiers up and
    /// has not cached it) → `Checking` (the store's future) → `Delaying` (a shaping delay)
    /// → `Calling` (the inner service's future) → `Charging` (the store charging what
    /// the response reports it used, when the layer charges after responses), or
    /// `Answered` in the service's place. A request the store decides at once starts in
    /// `Calling` or `Answered`.
    ///
    /// # Panics
    ///
    /// When polled again after it completed, like any future that makes no promise
    /// about that.
    pub struct ResponseFuture<S, B, St>
    where
        S: Service<Request<B>>,
        St: Store,
    {
        #[pin]
        state: State<St::Future, S::Future, S, B, St, S::Response>,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateOwned]
    enum State<C, F, S, B, St, R> {
        // The caller's tier is being looked up; the request waits in a box, as below.
        LookingUp { lookup: LookupFuture, waiting: Box<Waiting<S, B, St>> },
        // The store is deciding the request's limits. The request waits in a box:
        // it waits for I/O anyway, and the future of a request decided at once stays small.
        Checking { #[pin] check: C, pending: Box<Pending<S, B, St>> },
        // The request is admitted and held for its shaping delay, boxed likewise.
        Delaying { sleep: Pin<Box<Sleep>>, held: Box<Held<S, B, St>> },
        // The inner service is answering; its response gets `headers`, and is charged
        // for what it reports it used, `after`.
        Calling {
            #[pin] future: F,
            headers: RateLimitHeaders,
            after: Option<Box<AfterResponse<St>>>,
        },
        // The store is charging what the response used; then the response is returned.
        Charging { #[pin] charge: C, response: R, after: Box<AfterResponse<St>> },
        // The layer answers in the service's place.
        Answered { response: Response<Bytes> },
        // The response was returned.
        Done,
    }
}

/// A request waiting for the store: what its evaluation needs, and the ready service to
/// call if the limits let it through.
pub(super) struct Pending<S, B, St> {
    limiter: Arc<Limiter<St>>,
    evaluation: Evaluation,
    service: S,
    request: Request<B>,
}

/// A request waiting for its caller's tier, and the ready service to call if its limits
/// let it through.
pub(super) struct Waiting<S, B, St> {
    limiter: Arc<Limiter<St>>,
    key: Key,
    service: S,
    request: Request<B>,
}

/// An admitted request and the ready service it will be handed to.
pub(super) struct Held<S, B, St> {
    service: S,
    request: Request<B>,
    headers: RateLimitHeaders,
    after: Option<Box<AfterResponse<St>>>,
}

/// What charging a response for the units it used needs: the layer, and the request's
/// caller and limits. Made only when the layer charges after responses.
pub(super) struct AfterResponse<St> {
    limiter: Arc<Limiter<St>>,
    evaluation: Evaluation,
}

impl<St: Store> AfterResponse<St> {
    /// The charge after the response to the request of `evaluation`, if the layer
    /// charges after responses.
    pub(super) fn new(limiter: &Arc<Limiter<St>>, evaluation: Evaluation) -> Option<Box<Self>> {
        let after = limiter.charge_after.as_ref()?;
        // A request the store failed to decide is not charged either: the store is down.
        if evaluation.failed() || !evaluation.applies(after.policy) {
            return None;
        }
        Some(Box::new(AfterResponse {
            limiter: Arc::clone(limiter),
            evaluation,
        }))
    }

    /// Charges the units `response` reports: done at once, or the store's future.
    fn charge<R>(&self, response: &Response<R>) -> Option<St::Future> {
        let after = self.limiter.charge_after.as_ref()?;
        let units = (after.units)(response.status(), response.headers(), response.extensions());
        if units == 0 {
            return None;
        }
        let policy = self.limiter.limits.policy(after.policy);
        let key = self.evaluation.key().as_bytes();
        match self
            .limiter
            .store
            .operate(key, &[policy], Operation::Charge(units))
        {
            Checked::Ready(answer) => {
                charged(&self.limiter, answer);
                None
            }
            Checked::Pending(future) => Some(future),
        }
    }
}

/// Tells a failed charge the way a failed decision is told (apart: the decisions may go
/// on from a fallback while charges fail).
fn charged<St>(limiter: &Limiter<St>, answer: Result<Decisions, StoreError>) {
    match answer {
        Ok(_) => limiter.charge_failures.succeeded(),
        Err(error) => limiter
            .charge_failures
            .failed(&error, "responses go uncharged for what they used"),
    }
}

impl<S, B, St> ResponseFuture<S, B, St>
where
    S: Service<Request<B>>,
    St: Store,
{
    /// Waits for the tier `lookup` of `request`'s caller, then decides it.
    pub(super) fn looking_up(
        lookup: Lookup,
        limiter: Arc<Limiter<St>>,
        service: S,
        request: Request<B>,
    ) -> Self {
        Self::from(State::LookingUp {
            lookup: lookup.future,
            waiting: Box::new(Waiting {
                limiter,
                key: lookup.key,
                service,
                request,
            }),
        })
    }

    /// Waits for the store's `check`, then goes on with `pending`.
    pub(super) fn checking(check: St::Future, pending: Pending<S, B, St>) -> Self {
        Self::from(State::Checking {
            check,
            pending: Box::new(pending),
        })
    }

    /// Holds `request` for `delay`, then calls `service` with it.
    pub(super) fn delaying(
        delay: Duration,
        service: S,
        request: Request<B>,
        headers: RateLimitHeaders,
        after: Option<Box<AfterResponse<St>>>,
    ) -> Self {
        Self::from(State::delaying(delay, service, request, headers, after))
    }

    /// Waits for the service's `future`, then adds `headers` to its response and
    /// charges what it used (`after`).
    pub(super) fn calling(
        future: S::Future,
        headers: RateLimitHeaders,
        after: Option<Box<AfterResponse<St>>>,
    ) -> Self {
        Self::from(State::Calling {
            future,
            headers,
            after,
        })
    }

    /// Answers `response` without calling the service.
    pub(super) fn answered(response: Response<Bytes>) -> Self {
        Self::from(State::Answered { response })
    }

    fn from(state: State<St::Future, S::Future, S, B, St, S::Response>) -> Self {
        ResponseFuture { state }
    }
}

impl<C, F, S, B, St, R> State<C, F, S, B, St, R> {
    fn delaying(
        delay: Duration,
        service: S,
        request: Request<B>,
        headers: RateLimitHeaders,
        after: Option<Box<AfterResponse<St>>>,
    ) -> Self {
        State::Delaying {
            sleep: Box::pin(tokio::time::sleep(delay)),
            held: Box::new(Held {
                service,
                request,
                headers,
                after,
            }),
        }
    }
}

impl<S, B, St> Pending<S, B, St> {
    /// `request`, being checked by `evaluation`, to be handed to the ready `service`.
    pub(super) fn new(
        limiter: Arc<Limiter<St>>,
        evaluation: Evaluation,
        service: S,
        request: Request<B>,
    ) -> Self {
        Pending {
            limiter,
            evaluation,
            service,
            request,
        }
    }
}

impl<S, B, St> Pending<S, B, St>
where
    S: Service<Request<B>>,
    St: Store,
{
    /// The next state once the store answered: perhaps another check (the limits that
    /// enforce, after one in shadow mode denied).
    fn resume(
        mut self: Box<Self>,
        answer: Result<Decisions, StoreError>,
    ) -> State<St::Future, S::Future, S, B, St, S::Response> {
        let outcome = match self.evaluation.decided(&self.limiter, answer) {
            Step::Done(outcome) => outcome,
            Step::Wait(check) => {
                return State::Checking {
                    check,
                    pending: self,
                };
            }
        };
        let next = self.limiter.next(outcome, &self.request);
        let Pending {
            limiter,
            evaluation,
            service,
            request,
        } = *self;
        State::next(next, &limiter, Some(evaluation), service, request)
    }
}

impl<S, B, St> Waiting<S, B, St>
where
    S: Service<Request<B>>,
    St: Store,
{
    /// The next state once the caller's tier is known: decided now, or the store's check.
    fn resume(
        self,
        answer: Result<Option<String>, Box<dyn std::error::Error + Send + Sync>>,
    ) -> State<St::Future, S::Future, S, B, St, S::Response> {
        let Waiting {
            limiter,
            key,
            service,
            request,
        } = self;
        let (outcome, evaluation) = match limiter.looked_up(key, answer, &request) {
            Start::Decided(outcome) => (outcome, None),
            Start::Evaluate(mut evaluation) => match evaluation.check(&limiter) {
                Step::Done(outcome) => (outcome, Some(evaluation)),
                Step::Wait(check) => {
                    let limiter = Arc::clone(&limiter);
                    let pending = Pending::new(limiter, evaluation, service, request);
                    return State::Checking {
                        check,
                        pending: Box::new(pending),
                    };
                }
            },
            // A lookup's answer decides the tier: nothing is looked up twice.
            Start::Lookup(_) => unreachable!("looked_up never starts another lookup"),
        };
        let next = limiter.next(outcome, &request);
        State::next(next, &limiter, evaluation, service, request)
    }
}

impl<C, S, B, St> State<C, S::Future, S, B, St, S::Response>
where
    S: Service<Request<B>>,
    St: Store,
{
    /// The state that does what `next` says: call the service (after a delay), or
    /// answer in its place.
    fn next(
        next: Next,
        limiter: &Arc<Limiter<St>>,
        evaluation: Option<Evaluation>,
        mut service: S,
        request: Request<B>,
    ) -> Self {
        match next {
            Next::Call { headers, delay } => {
                let after = evaluation.and_then(|e| AfterResponse::new(limiter, e));
                match delay {
                    None => State::Calling {
                        future: service.call(request),
                        headers,
                        after,
                    },
                    Some(delay) => State::delaying(delay, service, request, headers, after),
                }
            }
            Next::Answer(response) => State::Answered { response },
        }
    }
}

impl<S, B, St> Held<S, B, St>
where
    S: Service<Request<B>>,
{
    /// Calls the service: the delay is over.
    fn call<C>(self) -> State<C, S::Future, S, B, St, S::Response> {
        let Held {
            mut service,
            request,
            headers,
            after,
        } = self;
        State::Calling {
            future: service.call(request),
            headers,
            after,
        }
    }
}

impl<S, B, St, ResBody> Future for ResponseFuture<S, B, St>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    St: Store,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            // Each state's pinned future is polled in place; once it is ready, the state's
            // other fields are moved out (leaving `Done`) into the next state.
            match state.as_mut().project() {
                StateProj::LookingUp { lookup, .. } => {
                    let answer = ready!(lookup.as_mut().poll(cx));
                    let StateOwned::LookingUp { waiting, .. } =
                        state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was LookingUp")
                    };
                    state.set((*waiting).resume(answer));
                }
                StateProj::Checking { check, .. } => {
                    let result = ready!(check.poll(cx));
                    let StateOwned::Checking { pending, .. } =
                        state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Checking")
                    };
                    state.set(pending.resume(result));
                }
                StateProj::Delaying { sleep, .. } => {
                    ready!(sleep.as_mut().poll(cx));
                    let StateOwned::Delaying { held, .. } =
                        state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Delaying")
                    };
                    state.set((*held).call());
                }
                StateProj::Calling {
                    future,
                    headers,
                    after,
                } => {
                    let mut response = ready!(future.poll(cx))?;
                    std::mem::take(headers).insert_into(response.headers_mut());
                    if let Some(after) = after.take()
                        && let Some(charge) = after.charge(&response)
                    {
                        state.set(State::Charging {
                            charge,
                            response,
                            after,
                        });
                        continue;
                    }
                    state.set(State::Done);
                    return Poll::Ready(Ok(response.map(ResponseBody::service)));
                }
                StateProj::Charging { charge, .. } => {
                    let answer = ready!(charge.poll(cx));
                    let StateOwned::Charging {
                        response, after, ..
                    } = state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Charging")
                    };
                    charged(&after.limiter, answer);
                    return Poll::Ready(Ok(response.map(ResponseBody::service)));
                }
                StateProj::Answered { .. } => {
                    let StateOwned::Answered { response } =
                        state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Answered")
                    };
                    return Poll::Ready(Ok(response.map(ResponseBody::layer)));
                }
                StateProj::Done => panic!("ResponseFuture polled after it completed"),
            }
        }
    }
}
