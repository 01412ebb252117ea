//! An axum server behind tollway: API-key tiers, a per-IP limit for anonymous callers,
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

use std::error::Error;
use std::net::SocketAddr;
use std::process::ExitCode;

use axum::Router;
use axum::routing::get;
use tokio::net::TcpListener;
use tollway_tower::{Algorithm, BoxStore, HeaderStyle, Policy, Protocol, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> ExitCode {
    demo::init_tracing();
    demo::exit(run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let (listener, addr) = demo::listen(3000).await?;
    let store = demo::store_from_env().await?;
    serve(store, listener, addr).await
}

/// Builds the router with the rate limits over `store` and serves it until Ctrl-C.
async fn serve(
    store: BoxStore,
    listener: TcpListener,
    addr: SocketAddr,
) -> Result<(), Box<dyn Error>> {
    let [anonymous, free, pro] = demo::tier_policies()?;
    let checkout = Policy::new(
        "checkout",
        Algorithm::SlidingWindowLog,
        Quota::per_minute(5)?,
    )?;
    let limits = RateLimitLayer::builder(store, anonymous)
        .key(demo::known_api_key()?)
        .tier(free)
        .tier(pro)
        .tiers(demo::tiers())
        .route(None, "/api/v1/checkout", checkout)
        .headers(HeaderStyle::Both)
        // An HTTP service: a request dressed as gRPC still gets its 429.
        .protocol(Protocol::Http)
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
    "Hello from behind tollway!\n"
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
    for (key, tier) in demo::DEMO_KEYS {
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
