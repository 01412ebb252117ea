//! A synchronous tonic `Interceptor` over a layer's limits.

use std::fmt;
use std::sync::Arc;

use tollway_core::{Clock, ConfigError, MemoryStore};
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::grpc::refusal_status;
use crate::key::KeyExtractor;
use crate::pipeline::{Action, Current, Limiter, Wait, Waited};
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
/// lookups are refused when it is made, and so is whatever needs the response (calls in
/// flight, settling, load shedding). Limits swapped in later
/// ([`RateLimitLayer::swap_limits`](crate::RateLimitLayer::swap_limits), a reload) are
/// checked the same way: a swap the interceptor cannot apply is refused, and the running
/// limits stay.
///
/// Denials are [`rejection_status`](crate::grpc::rejection_status):
/// `RESOURCE_EXHAUSTED` with `RetryInfo`, `QuotaFailure`, `retry-after` and
/// `grpc-retry-pushback-ms`, and the rate-limit headers as metadata.
pub struct RateLimitInterceptor<C, K> {
    limiter: Current<MemoryStore<C>>,
    key: Arc<K>,
}

impl<C, K> RateLimitInterceptor<C, K> {
    /// An interceptor deciding by `current`, whose limits it checks first (and every
    /// later swap of them: see [`Limiter::interceptable`]).
    pub(crate) fn new(current: Current<MemoryStore<C>>, key: Arc<K>) -> Result<Self, ConfigError> {
        current.load().interceptable()?;
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

        // Answered in gRPC's terms whatever the request looks like: it is a gRPC call.
        let mut action = limiter.decide_in(&*self.key, &http, true);
        loop {
            action = match action {
                // Nothing to finish after the response: the limits were checked for it.
                Action::Call(_) => {
                    let (parts, ()) = http.into_parts();
                    return Ok(tonic::Request::from_parts(
                        MetadataMap::from_headers(parts.headers),
                        parts.extensions,
                        (),
                    ));
                }
                Action::Answer(reply) => return Err(reply.into_status()),
                // The memory store answers at once: its future is a ready value.
                Action::Wait(Wait::Check { future }, resume) => {
                    limiter.resume(resume, Waited::Checked(future.into_inner()), &http)
                }
                // Refused when the interceptor is made: it cannot wait for a lookup.
                Action::Wait(Wait::Lookup { .. }, _) => {
                    return Err(refusal_status(Refusal::LookupFailed));
                }
            };
        }
    }
}
