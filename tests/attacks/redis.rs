//! Attacks on the Redis store: a large sliding log, its state lost, Redis stalled.

use std::net::Ipv4Addr;
use std::time::Duration;

use axum::http::StatusCode;
use support::CheckOne;
use support::http::{Hits, Reply, serve};
use support::redis::{RedisServer, shared_server, unique_prefix};
use support::stores::{EPOCH_US, per_minute};
use tollway_core::{Algorithm, BreakerState, ManualClock, Policy, Quota};
use tollway_tower::{Key, OnStoreError, RateLimitLayer};

use super::admitted;

/// A sliding window log of `limit` a minute.
fn log_of(limit: u32) -> Policy {
    Policy::new(
        "log",
        Algorithm::SlidingWindowLog,
        Quota::per_minute(limit.into()).unwrap(),
    )
    .unwrap()
}

/// Finding 6: a denial read the whole sliding log (milliseconds of Redis at 10,000
/// entries), so a few callers pushed every call past the timeout, and the store error
/// let their requests through: 865 extra in 50 s. A decision is a few O(log n)
/// sorted-set commands now, and larger logs are refused when the policy is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_10_000_entry_sliding_log_cannot_be_pushed_into_failing_open() {
    let error = Policy::new(
        "log",
        Algorithm::SlidingWindowLog,
        Quota::per_minute(10_001).unwrap(),
    )
    .unwrap_err();
    assert!(error.to_string().contains("at most 10000"), "{error}");

    let clock = ManualClock::at_micros(EPOCH_US);
    // The default timeout (100 ms), and nothing in front of Redis to absorb the attack:
    // every denial is a script call, and a call that times out lets its request through.
    let store = support::redis_store()
        .deny_cache(0)
        .without_breaker()
        .without_local_fallback()
        .timeout(Duration::from_secs(30))
        .prefix(unique_prefix("attack-log"))
        .caller_time(clock.clone())
        .connect(&shared_server().url())
        .await
        .unwrap();
    let policy = log_of(10_000);

    // The caller's log fills with 10,000 unit requests (straight to the store: the
    // attack is on the denials).
    let caller = Key::ip(Ipv4Addr::LOCALHOST.into(), 64);
    let fills = (0..16).map(|_| {
        let (store, policy, caller) = (store.clone(), policy.clone(), caller.clone());
        tokio::spawn(async move {
            for _ in 0..625 {
                let decision = store
                    .check_one(caller.as_bytes(), &policy, 1)
                    .await
                    .unwrap();
                assert!(decision.is_allowed());
            }
        })
    });
    for fill in fills.collect::<Vec<_>>() {
        fill.await.unwrap();
    }

    let layer = RateLimitLayer::builder(store, policy)
        .on_store_error(OnStoreError::Allow)
        .wall_clock(clock)
        .build()
        .unwrap();
    let hits = Hits::default();
    let server = serve(layer, &hits).await;
    // 128 callers at once, five requests each: every one a denial decided on the full
    // log, and none may time out into a pass.
    let attackers = (0..128).map(|_| {
        let client = server.client();
        tokio::spawn(async move {
            let mut replies = Vec::new();
            for _ in 0..5 {
                replies.push(client.get("/").await);
            }
            replies
        })
    });
    let mut replies: Vec<Reply> = Vec::new();
    for attacker in attackers.collect::<Vec<_>>() {
        replies.extend(attacker.await.unwrap());
    }
    assert_eq!(replies.len(), 640);
    assert_eq!(admitted(&replies), 0, "a denial timed out and failed open");
    assert_eq!(hits.get(), 0);
}

