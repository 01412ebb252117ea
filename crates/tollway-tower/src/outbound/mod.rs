//! Outbound limits: the same policies and stores on the client side.
//!
//! A fleet of workers calling a third-party API then stays under *its* quota together.
//! Ten workers each limiting themselves to 100 a second send 1,000 a second. Workers that
//! share a [`RedisStore`](tollway_core::RedisStore) share one budget. So do workers in one
//! process that share a [`MemoryStore`](tollway_core::MemoryStore).
//!
//! [`OutboundLayer`] wraps any tower HTTP client service: hyper-util's `Client`, or
//! anything that is a `Service<http::Request<B>>`.
//!
//! # Keys, costs and delays as on the server side
//!
//! A request's budget is found by a [`KeyExtractor`](crate::KeyExtractor), as on the
//! server side. The default is [`Upstream`], the URI's authority: each upstream has its
//! own budget. [`GlobalKey`](crate::GlobalKey), [`ApiKey`](crate::ApiKey), a closure or a
//! chain work as well. The cost function and a shaper's delay follow the server side's
//! rules too.
//!
//! # Wait, don't fail
//!
//! A request over the limit waits until the store would admit it. It waits the
//! decision's retry time, stretched by a random share (default up to 10%). So a fleet
//! does not wake in lockstep. Then the request is checked again. It waits for at most
//! [`max_wait`](OutboundLayerBuilder::max_wait) in all (default 30 s). Past that, it
//! fails with [`OutboundError::Limited`] and its retry time. With
//! [`fail_fast`](OutboundLayerBuilder::fail_fast), it fails so at once.
//!
//! A waiting request holds nothing. It is charged only when admitted. So a request
//! dropped while it waits costs the budget nothing: a timeout around it, say, or a
//! caller gone. The exception is a shaper's delay (a leaky bucket that shapes), which
//! comes after admission. The inner service is made ready after admission. So a waiting
//! request holds none of its capacity either.
//!
//! # Listen to the upstream
//!
//! A response may be a 429, or a gRPC `RESOURCE_EXHAUSTED`. It then pauses every worker
//! sharing its pause key, through the store. The pause lasts what its `Retry-After` says,
//! by the rule of [`pause_of`]. It is never longer than
//! [`max_pause`](OutboundLayerBuilder::max_pause) (default 60 s).
//!
//! The pause key is [`UpstreamAccount`]: the upstream and the account the request names.
//! The account is a digest of its `Authorization`, `X-API-Key` or `Api-Key`. So one
//! account's 429 pauses that account only. See
//! [`pause_key`](OutboundLayerBuilder::pause_key).
//!
//! After the pause, the refused request is sent once more if two things hold. It must be
//! idempotent (`GET`, `PUT`, `DELETE`…), or be whatever
//! [`replay`](OutboundLayerBuilder::replay) allows. And the pause must end within what is
//! left of its `max_wait`. Otherwise, or if it cannot go in time, the caller gets the
//! upstream's 429 as it came. One 429 is one pause. A copy the upstream refuses again is
//! answered as it came, and pauses nobody a second time.
//!
//! # Costs the response decides
//!
//! With [`settle`](OutboundLayerBuilder::settle), a request is charged its estimated
//! [`cost`](OutboundLayerBuilder::cost) up front. After, the difference from what its
//! response reports it used is charged or refunded. So a tokens-per-minute budget counts
//! what the fleet used.
//!
//! Responses may use more than their estimates, and the budget may run dry. Then a token
//! bucket or GCRA owes the rest (see
//! [`Operation::Charge`](tollway_core::Operation::Charge)). It admits nothing until it is
//! paid back. So over a run, the fleet uses at most the budget and what its calls in
//! flight used beyond it when it ran dry. A window algorithm forgets what its window
//! could not hold. Take a bucket for tokens.
//!
//! A layer's cost applies to each of its limits. For requests a second and tokens a
//! minute, stack two layers. A request admitted by the outer one and refused by the
//! inner one was never sent: the outer one gives its charge back. (So does a layer
//! around any outbound refusal, an [`OutboundError`], inside it.)
//!
//! # Told like the server side
//!
//! Each decision of the limits goes where the server side's go. That is the same debug
//! event, metrics (feature `metrics`), and
//! [`DecisionListener`](crate::DecisionListener)
//! ([`on_decision`](OutboundLayerBuilder::on_decision)). It is keyed `outbound:` and the
//! request's key. A running pause is told as `limited` by the pause's policy,
//! `outbound-pause`.
//!
//! # Capacities
//!
//! Give the clients a burst a little under the upstream's. Requests reach it a little
//! later and less evenly than they were admitted, and the difference absorbs that.
//! The repository's `BENCHMARKS.md` ("Outbound limits") has the measured 429s. Likewise give a token
//! capacity a little under the upstream's. The upstream counts a call's tokens a moment
//! before its settlement reaches the store.
//!
//! # Examples
//!
//! ```
//! use std::convert::Infallible;
//! use std::time::Duration;
//!
//! use http::{Request, Response};
//! use tollway_tower::TokioClock;
//! use tollway_tower::outbound::{OutboundError, OutboundLayer};
//! use tollway_tower::tollway_core::{Algorithm, MemoryStore, Policy, Quota};
//! use tower_layer::Layer;
//! use tower_service::Service;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! // Stand-in for an HTTP client: answers every request.
//! let client = tower_service_fn(|_req: Request<()>| async {
//!     Ok::<_, Infallible>(Response::new(()))
//! });
//!
//! // The upstream allows 2 a second; every worker of the fleet shares this store (on
//! // tokio's clock, which this example pauses).
//! let quota = Quota::per_second(2)?;
//! let policy = Policy::new("stripe", Algorithm::Gcra, quota)?;
//! let store = MemoryStore::builder().clock(TokioClock::new()).build()?;
//!
//! // Waits for its turn (the default)...
//! let mut waiting = OutboundLayer::builder(store.clone(), policy.clone()).build()?.layer(client.clone());
//! // ...or fails at once.
//! let mut failing = OutboundLayer::builder(store, policy).fail_fast().build()?.layer(client);
//!
//! let call = || Request::get("https://api.example.com/v1/charges").body(()).unwrap();
//! waiting.call(call()).await?;
//! waiting.call(call()).await?;
//! let refused = failing.call(call()).await.unwrap_err();
//! match refused.downcast_ref::<OutboundError>() {
//!     Some(OutboundError::Limited { retry_after }) => assert!(*retry_after > Duration::ZERO),
//!     other => panic!("{other:?}"),
//! }
//! // The third call waits about half a second (the paused clock moves on by itself).
//! let before = tokio::time::Instant::now();
//! waiting.call(call()).await?;
//! assert!(before.elapsed() >= Duration::from_millis(500));
//! # Ok(())
//! # }
//! # #[derive(Clone)]
//! # struct ServiceFn<F>(F);
//! # fn tower_service_fn<F>(f: F) -> ServiceFn<F> { ServiceFn(f) }
//! # impl<F, Fut, R> Service<Request<()>> for ServiceFn<F>
//! # where F: FnMut(Request<()>) -> Fut, Fut: std::future::Future<Output = Result<R, Infallible>> {
//! #     type Response = R; type Error = Infallible; type Future = Fut;
//! #     fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Infallible>> { std::task::Poll::Ready(Ok(())) }
//! #     fn call(&mut self, req: Request<()>) -> Fut { (self.0)(req) }
//! # }
//! ```
//!
//! # With reqwest
//!
//! A `reqwest::Client` becomes a tower service of `http` requests through a small
//! adapter (reqwest converts both ways); a body that is `Clone`, such as `String` or
//! `Bytes`, keeps refused idempotent requests replayable.
//!
//! ```
//! use http::Request;
//! use tollway_tower::outbound::OutboundLayer;
//! use tollway_tower::tollway_core::{Algorithm, MemoryStore, Policy, Quota};
//! use tower::{Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! # let upstream = listener.local_addr()?;
//! # let app = axum::Router::new().route("/v1/charges", axum::routing::get(|| async { "ok" }));
//! # tokio::spawn(async move { axum::serve(listener, app).await });
//! let client = reqwest::Client::new();
//! let adapter = tower::service_fn(move |request: Request<String>| {
//!     let client = client.clone();
//!     async move {
//!         let response = client.execute(reqwest::Request::try_from(request)?).await?;
//!         Ok::<_, reqwest::Error>(http::Response::from(response))
//!     }
//! });
//!
//! let policy = Policy::new("stripe", Algorithm::Gcra, Quota::per_second(100)?)?;
//! let layer = OutboundLayer::builder(MemoryStore::new(), policy).build()?;
//! let limited = layer.layer(adapter);
//!
//! let request = Request::get(format!("http://{upstream}/v1/charges")).body(String::new())?;
//! let response = limited.oneshot(request).await?;
//! assert_eq!(response.status(), 200);
//! # Ok(())
//! # }
//! ```

mod error;
mod future;
mod keys;
mod layer;
mod pause;
mod replay;
mod service;
mod shared;

pub use error::OutboundError;
pub use future::ResponseFuture;
pub use keys::{ACCOUNT_HEADERS, Upstream, UpstreamAccount};
pub use layer::{OutboundLayer, OutboundLayerBuilder};
pub use pause::{DEFAULT_PAUSE, pause_of};
pub use replay::{Idempotent, NoReplay, Replay};
pub use service::Outbound;

#[cfg(test)]
mod tests;
