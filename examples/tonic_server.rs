//! A tonic gRPC server behind tollway: API-key tiers in metadata, a per-IP limit for
//! anonymous callers, and a tighter limit on the expensive method.
//!
//! ```sh
//! cargo run --example tonic_server                                # memory store, port 50051
//! PORT=50052 cargo run --example tonic_server                     # another port
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example tonic_server  # limits shared in Redis
//! cargo run --example tonic_client                                # in another terminal
//! ```
//!
//! It serves `demo.Catalog` from `examples/proto/catalog.proto`, compiled by
//! `examples/build.rs` (protox and tonic-prost-build: no `protoc` to install). Policies:
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

use std::error::Error;
use std::net::SocketAddr;
use std::process::ExitCode;

use demo::catalog::{Catalog, CatalogServer, EXPORT};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tollway_tower::{Algorithm, BoxStore, HeaderStyle, Policy, Protocol, Quota, RateLimitLayer};
use tonic::transport::Server;

#[tokio::main]
async fn main() -> ExitCode {
    demo::init_tracing();
    demo::exit(run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let (listener, addr) = demo::listen(50051).await?;
    let store = demo::store_from_env().await?;
    serve(store, listener, addr).await
}

/// Serves `demo.Catalog` with the rate limits over `store` until Ctrl-C.
async fn serve(
    store: BoxStore,
    listener: TcpListener,
    addr: SocketAddr,
) -> Result<(), Box<dyn Error>> {
    let [anonymous, free, pro] = demo::tier_policies()?;
    let export = Policy::new("export", Algorithm::TokenBucket, Quota::per_minute(3)?)?;
    // Anonymous callers are keyed by their IP address from tonic's TcpConnectInfo.
    let key = demo::known_api_key()?;
    let tiers = demo::tiers();

    // A gRPC method's limit is on its path (/<package>.<Service>/<Method>), whatever the
    // HTTP method: gRPC calls are POSTs, but tonic serves a method however it is called.
    let limits = RateLimitLayer::builder(store, anonymous)
        .key(key)
        .tier(free)
        .tier(pro)
        .tiers(tiers)
        .grpc_method(EXPORT, export)
        .headers(HeaderStyle::Both)
        .protocol(Protocol::Grpc)
        .build()?;

    print_usage(addr);
    Server::builder()
        .layer(limits)
        .add_service(CatalogServer::new(Catalog))
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
    for (key, tier) in demo::DEMO_KEYS {
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
