//! Hostile clients at the Envoy edge: what a client that never finishes its handshake,
//! or one that sends long or made-up keys or reservations, does to tollway-server and the
//! Envoys in front of it. Each test attacks through the documented configuration and
//! checks that honest callers are still served and budgets hold.

use std::time::Instant;

use http::StatusCode;
use support::envoy::{self, Envoy};
use tokio::net::TcpStream;

use super::{Certified, File, app, limits, metrics, over_tls};

/// Connections the attacker opens: more than the gRPC port holds by default.
const ATTACKERS: usize = 1_100;

/// A client without a certificate opens 1,100 connections to the mutual-TLS gRPC port and
/// never says a word. The port holds 1,024: the oldest unfinished handshakes are closed
/// for new connections, and each is closed at the handshake timeout anyway. Meanwhile a
/// certified gRPC client, `/live`, and an Envoy started during the attack are served
/// within the handshake timeout, and that Envoy's callers are limited, not let through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_handshakes_keep_no_certified_caller_out() {
    let Certified {
        ca,
        server,
        client,
        ca_file,
        cert_file,
        key_file,
        _dir,
    } = Certified::new("flood-certificates");
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

/// Limits for the quota tests: 20 a second a bucket, by the client name the API key
/// filter writes (the documented configuration) or by the raw key (a configuration that
/// trusts the client's header).
fn quota_limits() -> String {
    r#"
[layer]
default = "per_key"

[policies.per_key]
algorithm = "token_bucket"
limit = 20
period = "1s"

[[buckets]]
domain = "edge"
entries = [{ key = "client" }]
policy = "per_key"

[[buckets]]
domain = "edge"
entries = [{ key = "api_key" }]
policy = "per_key"

[[buckets]]
domain = "edge"
entries = [{ key = "caller", value = "anonymous" }]
policy = "per_key"
"#
    .to_owned()
}

/// The documented quota configuration as it was before it trusted only Envoy's keys: the
/// API key filter taken out, each bucket the raw `x-api-key` a client sends.
fn trusting_the_header(documented: &str) -> String {
    let start = documented
        .find("          - name: envoy.filters.http.api_key_auth")
        .unwrap();
    let end = documented
        .find("          - name: envoy.filters.http.rate_limit_quota")
        .unwrap();
    let without = format!("{}{}", &documented[..start], &documented[end..]);
    without
        .replace("header_name: x-client", "header_name: x-api-key")
        .replace(
            "                              client:\n",
            "                              api_key:\n",
        )
}

/// Requests from `key` at `per_second` for `seconds`: how many were served, refused.
async fn steady(
    client: &support::http::Client,
    key: &str,
    per_second: u64,
    seconds: u64,
) -> (u64, u64) {
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(1_000 / per_second));
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..per_second * seconds {
        tick.tick().await;
        match client.get_with("/", &[("x-api-key", key)]).await.status {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("{key}: answered {other}"),
        }
    }
    (ok, refused)
}

/// Whether a client under its limit was served: all but a tenth. Envoy's bucket is a
/// few tokens (its share of the burst), so requests that a loaded Envoy passes on in a
/// bunch may find it empty; an Envoy told DENY_ALL, or a bucket abandoned, serves none.
fn mostly(ok: u64, refused: u64) -> bool {
    refused * 10 <= ok + refused
}

