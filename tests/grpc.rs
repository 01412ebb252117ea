//! The rate-limiting layer in front of a real tonic server on 127.0.0.1:0, called by a
//! real tonic client over HTTP/2, on a manual clock so that every value is exact.
//!
//! The service is `demo.Catalog` from `examples/grpc_demo.rs` (written by hand: no
//! `protoc`). A denied call must end with `RESOURCE_EXHAUSTED` — never a bare 429, which a
//! tonic client reports as `UNAVAILABLE` — carrying `google.rpc.RetryInfo` with the
//! decision's exact wait, `google.rpc.QuotaFailure` naming the policy, and `retry-after`,
//! `grpc-retry-pushback-ms` and `x-ratelimit-*` metadata.
//!
//! Tests that run twice, as `<test>::memory` and `<test>::redis`, run the same body over
//! a [`MemoryStore`] and over a [`RedisStore`] in caller-time mode, both reading the one
//! manual clock that the layer also reads for `x-ratelimit-reset`.
#![allow(clippy::unwrap_used)]

#[path = "../examples/grpc_demo.rs"]
mod demo;
mod support;
#[macro_use]
#[path = "support/stores.rs"]
mod stores;
#[path = "support/http.rs"]
mod web;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use demo::{
    Catalog, CatalogClient, EXPORT, ExportReply, ExportRequest, LookupReply, LookupRequest,
};
use http::{Method, StatusCode};
use support::RedisServer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tollway_core::{Algorithm, ManualClock, Policy, Quota, RedisStore, Store};
use tollway_tower::{ApiKey, HeaderStyle, KeyExtractor, MissingKey, OnStoreError, RateLimitLayer};
use tonic::metadata::MetadataMap;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Server;
use tonic::{Code, Status};
use tonic_types::StatusExt;

use stores::{EPOCH_S, EPOCH_US, memory_store, per_minute};

/// What `QuotaFailure` says about a [`per_minute`] policy of `n`.
fn per_minute_violation(name: &str, n: u32) -> (String, String) {
    (
        format!("policy:{name}"),
        format!("at most {n} units per 60 s (token_bucket)"),
    )
}

/// A tonic server on `127.0.0.1:<free port>`, serving from a spawned task; stopped on
/// drop.
#[derive(Debug)]
struct GrpcServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl GrpcServer {
    /// Binds a free loopback port and serves what `serve` makes of it. The port is bound
    /// before this returns, so clients may connect at once.
    async fn start<F>(serve: impl FnOnce(TcpListenerStream) -> F) -> Self
    where
        F: Future<Output = Result<(), tonic::transport::Error>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a free loopback port");
        let addr = listener.local_addr().expect("the listener's address");
        let server = serve(TcpListenerStream::new(listener));
        let task = tokio::spawn(async move {
            server.await.expect("the tonic server failed");
        });
        GrpcServer { addr, task }
    }

    /// A tonic client connected to this server.
    async fn client(&self) -> CatalogClient {
        within(
            "connecting",
            CatalogClient::connect(format!("http://{}", self.addr)),
        )
        .await
        .expect("connect to the test server")
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `catalog` behind `layer`, as `Server::builder().layer(..)` does in a
/// deployment. HTTP/1.1 is accepted too, for the plain-HTTP test.
async fn serve<St, K>(layer: RateLimitLayer<St, K>, catalog: &Catalog) -> GrpcServer
where
    St: Store,
    K: KeyExtractor<tonic::body::Body>,
{
    let router = Server::builder()
        .accept_http1(true)
        .layer(layer)
        .add_service(catalog.clone());
    GrpcServer::start(|incoming| router.serve_with_incoming(incoming)).await
}

/// Bounds a call, so that a broken layer fails the test instead of hanging it.
async fn within<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), future)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

/// A request for `message`, with `x-api-key` metadata when `key` is given.
fn request<T>(message: T, key: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("x-api-key", key.parse().unwrap());
    }
    request
}

async fn lookup(
    client: &mut CatalogClient,
    key: Option<&str>,
) -> Result<tonic::Response<LookupReply>, Status> {
    let message = LookupRequest {
        sku: "SKU-1".to_owned(),
    };
    within("Lookup", client.lookup(request(message, key))).await
}

async fn export(
    client: &mut CatalogClient,
    key: Option<&str>,
) -> Result<tonic::Response<ExportReply>, Status> {
    let message = ExportRequest {
        format: "csv".to_owned(),
    };
    within("Export", client.export(request(message, key))).await
}

