//! The multi-region harness (issue 21): regions are `redis-server`s on loopback, and the
//! distance between them is [`LatencyProxy`]: a TCP proxy that delays every byte and can
//! cut the link. These tests pin what the harness does, so the multi-region modes can be
//! measured on it: the delay each way, a cut that holds traffic and a heal that delivers
//! it, and a store reaching a Redis across the distance paying the round trip — and,
//! when the link is cut, failing within its timeout rather than hanging.

#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::time::Duration;

use support::proxy::LatencyProxy;
use support::regions::Regions;
use support::{RedisServer, within};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tollway_core::{
    Algorithm, Clock, Operation, Policy, Quota, RedisStore, ReplicatedStore, SplitStore, Store,
    StoreErrorKind,
};
use tollway_tower::TokioClock;

/// An echo server on loopback.
async fn echo() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = [0u8; 1024];
                while let Ok(n) = socket.read(&mut buffer).await {
                    if n == 0 || socket.write_all(&buffer[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

async fn ping(stream: &mut TcpStream) {
    stream.write_all(b"ping").await.unwrap();
    let mut answer = [0u8; 4];
    stream.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"ping");
}

/// On tokio's paused clock, which the proxy's delays run on: a round trip takes twice
/// the one-way delay, exactly, and follows a change of it; a cut holds a message for as
/// long as it lasts (10 s here) on an open connection, and the heal delivers it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_proxy_delays_each_way_and_a_cut_holds_traffic_until_healed() {
    let proxy = LatencyProxy::start(echo().await, Duration::from_millis(40)).await;
    let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
    let before = tokio::time::Instant::now();
    ping(&mut stream).await;
    assert_eq!(before.elapsed(), Duration::from_millis(80));

    proxy.set_one_way(Duration::from_millis(75));
    let before = tokio::time::Instant::now();
    ping(&mut stream).await;
    assert_eq!(before.elapsed(), Duration::from_millis(150));

    proxy.cut();
    let before = tokio::time::Instant::now();
    let held = tokio::time::timeout(Duration::from_secs(10), ping(&mut stream)).await;
    assert!(held.is_err(), "a message crossed a cut link");
    proxy.heal();
    // The ping sent into the cut is delivered now; its echo comes a one-way later.
    let mut answer = [0u8; 4];
    stream.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"ping");
    assert_eq!(before.elapsed(), Duration::from_millis(10_075));
}

/// A gateway deciding against a Redis one region away (35 ms each way; the store in
/// caller time on tokio's paused clock, which the proxy's delays and the store's timeout
/// run on) pays the round trip per decision; with the link cut, a decision fails with a
/// timeout after the store's 300 ms instead of hanging, and decisions come back once the
/// link heals.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_store_across_the_distance_pays_the_round_trip_and_a_cut_times_out() {
    let _time = support::keep_time_moving();
    let server = RedisServer::start();
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = LatencyProxy::start(target, Duration::from_millis(35)).await;
    let store = within(
        "connecting across the proxy",
        10,
        RedisStore::builder()
            .prefix(support::unique_prefix("regions"))
            .caller_time(TokioClock::new())
            .timeout(Duration::from_millis(300))
            .without_breaker()
            .without_local_fallback()
            .connect(&proxy.redis_url()),
    )
    .await
    .unwrap();
    let policy = Policy::new("global", Algorithm::Gcra, Quota::per_minute(100).unwrap()).unwrap();
    for _ in 0..3 {
        let before = tokio::time::Instant::now();
        let decisions = store.check(b"customer-1", &[&policy], 1).await.unwrap();
        assert!(decisions.is_allowed());
        let took = before.elapsed();
        assert!(
            took >= Duration::from_millis(70),
            "a decision took {took:?}"
        );
    }

    proxy.cut();
    let before = tokio::time::Instant::now();
    let cut = within("a decision across a cut link", 5, async {
        store.check(b"customer-1", &[&policy], 1).await
    })
    .await;
    assert_eq!(cut.unwrap_err().kind(), StoreErrorKind::Timeout);
    assert!(before.elapsed() >= Duration::from_millis(300));
    proxy.heal();
    let healed = within("a decision after the heal", 10, async {
        store.check(b"customer-1", &[&policy], 1).await
    })
    .await;
    assert!(healed.unwrap().is_allowed());
}

/// Three regions (`support::regions`: a `redis-server` each, a proxy a direction
/// between them, 40 ms each way), each with one gateway over its local Redis with the
/// other two as peers across the proxies. Everything on tokio's paused clock (the Redis
/// stores in caller time on it, the proxies' delays, the gateways' background tasks),
/// kept moving by `support::keep_time_moving`.
struct Gateways<G> {
    regions: Regions,
    gateways: Vec<G>,
    /// The one clock of every region (a `TokioClock` is zero where it is made).
    clock: TokioClock,
}

