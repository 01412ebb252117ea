//! Operating the limiter, over real HTTP: the axum example's admin API and its charge
//! after the response, shadow mode for one policy beside one that enforces, the allow and
//! deny lists, and the decision listener — on both stores, on a manual clock.

#![allow(clippy::unwrap_used)]

mod lookup;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::{Method, StatusCode};
use metrics_exporter_prometheus::PrometheusBuilder;
use support::both_stores;
use support::http::{Client, Server};
use support::stores::per_minute;
use tollway_core::{ManualClock, Store};
use tollway_tower::{
    ApiKey, BoxStore, DecisionEvent, DecisionOutcome, Fallback, Key, PeerIp, RateLimitLayer,
};

const ADMIN: (&str, &str) = ("authorization", "Bearer test-admin");

/// The axum example's application over `store`, served on a free loopback port (its
/// metrics go to a recorder of its own, not installed: this binary does not read them).
async fn example<St: Store + Clone>(store: St) -> (Server, Client) {
    example_with(store, std::path::Path::new(demo::axum_app::DEFAULT_CONFIG)).await
}

/// The same, with its limits from the file at `config`.
async fn example_with<St: Store + Clone>(store: St, config: &std::path::Path) -> (Server, Client) {
    let metrics = PrometheusBuilder::new().build_recorder().handle();
    let (app, _limits) = demo::axum_app::app(
        config,
        BoxStore::new(store),
        metrics,
        &demo::axum_app::Doors {
            admin_token: Some("test-admin".to_owned()),
            lab: false,
            ..Default::default()
        },
    )
    .unwrap();
    let server = Server::start(app).await;
    let client = server.client();
    (server, client)
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap()
}

both_stores! {
    /// The admin API wants its token; a peek at a caller it never saw is a fresh
    /// caller's state, consuming nothing; a reset lets a refused caller through again.
    async fn the_admin_api_peeks_and_resets_behind_its_token(store, clock) {
        let _ = &clock;
        let (_server, client) = example(store).await;
        let path = "/admin/limits/anonymous/ip:127.0.0.1";

        let none = client.get(path).await;
        assert_eq!(none.status, StatusCode::UNAUTHORIZED);
        assert_eq!(none.header("www-authenticate"), Some("Bearer"));
        let wrong = client.get_with(path, &[("authorization", "Bearer guess")]).await;
        assert_eq!(wrong.status, StatusCode::FORBIDDEN);
        let unknown = client.get_with("/admin/limits/nope/ip:127.0.0.1", &[ADMIN]).await;
        assert_eq!(unknown.status, StatusCode::NOT_FOUND);

        let fresh = client.get_with(path, &[ADMIN]).await;
        assert_eq!(fresh.status, StatusCode::OK);
        let fresh = json(&fresh.body);
        assert_eq!(fresh["remaining"], 20);
        assert_eq!(fresh["next_request_allowed"], true);
        assert_eq!(fresh["reset_after_ms"], 0);
        // Peeking consumed nothing.
        assert_eq!(json(&client.get_with(path, &[ADMIN]).await.body)["remaining"], 20);

        for _ in 0..20 {
            assert_eq!(client.get("/").await.status, StatusCode::OK);
        }
        assert_eq!(client.get("/").await.status, StatusCode::TOO_MANY_REQUESTS);
        let spent = json(&client.get_with(path, &[ADMIN]).await.body);
        assert_eq!(spent["remaining"], 0);
        assert_eq!(spent["next_request_allowed"], false);
        assert_eq!(spent["retry_after_ms"], 3_000);

        let reset = client.send(Method::DELETE, path, &[ADMIN]).await;
        assert_eq!(reset.status, StatusCode::OK);
        assert_eq!(json(&reset.body)["remaining"], 20);
        assert_eq!(client.get("/").await.status, StatusCode::OK);

        // `all`: every policy of the layer, each reset on its own.
        let all = client.send(Method::DELETE, "/admin/limits/all/ip:127.0.0.1", &[ADMIN]).await;
        let all = json(&all.body);
        let names: Vec<&str> = all.as_array().unwrap().iter().map(|p| p["policy"].as_str().unwrap()).collect();
        assert_eq!(names, ["anonymous", "free", "pro", "checkout", "tokens"]);
        assert_eq!(all[0]["remaining"], 20);
    }
}

