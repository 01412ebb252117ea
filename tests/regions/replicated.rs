//! Replicated regions: each decides on its own Redis and tells the others what it
//! admitted; within the stated bound, through hammering, moving demand and a partition.

use super::*;

/// One customer hammering from one region (10 a second against 100 a minute, 80 ms
/// between regions, a sync every 50 ms): that region decides on its own Redis exactly as
/// one global store would — 100 a window, no more — and the other regions learn it: after
/// a sync, a peek in another region sees what the first one has left.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_region_hammering_is_decided_exactly_and_the_others_learn_it() {
    let _time = support::keep_time_moving();
    let regions = replicated().await;
    let policy = hundred_a_minute();
    let per_window = regions.traffic(&[(0, 0, 180)], &policy, async {}).await;
    assert!(per_window.len() >= 2, "{per_window:?}");
    assert!(per_window.iter().all(|&n| n == 100), "{per_window:?}");

    regions.gateways[0].sync_now().await;
    let peek = |r: usize| {
        let gateway = regions.gateways[r].clone();
        let policy = policy.clone();
        async move {
            gateway
                .operate(b"customer", &[&policy], Operation::Peek(0))
                .await
                .unwrap()[0]
                .remaining()
        }
    };
    let here = peek(0).await;
    assert_eq!(peek(1).await, here);
    assert_eq!(peek(2).await, here);
}

/// The same customer hammering from all three regions at once (10 a second each): every
/// whole window admits the limit give or take the bound, `(regions − 1) × (r × S + 1)`
/// with r = 10 a second and S = the 50 ms sync + 40 ms one way: 3.8, so at most 103.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn three_regions_hammering_stay_within_the_stated_bound() {
    let all = [(0, 0, 180), (1, 0, 180), (2, 0, 180)];
    admit_within_the_bound("three regions", &all).await;
}

/// Demand moving between regions: region 0 alone for 70 s, then region 1 (with region 2
/// joining for its last 20 s), then region 2 alone: every whole window admits the limit
/// within the same bound, whichever region the customer is calling from.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn demand_moving_between_regions_stays_within_the_stated_bound() {
    let moving = [(0, 0, 70), (1, 70, 130), (2, 110, 180)];
    admit_within_the_bound("demand moving", &moving).await;
}

/// Runs `senders` (see [`Gateways::traffic`]) for 3 minutes and checks that every whole
/// window admits 96 to 103: the limit, at most the stated bound (3.8) over it.
async fn admit_within_the_bound(what: &str, senders: &[(usize, u64, u64)]) {
    let _time = support::keep_time_moving();
    let regions = replicated().await;
    let per_window = regions
        .traffic(senders, &hundred_a_minute(), async {})
        .await;
    println!("admitted per whole window, {what}: {per_window:?}");
    assert!(per_window.len() >= 2, "{per_window:?}");
    for &n in &per_window {
        assert!(
            (96..=103).contains(&n),
            "{n} admitted in a window: {per_window:?}"
        );
    }
}

/// The bound for the algorithms that refill: a token bucket and GCRA at 100 a minute
/// (capacity 100), the customer hammering from all three regions at 10 a second each.
/// Over the two whole windows (120 s), one global bucket admits at most its capacity
/// plus 120 s of refill, 300; replicated, at most the bound more a period (3.8 × 2), so
/// 307 — and, with the bucket emptied in the first seconds, about the refill (200, less
/// a unit a window for the refill that straddles its end).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn replicated_buckets_stay_within_the_stated_bound() {
    let _time = support::keep_time_moving();
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let regions = replicated().await;
        let policy = Policy::new("bucket", algorithm, Quota::per_minute(100).unwrap()).unwrap();
        let all = [(0, 0, 180), (1, 0, 180), (2, 0, 180)];
        let per_window = regions.traffic(&all, &policy, async {}).await;
        let admitted: u64 = per_window.iter().sum();
        println!("{algorithm:?}: admitted per whole window {per_window:?}");
        assert_eq!(per_window.len(), 2, "{per_window:?}");
        assert!(
            (195..=307).contains(&admitted),
            "{algorithm:?}: {per_window:?}"
        );
    }
}

/// Region 2 cut off from the others for 70 s while all three hammer: nothing hangs (every
/// region decides its 10 a second throughout, region 2 on what it knows), a window
/// admits at most a quota on each side of the cut and the stated bound (3.8, as above),
/// and once the link heals what region 2 owed the others — and they it — is delivered:
/// nothing stays owed.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_partition_keeps_every_region_deciding_and_the_heal_settles_what_was_owed() {
    let _time = support::keep_time_moving();
    let regions = replicated().await;
    let all = [(0, 0, 180), (1, 0, 180), (2, 0, 180)];
    let per_window = regions
        .traffic(&all, &hundred_a_minute(), regions.cut(2, 30, 100))
        .await;
    println!("admitted per whole window, with a 70 s partition: {per_window:?}");
    // 200 on a quiet machine; a busy one syncs later within the bound.
    for &n in &per_window {
        assert!(n <= 203, "{n} admitted in a window: {per_window:?}");
    }
    // Held charges are delivered after the heal (the charges in flight at the cut time
    // out after the store's second and are sent again).
    tokio::time::sleep(Duration::from_secs(3)).await;
    for gateway in &regions.gateways {
        gateway.sync_now().await;
        assert_eq!(gateway.owed(), 0);
        assert_eq!(gateway.dropped(), 0);
    }
}

/// A quota changed while callers are counted: region 0 admits 60 under 100 a minute and
/// tells the others. Region 1, cut to 50 (same name, algorithm and period), refuses the
/// next request: 60 are used. Region 2, raised to 200, has 140 left. Region 0's own
/// Redis, cut to 50, refuses too.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_changed_quota_keeps_what_every_region_used() {
    let _time = support::keep_time_moving();
    let regions = replicated().await;
    let at = |limit: u64| {
        Policy::new(
            "global",
            Algorithm::FixedWindow,
            Quota::per_minute(limit).unwrap(),
        )
        .unwrap()
    };
    let (hundred, cut, raised) = (at(100), at(50), at(200));
    for _ in 0..60 {
        let decisions = regions.gateways[0]
            .check(b"customer", &[&hundred], 1)
            .await
            .unwrap();
        assert!(decisions.is_allowed());
    }
    regions.gateways[0].sync_now().await;
    let check = |r: usize, policy: &Policy| {
        let (gateway, policy) = (regions.gateways[r].clone(), policy.clone());
        async move { gateway.check(b"customer", &[&policy], 1).await.unwrap()[0] }
    };
    let refused = check(1, &cut).await;
    assert!(!refused.is_allowed(), "{refused:?}");
    assert_eq!(refused.remaining(), 0);
    let raised = check(2, &raised).await;
    assert!(raised.is_allowed(), "{raised:?}");
    assert_eq!(raised.remaining(), 139);
    assert!(!check(0, &cut).await.is_allowed());
}
