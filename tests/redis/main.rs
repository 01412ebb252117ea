//! The Redis store against one real `redis-server`: the store suites (the script decides
//! exactly like the Rust functions, atomically across gateways, survives `SCRIPT FLUSH`;
//! keys expire, include the quota, and cannot be steered), and what only one server shows
//! (a restart, a deadpool pool, a connection manager of your own, a request's script
//! calls counted, the deny cache's savings, the kinds of failure).
//!
//! The suites share this binary's server, each under key prefixes of its own; the tests
//! that count a server's calls, pause it or restart it start their own.

#![allow(clippy::unwrap_used)]

mod operations;

use std::time::Duration;

use redis::AsyncCommands;
use support::stores::EPOCH_US;
use support::suites::{self, Target, builder};
use support::{CheckOne, RedisServer, script_calls, shared_server};
use tollway_core::{Algorithm, Decision, ManualClock, Policy, Quota, RedisStore, StoreErrorKind};

fn shared() -> Target {
    Target::Server(shared_server().url())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_decides_exactly_like_the_rust_functions() {
    suites::conformance(&shared(), 10_000).await;
}

/// Server-time mode (the default): every script call reads Redis's `TIME`, and the Rust
/// functions fed the time it read decide the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_servers_clock_the_script_decides_exactly_like_the_rust_functions() {
    suites::conformance_server_time(&shared(), 400).await;
}

/// Two gateways in caller-time mode whose clocks are 500 ms apart decide differently from
/// two whose clocks agree — by a few requests, and exactly as the Rust functions do fed
/// each gateway's own time; in server-time mode every decision is the one the model makes
/// at the time Redis read, so skew between gateways cannot move it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_skew_moves_caller_time_decisions_and_server_time_removes_it() {
    let (rows, _) = suites::clock_skew(&shared()).await;
    for (algorithm, skewed, agreed) in &rows {
        println!("{algorithm:?}: clocks 500 ms apart admitted {skewed}, clocks agreeing {agreed}");
    }
    // 600 requests over 3 s at 10 per second, as measured. The buckets, GCRA and the
    // fixed window admit one more: the gateway ahead sees refill (or a window) the other
    // has not yet. The log admits 5 more: the slow gateway's entries slide out half a
    // second early for the fast one. The counter admits 5 fewer: the fast gateway's
    // window is the current one for both, and the slow one weighs the previous window
    // from its very start. (Before windows were made to take a later stored window as
    // the current one, each gateway started the other's window afresh: the fixed window
    // admitted 324, the counter 321.)
    let admitted: Vec<(u64, u64)> = rows.iter().map(|&(_, s, a)| (s, a)).collect();
    assert_eq!(
        admitted,
        [
            (40, 39),
            (40, 39),
            (40, 39),
            (41, 40),
            (35, 30),
            (30, 35),
            (40, 39)
        ],
        "{rows:?}"
    );
}

