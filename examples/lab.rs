//! The live rate-limiter lab, `GET /lab`: one page that drives tollway itself. Each of
//! the seven algorithms limits an endpoint of its own (`/lab/api/{algorithm}`), at a
//! capacity of 10 refilled at 2 a second (the window algorithms: 10 per 5-second window,
//! the same average rate), keyed by the caller's address; `/lab/state/{algorithm}` is
//! what the store holds for the caller now (a peek: it consumes nothing), which the page
//! polls to draw the bucket as it refills. `POST /lab/boundary` runs scenario 1, the
//! boundary burst (a fixed window against the log); `POST /lab/race` runs scenario 2, the
//! distributed race: two gateways on one store, tollway against a naive read-then-write
//! limiter.
//!
//! The lab runs on a memory store of its own, never the application's: a race makes
//! fresh keys every time, and on a shared Redis those would crowd out (or, under
//! `maxmemory`, evict) the keys that limit real callers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::future::join_all;
use parking_lot::Mutex;
use serde_json::json;
use tollway_tower::tollway_core::Clock;
use tollway_tower::{
    Algorithm, BoxStore, ConfigError, Decisions, HeaderStyle, Key, MemoryStore, Operation, Policy,
    Quota, RateLimitLayer, Store, TokioClock,
};

/// The page: HTML, CSS and script in one file, embedded (it works offline).
const PAGE: &str = include_str!("lab.html");

/// Each algorithm's lab policy: a capacity of 10 refilled at 2 a second, or for the
/// window algorithms 10 per 5-second window.
///
/// # Errors
///
/// Never: the quotas are the lab's own.
pub fn policies() -> Result<Vec<Policy>, ConfigError> {
    Algorithm::ALL
        .into_iter()
        // Calls in flight are held by a request's whole life, not shown here.
        .filter(|&algorithm| algorithm != Algorithm::Concurrency)
        .map(|algorithm| {
            let quota = if algorithm.uses_burst() {
                Quota::per_second(2)?.with_burst(10)?
            } else {
                Quota::with_period(10, Duration::from_secs(5))?
            };
            Policy::new(format!("lab-{}", algorithm.name()), algorithm, quota)
        })
        .collect()
}

/// The lab's routes over `store`, a memory store of the lab's own: the page, an
/// endpoint an algorithm, their states, and the two scenarios. They answer at
/// `localhost`, an IP address or one of `hosts` only, refuse writes from other sites,
/// and send a Content-Security-Policy, `X-Frame-Options` and `nosniff` (see
/// [`crate::guard`]); the scenarios are limited to 10 runs a minute per address.
///
/// # Errors
///
/// Never: the lab's layers are its own.
pub fn router<C: Clock>(store: MemoryStore<C>, hosts: &[String]) -> Result<Router, ConfigError> {
    let store = BoxStore::new(store);
    let policies = policies()?;
    let mut lab = Router::new();
    for policy in &policies {
        let name = policy.algorithm().name();
        let layer = RateLimitLayer::builder(store.clone(), policy.clone())
            .headers(HeaderStyle::Legacy)
            .build()?;
        lab = lab.route(
            &format!("/lab/api/{name}"),
            get(move || async move { format!("{name}: allowed\n") }).layer(layer),
        );
    }
    let limit = Policy::new("lab-race", Algorithm::FixedWindow, Quota::per_minute(10)?)?;
    let window = Quota::with_period(10, WINDOW)?;
    let clock = TokioClock::new();
    let state = Arc::new(Lab {
        store,
        policies,
        race: limit,
        races: AtomicU64::new(0),
        windows: MemoryStore::builder().clock(clock.clone()).build()?,
        clock,
        fixed: Policy::new("lab-boundary-fixed", Algorithm::FixedWindow, window.clone())?,
        log: Policy::new("lab-boundary-log", Algorithm::SlidingWindowLog, window)?,
    });
    let runs = Policy::new("lab-runs", Algorithm::TokenBucket, Quota::per_minute(10)?)?;
    let runs = RateLimitLayer::builder(MemoryStore::new(), runs)
        .headers(HeaderStyle::Legacy)
        .build()?;
    let scenarios = Router::new()
        .route("/lab/race", post(race))
        .route("/lab/boundary", post(boundary))
        .layer(runs);
    let guard = crate::guard::Guard::new(hosts, PAGE);
    Ok(lab
        .route("/lab", get(page))
        .route("/lab/state/{algorithm}", get(bucket))
        .merge(scenarios)
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(
            guard,
            crate::guard::guard,
        )))
}

/// The boundary scenario's window.
const WINDOW: Duration = Duration::from_secs(5);

