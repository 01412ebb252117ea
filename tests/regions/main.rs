//! The multi-region harness (issue 21): regions are `redis-server`s on loopback, and the
//! distance between them is [`LatencyProxy`]: a TCP proxy that delays every byte and can
//! cut the link. These tests pin what the harness does, so the multi-region modes can be
//! measured on it: the delay each way, a cut that holds traffic and a heal that delivers
//! it, and a store reaching a Redis across the distance paying the round trip — and,
//! when the link is cut, failing within its timeout rather than hanging.
//!
//! By topic: the harness itself (`proxy`), replicated regions (`replicated`), split
//! regions (`split`), and what region stores refuse (`refusals`).

#![allow(clippy::unwrap_used)]

mod proxy;
mod refusals;
mod replicated;
mod split;

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
    support::redis_store()
        .prefix(prefix)
        .caller_time(clock.clone())
        .deny_cache(0)
        .without_breaker()
        .without_local_fallback()
        .timeout(Duration::from_secs(3_600))
        // The paused clock moves while a reply is on its way: no stall watch either.
        .without_stall_detection()
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
