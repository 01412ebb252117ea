//! tollway-server end to end: a real gRPC client over Envoy's generated types, real
//! listeners on 127.0.0.1:0, a real `redis-server` where the store is Redis.

#![allow(clippy::unwrap_used)]

mod quota;
mod shared;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::OnceLock;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use support::redis::RedisServer;
use tonic::transport::Channel;

/// The rate limit service's name, as gRPC health knows it.
const RLS: &str = "envoy.service.ratelimit.v3.RateLimitService";

use support::TempFile as File;

/// The binary's one recorder: every server of this binary renders it.
fn metrics() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| PrometheusBuilder::new().install_recorder().unwrap())
        .clone()
}

/// A server of `config` on free loopback ports, and a client of it.
struct Served {
    running: tollway_server::Running,
    client: RateLimitServiceClient<Channel>,
    grpc: SocketAddr,
    http: SocketAddr,
}

/// A server of `config` on free loopback ports, its gRPC port served with `tls`, and
/// those ports.
async fn start(
    config: &Path,
    tls: Option<tollway_server::Tls>,
) -> Result<(tollway_server::Running, SocketAddr, SocketAddr), tollway_core::ConfigError> {
    let served =
        support::server::start(config, support::server::any_port(), tls, metrics()).await?;
    Ok((served.running, served.grpc, served.http))
}

async fn serve(config: &Path) -> Served {
    let (running, grpc_addr, http_addr) = start(config, None).await.unwrap();
    let client = RateLimitServiceClient::connect(format!("http://{grpc_addr}"))
        .await
        .unwrap();
    Served {
        running,
        client,
        grpc: grpc_addr,
        http: http_addr,
    }
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect(),
        ..Default::default()
    }
}

fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

async fn ask(
    client: &mut RateLimitServiceClient<Channel>,
    descriptors: Vec<RateLimitDescriptor>,
) -> RateLimitResponse {
    client
        .should_rate_limit(request(descriptors))
        .await
        .unwrap()
        .into_inner()
}

fn header<'r>(response: &'r RateLimitResponse, name: &str) -> Option<&'r str> {
    response
        .response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

const LIMITS: &str = r#"
[layer]
default = "per_address"

[policies.per_address]
algorithm = "gcra"
limit = 3
period = "1m"

[policies.checkout]
algorithm = "fixed_window"
limit = 1
period = "1h"

[[descriptors]]
domain = "edge"
entries = [{ key = "remote_address" }]
policy = "per_address"
key = "ip"

[[descriptors]]
domain = "edge"
entries = [{ key = "path", value = "/api/v1/checkout" }]
policy = "checkout"

[[descriptors]]
domain = "edge"
entries = [{ key = "api_key", value = "internal-*" }]
unlimited = true
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_is_allowed_to_its_limit_then_over_it() {
    let file = File::new("limit", LIMITS);
    let mut served = serve(&file.0).await;
    let me = || vec![descriptor(&[("remote_address", "203.0.113.9")])];
    for remaining in [2, 1, 0] {
        let response = ask(&mut served.client, me()).await;
        assert_eq!(response.overall_code, Code::Ok as i32);
        let status = &response.statuses[0];
        assert_eq!(status.code, Code::Ok as i32);
        assert_eq!(status.limit_remaining, remaining);
        let limit = status.current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (3, Unit::Minute as i32)
        );
        assert_eq!(limit.name, "per_address");
        assert_eq!(
            header(&response, "x-ratelimit-remaining"),
            Some(&*remaining.to_string())
        );
    }
    let over = ask(&mut served.client, me()).await;
    assert_eq!(over.overall_code, Code::OverLimit as i32);
    assert_eq!(over.statuses[0].code, Code::OverLimit as i32);
    let reset = over.statuses[0].duration_until_reset.as_ref().unwrap();
    assert!((1..=60).contains(&reset.seconds), "{reset:?}");
    assert_eq!(header(&over, "retry-after"), Some("20"));
    assert_eq!(header(&over, "x-ratelimit-limit"), Some("3"));
    // Another address is its own count.
    let other = ask(
        &mut served.client,
        vec![descriptor(&[("remote_address", "198.51.100.1")])],
    )
    .await;
    assert_eq!(other.overall_code, Code::Ok as i32);
    served.running.stop().await;
}

