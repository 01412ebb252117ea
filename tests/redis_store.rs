//! The Redis store against real `redis-server` processes: the Lua scripts decide exactly
//! like the Rust functions, atomically across gateways, and survive NOSCRIPT and restarts.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::AsyncCommands;
use support::{RedisServer, Rng};
use tollgate_core::{
    Algorithm, Decision, ManualClock, MemoryStore, Policy, Quota, RedisStore, Store,
};

/// About the Unix epoch in microseconds today: large numbers, as Redis TIME gives.
const EPOCH_US: u64 = 1_764_480_000_000_000;

async fn store(server: &RedisServer, clock: &ManualClock) -> RedisStore {
    RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .caller_time(clock.clone())
        .connect(&server.url())
        .await
        .unwrap()
}

/// Quotas that exercise uneven rates, short and long periods, bursts above and below the
/// limit.
fn quotas(algorithm: Algorithm) -> Vec<Quota> {
    let specs: [(u32, u64, u32); 5] = [
        (7, 3_000_000, 11),
        (100, 60_000_000, 100),
        (3, 1_000_000, 2),
        (50, 1_000, 64),
        (1, 86_400_000_000, 1),
    ];
    specs
        .iter()
        .map(|&(limit, period_us, burst)| {
            let q = Quota::with_period(limit, Duration::from_micros(period_us)).unwrap();
            if algorithm.uses_burst() {
                q.with_burst(burst).unwrap()
            } else {
                q
            }
        })
        .collect()
}

/// The next time gap: often none, often tiny, sometimes exactly to a period boundary,
/// sometimes a long idle stretch.
fn gap(rng: &mut Rng, now: u64, quota: &Quota) -> u64 {
    let period = quota.period_micros();
    match rng.below(10) {
        0..=2 => 0,
        3..=4 => rng.below(quota.emission_micros() * 2) + 1,
        5 => period - now % period, // exactly on the next boundary
        6 => (period - now % period).saturating_sub(1).max(1), // one tick before it
        7 => quota.emission_micros(),
        8 => rng.below(period) + 1,
        _ => period * (1 + rng.below(20)), // long idle
    }
}

