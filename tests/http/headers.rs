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
        // 0.6 s until the next unit, in whole seconds rounded up.
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
        // `t` is when the next unit comes (every 30 s); `X-RateLimit-Reset`, when all
        // of them have.
        for (remaining, full_in) in [(1, 30), (0, 60)] {
            let reply = both.get("/").await;
            assert_ok(&reply);
            assert_limits(&reply, 2, remaining, EPOCH_S + full_in);
            assert_eq!(reply.header("ratelimit-policy"), Some(r#""tiny";q=2;w=60"#));
            let current = format!(r#""tiny";r={remaining};t=30"#);
            assert_eq!(reply.header("ratelimit"), Some(current.as_str()));
        }
        let denied = both.get("/").await;
        assert_too_many(&denied, 30);
        assert_limits(&denied, 2, 0, EPOCH_S + 60);
        assert_eq!(denied.header("ratelimit-policy"), Some(r#""tiny";q=2;w=60"#));
        // Never later than `Retry-After`: a client that reads `t` comes back in time.
        assert_eq!(denied.header("ratelimit"), Some(r#""tiny";r=0;t=30"#));
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

/// Every rule of draft-ietf-httpapi-ratelimit-headers-10 (sections 3 and 4) that the
/// `RateLimit-Policy` and `RateLimit` fields of `reply` break, read as a client reads
/// them: as RFC 9651 Lists.
fn draft_violations(reply: &support::http::Reply) -> Vec<String> {
    use sfv::{BareItem, List, ListEntry, Parameters, Parser};

    let mut broken = Vec::new();
    let list = |name: &str| -> Option<List> {
        let text = reply.header(name)?;
        Parser::new(text).parse().ok()
    };
    let (Some(policies), Some(current)) = (list("ratelimit-policy"), list("ratelimit")) else {
        return vec![format!(
            "a field missing or not a List: {:?}",
            reply.headers
        )];
    };
    let integer = |params: &Parameters, key: &str| match params.get(key) {
        None => None,
        Some(BareItem::Integer(n)) => Some(Some(i64::from(*n))),
        Some(_) => Some(None),
    };
    let mut names = Vec::new();
    for entry in &policies {
        let ListEntry::Item(item) = entry else {
            broken.push("RateLimit-Policy: an inner list".to_owned());
            continue;
        };
        let BareItem::String(name) = &item.bare_item else {
            broken.push(format!(
                "RateLimit-Policy: {:?} is not a String",
                item.bare_item
            ));
            continue;
        };
        names.push(name.as_str().to_owned());
        match integer(&item.params, "q") {
            Some(Some(q)) if q >= 0 => {}
            q => broken.push(format!("{name}: q {q:?} is not a non-negative Integer")),
        }
        match integer(&item.params, "w") {
            None | Some(Some(1..)) => {}
            w => broken.push(format!("{name}: w {w:?} is not a positive Integer")),
        }
        match item.params.get("qu") {
            None => {}
            Some(BareItem::String(unit))
                if ["requests", "content-bytes", "concurrent-requests"]
                    .contains(&unit.as_str()) => {}
            unit => broken.push(format!("{name}: qu {unit:?} is not a quota unit")),
        }
    }
    let retry_after: Option<i64> = reply.header("retry-after").and_then(|v| v.parse().ok());
    for entry in &current {
        let ListEntry::Item(item) = entry else {
            broken.push("RateLimit: an inner list".to_owned());
            continue;
        };
        let BareItem::String(name) = &item.bare_item else {
            broken.push(format!("RateLimit: {:?} is not a String", item.bare_item));
            continue;
        };
        if !names.iter().any(|n| n == name.as_str()) {
            broken.push(format!("{name}: in RateLimit, not in RateLimit-Policy"));
        }
        match integer(&item.params, "r") {
            Some(Some(r)) if r >= 0 => {}
            r => broken.push(format!("{name}: r {r:?} is not a non-negative Integer")),
        }
        match (integer(&item.params, "t"), retry_after) {
            (None, _) => {}
            // Section 6: Retry-After is never earlier than the reset.
            (Some(Some(t)), Some(wait)) if (0..=wait).contains(&t) => {}
            (Some(Some(t)), None) if t >= 0 => {}
            (t, wait) => broken.push(format!("{name}: t {t:?} against Retry-After {wait:?}")),
        }
    }
    broken
}

both_stores! {
    /// The IETF fields of every algorithm, a limit on calls in flight and a cost policy,
    /// allowed and refused, read by a structured-field parser: nothing the draft forbids,
    /// and `t` never later than `Retry-After`.
    async fn the_ietf_fields_keep_the_draft_for_every_algorithm(store, clock) {
        use axum::http::Method;
        use tollway_core::{Algorithm, Policy, Quota};

        let quota = |limit: u64, burst: Option<u64>| {
            let quota = Quota::per_minute(limit).unwrap();
            match burst {
                Some(burst) => quota.with_burst(burst).unwrap(),
                None => quota,
            }
        };
        // The shaper delays rather than refuses: a thousand a second keeps its delays to
        // a millisecond (real time: the layer sleeps on tokio's clock).
        let shaped = Quota::per_second(1_000).unwrap();
        let algorithms = [
            (Algorithm::TokenBucket, quota(3, Some(6))),
            (Algorithm::LeakyBucket, quota(3, None)),
            (Algorithm::LeakyBucketShaper, shaped),
            (Algorithm::FixedWindow, quota(3, None)),
            (Algorithm::SlidingWindowLog, quota(3, None)),
            (Algorithm::SlidingWindowCounter, quota(3, None)),
            (Algorithm::Gcra, quota(3, Some(5))),
        ];
        let hits = Hits::default();
        let mut seen = 0;
        for (algorithm, quota_of) in algorithms {
            let name = format!("{algorithm:?}").to_lowercase();
            let policy = Policy::new(&name, algorithm, quota_of).unwrap();
            let tokens = Policy::new("tokens", Algorithm::TokenBucket, quota(100, None)).unwrap();
            let calls = Policy::new("calls", Algorithm::Concurrency, quota(2, None)).unwrap();
            let layer = RateLimitLayer::builder(store.clone(), policy)
                .route(None, "/cost", tokens)
                .route(None, "/calls", calls)
                .policy_cost("tokens", |_, _, headers, _| {
                    headers
                        .get("x-cost")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(1)
                })
                .headers(HeaderStyle::Ietf)
                .wall_clock(clock.clone())
                .build()
                .unwrap();
            let server = serve(layer, &hits).await;
            let client = server.client();
            let mut refused = 0;
            for (path, cost) in [("/", "1"); 8]
                .into_iter()
                .chain([("/cost", "40"); 4])
                .chain([("/calls", "1"); 2])
            {
                let reply = client.send(Method::GET, path, &[("x-cost", cost)]).await;
                let broken = draft_violations(&reply);
                assert!(broken.is_empty(), "{name} {path}: {broken:?} in {:?}", reply.headers);
                refused += usize::from(reply.status == StatusCode::TOO_MANY_REQUESTS);
                seen += 1;
                clock.advance(Duration::from_millis(700));
            }
            // Refused at least by the token limit: 40 a call of 100.
            assert!(refused >= 2, "{name}: {refused} refused");
            clock.advance(Duration::from_secs(120));
        }
        assert_eq!(seen, 7 * 14);
    }
}