// ---------------------------------------------------------------------------------------
// Assertions
// ---------------------------------------------------------------------------------------

/// One metadata value's bytes, if present.
fn meta<'a>(metadata: &'a MetadataMap, name: &str) -> Option<&'a [u8]> {
    metadata.get(name).map(|v| v.as_bytes())
}

/// An OK Lookup answered by the service.
#[track_caller]
fn assert_found(reply: &Result<tonic::Response<LookupReply>, Status>) -> &MetadataMap {
    match reply {
        Ok(reply) => {
            assert_eq!(
                reply.get_ref(),
                &LookupReply {
                    sku: "SKU-1".to_owned(),
                    name: "teapot".to_owned(),
                    in_stock: 12,
                }
            );
            reply.metadata()
        }
        Err(status) => panic!("Lookup failed: {status:?}"),
    }
}

/// An OK Export answered by the service.
#[track_caller]
fn assert_exported(reply: &Result<tonic::Response<ExportReply>, Status>) -> &MetadataMap {
    match reply {
        Ok(reply) => {
            assert_eq!(reply.get_ref().rows, 3);
            reply.metadata()
        }
        Err(status) => panic!("Export failed: {status:?}"),
    }
}

/// The `x-ratelimit-*` metadata, byte for byte.
#[track_caller]
fn assert_limits(metadata: &MetadataMap, limit: u64, remaining: u64, reset: u64) {
    let (limit, remaining, reset) = (limit.to_string(), remaining.to_string(), reset.to_string());
    assert_eq!(
        (
            meta(metadata, "x-ratelimit-limit"),
            meta(metadata, "x-ratelimit-remaining"),
            meta(metadata, "x-ratelimit-reset"),
        ),
        (
            Some(limit.as_bytes()),
            Some(remaining.as_bytes()),
            Some(reset.as_bytes()),
        ),
        "{metadata:?}"
    );
}

/// No rate-limit metadata of any kind.
#[track_caller]
fn assert_no_limits(metadata: &MetadataMap) {
    for name in [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit",
        "ratelimit-policy",
        "retry-after",
        "grpc-retry-pushback-ms",
    ] {
        assert_eq!(meta(metadata, name), None, "{name} in {metadata:?}");
    }
}

