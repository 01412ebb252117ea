//! The rate-limiting layer end to end: a real axum server on 127.0.0.1:0, a real HTTP
//! client over TCP, the memory store and a real `redis-server`, on a manual clock so that
//! every header value is exact.
//!
//! Most tests run twice, as `<test>::memory` and `<test>::redis`: the same body over a
//! [`MemoryStore`] and over a [`RedisStore`] in caller-time mode, both reading the one
//! manual clock that the layer also reads for `X-RateLimit-Reset`.
#![allow(clippy::unwrap_used)]

mod support;
#[macro_use]
#[path = "support/stores.rs"]
mod stores;
#[path = "support/http.rs"]
mod web;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::http::{Method, Response, StatusCode};
use axum::routing::{get, post};
use bytes::Bytes;
use support::RedisServer;
use tokio::sync::watch;
use tokio::time::Instant;
use tollway_core::{
    Algorithm, Checked, Decisions, ManualClock, Policy, Quota, RedisStore, Store, StoreError,
};
use tollway_tower::{
    ApiKey, ClientIp, HeaderStyle, KeyExtractor, MissingKey, OnStoreError, RateLimitLayer,
    Rejection,
};
use web::{Reply, Server};

use stores::{EPOCH_S, EPOCH_US, memory_store, per_minute, redis_store};

/// How many requests reached a handler: a denied request must never get there.
#[derive(Clone, Debug, Default)]
struct Hits(Arc<AtomicUsize>);

impl Hits {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// The application behind the layer: three routes that answer `ok` and count their hits.
fn routes(hits: &Hits) -> Router {
    let handler = |hits: Hits| {
        move || {
            hits.0.fetch_add(1, Ordering::SeqCst);
            async { "ok" }
        }
    };
    Router::new()
        .route("/", get(handler(hits.clone())))
        .route("/api/v1/items", get(handler(hits.clone())))
        .route("/api/v1/checkout", post(handler(hits.clone())))
}

/// Serves [`routes`] behind `layer` on a fresh loopback port.
async fn serve<St, K>(layer: RateLimitLayer<St, K>, hits: &Hits) -> Server
where
    St: Store,
    K: KeyExtractor<axum::body::Body>,
{
    Server::start(routes(hits).layer(layer)).await
}

// ---------------------------------------------------------------------------------------
// Assertions
// ---------------------------------------------------------------------------------------

/// A 200 from the handler.
#[track_caller]
fn assert_ok(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::OK, "{reply:#?}");
    assert_eq!(reply.body, "ok", "{reply:#?}");
}

/// The legacy headers, exactly.
#[track_caller]
fn assert_limits(reply: &Reply, limit: u64, remaining: u64, reset: u64) {
    let header = |name| reply.header(name).map(str::to_owned);
    assert_eq!(
        (
            header("x-ratelimit-limit"),
            header("x-ratelimit-remaining"),
            header("x-ratelimit-reset"),
        ),
        (
            Some(limit.to_string()),
            Some(remaining.to_string()),
            Some(reset.to_string()),
        ),
        "{reply:#?}"
    );
}

/// The default denial: 429, `Retry-After` and the JSON body, exactly.
#[track_caller]
fn assert_too_many(reply: &Reply, retry_after: u64) {
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS, "{reply:#?}");
    assert_eq!(
        reply.header("retry-after"),
        Some(retry_after.to_string().as_str()),
        "{reply:#?}"
    );
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(
        reply.body,
        format!(
            r#"{{"error":"Too Many Requests","message":"API rate limit exceeded. Please retry after {retry_after} seconds."}}"#
        )
    );
}

/// No rate-limit header of any style.
#[track_caller]
fn assert_no_limit_headers(reply: &Reply) {
    for name in [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit",
        "ratelimit-policy",
        "retry-after",
    ] {
        assert_eq!(reply.header(name), None, "{name} in {reply:#?}");
    }
}

// ---------------------------------------------------------------------------------------
// Headers and bodies
// ---------------------------------------------------------------------------------------

