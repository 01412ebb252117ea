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
use tollway_core::Store;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::headers::RateLimitHeaders;
use crate::pipeline::{Action, Call, Limiter, Resume, Wait};
use crate::settle::Settlement;
use crate::shed::Permit;

pin_project! {
    /// The future of a [`RateLimit`](super::RateLimit) service's response.
    ///
    /// A state machine:
    ///
    /// 1. `Waiting`: for the caller's tier, when the layer looks tiers up and has not
    ///    cached it. Then for the store's decision.
    /// 2. `Delaying`: a shaping delay.
    /// 3. `Calling`: the inner service's future. When the layer settles after
    ///    responses, the response's body settles the call at its end.
    ///
    /// Or `Answered`, in the service's place. A request the store decides at once starts
    /// in `Calling` or `Answered`.
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
        state: State<St::Future, S::Future, S, B, St>,
        // The load shedder's count of this call, until the service answers.
        permit: Option<Permit>,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateOwned]
    enum State<C, F, S, B, St>
    where
        St: Store,
    {
        // The store is deciding the request's limits, or its caller's tier is being looked
        // up. The request waits in a box: it waits for I/O anyway, and the future of a
        // request decided at once stays small.
        Waiting { #[pin] wait: Wait<C>, pending: Box<Pending<S, B, St>> },
        // The request is admitted and held for its shaping delay, boxed likewise.
        Delaying { sleep: Pin<Box<Sleep>>, held: Box<Held<S, B, St>> },
        // The inner service is answering; its response gets `headers`, and its body
        // settles the call, `after`.
        Calling {
            #[pin] future: F,
            headers: RateLimitHeaders,
            after: Option<Box<Settlement<St>>>,
        },
        // The layer answers in the service's place.
        Answered { response: Response<Bytes> },
        // The response was returned.
        Done,
    }
}

/// A request waiting for the store or its caller's tier: where the pipeline resumes it,
/// and the ready service to call if its limits let it through.
pub(super) struct Pending<S, B, St> {
    limiter: Arc<Limiter<St>>,
    resume: Resume,
    service: S,
    request: Request<B>,
}

/// The state a request goes on to.
type Next<S, B, St> = State<<St as Store>::Future, <S as Service<Request<B>>>::Future, S, B, St>;

/// An admitted request and the ready service it will be handed to.
pub(super) struct Held<S, B, St: Store> {
    service: S,
    request: Request<B>,
    headers: RateLimitHeaders,
    after: Option<Box<Settlement<St>>>,
}

impl<S, B, St> ResponseFuture<S, B, St>
where
    S: Service<Request<B>> + Clone,
    St: Store,
{
    /// What `action` says to do with `request`, for the ready `service`: call it now or
    /// after a delay, answer in its place, or wait for the store or a lookup. A service
    /// that will be called later is taken, a clone left in its place.
    pub(super) fn new(
        limiter: &Arc<Limiter<St>>,
        action: Action<St>,
        service: &mut S,
        request: Request<B>,
    ) -> Self {
        let (state, permit) = next_state(limiter, action, service, request);
        ResponseFuture { state, permit }
    }
}

/// The state `action` leads `request` to, for the ready `service`, and the shedder's
/// permit when the service is called: called now or after a delay, answered in its place,
/// or waiting. A service that will be called later is taken, a clone left in its place.
fn next_state<S, B, St>(
    limiter: &Arc<Limiter<St>>,
    action: Action<St>,
    service: &mut S,
    request: Request<B>,
) -> (Next<S, B, St>, Option<Permit>)
where
    S: Service<Request<B>> + Clone,
    St: Store,
{
    match action {
        Action::Call(Call {
            headers,
            delay,
            after,
            permit,
        }) => {
            let state = match delay {
                None => State::calling(service, request, headers, after),
                Some(delay) => State::delaying(delay, take_ready(service), request, headers, after),
            };
            (state, permit)
        }
        Action::Answer(reply) => (
            State::Answered {
                response: reply.into_response(),
            },
            None,
        ),
        Action::Wait(wait, resume) => {
            let pending = Pending {
                limiter: Arc::clone(limiter),
                resume,
                service: take_ready(service),
                request,
            };
            let state = State::Waiting {
                wait,
                pending: Box::new(pending),
            };
            (state, None)
        }
    }
}

