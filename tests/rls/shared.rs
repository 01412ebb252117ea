//! One limit for an Envoy edge and the service behind it: the rate limit service and an
//! axum service's tower layer share one Redis and one policy, and their admissions add
//! up to it. And the helpers the tests share.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get as route_get;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use support::http::{Client, Server};
use support::redis::RedisServer;
use tollway_tower::config::LimitsFile;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use super::{File, ask, descriptor, on_redis, serve};

/// What gRPC health says of `service` (`""`: the server as a whole).
pub(crate) async fn health(grpc: SocketAddr, service: &str) -> String {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let request = HealthCheckRequest {
        service: service.to_owned(),
    };
    let status = client.check(request).await.unwrap().into_inner().status();
    format!("{status:?}")
}

/// The status and body of `GET path` on the HTTP port.
pub(crate) async fn get(http: SocketAddr, path: &str) -> (u16, String) {
    let reply = Client::new(http).get(path).await;
    (reply.status.as_u16(), reply.body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_and_the_service_behind_it_share_one_limit() {
    let redis = RedisServer::start();
    let file = File::new("shared", &on_redis(&redis.url(), "allow"));
    // The service behind the edge: the layer of the same file, over the same Redis.
    let limits = LimitsFile::read(&file.0).unwrap();
    let store = limits.store().await.unwrap();
    let layer = limits.layer(store, limits.key().unwrap()).unwrap();
    let app = Router::new()
        .route("/", route_get(|| async { "hello" }))
        .layer(layer);
    let service = Server::start(app).await;
    let http = service.client();
    let mut edge = serve(&file.0).await;
    // The edge sees the same caller as the service does: 127.0.0.1.
    let me = || vec![descriptor(&[("remote_address", "127.0.0.1")])];

    let mut admitted = 0;
    for round in 0..4 {
        if http.get("/").await.status == http::StatusCode::OK {
            admitted += 1;
        }
        if ask(&mut edge.client, me()).await.overall_code == Code::Ok as i32 {
            admitted += 1;
        }
        if round == 0 {
            // The first of each: two of the three admitted.
            assert_eq!(admitted, 2);
        }
    }
    assert_eq!(admitted, 3, "one limit of 3 a minute, shared");
    let (status, scrape) = get(edge.http, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        scrape.contains("tollway_decisions_total{policy=\"per_address\",outcome=\"limited\"}"),
        "{scrape}"
    );
    assert_eq!(get(edge.http, "/live").await.0, 200);
    edge.running.stop().await;
}