both_stores! {
    /// Allowed responses carry exact `X-RateLimit-*` values; the denial adds `Retry-After`
    /// rounded up (never 0) and the JSON body; the manual clock lets the caller back in
    /// exactly when the bucket says, and not one microsecond sooner.
    async fn exact_headers_and_body_on_a_manual_clock(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("per-ip", 3))
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();

        // 3 a minute: each request leaves the bucket 20 s further from full.
        for (remaining, full_in) in [(2, 20), (1, 40), (0, 60)] {
            let reply = client.get("/").await;
            assert_ok(&reply);
            assert_limits(&reply, 3, remaining, EPOCH_S + full_in);
            assert_eq!(reply.header("retry-after"), None);
        }
        let denied = client.get("/").await;
        assert_too_many(&denied, 20);
        assert_limits(&denied, 3, 0, EPOCH_S + 60);

        // 0.5 s before the next token: Retry-After rounds 0.5 s up to 1.
        clock.advance(Duration::from_micros(19_500_000));
        let denied = client.get("/").await;
        assert_too_many(&denied, 1);
        assert_limits(&denied, 3, 0, EPOCH_S + 60);

        // One microsecond before it: still denied, and still "1", never "0".
        clock.advance(Duration::from_micros(499_999));
        let denied = client.get("/").await;
        assert_too_many(&denied, 1);

        // On the microsecond: through again, the bucket now full at +80 s.
        clock.advance(Duration::from_micros(1));
        let reply = client.get("/").await;
        assert_ok(&reply);
        assert_limits(&reply, 3, 0, EPOCH_S + 80);
        assert_eq!(hits.get(), 4);
    }
}

