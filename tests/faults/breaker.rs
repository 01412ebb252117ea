//! The breaker's probe, abandoned.

use super::*;

/// Regression: a probe whose caller gives up (a client disconnects, an outer timeout
/// fires: the future is dropped) once left the breaker half-open for good, every later
/// call skipping Redis although it had come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_probe_does_not_leave_the_breaker_half_open() {
    let server = RedisServer::start();
    let redis = unguarded().connect(&server.url()).await.unwrap();
    // The breaker's cool-down runs on a manual clock: the test moves it, never waits.
    let clock = ManualClock::new();
    let store = CircuitBreaker::builder(redis)
        .threshold(1)
        .cool_down(COOL_DOWN)
        .clock(clock.clone())
        .build()
        .unwrap();
    let policy = Policy::new("probe", Algorithm::Gcra, Quota::per_second(100).unwrap()).unwrap();
    assert!(store.check_one(b"k", &policy, 1).await.is_ok());

    // Scripts wait (writes are paused) while the admin connection still works.
    let mut admin = server.connection().await;
    support::redis::pause_writes(&mut admin).await;
    assert!(store.check_one(b"k", &policy, 1).await.is_err());
    assert_eq!(store.state(), BreakerState::Open);
    // While open, calls skip Redis; after the cool-down the next call is the probe, and
    // its caller abandons it.
    assert!(store.check_one(b"k", &policy, 1).await.is_err());
    assert_eq!(store.state(), BreakerState::Open);
    clock.advance(COOL_DOWN);
    let mut probe = Box::pin(store.check_one(b"k", &policy, 1));
    assert_eq!(store.state(), BreakerState::HalfOpen);
    // Polled once (its call goes out), then dropped: Redis, paused, cannot have answered.
    assert!(
        futures_util::poll!(probe.as_mut()).is_pending(),
        "the probe cannot answer while Redis is paused"
    );
    drop(probe);
    support::redis::unpause(&mut admin).await;
    // Redis answers again: the next call probes it and closes the breaker.
    let answer = store.check_one(b"k", &policy, 1).await;
    assert!(
        answer.is_ok(),
        "still {:?} after Redis came back: {answer:?}",
        store.state()
    );
    assert_eq!(store.state(), BreakerState::Closed);
}
