//! A Redis Cluster slot migration under load: no request fails, nothing is lost, no
//! caller gets more than its limit.

use super::*;
use tollway_core::Operation;

/// Requests a (gateway, caller) task sends at most, whatever the migration does.
const MAX_REQUESTS: usize = 20_000;
/// Admissions every caller must have before the migration starts and after it ends.
const AROUND: u64 = 30;

/// Slots move the way `redis-cli --cluster reshard` moves them, one key at a time, while
/// three gateways decide twelve callers' requests under two limits each (one script
/// a request, two keys in the caller's slot). During the move a script meets `ASK`
/// (its keys already moved) or `TRYAGAIN` (one key moved, one not); redis-rs follows the
/// first and retries the second within the store's timeout, so no request fails. The
/// state moves with its keys: afterwards each caller's state on its new master counts
/// exactly the requests the gateways admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migration_under_load_fails_no_request_and_loses_nothing() {
    let cluster = RedisCluster::start().await;
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    // The caller's clock stands still: the budgets neither refill nor roll over, so
    // what the state holds afterwards is exactly what the requests took.
    let clock = ManualClock::at_micros(EPOCH_US);
    let mut gateways = Vec::new();
    for _ in 0..3 {
        let store = support::redis_store()
            .deny_cache(0)
            .without_breaker()
            .without_local_fallback()
            // A timeout no loaded machine reaches: the test is of redirects, not speed.
            .timeout(Duration::from_secs(30))
            .caller_time(clock.clone())
            .connect_cluster(&urls)
            .await
            .unwrap();
        gateways.push(store);
    }
    let policies = [
        Policy::new(
            "migrate-bucket",
            Algorithm::TokenBucket,
            Quota::per_hour(1_000_000).unwrap(),
        )
        .unwrap(),
        Policy::new(
            "migrate-window",
            Algorithm::FixedWindow,
            Quota::per_hour(500_000).unwrap(),
        )
        .unwrap(),
    ];
    let callers: Vec<String> = (0..12).map(|c| format!("mover-{c}")).collect();
    let keys: Vec<String> = callers
        .iter()
        .map(|c| gateways[0].state_key(c.as_bytes(), &policies[0]))
        .collect();
    let masters = cluster.masters().await;
    let owners = cluster.masters_of(&keys).await;

    let stop = Arc::new(AtomicBool::new(false));
    let admitted: Arc<Vec<AtomicU64>> =
        Arc::new(callers.iter().map(|_| AtomicU64::new(0)).collect());
    let errors = Arc::new(Mutex::new(Vec::new()));
    // Woken after every admission, so the waits below need no polling interval.
    let progress = Arc::new(Notify::new());
    let mut tasks = Vec::new();
    for store in &gateways {
        for (c, caller) in callers.iter().enumerate() {
            let (store, policies, caller) = (store.clone(), policies.clone(), caller.clone());
            let (stop, admitted, errors) = (
                Arc::clone(&stop),
                Arc::clone(&admitted),
                Arc::clone(&errors),
            );
            let progress = Arc::clone(&progress);
            tasks.push(tokio::spawn(async move {
                let policies: Vec<&Policy> = policies.iter().collect();
                for _ in 0..MAX_REQUESTS {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    match store.check(caller.as_bytes(), &policies, 1).await {
                        Ok(d) => {
                            assert!(d.is_allowed(), "{caller}: {d:?}");
                            admitted[c].fetch_add(1, Ordering::Relaxed);
                            progress.notify_waiters();
                        }
                        Err(e) => errors.lock().unwrap().push(format!("{caller}: {e}")),
                    }
                }
            }));
        }
    }
    let counts = || -> Vec<u64> { admitted.iter().map(|a| a.load(Ordering::Relaxed)).collect() };
    let every_caller_past =
        |floor: &[u64]| counts().iter().zip(floor).all(|(n, f)| *n >= f + AROUND);
    within("admissions before the migration", 20, async {
        wait_until(&progress, || every_caller_past(&[0; 12])).await;
    })
    .await;

    // Half the callers' slots move, each to the next master along. Each slot is handed
    // over only once its caller has been admitted with its keys moved (through `ASK`),
    // so the traffic meets the migration however the tasks are scheduled.
    let mut moved_keys = 0;
    for (c, key) in keys.iter().enumerate().step_by(2) {
        let from = owners[key];
        let to = masters[(masters.iter().position(|&m| m == from).unwrap() + 1) % masters.len()];
        let slot = cluster.slot_of(key).await;
        let redirected = async {
            let before = counts()[c];
            within("an admission through ASK", 20, async {
                wait_until(&progress, || counts()[c] > before).await;
            })
            .await;
        };
        moved_keys += cluster.migrate_slot(slot, to, redirected).await;
    }
    let after = counts();
    within("admissions after the migration", 20, async {
        wait_until(&progress, || every_caller_past(&after)).await;
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }

    // The migration met the traffic: scripts were redirected or told to try again.
    let mut redirected = 0;
    for port in cluster.masters().await {
        redirected += cluster.error_replies(port, &["ASK", "TRYAGAIN"]).await;
    }
    assert!(redirected > 0, "no request met the migration");
    let errors = errors.lock().unwrap().clone();
    assert!(
        errors.is_empty(),
        "{} requests failed, e.g. {:?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    assert!(moved_keys >= 12, "{moved_keys} keys moved");
    let now_owned = cluster.masters_of(&keys).await;
    let admitted = counts();
    let policy_refs: Vec<&Policy> = policies.iter().collect();
    for (c, caller) in callers.iter().enumerate() {
        if c % 2 == 0 {
            assert_ne!(now_owned[&keys[c]], owners[&keys[c]], "{caller} moved");
        }
        // What every gateway admitted, and no more, is what the state has taken.
        let state = gateways[1]
            .operate(caller.as_bytes(), &policy_refs, Operation::Peek(0))
            .await
            .unwrap();
        assert_eq!(
            state[0].remaining(),
            1_000_000 - admitted[c],
            "{caller}'s bucket"
        );
        assert_eq!(
            state[1].remaining(),
            500_000 - admitted[c],
            "{caller}'s window"
        );
    }
    println!(
        "{moved_keys} keys of 6 callers moved under load; {} admissions, none failed; \
         {redirected} ASK or TRYAGAIN replies",
        admitted.iter().sum::<u64>()
    );
}

/// Returns once `done` holds, looking again whenever `progress` is woken.
async fn wait_until(progress: &Notify, mut done: impl FnMut() -> bool) {
    loop {
        let woken = progress.notified();
        tokio::pin!(woken);
        // Registered before `done` is read, so no wake-up between the two is missed.
        woken.as_mut().enable();
        if done() {
            return;
        }
        woken.await;
    }
}