/// Scenario 1, the boundary burst: a fixed window and a sliding window log, each 10 per
/// 5 seconds, meet a burst of 10 just before a window ends and another just after it.
/// The fixed window starts counting afresh at the boundary and admits both, 20 in a
/// quarter of a second; the log, counting the last 5 seconds wherever they fall, admits
/// the first 10 only. The server waits for the boundary itself (up to 5 s), on a memory
/// store of its own whose windows it can see.
async fn boundary(State(lab): State<Arc<Lab>>) -> Response {
    let run = lab.races.fetch_add(1, Ordering::Relaxed);
    let key = format!("boundary:{run}");
    let period = u64::try_from(WINDOW.as_micros()).unwrap_or(u64::MAX);
    // 200 ms before the next boundary (the one after, if that is too close).
    let to_boundary = period - lab.clock.now_micros() % period;
    let wait = if to_boundary < 300_000 {
        to_boundary + period
    } else {
        to_boundary
    } - 200_000;
    tokio::time::sleep(Duration::from_micros(wait)).await;
    let before = lab.burst(&key);
    // 10 ms after it.
    tokio::time::sleep(Duration::from_millis(210)).await;
    let after = lab.burst(&key);
    let body = json!({
        "window_ms": WINDOW.as_millis() as u64,
        "limit": 10,
        "waited_ms": wait / 1_000,
        "fixed_window": { "before": before.0, "after": after.0, "admitted": before.0 + after.0 },
        "sliding_window_log": { "before": before.1, "after": after.1, "admitted": before.1 + after.1 },
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

struct Lab {
    store: BoxStore,
    policies: Vec<Policy>,
    /// The race's limit: 10 a minute.
    race: Policy,
    /// Races and boundary runs, so that each starts from a fresh key.
    races: AtomicU64,
    /// The boundary scenario's store, and the clock it reads.
    windows: MemoryStore<TokioClock>,
    clock: TokioClock,
    fixed: Policy,
    log: Policy,
}

impl Lab {
    /// 10 requests for `key` to the fixed window and to the log: how many each admitted.
    fn burst(&self, key: &str) -> (usize, usize) {
        let admitted = |policy: &Policy| {
            (0..10)
                .filter(|_| {
                    self.windows
                        .check_sync(key.as_bytes(), policy, 1)
                        .is_allowed()
                })
                .count()
        };
        (admitted(&self.fixed), admitted(&self.log))
    }
}

/// How many requests a race sends.
const RACE_REQUESTS: usize = 30;

/// Scenario 2, the distributed race: two gateways share one store and a limit of 10,
/// and 30 requests arrive at once, split between them. With tollway each decision is one
/// atomic store call, and exactly 10 pass. A naive limiter that reads the count, then
/// (a network round trip later) writes it back, lets every request that read before the
/// others wrote pass. Both run here, in this process, on this store (the naive one on a
/// map of its own, read and written in two steps).
async fn race(State(lab): State<Arc<Lab>>) -> Response {
    let run = lab.races.fetch_add(1, Ordering::Relaxed);
    let key = format!("race:{run}");
    let gateways = [lab.store.clone(), lab.store.clone()];
    let tollway = join_all((0..RACE_REQUESTS).map(|i| {
        let (gateway, key, policy) = (&gateways[i % 2], key.as_bytes(), &lab.race);
        async move { gateway.check(key, &[policy], 1).await }
    }))
    .await;
    let tollway_admitted = tollway
        .iter()
        .filter(|d| d.as_ref().is_ok_and(Decisions::is_allowed))
        .count();
    let naive = NaiveLimiter::default();
    let naive_admitted = join_all((0..RACE_REQUESTS).map(|_| naive.admit(10)))
        .await
        .into_iter()
        .filter(|&admitted| admitted)
        .count();
    let body = json!({
        "limit": 10,
        "sent": RACE_REQUESTS,
        "gateways": 2,
        "naive_store": "memory",
        "tollway_admitted": tollway_admitted,
        "naive_admitted": naive_admitted,
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The limiter the race shows the flaw of: it reads a count, and writes the count plus
/// one in a second step, a round trip later.
#[derive(Default)]
struct NaiveLimiter {
    count: Mutex<u64>,
}

impl NaiveLimiter {
    async fn admit(&self, limit: u64) -> bool {
        let count = *self.count.lock();
        // The round trip between the read and the write, when others run.
        tokio::task::yield_now().await;
        if count >= limit {
            return false;
        }
        *self.count.lock() = count + 1;
        true
    }
}

async fn page() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE)
}

/// What the store holds for the caller under an algorithm's policy, consuming nothing:
/// units left, the capacity, when it is full again, and whether a request would pass.
async fn bucket(
    State(lab): State<Arc<Lab>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Path(algorithm): Path<String>,
) -> Response {
    let Some(policy) = lab
        .policies
        .iter()
        .find(|p| p.algorithm().name() == algorithm)
    else {
        let message = format!("no lab for {algorithm:?}");
        return (StatusCode::NOT_FOUND, message).into_response();
    };
    // The key the layer gives this caller: its address.
    let key = Key::ip(peer.ip(), 64);
    match crate::axum_app::state_after(&lab.store, key.as_bytes(), policy, Operation::Peek(0)).await
    {
        Ok(mut state) => {
            state["algorithm"] = json!(algorithm);
            Json(state).into_response()
        }
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}