// One descriptor over its limit refuses the request, and the others' charges are given
// back: the address's count is what its admitted requests took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_decided_all_or_nothing() {
    let file = File::new("all-or-nothing", LIMITS);
    let mut served = serve(&file.0).await;
    let both = || {
        vec![
            descriptor(&[("remote_address", "203.0.113.7")]),
            descriptor(&[("path", "/api/v1/checkout")]),
        ]
    };
    let first = ask(&mut served.client, both()).await;
    assert_eq!(first.overall_code, Code::Ok as i32);
    let second = ask(&mut served.client, both()).await;
    assert_eq!(second.overall_code, Code::OverLimit as i32);
    assert_eq!(
        second.statuses[0].code,
        Code::Ok as i32,
        "within its own limit"
    );
    assert_eq!(second.statuses[1].code, Code::OverLimit as i32);
    // The address was charged once: two of three remain after this third look.
    let address = ask(
        &mut served.client,
        vec![descriptor(&[("remote_address", "203.0.113.7")])],
    )
    .await;
    assert_eq!(address.statuses[0].limit_remaining, 1);
    // A descriptor's own hits: 0 looks without charging.
    let mut look = descriptor(&[("remote_address", "203.0.113.7")]);
    look.hits_addend = Some(UInt64Value { value: 0 });
    let looked = ask(&mut served.client, vec![look]).await;
    assert_eq!(looked.statuses[0].limit_remaining, 1);
    served.running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_unlimited_descriptors_are_ok_without_a_limit() {
    let file = File::new("unknown", LIMITS);
    let mut served = serve(&file.0).await;
    let response = ask(
        &mut served.client,
        vec![
            descriptor(&[("user_agent", "curl")]),
            descriptor(&[("api_key", "internal-batch")]),
        ],
    )
    .await;
    assert_eq!(response.overall_code, Code::Ok as i32);
    assert!(response.statuses[0].current_limit.is_none());
    assert_eq!(response.statuses[0].limit_remaining, 0);
    assert_eq!(response.statuses[1].limit_remaining, u32::MAX);
    assert!(response.response_headers_to_add.is_empty());
    // Another domain: none of the rules.
    let mut other = request(vec![descriptor(&[("remote_address", "203.0.113.9")])]);
    other.domain = "internal".to_owned();
    let response = served
        .client
        .should_rate_limit(other)
        .await
        .unwrap()
        .into_inner();
    assert!(response.statuses[0].current_limit.is_none());
    // No domain, or no descriptor: the request is malformed.
    let mut empty = request(vec![descriptor(&[("remote_address", "1.2.3.4")])]);
    empty.domain.clear();
    let refused = served.client.should_rate_limit(empty).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    let refused = served
        .client
        .should_rate_limit(request(vec![]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    served.running.stop().await;
}

// A reload puts a new limit in force, callers keeping what they used; a broken file
// keeps the running one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changes_the_limits_and_a_broken_file_keeps_them() {
    let file = File::new("reload", LIMITS);
    let mut served = serve(&file.0).await;
    let me = || vec![descriptor(&[("remote_address", "203.0.113.5")])];
    assert_eq!(
        ask(&mut served.client, me()).await.statuses[0].limit_remaining,
        2
    );
    file.write(&LIMITS.replace("limit = 3", "limit = 30"));
    served.running.reload().await.unwrap();
    let raised = ask(&mut served.client, me()).await;
    // The caller keeps what it used: 2 of 30.
    assert_eq!(raised.statuses[0].limit_remaining, 28);
    assert_eq!(
        raised.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        30
    );
    file.write(&LIMITS.replace("limit = 3", "limit = 0"));
    assert!(served.running.reload().await.is_err());
    let kept = ask(&mut served.client, me()).await;
    assert_eq!(
        kept.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        30
    );
    // One follower of the file: a new store is refused by the limits, and the
    // descriptors that came with it are not put in force either.
    let moved = LIMITS
        .replace("limit = 3", "limit = 30")
        .replace("key = \"ip\"\n", "key = \"ip\"\n\n[[descriptors]]\ndomain = \"edge\"\nentries = [{ key = \"user\" }]\npolicy = \"checkout\"\n")
        + "\n[store]\nkind = \"memory\"\nmax_keys = 10\n";
    file.write(&moved);
    let error = served.running.reload().await.unwrap_err().to_string();
    assert!(error.contains("[store]"), "{error}");
    let user = ask(&mut served.client, vec![descriptor(&[("user", "u-1")])]).await;
    assert!(
        user.statuses[0].current_limit.is_none(),
        "no rule for it yet"
    );
    served.running.stop().await;
}

/// The limits on a Redis at `url`, whose failures the file answers by `on_error`.
fn on_redis(url: &str, on_error: &str) -> String {
    let store = format!(
        "[store]\nkind = \"redis\"\nurl = \"{url}\"\ntimeout_ms = 100\nstall_after_ms = 1000\nlocal_fallback = false\n"
    );
    let limits = LIMITS.replace(
        "default = \"per_address\"",
        &format!("default = \"per_address\"\non_store_error = \"{on_error}\""),
    );
    format!("{store}{limits}")
}

// A dead Redis: the file's failure policy answers, and readiness (gRPC health, /ready)
// says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_is_answered_by_the_files_failure_policy() {
    let mut redis = RedisServer::start();
    let open = File::new("open", &on_redis(&redis.url(), "allow"));
    let closed = File::new("closed", &on_redis(&redis.url(), "reject"));
    let mut allow = serve(&open.0).await;
    let mut reject = serve(&closed.0).await;
    let me = || vec![descriptor(&[("remote_address", "203.0.113.4")])];
    assert_eq!(
        ask(&mut allow.client, me()).await.statuses[0].limit_remaining,
        2
    );
    assert!(allow.running.probe().await, "the store answers");
    for service in [RLS, ""] {
        assert_eq!(shared::health(allow.grpc, service).await, "Serving");
    }
    assert_eq!(shared::get(allow.http, "/ready").await.0, 200);

    redis.kill();
    let open_answer = ask(&mut allow.client, me()).await;
    assert_eq!(open_answer.overall_code, Code::Ok as i32);
    assert!(
        open_answer.statuses[0].current_limit.is_none(),
        "no decision to report"
    );
    let refused = reject
        .client
        .should_rate_limit(request(me()))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    assert!(!allow.running.probe().await, "the store is gone");
    assert!(!allow.running.is_ready());
    for service in [RLS, ""] {
        assert_eq!(shared::health(allow.grpc, service).await, "NotServing");
    }
    assert_eq!(shared::get(allow.http, "/ready").await.0, 503);
    allow.running.stop().await;
    reject.running.stop().await;
}