const SYNC: Duration = Duration::from_millis(50);
const ONE_WAY: Duration = Duration::from_millis(40);
/// How long each run lasts, in seconds: three minute windows.
const RUN: u64 = 180;

async fn paused_redis(url: &str, prefix: &str, clock: &TokioClock) -> RedisStore {
    RedisStore::builder()
        .prefix(prefix)
        .caller_time(clock.clone())
        .deny_cache(0)
        .without_breaker()
        .without_local_fallback()
        .timeout(Duration::from_secs(3_600))
        .grace(Duration::from_secs(3_600))
        .connect(url)
        .await
        .unwrap()
}

/// Replicated gateways, syncing every 50 ms.
async fn replicated() -> Gateways<ReplicatedStore<RedisStore>> {
    Gateways::start(|_, _, local, peers| async move {
        let builder = ReplicatedStore::builder(local).sync_every(SYNC);
        let builder = peers
            .into_iter()
            .fold(builder, |b, (name, peer)| b.peer(name, peer));
        builder.build().unwrap()
    })
    .await
}

/// Split gateways for `policy`, posting their demand a quarter of a window before its end
/// (the default).
async fn split_gateways(policy: &Policy) -> Gateways<SplitStore<RedisStore>> {
    Gateways::start(|name, clock, local, peers| {
        let builder = SplitStore::builder(name, local, clock).policy(policy);
        let builder = peers
            .into_iter()
            .fold(builder, |b, (name, peer)| b.peer(name, peer));
        async move { builder.build().await.unwrap() }
    })
    .await
}

impl<G: Store + Clone> Gateways<G> {
    /// The regions, and in each the gateway `gateway(name, clock, local, peers)` makes
    /// from its name (`region-{i}`), the regions' clock, its own Redis and the others'
    /// as it reaches them (named alike).
    async fn start<F, Fut>(mut gateway: F) -> Self
    where
        F: FnMut(String, TokioClock, RedisStore, Vec<(String, RedisStore)>) -> Fut,
        Fut: Future<Output = G>,
    {
        let regions = Regions::start(3, ONE_WAY).await;
        let prefix = support::unique_prefix("regions");
        let clock = TokioClock::new();
        let mut gateways = Vec::new();
        for i in 0..regions.len() {
            let local = paused_redis(&regions.url(i, i), &prefix, &clock).await;
            let mut peers = Vec::new();
            for j in (0..regions.len()).filter(|&j| j != i) {
                let peer = paused_redis(&regions.url(i, j), &prefix, &clock).await;
                peers.push((format!("region-{j}"), peer));
            }
            let name = format!("region-{i}");
            gateways.push(gateway(name, clock.clone(), local, peers).await);
        }
        Gateways {
            regions,
            gateways,
            clock,
        }
    }

    /// Region `r` cut off from the others from `from` to `to` seconds into a run.
    async fn cut(&self, r: usize, from: u64, to: u64) {
        tokio::time::sleep(Duration::from_secs(from)).await;
        self.regions.isolate(r, true);
        tokio::time::sleep(Duration::from_secs(to - from)).await;
        self.regions.isolate(r, false);
    }

    /// Each `(region, from, to)` of `senders` sends a request every 100 ms (10 a second)
    /// through `gateways[region]` from `from` to `to` seconds into a run of [`RUN`];
    /// `meanwhile` runs beside them (a cut, say). Returns the admissions of every minute
    /// window the run covered whole (the policy's fixed windows, on the clock), all
    /// regions together.
    async fn traffic(
        &self,
        senders: &[(usize, u64, u64)],
        policy: &Policy,
        meanwhile: impl Future<Output = ()>,
    ) -> Vec<u64> {
        let per_window = self.by_region(senders, policy, meanwhile).await;
        per_window
            .iter()
            .map(|regions| regions.iter().sum())
            .collect()
    }