/// What skew costs in caller-time mode at its worst. A gateway 250 ms behind and one
/// 250 ms ahead each send a burst 100 ms before a window's end (true time), 300 a second:
/// - the fixed window: the one behind fills the window that ends; the one ahead is
///   already in the next window and fills that. 600, two windows at once.
/// - a bucket or GCRA: the one ahead sees the refill of its lead, the skew times the
///   rate. 450 (GCRA 449).
/// - the sliding counter: the one ahead weighs the full previous window less 150 ms of
///   it. 345.
/// - the sliding log: entries written 500 ms "early" are still in the one ahead's
///   window. 300.
///
/// With clocks that agree, 300 each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skewed_caller_clocks_admit_up_to_a_window_more_at_a_windows_end() {
    const SKEW: u64 = 500_000;
    let end = EPOCH_US + 10_000_000;
    let url = shared_server().url();
    let cases = [
        (Algorithm::FixedWindow, 600),
        (Algorithm::Gcra, 449),
        (Algorithm::TokenBucket, 450),
        (Algorithm::SlidingWindowCounter, 345),
        (Algorithm::SlidingWindowLog, 300),
    ];
    for (algorithm, skewed) in cases {
        let mut quota = Quota::per_second(300).unwrap();
        if algorithm.uses_burst() {
            quota = quota.with_burst(300).unwrap();
        }
        let policy = Policy::new("skew", algorithm, quota).unwrap();
        for (apart, expected) in [(SKEW, skewed), (0, 300)] {
            let behind = ManualClock::at_micros(end - 100_000 - apart / 2);
            let ahead = ManualClock::at_micros(end - 100_000 + apart / 2);
            let prefix = support::unique_prefix("skew");
            let mut admitted = 0;
            for clock in [&behind, &ahead] {
                let store = builder(clock)
                    .prefix(prefix.clone())
                    .connect(&url)
                    .await
                    .unwrap();
                for _ in 0..400 {
                    let decision = store.check_one(b"burst", &policy, 1).await.unwrap();
                    admitted += u64::from(decision.is_allowed());
                }
            }
            println!("{algorithm:?}: clocks {apart} µs apart admitted {admitted} of 300");
            assert_eq!(admitted, expected, "{algorithm:?}, clocks {apart} µs apart");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_several_limits_decide_exactly_like_the_memory_store() {
    suites::conformance_multi(&shared(), 5_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_and_66_tasks_never_admit_more_than_the_model() {
    suites::atomicity(&shared()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scripts_loans_are_the_memory_stores() {
    suites::lend_conformance(&shared(), 5_000).await;
}

/// Server-time mode: a loan reads Redis's `TIME`, and the memory store fed the time it
/// read lends the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_servers_clock_the_scripts_loans_are_the_memory_stores() {
    suites::lend_conformance_server_time(&shared(), 300).await;
}

/// A shared policy's ledger: the script's shares are the memory store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scripts_shares_are_the_memory_stores() {
    suites::share_conformance(&shared(), 3_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_leasing_gateways_and_66_tasks_never_admit_more_than_the_capacity() {
    suites::leased_atomicity(&shared()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_survive_script_flush() {
    suites::script_flush(&shared()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expire_when_their_state_is_fresh_again() {
    suites::expiry(&shared()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_keys_cannot_choose_their_slot_or_bloat_redis() {
    suites::hostile_keys(&shared()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_limit_keeps_what_callers_used() {
    suites::a_changed_limit_keeps_usage(&shared()).await;
}

/// Counts the server's `EVALSHA`s: a server of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_three_limits_is_one_script_call() {
    let server = RedisServer::start();
    let mut node = server.connection().await;
    suites::one_round_trip(&Target::Server(server.url()), &mut node).await;
}

/// A redis-rs `ConnectionManager` of the application's own (one it already uses, say)
/// carries the store's script calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_manager_of_your_own_is_accepted_and_decides() {
    let client = redis::Client::open(shared_server().url()).unwrap();
    let manager = redis::aio::ConnectionManager::new(client).await.unwrap();
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = support::redis_store()
        .without_local_fallback()
        .timeout(Duration::from_secs(30))
        .caller_time(clock.clone())
        .prefix(support::unique_prefix("manager"))
        .with_connection_manager(manager)
        .unwrap();
    let policy = Policy::new("manager", Algorithm::Gcra, Quota::per_minute(2).unwrap()).unwrap();
    admits_two_then_waits(&store, &policy, Duration::from_secs(30)).await;
}

/// `store` admits two calls of `policy` (2 a minute) and tells the third to wait `retry`.
async fn admits_two_then_waits(store: &RedisStore, policy: &Policy, retry: Duration) {
    for _ in 0..2 {
        assert!(store.check_one(b"k", policy, 1).await.unwrap().is_allowed());
    }
    let third = store.check_one(b"k", policy, 1).await.unwrap();
    assert_eq!(third.retry_after(), Some(retry));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadpool_pool_is_accepted_and_decides_the_same() {
    let pool = deadpool_redis::Config::from_url(shared_server().url())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let clock = ManualClock::at_micros(EPOCH_US);
    let pooled = support::redis_store()
        .without_local_fallback()
        .timeout(Duration::from_secs(30))
        .caller_time(clock.clone())
        .prefix(support::unique_prefix("pool"))
        .with_pool(pool)
        .unwrap();
    let policy = Policy::new(
        "pool",
        Algorithm::SlidingWindowLog,
        Quota::per_minute(2).unwrap(),
    )
    .unwrap();
    admits_two_then_waits(&pooled, &policy, Duration::from_secs(60)).await;
}

/// Restarts its server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_go_on_after_a_restart_from_an_empty_server() {
    let mut server = RedisServer::start();
    let store = support::redis_store()
        .without_local_fallback()
        .timeout(Duration::from_secs(5))
        .connect(&server.url())
        .await
        .unwrap();
    let policy = Policy::new(
        "restart",
        Algorithm::TokenBucket,
        Quota::per_minute(10).unwrap(),
    )
    .unwrap();
    assert_eq!(
        store.check_one(b"k", &policy, 1).await.unwrap().remaining(),
        9
    );
    assert_eq!(
        store.check_one(b"k", &policy, 1).await.unwrap().remaining(),
        8
    );
    server.restart();
    let after_restart = store.check_one(b"k", &policy, 1).await.unwrap();
    assert!(after_restart.is_allowed());
    assert_eq!(
        after_restart.remaining(),
        9,
        "a restarted server starts empty"
    );
}

/// Kills its server. The store's timeout is 300 ms; the bound, 5 s, is what a loaded
/// machine always meets while a hang would not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_is_an_error_within_the_timeout_not_a_hang() {
    let mut server = RedisServer::start();
    let store = support::redis_store()
        .without_local_fallback()
        .timeout(Duration::from_millis(300))
        .connect(&server.url())
        .await
        .unwrap();
    server.kill();
    let policy = Policy::new("dead", Algorithm::Gcra, Quota::per_second(1).unwrap()).unwrap();
    let err = support::within("a decision from a dead server", 5, async {
        store.check_one(b"k", &policy, 1).await.unwrap_err()
    })
    .await;
    assert!(
        matches!(
            err.kind(),
            StoreErrorKind::Connection | StoreErrorKind::Timeout
        ),
        "{:?}: {err}",
        err.kind()
    );
}

/// Pauses its server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_is_a_timeout_and_a_bad_reply_a_script_error() {
    let server = RedisServer::start();
    let store = support::redis_store()
        .without_local_fallback()
        .timeout(Duration::from_millis(200))
        .prefix("kinds")
        .connect(&server.url())
        .await
        .unwrap();
    let policy = Policy::new("kinds", Algorithm::Gcra, Quota::per_second(1).unwrap()).unwrap();
    let mut admin = server.connection().await;
    // Another tollway's state under the same key: not a decision's shape.
    let key = store.state_key(b"k", &policy);
    let _: () = admin.set(&key, "not a state").await.unwrap();
    let err = store.check_one(b"k", &policy, 1).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Script, "{err}");

    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(2_000)
        .query_async(&mut admin)
        .await
        .unwrap();
    let err = store.check_one(b"other", &policy, 1).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Timeout, "{err}");
}

/// One key floods two nodes (two stores, each on its own connection) with 10,000
/// unit-cost requests, a 100 µs step of a shared manual clock apart: a second in all,
/// three retry periods of a 3-per-second token bucket. Returns every decision and the
/// script calls it cost the server.
async fn flood(server: &RedisServer, cache: bool) -> (Vec<Decision>, u64) {
    let clock = ManualClock::at_micros(EPOCH_US);
    let prefix = support::unique_prefix("flood");
    let mut nodes = Vec::new();
    for _ in 0..2 {
        let node = builder(&clock).prefix(prefix.clone());
        let node = if cache { node } else { node.deny_cache(0) };
        nodes.push(node.connect(&server.url()).await.unwrap());
    }
    let policy = Policy::new(
        "flood",
        Algorithm::TokenBucket,
        Quota::per_second(3).unwrap(),
    )
    .unwrap();
    let mut admin = server.connection().await;
    let before = script_calls(&mut admin).await;
    let mut decisions = Vec::with_capacity(10_000);
    for i in 0..10_000 {
        decisions.push(
            nodes[i % 2]
                .check_one(b"flooder", &policy, 1)
                .await
                .unwrap(),
        );
        clock.advance(Duration::from_micros(100));
    }
    let after = script_calls(&mut admin).await;
    (decisions, after - before)
}

/// Counts the server's script calls: a server of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deny_cache_answers_a_flood_locally_exactly_as_redis_would() {
    let server = RedisServer::start();
    let (uncached, calls_without) = flood(&server, false).await;
    let (cached, calls_with) = flood(&server, true).await;
    println!(
        "10,000 requests from one key through two nodes: {calls_without} script calls \
         without the deny cache, {calls_with} with it"
    );
    // The trace spans three retry periods: the bucket admits 3 at once, then one more
    // at 333 ms and at 667 ms.
    let allowed = uncached.iter().filter(|d| d.is_allowed()).count();
    assert_eq!(allowed, 5);
    // Field by field, the same answers.
    if let Some(i) = (0..uncached.len()).find(|&i| cached[i] != uncached[i]) {
        panic!(
            "request {i}: Redis said {:?}, the deny cache {:?}",
            uncached[i], cached[i]
        );
    }
    // Every request reached Redis without the cache (plus the one NOSCRIPT that loaded
    // the script on the fresh server); with it, a handful did.
    assert_eq!(calls_without, 10_001);
    assert!(calls_with <= 20, "{calls_with} script calls with the cache");
}

/// A bad breaker or fallback setting fails before anything connects, and says what to
/// write instead.
#[tokio::test]
async fn bad_breaker_and_fallback_settings_fail_before_connecting() {
    for (builder, says) in [
        (support::redis_store().local_fallback(0.0), "use 1/N"),
        (support::redis_store().local_fallback(1.5), "use 1/N"),
        (
            support::redis_store().breaker(0, Duration::from_millis(250)),
            "at least 1 failure",
        ),
    ] {
        // Nothing listens on port 1: an answer in these words comes from validation.
        let error = builder.connect("redis://127.0.0.1:1").await.unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Other, "{error}");
        assert!(error.to_string().contains(says), "{error}");
    }
}

/// A limits file's `leases` make the store a leasing one: 2,000 requests of one caller
/// through the layer, at a tenth of its limit, cost Redis a few loans rather than a
/// script call each; a cold caller still costs one call a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limits_files_leases_decide_a_hot_caller_here() {
    use tollway_tower::config::LimitsFile;
    use tower::{Service, ServiceExt};

    let server = RedisServer::start();
    let text = format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\nstall_after_ms = 1000\nleases = {{ min_units = 4 }}\n\n\
         [layer]\ndefault = \"api\"\n\n\
         [policies.api]\nalgorithm = \"gcra\"\nlimit = 20_000\nperiod = \"1s\"\n",
        server.url()
    );
    let file = LimitsFile::parse("limits.toml", &text).unwrap();
    let layer = file
        .layer(file.store().await.unwrap(), file.key().unwrap())
        .unwrap();
    let mut service =
        tower::ServiceBuilder::new()
            .layer(layer)
            .service_fn(|_: http::Request<()>| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(()))
            });
    let mut node = server.connection().await;
    let request = |peer: &str| {
        let mut request = http::Request::new(());
        request
            .extensions_mut()
            .insert(peer.parse::<std::net::SocketAddr>().unwrap());
        request
    };
    let before = script_calls(&mut node).await;
    for _ in 0..2_000 {
        let response = service
            .ready()
            .await
            .unwrap()
            .call(request("203.0.113.7:4000"))
            .await;
        assert_eq!(response.unwrap().status(), 200);
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    let hot = script_calls(&mut node).await - before;
    println!("a hot caller: {hot} script calls for 2,000 requests");
    assert!(hot <= 200, "{hot} script calls for 2,000 requests");
    let before = script_calls(&mut node).await;
    for i in 0..50 {
        let peer = format!("198.51.100.{i}:4000");
        let response = service.ready().await.unwrap().call(request(&peer)).await;
        assert_eq!(response.unwrap().status(), 200);
    }
    assert_eq!(
        script_calls(&mut node).await - before,
        50,
        "a cold caller, one call each"
    );
}

/// Calls in flight: three gateways count one caller's slots together; one that stops
/// renewing loses its slots a period later, and the others keep theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_share_slots_and_a_silent_gateway_loses_its_own() {
    suites::concurrency_across_gateways(&shared()).await;
}

/// Three gateways, 3 × 64 callers at once: never more than the 5 slots' calls inside
/// the handler, counted by the handler itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_never_have_more_calls_inside_than_the_slots() {
    let ((admitted, refused, most), _) = suites::in_flight_across_gateways(&shared()).await;
    println!("admitted {admitted}, refused {refused}, at most {most} inside at once");
}