/// The ready service, for a request that will call it later; a clone takes its place and
/// waits for the next `poll_ready` (tower-service's "be careful when cloning inner
/// services").
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

impl<C, F, S, B, St: Store> State<C, F, S, B, St> {
    fn delaying(
        delay: Duration,
        service: S,
        request: Request<B>,
        headers: RateLimitHeaders,
        after: Option<Box<Settlement<St>>>,
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

impl<C, S, B, St> State<C, S::Future, S, B, St>
where
    S: Service<Request<B>>,
    St: Store,
{
    /// Calls `service` with `request`, into which a settled call's
    /// [`Usage`](crate::Usage) goes for its handler to report into.
    fn calling(
        service: &mut S,
        mut request: Request<B>,
        headers: RateLimitHeaders,
        after: Option<Box<Settlement<St>>>,
    ) -> Self {
        if let Some(usage) = after.as_deref().and_then(Settlement::usage) {
            request.extensions_mut().insert(usage.clone());
        }
        State::Calling {
            future: service.call(request),
            headers,
            after,
        }
    }
}

impl<S, B, St> Pending<S, B, St>
where
    S: Service<Request<B>> + Clone,
    St: Store,
{
    /// The next state once the wait came to `waited`, and the shedder's permit when the
    /// service is called: perhaps another wait (the store, after a tier lookup; the
    /// limits that enforce, after one in shadow mode denied).
    fn resume(self, waited: crate::pipeline::Waited) -> (Next<S, B, St>, Option<Permit>) {
        let Pending {
            limiter,
            resume,
            mut service,
            request,
        } = self;
        let action = limiter.resume(resume, waited, &request);
        next_state(&limiter, action, &mut service, request)
    }
}

impl<S, B, St> Held<S, B, St>
where
    S: Service<Request<B>>,
    St: Store,
{
    /// Calls the service: the delay is over.
    fn call<C>(self) -> State<C, S::Future, S, B, St> {
        let Held {
            mut service,
            request,
            headers,
            after,
        } = self;
        State::calling(&mut service, request, headers, after)
    }
}

impl<S, B, St, ResBody> Future for ResponseFuture<S, B, St>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    St: Store,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let (mut state, permit) = (this.state, this.permit);
        loop {
            // Each state's pinned future is polled in place; once it is ready, the state's
            // other fields are moved out (leaving `Done`) into the next state.
            match state.as_mut().project() {
                StateProj::Waiting { wait, .. } => {
                    let waited = ready!(wait.poll(cx));
                    let StateOwned::Waiting { pending, .. } =
                        state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Waiting")
                    };
                    let (next, admitted) = (*pending).resume(waited);
                    if admitted.is_some() {
                        *permit = admitted;
                    }
                    state.set(next);
                    restart_if_calling(&state, permit);
                }
                StateProj::Delaying { sleep, .. } => {
                    ready!(sleep.as_mut().poll(cx));
                    let StateOwned::Delaying { held, .. } =
                        state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Delaying")
                    };
                    state.set((*held).call());
                    restart_if_calling(&state, permit);
                }
                StateProj::Calling {
                    future,
                    headers,
                    after,
                } => {
                    // A failed call drops `after`, which settles it short.
                    let answer = ready!(future.poll(cx));
                    match (permit.take(), &answer) {
                        (Some(permit), Ok(_)) => permit.answered(),
                        // A failure, often fast, says nothing of the service's latency.
                        (Some(permit), Err(_)) => permit.discard(),
                        (None, _) => {}
                    }
                    let mut response = answer?;
                    std::mem::take(headers).insert_into(response.headers_mut());
                    let after = after.take();
                    state.set(State::Done);
                    return Poll::Ready(Ok(match after {
                        None => response.map(ResponseBody::service),
                        Some(mut after) => {
                            after.read(&response);
                            response.map(|body| ResponseBody::finishing(body, after))
                        }
                    }));
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

/// Starts the load shedder's clock for the call when `state` has just called the
/// service: the wait before it was not the service's time.
fn restart_if_calling<C, F, S, B, St: Store>(
    state: &Pin<&mut State<C, F, S, B, St>>,
    permit: &mut Option<Permit>,
) {
    if let (Some(permit), State::Calling { .. }) = (permit.as_mut(), state.as_ref().get_ref()) {
        permit.calling();
    }
}