/// A denial: `RESOURCE_EXHAUSTED`; `RetryInfo` of exactly `wait`; `QuotaFailure` with
/// the one `violation` (subject, description); `retry-after` in whole seconds rounded up
/// and `grpc-retry-pushback-ms` in milliseconds rounded up, byte for byte. Returns the
/// status's metadata for further checks.
#[track_caller]
fn assert_exhausted<'a, T: std::fmt::Debug>(
    reply: &'a Result<T, Status>,
    wait: Duration,
    violation: &(String, String),
) -> &'a MetadataMap {
    let status = match reply {
        Ok(reply) => panic!("expected RESOURCE_EXHAUSTED, got {reply:?}"),
        Err(status) => status,
    };
    let secs = wait.as_micros().div_ceil(1_000_000).max(1);
    let millis = wait.as_micros().div_ceil(1_000);
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        status.message(),
        format!("API rate limit exceeded. Please retry after {secs} seconds.")
    );
    let details = status.get_error_details();
    assert_eq!(
        details.retry_info().map(|info| info.retry_delay),
        Some(Some(wait)),
        "{status:?}"
    );
    let violations: Vec<(String, String)> = details
        .quota_failure()
        .map(|failure| {
            failure
                .violations
                .iter()
                .map(|v| (v.subject.clone(), v.description.clone()))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(violations, std::slice::from_ref(violation), "{status:?}");
    let metadata = status.metadata();
    let (secs, millis) = (secs.to_string(), millis.to_string());
    assert_eq!(
        meta(metadata, "retry-after"),
        Some(secs.as_bytes()),
        "{metadata:?}"
    );
    assert_eq!(
        meta(metadata, "grpc-retry-pushback-ms"),
        Some(millis.as_bytes()),
        "{metadata:?}"
    );
    metadata
}

// ---------------------------------------------------------------------------------------
// Denials in gRPC's terms
// ---------------------------------------------------------------------------------------

both_stores! {
    /// Within the limit, calls succeed with exact `x-ratelimit-*` response metadata; over
    /// it, the call is `RESOURCE_EXHAUSTED` with `RetryInfo` equal to the decision's wait
    /// to the microsecond, and `retry-after` / `grpc-retry-pushback-ms` rounded up from
    /// it. The manual clock lets the caller back in exactly when RetryInfo said.
    async fn over_the_limit_is_resource_exhausted_with_exact_retry_info(store, clock) {
        let catalog = Catalog::new();
        let layer = RateLimitLayer::builder(store, per_minute("per-caller", 3))
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &catalog).await;
        let mut client = server.client().await;
        let violation = per_minute_violation("per-caller", 3);

        // 3 a minute: each call leaves the bucket 20 s further from full.
        for (remaining, full_in) in [(2, 20), (1, 40), (0, 60)] {
            let reply = lookup(&mut client, None).await;
            let metadata = assert_found(&reply);
            assert_limits(metadata, 3, remaining, EPOCH_S + full_in);
            assert_eq!(meta(metadata, "retry-after"), None);
            assert_eq!(meta(metadata, "grpc-retry-pushback-ms"), None);
        }
        let denied = lookup(&mut client, None).await;
        let metadata = assert_exhausted(&denied, Duration::from_secs(20), &violation);
        assert_eq!(meta(metadata, "retry-after"), Some(&b"20"[..]));
        assert_eq!(meta(metadata, "grpc-retry-pushback-ms"), Some(&b"20000"[..]));
        assert_limits(metadata, 3, 0, EPOCH_S + 60);

        // 0.5 s before the next unit: RetryInfo says 500 ms, retry-after rounds up to 1.
        clock.advance(Duration::from_micros(19_500_000));
        let denied = lookup(&mut client, None).await;
        let metadata = assert_exhausted(&denied, Duration::from_millis(500), &violation);
        assert_eq!(meta(metadata, "retry-after"), Some(&b"1"[..]));
        assert_eq!(meta(metadata, "grpc-retry-pushback-ms"), Some(&b"500"[..]));

        // One microsecond before it: a wait of 1 µs, which no header rounds down to 0.
        clock.advance(Duration::from_micros(499_999));
        let denied = lookup(&mut client, None).await;
        let metadata = assert_exhausted(&denied, Duration::from_micros(1), &violation);
        assert_eq!(meta(metadata, "retry-after"), Some(&b"1"[..]));
        assert_eq!(meta(metadata, "grpc-retry-pushback-ms"), Some(&b"1"[..]));

        // On the microsecond: through again, the bucket now full at +80 s.
        clock.advance(Duration::from_micros(1));
        let reply = lookup(&mut client, None).await;
        assert_limits(assert_found(&reply), 3, 0, EPOCH_S + 80);
        assert_eq!(catalog.lookups(), 4, "a denied call reached the service");
    }
}