// A policy in shadow mode answers OK where it would be over, and counts that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_in_shadow_mode_answers_ok_and_counts_what_it_would_refuse() {
    let shadowed = LIMITS.replace(
        "limit = 3\nperiod = \"1m\"",
        "limit = 3\nperiod = \"1m\"\nshadow = true",
    );
    let file = File::new("shadow", &shadowed);
    let mut served = serve(&file.0).await;
    let me = || vec![descriptor(&[("remote_address", "203.0.113.3")])];
    for _ in 0..5 {
        let response = ask(&mut served.client, me()).await;
        assert_eq!(response.overall_code, Code::Ok as i32);
        assert_eq!(response.statuses[0].code, Code::Ok as i32);
    }
    let (_, scrape) = shared::get(served.http, "/metrics").await;
    assert!(
        scrape.contains(
            "tollway_decisions_total{policy=\"per_address\",outcome=\"shadow_limited\"} 2"
        ),
        "{scrape}"
    );
    served.running.stop().await;
}

// The binary's default file is valid, and limits what it says.
#[test]
fn the_default_limits_file_is_valid() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/tollway-server/limits.toml"
    );
    let file = tollway_tower::config::LimitsFile::read(path).unwrap();
    let summary = file.summary();
    assert!(
        summary.contains("descriptor: edge (remote_address=*) -> per_address"),
        "{summary}"
    );
    assert!(
        summary.contains("descriptor: edge (api_key=*) -> per_api_key"),
        "{summary}"
    );
}

