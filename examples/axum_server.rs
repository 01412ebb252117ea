//! An axum server behind tollway: API-key tiers, a per-IP limit for anonymous callers,
//! and a tighter limit on checkout.
//!
//! ```sh
//! cargo run --example axum_server                                # memory store, port 3000
//! PORT=8080 cargo run --example axum_server                      # another port
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example axum_server  # limits shared in Redis
//! RUST_LOG=debug cargo run --example axum_server                 # more logging
//! TOLLWAY_CONFIG=my-limits.toml cargo run --example axum_server  # other limits
//! ```
//!
//! The limits below come from `examples/tollway.toml`, watched while the server runs:
//! edit a limit and save, and the next request sees it; a broken edit is refused with its
//! line and column in the log, and the running limits stay. SIGHUP and
//! `POST /admin/reload` read the file again too.
//!
//! Policies:
//!
//! | caller                                   | limit        |
//! |------------------------------------------|--------------|
//! | `X-API-Key: demo-free-key` (tier Free)   | 100 / min    |
//! | `X-API-Key: demo-pro-key` (tier Pro)     | 10,000 / min |
//! | no key, or a key we do not know          | 20 / min per IP |
//! | `/api/v1/checkout` (GET or POST), anyone | also 5 / min per caller |
//! | `POST /api/v1/completions?tokens=N`      | also 1,000 tokens / min per caller, settled after the response |
//! | `X-API-Key: demo-partner-key`            | allow list: not limited |
//! | `X-API-Key: demo-banned-key`             | deny list: 403 |
//!
//! Every response carries `X-RateLimit-*` and the IETF `RateLimit` / `RateLimit-Policy`
//! headers; a denial is a `429` with `Retry-After` and a JSON body. When the store fails
//! (Redis down), requests are let through and the failure is logged.
//!
//! `GET /metrics` is Prometheus text; `/admin/limits/{policy}/{key}` peeks (`GET`) at and
//! resets (`DELETE`) a caller's state, and `PUT /admin/shadow/{policy|all}` (body `on` or
//! `off`) switches shadow mode, behind `Authorization: Bearer $ADMIN_TOKEN`. Without
//! `ADMIN_TOKEN` there is no admin API; the token is never printed. See
//! `examples/axum_app.rs`.
//!
//! The store: the limits file's `[store]` section if it has one, else `REDIS_URL`, else
//! memory; a file with a `[store]` section and a `REDIS_URL` both is refused at start.
//!
//! The lab (`/lab`) runs on a memory store of its own. It is on by default only on the
//! demo's memory store; elsewhere `TOLLWAY_LAB=1` mounts it (`TOLLWAY_LAB=0` never).

use std::error::Error;
use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;

use demo::axum_app::{self, DEFAULT_CONFIG, Doors};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use tokio::net::TcpListener;
use tollway_tower::BoxStore;
use tollway_tower::config::{LimitsFile, Reloader};

#[tokio::main]
async fn main() -> ExitCode {
    demo::init_tracing();
    demo::exit(run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let (listener, addr) = demo::listen(3000).await?;
    let config = std::env::var("TOLLWAY_CONFIG").unwrap_or_else(|_| DEFAULT_CONFIG.to_owned());
    let file = LimitsFile::read(&config)?;
    let redis_url = std::env::var("REDIS_URL").ok();
    let (store, demo_memory) = demo::store_for(Some(&file), redis_url.as_deref()).await?;
    let lab = match std::env::var("TOLLWAY_LAB").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        Ok(other) => return Err(format!("TOLLWAY_LAB must be 1 or 0 (got {other:?})").into()),
        Err(_) => demo_memory,
    };
    let admin_token = std::env::var("ADMIN_TOKEN").ok().filter(|t| !t.is_empty());
    // Names besides localhost and IP addresses the lab and /metrics answer at.
    let hosts = std::env::var("TOLLWAY_HOSTS")
        .map(|names| {
            names
                .split(',')
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let doors = Doors {
        admin_token,
        lab,
        hosts,
    };
    serve(store, &config, &doors, listener, addr).await
}

/// Builds the application over `store` and serves it until Ctrl-C.
async fn serve(
    store: BoxStore,
    config: &str,
    doors: &Doors,
    listener: TcpListener,
    addr: SocketAddr,
) -> Result<(), Box<dyn Error>> {
    // Redis call latency as a histogram (the exporter's default is a summary).
    let metrics = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("tollway_store_duration_seconds".to_owned()),
            &[
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
            ],
        )?
        .install_recorder()?;
    let (app, reloader) = axum_app::app(Path::new(config), store, metrics, doors)?;
    // Reloaded whenever the file changes, while this lives, and on SIGHUP.
    let _watcher = reloader.watch()?;
    reload_on_hangup(reloader.clone());
    println!("limits: {config} (watched: edit it and the next request sees the change)");

    print_usage(addr, doors);
    demo::serve_until_ctrl_c(listener, app).await?;
    Ok(())
}

/// Reads the limits file again on every SIGHUP (`kill -HUP <pid>`), as daemons do.
#[cfg(unix)]
fn reload_on_hangup(reloader: Reloader<BoxStore>) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        eprintln!("SIGHUP cannot be caught here: the limits file is still watched");
        return;
    };
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            match reloader.reload().await {
                Ok(reloaded) => println!("SIGHUP: limits reloaded ({})", reloaded.version()),
                Err(e) => eprintln!("SIGHUP: limits not reloaded, the running ones stay: {e}"),
            }
        }
    });
}

#[cfg(not(unix))]
fn reload_on_hangup(_: Reloader<BoxStore>) {}

fn print_usage(addr: SocketAddr, doors: &Doors) {
    let base = format!("localhost:{}", addr.port());
    println!("listening on http://{addr}");
    if doors.lab {
        println!("the live lab: http://{base}/lab (on a memory store of its own)");
    } else {
        println!("the lab is off (not the demo's memory store): TOLLWAY_LAB=1 mounts it");
    }
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
    println!("  # a partner (allow list) and a banned key (deny list: 403)");
    println!("  curl -i -H 'X-API-Key: {}' {base}/", demo::PARTNER_KEY);
    println!("  curl -i -H 'X-API-Key: {}' {base}/", demo::BANNED_KEY);
    println!("  # a completion charged after the response for the 400 tokens it used (1,000/min)");
    println!("  curl -i -X POST '{base}/api/v1/completions?tokens=400'");
    println!("  # metrics");
    println!("  curl {base}/metrics");
    if doors.admin_token.is_none() {
        println!(
            "  # the admin API is off: start with ADMIN_TOKEN=<a secret of your own> to mount it"
        );
    } else {
        // The token itself is never printed: the shell fills it in.
        println!(
            "  # the admin API ({} requests a minute per address)",
            axum_app::ADMIN_PER_MINUTE
        );
        let auth = "-H \"Authorization: Bearer $ADMIN_TOKEN\"";
        println!("  curl {auth} {base}/admin/limits/anonymous/ip:127.0.0.1");
        println!("  curl -X DELETE {auth} {base}/admin/limits/anonymous/ip:127.0.0.1");
        println!("  curl -X PUT {auth} -d on {base}/admin/shadow/all");
        println!("  curl -X POST {auth} {base}/admin/reload");
    }
    println!();
    println!("Ctrl-C stops the server.");
}
