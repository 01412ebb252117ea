//! Keys and costs taken from the request: the user ID an authentication layer sets, one
//! key for everyone, and what a request costs.
//!
//! Route limits with `route_layer` and with the layer outside the `Router` are in the
//! attacks binary (`route_limits_hold_in_nested_routers_route_layers_and_outside_the_router`).

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use support::both_stores;
use support::http::{
    Client, Hits, Reply, Server, assert_limits, assert_ok, assert_too_many, routes, serve,
};
use support::stores::{EPOCH_S, EPOCH_US, memory_store, per_minute};
use tollway_core::ManualClock;
use tollway_tower::{Fallback, GlobalKey, PeerIp, RateLimitLayer, UserId};

/// The account an authentication layer found for a request, put in its extensions.
#[derive(Clone, Copy, Debug)]
struct AccountId(u64);

impl fmt::Display for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The authentication layer: `Authorization: Bearer <token>` with a token it issued puts
/// the token's account in the request's extensions. Alice has two tokens (a laptop's and
/// a phone's), Bob one. Anything else passes on without an account, as an API with
/// public endpoints would let it.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .and_then(|token| match token {
            "alice-laptop" | "alice-phone" => Some(AccountId(42)),
            "bob" => Some(AccountId(7)),
            _ => None,
        });
    if let Some(account) = account {
        request.extensions_mut().insert(account);
    }
    next.run(request).await
}

/// A client whose connections come from `127.0.0.<n>`: another peer address.
fn peer(server: &Server, n: u8) -> Client {
    Client::from_address(server.addr(), IpAddr::from([127, 0, 0, n]))
}

/// `Authorization: Bearer <token>`.
fn bearer(token: &str) -> [(&'static str, String); 1] {
    [("authorization", format!("Bearer {token}"))]
}

/// `GET /` with the headers `headers`.
async fn get(client: &Client, headers: &[(&'static str, String)]) -> Reply {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    client.get_with("/", &headers).await
}

both_stores! {
    /// `UserId` keys callers by the account the authentication layer in front of the
    /// rate limiter put in the extensions, not by their token or address: Alice's laptop
    /// and phone (two tokens, two peers) share her limit, and Bob, on the same peer as
    /// her laptop, has his own. Requests without an account get the default
    /// `MissingKey::Shared`: one limit for all of them, whatever their peer, apart from
    /// every user's.
    async fn user_ids_from_an_auth_layer_have_separate_limits(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("per-user", 2))
            .key(UserId::<AccountId>::new())
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let app = routes(&hits)
            .layer(layer)
            .layer(middleware::from_fn(authenticate));
        let server = Server::start(app).await;
        let (laptop, phone, third) = (peer(&server, 1), peer(&server, 2), peer(&server, 3));

        let reply = get(&laptop, &bearer("alice-laptop")).await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 1, EPOCH_S + 30);
        let reply = get(&phone, &bearer("alice-phone")).await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 0, EPOCH_S + 60);
        for (client, token) in [(&laptop, "alice-laptop"), (&phone, "alice-phone")] {
            let denied = get(client, &bearer(token)).await;
            assert_too_many(&denied, 30);
            assert_limits(&denied, 2, 0, EPOCH_S + 60);
        }

        // Bob, from the peer of Alice's laptop.
        let reply = get(&laptop, &bearer("bob")).await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 1, EPOCH_S + 30);

        // No account — no header, a token nobody issued, another scheme — from three
        // peers: one shared limit, which neither Alice's nor Bob's requests touched.
        let reply = get(&laptop, &[]).await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 1, EPOCH_S + 30);
        let reply = get(&phone, &bearer("mallory")).await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 0, EPOCH_S + 60);
        let denied = get(&third, &[("authorization", "Basic YWxpY2U6YWxpY2U=".to_owned())]).await;
        assert_too_many(&denied, 30);
        assert_limits(&denied, 2, 0, EPOCH_S + 60);

        // Bob's second request is still his own.
        let reply = get(&third, &bearer("bob")).await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 0, EPOCH_S + 60);
        assert_eq!(hits.get(), 6);
    }
}

