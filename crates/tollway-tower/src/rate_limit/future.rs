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
use crate::pipeline::{Answer, Decided, Limiter, Next, Progress, Resume, Wait};
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
    at: Resume,
    service: S,
    request: Request<B>,
}

/// An admitted request and the ready service it will be handed to.
pub(super) struct Held<S, B, St: Store> {
    service: S,
    request: Request<B>,
    headers: RateLimitHeaders,
    after: Option<Box<Settlement<St>>>,
}

/// Calls `service` with `request`, into which a settled call's [`Usage`](crate::Usage)
/// goes for its handler to report into.
pub(super) fn call<S, B, St: Store>(
    service: &mut S,
    mut request: Request<B>,
    after: Option<&Settlement<St>>,
) -> S::Future
where
    S: Service<Request<B>>,
{
    if let Some(usage) = after.and_then(Settlement::usage) {
        request.extensions_mut().insert(usage.clone());
    }
    service.call(request)
}

impl<S, B, St> ResponseFuture<S, B, St>
where
    S: Service<Request<B>>,
    St: Store,
{
    /// Waits for `wait`, then goes on with `pending`.
    pub(super) fn waiting(wait: Wait<St::Future>, pending: Pending<S, B, St>) -> Self {
        Self::from(State::Waiting {
            wait,
            pending: Box::new(pending),
        })
    }

    /// Holds `request` for `delay`, then calls `service` with it.
    pub(super) fn delaying(
        delay: Duration,
        service: S,
        request: Request<B>,
        headers: RateLimitHeaders,
        after: Option<Box<Settlement<St>>>,
    ) -> Self {
        Self::from(State::delaying(delay, service, request, headers, after))
    }

    /// Waits for the service's `future`, then adds `headers` to its response and
    /// charges what it used (`after`).
    pub(super) fn calling(
        future: S::Future,
        headers: RateLimitHeaders,
        after: Option<Box<Settlement<St>>>,
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

    fn from(state: State<St::Future, S::Future, S, B, St>) -> Self {
        ResponseFuture {
            state,
            permit: None,
        }
    }

    /// Holds the load shedder's `permit` until the service answers.
    pub(super) fn holding(mut self, permit: Option<Permit>) -> Self {
        self.permit = permit;
        self
    }
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

impl<S, B, St> Pending<S, B, St> {
    /// `request`, waiting at `at`, to be handed to the ready `service`.
    pub(super) fn new(
        limiter: Arc<Limiter<St>>,
        at: Resume,
        service: S,
        request: Request<B>,
    ) -> Self {
        Pending {
            limiter,
            at,
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
    /// The next state once the wait came to `answer`: perhaps another wait (the store,
    /// after a tier lookup; the limits that enforce, after one in shadow mode denied).
    fn resume(mut self: Box<Self>, answer: Answer) -> State<St::Future, S::Future, S, B, St> {
        let at = self.at;
        let Decided { outcome, charge } = match self.limiter.resume(at, answer, &self.request) {
            Progress::Decided(decided) => decided,
            Progress::Waiting(wait, at) => {
                self.at = at;
                return State::Waiting {
                    wait,
                    pending: self,
                };
            }
        };
        let next = self.limiter.next(outcome, &self.request);
        let after = charge.map(|charge| Box::new(Settlement::new(&self.limiter, charge)));
        State::next(next, after, self.service, self.request)
    }
}

impl<C, S, B, St> State<C, S::Future, S, B, St>
where
    S: Service<Request<B>>,
    St: Store,
{
    /// The state that does what `next` says: call the service (after a delay), or
    /// answer in its place.
    fn next(
        next: Next,
        after: Option<Box<Settlement<St>>>,
        mut service: S,
        request: Request<B>,
    ) -> Self {
        match next {
            Next::Call { headers, delay } => match delay {
                None => State::Calling {
                    future: call(&mut service, request, after.as_deref()),
                    headers,
                    after,
                },
                Some(delay) => State::delaying(delay, service, request, headers, after),
            },
            Next::Answer(response) => State::Answered { response },
        }
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
        State::Calling {
            future: call(&mut service, request, after.as_deref()),
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
        let this = self.project();
        let (mut state, permit) = (this.state, this.permit);
        loop {
            // Each state's pinned future is polled in place; once it is ready, the state's
            // other fields are moved out (leaving `Done`) into the next state.
            match state.as_mut().project() {
                StateProj::Waiting { wait, .. } => {
                    let answer = ready!(wait.poll(cx));
                    let StateOwned::Waiting { pending, .. } =
                        state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Waiting")
                    };
                    state.set(pending.resume(answer));
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
                    // Not the service's answer: no latency to learn from.
                    if let Some(permit) = permit.take() {
                        permit.discard();
                    }
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
