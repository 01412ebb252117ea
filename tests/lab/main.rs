//! The lab's server side over real HTTP, on a manual clock: the page lists the seven
//! algorithms, each algorithm's endpoint answers and is limited by that algorithm, and
//! the state the page draws is the store's; and (`browser`) the page itself in headless
//! Chromium.

#![allow(clippy::unwrap_used)]

mod browser;

use std::time::Duration;

use http::StatusCode;
use support::http::{Client, Server};
use support::stores::{EPOCH_US, memory_store};
use tollway_core::{Algorithm, ManualClock};
use tollway_tower::BoxStore;

async fn lab(clock: &ManualClock) -> (Server, Client) {
    let router = demo::lab::router(memory_store(clock), &[]).unwrap();
    let server = Server::start(router).await;
    let client = server.client();
    (server, client)
}

fn state(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_lists_all_seven_rate_algorithms_and_each_endpoint_answers() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let (_server, client) = lab(&clock).await;
    let page = client.get("/lab").await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    // Calls in flight are held for a request's whole life: not a lab scenario.
    assert!(!page.body.contains("concurrency"));
    let rates = Algorithm::ALL
        .into_iter()
        .filter(|&a| a != Algorithm::Concurrency);
    for algorithm in rates {
        let name = algorithm.name();
        assert!(
            page.body.contains(&format!("<option value=\"{name}\">")),
            "{name}"
        );
        let reply = client.get(&format!("/lab/api/{name}")).await;
        assert_eq!(reply.status, StatusCode::OK, "{name}");
        assert_eq!(reply.header("x-ratelimit-limit"), Some("10"), "{name}");
        assert_eq!(reply.header("x-ratelimit-remaining"), Some("9"), "{name}");
        let now = state(&client.get(&format!("/lab/state/{name}")).await.body);
        assert_eq!(
            (now["limit"].as_u64(), now["remaining"].as_u64()),
            (Some(10), Some(9)),
            "{name}"
        );
    }
    assert_eq!(
        client.get("/lab/state/nope").await.status,
        StatusCode::NOT_FOUND
    );
}

/// What the page's burst button does, against the token bucket: 15 requests, 10 pass and
/// 5 are refused with `X-RateLimit-Remaining: 0`; the state shows the bucket empty, and
/// after a second of the manual clock, 2 tokens back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_fifteen_drains_the_bucket_and_it_refills_at_two_a_second() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let (_server, client) = lab(&clock).await;
    let mut statuses = Vec::new();
    let mut last = None;
    for _ in 0..15 {
        let reply = client.get("/lab/api/token_bucket").await;
        statuses.push(reply.status.as_u16());
        last = Some(reply);
    }
    assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 10);
    assert_eq!(statuses.iter().filter(|&&s| s == 429).count(), 5);
    let last = last.unwrap();
    assert_eq!(last.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(last.header("retry-after"), Some("1"));
    let empty = state(&client.get("/lab/state/token_bucket").await.body);
    assert_eq!(empty["remaining"], 0);
    assert_eq!(empty["next_request_allowed"], false);
    assert_eq!(empty["retry_after_ms"], 500);
    clock.advance(Duration::from_secs(1));
    let refilled = state(&client.get("/lab/state/token_bucket").await.body);
    assert_eq!(refilled["remaining"], 2);
    assert_eq!(refilled["next_request_allowed"], true);
}

/// Scenario 2: 30 requests at once through two gateways sharing one store and a limit of
/// 10 — tollway admits exactly 10, the naive read-then-write limiter more; a second race
/// starts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_race_admits_exactly_the_limit_with_tollway_and_more_without() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let (_server, client) = lab(&clock).await;
    for _ in 0..2 {
        let reply = client.send(http::Method::POST, "/lab/race", &[]).await;
        assert_eq!(reply.status, StatusCode::OK);
        let race = state(&reply.body);
        assert_eq!(
            (race["limit"].as_u64(), race["sent"].as_u64()),
            (Some(10), Some(30))
        );
        assert_eq!(race["tollway_admitted"], 10);
        assert!(race["naive_admitted"].as_u64().unwrap() > 10, "{race}");
    }
    let page = client.get("/lab").await;
    assert!(page.body.contains("id=\"race\""));
}

/// Scenario 1 on a paused clock: the server waits for a window boundary (4.8 s after the
/// lab was made, its windows being 5 s), sends 10 just before it and 10 just after: the
/// fixed window admits all 20, the log the first 10.
#[tokio::test(start_paused = true)]
async fn the_boundary_burst_passes_twice_the_limit_in_a_fixed_window_and_the_limit_in_the_log() {
    use tower::ServiceExt;
    let clock = ManualClock::at_micros(EPOCH_US);
    let router = demo::lab::router(memory_store(&clock), &[]).unwrap();
    let start = tokio::time::Instant::now();
    let request = http::Request::post("/lab/boundary")
        .body(axum::body::Body::empty())
        .unwrap();
    let reply = router.oneshot(request).await.unwrap();
    assert_eq!(reply.status(), StatusCode::OK);
    assert_eq!(start.elapsed(), Duration::from_millis(4_800 + 210));
    let body = http_body_util::BodyExt::collect(reply.into_body())
        .await
        .unwrap()
        .to_bytes();
    let result = state(std::str::from_utf8(&body).unwrap());
    assert_eq!(result["waited_ms"], 4_800);
    let fixed = &result["fixed_window"];
    assert_eq!(
        (fixed["before"].as_u64(), fixed["after"].as_u64()),
        (Some(10), Some(10))
    );
    let log = &result["sliding_window_log"];
    assert_eq!(
        (log["before"].as_u64(), log["after"].as_u64()),
        (Some(10), Some(0))
    );
}

