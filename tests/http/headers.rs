//! Headers and bodies: exact `X-RateLimit-*`, the IETF fields, the 429, a custom
//! rejection.

use std::time::Duration;

use axum::http::header::CONTENT_TYPE;
use axum::http::{Response, StatusCode};
use bytes::Bytes;
use support::both_stores;
use support::http::{Hits, assert_limits, assert_ok, assert_too_many, serve};
use support::stores::{EPOCH_S, per_minute};
use tollway_tower::{HeaderStyle, RateLimitLayer, Rejection};

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