/// Finding 7: a sliding log was two Redis keys, and losing one (evicted, deleted) broke
/// the limit: `:log` lost let 20 of 20 through, `:meta` lost admitted 10 against 5. It is
/// one key now, so there is no half to lose: losing it is a fresh start, and the limit
/// holds from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_sliding_logs_state_in_redis_starts_it_afresh() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let prefix = unique_prefix("attack-evict");
    // No deny cache: it would go on refusing locally what Redis no longer remembers.
    let store = support::redis_store()
        .without_local_fallback()
        .deny_cache(0)
        .timeout(Duration::from_secs(5))
        .prefix(prefix.clone())
        .caller_time(clock.clone())
        .connect(&shared_server().url())
        .await
        .unwrap();
    let layer = RateLimitLayer::builder(store, log_of(5))
        .wall_clock(clock)
        .build()
        .unwrap();
    let hits = Hits::default();
    let server = serve(layer, &hits).await;
    let client = server.client();
    let mut redis = shared_server().connection().await;

    let mut replies = Vec::new();
    for _ in 0..8 {
        replies.push(client.get("/").await);
    }
    assert_eq!(admitted(&replies), 5);

    // The caller's whole state is one key; Redis evicts it.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let deleted: u32 = redis::cmd("DEL")
        .arg(&keys)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(deleted, 1);

    let mut replies = Vec::new();
    for _ in 0..20 {
        replies.push(client.get("/").await);
    }
    assert_eq!(admitted(&replies), 5, "a fresh log of 5, then the limit");
    assert_eq!(hits.get(), 10);
}

/// Finding 12: with Redis paused, every request waited the full timeout, and once the
/// deny cache expired an over-limit caller passed (20 of 20), since the store had no
/// breaker and a store error let requests through. A Redis store has both by default
/// now: the calls that find the breaker closed wait until the stall is detected (no
/// reply for 20 ms), five failures open it,
/// and from then on the local fallback decides without calling Redis — this node's
/// share of the quota (by default all of it), neither open nor closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_redis_neither_stalls_requests_nor_lifts_the_limit() {
    let server = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    // The defaults (100 ms timeout, 5 failures open the breaker, a local fallback), but
    // a cool-down longer than the test: no probe of Redis comes between the requests,
    // so which of them call Redis follows from the breaker's state alone.
    // The default stall watch (20 ms): the fallback's refill, on the real clock, stays
    // under a unit while five calls wait for it.
    let store = support::redis_store()
        .stall_after(Duration::from_millis(20))
        .breaker(5, Duration::from_secs(3_600))
        .caller_time(clock.clone())
        .connect(&server.url())
        .await
        .unwrap();
    let layer = RateLimitLayer::builder(store.clone(), per_minute("per-caller", 20))
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let hits = Hits::default();
    let app = serve(layer, &hits).await;
    let client = app.client();

    // The caller spends its 20 in Redis.
    let mut replies = Vec::new();
    for _ in 0..25 {
        replies.push(client.get("/").await);
    }
    assert_eq!(admitted(&replies), 20);

    // Redis stalls: scripts wait, the admin connection still works.
    let mut admin = server.connection().await;
    support::redis::pause_writes(&mut admin).await;
    // The deny cache answered the refusals so far without Redis; its entries expire when
    // the caller could retry (one unit refills in 3 s), and from then on every request
    // needs Redis.
    clock.advance(Duration::from_secs(3));
    let mut replies = Vec::new();
    // How many requests were sent while the breaker was closed: each of those waited
    // for the stall to be detected, every later one was answered in memory.
    let mut sent_to_redis = 0;
    for _ in 0..100 {
        if store.breaker_state() == BreakerState::Closed {
            sent_to_redis += 1;
        }
        replies.push(client.get("/").await);
    }
    support::redis::unpause(&mut admin).await;

    assert_eq!(sent_to_redis, 5, "five failures open the breaker");
    assert_eq!(
        store.breaker_state(),
        BreakerState::Open,
        "the breaker opened"
    );
    // The fallback decided: at most this node's share (all 20) more, not 100.
    assert!(
        admitted(&replies) <= 20,
        "{} of 100 passed",
        admitted(&replies)
    );
    assert!(
        replies
            .iter()
            .all(|r| r.status == StatusCode::OK || r.status == StatusCode::TOO_MANY_REQUESTS),
        "every answer is a decision"
    );
}