both_stores! {
    /// A limit on calls in flight, added to the example's file on completions: the admin
    /// API peeks at its slots (none free while a call holds the one) and a reset frees
    /// them, so the next completion goes through.
    async fn the_admin_api_peeks_at_and_resets_slots_of_calls_in_flight(store, clock) {
        let _ = &clock;
        let mut text = std::fs::read_to_string(demo::axum_app::DEFAULT_CONFIG).unwrap();
        text.push_str(
            "\n[policies.streams]\nalgorithm = \"concurrency\"\nlimit = 1\nperiod = \"30s\"\n\n\
             [[routes]]\npath = \"/api/v1/completions\"\npolicy = \"streams\"\n",
        );
        let dir = std::env::temp_dir().join(format!("tollway-streams-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join(format!("limits-{}.toml", support::unique_prefix("f")));
        std::fs::write(&config, text).unwrap();
        let (_server, client) = example_with(store.clone(), &config).await;
        let path = "/admin/limits/streams/ip:127.0.0.1";
        let completion = "/api/v1/completions?tokens=1";

        assert_eq!(json(&client.get_with(path, &[ADMIN]).await.body)["remaining"], 1);
        // A call in flight elsewhere holds the one slot.
        let slots = tollway_core::Quota::with_period(1, Duration::from_secs(30)).unwrap();
        let streams = tollway_core::Policy::new("streams", tollway_core::Algorithm::Concurrency, slots);
        let held = store.check(b"ip:127.0.0.1", &[&streams.unwrap()], 1).await.unwrap();
        assert!(held.is_allowed());
        let peek = json(&client.get_with(path, &[ADMIN]).await.body);
        assert_eq!(peek["remaining"], 0);
        assert_eq!(peek["next_request_allowed"], false);
        let refused = client.send(Method::POST, completion, &[]).await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.header("x-ratelimit-limit"), Some("1"));

        let reset = client.send(Method::DELETE, path, &[ADMIN]).await;
        assert_eq!(json(&reset.body)["remaining"], 1);
        assert_eq!(client.send(Method::POST, completion, &[]).await.status, StatusCode::OK);
        // That call ended: its slot is free again.
        assert_eq!(json(&client.get_with(path, &[ADMIN]).await.body)["remaining"], 1);
        std::fs::remove_file(&config).unwrap();
    }
}

both_stores! {
    /// A completion reserves 1 token, reports the tokens it used, and the layer settles
    /// the caller's 1,000-token-a-minute budget (a token bucket) to them after the
    /// response: two completions of 600 use it up — the second takes the 400 left and
    /// owes 200 — and the next is refused with the exact wait for the debt and its own
    /// token, 201 tokens at 60 ms (`Retry-After: 13`), and passes once that has passed,
    /// not before.
    async fn a_response_is_settled_to_what_it_used_and_the_next_request_waits(store, clock) {
        let (_server, client) = example(store).await;
        let path = "/admin/limits/tokens/ip:127.0.0.1";
        let completion = "/api/v1/completions?tokens=600";

        let first = client.send(Method::POST, completion, &[]).await;
        assert_eq!(first.status, StatusCode::OK);
        assert_eq!(first.header("x-tokens-used"), Some("600"));
        // The response reported the state before its settlement; that is in the store.
        assert_eq!(json(&client.get_with(path, &[ADMIN]).await.body)["remaining"], 400);
        assert_eq!(client.send(Method::POST, completion, &[]).await.status, StatusCode::OK);
        assert_eq!(json(&client.get_with(path, &[ADMIN]).await.body)["remaining"], 0);

        let refused = client.send(Method::POST, completion, &[]).await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.header("retry-after"), Some("13"));
        assert!(refused.body.contains("retry after 13 seconds"), "{}", refused.body);
        let waiting = json(&client.get_with(path, &[ADMIN]).await.body);
        assert_eq!(waiting["retry_after_ms"], 12_060);

        clock.advance(Duration::from_millis(12_059));
        assert_eq!(client.send(Method::POST, completion, &[]).await.status, StatusCode::TOO_MANY_REQUESTS);
        clock.advance(Duration::from_millis(1));
        assert_eq!(client.send(Method::POST, completion, &[]).await.status, StatusCode::OK);
    }
}

