//! Which limits a request meets: route limits by method and path, nested routers, and
//! the protocol a refusal is written in.

use std::net::SocketAddr;

use axum::Router;
use axum::http::{Method, StatusCode};
use axum::routing::{get, post};
use bytes::{BufMut, BytesMut};
use prost::Message;
use support::catalog::{Catalog, EXPORT, ExportRequest};
use support::http::{Client, Hits, Reply, Server};
use support::stores::{EPOCH_US, memory_store, per_minute};
use tokio::net::TcpListener;
use tollway_core::{ManualClock, MemoryStore};
use tollway_tower::{PeerIp, Protocol, RateLimitLayer, RateLimitLayerBuilder};
use tower::{Layer, ServiceExt};

use super::admitted;

/// A layer over a memory store on a manual clock that does not move, whose default
/// limit (100/min) no test here reaches.
fn builder() -> RateLimitLayerBuilder<MemoryStore<ManualClock>, PeerIp> {
    let clock = ManualClock::at_micros(EPOCH_US);
    RateLimitLayer::builder(memory_store(&clock), per_minute("per-caller", 100)).wall_clock(clock)
}

/// Finding 2, gRPC: `Export`'s limit was bound to POST, and any other method reached the
/// handler, since tonic serves a call whatever its method. A gRPC method's limit is on
/// the method now, whatever the HTTP method.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_http_method_does_not_escape_a_grpc_method_limit() {
    let catalog = Catalog::new();
    let layer = builder()
        .grpc_method(EXPORT, per_minute("export", 2))
        .protocol(Protocol::Grpc)
        .build()
        .unwrap();
    let server = support::grpc::serve(layer, &catalog).await;
    let client = Client::http2(server.addr());

    // One gRPC frame: uncompressed, its length, the message.
    let message = ExportRequest {
        format: "csv".to_owned(),
    }
    .encode_to_vec();
    let mut frame = BytesMut::new();
    frame.put_u8(0);
    frame.put_u32(u32::try_from(message.len()).unwrap());
    frame.put_slice(&message);
    let frame = frame.freeze();

    let headers = [("content-type", "application/grpc"), ("te", "trailers")];
    let methods = ["POST", "PUT", "GET", "PATCH", "DELETE", "BREW"];
    let mut answered = Vec::new();
    for _ in 0..2 {
        for method in methods {
            let method = Method::from_bytes(method.as_bytes()).unwrap();
            let reply = client
                .send_body(method.clone(), EXPORT, &headers, frame.clone())
                .await;
            answered.push((method, reply.header("grpc-status").map(str::to_owned)));
        }
    }
    assert_eq!(catalog.exports(), 2, "{answered:?}");
    let exhausted = answered
        .iter()
        .filter(|(_, status)| status.as_deref() == Some("8"))
        .count();
    assert_eq!(exhausted, 10, "{answered:?}");
}

/// Finding 2, HTTP: axum answers HEAD with the GET handler, so after GET was refused
/// HEAD got 6 of 6 through. A GET limit covers HEAD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_is_limited_with_get() {
    let hits = Hits::default();
    let layer = builder()
        .route(Some(Method::GET), "/api/v1/items", per_minute("items", 3))
        .build()
        .unwrap();
    let server = support::http::serve(layer, &hits).await;
    let client = server.client();
    let mut replies = Vec::new();
    for _ in 0..3 {
        replies.push(client.get("/api/v1/items").await);
    }
    for _ in 0..6 {
        replies.push(client.send(Method::HEAD, "/api/v1/items", &[]).await);
    }
    assert_eq!(admitted(&replies), 3);
    assert_eq!(hits.get(), 3, "a refused HEAD reached the handler");
    assert!(
        replies[3..]
            .iter()
            .all(|r| r.status == StatusCode::TOO_MANY_REQUESTS),
        "{replies:#?}"
    );
}

/// Nine POSTs to `/api/v1/checkout` and nine GETs of `/api/v1/users/<n>`, each a different
/// user: how many of each reached the handlers.
async fn attack(client: &Client) -> (usize, usize) {
    let mut checkouts = Vec::new();
    let mut users = Vec::new();
    for n in 0..9 {
        checkouts.push(client.send(Method::POST, "/api/v1/checkout", &[]).await);
        users.push(client.get(&format!("/api/v1/users/{n}")).await);
    }
    (admitted(&checkouts), admitted(&users))
}

