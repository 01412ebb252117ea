//! Leases against one call a request, side by side on one `redis-server`: one hot key,
//! three gateways (store instances) sharing it.
//!
//! ```sh
//! cargo bench -p tests --bench leases
//! ```
//!
//! Starts its own `redis-server` on a free loopback port. Two parts:
//!
//! 1. **Shares, on a manual clock.** 3 s of traffic at half and at twice a limit of
//!    50,000 a second, in 1 ms steps: each step's requests go at once, then the clock
//!    moves on (after a real millisecond, so that renewals land as they would). Every
//!    decision of a step is at one known instant, so the exact
//!    algorithm can replay what was admitted (over-admission: the admissions it refuses)
//!    and what was asked (the share of what it admits). Redis calls are `INFO
//!    commandstats`' script calls. The stores pass the manual clock to the scripts.
//! 2. **Cost and latency, on real time.** 5 s paced at 25,000 a second (half the
//!    limit) on the server's clock, the default: Redis calls and CPU (`INFO cpu`) a
//!    decision, and each decision's latency, renewals running beside. Then a cold
//!    workload: 20,000 keys each asked once. The memory store's latency on the same
//!    harness is the floor.

#![allow(clippy::unwrap_used, missing_docs)]

use std::time::{Duration, Instant};

use support::{RedisServer, command_calls};
use tollway_core::{
    Algorithm, BoxStore, Clock, Leased, ManualClock, MemoryStore, Policy, Quota, RedisStore, Store,
};

const LIMIT: u32 = 50_000;
const GATEWAYS: usize = 3;

fn quota(algorithm: Algorithm) -> Quota {
    let quota = Quota::per_second(LIMIT.into()).unwrap();
    if algorithm.uses_burst() {
        quota.with_burst((LIMIT / 10).into()).unwrap()
    } else {
        quota
    }
}

/// The lending algorithms but the meter, which is the token bucket's arithmetic.
const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::Gcra,
    Algorithm::TokenBucket,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindowCounter,
];

async fn scripts(node: &mut redis::aio::MultiplexedConnection) -> u64 {
    command_calls(node, "evalsha").await + command_calls(node, "eval").await
}

/// Seconds of CPU the server used (user and system).
async fn cpu(node: &mut redis::aio::MultiplexedConnection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(node)
        .await
        .unwrap();
    ["used_cpu_sys:", "used_cpu_user:"]
        .iter()
        .map(|field| {
            info.lines()
                .find_map(|l| l.strip_prefix(field))
                .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
        })
        .sum()
}

/// Three gateways on `url`: stores of their own, leasing or not.
async fn gateways(
    url: &str,
    prefix: &str,
    clock: Option<&ManualClock>,
    leased: bool,
) -> Vec<BoxStore> {
    let mut out = Vec::new();
    for _ in 0..GATEWAYS {
        let mut builder = RedisStore::builder()
            .prefix(prefix)
            .timeout(Duration::from_secs(5));
        if let Some(clock) = clock {
            builder = builder.caller_time(clock.clone());
        }
        let store = builder.connect(url).await.unwrap();
        out.push(match (leased, clock) {
            (false, _) => BoxStore::new(store),
            (true, Some(clock)) => {
                BoxStore::new(Leased::builder(store).clock(clock.clone()).build().unwrap())
            }
            (true, None) => BoxStore::new(Leased::new(store).unwrap()),
        });
    }
    out
}

struct Shares {
    requests: u64,
    admitted: u64,
    allowed: u64,
    over: u64,
    calls: u64,
}

/// What the exact algorithm admits of `events`, one at a time at its instant; and how
/// many of `admitted` it refuses.
fn exact(policy: &Policy, events: &[(u64, bool)]) -> (u64, u64) {
    let run = |events: &mut dyn Iterator<Item = u64>| {
        let clock = ManualClock::at_micros(0);
        let model = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let mut yes = 0;
        for at in events {
            clock.set_micros(at);
            yes += u64::from(model.decide(b"model", &[policy], 1).is_allowed());
        }
        yes
    };
    let allowed = run(&mut events.iter().map(|e| e.0));
    let admitted: Vec<u64> = events.iter().filter(|e| e.1).map(|e| e.0).collect();
    let accepted = run(&mut admitted.iter().copied());
    (allowed, admitted.len() as u64 - accepted)
}

async fn shares(server: &RedisServer, algorithm: Algorithm, leased: bool, demand: f64) -> Shares {
    let clock = ManualClock::at_micros(1_800_000_000_000_000);
    let prefix = format!("shares-{}-{leased}-{demand}", algorithm.name());
    let stores = gateways(&server.url(), &prefix, Some(&clock), leased).await;
    let policy = Policy::new("hot", algorithm, quota(algorithm)).unwrap();
    let mut node = server.connection().await;
    let before = scripts(&mut node).await;
    let per_step = f64::from(LIMIT) * demand / 1_000.0;
    let mut events = Vec::new();
    let mut owed = 0.0;
    for _ in 0..3_000 {
        clock.advance(Duration::from_millis(1));
        owed += per_step;
        let n = owed as usize;
        owed -= n as f64;
        let asks = (0..n).map(|i| {
            let store = stores[i % GATEWAYS].clone();
            let policy = policy.clone();
            async move {
                store
                    .check(b"hot", &[&policy], 1)
                    .await
                    .unwrap()
                    .is_allowed()
            }
        });
        let at = clock.now_micros();
        for allowed in join_all(asks).await {
            events.push((at, allowed));
        }
        // A step lasts a real millisecond too, so that calls on their way (renewals)
        // land within about the step they would at full speed.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let calls = scripts(&mut node).await - before;
    let (allowed, over) = exact(&policy, &events);
    Shares {
        requests: events.len() as u64,
        admitted: events.iter().filter(|e| e.1).count() as u64,
        allowed,
        over,
        calls,
    }
}

/// Polls every future together on this task (every call in flight at once), and
/// returns their answers in order.
async fn join_all<F: std::future::Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut futures: Vec<_> = futures.map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, out) in futures.iter_mut().zip(outputs.iter_mut()) {
            if out.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *out = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().map(Option::unwrap).collect()
}