    /// [`Self::traffic`], with each window's admissions region by region.
    async fn by_region(
        &self,
        senders: &[(usize, u64, u64)],
        policy: &Policy,
        meanwhile: impl Future<Output = ()>,
    ) -> Vec<Vec<u64>> {
        const PERIOD: u64 = 60_000_000;
        let start = self.clock.now_micros();
        let began = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for &(r, from, to) in senders {
            let (gateway, policy) = (self.gateways[r].clone(), policy.clone());
            let clock = self.clock.clone();
            tasks.push((
                r,
                tokio::spawn(async move {
                    let mut admitted = Vec::new();
                    tokio::time::sleep_until(began + Duration::from_secs(from)).await;
                    let mut ticks = tokio::time::interval(Duration::from_millis(100));
                    for _ in 0..(to - from) * 10 {
                        ticks.tick().await;
                        let at = clock.now_micros();
                        let decisions = gateway.check(b"customer", &[&policy], 1).await.unwrap();
                        if decisions.is_allowed() {
                            admitted.push(at);
                        }
                    }
                    admitted
                }),
            ));
        }
        meanwhile.await;
        let end = start + RUN * 1_000_000;
        // Whole windows only: from the first boundary after the start to the last before
        // the end.
        let (first, last) = (start.div_ceil(PERIOD), end / PERIOD);
        let windows = last.saturating_sub(first) as usize;
        let mut per_window = vec![vec![0u64; self.gateways.len()]; windows];
        for (r, task) in tasks {
            for at in task.await.unwrap() {
                let window = at / PERIOD;
                if (first..last).contains(&window) {
                    per_window[(window - first) as usize][r] += 1;
                }
            }
        }
        per_window
    }
}

fn hundred_a_minute() -> Policy {
    Policy::new(
        "global",
        Algorithm::FixedWindow,
        Quota::per_minute(100).unwrap(),
    )
    .unwrap()
}

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
/// admits at most a quota on each side of the cut, and once the link heals what region 2
/// owed the others — and they it — is delivered: nothing stays owed.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_partition_keeps_every_region_deciding_and_the_heal_settles_what_was_owed() {
    let _time = support::keep_time_moving();
    let regions = replicated().await;
    let all = [(0, 0, 180), (1, 0, 180), (2, 0, 180)];
    let per_window = regions
        .traffic(&all, &hundred_a_minute(), regions.cut(2, 30, 100))
        .await;
    println!("admitted per whole window, with a 70 s partition: {per_window:?}");
    for &n in &per_window {
        assert!(n <= 200, "{n} admitted in a window: {per_window:?}");
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

/// Issue 34: a layer over a split store built without one of its policies answered every
/// request of that policy with a store error, which the default `OnStoreError::Allow`
/// let through unlimited. The layer refuses to build now, naming the policy.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_layer_over_a_split_store_refuses_a_policy_the_store_was_not_told_about() {
    let clock = TokioClock::new();
    let local = tollway_core::MemoryStore::builder()
        .clock(clock.clone())
        .build()
        .unwrap();
    let peer = tollway_core::MemoryStore::builder()
        .clock(clock.clone())
        .build()
        .unwrap();
    let declared = hundred_a_minute();
    let split = SplitStore::builder("eu", local, clock)
        .policy(&declared)
        .peer("us", peer)
        .build()
        .await
        .unwrap();
    let undeclared = Policy::new(
        "checkout",
        Algorithm::FixedWindow,
        Quota::per_minute(5).unwrap(),
    )
    .unwrap();
    let err = tollway_tower::RateLimitLayer::builder(split.clone(), declared.clone())
        .route(None, "/checkout", undeclared)
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"checkout\"") && err.contains(".policy("),
        "{err}"
    );
    assert!(
        tollway_tower::RateLimitLayer::builder(split, declared)
            .build()
            .is_ok()
    );
}

/// Issue 34: a reset or refund on a region's store changed that region only, and the
/// others' state (replicated back, or counted in the split) undid it without a word. Both
/// region stores refuse them now, saying what to do; a peek still answers.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn region_stores_refuse_a_reset_or_refund_that_would_change_one_region() {
    let clock = TokioClock::new();
    let memory = || {
        tollway_core::MemoryStore::builder()
            .clock(clock.clone())
            .build()
            .unwrap()
    };
    let policy = hundred_a_minute();
    let replicated = ReplicatedStore::builder(memory())
        .peer("us", memory())
        .build()
        .unwrap();
    let split = SplitStore::builder("eu", memory(), clock.clone())
        .policy(&policy)
        .peer("us", memory())
        .build()
        .await
        .unwrap();
    for (name, answer) in [
        (
            "ReplicatedStore",
            replicated.operate(b"k", &[&policy], Operation::Reset).await,
        ),
        (
            "ReplicatedStore",
            replicated
                .operate(b"k", &[&policy], Operation::Refund(1))
                .await,
        ),
        (
            "SplitStore",
            split.operate(b"k", &[&policy], Operation::Reset).await,
        ),
        (
            "SplitStore",
            split.operate(b"k", &[&policy], Operation::Refund(1)).await,
        ),
    ] {
        let err = answer.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Other);
        let message = err.to_string();
        assert!(
            message.contains(name) && message.contains("each region's own store"),
            "{message}"
        );
    }
    assert!(
        replicated
            .operate(b"k", &[&policy], Operation::Peek(1))
            .await
            .is_ok()
    );
    assert!(
        split
            .operate(b"k", &[&policy], Operation::Peek(1))
            .await
            .is_ok()
    );
}