both_stores! {
    /// `HeaderStyle::Ietf` sends only `RateLimit-Policy` and `RateLimit`;
    /// `HeaderStyle::Both` sends them beside the legacy ones, denials included.
    async fn ietf_ratelimit_headers_have_exact_values(store, clock) {
        let hits = Hits::default();
        let ietf = RateLimitLayer::builder(store.clone(), per_minute("free", 100))
            .headers(HeaderStyle::Ietf)
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let ietf = serve(ietf, &hits).await;
        let reply = ietf.client().get("/").await;
        assert_ok(&reply);
        assert_eq!(reply.header("ratelimit-policy"), Some(r#""free";q=100;w=60"#));
        // 0.6 s until full again, in whole seconds rounded up.
        assert_eq!(reply.header("ratelimit"), Some(r#""free";r=99;t=1"#));
        assert_eq!(reply.header("x-ratelimit-limit"), None);
        assert_eq!(reply.header("x-ratelimit-remaining"), None);
        assert_eq!(reply.header("x-ratelimit-reset"), None);

        let both = RateLimitLayer::builder(store, per_minute("tiny", 2))
            .headers(HeaderStyle::Both)
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let both_server = serve(both, &hits).await;
        let both = both_server.client();
        for (remaining, full_in) in [(1, 30), (0, 60)] {
            let reply = both.get("/").await;
            assert_ok(&reply);
            assert_limits(&reply, 2, remaining, EPOCH_S + full_in);
            assert_eq!(reply.header("ratelimit-policy"), Some(r#""tiny";q=2;w=60"#));
            let current = format!(r#""tiny";r={remaining};t={full_in}"#);
            assert_eq!(reply.header("ratelimit"), Some(current.as_str()));
        }
        let denied = both.get("/").await;
        assert_too_many(&denied, 30);
        assert_limits(&denied, 2, 0, EPOCH_S + 60);
        assert_eq!(denied.header("ratelimit-policy"), Some(r#""tiny";q=2;w=60"#));
        assert_eq!(denied.header("ratelimit"), Some(r#""tiny";r=0;t=60"#));
        assert_eq!(hits.get(), 3);
    }
}

both_stores! {
    /// `on_rejected` writes the denial's status and body; the layer still adds
    /// `Retry-After` and the `X-RateLimit-*` headers to it.
    async fn a_custom_rejection_keeps_the_rate_limit_headers(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("tiny", 1))
            .on_rejected(|rejection: &Rejection<'_>| {
                let body = format!(
                    "{} says slow down: come back in {} s",
                    rejection.policy().name(),
                    rejection.retry_after_secs().unwrap_or(0)
                );
                Response::builder()
                    .status(StatusCode::TOO_MANY_REQUESTS)
                    .header(CONTENT_TYPE, "text/plain; charset=utf-8")
                    .header("x-custom", "yes")
                    .body(Bytes::from(body))
                    .unwrap()
            })
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();

        let reply = client.get("/").await;
        assert_ok(&reply);
        assert_limits(&reply, 1, 0, EPOCH_S + 60);

        clock.advance(Duration::from_secs(15));
        let denied = client.get("/").await;
        assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS, "{denied:#?}");
        assert_eq!(denied.body, "tiny says slow down: come back in 45 s");
        assert_eq!(denied.header("content-type"), Some("text/plain; charset=utf-8"));
        assert_eq!(denied.header("x-custom"), Some("yes"));
        assert_eq!(denied.header("retry-after"), Some("45"));
        assert_limits(&denied, 1, 0, EPOCH_S + 60);
        assert_eq!(hits.get(), 1);
    }
}

// ---------------------------------------------------------------------------------------
// Who is calling: tiers, proxies, IPv6, missing keys
// ---------------------------------------------------------------------------------------

both_stores! {
    /// Free (100/min) and Pro (10,000/min) by `X-API-Key`: the 101st Free request in the
    /// minute gets 429 while Pro goes on; an unknown key gets the default policy.
    async fn free_and_pro_tiers_by_api_key(store, clock) {
        let hits = Hits::default();
        let tiers = HashMap::from([
            ("free-key-1".to_owned(), "free".to_owned()),
            ("pro-key-1".to_owned(), "pro".to_owned()),
        ]);
        let layer = RateLimitLayer::builder(store, per_minute("anonymous", 20))
            .key(ApiKey::header("x-api-key").unwrap())
            .tier(per_minute("free", 100))
            .tier(per_minute("pro", 10_000))
            .tiers(tiers)
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();
        let free = [("x-api-key", "free-key-1")];
        let pro = [("x-api-key", "pro-key-1")];

        for i in 1..=100u64 {
            let reply = client.get_with("/", &free).await;
            assert_ok(&reply);
            // Each Free unit refills in 0.6 s; Pro's in 6 ms.
            assert_limits(&reply, 100, 100 - i, EPOCH_S + (6 * i).div_ceil(10));
            let reply = client.get_with("/", &pro).await;
            assert_ok(&reply);
            assert_limits(&reply, 10_000, 10_000 - i, EPOCH_S + 1);
        }
        let denied = client.get_with("/", &free).await;
        assert_too_many(&denied, 1);
        assert_limits(&denied, 100, 0, EPOCH_S + 60);
        for i in 101..=150u64 {
            let reply = client.get_with("/", &pro).await;
            assert_ok(&reply);
            assert_limits(&reply, 10_000, 10_000 - i, EPOCH_S + 1);
        }
        assert_too_many(&client.get_with("/", &free).await, 1);

        let unknown = client.get_with("/", &[("x-api-key", "no-such-key")]).await;
        assert_ok(&unknown);
        assert_limits(&unknown, 20, 19, EPOCH_S + 3);
        assert_eq!(hits.get(), 100 + 150 + 1);
    }
}

both_stores! {
    /// The test client's peer is 127.0.0.1, outside the trusted 10.0.0.0/8: its
    /// `X-Forwarded-For`, `Forwarded` and `X-Real-IP` are lies and the key stays the peer.
    async fn spoofed_forwarded_for_from_an_untrusted_peer_changes_nothing(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("per-client", 2))
            .key(ClientIp::trusting(["10.0.0.0/8"]).unwrap())
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();

        let reply = client.get_with("/", &[("x-forwarded-for", "198.51.100.1")]).await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 1, EPOCH_S + 30);
        let reply = client.get_with("/", &[("x-forwarded-for", "198.51.100.2")]).await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 0, EPOCH_S + 60);
        // A third made-up client, or a different header, is still 127.0.0.1.
        let denied = client.get_with("/", &[("x-forwarded-for", "198.51.100.3")]).await;
        assert_too_many(&denied, 30);
        let denied = client
            .get_with("/", &[("forwarded", "for=198.51.100.4"), ("x-real-ip", "198.51.100.5")])
            .await;
        assert_too_many(&denied, 30);
        assert_too_many(&client.get("/").await, 30);
        assert_eq!(hits.get(), 2);
    }
}

both_stores! {
    /// Through a trusted proxy (the peer 127.0.0.1) the right-most untrusted address in
    /// `X-Forwarded-For` is the client: each client has its own limit.
    async fn forwarded_for_from_a_trusted_proxy_names_the_client(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("per-client", 2))
            .key(ClientIp::trusting(["127.0.0.1"]).unwrap())
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();
        let alice = [("x-forwarded-for", "198.51.100.1")];

        assert_limits(&client.get_with("/", &alice).await, 2, 1, EPOCH_S + 30);
        assert_limits(&client.get_with("/", &alice).await, 2, 0, EPOCH_S + 60);
        assert_too_many(&client.get_with("/", &alice).await, 30);
        // Alice again, through a second trusted hop: still Alice.
        let via_two = [("x-forwarded-for", "198.51.100.1, 127.0.0.1")];
        assert_too_many(&client.get_with("/", &via_two).await, 30);

        // Bob behind the same proxy has a limit of his own; what he forged to the left of
        // the proxy's entry does not make him Alice.
        let bob = client.get_with("/", &[("x-forwarded-for", "198.51.100.2")]).await;
        assert_ok(&bob);
        assert_limits(&bob, 2, 1, EPOCH_S + 30);
        let forged = [("x-forwarded-for", "198.51.100.1, 198.51.100.2")];
        let bob = client.get_with("/", &forged).await;
        assert_ok(&bob);
        assert_limits(&bob, 2, 0, EPOCH_S + 60);

        // No header: the proxy itself is the caller.
        let direct = client.get("/").await;
        assert_ok(&direct);
        assert_limits(&direct, 2, 1, EPOCH_S + 30);
        assert_eq!(hits.get(), 5);
    }
}

both_stores! {
    /// Two IPv6 addresses in one /64 are one host and share a limit; an address in the
    /// next /64 does not.
    async fn ipv6_addresses_in_one_slash_64_share_a_limit(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("per-host", 2))
            .key(ClientIp::trusting(["127.0.0.1"]).unwrap())
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();
        let xff = |ip| [("x-forwarded-for", ip)];

        let first = client.get_with("/", &xff("2001:db8:1:2::1")).await;
        assert_limits(&first, 2, 1, EPOCH_S + 30);
        let neighbour = client
            .get_with("/", &xff("2001:db8:1:2:ffff:ffff:ffff:fffe"))
            .await;
        assert_ok(&neighbour);
        assert_limits(&neighbour, 2, 0, EPOCH_S + 60);
        assert_too_many(&client.get_with("/", &xff("2001:db8:1:2::1")).await, 30);
        assert_too_many(&client.get_with("/", &xff("2001:db8:1:2:abcd::7")).await, 30);

        let other = client.get_with("/", &xff("2001:db8:1:3::1")).await;
        assert_ok(&other);
        assert_limits(&other, 2, 1, EPOCH_S + 30);
        assert_eq!(hits.get(), 3);
    }
}

both_stores! {
    /// `MissingKey::Reject(401)`: without the header the caller is turned away, unlimited
    /// and unserved; with it, limited as usual.
    async fn missing_key_reject_answers_the_configured_status(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("keyed", 2))
            .key(ApiKey::header("x-api-key").unwrap())
            .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();

        for _ in 0..3 {
            let reply = client.get("/").await;
            assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{reply:#?}");
            assert_eq!(reply.header("content-type"), Some("application/json"));
            assert_eq!(
                reply.body,
                r#"{"error":"Unauthorized","message":"No rate-limit key could be determined for this request."}"#
            );
            assert_no_limit_headers(&reply);
        }
        let reply = client.get_with("/", &[("x-api-key", "k-1")]).await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 1, EPOCH_S + 30);
        assert_eq!(hits.get(), 1);
    }
}

both_stores! {
    /// The default, `MissingKey::FallbackToIp`: callers without the header are limited
    /// together by their IP address, apart from callers with a key.
    async fn missing_key_falls_back_to_the_peer_ip(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("keyed", 2))
            .key(ApiKey::header("x-api-key").unwrap())
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();

        assert_limits(&client.get("/").await, 2, 1, EPOCH_S + 30);
        assert_limits(&client.get("/").await, 2, 0, EPOCH_S + 60);
        assert_too_many(&client.get("/").await, 30);
        // An empty header is no key either.
        assert_too_many(&client.get_with("/", &[("x-api-key", "")]).await, 30);

        let keyed = client.get_with("/", &[("x-api-key", "k-1")]).await;
        assert_ok(&keyed);
        assert_limits(&keyed, 2, 1, EPOCH_S + 30);
        assert_eq!(hits.get(), 3);
    }
}

both_stores! {
    /// `MissingKey::Allow`: callers without the header pass unlimited and without
    /// rate-limit headers; callers with one are limited.
    async fn missing_key_allow_lets_the_request_through(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("keyed", 1))
            .key(ApiKey::header("x-api-key").unwrap())
            .on_missing_key(MissingKey::Allow)
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();

        for _ in 0..5 {
            let reply = client.get("/").await;
            assert_ok(&reply);
            assert_no_limit_headers(&reply);
        }
        let keyed = client.get_with("/", &[("x-api-key", "k-1")]).await;
        assert_ok(&keyed);
        assert_limits(&keyed, 1, 0, EPOCH_S + 60);
        assert_too_many(&client.get_with("/", &[("x-api-key", "k-1")]).await, 60);
        assert_eq!(hits.get(), 6);
    }
}

