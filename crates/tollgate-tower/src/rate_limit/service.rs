//! The rate-limiting service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tollgate_core::Store;
use tower_service::Service;

use smallvec::SmallVec;

use super::future::{max_delay, reject, store_failed};
use super::{ResponseFuture, Shared};
use crate::key::{Key, KeyExtractor, PeerIp};
use crate::limits::MissingKey;
use crate::response::{RejectionBody, refusal};

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
        let shared = Arc::clone(&self.shared);
        #[cfg(feature = "tonic")]
        let grpc = crate::grpc::is_grpc(request.headers());
        #[cfg(not(feature = "tonic"))]
        let grpc = false;
        let key = match self.key.extract(&request) {
            Some(key) => key,
            None => match shared.missing {
                MissingKey::FallbackToIp => {
                    // Without a peer address every such caller shares one key: still limited.
                    KeyExtractor::<B>::extract(&PeerIp::new(), &request)
                        .unwrap_or_else(|| Key::new("ip", "unknown"))
                }
                MissingKey::Allow => {
                    let future = self.inner.call(request);
                    return ResponseFuture::calling(shared, future, SmallVec::new());
                }
                MissingKey::Reject(status) => {
                    let response = refusal(
                        status,
                        "No rate-limit key could be determined for this request.",
                        grpc,
                    );
                    return ResponseFuture::respond(shared, response);
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
        let mut checked = SmallVec::new();
        for &index in &plan {
            let policy = &shared.limits.policies[index];
            match shared.store.check_now(key.as_bytes(), policy, cost) {
                Some(Ok(decision)) => {
                    checked.push((index, decision));
                    if !decision.is_allowed() {
                        let response = reject(&shared, &checked, grpc);
                        return ResponseFuture::respond(shared, response);
                    }
                }
                Some(Err(error)) => match store_failed(shared.on_error, &error, policy, grpc) {
                    Some(response) => return ResponseFuture::respond(shared, response),
                    None => {
                        let future = self.inner.call(request);
                        return ResponseFuture::calling(shared, future, SmallVec::new());
                    }
                },
                None => break,
            }
        }
        if checked.len() == plan.len() && max_delay(&checked) == 0 {
            let future = self.inner.call(request);
            return ResponseFuture::calling(shared, future, checked);
        }
        // The ready service goes with this request; its clone waits for the next
        // poll_ready (tower-service's "be careful when cloning inner services").
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::pending(shared, key, plan, cost, grpc, checked, inner, request)
    }
}
