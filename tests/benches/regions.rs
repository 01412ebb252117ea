//! One global Redis reached across regions: what a decision costs in latency when every
//! gateway decides against one Redis in one region (issue 21's baseline, the mode the
//! regional modes will be measured against).
//!
//! ```sh
//! cargo bench -p tests --bench regions
//! ```
//!
//! Three simulated regions on loopback: region A holds the `redis-server`; the gateways
//! of B and C reach it through the tests' [`LatencyProxy`], which delays every byte by
//! half the inter-region round trip each way. One gateway a region (its own
//! `RedisStore`, server time, no deny cache, so every decision is a round trip) decides
//! for one customer limited to 100 a second: each region sends one request every 20 ms
//! whatever the answers take (150 a second together, so the limit refuses some), 150 of
//! them, the three regions at once. For inter-region round trips of 20, 80 and 150 ms it prints each region's
//! decision latency (p50, p99) and the admissions against the limit over the run (a full
//! bucket and the refill: a global Redis is exact, so no run may exceed it).
//!
//! Part 2, the replicated mode (`ReplicatedStore`): three `redis-server`s, one a region,
//! every region reaching each other's through a proxy of its own. One gateway a region,
//! a `ReplicatedStore` over its own Redis with the other two as peers; one customer at
//! 100 a second (fixed window), every region sending 50 a second open loop for 5 s (150
//! a second together). For each inter-region round trip (20, 80, 150 ms) and sync
//! interval (10, 50, 200, 1,000 ms) it prints the admissions of the whole windows
//! (the stores decide on the system clock here, so the windows are whole seconds of it)
//! (mean, most), the over-admission of the worst window against the limit and against
//! the stated bound `(regions − 1) × (r × S + 1)` (r = 50 a second, S = the sync
//! interval plus the one-way latency), and the local decision latency; and it writes
//! `benches/regions.svg`, the worst window's over-admission against the sync interval,
//! one line a round trip.
//!
//! `REGIONS_PART=global|replicated|split|leased` runs one part alone.
//!
//! Part 3, the split mode (`SplitStore`): the same three regions, one customer at 100 a
//! second (fixed window), a `SplitStore` gateway a region over its own Redis posting on
//! the others'. For each round trip and lead (10, 50, 200, 500 ms: how long before a
//! window's end the demand is posted; it is read half that later), two runs of 5 s at
//! 150 a second in all: one region sending all of it (the others idle), then each
//! region 50 a second.
//! It prints the admissions of the whole windows after the first (the one the regions
//! learn in): one region's mean and least, all three's mean and most; the worst window
//! over the limit, the first included (never above zero: the mode never over-admits);
//! and the local decision latency; and writes `benches/regions-split.svg`, one region's
//! admissions (% of the limit) against the lead, one line a round trip.

#![allow(clippy::unwrap_used, missing_docs)]

use std::time::{Duration, Instant};

use support::RedisServer;
use support::proxy::LatencyProxy;
use support::regions::Regions;
use tollway_core::{
    Algorithm, Clock, Policy, Quota, RedisStore, ReplicatedStore, SplitStore, Store, SystemClock,
};

const DECISIONS: usize = 150;
const PER_SECOND: u32 = 100;
const EVERY: Duration = Duration::from_millis(20);

struct Region {
    name: &'static str,
    latencies: Vec<Duration>,
    admitted: usize,
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e3
}

async fn gateway(name: &'static str, url: String, prefix: String, policy: Policy) -> Region {
    let store = RedisStore::builder()
        .prefix(prefix)
        .timeout(Duration::from_secs(5))
        .deny_cache(0)
        .without_local_fallback()
        // Regions apart: round trips past any stall threshold; the timeout decides.
        .without_stall_detection()
        .connect(&url)
        .await
        .unwrap();
    // Open loop: a request every EVERY whatever the answers take, as callers send.
    let mut ticks = tokio::time::interval(EVERY);
    let mut pending = tokio::task::JoinSet::new();
    for _ in 0..DECISIONS {
        ticks.tick().await;
        let (store, policy) = (store.clone(), policy.clone());
        pending.spawn(async move {
            let before = Instant::now();
            let decisions = store.check(b"customer", &[&policy], 1).await.unwrap();
            (before.elapsed(), decisions.is_allowed())
        });
    }
    let (mut latencies, mut admitted) = (Vec::with_capacity(DECISIONS), 0);
    while let Some(answer) = pending.join_next().await {
        let (took, allowed) = answer.unwrap();
        latencies.push(took);
        admitted += usize::from(allowed);
    }
    latencies.sort();
    Region {
        name,
        latencies,
        admitted,
    }
}