fn cost(rng: &mut Rng, quota: &Quota, algorithm: Algorithm) -> u32 {
    let cap = if algorithm.uses_burst() {
        quota.burst()
    } else {
        quota.limit()
    };
    let c = match rng.below(10) {
        0..=5 => 1,
        6 => 0,
        7 => cap + 1,
        _ => 1 + rng.below(cap),
    };
    u32::try_from(c).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_scripts_decide_exactly_like_the_rust_functions() {
    const EVENTS: usize = 10_000;
    let server = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let redis = store(&server, &clock).await;
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let mut rng = Rng(0x7011_6a7e);
    for algorithm in Algorithm::ALL {
        let quotas = quotas(algorithm);
        let mut counts = [0u64; 3];
        for i in 0..EVENTS {
            // A new policy (and so a new key) every 2,000 events, cycling the quotas.
            let quota = quotas[(i / 2_000) % quotas.len()];
            let policy = Policy::new(format!("conf{}", i / 2_000), algorithm, quota).unwrap();
            let now = clock.now_micros_for_test();
            clock.set_micros(now + gap(&mut rng, now, &quota));
            let cost = cost(&mut rng, &quota, algorithm);
            let expected = memory.check_sync(b"caller", &policy, cost);
            let got = redis.check(b"caller", &policy, cost).await.unwrap();
            assert_eq!(
                got,
                expected,
                "{algorithm:?} event {i} at {} cost {cost} quota {quota:?}",
                clock.now_micros_for_test()
            );
            counts[usize::from(expected.denial_code().min(2))] += 1;
        }
        // The trace is not vacuous: it admits, limits and refuses.
        assert!(counts.iter().all(|&n| n > 100), "{algorithm:?}: {counts:?}");
    }
}

/// Test-only reading of the manual clock without importing the trait everywhere.
trait NowForTest {
    fn now_micros_for_test(&self) -> u64;
}

impl NowForTest for ManualClock {
    fn now_micros_for_test(&self) -> u64 {
        tollgate_core::Clock::now_micros(self)
    }
}

/// Runs `tasks` concurrent tasks, spread over `gateways`, each sending `per_task`
/// requests for one key, and returns how many were admitted.
async fn hammer(gateways: &[RedisStore], policy: &Policy, tasks: usize, per_task: usize) -> u64 {
    let admitted = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for t in 0..tasks {
        let store = gateways[t % gateways.len()].clone();
        let policy = policy.clone();
        let admitted = Arc::clone(&admitted);
        handles.push(tokio::spawn(async move {
            for _ in 0..per_task {
                if store.check(b"hot", &policy, 1).await.unwrap().is_allowed() {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    admitted.load(Ordering::Relaxed)
}

/// What a limiter without a script does: read, decide, write — two round trips with a
/// gap between them.
async fn naive_get_then_set(
    url: &str,
    gateways: usize,
    tasks: usize,
    per_task: usize,
    limit: u64,
) -> u64 {
    let mut cons = Vec::new();
    for _ in 0..gateways {
        cons.push(
            redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        );
    }
    let admitted = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for t in 0..tasks {
        let mut con = cons[t % gateways].clone();
        let admitted = Arc::clone(&admitted);
        handles.push(tokio::spawn(async move {
            for _ in 0..per_task {
                let count: Option<u64> = con.get("naive:hot").await.unwrap();
                let count = count.unwrap_or(0);
                if count < limit {
                    let () = con.set("naive:hot", count + 1).await.unwrap();
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    admitted.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_and_64_tasks_never_admit_more_than_the_model() {
    const TASKS: usize = 66;
    const PER_TASK: usize = 30;
    let server = RedisServer::start();
    // Time is pinned, so the exact model is the capacity: nothing refills mid-test.
    let clock = ManualClock::at_micros(EPOCH_US);
    let mut gateways = Vec::new();
    for _ in 0..3 {
        gateways.push(store(&server, &clock).await);
    }
    let quota = Quota::per_minute(100).unwrap();
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
        Algorithm::LeakyBucket,
    ] {
        let policy = Policy::new("atomic", algorithm, quota).unwrap();
        let admitted = hammer(&gateways, &policy, TASKS, PER_TASK).await;
        assert_eq!(
            admitted,
            100,
            "{algorithm:?} admitted {admitted} of {}",
            TASKS * PER_TASK
        );
    }
    // The same load through GET-then-SET over-admits: the race the scripts remove.
    let naive = naive_get_then_set(&server.url(), 3, TASKS, PER_TASK, 100).await;
    assert!(
        naive > 100,
        "the naive limiter admitted {naive}, expected more than 100"
    );
    println!(
        "naive GET-then-SET limiter admitted {naive} of {} (limit 100)",
        TASKS * PER_TASK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_survive_script_flush_and_a_restart() {
    let mut server = RedisServer::start();
    let store = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .connect(&server.url())
        .await
        .unwrap();
    let policy = Policy::new(
        "noscript",
        Algorithm::TokenBucket,
        Quota::per_minute(10).unwrap(),
    )
    .unwrap();
    assert!(store.check(b"k", &policy, 1).await.unwrap().is_allowed());

    let mut con = server.connection().await;
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut con)
        .await
        .unwrap();
    let after_flush = store.check(b"k", &policy, 1).await.unwrap();
    assert_eq!(after_flush.remaining(), 8, "state kept, script reloaded");

    server.restart();
    let after_restart = store.check(b"k", &policy, 1).await.unwrap();
    assert!(after_restart.is_allowed());
    assert_eq!(
        after_restart.remaining(),
        9,
        "a restarted server starts empty"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expire_when_their_state_is_fresh_again() {
    let server = RedisServer::start();
    let mut con = server.connection().await;
    // Server time: the TTL is exactly the time the state needs to become fresh.
    let store = RedisStore::builder()
        .prefix("ttl")
        .timeout(Duration::from_secs(5))
        .connect(&server.url())
        .await
        .unwrap();
    for algorithm in Algorithm::ALL {
        let policy = Policy::new("idle", algorithm, Quota::per_second(4).unwrap()).unwrap();
        let d: Decision = store.check(b"idler", &policy, 2).await.unwrap();
        assert!(d.is_allowed());
        for key in store.keys_for(b"idler", &policy) {
            let ttl: i64 = con.pttl(&key).await.unwrap();
            // Never without an expiry, and never longer than the state needs: the reset
            // time (rounded up to a millisecond), less what has passed since.
            let most = i64::try_from(d.reset_after().as_micros().div_ceil(1000)).unwrap();
            assert!(
                ttl > 0 && ttl <= most,
                "{algorithm:?} {key}: pttl {ttl}, reset {most} ms"
            );
        }
    }
    // With the caller's time, an idle caller's next look leaves nothing behind.
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = RedisStore::builder()
        .prefix("idle")
        .caller_time(clock.clone())
        .connect(&server.url())
        .await
        .unwrap();
    for algorithm in Algorithm::ALL {
        let policy = Policy::new("idle", algorithm, Quota::per_second(4).unwrap()).unwrap();
        assert!(
            store
                .check(b"idler", &policy, 1)
                .await
                .unwrap()
                .is_allowed()
        );
        clock.advance(Duration::from_secs(3));
        assert!(
            store
                .check(b"idler", &policy, 0)
                .await
                .unwrap()
                .is_allowed()
        );
        for key in store.keys_for(b"idler", &policy) {
            let exists: bool = con.exists(&key).await.unwrap();
            assert!(!exists, "{algorithm:?}: {key} outlived its state");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_keys_cannot_choose_their_slot_or_bloat_redis() {
    let server = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = store(&server, &clock).await;
    let policy = Policy::new("keys", Algorithm::Gcra, Quota::per_second(1).unwrap()).unwrap();
    let huge = vec![b'x'; 1 << 20];
    for key in [&b"}{victim"[..], b"\x00\xff binary", &huge] {
        assert!(store.check(key, &policy, 1).await.unwrap().is_allowed());
        let names = store.keys_for(key, &policy);
        assert_eq!(names[0].matches('{').count(), 1, "{}", names[0]);
        assert!(names[0].len() < 80, "{} bytes", names[0].len());
    }
    // The escaped key does not collide with the victim's own key.
    assert!(
        store
            .check(b"victim", &policy, 1)
            .await
            .unwrap()
            .is_allowed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadpool_pool_is_accepted_and_decides_the_same() {
    let server = RedisServer::start();
    let pool = deadpool_redis::Config::from_url(server.url())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let clock = ManualClock::at_micros(EPOCH_US);
    let pooled = RedisStore::builder()
        .caller_time(clock.clone())
        .with_pool(pool)
        .unwrap();
    let policy = Policy::new(
        "pool",
        Algorithm::SlidingWindowLog,
        Quota::per_minute(2).unwrap(),
    )
    .unwrap();
    assert!(pooled.check(b"k", &policy, 1).await.unwrap().is_allowed());
    assert!(pooled.check(b"k", &policy, 1).await.unwrap().is_allowed());
    let third = pooled.check(b"k", &policy, 1).await.unwrap();
    assert_eq!(third.retry_after(), Some(Duration::from_secs(60)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_is_an_error_within_the_timeout_not_a_hang() {
    let mut server = RedisServer::start();
    let store = RedisStore::builder()
        .timeout(Duration::from_millis(300))
        .connect(&server.url())
        .await
        .unwrap();
    server.kill();
    let policy = Policy::new("dead", Algorithm::Gcra, Quota::per_second(1).unwrap()).unwrap();
    let started = std::time::Instant::now();
    let err = store.check(b"k", &policy, 1).await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
    println!("dead server: {err}");
}
