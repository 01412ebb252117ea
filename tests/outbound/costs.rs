//! Costs charged as an estimate and settled with what the response reports.

use super::*;

/// A token-metered API: each call is charged an estimate (100 tokens) up front and
/// settled with what the response reports (`x-tokens-used`): the budget holds exactly
/// what was used, above the estimate or below it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn costs_are_settled_with_what_the_response_reports() {
    use axum::response::IntoResponse;
    let used = Arc::new(std::sync::Mutex::new(vec!["40", "250"]));
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(move || {
            let used = Arc::clone(&used);
            async move {
                let tokens = used.lock().unwrap().pop().unwrap_or("0");
                (StatusCode::OK, [("x-tokens-used", tokens)]).into_response()
            }
        }),
    );
    let server = Server::start(app).await;
    let store = paused_store();
    let tokens = Policy::new(
        "tokens",
        Algorithm::TokenBucket,
        Quota::per_minute(1_000).unwrap(),
    )
    .unwrap();
    let mut client = OutboundLayer::builder(store.clone(), tokens.clone())
        .cost(|_, _, _| 100)
        .settle(|_, headers| headers.get("x-tokens-used")?.to_str().ok()?.parse().ok())
        .build()
        .unwrap()
        .layer(http_client());
    let key = format!("upstream:{}", server.addr());
    let remaining = || async {
        let peek = store
            .operate(key.as_bytes(), &[&tokens], Operation::Peek(0))
            .await
            .unwrap();
        peek[0].remaining()
    };
    send(&mut client, &server).await.unwrap();
    assert_eq!(
        remaining().await,
        1_000 - 250,
        "charged 150 more than the estimate"
    );
    send(&mut client, &server).await.unwrap();
    assert_eq!(
        remaining().await,
        1_000 - 250 - 40,
        "refunded 60 of the estimate"
    );
}

/// Tokens a second across a fleet, with estimates that run low: four clients sharing one
/// store, 16 tasks each, for 10 s against an API whose calls use 50 to 150 tokens (100 on
/// average) while the clients estimate 50. Each response settles the difference, and what
/// an empty budget cannot take is owed (`Operation::Charge`), so the tokens the upstream
/// reports used stay within the budget over the run — the refill, the capacity, and
/// what is owed at the end (here under a capacity) — and every second after the first
/// within the rate and one capacity; the fleet still uses at least 90% of the refill.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_token_budget_holds_fleet_wide_when_estimates_run_low() {
    use axum::response::IntoResponse;
    const PER_SECOND: u64 = 1_000;
    const SECONDS: u64 = 10;
    let reports = Arc::new(std::sync::Mutex::new(
        Vec::<(tokio::time::Instant, u64)>::new(),
    ));
    let seen = Arc::clone(&reports);
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(move || {
            let seen = Arc::clone(&seen);
            async move {
                let mut seen = seen.lock().unwrap();
                // 50 to 150, evenly spread: 100 on average.
                let used = 50 + (seen.len() as u64 * 37) % 101;
                seen.push((tokio::time::Instant::now(), used));
                (StatusCode::OK, [("x-tokens-used", used.to_string())]).into_response()
            }
        }),
    );
    let server = Arc::new(Server::start(app).await);
    let store = paused_store();
    let tokens = Policy::new(
        "tokens",
        Algorithm::TokenBucket,
        Quota::per_second(PER_SECOND).unwrap(),
    )
    .unwrap();
    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_secs(SECONDS);
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let client = OutboundLayer::builder(store.clone(), tokens.clone())
            .cost(|_, _, _| 50)
            .settle(|_, headers| headers.get("x-tokens-used")?.to_str().ok()?.parse().ok())
            .build()
            .unwrap()
            .layer(http_client());
        for _ in 0..16 {
            let (mut client, server) = (client.clone(), Arc::clone(&server));
            tasks.push(tokio::spawn(async move {
                while tokio::time::Instant::now() < deadline {
                    let response = send(&mut client, &server).await.unwrap();
                    assert_eq!(response.status(), StatusCode::OK);
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let ran = started.elapsed();
    let reports = reports.lock().unwrap().clone();
    let used: u64 = reports.iter().map(|&(_, used)| used).sum();
    let refill = (PER_SECOND as f64 * ran.as_secs_f64()) as u64;
    let mut per_second = vec![0u64; ran.as_secs() as usize + 1];
    for &(at, used) in &reports {
        per_second[(at - started).as_secs() as usize] += used;
    }
    println!(
        "{} calls used {used} tokens in {ran:?}: refill {refill}, capacity {PER_SECOND}; \
         by the second {per_second:?}",
        reports.len()
    );
    assert!(
        used <= refill + 2 * PER_SECOND,
        "used {used}, over the refill {refill} and twice the capacity"
    );
    assert!(
        used * 10 >= refill * 9,
        "used {used} of a refill of {refill}"
    );
    for (second, &used) in per_second.iter().enumerate().skip(1) {
        assert!(
            used <= 2 * PER_SECOND,
            "second {second}: {used} tokens, more than the rate and a capacity"
        );
    }
}

/// Two layers stacked, requests outside and tokens inside: a request the token limit
/// refuses was never sent, so the request layer gives its charge back. Requests whose
/// tokens fit go; the refused ones leave the request budget where it was.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stacked_layer_gives_its_charge_back_when_an_inner_limit_refuses() {
    let hits = Hits::default();
    let (server, _) = upstream(1_000, &hits).await;
    let store = paused_store();
    let requests =
        Policy::new("requests", Algorithm::Gcra, Quota::per_minute(10).unwrap()).unwrap();
    let tokens = Policy::new(
        "tokens",
        Algorithm::TokenBucket,
        Quota::per_minute(1_000).unwrap(),
    )
    .unwrap();
    let inner = OutboundLayer::builder(store.clone(), tokens.clone())
        .cost(|_, _, _| 400)
        .fail_fast()
        .build()
        .unwrap();
    let outer = OutboundLayer::builder(store.clone(), requests.clone())
        .fail_fast()
        .build()
        .unwrap();
    let mut client = outer.layer(inner.layer(http_client()));
    let key = format!("upstream:{}", server.addr());
    let left = |policy: Policy| {
        let (store, key) = (store.clone(), key.clone());
        async move {
            let peek = store.operate(key.as_bytes(), &[&policy], Operation::Peek(0));
            peek.await.unwrap()[0].remaining()
        }
    };
    for _ in 0..2 {
        send(&mut client, &server).await.unwrap();
    }
    assert_eq!(left(requests.clone()).await, 8);
    // 200 tokens left: the next three are refused by the token limit, inside.
    for _ in 0..3 {
        let refused = send(&mut client, &server).await.unwrap_err();
        assert!(matches!(
            refused.downcast_ref::<OutboundError>(),
            Some(OutboundError::Limited { .. })
        ));
    }
    assert_eq!(
        left(requests).await,
        8,
        "refused inside: no request unit kept"
    );
    assert_eq!(left(tokens).await, 200);
    assert_eq!(
        hits.get(),
        2,
        "the refused requests never reached the upstream"
    );
}
