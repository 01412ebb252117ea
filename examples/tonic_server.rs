//! A tonic gRPC server behind tollgate: API-key tiers in metadata, a per-IP limit for
//! anonymous callers, and a tighter limit on the expensive method.
//!
//! ```sh
//! cargo run --example tonic_server                                # memory store, port 50051
//! PORT=50052 cargo run --example tonic_server                     # another port
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example tonic_server  # limits shared in Redis
//! cargo run --example tonic_client                                # in another terminal
//! ```
//!
//! It serves `demo.Catalog` (see `grpc_demo.rs`), written by hand so that no `protoc` is
//! needed. Policies:
//!
//! | caller                                    | limit                   |
//! |-------------------------------------------|-------------------------|
//! | `x-api-key: demo-free-key` (tier Free)    | 100 / min               |
//! | `x-api-key: demo-pro-key` (tier Pro)      | 10,000 / min            |
//! | no key, or a key we do not know           | 20 / min per IP         |
//! | `/demo.Catalog/Export`, anyone            | also 3 / min per caller |
//!
//! A denied call ends with `RESOURCE_EXHAUSTED`, `google.rpc.RetryInfo` (the exact wait)
//! and `google.rpc.QuotaFailure` (which policy) in its status details, and `retry-after`,
//! `grpc-retry-pushback-ms` and `x-ratelimit-*` metadata. Allowed calls carry
//! `x-ratelimit-*` and the IETF `ratelimit` / `ratelimit-policy` metadata. When the store
//! fails (Redis down), calls are let through and the failure is logged.

mod grpc_demo;

use std::collections::HashMap;
use std::error::Error;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;

use grpc_demo::{Catalog, EXPORT};
use http::Method;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tollgate_tower::core::{Algorithm, MemoryStore, Policy, Quota, RedisStore, Store};
use tollgate_tower::{Header, HeaderStyle, Key, KeyExtractor, RateLimitLayer};
use tonic::transport::Server;
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
        Err(_) => 50051,
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

/// Serves `demo.Catalog` with the rate limits over `store` until Ctrl-C.
async fn serve<St: Store>(
    store: St,
    listener: TcpListener,
    addr: SocketAddr,
) -> Result<(), Box<dyn Error>> {
    let anonymous = Policy::new("anonymous", Algorithm::TokenBucket, Quota::per_minute(20)?)?;
    let free = Policy::new("free", Algorithm::TokenBucket, Quota::per_minute(100)?)?;
    let pro = Policy::new("pro", Algorithm::TokenBucket, Quota::per_minute(10_000)?)?;
    let export = Policy::new("export", Algorithm::TokenBucket, Quota::per_minute(3)?)?;

    let tiers: HashMap<String, String> = DEMO_KEYS
        .iter()
        .map(|(key, tier)| ((*key).to_owned(), (*tier).to_owned()))
        .collect();
    // Only keys we know name a caller. An unknown key counts as no key, so the caller is
    // limited by its IP address (MissingKey::FallbackToIp, the default, reading tonic's
    // TcpConnectInfo): otherwise anyone could mint a fresh limit by sending a new random
    // key with every call. A real service checks its keys in an authentication layer
    // before this one.
    let known = Arc::new(tiers.clone());
    let api_key = Header::new("x-api-key")?;
    let key = move |request: &http::Request<tonic::body::Body>| {
        api_key.extract(request).filter(|key: &Key| {
            std::str::from_utf8(key.value()).is_ok_and(|value| known.contains_key(value))
        })
    };

    // gRPC calls are HTTP/2 POSTs to /<package>.<Service>/<Method>: a route limit on one
    // method is a route limit on its path.
    let limits = RateLimitLayer::builder(store, anonymous)
        .key(key)
        .tier(free)
        .tier(pro)
        .tiers(tiers)
        .route(Some(Method::POST), EXPORT, export)
        .headers(HeaderStyle::Both)
        .build()?;

    print_usage(addr);
    Server::builder()
        .layer(limits)
        .add_service(Catalog::new())
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
            // If the signal handler cannot be installed, serve until killed.
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        })
        .await?;
    Ok(())
}

fn print_usage(addr: SocketAddr) {
    println!("serving demo.Catalog (Lookup, Export) on http://{addr}");
    println!();
    println!("demo API keys (metadata x-api-key):");
    for (key, tier) in DEMO_KEYS {
        let limit = if tier == "pro" { "10,000" } else { "100" };
        println!("  {key:<14} tier {tier:<4} {limit}/min");
    }
    println!("  (none)         anonymous 20/min per IP");
    println!("  Export costs every caller also 1 of 3/min");
    println!();
    println!("try, in another terminal:");
    println!("  cargo run --example tonic_client");
    if addr.port() != 50051 {
        println!("  (with PORT={} for this server)", addr.port());
    }
    println!("  API_KEY=demo-pro-key cargo run --example tonic_client");
    println!("It calls Export until it is refused with RESOURCE_EXHAUSTED, prints the");
    println!("RetryInfo and retry metadata, waits as told, and calls again.");
    println!();
    println!("Ctrl-C stops the server.");
}
