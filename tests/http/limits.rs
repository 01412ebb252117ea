//! Several limits on one request: a route limit on top of the caller's, all or nothing.

use axum::http::Method;
use support::both_stores;
use support::http::{Hits, assert_limits, assert_ok, assert_too_many, serve};
use support::stores::{EPOCH_S, per_minute};
use tollway_tower::{ApiKey, HeaderStyle, RateLimitLayer};

both_stores! {
    /// A cost per limit: 1 request and N tokens, all or nothing. A request its token
    /// limit refuses takes no request unit, and the 429 reports the token limit.
    async fn a_request_refused_by_its_token_limit_takes_no_request_unit(store, clock) {
        let _ = clock;
        support::suites::a_refused_token_takes_no_request_unit(store, "http").await;
    }
}

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
        // `t` is when the next unit comes: 6 s for the user limit, 30 s for checkout.
        assert_eq!(reply.header("ratelimit"), Some(r#""per-user";r=8;t=6, "checkout";r=0;t=30"#));

        // Denied by the route, though the user limit has 8 left; and a refused request
        // costs nothing: five refusals leave the user limit where it was (8 left, the next
        // unit in 6 s), and the IETF field says so.
        for _ in 0..5 {
            let denied = checkout().await;
            assert_too_many(&denied, 30);
            assert_limits(&denied, 2, 0, EPOCH_S + 60);
            assert_eq!(denied.header("ratelimit-policy"), Some(both_policies));
            assert_eq!(denied.header("ratelimit"), Some(r#""per-user";r=8;t=6, "checkout";r=0;t=30"#));
        }

        // The user limit still lets the same user through elsewhere, charged once more.
        let items = client.get_with("/api/v1/items", &user).await;
        assert_ok(&items);
        assert_limits(&items, 10, 7, EPOCH_S + 18);
        assert_eq!(items.header("ratelimit-policy"), Some(r#""per-user";q=10;w=60"#));
        assert_eq!(items.header("ratelimit"), Some(r#""per-user";r=7;t=6"#));

        // The route limit is per caller: another user may check out.
        let other = client
            .send(Method::POST, "/api/v1/checkout", &[("x-api-key", "user-2")])
            .await;
        assert_ok(&other);
        assert_limits(&other, 2, 1, EPOCH_S + 30);
        assert_eq!(hits.get(), 4);
    }
}
