//! The rate-limiting layer in front of a real tonic server on 127.0.0.1:0, called by a
//! real tonic client over HTTP/2, on a manual clock so that every value is exact.
//!
//! The service is the tonic examples' `demo.Catalog`, counted by `support::catalog`.
//! A denied call must end with `RESOURCE_EXHAUSTED` — never a bare 429, which a tonic
//! client reports as `UNAVAILABLE` — carrying `google.rpc.RetryInfo` with the decision's
//! exact wait, `google.rpc.QuotaFailure` naming the policy, and `retry-after`,
//! `grpc-retry-pushback-ms` and `x-ratelimit-*` metadata.
//!
//! Tests that run twice, as `<test>::memory` and `<test>::redis`, run the same body over
//! a `MemoryStore` and over a `RedisStore` in caller-time mode, both reading the one
//! manual clock that the layer also reads for `x-ratelimit-reset`. What a dead Redis gets
//! is in the faults binary.

#![allow(clippy::unwrap_used)]

mod interceptor;

use std::collections::HashMap;
use std::time::Duration;

use http::StatusCode;
use support::both_stores;
use support::catalog::{Catalog, EXPORT};
use support::grpc::{
    assert_exhausted, assert_exported, assert_found, assert_limits, assert_no_limits, export,
    lookup, meta, per_minute_violation, serve,
};
use support::stores::{EPOCH_S, EPOCH_US, memory_store, per_minute};
use tollway_core::ManualClock;
use tollway_tower::{ApiKey, HeaderStyle, Key, MissingKey, RateLimitLayer};
use tonic::Code;

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
            .grpc_method(EXPORT, per_minute("export", 3))
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
            // `t`: the next unit of each, 3 s and 20 s away.
            let current = format!(
                r#""per-caller";r={};t=3, "export";r={};t=20"#,
                20 - i,
                3 - i
            );
            assert_eq!(meta(metadata, "ratelimit"), Some(current.as_bytes()));
        }
        // Refused by the route: five refused calls cost the caller's limit nothing (17
        // left, the next unit in 3 s), and the IETF fields say so.
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
                Some(&br#""per-caller";r=17;t=3, "export";r=0;t=20"#[..])
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

/// A key on the deny list is `PERMISSION_DENIED` over gRPC (403 over HTTP), with the
/// same message as the JSON body and no rate-limit metadata, and never reaches the
/// service; a key on the allow list is served without limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_key_is_permission_denied_and_an_allowed_one_unlimited() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let catalog = Catalog::new();
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("keyed", 1))
        .key(ApiKey::header("x-api-key").unwrap())
        .deny_key(Key::new("key", "banned"))
        .allow_key(Key::new("key", "partner"))
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let server = serve(layer, &catalog).await;
    let mut client = server.client().await;

    let status = lookup(&mut client, Some("banned")).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert_eq!(status.message(), "This client may not call this service.");
    assert_no_limits(status.metadata());
    for _ in 0..3 {
        assert_no_limits(assert_found(&lookup(&mut client, Some("partner")).await));
    }
    assert_eq!(catalog.lookups(), 3);
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
    let http = support::http::Client::new(server.addr());

    let first = support::within("an HTTP request", 10, http.get("/demo.Catalog/Lookup")).await;
    assert_eq!(
        first.header("x-ratelimit-remaining"),
        Some("0"),
        "{first:#?}"
    );
    let denied = support::within("an HTTP request", 10, http.get("/demo.Catalog/Lookup")).await;
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
