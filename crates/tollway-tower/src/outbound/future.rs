//! The response future: check, wait while over the limit, call, then tell the store
//! what the response said.

use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{Request, Response};
use pin_project_lite::pin_project;
use smallvec::SmallVec;
use tollway_core::{Checked, Decisions, Denial, Operation, Policy, Store, StoreError};
use tower_service::Service;

use super::error::OutboundError;
use super::shared::Shared;
use super::{Replay, pause_of};
use crate::key::Key;
use crate::report::{DecisionEvent, DecisionOutcome};
use crate::verdict::{Verdict, max_delay, most_restrictive};

type BoxError = Box<dyn Error + Send + Sync>;
/// The store operations a response calls for, run before the response is handed on.
type Work = Pin<Box<dyn Future<Output = ()> + Send>>;

pin_project! {
    #[project = ResponseFutureProj]
    /// The future of an [`Outbound`](super::Outbound) request, a state machine:
    ///
    /// 1. `Start`.
    /// 2. `Pausing`: is a pause running for the key?
    /// 3. `Checking`: the limits.
    /// 4. `Sleeping` while over them, then `Start` again.
    /// 5. `Ready`: the inner service made ready.
    /// 6. `Calling`.
    /// 7. `After`: the store told of a 429's pause, or of the real cost.
    /// 8. The response, or `Start` again with a copy of a refused request.
    ///
    /// Or it ends in an [`OutboundError`]. Or in the inner service's error: when that is
    /// an outbound layer's refusal (a stacked layer's limit), nothing was sent, and this
    /// layer first gives its charge back (`Refunding`).
    pub struct ResponseFuture<S, St, B, R>
    where
        S: Service<Request<B>>,
        St: Store,
    {
        #[pin]
        state: State<S::Future, St::Future, S::Response>,
        inner: S,
        shared: Arc<Shared<St, R>>,
        keys: RequestKeys,
        cost: u64,
        request: Option<Request<B>>,
        // The copy to send if the upstream refuses the request (made before it is sent).
        spare: Option<Request<B>>,
        // The upstream's refusal, while its copy is on its way: the answer if the copy
        // cannot be sent.
        refused: Option<S::Response>,
        waited: Duration,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, C, R> {
        Start,
        Pausing { #[pin] check: C },
        Checking { #[pin] check: C },
        // Over a limit or paused: back to `Start` when it ends; or admitted with a
        // shaper's delay: on to `Ready`.
        Sleeping { #[pin] sleep: tokio::time::Sleep, then_call: bool },
        Ready,
        Calling { #[pin] call: F },
        // `again`: send the spare copy after the work, rather than answer the response.
        After { work: Work, response: Option<R>, again: bool },
        // An outbound layer inside this one refused the request: this one's charge is
        // given back, then its error answered.
        Refunding { work: Work, error: Option<BoxError> },
        // Finished: polled again, it answers an error rather than resume what ended.
        Done,
    }
}

/// A request's keys: whose budget it draws on, and whose pause it waits out and starts.
#[derive(Debug)]
pub(super) struct RequestKeys {
    /// `None`: not limited (nor paused).
    pub(super) limits: Option<Key>,
    /// `None`: never paused (always so when not limited, or the layer never pauses).
    pub(super) pause: Option<Key>,
}

impl<S, St, B, R> ResponseFuture<S, St, B, R>
where
    S: Service<Request<B>>,
    St: Store,
{
    pub(super) fn new(
        inner: S,
        shared: Arc<Shared<St, R>>,
        keys: RequestKeys,
        cost: u64,
        request: Request<B>,
    ) -> Self {
        ResponseFuture {
            state: State::Start,
            inner,
            shared,
            keys,
            cost,
            request: Some(request),
            spare: None,
            refused: None,
            waited: Duration::ZERO,
        }
    }
}

impl<S, St, B, R> std::fmt::Debug for ResponseFuture<S, St, B, R>
where
    S: Service<Request<B>>,
    St: Store,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("keys", &self.keys)
            .field("cost", &self.cost)
            .field("waited", &self.waited)
            .finish_non_exhaustive()
    }
}

impl<S, St, B, R, RB> Future for ResponseFuture<S, St, B, R>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    St: Store,
    R: Replay<B> + Send + Sync + 'static,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let output = ready!(self.as_mut().drive(cx));
        self.project().state.set(State::Done);
        Poll::Ready(output)
    }
}

impl<S, St, B, R, RB> ResponseFuture<S, St, B, R>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    St: Store,
    R: Replay<B> + Send + Sync + 'static,
{
    /// Runs the state machine until it answers or waits. Anything that fails on the way
    /// to a refused request's second answer answers the first.
    fn drive(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<S::Response, BoxError>> {
        let mut this = self.project();
        loop {
            let next = match this.step(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(Step::Next(state))) => state,
                Poll::Ready(Ok(Step::Answer(response))) => {
                    this.refused.take();
                    return Poll::Ready(Ok(response));
                }
                Poll::Ready(Err(e)) => {
                    let Some(refused) = this.refused.take() else {
                        return Poll::Ready(Err(e));
                    };
                    tracing::debug!(error = %e, "outbound: a refused request could not go again");
                    return Poll::Ready(Ok(refused));
                }
            };
            this.state.set(next);
        }
    }
}

/// What one step of the state machine comes to.
enum Step<F, C, R> {
    Next(State<F, C, R>),
    Answer(R),
}

impl<S, St, B, R, RB> ResponseFutureProj<'_, S, St, B, R>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    St: Store,
    R: Replay<B> + Send + Sync + 'static,
{
    /// Moves the state machine one state on, if it can.
    #[allow(clippy::type_complexity)]
    fn step(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Step<S::Future, St::Future, S::Response>, BoxError>> {
        let this = self;
        let next = match this.state.as_mut().project() {
            StateProj::Start => {
                let keys = (this.keys.limits.as_ref(), this.keys.pause.as_ref());
                match (keys, &this.shared.pause) {
                    // No key: not limited.
                    ((None, _), _) => State::Ready,
                    ((Some(key), Some(pause_key)), Some(pause)) => {
                        let whole = Operation::Peek(capacity(pause));
                        match this
                            .shared
                            .store
                            .operate(pause_key.as_bytes(), &[pause], whole)
                        {
                            Checked::Ready(answer) => {
                                unpaused(answer, this.shared, key, *this.cost, this.waited)?
                            }
                            Checked::Pending(check) => State::Pausing { check },
                        }
                    }
                    ((Some(key), _), _) => limits(this.shared, key, *this.cost, this.waited)?,
                }
            }
            StateProj::Pausing { check } => {
                let answer = ready!(check.poll(cx));
                let key = this.keys.limits.as_ref().ok_or(UNKEYED)?;
                unpaused(answer, this.shared, key, *this.cost, this.waited)?
            }
            StateProj::Checking { check } => {
                let answer = ready!(check.poll(cx));
                let key = this.keys.limits.as_ref().ok_or(UNKEYED)?;
                decided(answer, this.shared, key, this.waited)?
            }
            StateProj::Sleeping { sleep, then_call } => {
                ready!(sleep.poll(cx));
                if *then_call {
                    State::Ready
                } else {
                    State::Start
                }
            }
            StateProj::Ready => {
                ready!(this.inner.poll_ready(cx)).map_err(Into::into)?;
                let request = this
                    .request
                    .take()
                    .ok_or("outbound request polled after it was sent")?;
                // The first time only, and only if a refusal would pause (and so be
                // waited out before the copy goes) and the request may wait at all.
                if this.refused.is_none()
                    && this.keys.pause.is_some()
                    && this.shared.pause.is_some()
                    && !this.shared.max_wait.is_zero()
                {
                    *this.spare = this.shared.replay.replay(&request);
                }
                State::Calling {
                    call: this.inner.call(request),
                }
            }
            StateProj::Calling { call } => {
                let mut response = match ready!(call.poll(cx)) {
                    Ok(response) => response,
                    Err(error) => {
                        let error: BoxError = error.into();
                        let Some(work) = unsent(this.shared, &this.keys.limits, *this.cost, &error)
                        else {
                            return Poll::Ready(Err(error));
                        };
                        let error = Some(error);
                        return Poll::Ready(Ok(Step::Next(State::Refunding { work, error })));
                    }
                };
                let Some(key) = this.keys.limits.as_ref() else {
                    return Poll::Ready(Ok(Step::Answer(response)));
                };
                // One 429, one pause: a copy's refusal pauses nobody again (its first
                // refusal did, and the copy waited that out), nor does a refusal an
                // outbound layer inside this one handed on (it paused, or had paused).
                let handled = response.extensions().get::<Handled>().is_some();
                let pause_key = (this.refused.is_none() && !handled)
                    .then_some(this.keys.pause.as_ref())
                    .flatten();
                let (work, pause) = told(this.shared, key, pause_key, *this.cost, &response);
                // Again if the upstream refused it, a copy was made, the pause ends
                // within what is left of the wait, and no outbound layer inside this one
                // handed the refusal on already (stacked layers would multiply the sends).
                let left = this.shared.max_wait.saturating_sub(*this.waited);
                let again =
                    !handled && this.spare.is_some() && pause.is_some_and(|pause| pause <= left);
                if pause.is_some() && !again {
                    response.extensions_mut().insert(Handled);
                }
                match work {
                    Some(work) => State::After {
                        work,
                        response: Some(response),
                        again,
                    },
                    None => return Poll::Ready(Ok(Step::Answer(response))),
                }
            }
            StateProj::After {
                work,
                response,
                again,
            } => {
                ready!(work.as_mut().poll(cx));
                let response = response
                    .take()
                    .ok_or("outbound response polled after it was handed on")?;
                match this.spare.take() {
                    Some(spare) if *again => {
                        *this.refused = Some(response);
                        *this.request = Some(spare);
                        State::Start
                    }
                    _ => return Poll::Ready(Ok(Step::Answer(response))),
                }
            }
            StateProj::Refunding { work, error } => {
                ready!(work.as_mut().poll(cx));
                let error = error
                    .take()
                    .unwrap_or_else(|| "outbound refusal polled after it was handed on".into());
                return Poll::Ready(Err(error));
            }
            StateProj::Done => {
                return Poll::Ready(Err("outbound future polled after it completed".into()));
            }
        };
        Poll::Ready(Ok(Step::Next(next)))
    }
}

/// The refund of this layer's charge for a request an outbound layer inside it refused
/// with `error`: the request was never sent, so it used nothing here either. `None` when
/// the error is another (the request may have gone), or nothing was charged.
fn unsent<St: Store, R: Send + Sync + 'static>(
    shared: &Arc<Shared<St, R>>,
    key: &Option<Key>,
    cost: u64,
    error: &BoxError,
) -> Option<Work> {
    let key = key
        .as_ref()
        .filter(|_| cost > 0 && error.is::<OutboundError>())?;
    let (shared, key) = (Arc::clone(shared), key.clone());
    Some(Box::pin(async move {
        let policies: SmallVec<[&Policy; 4]> = shared.policies.iter().collect();
        let refund = Operation::Refund(cost);
        if let Err(e) = shared
            .store
            .operate(key.as_bytes(), &policies, refund)
            .await
        {
            tracing::warn!(error = %e, "outbound: the store failed to refund an unsent request");
        }
    }))
}

/// What a store's answer for an unkeyed request says: it is never asked one.
const UNKEYED: &str = "outbound: a store answered for a request with no key";

/// Marks a refusal an outbound layer hands on: a layer around it does not send the
/// request again (one more send per request, however many layers).
#[derive(Clone, Copy, Debug)]
struct Handled;

/// The whole of the pause policy's capacity, in milliseconds: it fits only while no
/// pause runs.
fn capacity(pause: &Policy) -> u64 {
    pause.quota().burst()
}

/// Asks the store to decide the request's limits.
fn limits<F, C, R, St, P>(
    shared: &Shared<St, P>,
    key: &Key,
    cost: u64,
    waited: &mut Duration,
) -> Result<State<F, C, R>, BoxError>
where
    St: Store<Future = C>,
{
    let policies: SmallVec<[&Policy; 4]> = shared.policies.iter().collect();
    match shared.store.check(key.as_bytes(), &policies, cost) {
        Checked::Ready(answer) => decided(answer, shared, key, waited),
        Checked::Pending(check) => Ok(State::Checking { check }),
    }
}

/// What follows the limits' `answer` for the request of `key`, told first as the server
/// side tells its decisions: the debug event, the metrics, the listener.
fn decided<F, C, R, St, P>(
    answer: Result<Decisions, StoreError>,
    shared: &Shared<St, P>,
    key: &Key,
    waited: &mut Duration,
) -> Result<State<F, C, R>, BoxError> {
    if shared.reporter.active() {
        report(&answer, &shared.policies, shared, key);
    }
    after(answer, shared, waited)
}

/// Tells the `answer` of `policies` (the limits, or the pause) for the request of `key`
/// (`outbound:` and the key).
fn report<St, P>(
    answer: &Result<Decisions, StoreError>,
    policies: &[Policy],
    shared: &Shared<St, P>,
    key: &Key,
) {
    let key = Key::new("outbound", key.as_bytes());
    let Ok(decisions) = answer else {
        let event = DecisionEvent::new(Some(&key), DecisionOutcome::StoreError, &[], None);
        shared.reporter.report(&event, None);
        return;
    };
    let verdicts: SmallVec<[Verdict<'_>; 2]> = policies
        .iter()
        .zip(decisions.iter())
        .map(|(policy, &decision)| Verdict { policy, decision })
        .collect();
    let Some(most) = most_restrictive(&verdicts) else {
        return;
    };
    let outcome = DecisionOutcome::of(&verdicts[most], decisions.is_allowed());
    let event = DecisionEvent::new(Some(&key), outcome, &verdicts, Some(most));
    shared.reporter.report(&event, Some(most));
}

/// What follows the pause store's answer: the limits when no pause runs, else a sleep
/// until it ends (or the error, past `max_wait`).
fn unpaused<F, C, R, St, P>(
    answer: Result<Decisions, StoreError>,
    shared: &Shared<St, P>,
    key: &Key,
    cost: u64,
    waited: &mut Duration,
) -> Result<State<F, C, R>, BoxError>
where
    St: Store<Future = C>,
{
    match answer {
        Ok(decisions) if decisions.is_allowed() => limits(shared, key, cost, waited),
        // A pause runs (or the store failed): told like a refusal of the limits.
        answer => {
            if shared.reporter.active() {
                report(&answer, shared.pause.as_slice(), shared, key);
            }
            after(answer, shared, waited)
        }
    }
}

/// What follows the store's answer: the call (after a shaper's delay, if any), a sleep
/// until the limits would admit the request, or the error that ends it.
fn after<F, C, R, St, P>(
    answer: Result<Decisions, StoreError>,
    shared: &Shared<St, P>,
    waited: &mut Duration,
) -> Result<State<F, C, R>, BoxError> {
    let decisions = answer.map_err(|e| Box::new(OutboundError::Store(e)))?;
    if decisions.is_allowed() {
        // A shaper's delay: the request is admitted (and charged) already, so it goes
        // after the delay whatever `max_wait` says, and a drop during it keeps the charge.
        let Some(delay) = max_delay(decisions.iter()) else {
            return Ok(State::Ready);
        };
        return Ok(State::Sleeping {
            sleep: tokio::time::sleep(delay),
            then_call: true,
        });
    }
    let mut retry_after = Duration::ZERO;
    for decision in decisions.iter() {
        match decision.denial() {
            None => {}
            Some(Denial::CostExceedsCapacity) => {
                return Err(Box::new(OutboundError::CostExceedsCapacity));
            }
            Some(Denial::StoreFull) => return Err(Box::new(OutboundError::StoreFull)),
            // Limited, and any later reason that comes with a retry time.
            Some(_) => retry_after = retry_after.max(decision.retry_after().unwrap_or_default()),
        }
    }
    let left = shared.max_wait.saturating_sub(*waited);
    if retry_after.is_zero() || retry_after > left {
        return Err(Box::new(OutboundError::Limited { retry_after }));
    }
    let wait = shared.jittered(retry_after).min(left);
    *waited += wait;
    Ok(State::Sleeping {
        sleep: tokio::time::sleep(wait),
        then_call: false,
    })
}

/// What the response tells the store, if anything.
///
/// When it is a refusal (see [`pause_of`]), it tells a pause for every worker sharing
/// `pause_key`. There is none without a pause key. When the layer settles costs, it tells
/// the difference between the real cost and the estimate charged to `key`. It comes with
/// the pause the refusal asks for, if the layer pauses, recorded or not.
fn told<St: Store, R: Send + Sync + 'static, RB>(
    shared: &Arc<Shared<St, R>>,
    key: &Key,
    pause_key: Option<&Key>,
    cost: u64,
    response: &Response<RB>,
) -> (Option<Work>, Option<Duration>) {
    let (status, headers) = (response.status(), response.headers());
    let pause = shared.pause.as_ref().and_then(|policy| {
        let longest = Duration::from_millis(capacity(policy));
        pause_of(status, headers, longest).map(|pause| (policy.clone(), pause))
    });
    let paused = pause.as_ref().map(|&(_, pause)| pause);
    let record = pause.zip(pause_key.cloned());
    let used = shared
        .settle
        .as_ref()
        .and_then(|settle| settle(&status, headers))
        .filter(|&used| used != cost);
    if record.is_none() && used.is_none() {
        return (None, paused);
    }
    let (shared, key) = (Arc::clone(shared), key.clone());
    let work: Work = Box::pin(async move {
        let store = &shared.store;
        if let Some(((policy, pause), pause_key)) = record {
            // At most `capacity − pause` left: the capacity is whole again `pause` from
            // now. One operation, so that 429s racing each other do not add up, and a
            // longer pause already running stands.
            let ms = u64::try_from(pause.as_micros().div_ceil(1_000)).unwrap_or(u64::MAX);
            let drain = Operation::Drain(capacity(&policy).saturating_sub(ms));
            if let Err(e) = store.operate(pause_key.as_bytes(), &[&policy], drain).await {
                tracing::warn!(error = %e, "outbound: the store failed to record a pause");
            }
        }
        if let Some(operation) = used.and_then(|used| crate::settle::difference(used, cost)) {
            let policies: SmallVec<[&Policy; 4]> = shared.policies.iter().collect();
            if let Err(e) = store.operate(key.as_bytes(), &policies, operation).await {
                tracing::warn!(error = %e, "outbound: the store failed to settle a cost");
            }
        }
    });
    (Some(work), paused)
}