// A descriptor's `limit` (a per-customer limit Envoy sends) decides in place of the
// file's policy, under the same budget: the caller keeps what it used. A `limit` that
// cannot be a policy (0 a minute) leaves the file's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptors_own_limit_decides_and_keeps_what_was_used() {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;

    let file = File::new("override", LIMITS);
    let mut served = serve(&file.0).await;
    let me = |limit: Option<u32>| {
        let mut d = descriptor(&[("remote_address", "203.0.113.9")]);
        d.limit = limit.map(|requests_per_unit| RateLimitOverride {
            requests_per_unit,
            unit: RateLimitUnit::Minute as i32,
        });
        vec![d]
    };
    // The file's 3 a minute: 2 used.
    for _ in 0..2 {
        assert_eq!(
            ask(&mut served.client, me(None)).await.overall_code,
            Code::Ok as i32
        );
    }
    // This customer's own 10 a minute: 7 more, then refused.
    let own = ask(&mut served.client, me(Some(10))).await;
    assert_eq!(own.statuses[0].limit_remaining, 7);
    let stated = own.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(
        (stated.requests_per_unit, stated.unit),
        (10, Unit::Minute as i32)
    );
    for _ in 0..7 {
        assert_eq!(
            ask(&mut served.client, me(Some(10))).await.overall_code,
            Code::Ok as i32
        );
    }
    let over = ask(&mut served.client, me(Some(10))).await;
    assert_eq!(over.overall_code, Code::OverLimit as i32);
    // What cannot be a policy leaves the file's 3, spent: 0 a minute, an unknown unit,
    // or the most a second (finer than GCRA's microsecond).
    let unit = |requests_per_unit: u32, unit: i32| {
        let mut d = descriptor(&[("remote_address", "203.0.113.9")]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit,
            unit,
        });
        vec![d]
    };
    let minute = RateLimitUnit::Minute as i32;
    let second = RateLimitUnit::Second as i32;
    for hostile in [
        unit(0, minute),
        unit(100, 99),
        unit(100, 0),
        unit(u32::MAX, second),
    ] {
        let answer = ask(&mut served.client, hostile).await;
        assert_eq!(answer.overall_code, Code::OverLimit as i32);
        let stated = answer.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(stated.requests_per_unit, 3);
    }
    served.running.stop().await;
}

// Requests past tollway-server's bounds are refused INVALID_ARGUMENT before the store
// sees a call, and counted: 50,000 descriptors in one 1.5 MB request (which once cost
// 50,000 store decisions and 100 MB), 65 descriptors, a descriptor of 17 entries, a
// value of 64 KiB + 1, a message past 4 MiB (which gRPC itself would call
// OUT_OF_RANGE). Within them, the request is decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_bounds_are_refused_before_any_store_call() {
    use tollway_server::bounds;

    let redis = RedisServer::start();
    let file = File::new("bounds", &on_redis(&redis.url(), "allow"));
    let mut served = serve(&file.0).await;
    let mut node = redis.connection().await;
    // Readiness peeks at the store once a second: those are the only script calls
    // allowed while the requests are refused.
    let started = std::time::Instant::now();
    let before = support::redis::script_calls(&mut node).await;
    let many = |n: usize| {
        (0..n)
            .map(|i| {
                descriptor(&[(
                    "remote_address",
                    &format!("203.0.{}.{}", i / 256 % 256, i % 256),
                )])
            })
            .collect::<Vec<_>>()
    };
    let flood = many(50_000);
    let bytes = prost::Message::encoded_len(&request(flood.clone()));
    assert!(bytes > 1_000_000, "{bytes} bytes");
    let wide = descriptor(&[("remote_address", "203.0.113.4"); bounds::ENTRIES + 1]);
    let long = "v".repeat(bounds::VALUE_BYTES + 1);
    let long = descriptor(&[("remote_address", long.as_str())]);
    let full = "v".repeat(bounds::VALUE_BYTES);
    let heavy = vec![descriptor(&[("remote_address", full.as_str())]); 80];
    let bytes = prost::Message::encoded_len(&request(heavy.clone()));
    assert!(bytes > bounds::MESSAGE_BYTES, "{bytes} bytes");
    for descriptors in [
        flood,
        many(bounds::DESCRIPTORS + 1),
        vec![wide],
        vec![long],
        heavy,
    ] {
        let refused = served
            .client
            .should_rate_limit(request(descriptors))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains("bounds"), "{refused:?}");
    }
    let calls = support::redis::script_calls(&mut node).await - before;
    let probes = 2 * (started.elapsed().as_secs() + 1);
    assert!(
        calls <= probes,
        "{calls} script calls: the readiness probe makes {probes} at most"
    );
    let counted = metrics().render();
    for reason in ["descriptors", "entries", "value_bytes", "message_bytes"] {
        let line = format!("tollway_rls_requests_refused_total{{reason=\"{reason}\"}}");
        assert!(counted.contains(&line), "{reason}: {counted}");
    }
    let within = ask(&mut served.client, many(bounds::DESCRIPTORS)).await;
    assert_eq!(within.statuses.len(), bounds::DESCRIPTORS);
    assert!(support::redis::script_calls(&mut node).await > before);
    served.running.stop().await;
}

