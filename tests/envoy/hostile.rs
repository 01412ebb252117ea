//! Hostile clients at the Envoy edge: what a client that never finishes its handshake,
//! or one that sends long or made-up keys or reservations, does to tollway-server and the
//! Envoys in front of it. Each test attacks through the documented configuration and
//! checks that honest callers are still served and budgets hold.

use std::time::Instant;

use http::StatusCode;
use support::envoy::{self, Envoy};
use tokio::net::TcpStream;

use super::{File, app, limits, metrics, over_tls};

/// Connections the attacker opens: more than the gRPC port holds by default.
const ATTACKERS: usize = 1_100;

/// A client without a certificate opens 1,100 connections to the mutual-TLS gRPC port and
/// never says a word. The port holds 1,024: the oldest unfinished handshakes are closed
/// for new connections, and each is closed at the handshake timeout anyway. Meanwhile a
/// certified gRPC client, `/live`, and an Envoy started during the attack are served
/// within the handshake timeout, and that Envoy's callers are limited, not let through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_handshakes_keep_no_certified_caller_out() {
    use support::tls::TestCa;

    let ca = TestCa::new("tollway clients");
    let (server, client) = (ca.server_files(), ca.server_files());
    let dir = File::new("flood-certificates", "");
    let folder = dir.0.parent().unwrap().to_path_buf();
    let write = |name: &str, text: &str| {
        let path = folder.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let ca_file = write("ca.pem", ca.pem());
    let (cert_file, key_file) = (
        write("client.pem", &client.cert),
        write("client.key", &client.key),
    );
    let app = app().await;
    // 10 an hour by address.
    let file = File::new("flood-limits", &limits(10, 100));
    let tls = tollway_server::Tls {
        cert: server.cert.clone().into_bytes(),
        key: server.key.clone().into_bytes(),
        client_ca: Some(ca.pem().as_bytes().to_vec()),
    };
    let served = support::server::start(&file.0, support::server::any_port(), Some(tls), metrics())
        .await
        .unwrap();
    let handshake = tollway_server::Connections::default().handshake;

    let mut attackers = Vec::with_capacity(ATTACKERS);
    for _ in 0..ATTACKERS {
        attackers.push(TcpStream::connect(served.grpc).await.unwrap());
    }
    let attacked = Instant::now();

    // A certified gRPC client.
    let asked = tokio::time::timeout(handshake, ask_over_tls(served.grpc.port(), &ca, &client))
        .await
        .expect("a certified client served within the handshake timeout");
    asked.expect("a certified client served");
    // The HTTP port.
    let live = tokio::time::timeout(handshake, async {
        let client = support::http::Client::new(served.http);
        client.get("/live").await
    })
    .await
    .expect("/live within the handshake timeout");
    assert_eq!(live.status, StatusCode::OK);
    // A new Envoy, certified: its callers are decided, not let through.
    let documented = envoy::documented(app.addr(), served.grpc);
    let edge = Envoy::start(&over_tls(
        &documented,
        &ca_file,
        Some((&cert_file, &key_file)),
    ))
    .await;
    let client = edge.client();
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..60 {
        match client.get("/").await.status {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("answered {other}"),
        }
    }
    assert_eq!((ok, refused), (10, 50), "the Envoy failed open");
    assert_eq!(edge.stat("cluster.app.ratelimit.error").await, None);
    eprintln!(
        "{ATTACKERS} silent connections: a certified client, /live and a new Envoy served; \
         {:?} since the attack began",
        attacked.elapsed()
    );
    // The server never held more than its cap: on a host whose descriptor limit is near
    // it, the rest of the process keeps its descriptors.
    let held = established_on(served.grpc.port());
    let cap = tollway_server::Connections::default().grpc;
    assert!(
        held <= cap,
        "the gRPC port holds {held} connections, past {cap}"
    );
    let counted = metrics().render();
    assert!(
        counted
            .contains("tollway_server_connections_dropped_total{port=\"grpc\",reason=\"evicted\"}"),
        "{counted}"
    );
    drop(attackers);
    served.running.stop().await;
}

/// A `ShouldRateLimit` call over mutual TLS, presenting `identity`.
async fn ask_over_tls(
    port: u16,
    ca: &support::tls::TestCa,
    identity: &support::TlsFiles,
) -> Result<(), String> {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.pem()))
        .domain_name("localhost")
        .identity(Identity::from_pem(&identity.cert, &identity.key));
    let channel = Channel::from_shared(format!("https://localhost:{port}"))
        .map_err(|e| e.to_string())?
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let request = RateLimitRequest {
        domain: "edge".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "remote_address".to_owned(),
                value: "203.0.113.9".to_owned(),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    };
    RateLimitServiceClient::new(channel)
        .should_rate_limit(request)
        .await
        .map(drop)
        .map_err(|e| format!("call: {e:?}"))
}

/// Connections established to `port` on this host, the server's side of each: what
/// `/proc/net/tcp` lists with that local port.
fn established_on(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let local = format!(":{port:04X}");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // 01: ESTABLISHED.
            fields.len() > 3 && fields[1].ends_with(&local) && fields[3] == "01"
        })
        .count()
}
