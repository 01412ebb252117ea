//! Over real HTTP, on a real Redis: a full service answers 503 at once, and a refused
//! request never reaches Redis.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use support::http::Server;
use support::redis::{RedisServer, script_calls};
use tokio::sync::Semaphore;
use tollway_core::{Algorithm, Policy, Quota, RedisStore};
use tollway_tower::RateLimitLayer;
use tollway_tower::shed::{Match, Priority, Shed};

/// Waits, up to ten seconds, for `done` to hold: a condition, never a fixed sleep.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "waited ten seconds for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_service_answers_503_and_a_refusal_never_reaches_redis() {
    // A server of its own: its script count is this test's alone.
    let redis = RedisServer::start();
    let store = RedisStore::builder().connect(&redis.url()).await.unwrap();
    let policy = Policy::new("api", Algorithm::Gcra, Quota::per_minute(6_000).unwrap()).unwrap();
    // Two calls at once; checkout may always count on one of them.
    let checkout = Priority::new("checkout", 0.5)
        .when(Match::route(Some(http::Method::POST), "/api/v1/checkout").unwrap());
    let shed = Shed::builder()
        .limits(2, 2)
        .priority(checkout)
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(store, policy)
        .shed(shed.clone())
        .build()
        .unwrap();
    // Handlers that hold their calls until the test lets them go.
    let (gate, inside) = (Arc::new(Semaphore::new(0)), Arc::new(AtomicUsize::new(0)));
    let hold = {
        let (gate, inside) = (Arc::clone(&gate), Arc::clone(&inside));
        move || {
            let (gate, inside) = (Arc::clone(&gate), Arc::clone(&inside));
            async move {
                inside.fetch_add(1, Ordering::SeqCst);
                gate.acquire().await.unwrap().forget();
                "done"
            }
        }
    };
    let app = Router::new()
        .route("/search", get(hold.clone()))
        .route("/api/v1/checkout", axum::routing::post(hold))
        .layer(layer);
    let server = Server::start(app).await;
    let client = server.client();

    // A search holds one place; the other is checkout's own.
    let search = tokio::spawn({
        let client = client.clone();
        async move { client.get("/search").await }
    });
    until("the search inside", || inside.load(Ordering::SeqCst) == 1).await;
    let mut node = redis.connection().await;
    let scripts = script_calls(&mut node).await;
    for _ in 0..20 {
        let refused = client.get("/search").await;
        assert_eq!(refused.status, http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refused.header("retry-after"), Some("1"));
        assert!(refused.header("x-ratelimit-limit").is_none());
        assert!(refused.body.contains("overloaded"), "{}", refused.body);
    }
    assert_eq!(
        script_calls(&mut node).await,
        scripts,
        "twenty refusals, no script call"
    );
    // Checkout within its share is admitted while searches are refused.
    let checkout = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .send(http::Method::POST, "/api/v1/checkout", &[])
                .await
        }
    });
    until("the checkout inside", || inside.load(Ordering::SeqCst) == 2).await;
    assert_eq!(script_calls(&mut node).await, scripts + 1);
    gate.add_permits(2);
    for call in [search, checkout] {
        let reply = call.await.unwrap();
        assert_eq!(reply.status, http::StatusCode::OK);
        assert!(reply.header("x-ratelimit-remaining").is_some());
    }
    until("both places given back", || shed.in_flight() == 0).await;
    let states = shed.priorities();
    assert_eq!((states[0].admitted, states[0].shed), (1, 0), "checkout");
    assert_eq!((states[1].admitted, states[1].shed), (1, 20), "other");
}
