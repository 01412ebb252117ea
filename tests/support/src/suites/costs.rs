//! A cost per limit, through the layer over real HTTP: a request charges its request
//! limit 1, its token limit what it asks for and its stream limit a slot, all or
//! nothing, and the limit that refused is the one the 429 reports. Any store that
//! decides each cost runs it.

use axum::Router;
use axum::routing::get;
use tollway_core::{Algorithm, Policy, Quota, Store};
use tollway_tower::{GlobalKey, HeaderStyle, RateLimitLayer};

use crate::http::Server;

/// A request refused by its token limit takes no request unit and no slot.
///
/// `store` must decide each cost ([`Store::check_each`]) and be on a clock that does not
/// move during the suite: a bucket of 100 tokens a minute refills as it reads. `name`
/// keeps the suite's policies apart from others on a shared server.
///
/// # Panics
///
/// When an answer is not the one the costs make.
pub async fn a_refused_token_takes_no_request_unit<St: Store>(store: St, name: &str) {
    let requests = Policy::new(
        format!("{name}-requests"),
        Algorithm::FixedWindow,
        Quota::per_minute(10).unwrap(),
    )
    .unwrap();
    let tokens = Policy::new(
        format!("{name}-tokens"),
        Algorithm::TokenBucket,
        Quota::per_minute(100).unwrap(),
    )
    .unwrap();
    // Two calls in flight; a slot nobody gives back would show on the next call.
    let streams = Policy::new(
        format!("{name}-streams"),
        Algorithm::Concurrency,
        Quota::with_period(2, std::time::Duration::from_secs(30)).unwrap(),
    )
    .unwrap();
    let layer = RateLimitLayer::builder(store, requests)
        .key(GlobalKey)
        .headers(HeaderStyle::Both)
        .route(None, "/v1/complete", tokens)
        .route(None, "/v1/complete", streams)
        .policy_cost(format!("{name}-tokens"), |_, _, headers, _| {
            headers
                .get("x-tokens")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        })
        .build()
        .unwrap();
    let app = Router::new()
        .route("/v1/complete", get(|| async { "done" }))
        .route("/v1/models", get(|| async { "models" }))
        .layer(layer);
    let server = Server::start(app).await;
    let client = server.client();
    let complete = |tokens: &'static str| {
        let client = client.clone();
        async move {
            client
                .get_with("/v1/complete", &[("x-tokens", tokens)])
                .await
        }
    };

    // 1 request, 60 tokens and a slot: all three are charged; the headers report the
    // one nearest its end (1 of 2 slots left, against 9 of 10 requests and 40 of 100
    // tokens).
    let reply = complete("60").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-ratelimit-limit"), Some("2"));
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("1"));

    // 60 tokens more do not fit: refused by the token limit, which the 429 reports.
    let reply = complete("60").await;
    assert_eq!(reply.status, 429, "{}", reply.body);
    assert_eq!(reply.header("x-ratelimit-limit"), Some("100"));
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("40"));
    // 20 tokens at 100 a minute: 12 seconds.
    assert_eq!(reply.header("retry-after"), Some("12"));

    // The refusal took no request unit: a request on another route (requests only)
    // finds 8 of 10 left, its own and the first one's taken.
    let reply = client.get("/v1/models").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("8"));

    // What still fits passes: 40 tokens, the bucket's last. It holds the one slot in
    // use: the refused request left none behind, and the first gave its own back.
    let reply = complete("40").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(reply.header("x-ratelimit-limit"), Some("100"));
    let fields = reply.header("ratelimit").unwrap_or_default();
    // A slot comes back when a call ends, which no clock says: no `t`.
    assert!(
        fields.contains(&format!("\"{name}-streams\";r=1,"))
            || fields.ends_with(&format!("\"{name}-streams\";r=1")),
        "{fields}"
    );
}
