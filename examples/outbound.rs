//! Outbound limits: workers calling a third-party API through `OutboundLayer`, with and
//! without it.
//!
//! The "third-party API" is a stand-in on 127.0.0.1: an axum server that enforces 50
//! requests a second (burst 10) and 20,000 tokens a minute with tollway (a call takes a
//! token up front and the rest of what it used after), answers 429 with `Retry-After`
//! past either, and reports the tokens each call used (`x-tokens-used`, 50 to 150). 64
//! worker tasks call it as fast as they can for 5 s, first through the layers (50 a
//! second; an estimate of 100 tokens a call settled with what the response reports;
//! pausing on a 429 and sending a refused GET once more), then without them. The example
//! prints what the stand-in received, served and refused, the tokens used against its
//! budget, and what the callers got back.
//!
//! ```sh
//! cargo run --release --example outbound                 # the workers share a memory store
//! REDIS_URL=redis://127.0.0.1/ cargo run --release --example outbound   # ... or Redis
//! ```

use std::error::Error;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use bytes::Bytes;
use http::Request;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollway_tower::outbound::{OutboundError, OutboundLayer};
use tollway_tower::{Algorithm, GlobalKey, MemoryStore, Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

const WORKERS: usize = 64;
const TOKENS_PER_MINUTE: u64 = 20_000;
const RUN: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() -> ExitCode {
    demo::exit(run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let upstream = upstream().await?;
    println!(
        "upstream on {}: 50 requests/s (burst 10) and 20,000 tokens/min",
        upstream.0
    );
    let store = demo::store_from_env().await?;
    // A layer's cost applies to each of its limits: requests and tokens are two layers.
    // Each a little under the upstream's capacity (burst 8 of 10, 19,000 tokens of
    // 20,000): requests reach it a little later and less evenly than they were admitted,
    // and are settled a moment after it counted them; the difference absorbs that (with
    // the upstream's own capacities, 0.8-2.4% of calls drew a 429 in three runs).
    let requests = OutboundLayer::builder(
        store.clone(),
        Policy::new(
            "third-party",
            Algorithm::Gcra,
            Quota::per_second(50)?.with_burst(8)?,
        )?,
    )
    .build()?;
    let tokens = OutboundLayer::builder(
        store,
        Policy::new(
            "third-party-tokens",
            Algorithm::TokenBucket,
            Quota::per_minute(TOKENS_PER_MINUTE)?.with_burst(19_000)?,
        )?,
    )
    .cost(|_, _, _| 100)
    .settle(|_, headers| headers.get("x-tokens-used")?.to_str().ok()?.parse().ok())
    .build()?;
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();

    let limited = requests.layer(tokens.layer(client.clone()));
    let (addr, seen) = upstream;
    let (with, ran) = calls(addr, limited).await;
    let seen = seen.over(ran);
    println!(
        "{WORKERS} workers for {RUN:?} ({ran:.1?} with the calls waiting at the end), through OutboundLayer:\n  {seen}\n  {with}"
    );
    // A fresh upstream, its budgets whole, for the run without the layer.
    let (addr, seen) = self::upstream().await?;
    let (without, ran) = calls(addr, client).await;
    let seen = seen.over(ran);
    println!("{WORKERS} workers for {RUN:?} ({ran:.1?}), without it:\n  {seen}\n  {without}");
    Ok(())
}

/// What the stand-in saw.
#[derive(Default)]
struct Seen {
    received: AtomicU64,
    served: AtomicU64,
    tokens: AtomicU64,
}

impl Seen {
    /// What it saw over a run that lasted `ran`.
    fn over(&self, ran: Duration) -> String {
        let received = self.received.load(Ordering::Relaxed);
        let served = self.served.load(Ordering::Relaxed);
        let refused = received - served;
        // Its token budget over the run: a full bucket and the refill.
        let budget = TOKENS_PER_MINUTE + TOKENS_PER_MINUTE * ran.as_millis() as u64 / 60_000;
        format!(
            "upstream: {received} received, {served} served ({:.1}/s), {refused} refused with 429 \
             ({:.1}%); {} tokens used, budget {budget} over the run",
            served as f64 / ran.as_secs_f64(),
            100.0 * refused as f64 / received.max(1) as f64,
            self.tokens.load(Ordering::Relaxed),
        )
    }
}

/// The stand-in: one global budget of requests and one of tokens, each answer reporting
/// what it used; with what it saw.
async fn upstream() -> Result<(SocketAddr, Arc<Seen>), Box<dyn Error>> {
    let requests = Policy::new(
        "upstream",
        Algorithm::Gcra,
        Quota::per_second(50)?.with_burst(10)?,
    )?;
    let tokens = Policy::new(
        "upstream-tokens",
        Algorithm::TokenBucket,
        Quota::per_minute(TOKENS_PER_MINUTE)?,
    )?;
    // A call reserves one token up front (it is refused once they are gone) and is
    // settled to what it used after its response.
    let layer = RateLimitLayer::builder(MemoryStore::new(), requests)
        .route(None, "/v1/complete", tokens)
        .key(GlobalKey)
        .settle("upstream-tokens", |_, headers: &HeaderMap, _| {
            headers.get("x-tokens-used")?.to_str().ok()?.parse().ok()
        })
        .build()?;
    let seen = Arc::new(Seen::default());
    let (served, received) = (Arc::clone(&seen), Arc::clone(&seen));
    let app =
        Router::new()
            .route(
                "/v1/complete",
                get(move || {
                    let n = served.served.fetch_add(1, Ordering::Relaxed);
                    let used = 50 + n % 101;
                    served.tokens.fetch_add(used, Ordering::Relaxed);
                    async move {
                        (StatusCode::OK, [("x-tokens-used", used.to_string())]).into_response()
                    }
                }),
            )
            .layer(layer)
            .layer(tower::util::MapRequestLayer::new(move |request| {
                received.received.fetch_add(1, Ordering::Relaxed);
                request
            }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("upstream: {e}");
        }
    });
    Ok((addr, seen))
}

/// What one run's callers got back.
#[derive(Default)]
struct Counts {
    /// Answers from the upstream.
    sent: AtomicU64,
    ok: AtomicU64,
    too_many: AtomicU64,
    /// Refused by the layer itself (a wait past `max_wait`), so never sent.
    refused_here: AtomicU64,
    failed: AtomicU64,
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sent = self.sent.load(Ordering::Relaxed);
        let too_many = self.too_many.load(Ordering::Relaxed);
        write!(
            f,
            "callers: {sent} answers, {} served, {too_many} a 429 (a refused request sent \
             again counts once), {} refused by the layer, {} failed",
            self.ok.load(Ordering::Relaxed),
            self.refused_here.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

/// `WORKERS` tasks calling `upstream` through `client` as fast as they may for `RUN`
/// (those waiting at the end finish their call); with how long they took.
async fn calls<C, E>(upstream: SocketAddr, client: C) -> (Arc<Counts>, Duration)
where
    C: Service<Request<Empty<Bytes>>, Response = http::Response<hyper::body::Incoming>, Error = E>
        + Clone
        + Send
        + 'static,
    C::Future: Send,
    E: Into<Box<dyn Error + Send + Sync>> + Send,
{
    let counts = Arc::new(Counts::default());
    let started = Instant::now();
    let stop = started + RUN;
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let (mut client, counts) = (client.clone(), Arc::clone(&counts));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < stop {
                let request = Request::get(format!("http://{upstream}/v1/complete"))
                    .body(Empty::new())
                    .unwrap_or_default();
                let answer = match client.ready().await {
                    Ok(ready) => ready.call(request).await,
                    Err(e) => Err(e),
                };
                let counter = match answer.map_err(Into::into) {
                    Ok(response) => {
                        counts.sent.fetch_add(1, Ordering::Relaxed);
                        match response.status() {
                            StatusCode::TOO_MANY_REQUESTS => &counts.too_many,
                            status if status.is_success() => &counts.ok,
                            _ => &counts.failed,
                        }
                    }
                    Err(e) if e.downcast_ref::<OutboundError>().is_some() => &counts.refused_here,
                    Err(_) => &counts.failed,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    (counts, started.elapsed())
}