both_stores! {
    /// A route policy in shadow mode (1 a minute) beside the caller's own, which enforces
    /// (3 a minute): when only the shadow policy refuses, the request goes through and
    /// the caller's policy still counts it — so the fourth request is the first refused,
    /// by the caller's policy — and the listener hears each shadow refusal. Switched to
    /// enforcing at run time, the route policy refuses at once.
    async fn a_policy_in_shadow_refuses_nothing_and_changes_no_other_count(store, clock) {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&heard);
        let layer = RateLimitLayer::builder(store, per_minute("caller", 3))
            .route(None, "/export", per_minute("export", 1))
            .shadow_policy("export")
            .wall_clock(clock.clone())
            .on_decision(move |event: &DecisionEvent<'_>| {
                let policy = event.verdict().map(|v| v.policy.name().to_owned());
                log.lock().unwrap().push((event.outcome(), policy));
            })
            .build()
            .unwrap();
        let app = Router::new().route("/export", get(|| async { "data" })).layer(layer.clone());
        let server = Server::start(app).await;
        let client = server.client();

        // Allowed by both: the headers speak only of the policy that enforces.
        let first = client.get("/export").await;
        assert_eq!(first.header("x-ratelimit-limit"), Some("3"));
        assert_eq!(first.header("x-ratelimit-remaining"), Some("2"));
        let statuses: Vec<u16> = futures_in_order(&client, "/export", 3).await;
        assert_eq!(statuses, [200, 200, 429]);
        use DecisionOutcome::{Allowed, Limited, ShadowLimited};
        let export = Some("export".to_owned());
        let caller = Some("caller".to_owned());
        assert_eq!(
            *heard.lock().unwrap(),
            [
                (Allowed, export.clone()),
                (ShadowLimited, export.clone()),
                (Allowed, caller.clone()),
                (ShadowLimited, export.clone()),
                (Allowed, caller.clone()),
                (ShadowLimited, export.clone()),
                (Limited, caller.clone()),
            ]
        );
        // A request the shadow policy would refuse reports the policy that enforces.
        clock.advance(Duration::from_secs(20));
        let passed = client.get("/export").await;
        assert_eq!(passed.status, StatusCode::OK);
        assert_eq!(passed.header("x-ratelimit-limit"), Some("3"));
        assert_eq!(passed.header("x-ratelimit-remaining"), Some("0"));

        layer.set_policy_shadow("export", false).unwrap();
        assert!(!layer.is_shadow(Some("export")));
        clock.advance(Duration::from_secs(20));
        let refused = client.get("/export").await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(layer.set_policy_shadow("nope", true).is_err());
    }
}

/// `n` requests to `path`, one after the other: their statuses.
async fn futures_in_order(client: &Client, path: &str, n: usize) -> Vec<u16> {
    let mut statuses = Vec::new();
    for _ in 0..n {
        statuses.push(client.get(path).await.status.as_u16());
    }
    statuses
}

/// The lists over HTTP: a network on the deny list gets 403 with the JSON body, one on
/// the allow list is never limited, and a key on the deny list loses even inside an
/// allowed network.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_callers_are_never_limited_and_denied_ones_are_forbidden() {
    let clock = ManualClock::at_micros(support::stores::EPOCH_US);
    let store = support::stores::memory_store(&clock);
    let layer = RateLimitLayer::builder(store.clone(), per_minute("caller", 1))
        .key(ApiKey::header("x-api-key").unwrap().or(PeerIp::new()))
        .allow_network("127.0.0.0/8")
        .deny_key(Key::new("key", "banned"))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let server = Server::start(app).await;
    let client = server.client();
    for _ in 0..5 {
        let reply = client.get("/").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.header("x-ratelimit-remaining"), None);
    }
    let banned = client.get_with("/", &[("x-api-key", "banned")]).await;
    assert_eq!(banned.status, StatusCode::FORBIDDEN);
    assert_eq!(banned.header("content-type"), Some("application/json"));
    assert_eq!(
        banned.body,
        r#"{"error":"Forbidden","message":"This client may not call this service."}"#
    );
    // Nothing was stored for the allowed caller.
    assert!(store.is_empty());

    let denied = RateLimitLayer::builder(
        support::stores::memory_store(&clock),
        per_minute("caller", 1),
    )
    .deny_network("127.0.0.1")
    .build()
    .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(denied);
    let server = Server::start(app).await;
    assert_eq!(server.client().get("/").await.status, StatusCode::FORBIDDEN);

    let err = RateLimitLayer::builder(
        support::stores::memory_store(&clock),
        per_minute("caller", 1),
    )
    .allow_network("127.0.0.1/40")
    .build()
    .unwrap_err();
    assert!(err.to_string().contains("not a network"), "{err}");
}

