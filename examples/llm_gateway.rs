//! An LLM gateway: an axum proxy in front of a model API that streams tokens, limited
//! per API key to requests a minute, tokens a minute and streams at once.
//!
//! ```sh
//! cargo run --example llm_gateway       # the gateway on port 3000, a stand-in model on 3001
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example llm_gateway   # limits shared in Redis
//! ```
//!
//! The limits are `examples/llm_gateway.toml` (`TOLLWAY_CONFIG` for another file):
//!
//! | API key (`X-API-Key`) | limit |
//! |---|---|
//! | `team-1-key` … `team-3-key` | 120 requests / min |
//! | anyone else | 10 requests / min |
//! | everyone, on `/v1/completions` | also 20,000 tokens / min and 4 streams at once |
//!
//! A call reserves its JSON body's `max_tokens` when it is admitted: the gateway writes
//! it in `x-max-tokens`, between 1 and 4,096 (a client's own header is overwritten). The
//! stand-in model streams one server-sent event a token, then its usage; the gateway
//! counts the tokens as they pass and settles the reservation to them when the stream
//! ends. A stream its client cuts is charged what it delivered; a call the model failed
//! gives its reservation back. A stream holds its slot until its last event, or until
//! the client goes away.

use std::error::Error;
use std::net::Ipv4Addr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use demo::llm;
use tokio::net::TcpListener;
use tollway_tower::config::LimitsFile;

/// The limits file, from the workspace root.
const CONFIG: &str = "examples/llm_gateway.toml";

#[tokio::main]
async fn main() -> ExitCode {
    demo::init_tracing();
    demo::exit(run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let model_port = match std::env::var("MODEL_PORT") {
        Ok(port) => port
            .parse::<u16>()
            .map_err(|_| format!("MODEL_PORT must be a port number (got {port:?})"))?,
        Err(_) => 3001,
    };
    let model = TcpListener::bind((Ipv4Addr::LOCALHOST, model_port))
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:{model_port}: {e}"))?;
    let model_addr = model.local_addr()?;
    // A token every 20 ms: a 200-token answer streams for 4 s.
    let streaming = Arc::new(llm::Streaming::default());
    let model_app = llm::model(Duration::from_millis(20), streaming);
    tokio::spawn(async move { axum::serve(model, model_app).await });

    let (listener, addr) = demo::listen(3000).await?;
    let config = std::env::var("TOLLWAY_CONFIG").unwrap_or_else(|_| CONFIG.to_owned());
    let file = LimitsFile::read(&config)?;
    let redis_url = std::env::var("REDIS_URL").ok();
    let (store, _) = demo::store_for(Some(&file), redis_url.as_deref()).await?;
    let layer = file.layer(store, file.key()?)?;
    let app = llm::limited(model_addr, layer);

    println!("the model (a stand-in) on http://{model_addr}; the gateway on http://{addr}");
    println!("limits: {config}");
    println!("try:");
    println!(
        "  curl -N -H 'X-API-Key: team-1-key' -d '{{\"max_tokens\": 200}}' localhost:{}/v1/completions",
        addr.port()
    );
    demo::serve_until_ctrl_c(listener, app).await?;
    Ok(())
}
