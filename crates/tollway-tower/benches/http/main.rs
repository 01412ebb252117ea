//! tollway against plain axum and tower_governor over real HTTP, side by side in one run.
//!
//! ```sh
//! cargo bench -p tollway-tower --bench http
//! HTTP_BENCH_ROUNDS=3 HTTP_BENCH_MILLIS=1000 cargo bench -p tollway-tower --bench http
//! # only some variants (for a profiler), by the names in the table below
//! HTTP_BENCH_ONLY=tollway,governor cargo bench -p tollway-tower --bench http
//! ```
//!
//! Ten variants of the same axum hello-world server, each on its own `127.0.0.1:0`
//! listener in this process: the five the performance goals are about, two that pair
//! the allowed paths like for like, with and without rate-limit headers, and three that
//! show what a layer costs at all, what its headers cost, and where it is applied.
//!
//! | variant            | layer                                                             |
//! |--------------------|-------------------------------------------------------------------|
//! | `axum`             | none                                                              |
//! | `tollway`         | `RateLimitLayer`, `MemoryStore`, GCRA, a quota nothing reaches; defaults (`X-RateLimit-*` on every response) |
//! | `governor`         | `GovernorLayer`, the same quota; defaults (no headers on allowed responses) |
//! | `tollway-429`     | `RateLimitLayer`, 1 per hour: every measured request denied       |
//! | `governor-429`     | `GovernorLayer`, 1 per hour: every measured request denied        |
//! | `tollway-bare`    | as `tollway`, with `HeaderStyle::None`: like `governor`          |
//! | `governor-headers` | as `governor`, with `use_headers()` (limit, remaining): like `tollway` |
//! | `noop`             | `Router::layer` of a `MapRequestLayer` that returns the request: what any layer costs |
//! | `tollway-outside` | as `tollway`, but the layer wraps the whole `Router` instead of `Router::layer` |
//! | `headers-only`     | `Router::layer` of a `MapResponseLayer` adding tollway's three `X-RateLimit-*` headers with constant values: the floor of any layer that sends them |
//!
//! Both limiters key callers by the peer IP (tollway's `PeerIp`, tower_governor's
//! `PeerIpKeyExtractor`, both from axum's `ConnectInfo`). All load comes from 127.0.0.1,
//! so every request hits **one hot key**: the worst case for a keyed limiter's locking.
//! On denials tollway answers `Retry-After`, `X-RateLimit-*` and a JSON body,
//! tower_governor `Retry-After`, `X-RateLimit-After` and a text body.
//!
//! **Setup.** The machine this was written on has 2 vCPUs, shared by the server and the
//! load generator. By default (`HTTP_BENCH_LAYOUT=pinned`) the servers run on a tokio
//! runtime with one worker pinned to CPU 0 and the load generator is pinned to CPU 1, so
//! the server's core is the bottleneck and requests/s is what one core of server
//! achieves; `HTTP_BENCH_LAYOUT=shared` runs two unpinned workers beside the unpinned
//! load generator instead (a hot key locked from two cores). The load generator is one
//! thread (a current-thread runtime) driving 32 keep-alive HTTP/1.1 connections, each
//! with one request in flight (closed loop), with a small hand-written client
//! (`httparse` for the response head, no allocation per request). Each run also reports
//! the CPU share of the server and of the client, and requests per second of server CPU
//! time (from the threads' `schedstat`). Everything stays on loopback.
//!
//! **Instructions.** `HTTP_BENCH_COUNT=N` runs the selected variants for a fixed amount
//! of work instead (20 warm-up requests, then `N` on each connection, untimed), for an
//! instruction counter: `benches/instructions.sh` runs it under callgrind.
//!
//! **Method.** Rounds: each round runs every variant once, in an order rotated by one
//! each round, so a slow phase of the machine (another build, a noisy neighbour) hits
//! every variant alike; runs are short and rounds many, so that the variants compared
//! within a round ran seconds apart. A run opens fresh connections, warms up for 0.3 s
//! (which also spends the 1-per-hour variants' one allowed request), then measures for a
//! bounded time (`HTTP_BENCH_MILLIS`, default 1500) and at most 1,000,000 requests per
//! connection. Reported per variant: the median over rounds (`HTTP_BENCH_ROUNDS`,
//! default 10) of requests/s, p50 and p99; and the ratios the performance goals are
//! about, each the median of the per-round ratios (a paired comparison within a round),
//! with the spread of those ratios (their lowest and highest). The status of
//! every measured response is checked: the allowed variants must answer only 200, the
//! rejecting ones only 429. The defaults take about three minutes (10 variants × 1.8 s × 10);
//! BENCHMARKS.md uses `HTTP_BENCH_ROUNDS=30 HTTP_BENCH_MILLIS=300`.
//!
//! `HTTP_BENCH_SUITE=operate` runs what operating the layer costs beside it:
//! `tollway-shadow` (the whole layer in shadow mode, every request allowed),
//! `tollway-shadowed` (in shadow mode at 1 per hour: every measured request one the
//! layer would refuse, let through), `tollway-listener` (a listener that does nothing)
//! `tollway-metrics` (metrics recorded into `metrics-exporter-prometheus`; built with
//! `--features metrics`) and `tollway-config` (`tollway`'s limits from a limits file, with
//! a `config::Reloader` behind them), beside `tollway`, `tollway-429` and `tollway-bare`.
//!
//! The binary does nothing unless run by `cargo bench` (which passes `--bench`), so
//! `cargo test --benches` stays quick.

