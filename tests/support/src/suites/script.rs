//! What only the Redis store has: one script call a request, keys that name the quota,
//! atomic scripts across gateways, `SCRIPT FLUSH`, expiry, and hostile keys.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use tollway_core::{
    Algorithm, Decision, ManualClock, MemoryStore, Operation, Policy, Quota, RedisStore, Store,
};

use super::{Target, builder};
use crate::CheckOne;
use crate::redis::{command_calls, unique_prefix};
use crate::stores::EPOCH_US;

/// A request against three limits is one script call, however many limits it has and
/// whether they cost the same or each its own: the server's `INFO commandstats` counts
/// one `EVALSHA` a request.
pub async fn one_round_trip(target: &Target, node: &mut MultiplexedConnection) -> Vec<String> {
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = target
        .connect(builder(&clock).prefix(unique_prefix("trips")))
        .await;
    let policies: Vec<Policy> = [
        Algorithm::TokenBucket,
        Algorithm::SlidingWindowLog,
        Algorithm::Gcra,
    ]
    .iter()
    .enumerate()
    .map(|(i, &a)| Policy::new(format!("trip{i}"), a, Quota::per_minute(100).unwrap()).unwrap())
    .collect();
    let policies: Vec<&Policy> = policies.iter().collect();
    // Loads the script.
    store.check(b"warm", &policies, 1).await.unwrap();
    let before = command_calls(node, "evalsha").await;
    for _ in 0..10 {
        assert!(
            store
                .check(b"caller", &policies, 1)
                .await
                .unwrap()
                .is_allowed()
        );
    }
    assert_eq!(command_calls(node, "evalsha").await - before, 10);
    // Three limits, three costs: still one call a request.
    let before = command_calls(node, "evalsha").await;
    for i in 1..=10 {
        let decisions = store
            .check_each(b"each", &policies, &[1, 2, 3])
            .await
            .unwrap();
        let remaining: Vec<u64> = decisions.iter().map(Decision::remaining).collect();
        assert_eq!(remaining, [100 - i, 100 - 2 * i, 100 - 3 * i]);
    }
    assert_eq!(command_calls(node, "evalsha").await - before, 10);
    ["warm", "caller", "each"]
        .iter()
        .flat_map(|k| policies.iter().map(|p| store.state_key(k.as_bytes(), p)))
        .collect()
}

/// A policy whose limit changes keeps what its callers used, for every algorithm: 20 of
/// 20 used, a cut to 10 leaves nothing and a raise to 100 leaves 80. A changed period
/// starts afresh (but for calls in flight, which hold their slots whatever it is). The
/// state key names the policy, its algorithm and its period, not its limit.
pub async fn a_changed_limit_keeps_usage(target: &Target) -> Vec<String> {
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = target
        .connect(builder(&clock).prefix(unique_prefix("requota")))
        .await;
    let mut keys = Vec::new();
    for algorithm in Algorithm::ALL {
        let key = algorithm.name().as_bytes();
        let policy = |quota: Quota| Policy::new("api", algorithm, quota).unwrap();
        let per_minute = |limit: u64| policy(Quota::per_minute(limit).unwrap());
        let first = store.check_one(key, &per_minute(20), 20).await.unwrap();
        assert!(first.is_allowed(), "{algorithm:?}");
        let cut = store.check_one(key, &per_minute(10), 1).await.unwrap();
        assert!(!cut.is_allowed(), "{algorithm:?}");
        assert_eq!(cut.remaining(), 0, "{algorithm:?}");
        let raised = store.check_one(key, &per_minute(100), 0).await.unwrap();
        assert_eq!(raised.remaining(), 80, "{algorithm:?}");
        let hourly = policy(Quota::per_hour(100).unwrap());
        let fresh = if algorithm == Algorithm::Concurrency {
            80
        } else {
            100
        };
        let other = store.check_one(key, &hourly, 0).await.unwrap();
        assert_eq!(other.remaining(), fresh, "{algorithm:?}");
        assert_eq!(
            store.state_key(key, &per_minute(10)),
            store.state_key(key, &per_minute(100))
        );
        keys.push(store.state_key(key, &per_minute(20)));
        keys.push(store.state_key(key, &hourly));
    }
    // A cut's new rate runs from the first request under it; a look moves nothing. A
    // bucket of 20 a minute spent, looked at under 10 a minute: 30 s later the old rate
    // has refilled 10, so the first request finds 10 missing of 10 and waits 6 s.
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let key = format!("look-{}", algorithm.name());
        let per_minute =
            |limit: u64| Policy::new("api", algorithm, Quota::per_minute(limit).unwrap()).unwrap();
        clock.set_micros(EPOCH_US);
        let spent = store.check_one(key.as_bytes(), &per_minute(20), 20);
        assert!(spent.await.unwrap().is_allowed());
        let looked = store
            .operate(key.as_bytes(), &[&per_minute(10)], Operation::Peek(1))
            .await
            .unwrap();
        assert!(!looked[0].is_allowed(), "{algorithm:?}");
        clock.set_micros(EPOCH_US + 30_000_000);
        let first = store
            .check_one(key.as_bytes(), &per_minute(10), 1)
            .await
            .unwrap();
        assert_eq!(first.retry_after_micros(), 6_000_000, "{algorithm:?}");
        keys.push(store.state_key(key.as_bytes(), &per_minute(10)));
    }
    keys
}

