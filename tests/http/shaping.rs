//! Shaping, at the service: a leaky-bucket shaper holds requests to a steady rate
//! instead of rejecting them. No sockets: the layer wraps a service that records when it
//! is called, five calls go in at once through `tower::ServiceExt::oneshot`, and tokio's
//! clock is paused and moved by hand, so every delay is exact.

use std::convert::Infallible;
use std::future::ready;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use support::stores::{EPOCH_S, EPOCH_US, memory_store};
use tokio::time::Instant;
use tollway_core::{
    Algorithm, Checked, Decisions, ManualClock, Operation, Policy, Quota, Store, StoreError,
};
use tollway_tower::RateLimitLayer;
use tower::{Layer, ServiceExt};

/// A store that answers through a future what `inner` decided at once, as a store that
/// calls out does: the layer then holds the request in its future while it waits.
#[derive(Clone)]
struct Deferred<St>(St);

type DeferredCheck = Pin<Box<dyn Future<Output = Result<Decisions, StoreError>> + Send>>;

impl<St: Store> Store for Deferred<St> {
    type Future = DeferredCheck;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<DeferredCheck> {
        let answer = self.0.check(key, policies, cost);
        Checked::Pending(Box::pin(async move {
            // Answer on a later poll, as I/O would.
            tokio::task::yield_now().await;
            answer.await
        }))
    }

    fn operate(&self, key: &[u8], policies: &[&Policy], op: Operation) -> Checked<DeferredCheck> {
        let answer = self.0.operate(key, policies, op);
        Checked::Pending(Box::pin(answer.into_future()))
    }

    fn supports(&self, policy: &Policy) -> Result<(), tollway_core::ConfigError> {
        self.0.supports(policy)
    }
}

/// Lets every spawned task run until it waits on the (paused) clock.
async fn settle() {
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
}

/// A shaper (10/s, room for 4 in the queue) meets 5 requests at once: it lets the first
/// through, delays three to exactly 100, 200 and 300 ms later (not one millisecond
/// sooner) instead of rejecting them, and rejects only the fifth, which overflows the
/// queue, with the headers of its decision. The store's manual clock stays put, so all
/// five are decided at one instant.
async fn shaping_delays_instead_of_rejecting<St: Store + Clone>(store: St, clock: ManualClock) {
    let quota = Quota::per_second(10).unwrap().with_burst(4).unwrap();
    let policy = Policy::new("shaped", Algorithm::LeakyBucketShaper, quota).unwrap();
    let layer = RateLimitLayer::builder(store, policy)
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let calls = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let recorded = Arc::clone(&calls);
    let service = layer.layer(tower::service_fn(move |_: Request<()>| {
        recorded.lock().unwrap().push(Instant::now());
        ready(Ok::<_, Infallible>(Response::new(
            http_body_util::Full::new(bytes::Bytes::from_static(b"ok")),
        )))
    }));
    let start = Instant::now();
    let requests: Vec<_> = (0..5)
        .map(|_| {
            let mut request = Request::new(());
            let peer: SocketAddr = "198.51.100.7:40000".parse().unwrap();
            request.extensions_mut().insert(peer);
            tokio::spawn(service.clone().oneshot(request))
        })
        .collect();
    let offsets = || {
        calls
            .lock()
            .unwrap()
            .iter()
            .map(|&t| t - start)
            .collect::<Vec<_>>()
    };
    let slots: Vec<Duration> = (0..4).map(|k| Duration::from_millis(100) * k).collect();

    settle().await;
    assert_eq!(
        offsets(),
        slots[..1],
        "only the first goes straight through"
    );
    for k in 1..=3 {
        tokio::time::advance(Duration::from_millis(99)).await;
        settle().await;
        assert_eq!(offsets(), slots[..k], "request {k} came early");
        tokio::time::advance(Duration::from_millis(1)).await;
        settle().await;
        assert_eq!(offsets(), slots[..=k], "request {k}");
    }

    let (mut remaining, mut denied) = (Vec::new(), Vec::new());
    for request in requests {
        let response = request.await.unwrap().unwrap();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        // Reset is measured at the store's instant: at most 400 ms ahead.
        assert_eq!(header("x-ratelimit-limit").as_deref(), Some("4"));
        assert_eq!(header("x-ratelimit-reset"), Some((EPOCH_S + 1).to_string()));
        if response.status() == StatusCode::OK {
            remaining.push(header("x-ratelimit-remaining").unwrap());
        } else {
            assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
            // The queue frees a slot in 100 ms: Retry-After rounds it up to 1 s.
            assert_eq!(header("retry-after").as_deref(), Some("1"));
            assert_eq!(header("x-ratelimit-remaining").as_deref(), Some("0"));
            let body = response.into_body().collect().await.unwrap().to_bytes();
            denied.push(body);
        }
    }
    remaining.sort_unstable();
    assert_eq!(remaining, ["0", "1", "2", "3"]);
    assert_eq!(
        denied,
        [&br#"{"error":"Too Many Requests","message":"API rate limit exceeded. Please retry after 1 seconds."}"#[..]]
    );
    assert_eq!(calls.lock().unwrap().len(), 4);
    assert_eq!(Instant::now() - start, Duration::from_millis(300));
}

/// The memory store decides at once: the service holds the admitted request for its
/// delay.
#[tokio::test(start_paused = true)]
async fn a_shaper_delays_requests_the_store_decided_at_once() {
    let clock = ManualClock::at_micros(EPOCH_US);
    shaping_delays_instead_of_rejecting(memory_store(&clock), clock).await;
}

/// A store that answers through a future: the request waits in the response future for
/// the store, then for its delay.
#[tokio::test(start_paused = true)]
async fn a_shaper_delays_requests_the_store_decided_later() {
    let clock = ManualClock::at_micros(EPOCH_US);
    shaping_delays_instead_of_rejecting(Deferred(memory_store(&clock)), clock).await;
}