/// The admin API's doors: without a token the admin routes do not exist (the example
/// used to mount them with the token `demo-admin-token`); with one, an address gets 30
/// admin requests a minute, right or wrong, so the token cannot be guessed at
/// thousands a second (it used to be unlimited); and `/metrics` stays unlimited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_needs_a_token_of_your_own_and_is_limited() {
    let clock = ManualClock::at_micros(support::stores::EPOCH_US);
    let app = |admin_token: Option<&str>| {
        let metrics = PrometheusBuilder::new().build_recorder().handle();
        let doors = demo::axum_app::Doors {
            admin_token: admin_token.map(str::to_owned),
            lab: false,
            ..Default::default()
        };
        let config = std::path::Path::new(demo::axum_app::DEFAULT_CONFIG);
        let store = BoxStore::new(support::stores::memory_store(&clock));
        demo::axum_app::app(config, store, metrics, &doors)
            .unwrap()
            .0
    };
    let path = "/admin/limits/anonymous/ip:127.0.0.1";

    let closed = Server::start(app(None)).await;
    let client = closed.client();
    for token in ["demo-admin-token", "test-admin", ""] {
        let bearer = format!("Bearer {token}");
        let reply = client.get_with(path, &[("authorization", &bearer)]).await;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{token:?}");
    }
    let reload = client.send(Method::POST, "/admin/reload", &[ADMIN]).await;
    assert_eq!(reload.status, StatusCode::NOT_FOUND);

    let open = Server::start(app(Some("test-admin"))).await;
    let client = open.client();
    let guess = [("authorization", "Bearer guess")];
    for _ in 0..demo::axum_app::ADMIN_PER_MINUTE - 1 {
        assert_eq!(
            client.get_with(path, &guess).await.status,
            StatusCode::FORBIDDEN
        );
    }
    assert_eq!(client.get_with(path, &[ADMIN]).await.status, StatusCode::OK);
    // The budget is spent: even the right token waits now.
    let limited = client.get_with(path, &[ADMIN]).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(limited.header("retry-after").is_some());
    for _ in 0..40 {
        assert_eq!(client.get("/metrics").await.status, StatusCode::OK);
    }
}