/// The layer's limits: POST `/api/v1/checkout` 5/min, and GET of any user 3/min (by the
/// route's template).
fn route_limits() -> RateLimitLayer<MemoryStore<ManualClock>, PeerIp> {
    builder()
        .route(
            Some(Method::POST),
            "/api/v1/checkout",
            per_minute("checkout", 5),
        )
        .route(
            Some(Method::GET),
            "/api/v1/users/{id}",
            per_minute("users", 3),
        )
        .build()
        .unwrap()
}

/// The handlers, under `/checkout` and `/users/{id}`.
fn api() -> Router {
    Router::new()
        .route("/checkout", post(ok))
        .route("/users/{id}", get(ok))
}

async fn ok() -> &'static str {
    "ok"
}

/// Finding 3: inside `Router::nest` the layer saw the stripped path, so a 5/min route
/// admitted 10 of 10. Limits match the whole path (`OriginalUri`) and the matched route
/// (`MatchedPath`, nest prefix included) now: in a nested router, with `route_layer`,
/// and with the layer outside the router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_limits_hold_in_nested_routers_route_layers_and_outside_the_router() {
    // The layer on the nested router: it sees `/checkout`.
    let nested = Router::new().nest("/api/v1", api().layer(route_limits()));
    let server = Server::start(nested).await;
    assert_eq!(attack(&server.client()).await, (5, 3), "layer in nest");

    // A route layer on the nested router.
    let nested = Router::new().nest("/api/v1", api().route_layer(route_limits()));
    let server = Server::start(nested).await;
    assert_eq!(
        attack(&server.client()).await,
        (5, 3),
        "route_layer in nest"
    );

    // A route layer on a flat router.
    let flat = Router::new()
        .route("/api/v1/checkout", post(ok))
        .route("/api/v1/users/{id}", get(ok))
        .route_layer(route_limits());
    let server = Server::start(flat).await;
    assert_eq!(attack(&server.client()).await, (5, 3), "route_layer");

    // The layer around the whole router, as a tower layer: no route has matched yet, and
    // the template is matched against the path.
    let nested = Router::new().nest("/api/v1", api());
    let addr = serve_service(route_limits().layer(nested)).await;
    assert_eq!(
        attack(&Client::new(addr)).await,
        (5, 3),
        "outside the router"
    );
}

/// Serves `service` (not a router) on a free loopback port, until the test ends.
async fn serve_service<S, B>(service: S) -> SocketAddr
where
    S: tower::Service<
            axum::extract::Request,
            Response = axum::http::Response<B>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
    B: axum::body::HttpBody<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = service.map_response(|response| response.map(axum::body::Body::new));
    tokio::spawn(async move {
        axum::serve(listener, tower::make::Shared::new(service))
            .await
            .unwrap();
    });
    addr
}

/// Finding 10: a plain-HTTP route answered a refused request carrying `Content-Type:
/// application/grpc` with 200 OK and `grpc-status: 8`, which status monitoring counts as
/// a success. Over HTTP/1.1 no request is gRPC; on a layer set to `Protocol::Http` none
/// is, HTTP/2 or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dressed_as_grpc_still_gets_its_429() {
    let grpc = [("content-type", "application/grpc")];

    // The default, over HTTP/1.1.
    let hits = Hits::default();
    let layer = builder()
        .route(None, "/", per_minute("root", 1))
        .build()
        .unwrap();
    let server = support::http::serve(layer, &hits).await;
    let client = server.client();
    let replies = [
        client.get_with("/", &grpc).await,
        client.get_with("/", &grpc).await,
    ];
    assert_refused_in_http(&replies);

    // `Protocol::Http`, over HTTP/2.
    let hits = Hits::default();
    let layer = builder()
        .route(None, "/", per_minute("root", 1))
        .protocol(Protocol::Http)
        .build()
        .unwrap();
    let server = support::http::serve(layer, &hits).await;
    let client = Client::http2(server.addr());
    let replies = [
        client.get_with("/", &grpc).await,
        client.get_with("/", &grpc).await,
    ];
    assert_refused_in_http(&replies);
}

#[track_caller]
fn assert_refused_in_http(replies: &[Reply; 2]) {
    assert_eq!(replies[0].status, StatusCode::OK, "{replies:#?}");
    assert_eq!(
        replies[1].status,
        StatusCode::TOO_MANY_REQUESTS,
        "{replies:#?}"
    );
    assert_eq!(replies[1].header("grpc-status"), None, "{replies:#?}");
}
