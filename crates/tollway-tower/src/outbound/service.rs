//! The service an outbound layer makes around a client.

use std::error::Error;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;
use tollway_core::Store;
use tower_service::Service;

use super::future::{RequestKeys, ResponseFuture};
use super::keys::{Upstream, UpstreamAccount};
use super::replay::{Idempotent, Replay};
use super::shared::{Keys, Shared};
use crate::key::KeyExtractor;
use crate::pipeline::cost_of;

/// The service an [`OutboundLayer`](super::OutboundLayer) makes around a client.
pub struct Outbound<S, St, K = Upstream, P = UpstreamAccount, R = Idempotent> {
    inner: S,
    shared: Arc<Shared<St, R>>,
    keys: Arc<Keys<K, P>>,
}

impl<S: Clone, St, K, P, R> Clone for Outbound<S, St, K, P, R> {
    fn clone(&self) -> Self {
        Outbound {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
            keys: Arc::clone(&self.keys),
        }
    }
}

impl<S: fmt::Debug, St, K, P, R> fmt::Debug for Outbound<S, St, K, P, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbound")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St, K, P, R, B, RB> Service<Request<B>> for Outbound<S, St, K, P, R>
where
    S: Service<Request<B>, Response = http::Response<RB>> + Clone,
    S::Error: Into<Box<dyn Error + Send + Sync>>,
    St: Store,
    K: KeyExtractor<B>,
    P: KeyExtractor<B>,
    R: Replay<B> + Send + Sync + 'static,
{
    type Response = S::Response;
    type Error = Box<dyn Error + Send + Sync>;
    type Future = ResponseFuture<S, St, B, R>;

    /// Always ready: a request may wait for the limit first, and holding the inner
    /// service's readiness meanwhile would starve it. The future makes its own clone of
    /// the inner service ready once the request is admitted.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let shared = &self.shared;
        let key = self.keys.limits.extract(&request);
        // Only a layer that pauses needs it, and only for a request it limits.
        let pause = match (&shared.pause, &key) {
            (Some(_), Some(key)) => match &self.keys.pause {
                Some(pause_key) => pause_key.extract(&request),
                None => Some(key.clone()),
            },
            _ => None,
        };
        let (method, uri, headers) = (request.method(), request.uri(), request.headers());
        let cost = cost_of(shared.cost.as_ref(), method, || uri, headers);
        let keys = RequestKeys { limits: key, pause };
        ResponseFuture::new(self.inner.clone(), Arc::clone(shared), keys, cost, request)
    }
}

impl<S, St, K, P, R> Outbound<S, St, K, P, R> {
    pub(super) fn new(inner: S, shared: Arc<Shared<St, R>>, keys: Arc<Keys<K, P>>) -> Self {
        Outbound {
            inner,
            shared,
            keys,
        }
    }
}