both_stores! {
    /// `UserId.or(PeerIp)`: signed-in callers by account, anonymous ones by address. An
    /// anonymous peer has a limit of its own, apart from other anonymous peers and from
    /// the users who call from the same address.
    async fn anonymous_callers_fall_back_to_their_peer_ip(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("per-caller", 1))
            .key(UserId::<AccountId>::new().or(PeerIp::new()))
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let app = routes(&hits)
            .layer(layer)
            .layer(middleware::from_fn(authenticate));
        let server = Server::start(app).await;
        let (one, two) = (peer(&server, 1), peer(&server, 2));

        let reply = get(&one, &[]).await;
        assert_ok(&reply);
        assert_limits(&reply, 1, 0, EPOCH_S + 60);
        assert_too_many(&get(&one, &bearer("mallory")).await, 60);

        // Another anonymous peer, and a user on the first peer: limits of their own.
        let reply = get(&two, &[]).await;
        assert_ok(&reply);
        assert_limits(&reply, 1, 0, EPOCH_S + 60);
        let reply = get(&one, &bearer("alice-laptop")).await;
        assert_ok(&reply);
        assert_limits(&reply, 1, 0, EPOCH_S + 60);
        assert_too_many(&get(&two, &bearer("alice-phone")).await, 60);
        assert_eq!(hits.get(), 3);
    }
}

both_stores! {
    /// `GlobalKey`: one budget for the whole service. Callers on three peer addresses,
    /// over HTTP/1.1 and HTTP/2, with and without an API key, on any route, all drain
    /// it, and once it is spent every one of them waits for the same refill. (A
    /// per-peer layer over the same store tells the peers apart: they are different
    /// callers.)
    async fn the_global_key_is_one_budget_every_caller_drains(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store.clone(), per_minute("whole-service", 5))
            .key(GlobalKey)
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let (one, two, three) = (peer(&server, 1), peer(&server, 2), peer(&server, 3));
        let http2 = Client::http2(server.addr());
        let api_key = [("x-api-key", "k-1")];

        // 5 a minute: each request leaves the budget 12 s further from full.
        let replies = [
            one.get("/").await,
            two.get("/api/v1/items").await,
            three.send(Method::POST, "/api/v1/checkout", &api_key).await,
            http2.get("/").await,
            two.get_with("/", &api_key).await,
        ];
        for (i, reply) in (1..).zip(&replies) {
            assert_ok(reply);
            assert_limits(reply, 5, 5 - i, EPOCH_S + 12 * i);
        }
        for client in [&one, &two, &three, &http2] {
            let denied = client.get("/api/v1/items").await;
            assert_too_many(&denied, 12);
            assert_limits(&denied, 5, 0, EPOCH_S + 60);
        }

        // One unit back after 12 s: whoever asks first has it, and the others wait again.
        clock.advance(Duration::from_secs(12));
        let reply = three.get("/").await;
        assert_ok(&reply);
        assert_limits(&reply, 5, 0, EPOCH_S + 72);
        assert_too_many(&one.get("/").await, 12);
        assert_eq!(hits.get(), 6);

        // The control: keyed by peer, the same clients are three callers.
        let per_peer = RateLimitLayer::builder(store, per_minute("per-peer", 1))
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(per_peer, &hits).await;
        for n in 1..=3 {
            let reply = peer(&server, n).get("/").await;
            assert_ok(&reply);
            assert_limits(&reply, 1, 0, EPOCH_S + 72);
        }
        assert_too_many(&peer(&server, 1).get("/").await, 60);
    }
}

/// What a request costs: a checkout 4 units, a batch as many as its `X-Batch-Size`,
/// anything else 1.
fn cost(method: &Method, uri: &Uri, headers: &HeaderMap) -> u64 {
    if method == Method::POST && uri.path() == "/api/v1/checkout" {
        return 4;
    }
    headers
        .get("x-batch-size")
        .and_then(|value| value.to_str().ok()?.parse().ok())
        .unwrap_or(1)
}

/// `GET /` as a batch of `size`.
async fn batch(client: &Client, size: u64) -> Reply {
    let size = size.to_string();
    client
        .get_with("/", &[("x-batch-size", size.as_str())])
        .await
}

