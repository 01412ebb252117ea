//! The synchronous tonic interceptor over a layer's limits.

use std::time::Duration;

use http::Method;
use support::catalog::{self, Catalog, EXPORT};
use support::grpc::{
    GrpcServer, assert_exhausted, assert_found, assert_limits, export, lookup, meta,
    per_minute_violation, request, serve,
};
use support::stores::{EPOCH_S, EPOCH_US, memory_store, per_minute};
use tollway_core::{Algorithm, ManualClock, Policy, Quota};
use tollway_tower::{ApiKey, RateLimitLayer};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Server;

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
    let intercepted = InterceptedService::new(catalog.server(), interceptor);
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
            .insert(tonic::GrpcMethod::new(catalog::SERVICE, method));
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
/// only the default) refuses to make one, saying which policy and what to use instead;
/// and it never sees the response, so neither does a layer that holds slots or settles.
#[test]
fn an_interceptor_refuses_a_shaping_policy() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let quota = Quota::per_second(10).unwrap().with_burst(4).unwrap();
    let shaper = Policy::new("shaped", Algorithm::LeakyBucketShaper, quota.clone()).unwrap();
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

    // Nor a limit on calls in flight, nor a settled one: it never sees the response.
    let slots = Quota::with_period(2, std::time::Duration::from_secs(30)).unwrap();
    let streams = Policy::new("streams", Algorithm::Concurrency, slots).unwrap();
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("per-ip", 10))
        .grpc_method("/demo.Catalog/Export", streams)
        .build()
        .unwrap();
    let error = layer.interceptor().unwrap_err().to_string();
    assert!(
        error.contains("\"streams\" limits calls in flight"),
        "{error}"
    );
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("per-ip", 10))
        .settle("per-ip", |_, _, _| None)
        .build()
        .unwrap();
    let error = layer.interceptor().unwrap_err().to_string();
    assert!(
        error.contains("settles a policy after responses"),
        "{error}"
    );

    let rejecting = Policy::new("metered", Algorithm::LeakyBucket, quota).unwrap();
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("per-ip", 10))
        .tier(rejecting)
        .build()
        .unwrap();
    assert!(layer.interceptor().is_ok());
}

// An interceptor checked its limits only when it was made: limits swapped in later with
// a limit on calls in flight took slots it never gave back, and a later [shed] was
// ignored. A swap it cannot apply is refused now, and the running limits stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_an_interceptor_cannot_apply_are_not_swapped_in_under_it() {
    use tollway_tower::config::Reloader;
    use tonic::service::Interceptor;

    let dir = std::env::temp_dir().join(format!("tollway-intercepted-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("limits.toml");
    let file = |extra: &str, limit: u32| {
        format!(
            "[layer]\ndefault = \"api\"\n\n[policies.api]\nalgorithm = \"gcra\"\nlimit = {limit}\n\
             period = \"1m\"\n{extra}"
        )
    };
    std::fs::write(&path, file("", 2)).unwrap();
    let clock = ManualClock::at_micros(EPOCH_US);
    let reloader = Reloader::new(&path, memory_store(&clock)).unwrap();
    let mut interceptor = reloader.layer().interceptor().unwrap();
    let mut calls = |n: usize| {
        (0..n)
            .filter(|_| interceptor.call(request((), None)).is_ok())
            .count()
    };
    assert_eq!(calls(3), 2, "2 a minute");

    let streams = "\n[policies.streams]\nalgorithm = \"concurrency\"\nlimit = 4\nperiod = \"30s\"\n\n\
                   [[routes]]\npath = \"/demo.Catalog/Export\"\npolicy = \"streams\"\n";
    let shed = "\n[shed]\nfloor = 10\nceiling = 10\n";
    for (added, why) in [(streams, "limits calls in flight"), (shed, "sheds load")] {
        std::fs::write(&path, file(added, 100)).unwrap();
        let error = reloader.reload().await.unwrap_err().to_string();
        assert!(
            error.contains("interceptor") && error.contains(why),
            "{error}"
        );
        assert_eq!(calls(1), 0, "the running limits stay: 2 a minute, spent");
    }
    // What it can apply is swapped in: a raise, which the interceptor applies at once
    // (the caller keeps its 2 used).
    std::fs::write(&path, file("", 5)).unwrap();
    reloader.reload().await.unwrap();
    assert_eq!(calls(6), 3, "5 a minute, 2 used");
    let _ = std::fs::remove_dir_all(&dir);
}