/// A client of the server at `port` over TLS, verifying it against `ca` (PEM), and
/// presenting `identity` when given; `Err` when the handshake or the call fails.
async fn ask_over_tls(
    port: u16,
    ca: &str,
    identity: Option<&support::TlsFiles>,
) -> Result<RateLimitResponse, String> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some(files) = identity {
        tls = tls.identity(Identity::from_pem(&files.cert, &files.key));
    }
    let channel = Channel::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let mut client = RateLimitServiceClient::new(channel);
    let me = vec![descriptor(&[("remote_address", "203.0.113.4")])];
    client
        .should_rate_limit(request(me))
        .await
        .map(tonic::Response::into_inner)
        .map_err(|e| format!("call: {e:?}"))
}

// Mutual TLS on the gRPC port: a client with a certificate the server's client CA
// signed is served; one without a certificate, one with another CA's, and one in plain
// text are refused before any call. A key that is not a key fails the start, and says
// so without the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_serves_only_clients_with_a_trusted_certificate() {
    use support::tls::TestCa;

    let (ca, rogue) = (TestCa::new("tollway clients"), TestCa::new("someone else"));
    let server = ca.server_files();
    let file = File::new("mtls", LIMITS);
    let with_key = |key: String| {
        let tls = tollway_server::Tls {
            cert: server.cert.clone().into_bytes(),
            key: key.into_bytes(),
            client_ca: Some(ca.pem().as_bytes().to_vec()),
        };
        start(&file.0, Some(tls))
    };
    let (running, grpc, _) = with_key(server.key.clone()).await.unwrap();
    let port = grpc.port();
    let served = ask_over_tls(port, ca.pem(), Some(&ca.server_files())).await;
    assert_eq!(served.unwrap().overall_code, Code::Ok as i32);
    let refused = [
        ask_over_tls(port, ca.pem(), None).await,
        ask_over_tls(port, ca.pem(), Some(&rogue.server_files())).await,
    ];
    for refused in refused {
        assert!(refused.is_err(), "{refused:?}");
    }
    let mut plain = RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    let me = vec![descriptor(&[("remote_address", "203.0.113.4")])];
    assert!(plain.should_rate_limit(request(me)).await.is_err());
    running.stop().await;

    let not_a_key =
        "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWJ1dC1ub3QtYS1rZXk=\n-----END PRIVATE KEY-----\n";
    let error = with_key(not_a_key.to_owned())
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("TLS on the gRPC port"), "{error}");
    assert!(!error.contains("c2VjcmV0"), "the key is repeated: {error}");
}

// A rule's floor: with `min_hits`, a descriptor of 0 hits (a client's "0" through a
// `hits_addend` format) charges the floor, and refuses when the budget is spent, where
// a rule without one would only look.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rules_floor_makes_zero_hits_a_charge() {
    // A policy of its own: the counters another test reads do not move.
    let floored = CAPPED
        .replace("per_key", "floored")
        .replace("max_hits = 10", "max_hits = 50\nmin_hits = 40");
    let file = File::new("floored", &floored);
    let mut served = serve(&file.0).await;
    let zero = || {
        let mut d = descriptor(&[("api_key", "k-1")]);
        d.hits_addend = Some(UInt64Value { value: 0 });
        vec![d]
    };
    let lefts: Vec<u32> = {
        let mut lefts = Vec::new();
        for _ in 0..3 {
            lefts.push(ask(&mut served.client, zero()).await.statuses[0].limit_remaining);
        }
        lefts
    };
    assert_eq!(
        lefts,
        [60, 20, 20],
        "0 hits charge 40; the third does not fit"
    );
    let refused = ask(&mut served.client, zero()).await;
    assert_eq!(refused.overall_code, Code::OverLimit as i32);
}

// `trial` is the layer's policy: tollway_decisions_total counts the layer's policies.
const CAPPED: &str = r#"
[layer]
default = "trial"

[policies.per_key]
algorithm = "token_bucket"
limit = 100
period = "1h"

[policies.trial]
algorithm = "fixed_window"
limit = 1
period = "1h"

