//! A request over the limit waits its turn; dropped while waiting, it charges nothing;
//! what fails instead of waiting is a typed error.

use super::*;

/// A request waiting for the limit that is dropped (a timeout around it, a caller gone)
/// charges nothing: after the refill the budget is whole again, and the next request
/// goes at once.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_waiting_request_dropped_consumes_nothing() {
    let hits = Hits::default();
    let (server, _) = upstream(1_000, &hits).await;
    let store = paused_store();
    let policy = Policy::new(
        "one-a-second",
        Algorithm::TokenBucket,
        Quota::per_second(1).unwrap(),
    )
    .unwrap();
    let layer = OutboundLayer::builder(store.clone(), policy.clone())
        .build()
        .unwrap();
    let mut client = layer.layer(http_client());

    let response = send(&mut client, &server).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // The second waits about a second: give up after 300 ms.
    let waiting = client.ready().await.unwrap().call(get(&server));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), waiting)
            .await
            .is_err()
    );
    tokio::time::advance(Duration::from_millis(700)).await;

    // The default key: the upstream's authority.
    let key = format!("upstream:{}", server.addr());
    let peek_upstream = store
        .operate(key.as_bytes(), &[&policy], Operation::Peek(0))
        .await
        .unwrap();
    assert_eq!(
        peek_upstream[0].remaining(),
        1,
        "the dropped request was charged"
    );
    let before = tokio::time::Instant::now();
    let response = send(&mut client, &server).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(before.elapsed(), Duration::ZERO);
    assert_eq!(hits.get(), 2);
}

/// What fails instead of waiting: `fail_fast`, a wait longer than `max_wait`, a cost the
/// limit can never hold; and a request without a key is not limited at all. A jitter
/// outside 0..=1 fails when the layer is built.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn refusals_are_typed_errors_and_a_request_without_a_key_is_not_limited() {
    let hits = Hits::default();
    let (server, _) = upstream(1_000, &hits).await;
    let store = paused_store();
    let policy = Policy::new(
        "two-a-minute",
        Algorithm::Gcra,
        Quota::per_minute(2).unwrap(),
    )
    .unwrap();
    let build = |b: tollway_tower::outbound::OutboundLayerBuilder<MemoryStore<TokioClock>>| {
        b.build().unwrap().layer(http_client())
    };
    let no_key = |_: &Request<Empty<Bytes>>| None::<Key>;
    let mut waiting = build(
        OutboundLayer::builder(store.clone(), policy.clone()).max_wait(Duration::from_secs(10)),
    );
    let mut failing = build(OutboundLayer::builder(store.clone(), policy.clone()).fail_fast());
    let mut weighted =
        build(OutboundLayer::builder(store.clone(), policy.clone()).cost(|_, _, _| 3));
    let mut unkeyed = OutboundLayer::builder(store.clone(), policy.clone())
        .key(no_key)
        .build()
        .unwrap()
        .layer(http_client());

    for _ in 0..2 {
        let response = send(&mut waiting, &server).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let limited = |e: Box<dyn std::error::Error + Send + Sync>| match e.downcast::<OutboundError>()
    {
        Ok(e) => *e,
        Err(other) => panic!("not the limiter's error: {other}"),
    };
    // The next unit comes in 30 s: failing at once, and past a 10 s wait.
    let before = tokio::time::Instant::now();
    let e = limited(send(&mut failing, &server).await.unwrap_err());
    assert!(
        matches!(e, OutboundError::Limited { retry_after } if retry_after == Duration::from_secs(30)),
        "{e:?}"
    );
    let e = limited(send(&mut waiting, &server).await.unwrap_err());
    assert!(matches!(e, OutboundError::Limited { .. }), "{e:?}");
    assert_eq!(
        before.elapsed(),
        Duration::ZERO,
        "no wait when it cannot end in time"
    );
    let e = limited(send(&mut weighted, &server).await.unwrap_err());
    assert!(matches!(e, OutboundError::CostExceedsCapacity), "{e:?}");
    // No key: through, whatever the budget.
    for _ in 0..3 {
        let response = send(&mut unkeyed, &server).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(hits.get(), 5);

    let err = OutboundLayer::builder(store, policy)
        .jitter(1.5)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("jitter"), "{err}");
}

/// A request over the limit waits the retry time (and at most 10% more), then goes.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_over_the_limit_waits_its_turn_then_goes() {
    let hits = Hits::default();
    let (server, _) = upstream(1_000, &hits).await;
    let store = paused_store();
    let policy = Policy::new(
        "one-a-second",
        Algorithm::Gcra,
        Quota::per_second(1).unwrap(),
    )
    .unwrap();
    let mut client = OutboundLayer::builder(store, policy)
        .build()
        .unwrap()
        .layer(http_client());
    let started = tokio::time::Instant::now();
    for n in 0..4u32 {
        let response = send(&mut client, &server).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let elapsed = started.elapsed();
        // Request n goes n seconds in, give or take the jitter of the waits before it.
        assert!(
            elapsed >= Duration::from_secs(u64::from(n)),
            "{n}: {elapsed:?}"
        );
        assert!(
            elapsed <= Duration::from_secs(u64::from(n)).mul_f64(1.1),
            "{n}: {elapsed:?}"
        );
    }
    assert_eq!(hits.get(), 4);
}
