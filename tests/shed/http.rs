//! Over real HTTP, on a real Redis: a full service answers 503 at once, and a refused
//! request never reaches Redis.

use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use support::http::Server;
use support::redis::{RedisServer, script_calls};
use tokio::sync::{Semaphore, mpsc};
use tollway_core::{Algorithm, Policy, Quota, RedisStore};
use tollway_tower::RateLimitLayer;
use tollway_tower::shed::{Match, Priority, Shed};

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
    // Handlers that say when a call is inside, and hold it until the test lets it go.
    let gate = Arc::new(Semaphore::new(0));
    let (entered, mut inside) = mpsc::unbounded_channel::<()>();
    let hold = {
        let gate = Arc::clone(&gate);
        move || {
            let (gate, entered) = (Arc::clone(&gate), entered.clone());
            async move {
                let _ = entered.send(());
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
    inside.recv().await.unwrap();
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
    inside.recv().await.unwrap();
    assert_eq!(script_calls(&mut node).await, scripts + 1);
    gate.add_permits(2);
    for call in [search, checkout] {
        let reply = call.await.unwrap();
        assert_eq!(reply.status, http::StatusCode::OK);
        assert!(reply.header("x-ratelimit-remaining").is_some());
    }
    // Each place is given back when the service answers, before the answer is sent.
    assert_eq!(shed.in_flight(), 0);
    let states = shed.priorities();
    assert_eq!((states[0].admitted, states[0].shed), (1, 0), "checkout");
    assert_eq!((states[1].admitted, states[1].shed), (1, 20), "other");
}