both_stores! {
    /// A route limit on `/demo.Catalog/Export` (3/min) on top of the caller's limit
    /// (20/min): Export is refused by its own policy while Lookup goes on under the
    /// caller's, and a refused Export costs the caller's limit nothing. The legacy
    /// metadata reports the most restrictive limit; the IETF fields list both.
    async fn export_is_limited_tighter_than_lookup(store, clock) {
        let catalog = Catalog::new();
        let layer = RateLimitLayer::builder(store, per_minute("per-caller", 20))
            .key(ApiKey::header("x-api-key").unwrap())
            .route(Some(Method::POST), EXPORT, per_minute("export", 3))
            .headers(HeaderStyle::Both)
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &catalog).await;
        let mut client = server.client().await;
        let key = Some("team-1");
        let both_policies = &br#""per-caller";q=20;w=60, "export";q=3;w=60"#[..];

        // Each Export takes a unit from both: 3 s of per-caller's bucket, 20 s of export's.
        for i in 1..=3u64 {
            let reply = export(&mut client, key).await;
            let metadata = assert_exported(&reply);
            assert_limits(metadata, 3, 3 - i, EPOCH_S + 20 * i);
            assert_eq!(meta(metadata, "ratelimit-policy"), Some(both_policies));
            let current = format!(
                r#""per-caller";r={};t={}, "export";r={};t={}"#,
                20 - i,
                3 * i,
                3 - i,
                20 * i
            );
            assert_eq!(meta(metadata, "ratelimit"), Some(current.as_bytes()));
        }
        // Refused by the route: five refused calls cost the caller's limit nothing (17
        // left, full in 9 s), and the IETF fields say so.
        for _ in 0..5 {
            let denied = export(&mut client, key).await;
            let metadata = assert_exhausted(
                &denied,
                Duration::from_secs(20),
                &per_minute_violation("export", 3),
            );
            assert_limits(metadata, 3, 0, EPOCH_S + 60);
            assert_eq!(
                meta(metadata, "ratelimit"),
                Some(&br#""per-caller";r=17;t=9, "export";r=0;t=60"#[..])
            );
        }

        // Lookup is not Export: the same caller goes on under its own 20 a minute.
        for i in 1..=5u64 {
            let reply = lookup(&mut client, key).await;
            let metadata = assert_found(&reply);
            assert_limits(metadata, 20, 17 - i, EPOCH_S + 3 * (3 + i));
            assert_eq!(
                meta(metadata, "ratelimit-policy"),
                Some(&br#""per-caller";q=20;w=60"#[..])
            );
        }

        // The route limit is per caller: another key may export.
        let other = export(&mut client, Some("team-2")).await;
        assert_limits(assert_exported(&other), 3, 2, EPOCH_S + 20);
        assert_eq!((catalog.exports(), catalog.lookups()), (4, 5));
    }
}

both_stores! {
    /// Free (5/min) and Pro (100/min) by `x-api-key` metadata; callers without a key are
    /// limited by their peer address (tonic's `TcpConnectInfo`) under the default policy.
    async fn free_and_pro_tiers_by_api_key_metadata(store, clock) {
        let catalog = Catalog::new();
        let tiers = HashMap::from([
            ("free-key-1".to_owned(), "free".to_owned()),
            ("pro-key-1".to_owned(), "pro".to_owned()),
        ]);
        let layer = RateLimitLayer::builder(store, per_minute("anonymous", 2))
            .key(ApiKey::header("x-api-key").unwrap())
            .tier(per_minute("free", 5))
            .tier(per_minute("pro", 100))
            .tiers(tiers)
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &catalog).await;
        let mut client = server.client().await;
        let (free, pro) = (Some("free-key-1"), Some("pro-key-1"));

        for i in 1..=5u64 {
            let reply = lookup(&mut client, free).await;
            // Each Free unit refills in 12 s; Pro's in 0.6 s.
            assert_limits(assert_found(&reply), 5, 5 - i, EPOCH_S + 12 * i);
            let reply = lookup(&mut client, pro).await;
            assert_limits(assert_found(&reply), 100, 100 - i, EPOCH_S + (6 * i).div_ceil(10));
        }
        let denied = lookup(&mut client, free).await;
        let metadata =
            assert_exhausted(&denied, Duration::from_secs(12), &per_minute_violation("free", 5));
        assert_limits(metadata, 5, 0, EPOCH_S + 60);
        for i in 6..=10u64 {
            let reply = lookup(&mut client, pro).await;
            assert_limits(assert_found(&reply), 100, 100 - i, EPOCH_S + (6 * i).div_ceil(10));
        }

        // No key: 127.0.0.1, under the default policy.
        for (remaining, full_in) in [(1, 30), (0, 60)] {
            let reply = lookup(&mut client, None).await;
            assert_limits(assert_found(&reply), 2, remaining, EPOCH_S + full_in);
        }
        let denied = lookup(&mut client, None).await;
        assert_exhausted(&denied, Duration::from_secs(30), &per_minute_violation("anonymous", 2));
        assert_eq!(catalog.lookups(), 5 + 10 + 2);
    }
}

/// `MissingKey::Reject(401)` over gRPC is `UNAUTHENTICATED`, without rate-limit
/// metadata and without reaching the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_key_rejected_is_unauthenticated() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let catalog = Catalog::new();
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("keyed", 2))
        .key(ApiKey::header("x-api-key").unwrap())
        .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let server = serve(layer, &catalog).await;
    let mut client = server.client().await;

    let status = lookup(&mut client, None).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert_eq!(
        status.message(),
        "No rate-limit key could be determined for this request."
    );
    assert_no_limits(status.metadata());
    let reply = lookup(&mut client, Some("k-1")).await;
    assert_limits(assert_found(&reply), 2, 1, EPOCH_S + 30);
    assert_eq!(catalog.lookups(), 1);
}

// ---------------------------------------------------------------------------------------
// The interceptor
// ---------------------------------------------------------------------------------------

