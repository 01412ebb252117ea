//! The response future: check the limits, perhaps wait, then call the service.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use smallvec::SmallVec;
use tollway_core::{Decision, Store};
use tower_service::Service;

use super::Shared;
use crate::Key;
use crate::limits::{HeaderStyle, OnStoreError, Plan};
use crate::response::{
    Added, Rejection, RejectionBody, Verdict, add_headers, most_restrictive, refusal,
    restrictiveness,
};

/// `(policy index, decision)` for every limit checked so far.
pub(super) type Checked = SmallVec<[(usize, Decision); 2]>;

pin_project! {
    /// The future of a [`RateLimit`](super::RateLimit) service's response.
    ///
    /// A request the store decided at once (the memory store, a local denial) carries only
    /// the inner service's future and the headers to add; everything a decision that
    /// waits needs (a Redis call, a shaping delay) is boxed apart, so the common future
    /// stays small.
    pub struct ResponseFuture<S, B, St>
    where
        S: Service<Request<B>>,
        St: Store,
    {
        #[pin]
        state: State<St::Future, S::Future>,
        pending: Option<Box<Pending<S, B, St>>>,
    }
}

/// A request whose limits are still being checked (or whose shaping delay runs): the ready
/// service and the request until the limits let it through, and what the next check needs.
struct Pending<S, B, St> {
    shared: Arc<Shared<St>>,
    call: Option<(S, Request<B>)>,
    key: Key,
    plan: Plan,
    cost: u32,
    grpc: bool,
    checked: Checked,
    /// The headers, made when the last limit was decided (a shaping delay then runs before
    /// the service is called, and must not move `X-RateLimit-Reset`).
    added: Option<Added>,
}

pin_project! {
    #[project = StateProj]
    enum State<C, F> {
        Checking { #[pin] check: C },
        Delaying { sleep: Pin<Box<tokio::time::Sleep>> },
        Calling { #[pin] future: F, added: Added },
        Respond { response: Option<Response<Bytes>> },
    }
}

impl<S, B, St> ResponseFuture<S, B, St>
where
    S: Service<Request<B>>,
    St: Store,
{
    /// Finishes checking `plan` for `key` (the decisions in `checked` are already made)
    /// and waits out any shaping delay, then calls `service` with `request`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pending(
        shared: Arc<Shared<St>>,
        key: Key,
        plan: Plan,
        cost: u32,
        grpc: bool,
        checked: Checked,
        service: S,
        request: Request<B>,
    ) -> Self {
        let mut added = None;
        let state = match plan.get(checked.len()) {
            Some(&next) => State::Checking {
                check: shared
                    .store
                    .check(key.as_bytes(), &shared.limits.policies[next], cost),
            },
            None => {
                added = Some(Added::new(&shared, &checked));
                State::Delaying {
                    sleep: Box::pin(tokio::time::sleep(Duration::from_micros(max_delay(
                        &checked,
                    )))),
                }
            }
        };
        ResponseFuture {
            state,
            pending: Some(Box::new(Pending {
                shared,
                call: Some((service, request)),
                key,
                plan,
                cost,
                grpc,
                checked,
                added,
            })),
        }
    }

    /// Waits for the service's `future`, then adds the `added` headers.
    pub(super) fn calling(future: S::Future, added: Added) -> Self {
        ResponseFuture {
            state: State::Calling { future, added },
            pending: None,
        }
    }

    /// Answers `response` without calling the service.
    pub(super) fn respond(response: Response<Bytes>) -> Self {
        ResponseFuture {
            state: State::Respond {
                response: Some(response),
            },
            pending: None,
        }
    }
}

/// The longest shaping delay among `checked`, in microseconds.
pub(super) fn max_delay(checked: &[(usize, Decision)]) -> u64 {
    checked
        .iter()
        .map(|(_, d)| d.delay_micros())
        .max()
        .unwrap_or(0)
}

/// What to do when the store failed for `policy`: `None` to let the request through
/// (unlimited, without headers), or the refusal to answer.
pub(super) fn store_failed(
    on_error: OnStoreError,
    error: &tollway_core::StoreError,
    policy: &tollway_core::Policy,
    grpc: bool,
) -> Option<Response<Bytes>> {
    match on_error {
        OnStoreError::Allow => {
            tracing::warn!(%error, policy = policy.name(), "rate limit store failed; letting the request through");
            None
        }
        _ => {
            tracing::warn!(%error, policy = policy.name(), "rate limit store failed; answering 503");
            Some(refusal(
                StatusCode::SERVICE_UNAVAILABLE,
                "Rate limiting is unavailable. Please retry later.",
                grpc,
            ))
        }
    }
}

impl<S, B, St, ResBody> Future for ResponseFuture<S, B, St>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    St: Store,
    ResBody: RejectionBody,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Checking { check } => {
                    // Checking is only ever entered with a pending request; were it not,
                    // answer rather than panic on a request path.
                    let Some(pending) = this.pending.as_mut() else {
                        return Poll::Ready(Ok(lost(false).map(ResBody::from_bytes)));
                    };
                    let result = ready!(check.poll(cx));
                    let next = pending.decided(result);
                    this.state.set(next);
                }
                StateProj::Delaying { sleep } => {
                    ready!(sleep.as_mut().poll(cx));
                    let next = match this.pending.as_mut() {
                        Some(pending) => pending.call(),
                        None => State::Respond {
                            response: Some(lost(false)),
                        },
                    };
                    this.state.set(next);
                }
                StateProj::Calling { future, added } => {
                    let mut response = ready!(future.poll(cx))?;
                    added.add_to(response.headers_mut());
                    return Poll::Ready(Ok(response));
                }
                StateProj::Respond { response } => {
                    // Taken once: polled again after completing, answer rather than panic.
                    let response = response.take().unwrap_or_else(|| lost(false));
                    return Poll::Ready(Ok(response.map(ResBody::from_bytes)));
                }
            }
        }
    }
}

