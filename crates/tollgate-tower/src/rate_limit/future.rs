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
use tollgate_core::{Decision, Store};
use tower_service::Service;

use super::Shared;
use crate::Key;
use crate::limits::{OnStoreError, Plan};
use crate::response::{Rejection, RejectionBody, Verdict, add_headers, most_restrictive, refusal};

pin_project! {
    /// The future of a [`RateLimit`](super::RateLimit) service's response.
    pub struct ResponseFuture<S, B, St>
    where
        S: Service<Request<B>>,
        St: Store,
    {
        #[pin]
        state: State<St::Future, S::Future>,
        shared: Arc<Shared<St>>,
        // What only a decision that waits needs, boxed so that the common future (decided
        // at once) stays small.
        pending: Option<Box<Pending<S, B>>>,
        grpc: bool,
        // (policy index, decision) for every limit checked so far.
        checked: SmallVec<[(usize, Decision); 2]>,
    }
}

/// A request whose limits are still being checked (or whose shaping delay runs): the ready
/// service and the request until the limits let it through, and what the next check needs.
struct Pending<S, B> {
    call: Option<(S, Request<B>)>,
    key: Key,
    plan: Plan,
    cost: u32,
}

pin_project! {
    #[project = StateProj]
    enum State<C, F> {
        Checking { #[pin] check: C },
        Delaying { #[pin] sleep: tokio::time::Sleep },
        Calling { #[pin] future: F },
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
        checked: SmallVec<[(usize, Decision); 2]>,
        service: S,
        request: Request<B>,
    ) -> Self {
        let state = match plan.get(checked.len()) {
            Some(&next) => State::Checking {
                check: shared
                    .store
                    .check(key.as_bytes(), &shared.limits.policies[next], cost),
            },
            None => State::Delaying {
                sleep: tokio::time::sleep(Duration::from_micros(max_delay(&checked))),
            },
        };
        ResponseFuture {
            state,
            pending: Some(Box::new(Pending {
                call: Some((service, request)),
                key,
                plan,
                cost,
            })),
            grpc,
            checked,
            shared,
        }
    }

    /// Waits for the service's `future`, then adds the headers for `checked`.
    pub(super) fn calling(
        shared: Arc<Shared<St>>,
        future: S::Future,
        checked: SmallVec<[(usize, Decision); 2]>,
    ) -> Self {
        ResponseFuture {
            state: State::Calling { future },
            pending: None,
            grpc: false,
            checked,
            shared,
        }
    }

    /// Answers `response` without calling the service.
    pub(super) fn respond(shared: Arc<Shared<St>>, response: Response<Bytes>) -> Self {
        ResponseFuture {
            state: State::Respond {
                response: Some(response),
            },
            pending: None,
            grpc: false,
            checked: SmallVec::new(),
            shared,
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
    error: &tollgate_core::StoreError,
    policy: &tollgate_core::Policy,
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
                    let shared = &**this.shared;
                    // Checking is only ever entered with a pending request; were it not,
                    // answer rather than panic on a request path.
                    let Some(pending) = this.pending.as_mut() else {
                        let response = refusal(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "The rate limiter lost track of this request.",
                            *this.grpc,
                        );
                        return Poll::Ready(Ok(response.map(ResBody::from_bytes)));
                    };
                    let index = pending.plan[this.checked.len()];
                    let policy = &shared.limits.policies[index];
                    match ready!(check.poll(cx)) {
                        Ok(decision) => {
                            this.checked.push((index, decision));
                            if !decision.is_allowed() {
                                let response = reject(shared, this.checked, *this.grpc);
                                this.state.set(State::Respond {
                                    response: Some(response),
                                });
                                continue;
                            }
                            if let Some(&next) = pending.plan.get(this.checked.len()) {
                                let check = shared.store.check(
                                    pending.key.as_bytes(),
                                    &shared.limits.policies[next],
                                    pending.cost,
                                );
                                this.state.set(State::Checking { check });
                                continue;
                            }
                            let delay = max_delay(this.checked);
                            if delay > 0 {
                                let sleep = tokio::time::sleep(Duration::from_micros(delay));
                                this.state.set(State::Delaying { sleep });
                                continue;
                            }
                        }
                        Err(error) => {
                            if let Some(response) =
                                store_failed(shared.on_error, &error, policy, *this.grpc)
                            {
                                this.state.set(State::Respond {
                                    response: Some(response),
                                });
                                continue;
                            }
                            this.checked.clear();
                        }
                    }
                    call_inner(this.pending, this.state.as_mut());
                }
                StateProj::Delaying { sleep } => {
                    ready!(sleep.poll(cx));
                    call_inner(this.pending, this.state.as_mut());
                }
                StateProj::Calling { future } => {
                    let mut response = ready!(future.poll(cx))?;
                    let shared = &**this.shared;
                    let verdicts = verdicts(shared, this.checked);
                    if let Some(most) = most_restrictive(&verdicts) {
                        let now = shared.clock.now_micros();
                        add_headers(response.headers_mut(), shared.headers, &verdicts, most, now);
                    }
                    return Poll::Ready(Ok(response));
                }
                StateProj::Respond { response } => {
                    let response = response
                        .take()
                        .expect("ResponseFuture polled after it completed");
                    return Poll::Ready(Ok(response.map(ResBody::from_bytes)));
                }
            }
        }
    }
}

fn call_inner<S, B, C>(
    pending: &mut Option<Box<Pending<S, B>>>,
    mut state: Pin<&mut State<C, S::Future>>,
) where
    S: Service<Request<B>>,
{
    // Present until the first call: every path that gets here set it and took nothing.
    if let Some((mut service, request)) = pending.as_mut().and_then(|p| p.call.take()) {
        state.set(State::Calling {
            future: service.call(request),
        });
    }
}

/// The checked limits with their policies.
fn verdicts<'a, St>(
    shared: &'a Shared<St>,
    checked: &[(usize, Decision)],
) -> SmallVec<[Verdict<'a>; 2]> {
    checked
        .iter()
        .map(|&(index, decision)| Verdict {
            policy: &shared.limits.policies[index],
            decision,
        })
        .collect()
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
