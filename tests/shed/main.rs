//! Launch day, simulated: a service whose latency rises with its calls in flight and
//! collapses past a point, paying customers at a steady rate, and a botnet of 100,000
//! addresses at ten times what the service can answer. Four setups face the same
//! traffic: no limiter, per-key limits alone, a static concurrency limit (tower's
//! `ConcurrencyLimit` + `LoadShed`), and tollway's adaptive limit with priorities beside
//! the per-key limits.
//!
//! Time is tokio's, paused: the service works on it, the clients time out on it, the
//! shedder and the store measure it. A run is the same on every machine.
//! `cargo test -p tests --test shed -- --nocapture` prints the table BENCHMARKS.md
//! quotes.

#![allow(clippy::unwrap_used)]

mod http;

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use support::Rng;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tollway_core::{Algorithm, MemoryStore, Policy, Quota};
use tollway_tower::shed::{Match, Priority, Shed};
use tollway_tower::{RateLimitLayer, TokioClock};
use tower::util::BoxCloneService;
use tower::{BoxError, ServiceBuilder, ServiceExt};

/// Workers: calls the service works on at once; the rest wait for one.
const WORKERS: usize = 10;
/// A call's work unloaded, ±20 %.
const WORK: Duration = Duration::from_millis(10);
/// Calls inside the service past which every call's work slows in proportion: memory,
/// locks, a database pool's waiters. Past it throughput falls: the collapse.
const CROWD: usize = 40;
/// Clients give up after this.
const TIMEOUT: Duration = Duration::from_secs(1);
/// Before the botnet: paying customers and ordinary anonymous traffic.
const CALM: Duration = Duration::from_secs(10);
/// The botnet's attack.
const ATTACK: Duration = Duration::from_secs(10);
/// Paying customers' calls a second, from 100 customers: a tenth of what the service
/// answers (WORKERS / WORK = 1,000 a second).
const PAYING: u64 = 100;
/// Ordinary anonymous calls a second, from 1,000 addresses.
const ANONYMOUS: u64 = 300;
/// The botnet's calls a second: ten times the service's capacity.
const BOTNET: u64 = 10_000;
/// The botnet's addresses: each sends 6 calls a minute, under any per-key limit.
const ADDRESSES: u32 = 100_000;

/// The service: a pool of workers, whose work slows when too many calls are inside.
struct Model {
    workers: Semaphore,
    inside: AtomicUsize,
    rng: Mutex<Rng>,
}

/// One call inside the model, counted until it ends or is dropped.
struct Inside<'a>(&'a AtomicUsize);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Model {
    fn new() -> Arc<Self> {
        Arc::new(Model {
            workers: Semaphore::new(WORKERS),
            inside: AtomicUsize::new(0),
            rng: Mutex::new(Rng(38)),
        })
    }

    async fn serve(&self) {
        self.inside.fetch_add(1, Ordering::SeqCst);
        let _inside = Inside(&self.inside);
        let _worker = self.workers.acquire().await.unwrap();
        let crowd = self.inside.load(Ordering::SeqCst);
        let slowdown = (crowd as f64 / CROWD as f64).max(1.0);
        let jitter = 0.8 + self.rng.lock().unwrap().below(401) as f64 / 1_000.0;
        tokio::time::sleep(WORK.mul_f64(jitter * slowdown)).await;
    }
}

type Service = BoxCloneService<::http::Request<()>, ::http::StatusCode, BoxError>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    Unprotected,
    PerKey,
    Static,
    /// The adaptive limit with no priorities: what the priorities add.
    AdaptiveAlone,
    Adaptive,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::Unprotected => "no limiter",
            Setup::PerKey => "per-key limits alone",
            Setup::Static => "static concurrency limit (tower, 40)",
            Setup::AdaptiveAlone => "tollway: adaptive limit, no priorities",
            Setup::Adaptive => "tollway: adaptive limit + priorities",
        }
    }
}

/// A response's status: all the simulation reads.
fn status<B>(response: ::http::Response<B>) -> ::http::StatusCode {
    response.status()
}