/// `RateLimitLayer::interceptor` under `InterceptedService`: a denial is the same
/// `RESOURCE_EXHAUSTED` with `RetryInfo`, `QuotaFailure` and retry metadata. The
/// interceptor shares its layer's state, so a server using the layer itself refuses the
/// same caller, and the caller is let back in when RetryInfo said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_interceptor_denies_with_retry_info_and_shares_the_layers_limits() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let catalog = Catalog::new();
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("per-key", 2))
        .key(ApiKey::header("x-api-key").unwrap())
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let interceptor = layer.interceptor().unwrap();
    let intercepted = InterceptedService::new(catalog.clone(), interceptor);
    let server = GrpcServer::start(|incoming| {
        Server::builder()
            .add_service(intercepted)
            .serve_with_incoming(incoming)
    })
    .await;
    let mut client = server.client().await;
    let key = Some("k-1");
    let violation = per_minute_violation("per-key", 2);

    for _ in 0..2 {
        assert_found(&lookup(&mut client, key).await);
    }
    let denied = lookup(&mut client, key).await;
    let metadata = assert_exhausted(&denied, Duration::from_secs(30), &violation);
    assert_eq!(meta(metadata, "retry-after"), Some(&b"30"[..]));
    assert_eq!(
        meta(metadata, "grpc-retry-pushback-ms"),
        Some(&b"30000"[..])
    );
    assert_limits(metadata, 2, 0, EPOCH_S + 60);
    // Export has no route limit here: the caller's one limit covers both methods.
    assert_exhausted(
        &export(&mut client, key).await,
        Duration::from_secs(30),
        &violation,
    );

    // The layer in front of another server counts in the same store.
    let layered = serve(layer, &catalog).await;
    let mut layered_client = layered.client().await;
    let denied = lookup(&mut layered_client, key).await;
    assert_exhausted(&denied, Duration::from_secs(30), &violation);

    // Without a key the interceptor falls back to the peer address, as the layer does.
    for _ in 0..2 {
        assert_found(&lookup(&mut client, None).await);
    }
    assert_exhausted(
        &lookup(&mut client, None).await,
        Duration::from_secs(30),
        &violation,
    );

    clock.advance(Duration::from_secs(30));
    assert_found(&lookup(&mut client, key).await);
    assert_eq!((catalog.lookups(), catalog.exports()), (2 + 2 + 1, 0));
}

/// Regression: the interceptor used to hand the cost function a `GET /` where the layer
/// hands it the call's `POST /<service>/<method>`, so a cost keyed on the method gave a
/// call through the interceptor a different price than the same call through the layer.
/// Where tonic names the method (its client sets a `GrpcMethod` extension, so this is an
/// interceptor on the client side), route limits and costs apply as in the layer.
#[test]
fn the_interceptor_prices_a_call_as_a_post_to_its_method() {
    use tonic::service::Interceptor;

    let clock = ManualClock::at_micros(EPOCH_US);
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("per-key", 10))
        .key(ApiKey::header("x-api-key").unwrap())
        .route(Some(Method::POST), EXPORT, per_minute("export", 6))
        .cost(|method: &Method, uri: &http::Uri, _: &http::HeaderMap| {
            if method == Method::POST && uri.path() == EXPORT {
                3
            } else {
                1
            }
        })
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let mut interceptor = layer.interceptor().unwrap();
    let mut call = |method: &'static str| {
        let mut request = request((), Some("k-1"));
        request
            .extensions_mut()
            .insert(tonic::GrpcMethod::new(demo::SERVICE, method));
        interceptor.call(request)
    };

    // Export costs 3 of the caller's 10 and 3 of its own 6.
    assert!(call("Export").is_ok());
    assert!(call("Export").is_ok());
    let denied = call("Export");
    // Three units of a 6-a-minute bucket take 30 s to come back.
    let metadata = assert_exhausted(
        &denied,
        Duration::from_secs(30),
        &per_minute_violation("export", 6),
    );
    assert_limits(metadata, 6, 0, EPOCH_S + 60);
    // Lookup costs 1, and only the caller's limit applies; the refused Export cost it
    // nothing: 10 - 6 = 4 left.
    for _ in 0..4 {
        assert!(call("Lookup").is_ok());
    }
    let denied = call("Lookup");
    assert_exhausted(
        &denied,
        Duration::from_secs(6),
        &per_minute_violation("per-key", 10),
    );
}

