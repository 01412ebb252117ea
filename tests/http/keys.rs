//! Who is calling: tiers by API key, the client behind trusted proxies, IPv6 prefixes,
//! and requests without a key.

use std::collections::HashMap;

use axum::http::StatusCode;
use support::both_stores;
use support::http::{
    Hits, assert_limits, assert_no_limit_headers, assert_ok, assert_too_many, serve,
};
use support::stores::{EPOCH_S, per_minute};
use tollway_tower::{
    ApiKey, ClientIp, Fallback, ForwardedHeader, MissingKey, PeerIp, RateLimitLayer,
};

both_stores! {
    /// Free (100/min) and Pro (10,000/min) by `X-API-Key`: the 101st Free request in the
    /// minute gets 429 while Pro goes on; an unknown key is no key, and the caller's
    /// address gets the default policy.
    async fn free_and_pro_tiers_by_api_key(store, clock) {
        let hits = Hits::default();
        let tiers = HashMap::from([
            ("free-key-1".to_owned(), "free".to_owned()),
            ("pro-key-1".to_owned(), "pro".to_owned()),
        ]);
        let layer = RateLimitLayer::builder(store, per_minute("anonymous", 20))
            .key(ApiKey::header("x-api-key").unwrap().known(tiers.clone()).or(PeerIp::new()))
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
            .key(ClientIp::new(ForwardedHeader::XForwardedFor, ["10.0.0.0/8"]).unwrap())
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
            .key(ClientIp::new(ForwardedHeader::XForwardedFor, ["127.0.0.1"]).unwrap())
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
            .key(ClientIp::new(ForwardedHeader::XForwardedFor, ["127.0.0.1"]).unwrap())
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
    /// `api_key.or(PeerIp::new())`: callers without the header are limited together by
    /// their IP address, apart from callers with a key.
    async fn missing_key_falls_back_to_the_peer_ip(store, clock) {
        let hits = Hits::default();
        let layer = RateLimitLayer::builder(store, per_minute("keyed", 2))
            .key(ApiKey::header("x-api-key").unwrap().or(PeerIp::new()))
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