#[tokio::main]
async fn main() {
    let part = std::env::var("REGIONS_PART").unwrap_or_default();
    if part.is_empty() || part == "global" {
        global().await;
        println!();
    }
    if part.is_empty() || part == "replicated" {
        replicated().await;
        println!();
    }
    if part.is_empty() || part == "split" {
        split().await;
        println!();
    }
    if part.is_empty() || part == "leased" {
        leased().await;
    }
}

/// Part 4: leases from the one global Redis in region A. Each region's gateway is a
/// `Leased` over its `RedisStore` (server time, the deny cache on), horizon 500 ms and
/// loans of up to 30% of the capacity: long enough for a renewal to come back across
/// 150 ms. The customer at 100 a second (GCRA); each region sends one request every
/// 20 ms open loop for 5 s (150 a second together). A second run cuts region C off from
/// 2 s to 3.5 s. Prints each region's decision latency, the admissions against the
/// limit over the run (a full bucket and its refill), and C's admissions while cut off.
async fn leased() {
    let server = RedisServer::start();
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let policy = Policy::new(
        "leased",
        Algorithm::Gcra,
        Quota::per_second(PER_SECOND.into()).unwrap(),
    )
    .unwrap();
    println!(
        "leases from one global Redis in region A; every region a request each {SEND_EVERY:?} \
         for {RUN:?}; {PER_SECOND}/s for one customer; horizon 500 ms, max_share 0.3"
    );
    println!();
    println!(
        "| round trip A–B, A–C | C cut off | A p50 / p99 ms | B p50 / p99 ms | C p50 / p99 ms | admitted (A, B, C) | the limit over the run | C admitted while cut off |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for rtt_ms in RTTS_MS {
        for cut in [false, true] {
            let one_way = Duration::from_micros(rtt_ms * 500);
            let to_b = LatencyProxy::start(target, one_way).await;
            let to_c = LatencyProxy::start(target, one_way).await;
            let prefix = support::unique_prefix(&format!("leased-{rtt_ms}-{cut}"));
            let mut gateways = Vec::new();
            for url in [server.url(), to_b.redis_url(), to_c.redis_url()] {
                let store = RedisStore::builder()
                    .prefix(prefix.clone())
                    .timeout(Duration::from_millis(400))
                    .without_local_fallback()
                    // Regions apart: round trips past any stall threshold; the timeout decides.
                    .without_stall_detection()
                    .connect(&url)
                    .await
                    .unwrap();
                gateways.push(
                    tollway_core::Leased::builder(store)
                        .horizon(Duration::from_millis(500))
                        .max_share(0.3)
                        .build()
                        .unwrap(),
                );
            }
            let epoch = Instant::now();
            let cutter = async {
                if cut {
                    tokio::time::sleep(Duration::from_millis(2_000)).await;
                    to_c.cut();
                    tokio::time::sleep(Duration::from_millis(1_500)).await;
                    to_c.heal();
                }
            };
            let (a, b, c, ()) = tokio::join!(
                leased_sender(gateways[0].clone(), policy.clone(), epoch),
                leased_sender(gateways[1].clone(), policy.clone(), epoch),
                leased_sender(gateways[2].clone(), policy.clone(), epoch),
                cutter,
            );
            let ran = epoch.elapsed();
            let limit = f64::from(PER_SECOND) * (1.0 + ran.as_secs_f64());
            let admitted = a.admitted.len() + b.admitted.len() + c.admitted.len();
            let while_cut = c
                .admitted
                .iter()
                .filter(|at| (2_000..3_500).contains(&at.as_millis()))
                .count();
            let p = |r: &Sent| {
                let mut l = r.latencies.clone();
                l.sort();
                format!("{:.3} / {:.3}", percentile(&l, 0.5), percentile(&l, 0.99))
            };
            println!(
                "| {rtt_ms} ms | {} | {} | {} | {} | {admitted} ({}, {}, {}) | {limit:.0} in {:.1} s | {} |",
                if cut { "2–3.5 s" } else { "no" },
                p(&a),
                p(&b),
                p(&c),
                a.admitted.len(),
                b.admitted.len(),
                c.admitted.len(),
                ran.as_secs_f64(),
                if cut {
                    while_cut.to_string()
                } else {
                    "–".to_owned()
                },
            );
            assert!(
                admitted as f64 <= limit,
                "leases admitted {admitted}, over {limit}"
            );
        }
    }
}