/// Runs `tasks` concurrent tasks, task `t` on gateway `t % gateways` for key
/// `t / gateways % keys` (so every key is hammered through every gateway), each sending
/// `per_task` requests, and returns the delays of the requests each key admitted, in
/// order (all 0 but the shaper's).
async fn hammer(
    gateways: &[RedisStore],
    policy: &Policy,
    keys: &[String],
    tasks: usize,
    per_task: usize,
) -> Vec<Vec<u64>> {
    let admitted: Arc<Vec<std::sync::Mutex<Vec<u64>>>> =
        Arc::new(keys.iter().map(|_| Default::default()).collect());
    let mut handles = Vec::new();
    for t in 0..tasks {
        let store = gateways[t % gateways.len()].clone();
        let k = t / gateways.len() % keys.len();
        let key = keys[k].clone();
        let policy = policy.clone();
        let admitted = Arc::clone(&admitted);
        handles.push(tokio::spawn(async move {
            for _ in 0..per_task {
                let d = store.check_one(key.as_bytes(), &policy, 1).await.unwrap();
                if d.is_allowed() {
                    admitted[k].lock().unwrap().push(d.delay_micros());
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    admitted
        .iter()
        .map(|delays| {
            let mut delays = delays.lock().unwrap().clone();
            delays.sort_unstable();
            delays
        })
        .collect()
}

/// What a limiter without a script does: read, decide, write — two round trips with a
/// gap between them.
async fn naive_get_then_set(
    target: &Target,
    gateways: usize,
    tasks: usize,
    per_task: usize,
    limit: u64,
) -> u64 {
    let mut cons = Vec::new();
    for _ in 0..gateways {
        cons.push(target.admin().await);
    }
    let admitted = Arc::new(AtomicU64::new(0));
    let key = unique_prefix("naive:hot");
    let mut handles = Vec::new();
    for t in 0..tasks {
        let mut con = cons[t % gateways].clone();
        let admitted = Arc::clone(&admitted);
        let key = key.clone();
        handles.push(tokio::spawn(async move {
            for _ in 0..per_task {
                let count: Option<u64> = con.get(&key).await.unwrap();
                let count = count.unwrap_or(0);
                if count < limit {
                    let () = con.set(&key, count + 1).await.unwrap();
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

/// Three gateways and 66 tasks hammer three keys per algorithm on a pinned clock: each
/// key admits exactly what the memory store admits to the same number of requests one at
/// a time — its capacity, never more — and the shaper gives each admitted request a
/// departure slot of its own, the model's delays exactly (no two requests sent at once);
/// a GET-then-SET limiter under the same load over-admits. Returns the Redis keys it used.
pub async fn atomicity(target: &Target) -> Vec<String> {
    const TASKS: usize = 66;
    const PER_TASK: usize = 30;
    // Time is pinned, so the exact model is the capacity: nothing refills mid-test.
    let clock = ManualClock::at_micros(EPOCH_US);
    let prefix = unique_prefix("atomicity");
    let mut gateways = Vec::new();
    for _ in 0..3 {
        // No deny cache: every one of the requests races inside Redis.
        gateways.push(
            target
                .connect(builder(&clock).prefix(prefix.clone()).deny_cache(0))
                .await,
        );
    }
    let quota = Quota::per_minute(100).unwrap();
    // A caller's keys share its hash tag; these three callers' tags hash to slots 5356,
    // 9359 and 13486: one on each master of a three-master cluster's default split.
    let callers: Vec<String> = ["hot-0", "hot-3", "hot-2"].map(String::from).to_vec();
    let per_key = TASKS * PER_TASK / callers.len();
    let mut keys = Vec::new();
    for algorithm in Algorithm::ALL {
        let policy =
            Policy::new(format!("atomic-{algorithm:?}"), algorithm, quota.clone()).unwrap();
        // The model: the same requests one at a time, on the same pinned clock.
        let model = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let expected: Vec<u64> = (0..per_key)
            .map(|_| model.check_sync(b"model", &policy, 1))
            .filter(Decision::is_allowed)
            .map(|d| d.delay_micros())
            .collect();
        assert_eq!(expected.len(), 100, "{algorithm:?}: the capacity");
        let admitted = hammer(&gateways, &policy, &callers, TASKS, PER_TASK).await;
        for (caller, delays) in callers.iter().zip(&admitted) {
            assert_eq!(
                delays.len(),
                expected.len(),
                "{algorithm:?} admitted {} of {per_key} for {caller}",
                delays.len()
            );
            assert_eq!(
                delays, &expected,
                "{algorithm:?}: the delays given to {caller}"
            );
        }
        if algorithm == Algorithm::LeakyBucketShaper {
            // Not vacuous: 100 distinct slots, 0.6 s apart.
            assert_eq!(expected[99], 99 * 600_000);
        }
        for caller in &callers {
            keys.push(gateways[0].state_key(caller.as_bytes(), &policy));
        }
    }
    // The same load through GET-then-SET over-admits: the race the scripts remove.
    let naive = naive_get_then_set(target, 3, TASKS, PER_TASK, 100).await;
    assert!(
        naive > 100,
        "the naive limiter admitted {naive}, expected more than 100"
    );
    println!(
        "naive GET-then-SET limiter admitted {naive} of {} (limit 100)",
        TASKS * PER_TASK
    );
    keys
}

/// Many callers' state survives `SCRIPT FLUSH` on every node: each node that runs a
/// script afterwards gets `NOSCRIPT`, reloads it with `EVAL`, and decides from the state
/// it kept. Returns the Redis keys it used.
pub async fn script_flush(target: &Target) -> Vec<String> {
    const CALLERS: usize = 24;
    let clock = ManualClock::at_micros(EPOCH_US);
    // No deny cache: every call must reach Redis, and the test counts them.
    let store = target
        .connect(builder(&clock).prefix(unique_prefix("flush")).deny_cache(0))
        .await;
    let policy = Policy::new(
        "noscript",
        Algorithm::TokenBucket,
        Quota::per_minute(10).unwrap(),
    )
    .unwrap();
    let callers: Vec<String> = (0..CALLERS).map(|c| format!("caller-{c}")).collect();
    for caller in &callers {
        let d = store
            .check_one(caller.as_bytes(), &policy, 1)
            .await
            .unwrap();
        assert_eq!(d.remaining(), 9, "{caller}");
    }

    let mut nodes = target.each_node().await;
    let mut before = Vec::new();
    for node in &mut nodes {
        before.push((
            command_calls(node, "evalsha").await,
            command_calls(node, "eval").await,
        ));
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(node)
            .await
            .unwrap();
    }
    for caller in &callers {
        let d = store
            .check_one(caller.as_bytes(), &policy, 1)
            .await
            .unwrap();
        assert_eq!(d.remaining(), 8, "{caller}: state kept, script reloaded");
    }
    let mut served = 0;
    for (node, (evalsha, eval)) in nodes.iter_mut().zip(before) {
        let evalsha = command_calls(node, "evalsha").await - evalsha;
        let eval = command_calls(node, "eval").await - eval;
        // A node that ran scripts after the flush had them reloaded with EVAL, after a
        // NOSCRIPT; one that ran none, none. (Counted per node: other tests sharing the
        // server or cluster may add calls of their own, each store one EVAL a node.)
        if evalsha > 0 {
            served += 1;
            assert!(eval >= 1, "a node ran {evalsha} EVALSHA and {eval} EVAL");
        } else {
            assert_eq!(eval, 0);
        }
    }
    assert!(served > 0);
    callers
        .iter()
        .map(|c| store.state_key(c.as_bytes(), &policy))
        .collect()
}

/// Keys expire when their state is fresh again, on the server's time and on the
/// caller's, for every algorithm and several callers. Returns the Redis keys it used.
pub async fn expiry(target: &Target) -> Vec<String> {
    let callers: Vec<String> = (0..6).map(|c| format!("idler-{c}")).collect();
    let mut con = target.admin().await;
    let mut keys = Vec::new();
    // Server time: a key expires at the instant its state is fresh, rounded up to Redis's
    // millisecond, counted from the TIME the script read — not from the millisecond the
    // command ran, which Redis 7.2 takes when the EVALSHA starts, before TIME (a key of a
    // 1 ms log written with a relative PEXPIRE could then go while an entry still counts).
    let store = target
        .connect(
            crate::redis_store()
                .without_local_fallback()
                .prefix(unique_prefix("ttl"))
                .timeout(Duration::from_secs(5)),
        )
        .await;
    for algorithm in Algorithm::ALL {
        let policy = Policy::new("idle", algorithm, Quota::per_second(4).unwrap()).unwrap();
        for caller in &callers {
            let (d, told) = store
                .check_telling_time(caller.as_bytes(), &[&policy], 2)
                .await
                .unwrap();
            assert!(d.is_allowed());
            let key = store.state_key(caller.as_bytes(), &policy);
            let at: u64 = redis::cmd("PEXPIRETIME")
                .arg(&key)
                .query_async(&mut con)
                .await
                .unwrap();
            // Every one of these states is fresh again when its reset time has passed.
            let fresh = told + u64::try_from(d[0].reset_after().as_micros()).unwrap();
            assert_eq!(
                at,
                fresh.div_ceil(1000),
                "{algorithm:?} {key}: expires at {at} ms, TIME {told} µs, reset {:?}",
                d[0].reset_after()
            );
            keys.push(key);
        }
    }
    // With the caller's time, an idle caller's next look leaves nothing behind.
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = target
        .connect(builder(&clock).prefix(unique_prefix("idle")).deny_cache(0))
        .await;
    for algorithm in Algorithm::ALL {
        let policy = Policy::new("idle", algorithm, Quota::per_second(4).unwrap()).unwrap();
        for caller in &callers {
            let d = store
                .check_one(caller.as_bytes(), &policy, 1)
                .await
                .unwrap();
            assert!(d.is_allowed());
        }
        clock.advance(Duration::from_secs(3));
        for caller in &callers {
            let d = store
                .check_one(caller.as_bytes(), &policy, 0)
                .await
                .unwrap();
            assert!(d.is_allowed());
            let key = store.state_key(caller.as_bytes(), &policy);
            let exists: bool = con.exists(&key).await.unwrap();
            assert!(!exists, "{algorithm:?}: {key} outlived its state");
            keys.push(key);
        }
    }
    keys
}

/// Keys with braces, binary or a megabyte become short, hashed keys with one hash tag
/// (all of a caller's limits share it, so a cluster never answers `CROSSSLOT`), and
/// never collide with the key they imitate. Returns the Redis keys it used.
pub async fn hostile_keys(target: &Target) -> Vec<String> {
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = target
        .connect(builder(&clock).prefix(unique_prefix("hostile")))
        .await;
    let huge = vec![b'x'; 1 << 20];
    let mut keys = Vec::new();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingWindowLog] {
        let policy = Policy::new("keys", algorithm, Quota::per_second(1).unwrap()).unwrap();
        for key in [&b"}{victim"[..], b"\x00\xff binary", &huge] {
            assert!(store.check_one(key, &policy, 1).await.unwrap().is_allowed());
            let name = store.state_key(key, &policy);
            assert_eq!(name.matches('{').count(), 1, "{name}");
            assert!(name.len() < 80, "{} bytes", name.len());
            keys.push(name);
        }
        // The escaped key does not collide with the victim's own key.
        assert!(
            store
                .check_one(b"victim", &policy, 1)
                .await
                .unwrap()
                .is_allowed()
        );
        keys.push(store.state_key(b"victim", &policy));
    }
    keys
}