/// The lab never touches the application's store: the example on Redis with the lab
/// mounted, a race, a burst and a look at the lab's state leave not one key in Redis
/// (the lab used to run on the application's store: each race made fresh keys there,
/// which under `maxmemory` evicted the real callers' limits). The API still counts in
/// Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lab_keeps_its_keys_off_the_applications_store() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let prefix = support::redis::unique_prefix("lab");
    let store = BoxStore::new(support::stores::redis_store_under(&prefix, &clock).await);
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .build_recorder()
        .handle();
    let doors = demo::axum_app::Doors {
        admin_token: None,
        lab: true,
        ..Default::default()
    };
    let config = std::path::Path::new(demo::axum_app::DEFAULT_CONFIG);
    let (app, _limits) = demo::axum_app::app(config, store, metrics, &doors).unwrap();
    let server = Server::start(app).await;
    let client = server.client();
    let redis = redis::Client::open(support::shared_server().url()).unwrap();
    let mut connection = redis.get_multiplexed_async_connection().await.unwrap();
    let mut keys = async || -> Vec<String> {
        redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut connection)
            .await
            .unwrap()
    };
    let race = state(&client.send(http::Method::POST, "/lab/race", &[]).await.body);
    assert_eq!(race["tollway_admitted"], 10);
    for _ in 0..15 {
        client.get("/lab/api/token_bucket").await;
    }
    assert_eq!(
        client.get("/lab/state/token_bucket").await.status,
        StatusCode::OK
    );
    assert_eq!(keys().await, Vec::<String>::new());
    assert_eq!(client.get("/").await.status, StatusCode::OK);
    assert_eq!(keys().await.len(), 1, "the API's caller, in Redis");
}

/// The lab and `/metrics` answer at `localhost`, an IP address, or a configured name
/// only: a page on another name that rebinds its DNS to this server gets 403 (they
/// used to answer any `Host`). A write sent by another site's page (its `Origin`, or
/// `Sec-Fetch-Site: cross-site`) is refused; one from the lab's own page passes. Every
/// answer carries a Content-Security-Policy naming the page's script by digest,
/// `X-Frame-Options: DENY` and `nosniff` (there were none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lab_answers_its_own_host_and_origin_only_with_security_headers() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .build_recorder()
        .handle();
    let doors = demo::axum_app::Doors {
        lab: true,
        hosts: vec!["gateway.example".to_owned()],
        ..Default::default()
    };
    let config = std::path::Path::new(demo::axum_app::DEFAULT_CONFIG);
    let store = BoxStore::new(memory_store(&clock));
    let (app, _limits) = demo::axum_app::app(config, store, metrics, &doors).unwrap();
    let server = Server::start(app).await;
    let client = server.client();
    let rebound = [("host", "attacker.example:3000")];

    let page = client.get("/lab").await;
    assert_eq!(page.status, StatusCode::OK);
    let csp = page.header("content-security-policy").unwrap();
    assert!(csp.contains("script-src 'sha256-"), "{csp}");
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(!csp.contains("unsafe-inline"), "{csp}");
    assert_eq!(page.header("x-frame-options"), Some("DENY"));
    assert_eq!(page.header("x-content-type-options"), Some("nosniff"));
    for path in [
        "/lab",
        "/lab/state/token_bucket",
        "/lab/api/gcra",
        "/metrics",
    ] {
        assert_eq!(
            client.get_with(path, &rebound).await.status,
            StatusCode::FORBIDDEN,
            "{path}"
        );
        let named = client.get_with(path, &[("host", "gateway.example")]).await;
        assert_eq!(named.status, StatusCode::OK, "{path}");
    }
    assert_eq!(client.get("/metrics").await.status, StatusCode::OK);

    let post = async |headers: &[(&str, &str)]| {
        client
            .send(http::Method::POST, "/lab/race", headers)
            .await
            .status
    };
    assert_eq!(
        post(&[("origin", "http://attacker.example")]).await,
        StatusCode::FORBIDDEN
    );
    assert_eq!(post(&[("origin", "null")]).await, StatusCode::FORBIDDEN);
    assert_eq!(
        post(&[("sec-fetch-site", "cross-site")]).await,
        StatusCode::FORBIDDEN
    );
    let own = format!("http://{}", server.addr());
    assert_eq!(post(&[("origin", &own)]).await, StatusCode::OK);
    assert_eq!(post(&[]).await, StatusCode::OK);
}

/// The lab's scenarios are limited: 10 runs a minute per address, then 429 (each race
/// is 30 store calls and a boundary run holds its request for up to 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_labs_scenarios_are_limited_per_address() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let (_server, client) = lab(&clock).await;
    for _ in 0..10 {
        let reply = client.send(http::Method::POST, "/lab/race", &[]).await;
        assert_eq!(reply.status, StatusCode::OK);
    }
    let refused = client.send(http::Method::POST, "/lab/race", &[]).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
}