/// What one region's sender saw: when each admitted request was sent (from the run's
/// start), and each decision's latency (errors count as refusals).
struct Sent {
    admitted: Vec<Duration>,
    latencies: Vec<Duration>,
}

async fn leased_sender<G: Store + Clone>(gateway: G, policy: Policy, epoch: Instant) -> Sent {
    let mut ticks = tokio::time::interval(SEND_EVERY);
    let mut pending = tokio::task::JoinSet::new();
    while epoch.elapsed() < RUN {
        ticks.tick().await;
        let (gateway, policy) = (gateway.clone(), policy.clone());
        pending.spawn(async move {
            let (at, before) = (epoch.elapsed(), Instant::now());
            let allowed = gateway
                .check(b"customer", &[&policy], 1)
                .await
                .is_ok_and(|d| d.is_allowed());
            (at, before.elapsed(), allowed)
        });
    }
    let mut sent = Sent {
        admitted: Vec::new(),
        latencies: Vec::new(),
    };
    while let Some(answer) = pending.join_next().await {
        let (at, took, allowed) = answer.unwrap();
        sent.latencies.push(took);
        if allowed {
            sent.admitted.push(at);
        }
    }
    sent
}

/// Part 1: one global Redis in region A.
async fn global() {
    let server = RedisServer::start();
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let policy = Policy::new(
        "global",
        Algorithm::Gcra,
        Quota::per_second(PER_SECOND.into()).unwrap(),
    )
    .unwrap();
    println!(
        "one global Redis in region A; {DECISIONS} decisions a region every {EVERY:?}, the \
         regions at once; {PER_SECOND}/s for one customer"
    );
    println!();
    println!(
        "| round trip A–B, A–C | region | p50 ms | p99 ms | admitted (all regions) | limit over the run |"
    );
    println!("|---|---|---|---|---|---|");
    for rtt_ms in [20u64, 80, 150] {
        let one_way = Duration::from_micros(rtt_ms * 500);
        let to_b = LatencyProxy::start(target, one_way).await;
        let to_c = LatencyProxy::start(target, one_way).await;
        let prefix = support::unique_prefix(&format!("regions-{rtt_ms}"));
        let started = Instant::now();
        let regions = tokio::join!(
            gateway("A", server.url(), prefix.clone(), policy.clone()),
            gateway("B", to_b.redis_url(), prefix.clone(), policy.clone()),
            gateway("C", to_c.redis_url(), prefix, policy.clone()),
        );
        let ran = started.elapsed();
        let regions = [regions.0, regions.1, regions.2];
        let admitted: usize = regions.iter().map(|r| r.admitted).sum();
        let limit = f64::from(PER_SECOND) * (1.0 + ran.as_secs_f64());
        for region in &regions {
            println!(
                "| {rtt_ms} ms | {} | {:.2} | {:.2} | {admitted} ({}) | {limit:.0} in {:.1} s |",
                region.name,
                percentile(&region.latencies, 0.50),
                percentile(&region.latencies, 0.99),
                region.admitted,
                ran.as_secs_f64(),
            );
        }
        assert!(
            admitted as f64 <= limit,
            "a global Redis admitted {admitted}, over {limit}"
        );
    }
}

const REGIONS: usize = 3;
const SEND_EVERY: Duration = Duration::from_millis(20);
const RUN: Duration = Duration::from_secs(5);
const SYNCS_MS: [u64; 4] = [10, 50, 200, 1_000];
const RTTS_MS: [u64; 3] = [20, 80, 150];