[[descriptors]]
domain = "edge"
entries = [{ key = "api_key" }]
policy = "per_key"
max_hits = 10

[[descriptors]]
domain = "edge"
entries = [{ key = "trial" }]
policy = "trial"
shadow_mode = true
"#;

// A rule's `max_hits` caps what one descriptor charges and what it gives back
// (`is_negative_hits`), so a caller of the port drains or refills at most that much a
// call. A rule in `shadow_mode` is decided and counted, and never refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rules_hit_cap_and_shadow_mode_hold() {
    let file = File::new("capped", CAPPED);
    let mut served = serve(&file.0).await;
    let hits = |n: u64, back: bool| {
        let mut d = descriptor(&[("api_key", "k-1")]);
        d.hits_addend = Some(UInt64Value { value: n });
        d.is_negative_hits = back;
        vec![d]
    };
    let first = ask(&mut served.client, hits(1_000_000, false)).await;
    assert_eq!(first.overall_code, Code::Ok as i32);
    assert_eq!(
        first.statuses[0].limit_remaining, 90,
        "charged 10, not a million"
    );
    for left in [80, 70] {
        let r = ask(&mut served.client, hits(10, false)).await;
        assert_eq!(r.statuses[0].limit_remaining, left);
    }
    let back = ask(&mut served.client, hits(1_000_000, true)).await;
    assert_eq!(back.overall_code, Code::Ok as i32);
    assert_eq!(
        back.statuses[0].limit_remaining, 80,
        "given back 10, not a million"
    );
    assert!(
        back.response_headers_to_add.is_empty(),
        "a give-back is no decision"
    );
    assert_eq!(
        ask(&mut served.client, hits(0, false)).await.statuses[0].limit_remaining,
        80
    );

    let trial = || vec![descriptor(&[("trial", "t-1")])];
    for _ in 0..3 {
        let r = ask(&mut served.client, trial()).await;
        assert_eq!(
            r.overall_code,
            Code::Ok as i32,
            "a rule in shadow never refuses"
        );
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
    }
    let counted = metrics().render();
    for line in [
        "tollway_decisions_total{policy=\"trial\",outcome=\"shadow_limited\"}",
        // Every descriptor's policy, the layer's or not, by the service's own counters.
        "tollway_rls_decisions_total{policy=\"per_key\",outcome=\"allowed\"} 4",
        "tollway_rls_decisions_total{policy=\"trial\",outcome=\"shadow_limited\"} 2",
        "tollway_rls_near_limit_total{policy=\"trial\"} 1",
    ] {
        assert!(counted.contains(line), "{line}: {counted}");
    }
    served.running.stop().await;
}

const REPLACING: &str = r#"
[layer]
default = "per_address"

[policies.per_address]
algorithm = "gcra"
limit = 2
period = "1h"

[policies.partner]
algorithm = "gcra"
limit = 100
period = "1h"

[[descriptors]]
name = "by_address"
domain = "edge"
entries = [{ key = "remote_address" }]
policy = "per_address"
key = "ip"

[[descriptors]]
domain = "edge"
entries = [{ key = "api_key", value = "partner-*" }]
policy = "partner"
replaces = ["by_address"]
"#;

// `replaces`: a request that matches a partner's key skips the address limit it
// replaces (its status carries no limit), and counts on the partner's own; without
// the key, the address limit holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_that_replaces_another_skips_its_limit() {
    let file = File::new("replacing", REPLACING);
    let mut served = serve(&file.0).await;
    let both = || {
        vec![
            descriptor(&[("remote_address", "203.0.113.7")]),
            descriptor(&[("api_key", "partner-acme")]),
        ]
    };
    for left in (95..100).rev() {
        let r = ask(&mut served.client, both()).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert!(
            r.statuses[0].current_limit.is_none(),
            "the address limit is skipped"
        );
        assert_eq!(r.statuses[1].limit_remaining, left);
    }
    let alone = || vec![descriptor(&[("remote_address", "203.0.113.7")])];
    for _ in 0..2 {
        assert_eq!(
            ask(&mut served.client, alone()).await.overall_code,
            Code::Ok as i32
        );
    }
    let refused = ask(&mut served.client, alone()).await;
    assert_eq!(
        refused.overall_code,
        Code::OverLimit as i32,
        "the address counted only its own"
    );
    served.running.stop().await;
}
