//! What the demo servers and client share: logging, the port, the store chosen by
//! `REDIS_URL`, and the demo API keys with their tiers. The examples package's library,
//! `demo`: not an example of its own.

use std::collections::HashMap;
use std::error::Error;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;

use tokio::net::TcpListener;
use tollway_tower::config::LimitsFile;
use tollway_tower::{
    Algorithm, ApiKey, BoxStore, ConfigError, Fallback, MemoryStore, Or, PeerIp, Policy, Quota,
    RedisStore,
};
use tracing_subscriber::EnvFilter;

pub mod axum_app;
pub mod catalog;
pub mod guard;
pub mod lab;
pub mod llm;

/// The demo API keys and the tier each belongs to.
pub const DEMO_KEYS: [(&str, &str); 2] = [("demo-free-key", "free"), ("demo-pro-key", "pro")];

/// A partner's key, on the axum example's allow list: never limited.
pub const PARTNER_KEY: &str = "demo-partner-key";

/// A key on the axum example's deny list: refused with 403.
pub const BANNED_KEY: &str = "demo-banned-key";

/// Logs to stderr at `RUST_LOG` (default `info`).
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
}

/// The process's exit code for `result`, printing an error.
pub fn exit(result: Result<(), Box<dyn Error>>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// `PORT`, or `default`.
pub fn port(default: u16) -> Result<u16, String> {
    match std::env::var("PORT") {
        Ok(text) => text
            .parse::<u16>()
            .map_err(|_| format!("PORT must be a port number from 0 to 65535 (got {text:?})")),
        Err(_) => Ok(default),
    }
}

/// A listener on 127.0.0.1 at `PORT`, or `default`.
pub async fn listen(default: u16) -> Result<(TcpListener, SocketAddr), Box<dyn Error>> {
    let port = port(default)?;
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port))
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:{port}: {e}"))?;
    let addr = listener.local_addr()?;
    Ok((listener, addr))
}

/// Serves `app` on `listener` with each connection's address (`ConnectInfo`), until
/// Ctrl-C (or until killed, where the signal cannot be caught).
///
/// # Errors
///
/// When the server fails.
pub async fn serve_until_ctrl_c(listener: TcpListener, app: axum::Router) -> std::io::Result<()> {
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    })
    .await
}

/// The Redis store at `url`, or an error that says what to do.
///
/// Its breaker and local fallback are the store's defaults: when Redis stalls or dies,
/// decisions come from this process's memory within microseconds, each gateway allowed
/// its share of the quota — one in `GATEWAYS` (default 1: this gateway alone).
pub async fn redis_store(url: &str) -> Result<RedisStore, String> {
    let gateways = match std::env::var("GATEWAYS") {
        Ok(text) => text
            .parse::<u32>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("GATEWAYS must be a whole number above 0 (got {text:?})"))?,
        Err(_) => 1,
    };
    RedisStore::builder()
        .prefix("tollway-demo")
        .local_fallback(1.0 / f64::from(gateways))
        .connect(url)
        .await
        .map_err(|e| {
            format!(
                "cannot use Redis at {url}: {e}\n\
                 Start Redis (redis-server) or unset REDIS_URL to use the memory store."
            )
        })
}

/// The store `REDIS_URL` names (limits shared by every server using it), else the
/// memory store (this process only), as one type for the layer: a [`BoxStore`].
pub async fn store_from_env() -> Result<BoxStore, String> {
    let url = std::env::var("REDIS_URL").ok();
    Ok(store_for(None, url.as_deref()).await?.0)
}

/// The store a server uses: the limits file's `[store]` section when it has one, else
/// the Redis at `redis_url`, else the memory store (this process only); and whether it
/// is the demo's own memory store (neither a file's store nor Redis). A file naming a
/// store and a `REDIS_URL` both is refused: one of them would be ignored, and gateways
/// that meant to share limits would not.
///
/// # Errors
///
/// When both name a store, or the store cannot be reached.
pub async fn store_for(
    file: Option<&LimitsFile>,
    redis_url: Option<&str>,
) -> Result<(BoxStore, bool), String> {
    match (file.filter(|f| f.has_store()), redis_url) {
        (Some(file), Some(_)) => Err(format!(
            "{} has a [store] section and REDIS_URL is set too: remove the section, or unset \
             REDIS_URL, so that one of them says where the limits are kept",
            file.name()
        )),
        (Some(file), None) => {
            let store = file.store().await.map_err(|e| e.to_string())?;
            println!("store: the [store] section of {}", file.name());
            // Whatever it names, a file that chose a store is no throwaway demo.
            Ok((store, false))
        }
        (None, Some(url)) => {
            let store = redis_store(url).await?;
            println!(
                "store: Redis at {} (limits shared by every server using it)",
                without_password(url)
            );
            Ok((BoxStore::new(store), false))
        }
        (None, None) => {
            println!("store: memory (this process only; set REDIS_URL to share limits)");
            Ok((BoxStore::new(MemoryStore::new()), true))
        }
    }
}

/// `url` without what comes before an `@` (a user name and password).
fn without_password(url: &str) -> String {
    match (url.split_once("://"), url.rsplit_once('@')) {
        (Some((scheme, _)), Some((_, host))) => format!("{scheme}://…@{host}"),
        _ => url.to_owned(),
    }
}

/// The anonymous (20/min per IP), Free (100/min) and Pro (10,000/min) policies.
pub fn tier_policies() -> Result<[Policy; 3], ConfigError> {
    Ok([
        Policy::new("anonymous", Algorithm::TokenBucket, Quota::per_minute(20)?)?,
        Policy::new("free", Algorithm::TokenBucket, Quota::per_minute(100)?)?,
        Policy::new("pro", Algorithm::TokenBucket, Quota::per_minute(10_000)?)?,
    ])
}

/// The demo keys as a map from key to tier name (the listed keys are Free callers, for
/// a server without lists).
pub fn tiers() -> HashMap<String, String> {
    DEMO_KEYS
        .iter()
        .chain(&[(PARTNER_KEY, "free"), (BANNED_KEY, "free")])
        .map(|(key, tier)| ((*key).to_owned(), (*tier).to_owned()))
        .collect()
}

/// Keys callers by `X-API-Key`, but only keys we issued: any other value is no key, and
/// the caller is limited by its address instead. Otherwise anyone could mint a fresh
/// limit by sending a new random key with every request.
pub fn known_api_key() -> Result<Or<ApiKey<HashMap<String, String>>, PeerIp>, ConfigError> {
    Ok(ApiKey::header("x-api-key")?
        .known(tiers())
        .or(PeerIp::new()))
}
