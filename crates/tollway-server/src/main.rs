//! `tollway-server`: the Envoy rate limit service.
//!
//! ```text
//! tollway-server [--config FILE] [--grpc ADDR] [--http ADDR] [--log json|text]
//! tollway-server --help
//! ```
//!
//! Defaults suit a container: `--config /etc/tollway/limits.toml` (or `TOLLWAY_CONFIG`),
//! gRPC on `0.0.0.0:8081`, `/metrics`, `/ready` and `/live` on `0.0.0.0:9090`, logs as
//! JSON lines. The file is watched and reloaded when it changes, and on `SIGHUP`.
//! `SIGTERM` or Ctrl-C stop it gracefully.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::net::TcpListener;

const USAGE: &str =
    "usage: tollway-server [--config FILE] [--grpc ADDR] [--http ADDR] [--log json|text]";

const HELP: &str = "tollway-server: an Envoy rate limit service (RLS v3) over a tollway limits file

usage: tollway-server [--config FILE] [--grpc ADDR] [--http ADDR] [--log json|text]

  --config FILE   the limits file (default: $TOLLWAY_CONFIG, else /etc/tollway/limits.toml);
                  watched and reloaded when it changes, and on SIGHUP
  --grpc ADDR     where Envoy asks ShouldRateLimit, with gRPC health (default 0.0.0.0:8081);
                  keep it off the clients' network: a caller of it can spend any budget
  --http ADDR     /metrics, /ready and /live (default 0.0.0.0:9090; 127.0.0.1:9090 keeps
                  them on this host)
  --log FORMAT    json (default) or text; the level from RUST_LOG (default info)
  -h, --help      this text

`tollway check FILE` validates a limits file and prints what it limits.";

struct Args {
    config: PathBuf,
    grpc: SocketAddr,
    http: SocketAddr,
    json: bool,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        config: std::env::var_os("TOLLWAY_CONFIG")
            .map_or_else(|| PathBuf::from("/etc/tollway/limits.toml"), PathBuf::from),
        grpc: SocketAddr::from(([0, 0, 0, 0], 8081)),
        http: SocketAddr::from(([0, 0, 0, 0], 9090)),
        json: true,
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        let mut value = || {
            given
                .next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        let address = |v: String| {
            v.parse::<SocketAddr>()
                .map_err(|_| format!("{flag} {v:?} is not an address like 0.0.0.0:8081\n{USAGE}"))
        };
        match flag.as_str() {
            "-h" | "--help" => return Err(String::new()),
            "--config" => args.config = PathBuf::from(value()?),
            "--grpc" => args.grpc = address(value()?)?,
            "--http" => args.http = address(value()?)?,
            "--log" => {
                args.json = match value()?.as_str() {
                    "json" => true,
                    "text" => false,
                    _ => return Err(format!("--log is json or text\n{USAGE}")),
                }
            }
            _ => return Err(format!("unknown argument {flag:?}\n{USAGE}")),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match args() {
        Ok(args) => args,
        // Asked for help: the help, on standard output, and success.
        Err(message) if message.is_empty() => {
            println!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt().with_env_filter(filter);
    if args.json {
        logs.json().init();
    } else {
        logs.init();
    }
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(%error, "tollway-server stopped");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let grpc = TcpListener::bind(args.grpc).await?;
    let http = TcpListener::bind(args.http).await?;
    tracing::info!(grpc = %grpc.local_addr()?, http = %http.local_addr()?, config = %args.config.display(), "serving");
    // The signals are ours before the store is connected: a SIGHUP meanwhile is no kill.
    let signals = Signals::new()?;
    let running = tollway_server::start(tollway_server::Options {
        config: &args.config,
        grpc,
        http,
        metrics,
        watch: true,
    })
    .await?;
    signals.stopped(&running).await;
    tracing::info!("stopping: calls in progress finish");
    running.stop().await;
    Ok(())
}

/// The signals the server answers.
#[cfg(unix)]
struct Signals {
    term: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

#[cfg(unix)]
impl Signals {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }

    /// Waits for `SIGTERM` or Ctrl-C, reloading on each `SIGHUP` meanwhile.
    async fn stopped(mut self, running: &tollway_server::Running) {
        loop {
            tokio::select! {
                _ = self.term.recv() => return,
                _ = tokio::signal::ctrl_c() => return,
                _ = self.hangup.recv() => {
                    if let Err(error) = running.reload().await {
                        tracing::warn!(%error, "not reloaded; the running limits stay");
                    }
                }
            }
        }
    }
}

/// Ctrl-C alone.
#[cfg(not(unix))]
struct Signals;

#[cfg(not(unix))]
impl Signals {
    fn new() -> std::io::Result<Self> {
        Ok(Signals)
    }

    async fn stopped(self, _: &tollway_server::Running) {
        let _ = tokio::signal::ctrl_c().await;
    }
}