// ---------------------------------------------------------------------------------------
// Several limits on one request
// ---------------------------------------------------------------------------------------

both_stores! {
    /// A route limit (checkout, 2/min) on top of the user limit (10/min): the route limit
    /// denies while the user limit still has room, and the refused requests cost the user
    /// limit nothing (all or nothing). The legacy headers report the most restrictive
    /// limit; the IETF fields list every limit checked.
    async fn a_route_limit_denies_while_the_user_limit_has_room(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("per-user", 10))
            .key(ApiKey::header("x-api-key").unwrap())
            .route(Some(Method::POST), "/api/v1/checkout", per_minute("checkout", 2))
            .headers(HeaderStyle::Both)
            .wall_clock(clock.clone())
            .build()
            .unwrap();
        let server = serve(layer, &hits).await;
        let client = server.client();
        let user = [("x-api-key", "user-1")];
        let checkout = || client.send(Method::POST, "/api/v1/checkout", &user);
        let both_policies = r#""per-user";q=10;w=60, "checkout";q=2;w=60"#;

        let reply = checkout().await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 1, EPOCH_S + 30);
        assert_eq!(reply.header("ratelimit-policy"), Some(both_policies));
        assert_eq!(reply.header("ratelimit"), Some(r#""per-user";r=9;t=6, "checkout";r=1;t=30"#));

        let reply = checkout().await;
        assert_ok(&reply);
        assert_limits(&reply, 2, 0, EPOCH_S + 60);
        assert_eq!(reply.header("ratelimit"), Some(r#""per-user";r=8;t=12, "checkout";r=0;t=60"#));

        // Denied by the route, though the user limit has 8 left; and a refused request
        // costs nothing: five refusals leave the user limit where it was (8 left, full
        // again in 12 s), and the IETF field says so.
        for _ in 0..5 {
            let denied = checkout().await;
            assert_too_many(&denied, 30);
            assert_limits(&denied, 2, 0, EPOCH_S + 60);
            assert_eq!(denied.header("ratelimit-policy"), Some(both_policies));
            assert_eq!(denied.header("ratelimit"), Some(r#""per-user";r=8;t=12, "checkout";r=0;t=60"#));
        }

        // The user limit still lets the same user through elsewhere, charged once more.
        let items = client.get_with("/api/v1/items", &user).await;
        assert_ok(&items);
        assert_limits(&items, 10, 7, EPOCH_S + 18);
        assert_eq!(items.header("ratelimit-policy"), Some(r#""per-user";q=10;w=60"#));
        assert_eq!(items.header("ratelimit"), Some(r#""per-user";r=7;t=18"#));

        // The route limit is per caller: another user may check out.
        let other = client
            .send(Method::POST, "/api/v1/checkout", &[("x-api-key", "user-2")])
            .await;
        assert_ok(&other);
        assert_limits(&other, 2, 1, EPOCH_S + 30);
        assert_eq!(hits.get(), 4);
    }
}

// ---------------------------------------------------------------------------------------
// Shaping
// ---------------------------------------------------------------------------------------

/// Keeps tokio's paused clock from auto-advancing while real sockets do their work.
///
/// With paused time tokio jumps to the next timer whenever it parks with timers pending,
/// even while tasks wait on sockets; with real TCP (and a real Redis) that would move the
/// clock between the decisions and break exact timing. Tokio does not auto-advance while a
/// blocking task runs (documented under `tokio::time::pause`, "Preventing auto-advance"),
/// so this holds one until dropped: time then moves only by `tokio::time::advance`.
///
/// The blocking task also lets go after a minute of real time, so that a layer that hangs
/// makes the test's (virtual) timeouts fire instead of a stuck test.
struct HeldClock {
    _release: std::sync::mpsc::Sender<()>,
}

fn hold_clock() -> HeldClock {
    let (release, released) = std::sync::mpsc::channel::<()>();
    tokio::task::spawn_blocking(move || {
        let _ = released.recv_timeout(Duration::from_secs(60));
    });
    HeldClock { _release: release }
}

/// Waits for `rx` to satisfy `ready`, failing (rather than hanging) if the held clock had
/// to let go.
async fn wait_for<T>(rx: &mut watch::Receiver<T>, what: &str, ready: impl FnMut(&T) -> bool) {
    tokio::time::timeout(Duration::from_secs(3600), rx.wait_for(ready))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .unwrap();
}

/// A store that counts its finished decisions, so a test knows when every request in
/// flight has been decided.
struct Observed<St> {
    inner: St,
    decided: Arc<watch::Sender<usize>>,
}

type BoxedCheck = Pin<Box<dyn Future<Output = Result<Decisions, StoreError>> + Send>>;

/// It always answers through a future, as a store that calls out does.
impl<St: Store> Store for Observed<St> {
    type Future = BoxedCheck;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u32) -> Checked<BoxedCheck> {
        let check = self.inner.check(key, policies, cost);
        let decided = Arc::clone(&self.decided);
        Checked::Pending(Box::pin(async move {
            let decisions = check.await;
            decided.send_modify(|n| *n += 1);
            decisions
        }))
    }
}

/// A shaper (10/s, room for 4 in the queue) meets 5 requests at once, over real TCP: it
/// delays 4 of them to a steady 100 ms apart instead of rejecting them, and rejects only
/// the fifth, which overflows the queue.
///
/// The delay is a tokio sleep, so the runtime's clock is paused and held (see
/// [`HeldClock`]) and moved by hand; the handler records `tokio::time::Instant::now()`
/// when each request reaches it, which must be exactly the decision's delay after the
/// start — it is not there after 99 ms and is there at 100. The store's manual clock
/// stays put, so all five are decided at one instant.
async fn shaping_delays_instead_of_rejecting<St: Store>(store: St, clock: ManualClock) {
    let _held = hold_clock();
    let (decided, mut decisions) = watch::channel(0usize);
    let store = Observed {
        inner: store,
        decided: Arc::new(decided),
    };
    let quota = Quota::per_second(10).unwrap().with_burst(4).unwrap();
    let policy = Policy::new("shaped", Algorithm::LeakyBucketShaper, quota).unwrap();
    let layer = RateLimitLayer::builder(store, policy)
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let (called, mut calls) = watch::channel(Vec::<Instant>::new());
    let called = Arc::new(called);
    let app = Router::new()
        .route(
            "/",
            get(move || {
                called.send_modify(|c| c.push(Instant::now()));
                async { "ok" }
            }),
        )
        .layer(layer);
    let server = Server::start(app).await;
    let client = server.client();

    let start = Instant::now();
    let requests: Vec<_> = (0..5)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { client.get("/").await })
        })
        .collect();

    wait_for(&mut decisions, "five decisions", |&n| n >= 5).await;
    let offsets = |calls: &watch::Receiver<Vec<Instant>>| {
        calls
            .borrow()
            .iter()
            .map(|&t| t - start)
            .collect::<Vec<_>>()
    };
    let slots: Vec<Duration> = (0..4).map(|k| Duration::from_millis(100) * k).collect();
    wait_for(&mut calls, "the first request", |c| !c.is_empty()).await;
    assert_eq!(
        offsets(&calls),
        slots[..1],
        "only the first goes straight through"
    );
    for k in 1..=3 {
        tokio::time::advance(Duration::from_millis(99)).await;
        assert_eq!(offsets(&calls), slots[..k], "request {k} came early");
        tokio::time::advance(Duration::from_millis(1)).await;
        wait_for(&mut calls, "a delayed request", |c| c.len() > k).await;
        assert_eq!(offsets(&calls), slots[..=k], "request {k}");
    }

    let mut remaining = Vec::new();
    let mut denied = Vec::new();
    for request in requests {
        let reply = tokio::time::timeout(Duration::from_secs(3600), request)
            .await
            .expect("a reply")
            .unwrap();
        if reply.status == StatusCode::OK {
            // Reset is measured at the store's instant: at most 400 ms ahead.
            let left: u64 = reply
                .header("x-ratelimit-remaining")
                .unwrap()
                .parse()
                .unwrap();
            assert_limits(&reply, 4, left, EPOCH_S + 1);
            remaining.push(left);
        } else {
            denied.push(reply);
        }
    }
    remaining.sort_unstable();
    assert_eq!(remaining, [0, 1, 2, 3]);
    assert_eq!(denied.len(), 1, "{denied:#?}");
    // The queue frees a slot in 100 ms: Retry-After rounds it up to 1 s.
    assert_too_many(&denied[0], 1);
    assert_limits(&denied[0], 4, 0, EPOCH_S + 1);
    assert_eq!(calls.borrow().len(), 4);
    assert_eq!(Instant::now() - start, Duration::from_millis(300));
}

mod shaping_delays_instead_of_rejecting {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn memory() {
        let clock = ManualClock::at_micros(EPOCH_US);
        shaping_delays_instead_of_rejecting(memory_store(&clock), clock).await;
    }

    #[tokio::test(start_paused = true)]
    async fn redis() {
        let server = RedisServer::start();
        let clock = ManualClock::at_micros(EPOCH_US);
        // Held before connecting: the connection's timeouts must not fire on their own.
        let _held = hold_clock();
        let store = redis_store(&server, &clock).await;
        shaping_delays_instead_of_rejecting(store, clock).await;
    }
}

// ---------------------------------------------------------------------------------------
// Redis: failure, and a fleet
// ---------------------------------------------------------------------------------------

/// Bounds a request that must not hang on a dead store.
async fn within<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(5), future)
        .await
        .unwrap_or_else(|_| panic!("{what} hung on a dead Redis"))
}

/// With its Redis killed, a layer answers as configured and promptly: fail open lets the
/// request through without rate-limit headers, fail closed answers 503 with a JSON body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_gets_the_configured_answer() {
    let mut redis = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = RedisStore::builder()
        .timeout(Duration::from_millis(250))
        .caller_time(clock.clone())
        .connect(&redis.url())
        .await
        .unwrap();
    let (open_hits, closed_hits) = (Hits::default(), Hits::default());
    let open = RateLimitLayer::builder(store.clone(), per_minute("fail-open", 10))
        .on_store_error(OnStoreError::Allow)
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let closed = RateLimitLayer::builder(store, per_minute("fail-closed", 10))
        .on_store_error(OnStoreError::Reject)
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let open_server = serve(open, &open_hits).await;
    let closed_server = serve(closed, &closed_hits).await;
    let (open, closed) = (open_server.client(), closed_server.client());

    // While Redis is up, both limit as usual.
    for client in [&open, &closed] {
        let reply = within("a request", client.get("/")).await;
        assert_ok(&reply);
        assert_limits(&reply, 10, 9, EPOCH_S + 6);
    }

    redis.kill();
    for _ in 0..3 {
        let reply = within("the fail-open request", open.get("/")).await;
        assert_ok(&reply);
        assert_no_limit_headers(&reply);

        let reply = within("the fail-closed request", closed.get("/")).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:#?}");
        assert_eq!(reply.header("content-type"), Some("application/json"));
        assert_eq!(
            reply.body,
            r#"{"error":"Service Unavailable","message":"Rate limiting is unavailable. Please retry later."}"#
        );
        assert_no_limit_headers(&reply);
    }
    assert_eq!(open_hits.get(), 1 + 3);
    assert_eq!(closed_hits.get(), 1);
}

/// Two gateways (two axum servers, each with its own Redis connection and layer) sharing
/// one Redis enforce one limit: 10 a minute, 6 concurrent requests to each, exactly 10
/// served, each of the 10 units handed out once. The same two gateways on memory stores
/// (one each) serve all 12: the shared store is what makes the limit one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_sharing_one_redis_enforce_one_limit() {
    async fn fleet<St: Store>(a: St, b: St, clock: &ManualClock) -> (Vec<u64>, usize, usize) {
        let hits = Hits::default();
        let mut servers = Vec::new();
        for store in [a, b] {
            let layer = RateLimitLayer::builder(store, per_minute("shared", 10))
                .wall_clock(clock.clone())
                .build()
                .unwrap();
            servers.push(serve(layer, &hits).await);
        }
        let requests: Vec<_> = servers
            .iter()
            .flat_map(|server| std::iter::repeat_n(server.client(), 6))
            .map(|client| tokio::spawn(async move { client.get("/").await }))
            .collect();
        let (mut remaining, mut denied) = (Vec::new(), 0);
        for request in requests {
            let reply = within("a request", request).await.unwrap();
            if reply.status == StatusCode::OK {
                remaining.push(
                    reply
                        .header("x-ratelimit-remaining")
                        .unwrap()
                        .parse()
                        .unwrap(),
                );
            } else {
                assert_too_many(&reply, 6);
                denied += 1;
            }
        }
        remaining.sort_unstable();
        (remaining, denied, hits.get())
    }

    let redis = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let (a, b) = (
        redis_store(&redis, &clock).await,
        redis_store(&redis, &clock).await,
    );
    let (remaining, denied, hits) = fleet(a, b, &clock).await;
    assert_eq!(remaining, (0..10).collect::<Vec<u64>>());
    assert_eq!((denied, hits), (2, 10));

    let (a, b) = (memory_store(&clock), memory_store(&clock));
    let (remaining, denied, hits) = fleet(a, b, &clock).await;
    assert_eq!(remaining.len(), 12, "{remaining:?}");
    assert_eq!((denied, hits), (0, 12));
}
