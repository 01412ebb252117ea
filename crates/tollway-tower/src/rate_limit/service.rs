//! The rate-limiting service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tollway_core::Store;
use tower_service::Service;

use super::ResponseFuture;
use crate::body::ResponseBody;
use crate::key::{KeyExtractor, PeerIp};
use crate::pipeline::Current;

/// Rate limits the requests to `S`. Built by [`RateLimitLayer`](super::RateLimitLayer);
/// clones share their limits.
pub struct RateLimit<S, St, K = PeerIp> {
    inner: S,
    limiter: Current<St>,
    key: Arc<K>,
}

impl<S, St, K> RateLimit<S, St, K> {
    pub(super) fn new(inner: S, limiter: Current<St>, key: Arc<K>) -> Self {
        RateLimit {
            inner,
            limiter,
            key,
        }
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
            limiter: Arc::clone(&self.limiter),
            key: Arc::clone(&self.key),
        }
    }
}

impl<S: fmt::Debug, St, K> fmt::Debug for RateLimit<S, St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("limits", &self.limiter.load().limits)
            .finish_non_exhaustive()
    }
}

impl<S, St, K, B, ResBody> Service<Request<B>> for RateLimit<S, St, K>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    St: Store,
    K: KeyExtractor<B>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B, St>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The limits current now decide this request, to its end.
        let current = self.limiter.load();
        let action = current.decide(&*self.key, &request);
        ResponseFuture::new(&current, action, &mut self.inner, request)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::StatusCode;
    use tollway_core::{Algorithm, MemoryStore, Policy, Quota};
    use tower::ServiceExt;

    use super::*;
    use crate::RateLimitLayer;

    /// A service that counts its clones.
    #[derive(Debug)]
    struct Counted(Arc<AtomicUsize>);

    impl Clone for Counted {
        fn clone(&self) -> Self {
            self.0.fetch_add(1, Ordering::SeqCst);
            Counted(Arc::clone(&self.0))
        }
    }

    impl Service<Request<()>> for Counted {
        type Response = Response<String>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Response<String>, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Request<()>) -> Self::Future {
            std::future::ready(Ok(Response::new("hello".to_owned())))
        }
    }

    fn request() -> Request<()> {
        let mut request = Request::new(());
        let peer: SocketAddr = "203.0.113.9:5000".parse().unwrap();
        request.extensions_mut().insert(peer);
        request
    }

    // Without tonic there is no gRPC status to answer with: a layer told to answer only
    // in gRPC's terms answered in HTTP's, silently. It fails at build there. (The tests
    // build with tonic: the workspace's dev-dependencies turn it on.)
    #[test]
    fn answering_in_grpc_needs_feature_tonic() {
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_minute(1).unwrap()).unwrap();
        let built = RateLimitLayer::builder(MemoryStore::new(), policy)
            .protocol(crate::Protocol::Grpc)
            .build();
        assert_eq!(built.is_ok(), cfg!(feature = "tonic"));
        if let Err(err) = built {
            assert!(err.to_string().contains("feature \"tonic\""), "{err}");
        }
    }

    // tower-service's "be careful when cloning inner services": a request the store
    // decides at once goes to the service that was made ready, and a refused one goes
    // nowhere; neither needs a clone.
    #[tokio::test]
    async fn a_request_decided_at_once_calls_the_ready_service_without_cloning_it() {
        let clones = Arc::new(AtomicUsize::new(0));
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_minute(1).unwrap()).unwrap();
        let layer = RateLimitLayer::builder(MemoryStore::new(), policy)
            .build()
            .unwrap();
        let mut service = tower_layer::Layer::layer(&layer, Counted(Arc::clone(&clones)));

        let allowed = service
            .ready()
            .await
            .unwrap()
            .call(request())
            .await
            .unwrap();
        assert_eq!(allowed.status(), StatusCode::OK);
        assert_eq!(allowed.headers()["x-ratelimit-remaining"], "0");
        let denied = service
            .ready()
            .await
            .unwrap()
            .call(request())
            .await
            .unwrap();
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(clones.load(Ordering::SeqCst), 0);
    }
}
