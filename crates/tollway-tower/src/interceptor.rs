//! A synchronous tonic `Interceptor` over a layer's limits.

use std::fmt;
use std::sync::Arc;

use tollway_core::{Algorithm, Clock, ConfigError, MemoryStore};
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::grpc::{denial_status, refusal_status};
use crate::key::KeyExtractor;
use crate::pipeline::{Answer, Current, Decided, Limiter, Outcome, Progress, Wait};
use crate::rejection::Refusal;

/// A synchronous tonic `Interceptor` that applies a layer's limits.
///
/// It is for users who wrap services with `InterceptedService`, or
/// `Server::add_service(Svc::with_interceptor(..))`, rather than a layer.
/// [`RateLimitLayer::interceptor`](crate::RateLimitLayer::interceptor) makes it from a
/// layer over a [`MemoryStore`], whose decisions need no I/O. It shares that layer's
/// state and decides exactly as the layer does.
///
/// An interceptor sees the request's metadata and extensions, but not its path. So route
/// (per-method) limits apply only where a `tonic::GrpcMethod` extension names the method.
/// It cannot add headers to responses, or hold a request. So shaping policies and tier
/// lookups are refused when it is made. Limits swapped in later are applied, and a
/// shaping policy among them admits without its delay. It charges nothing after
/// responses.
///
/// Denials are [`rejection_status`](crate::grpc::rejection_status):
/// `RESOURCE_EXHAUSTED` with `RetryInfo`, `QuotaFailure`, `retry-after` and
/// `grpc-retry-pushback-ms`, and the rate-limit headers as metadata.
pub struct RateLimitInterceptor<C, K> {
    limiter: Current<MemoryStore<C>>,
    key: Arc<K>,
}

impl<C, K> RateLimitInterceptor<C, K> {
    pub(crate) fn new(current: Current<MemoryStore<C>>, key: Arc<K>) -> Result<Self, ConfigError> {
        let limiter = current.load();
        if let Some(p) = limiter
            .limits
            .policies()
            .iter()
            .find(|p| p.algorithm() == Algorithm::LeakyBucketShaper)
        {
            return Err(ConfigError::new(format!(
                "policy {:?} shapes requests by delaying them, which an interceptor cannot do: \
                 use the layer (Server::builder().layer(..)) for shaping",
                p.name()
            )));
        }
        // It never sees the response: a slot would never be given back, a reservation
        // never settled.
        if let Some(p) = limiter
            .limits
            .policies()
            .iter()
            .find(|p| p.algorithm() == Algorithm::Concurrency)
        {
            return Err(ConfigError::new(format!(
                "policy {:?} limits calls in flight until their responses end, which an \
                 interceptor never sees: use the layer (Server::builder().layer(..))",
                p.name()
            )));
        }
        if limiter.settle.is_some() {
            return Err(ConfigError::new(
                "the layer settles a policy after responses, which an interceptor never sees: \
                 use the layer (Server::builder().layer(..))",
            ));
        }
        if limiter.shed.is_some() {
            return Err(ConfigError::new(
                "the layer sheds load, counting calls until their responses, which an \
                 interceptor never sees: use the layer (Server::builder().layer(..))",
            ));
        }
        if limiter.lookups.is_some() {
            return Err(ConfigError::new(
                "the layer looks tiers up, which takes a wait an interceptor cannot take: \
                 use the layer (Server::builder().layer(..)), or tiers() with a map",
            ));
        }
        drop(limiter);
        Ok(RateLimitInterceptor {
            limiter: current,
            key,
        })
    }
}

impl<C, K> Clone for RateLimitInterceptor<C, K> {
    fn clone(&self) -> Self {
        RateLimitInterceptor {
            limiter: Arc::clone(&self.limiter),
            key: Arc::clone(&self.key),
        }
    }
}

impl<C, K> fmt::Debug for RateLimitInterceptor<C, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitInterceptor")
            .field("limits", &self.limiter.load().limits)
            .finish_non_exhaustive()
    }
}

impl<C, K> tonic::service::Interceptor for RateLimitInterceptor<C, K>
where
    C: Clock,
    K: KeyExtractor<()>,
{
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        // The limits current now, as the layer's (swapped by `swap_limits` or a reload).
        let current = self.limiter.load();
        let limiter: &Limiter<MemoryStore<C>> = &current;
        // The call as the layer sees it, for the key extractor and the cost function: a
        // POST, to the method's path when a `GrpcMethod` extension names it.
        let (metadata, extensions, ()) = request.into_parts();
        let path = extensions
            .get::<tonic::GrpcMethod<'static>>()
            .map(|m| format!("/{}/{}", m.service(), m.method()))
            .unwrap_or_default();
        let mut http = http::Request::new(());
        *http.method_mut() = http::Method::POST;
        if let Ok(uri) = http::Uri::try_from(path) {
            *http.uri_mut() = uri;
        }
        *http.headers_mut() = metadata.into_headers();
        *http.extensions_mut() = extensions;

        let mut progress = limiter.decide(&*self.key, &http);
        let Decided { outcome, .. } = loop {
            progress = match progress {
                Progress::Decided(decided) => break decided,
                // The memory store answers at once: its future is a ready value.
                Progress::Waiting(Wait::Check { future }, at) => {
                    limiter.resume(at, Answer::Checked(future.into_inner()), &http)
                }
                // Refused when the interceptor is made: it cannot wait for a lookup.
                Progress::Waiting(Wait::Lookup { .. }, _) => {
                    return Err(refusal_status(Refusal::LookupFailed));
                }
            };
        };
        match outcome {
            Outcome::Allow { .. } => {
                let (parts, ()) = http.into_parts();
                Ok(tonic::Request::from_parts(
                    MetadataMap::from_headers(parts.headers),
                    parts.extensions,
                    (),
                ))
            }
            Outcome::Deny { verdict, headers } => Err(denial_status(&verdict, headers)),
            Outcome::Refuse(refusal) => Err(refusal_status(refusal)),
        }
    }
}