/// The model, behind `setup`'s protection.
fn service(setup: Setup, model: Arc<Model>) -> (Service, Option<Shed>) {
    let model = tower::service_fn(move |_: ::http::Request<()>| {
        let model = Arc::clone(&model);
        async move {
            model.serve().await;
            Ok::<_, Infallible>(::http::Response::new(Empty::<Bytes>::new()))
        }
    });
    // A person's pace, per address: two calls a second, bursts of 120.
    let per_key = || {
        let store = MemoryStore::builder()
            .clock(TokioClock::new())
            .build()
            .unwrap();
        let policy = Policy::new(
            "per-address",
            Algorithm::Gcra,
            Quota::per_minute(120).unwrap(),
        )
        .unwrap();
        RateLimitLayer::builder(store, policy)
    };
    match setup {
        Setup::Unprotected => (
            ServiceBuilder::new()
                .map_response(status)
                .map_err(BoxError::from)
                .service(model)
                .boxed_clone(),
            None,
        ),
        Setup::PerKey => (
            ServiceBuilder::new()
                .map_response(status)
                .map_err(BoxError::from)
                .layer(per_key().build().unwrap())
                .service(model)
                .boxed_clone(),
            None,
        ),
        Setup::Static => (
            ServiceBuilder::new()
                .map_response(status)
                .load_shed()
                .concurrency_limit(CROWD)
                .service(model)
                .boxed_clone(),
            None,
        ),
        Setup::Adaptive | Setup::AdaptiveAlone => {
            let mut shed = Shed::builder()
                .limits(5, 500)
                .initial(20)
                .clock(TokioClock::new());
            if setup == Setup::Adaptive {
                // The customers' sessions, as an auth layer would know them.
                let sessions = (0..PAYING).map(|n| format!("Bearer customer-{n}"));
                let paying = Match::header_in(::http::header::AUTHORIZATION, sessions);
                shed = shed.priority(Priority::new("paying", 0.5).when(paying));
            }
            let shed = shed.build().unwrap();
            let layer = per_key().shed(shed.clone()).build().unwrap();
            let service = ServiceBuilder::new()
                .map_response(status)
                .map_err(BoxError::from)
                .layer(layer)
                .service(model)
                .boxed_clone();
            (service, Some(shed))
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Caller {
    Paying,
    Anonymous,
    Bot,
}

/// What happened to one kind of caller in one phase.
#[derive(Debug, Default)]
struct Tally {
    sent: u64,
    /// Latencies of the calls served, in microseconds.
    served: Vec<u64>,
    refused: u64,
    timed_out: u64,
}

impl Tally {
    fn goodput(&self) -> f64 {
        self.served.len() as f64 / self.sent.max(1) as f64
    }

    /// The 99th percentile latency of the calls served, if any was.
    fn p99(&mut self) -> Option<Duration> {
        self.served.sort_unstable();
        let last = self.served.len().checked_sub(1)?;
        Some(Duration::from_micros(self.served[last * 99 / 100]))
    }
}

/// Tallies by phase (calm, attack) and caller.
#[derive(Default)]
struct Tallies([[Tally; 3]; 2]);

impl Tallies {
    fn at(&mut self, attack: bool, caller: Caller) -> &mut Tally {
        &mut self.0[usize::from(attack)][caller as usize]
    }
}

/// One row of the table.
#[derive(Debug)]
struct Row {
    setup: Setup,
    paying_goodput: f64,
    paying_p99: Option<Duration>,
    calm_p99: Option<Duration>,
    /// Calls served a second during the attack, every caller.
    throughput: f64,
    bots_served: f64,
    limit: Option<u32>,
}

fn request(caller: Caller, n: u64) -> ::http::Request<()> {
    let (address, paying) = match caller {
        Caller::Paying => (Ipv4Addr::new(10, 1, 0, (n % PAYING) as u8), true),
        Caller::Anonymous => (Ipv4Addr::from(0x0a02_0000 + (n % 1_000) as u32), false),
        Caller::Bot => (
            Ipv4Addr::from(0xac10_0000 + (n % u64::from(ADDRESSES)) as u32),
            false,
        ),
    };
    let mut request = ::http::Request::builder().uri("/api/v1/checkout");
    if paying {
        request = request.header(
            ::http::header::AUTHORIZATION,
            format!("Bearer customer-{}", n % PAYING),
        );
    }
    let mut request = request.body(()).unwrap();
    request
        .extensions_mut()
        .insert(SocketAddr::from((address, 40_000)));
    request
}

/// Runs the calm, then the attack, through `setup`; every call is a task that gives up
/// after [`TIMEOUT`].
async fn run(setup: Setup) -> Row {
    let model = Model::new();
    let (service, shed) = service(setup, Arc::clone(&model));
    let tallies = Arc::new(Mutex::new(Tallies::default()));
    let start = Instant::now();
    let end = CALM + ATTACK;
    let mut sent = [0u64; 3];
    let mut rng = Rng(2026);
    let mut tasks = tokio::task::JoinSet::new();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    loop {
        tick.tick().await;
        let now = start.elapsed();
        if now >= end {
            break;
        }
        let attack = now >= CALM;
        let ms = u64::try_from(now.as_millis()).unwrap() + 1;
        // The calls due by this millisecond, in an order of chance: who comes first
        // in a millisecond must not decide who finds a free worker.
        let mut due = Vec::new();
        for (caller, rate) in [
            (Caller::Paying, PAYING),
            (Caller::Anonymous, ANONYMOUS),
            (Caller::Bot, if attack { BOTNET } else { 0 }),
        ] {
            // At `rate` a second, counted from the start of its phase (the bots').
            let since = if caller == Caller::Bot {
                ms.saturating_sub(CALM.as_millis() as u64)
            } else {
                ms
            };
            let sent = &mut sent[caller as usize];
            while *sent < since * rate / 1_000 {
                due.push((caller, request(caller, *sent)));
                *sent += 1;
            }
        }
        for i in (1..due.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            due.swap(i, j);
        }
        for (caller, request) in due {
            let (service, tallies) = (service.clone(), Arc::clone(&tallies));
            tasks.spawn(async move {
                let began = Instant::now();
                let answer = tokio::time::timeout(TIMEOUT, service.oneshot(request)).await;
                let took = u64::try_from(began.elapsed().as_micros()).unwrap();
                let mut tallies = tallies.lock().unwrap();
                let tally = tallies.at(attack, caller);
                tally.sent += 1;
                match answer {
                    Ok(Ok(status)) if status.is_success() => tally.served.push(took),
                    Ok(_) => tally.refused += 1,
                    Err(_) => tally.timed_out += 1,
                }
            });
        }
        // Finished calls, reaped as we go.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let mut tallies = std::mem::take(&mut *tallies.lock().unwrap());
    let attack_served: usize = tallies.0[1].iter().map(|t| t.served.len()).sum();
    let calm_p99 = tallies.at(false, Caller::Paying).p99();
    let bots_served = tallies.at(true, Caller::Bot).goodput();
    let paying = tallies.at(true, Caller::Paying);
    Row {
        setup,
        paying_goodput: paying.goodput(),
        paying_p99: paying.p99(),
        calm_p99,
        throughput: attack_served as f64 / ATTACK.as_secs_f64(),
        bots_served,
        limit: shed.map(|s| s.limit()),
    }
}

// The launch-day scene, four ways. Paying customers are served by tollway's adaptive
// limit with priorities (the goal: ≥ 95 %, p99 within twice the calm p99), where
// per-key limits alone serve them far less: the botnet is under every per-key limit.
#[tokio::test(start_paused = true)]
async fn paying_customers_are_served_through_a_botnet_at_ten_times_capacity() {
    let mut rows = Vec::new();
    for setup in [
        Setup::Unprotected,
        Setup::PerKey,
        Setup::Static,
        Setup::AdaptiveAlone,
        Setup::Adaptive,
    ] {
        rows.push(run(setup).await);
    }
    println!(
        "| setup | paying served | paying p99 (calm p99) | service throughput | botnet served |"
    );
    println!("|---|---:|---:|---:|---:|");
    for row in &rows {
        let ms = |p99: Option<Duration>| {
            p99.map_or("none served".to_owned(), |p| {
                format!("{:.1} ms", p.as_secs_f64() * 1e3)
            })
        };
        println!(
            "| {} | {:.1} % | {} ({}) | {:.0} /s | {:.1} %{} |",
            row.setup.name(),
            row.paying_goodput * 100.0,
            ms(row.paying_p99),
            ms(row.calm_p99),
            row.throughput,
            row.bots_served * 100.0,
            row.limit
                .map(|l| format!(" (limit at the end: {l})"))
                .unwrap_or_default(),
        );
    }
    let [unprotected, per_key, fixed, alone, adaptive] = &rows[..] else {
        unreachable!("five setups")
    };
    // Without priorities, the limit keeps the service up and serves whoever comes.
    assert!(alone.paying_goodput < 0.5, "{alone:?}");
    assert!(adaptive.paying_goodput >= 0.95, "{adaptive:?}");
    let (p99, calm) = (adaptive.paying_p99.unwrap(), adaptive.calm_p99.unwrap());
    assert!(p99 <= calm * 2, "{adaptive:?}");
    // Per-key limits do not see the botnet: they serve paying customers no better than
    // no limiter at all.
    assert!(per_key.paying_goodput < 0.5, "{per_key:?}");
    assert!(unprotected.paying_goodput < 0.5, "{unprotected:?}");
    // A static limit keeps the service up, but cannot tell paying customers apart.
    assert!(fixed.paying_goodput < 0.5, "{fixed:?}");
    assert!(
        fixed.throughput > per_key.throughput,
        "{fixed:?} {per_key:?}"
    );
}