#![allow(clippy::unwrap_used)]

mod load;
mod variants;

use variants::{Fleet, Variant, app, huge_quota, memory_layer};

use load::{CONNECTIONS, Run, SERVER_THREADS, WARMUP, run, run_count, thread_id};
use std::error::Error;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tollway_core::{Algorithm, BreakerState, Policy, Quota, RedisStore, Store};
use tollway_tower::HeaderStyle;

type BoxError = Box<dyn Error + Send + Sync>;

/// Where the server and the load generator run (`HTTP_BENCH_LAYOUT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// The default: the server on one tokio worker pinned to CPU 0, the load generator
    /// pinned to CPU 1. The server's core is the bottleneck, so requests/s is what one
    /// core of server achieves, and nothing of the client's own work (such as parsing
    /// the longer responses that carry rate-limit headers) is charged to the server.
    Pinned,
    /// Two server workers and the load generator, unpinned, sharing both CPUs: the
    /// layout of the earlier runs, with a hot key locked from two cores.
    Shared,
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn env_number(name: &str, default: u64) -> Result<u64, BoxError> {
    match std::env::var(name) {
        Ok(text) => Ok(text
            .parse::<u64>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{name} must be a whole number above 0 (got {text:?})"))?),
        Err(_) => Ok(default),
    }
}

fn main() -> Result<(), BoxError> {
    // `cargo bench` passes --bench; `cargo test --benches` does not: do nothing then.
    if !std::env::args().any(|a| a == "--bench") {
        return Ok(());
    }
    let rounds = usize::try_from(env_number("HTTP_BENCH_ROUNDS", 10)?)?;
    let measure = Duration::from_millis(env_number("HTTP_BENCH_MILLIS", 1_500)?);

    let layout = match std::env::var("HTTP_BENCH_LAYOUT").as_deref() {
        Ok("shared") => Layout::Shared,
        Ok("pinned") | Err(_) => Layout::Pinned,
        Ok(other) => {
            return Err(format!("HTTP_BENCH_LAYOUT is pinned or shared (got {other:?})").into());
        }
    };
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    if layout == Layout::Pinned && cores.len() < 2 {
        return Err("the pinned layout needs two CPUs; run with HTTP_BENCH_LAYOUT=shared".into());
    }
    let server_core = cores.first().copied();
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(if layout == Layout::Pinned { 1 } else { 2 })
        .thread_name("server")
        .on_thread_start(move || {
            if let (Layout::Pinned, Some(core)) = (layout, server_core) {
                core_affinity::set_for_current(core);
            }
            if let (Some(tid), Ok(mut tids)) = (thread_id(), SERVER_THREADS.lock()) {
                tids.push(tid);
            }
        })
        .enable_all()
        .build()?;
    let suite_name = std::env::var("HTTP_BENCH_SUITE").ok();
    let fleet_suite = suite_name.as_deref() == Some("fleet");
    let suite: &[Variant] = match suite_name.as_deref() {
        Some("fleet") => &Variant::FLEET,
        Some("operate") => &Variant::OPERATE,
        _ => &Variant::ALL[..10],
    };
    let only = std::env::var("HTTP_BENCH_ONLY").ok();
    let selected: Vec<Variant> = suite
        .iter()
        .copied()
        .filter(|v| {
            only.as_deref()
                .is_none_or(|only| only.split(',').any(|s| s.trim() == v.short()))
        })
        .collect();
    // The fleet suite's servers: one healthy, one killed once its store has connected.
    let mut redis = Vec::new();
    let fleet = if suite.iter().any(|v| v.needs_redis()) {
        let healthy = support::RedisServer::start();
        let mut doomed = support::RedisServer::start();
        let fleet = server.block_on(async {
            let store = |url: String, cache: usize| async move {
                RedisStore::builder()
                    .timeout(Duration::from_millis(50))
                    .deny_cache(cache)
                    .without_local_fallback()
                    .connect(&url)
                    .await
            };
            // Its own breaker, opened below; no fallback: the layer lets requests through.
            let dead = RedisStore::builder()
                .timeout(Duration::from_millis(50))
                .deny_cache(0)
                .breaker(3, Duration::from_secs(1))
                .without_local_fallback()
                .connect(&doomed.url())
                .await?;
            doomed.kill();
            // Open the breaker before measuring: three failed decisions.
            let probe = Policy::new("probe", Algorithm::Gcra, Quota::per_second(1)?)?;
            for _ in 0..3 {
                let _ = dead.check(b"probe", &[&probe], 1).await;
            }
            if dead.breaker_state() != BreakerState::Open {
                return Err::<Fleet, BoxError>(
                    "the breaker did not open after three failures".into(),
                );
            }
            Ok(Fleet {
                healthy: store(healthy.url(), 0).await?,
                cached: store(healthy.url(), 65_536).await?,
                uncached: store(healthy.url(), 0).await?,
                dead,
            })
        })?;
        redis.push(healthy);
        redis.push(doomed);
        Some(fleet)
    } else {
        None
    };
    let mut addrs = Vec::new();
    for variant in Variant::ALL {
        if !selected.contains(&variant) {
            addrs.push(None);
            continue;
        }
        let app = app(variant, fleet.as_ref())?;
        let addr = server.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            if variant == Variant::TollwayOutside {
                // The layer around the whole router (`ServiceBuilder` style) rather than
                // through `Router::layer`, which clones a boxed route per request; its
                // body is turned back into axum's for `axum::serve`.
                let layer = memory_layer(huge_quota()?, HeaderStyle::Legacy)?;
                let service = tower::ServiceBuilder::new()
                    .map_response(axum::response::IntoResponse::into_response)
                    .layer(layer)
                    .service(app);
                let service = axum::ServiceExt::<axum::extract::Request>::into_make_service_with_connect_info::<SocketAddr>(service);
                tokio::spawn(async move {
                    if let Err(e) = axum::serve(listener, service).await {
                        eprintln!("server error: {e}");
                    }
                });
            } else {
                tokio::spawn(async move {
                    let service = app.into_make_service_with_connect_info::<SocketAddr>();
                    if let Err(e) = axum::serve(listener, service).await {
                        eprintln!("server error: {e}");
                    }
                });
            }
            Ok::<_, BoxError>(addr)
        })?;
        addrs.push(Some(addr));
    }

    if layout == Layout::Pinned
        && let Some(&core) = cores.get(1)
    {
        core_affinity::set_for_current(core);
    }
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;

    println!(
        "HTTP side by side: {CONNECTIONS} keep-alive connections, {} ms per run after {} ms warm-up, \
         {rounds} rounds in rotating order",
        measure.as_millis(),
        WARMUP.as_millis()
    );
    println!(
        "layout {layout:?}: server: tokio multi-thread runtime, {}; client: 1 thread{}; {} CPUs available",
        if layout == Layout::Pinned {
            "1 worker pinned to CPU 0"
        } else {
            "2 workers"
        },
        if layout == Layout::Pinned {
            " pinned to CPU 1"
        } else {
            ""
        },
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("keys: the peer IP for both limiters; all load comes from 127.0.0.1, so one hot key");
    println!();

    if selected.is_empty() {
        return Err("HTTP_BENCH_ONLY selects no variant: name some of \
                    axum, tollway, governor, tollway-429, governor-429"
            .into());
    }

    if let Ok(count) = std::env::var("HTTP_BENCH_COUNT") {
        let count: usize = count
            .parse()
            .map_err(|_| format!("HTTP_BENCH_COUNT must be a whole number (got {count:?})"))?;
        for &variant in &selected {
            let addr = addrs[variant.index()].ok_or("a selected variant has no server")?;
            let done = client.block_on(run_count(variant.expected_status(), addr, 20, count))?;
            println!("{}: {done} requests after the warm-up", variant.name());
        }
        return Ok(());
    }

    let n = selected.len();
    let mut runs: Vec<Vec<Run>> = (0..Variant::ALL.len()).map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for k in 0..n {
            let variant = selected[(round + k) % n];
            let addr = addrs[variant.index()].ok_or("a selected variant has no server")?;
            let result = client.block_on(run(
                variant.name(),
                variant.expected_status(),
                addr,
                measure,
            ))?;
            println!(
                "round {}  {:<24} {:>9.0} req/s  {:>9.0} per server cpu-s  p50 {:>7.1} µs  p99 {:>7.1} µs  cpu server {:>4.0}% client {:>4.0}%  ({} requests{})",
                round + 1,
                variant.name(),
                result.requests_per_sec,
                result.per_server_cpu_sec,
                result.p50_us,
                result.p99_us,
                result.server_cpu * 100.0,
                result.client_cpu * 100.0,
                result.requests,
                if result.unexpected > 0 {
                    format!(", {} with an unexpected status!", result.unexpected)
                } else {
                    String::new()
                }
            );
            runs[variant.index()].push(result);
        }
    }

    println!();
    println!("median over {rounds} rounds");
    println!(
        "{:<24} {:>10} {:>12} {:>10} {:>10} {:>11} {:>11} {:>12}",
        "variant",
        "req/s",
        "per cpu-s",
        "p50 µs",
        "p99 µs",
        "server cpu",
        "client cpu",
        "unexpected"
    );
    for &variant in &selected {
        let rs = &runs[variant.index()];
        let mut rps: Vec<f64> = rs.iter().map(|r| r.requests_per_sec).collect();
        let mut p50: Vec<f64> = rs.iter().map(|r| r.p50_us).collect();
        let mut p99: Vec<f64> = rs.iter().map(|r| r.p99_us).collect();
        let mut per_cpu: Vec<f64> = rs.iter().map(|r| r.per_server_cpu_sec).collect();
        let mut server_cpu: Vec<f64> = rs.iter().map(|r| r.server_cpu * 100.0).collect();
        let mut client_cpu: Vec<f64> = rs.iter().map(|r| r.client_cpu * 100.0).collect();
        let unexpected: usize = rs.iter().map(|r| r.unexpected).sum();
        println!(
            "{:<24} {:>10.0} {:>12.0} {:>10.1} {:>10.1} {:>10.0}% {:>10.0}% {:>12}",
            variant.name(),
            median(&mut rps),
            median(&mut per_cpu),
            median(&mut p50),
            median(&mut p99),
            median(&mut server_cpu),
            median(&mut client_cpu),
            unexpected
        );
    }

    let total_unexpected: usize = runs.iter().flatten().map(|r| r.unexpected).sum();
    if total_unexpected > 0 {
        return Err(format!(
            "{total_unexpected} measured responses had an unexpected status: the quotas are wrong"
        )
        .into());
    }
    if n < suite.len() {
        return Ok(());
    }

    // Ratios of throughput, each the median of the per-round ratios, with their spread.
    // Each ratio twice: of requests/s (wall clock), and of requests per second of server
    // CPU time (what one busy server core achieves, whatever the host took meanwhile).
    let line = |label: &str, a: Variant, b: Variant, goal: Option<f64>| {
        let ratios = |metric: fn(&Run) -> f64| {
            let mut r: Vec<f64> = runs[a.index()]
                .iter()
                .zip(&runs[b.index()])
                .map(|(x, y)| metric(x) / metric(y) * 100.0)
                .collect();
            let mid = median(&mut r);
            (
                mid,
                r.first().copied().unwrap_or(0.0),
                r.last().copied().unwrap_or(0.0),
            )
        };
        // A pair with a variant outside the suite has nothing to compare.
        if runs[a.index()].is_empty() || runs[b.index()].is_empty() {
            return;
        }
        let (wall, wall_low, wall_high) = ratios(|r| r.requests_per_sec);
        let (cpu, cpu_low, cpu_high) = ratios(|r| r.per_server_cpu_sec);
        let goal = goal.map_or(String::new(), |g| {
            let verdict = |x: f64| if x >= g { "met" } else { "NOT met" };
            format!("goal >= {g:.0}%: {} / {}", verdict(wall), verdict(cpu))
        });
        println!(
            "  {label:<42} {wall:>6.1}% [{wall_low:>5.1} .. {wall_high:>5.1}]  {cpu:>6.1}% [{cpu_low:>5.1} .. {cpu_high:>5.1}]  {goal}"
        );
    };
    println!();
    println!(
        "ratios, each the median of the per-round ratios [lowest .. highest]: of requests/s, \
         then of requests per server CPU second"
    );
    line(
        "tollway allowed / axum",
        Variant::Tollway,
        Variant::Axum,
        Some(98.0),
    );
    line(
        "tollway allowed / tower_governor allowed",
        Variant::Tollway,
        Variant::Governor,
        Some(100.0),
    );
    line(
        "tollway all-429 / axum",
        Variant::TollwayRejecting,
        Variant::Axum,
        Some(90.0),
    );
    line(
        "tower_governor allowed / axum",
        Variant::Governor,
        Variant::Axum,
        None,
    );
    line(
        "tower_governor all-429 / axum",
        Variant::GovernorRejecting,
        Variant::Axum,
        None,
    );
    line(
        "tollway all-429 / tower_governor all-429",
        Variant::TollwayRejecting,
        Variant::GovernorRejecting,
        None,
    );
    line(
        "tollway all-429 / tollway allowed",
        Variant::TollwayRejecting,
        Variant::Tollway,
        None,
    );
    line(
        "axum + a no-op layer / axum",
        Variant::NoopLayer,
        Variant::Axum,
        None,
    );
    line(
        "tollway allowed / axum + a no-op layer",
        Variant::Tollway,
        Variant::NoopLayer,
        None,
    );
    line(
        "tollway around Router / axum",
        Variant::TollwayOutside,
        Variant::Axum,
        None,
    );
    line(
        "axum + 3 constant headers / axum",
        Variant::HeadersOnly,
        Variant::Axum,
        None,
    );
    line(
        "axum + 3 constant headers / tower_governor",
        Variant::HeadersOnly,
        Variant::Governor,
        None,
    );
    line(
        "tollway allowed / axum + 3 constant headers",
        Variant::Tollway,
        Variant::HeadersOnly,
        None,
    );
    println!("like for like, allowed path:");
    line(
        "tollway no headers / axum",
        Variant::TollwayNoHeaders,
        Variant::Axum,
        None,
    );
    line(
        "tollway no headers / tower_governor",
        Variant::TollwayNoHeaders,
        Variant::Governor,
        None,
    );
    line(
        "tollway / tower_governor with headers",
        Variant::Tollway,
        Variant::GovernorHeaders,
        None,
    );
    if fleet_suite {
        println!("fleet:");
        line(
            "Redis allowed / memory allowed",
            Variant::RedisHealthy,
            Variant::Tollway,
            None,
        );
        line(
            "dead Redis, open breaker / axum",
            Variant::RedisDead,
            Variant::Axum,
            None,
        );
        line(
            "one-key flood, deny cache / no cache",
            Variant::RedisFloodCached,
            Variant::RedisFloodUncached,
            None,
        );
        line(
            "one-key flood, deny cache / axum",
            Variant::RedisFloodCached,
            Variant::Axum,
            None,
        );
    }
    drop(redis);
    Ok(())
}
