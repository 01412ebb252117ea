//! The rate-limiting service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tollway_core::Store;
use tower_service::Service;

use super::future::{Checked, max_delay, reject, store_failed};
use super::{ResponseFuture, Shared};
use crate::key::{Key, KeyExtractor, PeerIp};
use crate::limits::MissingKey;
use crate::response::{Added, RejectionBody, refusal};

/// Rate limits the requests to `S`. Built by [`RateLimitLayer`](super::RateLimitLayer);
/// clones share their limits.
pub struct RateLimit<S, St, K> {
    inner: S,
    shared: Arc<Shared<St>>,
    key: Arc<K>,
}

impl<S, St, K> RateLimit<S, St, K> {
    pub(super) fn new(inner: S, shared: Arc<Shared<St>>, key: Arc<K>) -> Self {
        RateLimit { inner, shared, key }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, St, K> Clone for RateLimit<S, St, K> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
            key: Arc::clone(&self.key),
        }
    }
}

impl<S: fmt::Debug, St, K> fmt::Debug for RateLimit<S, St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("limits", &self.shared.limits)
            .finish_non_exhaustive()
    }
}

impl<S, St, K, B, ResBody> Service<Request<B>> for RateLimit<S, St, K>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    St: Store,
    K: KeyExtractor<B>,
    ResBody: RejectionBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B, St>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // Borrowed, not cloned: a request decided at once never touches the `Arc`'s count.
        let RateLimit { inner, shared, key } = self;
        let key = match key.extract(&request) {
            Some(key) => key,
            None => match shared.missing {
                MissingKey::FallbackToIp => {
                    // Without a peer address every such caller shares one key: still limited.
                    KeyExtractor::<B>::extract(&PeerIp::new(), &request)
                        .unwrap_or_else(|| Key::new("ip", "unknown"))
                }
                MissingKey::Allow => {
                    return ResponseFuture::calling(inner.call(request), Added::Nothing);
                }
                MissingKey::Reject(status) => {
                    let response = refusal(
                        status,
                        "No rate-limit key could be determined for this request.",
                        is_grpc(&request),
                    );
                    return ResponseFuture::respond(response);
                }
            },
        };
        let plan = shared
            .limits
            .plan(&key, request.method(), request.uri().path());
        let cost = shared.cost.as_ref().map_or(1, |cost| {
            cost(request.method(), request.uri(), request.headers())
        });
        // Decide now what the store can decide without waiting: then the ready service is
        // called at once, and nothing is held across an await.
        let mut checked = Checked::new();
        for &index in &plan {
            let policy = &shared.limits.policies[index];
            match shared.store.check_now(key.as_bytes(), policy, cost) {
                Some(Ok(decision)) => {
                    checked.push((index, decision));
                    if !decision.is_allowed() {
                        let response = reject(shared, &checked, is_grpc(&request));
                        return ResponseFuture::respond(response);
                    }
                }
                Some(Err(error)) => {
                    return match store_failed(shared.on_error, &error, policy, is_grpc(&request)) {
                        Some(response) => ResponseFuture::respond(response),
                        None => ResponseFuture::calling(inner.call(request), Added::Nothing),
                    };
                }
                None => break,
            }
        }
        if checked.len() == plan.len() && max_delay(&checked) == 0 {
            let added = Added::new(shared, &checked);
            return ResponseFuture::calling(inner.call(request), added);
        }
        // The ready service goes with this request; its clone waits for the next
        // poll_ready (tower-service's "be careful when cloning inner services").
        let clone = inner.clone();
        let ready = std::mem::replace(inner, clone);
        let grpc = is_grpc(&request);
        ResponseFuture::pending(
            Arc::clone(shared),
            key,
            plan,
            cost,
            grpc,
            checked,
            ready,
            request,
        )
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