both_stores! {
    /// A cost from a closure (by path, by header): each request takes its cost from the
    /// budget and `X-RateLimit-Remaining` counts down by it. A request that costs more
    /// than is left is refused, charged nothing, and told when its cost will have
    /// refilled, while a cheaper one still fits.
    async fn weighted_requests_drain_the_budget_by_their_cost(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("weighted", 10))
            .cost(cost)
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();
        let checkout = || client.send(Method::POST, "/api/v1/checkout", &[]);

        // 10 a minute: a unit refills every 6 s.
        let reply = client.get("/api/v1/items").await;
        assert_ok(&reply);
        assert_limits(&reply, 10, 9, EPOCH_S + 6);
        let reply = checkout().await;
        assert_ok(&reply);
        assert_limits(&reply, 10, 5, EPOCH_S + 30);
        let reply = batch(&client, 3).await;
        assert_ok(&reply);
        assert_limits(&reply, 10, 2, EPOCH_S + 48);

        // 4 units with 2 left: two more are 12 s away.
        let denied = checkout().await;
        assert_too_many(&denied, 12);
        assert_limits(&denied, 10, 2, EPOCH_S + 48);
        // It took nothing: a 1-unit request still fits.
        let reply = client.get("/api/v1/items").await;
        assert_ok(&reply);
        assert_limits(&reply, 10, 1, EPOCH_S + 54);

        // Three more units are 18 s away: one microsecond short, still refused.
        clock.advance(Duration::from_micros(17_999_999));
        let denied = checkout().await;
        assert_too_many(&denied, 1);
        assert_limits(&denied, 10, 3, EPOCH_S + 54);
        clock.advance(Duration::from_micros(1));
        let reply = checkout().await;
        assert_ok(&reply);
        assert_limits(&reply, 10, 0, EPOCH_S + 78);
        assert_eq!(hits.get(), 5);
    }
}

/// The answer to a request that costs more than the limit's capacity: a 429 without
/// `Retry-After`, since no wait would let it through, and a body that says so.
#[track_caller]
fn assert_never_fits(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS, "{reply:#?}");
    assert_eq!(reply.header("retry-after"), None, "{reply:#?}");
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(
        reply.body,
        r#"{"error":"Too Many Requests","message":"This request costs more than the rate limit allows at once; it cannot succeed."}"#
    );
}

both_stores! {
    /// A request that costs more than the capacity can never pass: refused with no
    /// `Retry-After` and a body that says it cannot succeed — from a full budget too,
    /// and after any wait — and charged nothing. A request of exactly the capacity
    /// passes.
    async fn a_cost_above_capacity_is_refused_without_a_retry_time(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("weighted", 10))
            .cost(cost)
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();

        // A full budget: nothing missing, full now.
        let refused = batch(&client, 11).await;
        assert_never_fits(&refused);
        assert_limits(&refused, 10, 10, EPOCH_S);
        let reply = batch(&client, 10).await;
        assert_ok(&reply);
        assert_limits(&reply, 10, 0, EPOCH_S + 60);
        let refused = batch(&client, 11).await;
        assert_never_fits(&refused);
        assert_limits(&refused, 10, 0, EPOCH_S + 60);

        // A minute on, full again: still never.
        clock.advance(Duration::from_secs(60));
        let refused = batch(&client, 11).await;
        assert_never_fits(&refused);
        assert_limits(&refused, 10, 10, EPOCH_S + 60);
        // Past 2^32, past 2^53 (Lua's exact integers), the most a u64 holds.
        for size in [1 << 32, (1 << 53) + 1, u64::MAX] {
            let refused = batch(&client, size).await;
            assert_never_fits(&refused);
            assert_limits(&refused, 10, 10, EPOCH_S + 60);
        }
        // The refusals took nothing.
        let reply = client.get("/").await;
        assert_ok(&reply);
        assert_limits(&reply, 10, 9, EPOCH_S + 66);
        assert_eq!(hits.get(), 2);
    }
}

/// Inside `Router::nest` the cost closure sees the URI the client sent, prefix included,
/// as the same layer's route limits do (a regression test: it was once handed the path
/// the nested router stripped, `/checkout`, and a cost written for `/api/v1/checkout`
/// never applied — the checkout limit did, but the 4-unit checkout was charged 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_by_path_holds_inside_a_nested_router() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("weighted", 10))
        .route(
            Some(Method::POST),
            "/api/v1/checkout",
            per_minute("checkout", 8),
        )
        .cost(cost)
        .wall_clock(clock)
        .build()
        .unwrap();
    let api = Router::new()
        .route("/checkout", post(|| async { "ok" }))
        .layer(layer);
    let server = Server::start(Router::new().nest("/api/v1", api)).await;

    let reply = server
        .client()
        .send(Method::POST, "/api/v1/checkout", &[])
        .await;
    assert_ok(&reply);
    // 8 a minute: a unit every 7.5 s; four of them, 30 s.
    assert_limits(&reply, 8, 4, EPOCH_S + 30);
}