/// An interceptor cannot hold a call, so a layer with a shaping policy (any tier, not
/// only the default) refuses to make one, saying which policy and what to use instead.
#[test]
fn an_interceptor_refuses_a_shaping_policy() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let quota = Quota::per_second(10).unwrap().with_burst(4).unwrap();
    let shaper = Policy::new("shaped", Algorithm::LeakyBucketShaper, quota).unwrap();
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("per-ip", 10))
        .tier(shaper)
        .build()
        .unwrap();
    let error = layer.interceptor().unwrap_err();
    assert_eq!(
        error.to_string(),
        "policy \"shaped\" shapes requests by delaying them, which an interceptor cannot do: \
         use the layer (Server::builder().layer(..)) for shaping"
    );

    let rejecting = Policy::new("metered", Algorithm::LeakyBucket, quota).unwrap();
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("per-ip", 10))
        .tier(rejecting)
        .build()
        .unwrap();
    assert!(layer.interceptor().is_ok());
}

// ---------------------------------------------------------------------------------------
// A dead Redis, and plain HTTP
// ---------------------------------------------------------------------------------------

/// With its Redis killed, a layer answers as configured and promptly: fail closed is
/// `UNAVAILABLE` (not `RESOURCE_EXHAUSTED`: the caller did nothing wrong), fail open lets
/// the call through without rate-limit metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_gets_the_configured_grpc_answer() {
    let mut redis = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = RedisStore::builder()
        .timeout(Duration::from_millis(250))
        .caller_time(clock.clone())
        .connect(&redis.url())
        .await
        .unwrap();
    let catalog = Catalog::new();
    let closed = RateLimitLayer::builder(store.clone(), per_minute("fail-closed", 10))
        .on_store_error(OnStoreError::Reject)
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let open = RateLimitLayer::builder(store, per_minute("fail-open", 10))
        .on_store_error(OnStoreError::Allow)
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let closed_server = serve(closed, &catalog).await;
    let open_server = serve(open, &catalog).await;
    let mut closed = closed_server.client().await;
    let mut open = open_server.client().await;

    // While Redis is up, both limit as usual.
    for client in [&mut closed, &mut open] {
        let reply = lookup(client, None).await;
        assert_limits(assert_found(&reply), 10, 9, EPOCH_S + 6);
    }

    redis.kill();
    for _ in 0..3 {
        let status = lookup(&mut closed, None).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert_eq!(
            status.message(),
            "Rate limiting is unavailable. Please retry later."
        );
        assert!(
            status.get_error_details().retry_info().is_none(),
            "{status:?}"
        );
        assert_no_limits(status.metadata());

        let reply = lookup(&mut open, None).await;
        assert_no_limits(assert_found(&reply));
    }
    assert_eq!(catalog.lookups(), 2 + 3);
}

/// The same layer on the same tonic server answers a plain HTTP/1.1 request (no gRPC
/// content type) over its limit with the HTTP 429 and JSON body, and a gRPC call from the
/// same peer with `RESOURCE_EXHAUSTED`: the content type, not the server, decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_through_the_grpc_server_gets_a_json_429() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let catalog = Catalog::new();
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("per-ip", 1))
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let server = serve(layer, &catalog).await;
    let http = web::Client::new(server.addr);

    let first = within("an HTTP request", http.get("/demo.Catalog/Lookup")).await;
    assert_eq!(
        first.header("x-ratelimit-remaining"),
        Some("0"),
        "{first:#?}"
    );
    let denied = within("an HTTP request", http.get("/demo.Catalog/Lookup")).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS, "{denied:#?}");
    assert_eq!(denied.header("content-type"), Some("application/json"));
    assert_eq!(denied.header("retry-after"), Some("60"));
    assert_eq!(denied.header("x-ratelimit-limit"), Some("1"));
    assert_eq!(denied.header("x-ratelimit-remaining"), Some("0"));
    let reset = (EPOCH_S + 60).to_string();
    assert_eq!(denied.header("x-ratelimit-reset"), Some(reset.as_str()));
    assert_eq!(
        denied.body,
        r#"{"error":"Too Many Requests","message":"API rate limit exceeded. Please retry after 60 seconds."}"#
    );
    assert_eq!(denied.header("grpc-status"), None);

    let mut client = server.client().await;
    let denied = lookup(&mut client, None).await;
    assert_exhausted(
        &denied,
        Duration::from_secs(60),
        &per_minute_violation("per-ip", 1),
    );
}
