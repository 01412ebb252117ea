//! An axum server behind tollgate: API-key tiers, a per-IP limit for anonymous callers,
//! and a tighter limit on checkout.
//!
//! ```sh
//! cargo run --example axum_server                                # memory store, port 3000
//! PORT=8080 cargo run --example axum_server                      # another port
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example axum_server  # limits shared in Redis
//! RUST_LOG=debug cargo run --example axum_server                 # more logging
//! ```
//!
//! Policies:
//!
//! | caller                                   | limit        |
//! |------------------------------------------|--------------|
//! | `X-API-Key: demo-free-key` (tier Free)   | 100 / min    |
//! | `X-API-Key: demo-pro-key` (tier Pro)     | 10,000 / min |
//! | no key, or a key we do not know          | 20 / min per IP |
//! | `/api/v1/checkout` (GET or POST), anyone | also 5 / min per caller |
//!
//! Every response carries `X-RateLimit-*` and the IETF `RateLimit` / `RateLimit-Policy`
//! headers; a denial is a `429` with `Retry-After` and a JSON body. When the store fails
//! (Redis down), requests are let through and the failure is logged.

use std::collections::HashMap;
use std::error::Error;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::Request;
use axum::routing::get;
use tokio::net::TcpListener;
use tollgate_tower::core::{Algorithm, MemoryStore, Policy, Quota, RedisStore, Store};
use tollgate_tower::{Header, HeaderStyle, Key, KeyExtractor, RateLimitLayer};
use tracing_subscriber::EnvFilter;

/// The demo API keys and the tier each belongs to.
const DEMO_KEYS: [(&str, &str); 2] = [("demo-free-key", "free"), ("demo-pro-key", "pro")];

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn Error>> {
    let port = match std::env::var("PORT") {
        Ok(text) => text
            .parse::<u16>()
            .map_err(|_| format!("PORT must be a port number from 0 to 65535 (got {text:?})"))?,
        Err(_) => 3000,
    };
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port))
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:{port}: {e}"))?;
    let addr = listener.local_addr()?;

    match std::env::var("REDIS_URL") {
        Ok(url) => {
            let store = RedisStore::builder()
                .prefix("tollgate-demo")
                .connect(&url)
                .await
                .map_err(|e| {
                    format!(
                        "cannot use Redis at {url}: {e}\n\
                         Start Redis (redis-server) or unset REDIS_URL to use the memory store."
                    )
                })?;
            println!("store: Redis at {url} (limits shared by every server using it)");
            serve(store, listener, addr).await
        }
        Err(_) => {
            println!("store: memory (this process only; set REDIS_URL to share limits)");
            serve(MemoryStore::new(), listener, addr).await
        }
    }
}

/// Builds the router with the rate limits over `store` and serves it until Ctrl-C.
async fn serve<St: Store>(
    store: St,
    listener: TcpListener,
    addr: SocketAddr,
) -> Result<(), Box<dyn Error>> {
    let anonymous = Policy::new("anonymous", Algorithm::TokenBucket, Quota::per_minute(20)?)?;
    let free = Policy::new("free", Algorithm::TokenBucket, Quota::per_minute(100)?)?;
    let pro = Policy::new("pro", Algorithm::TokenBucket, Quota::per_minute(10_000)?)?;
    let checkout = Policy::new(
        "checkout",
        Algorithm::SlidingWindowLog,
        Quota::per_minute(5)?,
    )?;

    let tiers: HashMap<String, String> = DEMO_KEYS
        .iter()
        .map(|(key, tier)| ((*key).to_owned(), (*tier).to_owned()))
        .collect();
    // Only keys we know name a caller. An unknown key counts as no key, so the caller is
    // limited by IP (MissingKey::FallbackToIp, the default): otherwise anyone could mint
    // a fresh limit by sending a new random key with every request. A real service
    // checks its keys in an authentication layer before this one.
    let known = Arc::new(tiers.clone());
    let api_key = Header::new("x-api-key")?;
    let key = move |request: &Request<Body>| {
        api_key.extract(request).filter(|key: &Key| {
            std::str::from_utf8(key.value()).is_ok_and(|value| known.contains_key(value))
        })
    };

    let limits = RateLimitLayer::builder(store, anonymous)
        .key(key)
        .tier(free)
        .tier(pro)
        .tiers(tiers)
        .route(None, "/api/v1/checkout", checkout)
        .headers(HeaderStyle::Both)
        .build()?;

    let app = Router::new()
        .route("/", get(hello))
        .route("/api/v1/checkout", get(checkout_status).post(place_order))
        .layer(limits);

    print_usage(addr);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        // If the signal handler cannot be installed, serve until killed.
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    })
    .await?;
    Ok(())
}

async fn hello() -> &'static str {
    "Hello from behind tollgate!\n"
}

async fn checkout_status() -> &'static str {
    "Checkout is open.\n"
}

async fn place_order() -> &'static str {
    "Order placed.\n"
}

fn print_usage(addr: SocketAddr) {
    let base = format!("localhost:{}", addr.port());
    println!("listening on http://{addr}");
    println!();
    println!("demo API keys:");
    for (key, tier) in DEMO_KEYS {
        let limit = if tier == "pro" { "10,000" } else { "100" };
        println!("  {key:<14} tier {tier:<4} {limit}/min");
    }
    println!("  (none)         anonymous 20/min per IP; /api/v1/checkout also 5/min per caller");
    println!();
    println!("try:");
    println!("  curl -i {base}/");
    println!("  curl -i -H 'X-API-Key: demo-free-key' {base}/");
    println!("  curl -i -H 'X-API-Key: demo-pro-key' {base}/");
    println!("  curl -i -X POST -H 'X-API-Key: demo-pro-key' {base}/api/v1/checkout");
    println!("  # 25 anonymous requests: the last ones are 429");
    println!(
        "  for i in $(seq 1 25); do curl -s -o /dev/null -w \"%{{http_code}} \" {base}/; done; echo"
    );
    println!("  # then look at a denial: Retry-After, X-RateLimit-* and the JSON body");
    println!("  curl -i {base}/");
    println!();
    println!("Ctrl-C stops the server.");
}