/// The example uses the store its limits file names: two gateways on a file whose
/// `[store]` section names one Redis share its 20 a minute (each used to build a memory
/// store of its own and admit 20: 40 in all). A file naming a store and a `REDIS_URL`
/// both is refused, saying what to remove.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_on_a_file_naming_redis_share_its_limits() {
    let example = std::fs::read_to_string(demo::axum_app::DEFAULT_CONFIG).unwrap();
    let prefix = support::redis::unique_prefix("store-section");
    let url = support::shared_server().url();
    let text = format!(
        "[store]\nkind = \"redis\"\nurl = \"{url}\"\nprefix = \"{prefix}\"\nstall_after_ms = 1000\n\n{example}"
    );
    let dir = std::env::temp_dir().join(format!("tollway-{prefix}"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tollway.toml");
    std::fs::write(&path, text).unwrap();
    let file = tollway_tower::config::LimitsFile::read(&path).unwrap();

    let mut admitted = 0;
    let mut servers = Vec::new();
    for _ in 0..2 {
        let (store, demo_memory) = demo::store_for(Some(&file), None).await.unwrap();
        assert!(!demo_memory);
        let metrics = PrometheusBuilder::new().build_recorder().handle();
        let doors = demo::axum_app::Doors::default();
        let (app, _limits) = demo::axum_app::app(&path, store, metrics, &doors).unwrap();
        servers.push(Server::start(app).await);
    }
    for server in &servers {
        let client = server.client();
        for _ in 0..25 {
            if client.get("/").await.status == StatusCode::OK {
                admitted += 1;
            }
        }
    }
    assert_eq!(admitted, 20);

    let both = demo::store_for(Some(&file), Some(&url)).await;
    let err = both.err().unwrap();
    assert!(
        err.contains("[store]") && err.contains("REDIS_URL"),
        "{err}"
    );
    assert!(!err.contains(&url), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 34: which configuration is live could not be seen, and a reload silently undid
/// `PUT /admin/shadow`. `GET /admin/config` shows the file's SHA-256 and each limit's
/// shadow mode; a reload answers what it kept; `file` hands a limit back to its file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_shows_the_live_config_and_keeps_switches_over_a_reload() {
    let clock = ManualClock::at_micros(support::stores::EPOCH_US);
    let (_server, client) = example(support::stores::memory_store(&clock)).await;
    let out = std::process::Command::new("sha256sum")
        .arg(demo::axum_app::DEFAULT_CONFIG)
        .output()
        .unwrap();
    let out = String::from_utf8(out.stdout).unwrap();
    let digest = out.split_whitespace().next().unwrap().to_owned();
    let live = json(&client.get_with("/admin/config", &[ADMIN]).await.body);
    assert_eq!(live["version"], digest.as_str());
    assert_eq!(live["reloads"], 0);
    let free = |live: &serde_json::Value| {
        live["shadow"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["policy"] == "free")
            .cloned()
            .unwrap()
    };
    assert_eq!(free(&live)["switched"], false);

    let put = |body: &'static str| {
        client.send_body(
            Method::PUT,
            "/admin/shadow/free",
            &[ADMIN],
            bytes::Bytes::from_static(body.as_bytes()),
        )
    };
    assert_eq!(put("on").await.status, StatusCode::NO_CONTENT);
    let reload = client.send(Method::POST, "/admin/reload", &[ADMIN]).await;
    assert_eq!(reload.status, StatusCode::OK);
    let reloaded = json(&reload.body);
    assert_eq!(reloaded["version"], digest.as_str());
    assert_eq!(reloaded["kept_switches"][0]["policy"], "free");
    let live = json(&client.get_with("/admin/config", &[ADMIN]).await.body);
    assert_eq!(live["reloads"], 1);
    assert_eq!(free(&live)["on"], true);
    assert_eq!(free(&live)["switched"], true);

    assert_eq!(put("file").await.status, StatusCode::NO_CONTENT);
    let live = json(&client.get_with("/admin/config", &[ADMIN]).await.body);
    assert_eq!(free(&live)["on"], false);
    assert_eq!(free(&live)["switched"], false);
}

/// The example's load shedder, behind the admin token: its limit and priorities, what
/// each admitted, and its shadow mode, which a reload of an unchanged `[shed]` keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_shows_the_load_shedder_and_switches_its_shadow_mode() {
    let clock = ManualClock::at_micros(support::stores::EPOCH_US);
    let (_server, client) = example(support::stores::memory_store(&clock)).await;
    assert_eq!(
        client.get("/admin/shed").await.status,
        StatusCode::UNAUTHORIZED
    );
    for key in ["demo-pro-key", "demo-free-key"] {
        let reply = client.get_with("/", &[("x-api-key", key)]).await;
        assert_eq!(reply.status, StatusCode::OK);
    }
    let guest = client.send(Method::POST, "/api/v1/checkout", &[]).await;
    assert_eq!(guest.status, StatusCode::OK);
    let shed = json(&client.get_with("/admin/shed", &[ADMIN]).await.body);
    assert_eq!(shed["limit"], 20);
    assert_eq!(shed["in_flight"], 0);
    assert_eq!(shed["shadow"], false);
    let admitted: Vec<_> = shed["priorities"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_owned(),
                p["admitted"].as_u64().unwrap(),
            )
        })
        .collect();
    let expected = [("pro", 1), ("free", 1), ("checkout", 1), ("other", 0)];
    let expected: Vec<_> = expected
        .iter()
        .map(|(n, a)| ((*n).to_owned(), *a))
        .collect();
    assert_eq!(admitted, expected);

    let on = bytes::Bytes::from_static(b"on");
    let put = client
        .send_body(Method::PUT, "/admin/shed/shadow", &[ADMIN], on)
        .await;
    assert_eq!(put.status, StatusCode::NO_CONTENT);
    let reload = client.send(Method::POST, "/admin/reload", &[ADMIN]).await;
    assert_eq!(reload.status, StatusCode::OK);
    let shed = json(&client.get_with("/admin/shed", &[ADMIN]).await.body);
    assert_eq!(
        shed["shadow"], true,
        "the running shedder, kept over the reload"
    );
    assert_eq!(shed["priorities"][0]["admitted"], 1);
}