/// Waits until `key`'s bucket has its first assignment: a request of it is served (its
/// first is refused while Envoy asks, the documented DENY_ALL).
async fn assigned(client: &support::http::Client, key: &str) {
    support::within(&format!("{key}'s first assignment"), 20, async {
        while client.get_with("/", &[("x-api-key", key)]).await.status != StatusCode::OK {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// The attack: 100 requests with 50 KB keys, then 4,100 made-up keys, each a new one.
async fn long_and_made_up_keys(client: &support::http::Client) -> Vec<StatusCode> {
    let mut answers = Vec::new();
    for n in 0..100 {
        let long = format!("{n:04}{}", "x".repeat(50_000));
        answers.push(client.get_with("/", &[("x-api-key", &long)]).await.status);
    }
    for n in 0..4_100 {
        let made_up = format!("made-up-{n}");
        answers.push(
            client
                .get_with("/", &[("x-api-key", &made_up)])
                .await
                .status,
        );
    }
    answers
}

/// Through the documented quota configuration, a client's long and made-up keys are
/// refused by Envoy's API key filter before any bucket: tollway-server never sees them,
/// and the honest clients' buckets are served at their limit before, during and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_envoy_does_not_trust_make_no_bucket() {
    let app = app().await;
    let file = File::new("rlqs-trusted", &quota_limits());
    let served = support::server::start(&file.0, support::server::any_port(), None, metrics())
        .await
        .unwrap();
    let documented = envoy::documented_file("envoy-rlqs.yaml", app.addr(), served.grpc);
    let edge = Envoy::start(&super::rlqs::with_credentials(&documented)).await;
    let client = edge.client();
    // An honest client under its limit, once its bucket is assigned.
    assigned(&client, "honest-1").await;
    let honest = {
        let client = client.clone();
        tokio::spawn(async move { steady(&client, "honest-1", 10, 12).await })
    };
    let attacker = edge.client();
    let answers = long_and_made_up_keys(&attacker).await;
    assert!(
        answers.iter().all(|s| *s == StatusCode::UNAUTHORIZED),
        "every made-up key refused 401"
    );
    let (ok, refused) = honest.await.unwrap();
    eprintln!("trusted keys only: the honest client served {ok}, refused {refused}");
    assert!(
        mostly(ok, refused),
        "the honest client under its limit is served"
    );
    // A flood by an honest key is held at its bucket.
    let (ok, _) = steady(&client, "honest-2", 100, 3).await;
    assert!(ok <= 20 + 20 * 3 + 2, "{ok} served of honest-2's flood");
    let counted = metrics().render();
    assert!(
        !counted.contains("tollway_rlqs_streams_ended_total"),
        "{counted}"
    );
    served.running.stop().await;
}

/// Through a configuration that buckets the raw `x-api-key` (what the documented one did
/// before): 100 keys of 50 KB and 4,100 made-up keys. Envoy's next report of every bucket
/// is megabytes long: tollway-server reads it, gives the quietest buckets' places to new
/// ones past a stream's bound, and keeps serving the rest. A client served before the
/// attack is served throughout, a new one after it is served, budgets hold, and no
/// stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_and_made_up_keys_leave_honest_buckets_served() {
    let app = app().await;
    let file = File::new("rlqs-raw", &quota_limits());
    let served = support::server::start(&file.0, support::server::any_port(), None, metrics())
        .await
        .unwrap();
    let documented = envoy::documented_file("envoy-rlqs.yaml", app.addr(), served.grpc);
    let edge = Envoy::start(&trusting_the_header(&documented)).await;
    let client = edge.client();
    // A client served for two of Envoy's reports (its demand known) before the attack.
    assigned(&client, "honest-1").await;
    let (ok, refused) = steady(&client, "honest-1", 10, 11).await;
    assert!(
        mostly(ok, refused),
        "before the attack: {ok} served, {refused} refused"
    );
    let honest = {
        let client = client.clone();
        tokio::spawn(async move { steady(&client, "honest-1", 10, 20).await })
    };
    let attacker = edge.client();
    let answers = long_and_made_up_keys(&attacker).await;
    assert_eq!(answers.len(), 4_200);
    let (ok, refused) = honest.await.unwrap();
    eprintln!("raw keys: the served client got {ok}, refused {refused} during the attack");
    assert!(
        mostly(ok, refused),
        "a client served before the attack is served through it"
    );
    // A new client after the attack: its first request waits for its bucket (one round
    // trip, the documented DENY_ALL), then it is served.
    assigned(&client, "honest-3").await;
    let (ok, refused) = steady(&client, "honest-3", 10, 5).await;
    assert!(
        mostly(ok, refused),
        "a new client after the attack: {ok} served, {refused} refused"
    );
    let (flood, _) = steady(&client, "honest-2", 100, 3).await;
    assert!(
        flood <= 20 + 20 * 3 + 2,
        "{flood} served of honest-2's flood"
    );
    let counted = metrics().render();
    assert!(
        !counted.contains("tollway_rlqs_streams_ended_total"),
        "{counted}"
    );
    assert!(
        counted.contains("tollway_rlqs_buckets_abandoned_total{reason=\"evicted\"}"),
        "{counted}"
    );
    served.running.stop().await;
}
