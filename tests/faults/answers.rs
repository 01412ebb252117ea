//! What an HTTP and a gRPC server answer while their Redis is dead.

use super::*;

/// With its Redis killed, a layer answers as configured and promptly: fail open lets the
/// request through without rate-limit headers, fail closed answers 503 with a JSON body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_gets_the_configured_http_answer() {
    let mut redis = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = support::redis_store()
        .without_local_fallback()
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
    let open_server = web::serve(open, &open_hits).await;
    let closed_server = web::serve(closed, &closed_hits).await;
    let (open, closed) = (open_server.client(), closed_server.client());

    // While Redis is up, both limit as usual.
    for client in [&open, &closed] {
        let reply = within("a request", 5, client.get("/")).await;
        web::assert_ok(&reply);
        web::assert_limits(&reply, 10, 9, EPOCH_S + 6);
    }

    redis.kill();
    for _ in 0..3 {
        let reply = within("the fail-open request", 5, open.get("/")).await;
        web::assert_ok(&reply);
        web::assert_no_limit_headers(&reply);

        let reply = within("the fail-closed request", 5, closed.get("/")).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:#?}");
        assert_eq!(reply.header("content-type"), Some("application/json"));
        assert_eq!(
            reply.body,
            r#"{"error":"Service Unavailable","message":"Rate limiting is unavailable. Please retry later."}"#
        );
        web::assert_no_limit_headers(&reply);
    }
    assert_eq!(open_hits.get(), 1 + 3);
    assert_eq!(closed_hits.get(), 1);
}

/// With its Redis killed, a layer answers as configured and promptly: fail closed is
/// `UNAVAILABLE` (not `RESOURCE_EXHAUSTED`: the caller did nothing wrong), fail open lets
/// the call through without rate-limit metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_gets_the_configured_grpc_answer() {
    let mut redis = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = support::redis_store()
        .without_local_fallback()
        .timeout(Duration::from_millis(250))
        .caller_time(clock.clone())
        .connect(&redis.url())
        .await
        .unwrap();
    let catalog = Catalog::new();
    let closed = RateLimitLayer::builder(store.clone(), per_minute("fail-closed", 10))
        .on_store_error(OnStoreError::Reject)
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let open = RateLimitLayer::builder(store, per_minute("fail-open", 10))
        .on_store_error(OnStoreError::Allow)
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let closed_server = grpc::serve(closed, &catalog).await;
    let open_server = grpc::serve(open, &catalog).await;
    let mut closed = closed_server.client().await;
    let mut open = open_server.client().await;

    // While Redis is up, both limit as usual.
    for client in [&mut closed, &mut open] {
        let reply = grpc::lookup(client, None).await;
        grpc::assert_limits(grpc::assert_found(&reply), 10, 9, EPOCH_S + 6);
    }

    redis.kill();
    for _ in 0..3 {
        let status = grpc::lookup(&mut closed, None).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert_eq!(
            status.message(),
            "Rate limiting is unavailable. Please retry later."
        );
        assert!(
            status.get_error_details().retry_info().is_none(),
            "{status:?}"
        );
        grpc::assert_no_limits(status.metadata());

        let reply = grpc::lookup(&mut open, None).await;
        grpc::assert_no_limits(grpc::assert_found(&reply));
    }
    assert_eq!(catalog.lookups(), 2 + 3);
}