struct Costs {
    decisions: u64,
    calls: u64,
    cpu_s: f64,
    latencies: Vec<Duration>,
}

/// `rate` decisions a second for `seconds` on real time, through 48 tasks over the
/// gateways; `keys` distinct keys (1: one hot key), each task's in turn.
async fn costs(
    stores: &[BoxStore],
    policy: &Policy,
    rate: u64,
    seconds: u64,
    keys: u64,
    node: Option<&mut redis::aio::MultiplexedConnection>,
) -> Costs {
    const TASKS: u64 = 48;
    let mut node = node;
    let (calls0, cpu0) = match node.as_deref_mut() {
        Some(n) => (scripts(n).await, cpu(n).await),
        None => (0, 0.0),
    };
    let start = tokio::time::Instant::now();
    let per_task = rate * seconds / TASKS;
    let interval = Duration::from_secs_f64(TASKS as f64 / rate as f64);
    let mut handles = Vec::new();
    for t in 0..TASKS {
        let store = stores[t as usize % stores.len()].clone();
        let policy = policy.clone();
        handles.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(per_task as usize);
            for i in 0..per_task {
                tokio::time::sleep_until(start + interval * i as u32).await;
                let key = if keys == 1 {
                    "hot".to_owned()
                } else {
                    format!("cold-{}", (i * TASKS + t) % keys)
                };
                let sent = Instant::now();
                let _ = store.check(key.as_bytes(), &[&policy], 1).await.unwrap();
                latencies.push(sent.elapsed());
            }
            latencies
        }));
    }
    let mut latencies = Vec::new();
    for h in handles {
        latencies.extend(h.await.unwrap());
    }
    let (calls, cpu_s) = match node {
        Some(n) => (scripts(n).await - calls0, cpu(n).await - cpu0),
        None => (0, 0.0),
    };
    latencies.sort_unstable();
    Costs {
        decisions: latencies.len() as u64,
        calls,
        cpu_s,
        latencies,
    }
}

fn at(latencies: &[Duration], q: f64) -> f64 {
    let i = ((latencies.len() as f64 * q) as usize).min(latencies.len() - 1);
    latencies[i].as_secs_f64() * 1e6
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        println!("part 1: one hot key, {LIMIT} a second, 3 gateways, 3 s on a manual clock");
        println!(
            "{:<24} {:>6} {:>7} {:>9} {:>9} {:>9} {:>6} {:>8} {:>10}",
            "algorithm", "demand", "mode", "requests", "admitted", "exact", "over", "calls", "calls/dec"
        );
        for algorithm in ALGORITHMS {
            for demand in [0.5, 2.0] {
                for leased in [false, true] {
                    let s = shares(&server, algorithm, leased, demand).await;
                    println!(
                        "{:<24} {:>5.1}x {:>7} {:>9} {:>9} {:>9} {:>6} {:>8} {:>10.4}   share {:.2}%",
                        algorithm.name(),
                        demand,
                        if leased { "leased" } else { "per-req" },
                        s.requests,
                        s.admitted,
                        s.allowed,
                        s.over,
                        s.calls,
                        s.calls as f64 / s.requests as f64,
                        100.0 * s.admitted as f64 / s.allowed as f64,
                    );
                }
            }
        }

        println!();
        println!("part 2: real time, the server's clock, 25,000 a second for 5 s (half the limit)");
        println!(
            "{:<30} {:>9} {:>8} {:>10} {:>12} {:>8} {:>8} {:>8} {:>8}",
            "case", "decisions", "calls", "calls/dec", "cpu µs/dec", "p50 µs", "p99 µs", "p999 µs", "max µs"
        );
        let mut node = server.connection().await;
        for algorithm in [Algorithm::Gcra, Algorithm::FixedWindow] {
            let policy = Policy::new("hot", algorithm, quota(algorithm)).unwrap();
            for leased in [false, true] {
                let prefix = format!("costs-{}-{leased}", algorithm.name());
                let stores = gateways(&server.url(), &prefix, None, leased).await;
                let c = costs(&stores, &policy, 25_000, 5, 1, Some(&mut node)).await;
                report(
                    &format!("{} {}", algorithm.name(), if leased { "leased" } else { "per-request" }),
                    &c,
                );
            }
        }
        let policy = Policy::new("hot", Algorithm::Gcra, quota(Algorithm::Gcra)).unwrap();
        for leased in [false, true] {
            let stores = gateways(&server.url(), &format!("cold-{leased}"), None, leased).await;
            let c = costs(&stores, &policy, 10_000, 2, 20_000, Some(&mut node)).await;
            report(
                &format!("cold keys {}", if leased { "leased" } else { "per-request" }),
                &c,
            );
        }
        let memory = BoxStore::new(MemoryStore::new());
        let c = costs(&[memory], &policy, 25_000, 5, 1, None).await;
        report("memory store (the floor)", &c);
    });
}

fn report(case: &str, c: &Costs) {
    println!(
        "{:<30} {:>9} {:>8} {:>10.4} {:>12.2} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
        case,
        c.decisions,
        c.calls,
        c.calls as f64 / c.decisions as f64,
        c.cpu_s * 1e6 / c.decisions as f64,
        at(&c.latencies, 0.5),
        at(&c.latencies, 0.99),
        at(&c.latencies, 0.999),
        c.latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1e6),
    );
}
