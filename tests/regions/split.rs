//! Split regions: each holds a share of the limit, rebalanced every window; never over
//! the limit, through hammering, moving demand and a partition.

use super::*;

/// `senders` (see [`Gateways::traffic`]) for 3 minutes through split gateways at 100 a
/// minute, region `cut.0` cut off from the others from `cut.1` to `cut.2` seconds:
/// checks that no whole window admits more than the limit, all regions together, and
/// returns the gateways and each whole window's admissions region by region.
async fn split(
    what: &str,
    senders: &[(usize, u64, u64)],
    cut: Option<(usize, u64, u64)>,
) -> (Gateways<SplitStore<RedisStore>>, Vec<Vec<u64>>) {
    let _time = support::keep_time_moving();
    let policy = hundred_a_minute();
    let regions = split_gateways(&policy).await;
    let partition = async {
        if let Some((r, from, to)) = cut {
            regions.cut(r, from, to).await;
        }
    };
    let per_window = regions.by_region(senders, &policy, partition).await;
    println!("split, admitted per whole window and region, {what}: {per_window:?}");
    assert!(per_window.len() >= 2, "{per_window:?}");
    for window in &per_window {
        let admitted: u64 = window.iter().sum();
        assert!(
            admitted <= 100,
            "{admitted} admitted in a window: {per_window:?}"
        );
    }
    (regions, per_window)
}

/// One customer hammering from one region (10 a second against 100 a minute): its
/// demand, posted in the first window, gives that region the whole limit of every
/// window after it — 100, exactly a global store's — and the others none of it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn split_one_region_hammering_gets_the_whole_limit_after_its_first_window() {
    let (regions, per_window) = split("one region", &[(0, 0, 180)], None).await;
    assert!(
        per_window.iter().all(|w| w == &[100, 0, 0]),
        "{per_window:?}"
    );
    for (r, share) in [(0, 100), (1, 0), (2, 0)] {
        let share_now = regions.gateways[r].share_of(b"customer", &hundred_a_minute());
        assert_eq!(share_now.unwrap(), share);
    }
}

/// The same customer from all three regions at once, 10 a second each: a third each
/// (33), 99 a window together — the limit, less its remainder of a third.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn split_three_regions_hammering_share_the_limit() {
    let all = [(0, 0, 180), (1, 0, 180), (2, 0, 180)];
    let (_, per_window) = split("three regions", &all, None).await;
    assert!(
        per_window.iter().all(|w| w == &[33, 33, 33]),
        "{per_window:?}"
    );
}

/// Demand moving: region 0 alone until 70 s, then region 1 until 130 s, region 2 from
/// 110 s. Never over the limit; under it while demand moves: in the window from 60 s,
/// region 0 spends its whole share (100) in its last 10 s and region 1, whose callers
/// arrived after that window's shares were fixed, gets nothing of it; in the window
/// from 120 s, regions 0 and 1 posted demand (45 s of it) and get half each, and region
/// 2, arriving after the post, nothing: 50 admitted (region 1 until it stops at 130 s).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn split_demand_moving_never_over_admits_and_under_admits_while_it_moves() {
    let moving = [(0, 0, 70), (1, 70, 130), (2, 110, 180)];
    let (_, per_window) = split("demand moving", &moving, None).await;
    assert_eq!(per_window, [vec![100, 0, 0], vec![0, 50, 0]]);
}

/// Regions 0 and 2 hammering, region 2 cut off from 30 s to 100 s: the posts of the
/// first window (at 45 s) are lost both ways, so in the window from 60 s region 0 counts
/// region 2 as asking everything and takes half (it heard that region 1 asks nothing),
/// and region 2 — hearing nobody — a third: 83, never over the limit, and region 2
/// keeps deciding. Once the link is back, the next window's posts go through and the two
/// split the limit evenly.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn split_a_partition_never_over_admits_and_each_side_keeps_deciding() {
    let both = [(0, 0, 180), (2, 0, 180)];
    let (_, per_window) = split("a 70 s partition", &both, Some((2, 30, 100))).await;
    assert_eq!(per_window, [vec![50, 0, 33], vec![50, 0, 50]]);
}