impl<S, B, St> Pending<S, B, St>
where
    S: Service<Request<B>>,
    St: Store,
{
    /// The next state once the store answered for the next policy of the plan.
    fn decided(
        &mut self,
        result: Result<Decision, tollway_core::StoreError>,
    ) -> State<St::Future, S::Future> {
        let shared = &*self.shared;
        let index = self.plan[self.checked.len()];
        match result {
            Ok(decision) => {
                self.checked.push((index, decision));
                if !decision.is_allowed() {
                    return State::Respond {
                        response: Some(reject(shared, &self.checked, self.grpc)),
                    };
                }
                if let Some(&next) = self.plan.get(self.checked.len()) {
                    let check = shared.store.check(
                        self.key.as_bytes(),
                        &shared.limits.policies[next],
                        self.cost,
                    );
                    return State::Checking { check };
                }
                let delay = max_delay(&self.checked);
                if delay > 0 {
                    self.added = Some(Added::new(shared, &self.checked));
                    let sleep = Box::pin(tokio::time::sleep(Duration::from_micros(delay)));
                    return State::Delaying { sleep };
                }
            }
            Err(error) => {
                let policy = &shared.limits.policies[index];
                if let Some(response) = store_failed(shared.on_error, &error, policy, self.grpc) {
                    return State::Respond {
                        response: Some(response),
                    };
                }
                self.checked.clear();
            }
        }
        self.call()
    }

    /// Calls the service, once: every path that gets here set `call` and took nothing.
    fn call(&mut self) -> State<St::Future, S::Future> {
        match self.call.take() {
            Some((mut service, request)) => State::Calling {
                future: service.call(request),
                added: self
                    .added
                    .take()
                    .unwrap_or_else(|| Added::new(&self.shared, &self.checked)),
            },
            None => State::Respond {
                response: Some(lost(self.grpc)),
            },
        }
    }
}

/// The answer to a future polled in a state it cannot be in (or after it completed):
/// a 500 rather than a panic on a request path.
fn lost(grpc: bool) -> Response<Bytes> {
    refusal(
        StatusCode::INTERNAL_SERVER_ERROR,
        "The rate limiter lost track of this request.",
        grpc,
    )
}

/// The checked limits with their policies.
fn verdicts<'a, St>(
    shared: &'a Shared<St>,
    checked: &[(usize, Decision)],
) -> SmallVec<[Verdict<'a>; 2]> {
    // A loop of pushes: cheaper than `collect` for the one or two limits of a request.
    let mut verdicts = SmallVec::new();
    for &(index, decision) in checked {
        verdicts.push(Verdict {
            policy: &shared.limits.policies[index],
            decision,
        });
    }
    verdicts
}

impl Added {
    /// The headers an allowed response carries for `checked`, at the layer's wall time.
    pub(super) fn new<St>(shared: &Shared<St>, checked: &[(usize, Decision)]) -> Self {
        match shared.headers {
            HeaderStyle::None => Added::Nothing,
            HeaderStyle::Legacy => match most_restrictive_decision(checked) {
                Some((index, d)) => {
                    let limit = shared.limits.limit_header(*index, d.limit());
                    Added::legacy(d, limit, shared.clock.now_micros())
                }
                None => Added::Nothing,
            },
            style => {
                let verdicts = verdicts(shared, checked);
                let Some(most) = most_restrictive(&verdicts) else {
                    return Added::Nothing;
                };
                let mut headers = http::HeaderMap::new();
                add_headers(
                    &mut headers,
                    style,
                    &verdicts,
                    most,
                    shared.clock.now_micros(),
                );
                Added::Built(Box::new(headers))
            }
        }
    }
}

/// Of several decisions, the one the legacy headers report (as `most_restrictive`).
fn most_restrictive_decision(checked: &[(usize, Decision)]) -> Option<&(usize, Decision)> {
    checked.iter().min_by_key(|(_, d)| restrictiveness(d))
}

/// The response to a denied request: the handler's body (over gRPC, the status), our
/// headers.
pub(super) fn reject<St>(
    shared: &Shared<St>,
    checked: &[(usize, Decision)],
    grpc: bool,
) -> Response<Bytes> {
    let verdicts = verdicts(shared, checked);
    let Some(most) = most_restrictive(&verdicts) else {
        return refusal(
            StatusCode::TOO_MANY_REQUESTS,
            "API rate limit exceeded.",
            grpc,
        );
    };
    #[cfg(feature = "tonic")]
    let mut response = if grpc {
        crate::grpc::response(crate::grpc::rejection_status(most))
    } else {
        (shared.on_rejected)(&Rejection::new(*most))
    };
    #[cfg(not(feature = "tonic"))]
    let mut response = {
        let _ = grpc;
        (shared.on_rejected)(&Rejection::new(*most))
    };
    let now = shared.clock.now_micros();
    add_headers(response.headers_mut(), shared.headers, &verdicts, most, now);
    response
}