/// One region's gateway sending open loop for `RUN` from `epoch`: when each admitted
/// request was sent (the stores' clock, µs), and each decision's latency.
async fn sender<G: Store + Clone>(
    gateway: G,
    policy: Policy,
    epoch: Instant,
) -> (Vec<u64>, Vec<Duration>) {
    let mut ticks = tokio::time::interval(SEND_EVERY);
    let mut pending = tokio::task::JoinSet::new();
    while epoch.elapsed() < RUN {
        ticks.tick().await;
        let (gateway, policy) = (gateway.clone(), policy.clone());
        pending.spawn(async move {
            let (at, before) = (SystemClock.now_micros(), Instant::now());
            let decisions = gateway.check(b"customer", &[&policy], 1).await.unwrap();
            (at, before.elapsed(), decisions.is_allowed())
        });
    }
    let (mut admitted, mut latencies) = (Vec::new(), Vec::new());
    while let Some(answer) = pending.join_next().await {
        let (at, took, allowed) = answer.unwrap();
        latencies.push(took);
        if allowed {
            admitted.push(at);
        }
    }
    (admitted, latencies)
}

/// A gateway's Redis store: caller time on the system clock (so the stores' windows are
/// whole seconds of it), no deny cache, no fallback.
async fn connect(url: String, prefix: String) -> RedisStore {
    RedisStore::builder()
        .prefix(prefix)
        .timeout(Duration::from_secs(5))
        .caller_time(SystemClock)
        .deny_cache(0)
        .without_local_fallback()
        // Regions apart: round trips past any stall threshold; the timeout decides.
        .without_stall_detection()
        .connect(&url)
        .await
        .unwrap()
}

/// A gateway a region, made by `gateway(name, local, peers)` from its name
/// (`region-{i}`), its own Redis and the others' as it reaches them (named alike).
async fn gateways<G, F, Fut>(regions: &Regions, prefix: &str, mut gateway: F) -> Vec<G>
where
    F: FnMut(String, RedisStore, Vec<(String, RedisStore)>) -> Fut,
    Fut: std::future::Future<Output = G>,
{
    let mut gateways = Vec::new();
    for i in 0..REGIONS {
        let local = connect(regions.url(i, i), prefix.to_owned()).await;
        let mut peers = Vec::new();
        for j in (0..REGIONS).filter(|&j| j != i) {
            peers.push((
                format!("region-{j}"),
                connect(regions.url(i, j), prefix.to_owned()).await,
            ));
        }
        gateways.push(gateway(format!("region-{i}"), local, peers).await);
    }
    gateways
}

/// Every gateway of `gateways` sending open loop for `RUN`: the admissions of each whole
/// window of the stores (whole seconds of the system clock; the first and last, partial,
/// left out), all regions together, and every decision's latency, sorted.
async fn run<G: Store + Clone>(gateways: &[G], policy: &Policy) -> (Vec<u64>, Vec<Duration>) {
    let epoch = Instant::now();
    let runs: Vec<_> = gateways
        .iter()
        .map(|g| tokio::spawn(sender(g.clone(), policy.clone(), epoch)))
        .collect();
    let mut per_window = std::collections::BTreeMap::<u64, u64>::new();
    let mut latencies = Vec::new();
    for run in runs {
        let (admitted, took) = run.await.unwrap();
        latencies.extend(took);
        for at in admitted {
            *per_window.entry(at / 1_000_000).or_default() += 1;
        }
    }
    latencies.sort();
    let whole: Vec<u64> = per_window.values().copied().collect();
    let whole = whole
        .get(1..whole.len().saturating_sub(1))
        .unwrap_or_default()
        .to_vec();
    (whole, latencies)
}

/// Part 2: the replicated mode over a range of round trips and sync intervals.
async fn replicated() {
    let regions = Regions::start(REGIONS, Duration::ZERO).await;
    let policy = Policy::new(
        "replicated",
        Algorithm::FixedWindow,
        Quota::per_second(PER_SECOND.into()).unwrap(),
    )
    .unwrap();
    let rate = 1.0 / SEND_EVERY.as_secs_f64();
    println!(
        "replicated: {REGIONS} regions, each sending {rate:.0}/s for {RUN:?}; {PER_SECOND}/s \
         for one customer (fixed window)"
    );
    println!();
    println!(
        "| round trip | sync every | admitted a whole window: mean / most | worst window over the limit | stated bound | local p50 / p99 ms |"
    );
    println!("|---|---|---|---|---|---|");
    let mut lines: Vec<(u64, Vec<(u64, f64)>)> = Vec::new();
    for rtt_ms in RTTS_MS {
        regions.set_one_way(Duration::from_micros(rtt_ms * 500));
        let mut points = Vec::new();
        for sync_ms in SYNCS_MS {
            let prefix = support::unique_prefix(&format!("replicated-{rtt_ms}-{sync_ms}"));
            let gateways = gateways(&regions, &prefix, |_, local, peers| async move {
                let builder =
                    ReplicatedStore::builder(local).sync_every(Duration::from_millis(sync_ms));
                let builder = peers.into_iter().fold(builder, |b, (n, p)| b.peer(n, p));
                builder.build().unwrap()
            })
            .await;
            let (whole, latencies) = run(&gateways, &policy).await;
            let mean = whole.iter().sum::<u64>() as f64 / whole.len().max(1) as f64;
            let most = whole.iter().copied().max().unwrap_or(0);
            let over = most.saturating_sub(u64::from(PER_SECOND));
            // A round every sync interval, whatever the answers take; a charge lands one
            // way after it is sent.
            let staleness = (sync_ms + rtt_ms / 2) as f64 / 1e3;
            let bound = (REGIONS - 1) as f64 * (rate * staleness + 1.0);
            println!(
                "| {rtt_ms} ms | {sync_ms} ms | {mean:.1} / {most} | {over} ({:.0}%) | {bound:.0} | {:.2} / {:.2} |",
                100.0 * over as f64 / f64::from(PER_SECOND),
                percentile(&latencies, 0.50),
                percentile(&latencies, 0.99),
            );
            points.push((sync_ms, 100.0 * over as f64 / f64::from(PER_SECOND)));
            for gateway in &gateways {
                gateway.sync_now().await;
            }
        }
        lines.push((rtt_ms, points));
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/regions.svg");
    let plot = Plot {
        title: "ReplicatedStore: worst window over the limit vs sync interval",
        x_label: "sync interval (ms, log scale)",
        y_label: "over-admission (% of the limit)",
        xs: &SYNCS_MS,
    };
    std::fs::write(path, plot.svg(&lines)).unwrap();
    println!();
    println!("wrote {path}");
}

const LEADS_MS: [u64; 4] = [10, 50, 200, 500];

/// Part 3: the split mode over a range of round trips and leads (how long before a
/// window's end each region posts its demand; it reads the others' half that later).
async fn split() {
    let regions = Regions::start(REGIONS, Duration::ZERO).await;
    let policy = Policy::new(
        "split",
        Algorithm::FixedWindow,
        Quota::per_second(PER_SECOND.into()).unwrap(),
    )
    .unwrap();
    let rate = 1.0 / SEND_EVERY.as_secs_f64();
    println!(
        "split: {REGIONS} regions, {:.0}/s from one region or {rate:.0}/s from each, for \
         {RUN:?}; {PER_SECOND}/s for one customer (fixed window); whole windows after the first",
        rate * REGIONS as f64
    );
    println!();
    println!(
        "| round trip | lead | one region: admitted a window, mean / least | three regions: mean / most | worst window over the limit | local p50 / p99 ms |"
    );
    println!("|---|---|---|---|---|---|");
    let mut lines: Vec<(u64, Vec<(u64, f64)>)> = Vec::new();
    for rtt_ms in RTTS_MS {
        regions.set_one_way(Duration::from_micros(rtt_ms * 500));
        let mut points = Vec::new();
        for lead_ms in LEADS_MS {
            let mut cells = Vec::new();
            let mut worst = 0;
            let mut latencies = Vec::new();
            // One region sending as much as all three do (three senders there), then
            // each region one sender.
            for senders in [[0; REGIONS], [0, 1, 2]] {
                let prefix = support::unique_prefix(&format!("split-{rtt_ms}-{lead_ms}"));
                let gateways = gateways(&regions, &prefix, |name, local, peers| {
                    let builder = SplitStore::builder(name, local, SystemClock)
                        .policy(&policy)
                        .lead(Duration::from_millis(lead_ms));
                    let builder = peers.into_iter().fold(builder, |b, (n, p)| b.peer(n, p));
                    async move { builder.build().await.unwrap() }
                })
                .await;
                let sending: Vec<_> = senders.iter().map(|&r| gateways[r].clone()).collect();
                let (whole, took) = run(&sending, &policy).await;
                latencies.extend(took);
                // The first whole window is the one the regions learn in.
                let learnt = whole.get(1..).unwrap_or_default();
                let mean = learnt.iter().sum::<u64>() as f64 / learnt.len().max(1) as f64;
                let least = learnt.iter().copied().min().unwrap_or(0);
                let most = learnt.iter().copied().max().unwrap_or(0);
                worst = worst.max(whole.iter().copied().max().unwrap_or(0));
                cells.push((mean, least, most));
            }
            latencies.sort();
            let over = worst.saturating_sub(u64::from(PER_SECOND));
            println!(
                "| {rtt_ms} ms | {lead_ms} ms | {:.1} / {} | {:.1} / {} | {over} | {:.2} / {:.2} |",
                cells[0].0,
                cells[0].1,
                cells[1].0,
                cells[1].2,
                percentile(&latencies, 0.50),
                percentile(&latencies, 0.99),
            );
            points.push((lead_ms, 100.0 * cells[0].0 / f64::from(PER_SECOND)));
        }
        lines.push((rtt_ms, points));
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/regions-split.svg");
    let plot = Plot {
        title: "SplitStore: one region's admissions (% of the limit) vs lead",
        x_label: "lead (ms, log scale)",
        y_label: "admitted a window (% of the limit)",
        xs: &LEADS_MS,
    };
    std::fs::write(path, plot.svg(&lines)).unwrap();
    println!();
    println!("wrote {path}");
}

/// A line plot against a log-scale x axis from 10 to 1,000.
struct Plot<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    xs: &'a [u64],
}

impl Plot<'_> {
    /// Percentages against the x values, one line a round trip.
    fn svg(&self, lines: &[(u64, Vec<(u64, f64)>)]) -> String {
        let (width, height, left, bottom, top, right) = (640.0, 400.0, 70.0, 60.0, 40.0, 150.0);
        let most = lines
            .iter()
            .flat_map(|(_, points)| points.iter().map(|p| p.1))
            .fold(10.0f64, f64::max);
        let y_top = (most / 10.0).ceil() * 10.0;
        let x = |ms: u64| left + ((ms as f64).log10() - 1.0) / 2.0 * (width - left - right);
        let y = |pct: f64| height - bottom - pct / y_top * (height - bottom - top);
        let colours = ["#1f77b4", "#d62728", "#2ca02c"];
        let mut out = format!(
            r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>
<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="black"/>
<line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="black"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text x="18" y="{}" transform="rotate(-90 18 {})" text-anchor="middle">{}</text>
"##,
            (width - right + left) / 2.0,
            self.title,
            height - bottom,
            width - right,
            height - bottom,
            height - bottom,
            (width - right + left) / 2.0,
            height - 18.0,
            self.x_label,
            (height - bottom + top) / 2.0,
            (height - bottom + top) / 2.0,
            self.y_label,
        );
        for &ms in self.xs {
            out += &format!(
                r##"<text x="{:.1}" y="{}" text-anchor="middle">{ms}</text>
"##,
                x(ms),
                height - bottom + 18.0
            );
        }
        for step in 0..=5 {
            let pct = y_top * f64::from(step) / 5.0;
            out += &format!(
                r##"<text x="{}" y="{:.1}" text-anchor="end">{pct:.0}%</text>
<line x1="{left}" y1="{:.1}" x2="{}" y2="{:.1}" stroke="#ddd"/>
"##,
                left - 6.0,
                y(pct) + 4.0,
                y(pct),
                width - right,
                y(pct)
            );
        }
        for (k, (rtt, points)) in lines.iter().enumerate() {
            let colour = colours[k % colours.len()];
            let path: Vec<String> = points
                .iter()
                .map(|&(ms, pct)| format!("{:.1},{:.1}", x(ms), y(pct)))
                .collect();
            out += &format!(
                r##"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>
<text x="{}" y="{:.1}" fill="{colour}">{rtt} ms round trip</text>
"##,
                path.join(" "),
                width - right + 10.0,
                top + 20.0 + 18.0 * k as f64
            );
            for &(ms, pct) in points {
                out += &format!(
                    r##"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"/>
"##,
                    x(ms),
                    y(pct)
                );
            }
        }
        out + "</svg>\n"
    }
}
