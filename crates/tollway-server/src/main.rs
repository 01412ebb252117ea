//! `tollway-server`: the Envoy rate limit service.
//!
//! ```text
//! tollway-server [--config FILE] [--grpc ADDR] [--http ADDR] [--log json|text]
//!                [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]
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

const USAGE: &str = "usage: tollway-server [--config FILE] [--grpc ADDR] [--http ADDR] \
     [--log json|text] [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] \
     [--max-connections N] [--handshake-timeout SECONDS]";

const HELP: &str = "tollway-server: an Envoy rate limit service (RLS v3) over a tollway limits file

usage: tollway-server [--config FILE] [--grpc ADDR] [--http ADDR] [--log json|text]
                      [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]
                      [--max-connections N] [--handshake-timeout SECONDS]

  --config FILE   the limits file (default: $TOLLWAY_CONFIG, else /etc/tollway/limits.toml);
                  watched and reloaded when it changes, and on SIGHUP
  --grpc ADDR     where Envoy asks ShouldRateLimit, with gRPC health (default 0.0.0.0:8081);
                  keep it off the clients' network: a caller of it can spend any budget
  --http ADDR     /metrics, /ready and /live (default 0.0.0.0:9090; 127.0.0.1:9090 keeps
                  them on this host)
  --log FORMAT    json (default) or text; the level from RUST_LOG (default info)
  --tls-cert FILE, --tls-key FILE
                  TLS on the gRPC port: the certificate chain and its key, PEM
  --tls-client-ca FILE
                  mutual TLS: only clients with a certificate this CA signed (PEM) are
                  served (Envoy's cluster then presents one)
  --max-connections N
                  the most connections the gRPC port holds, handshakes included (default
                  1024; fewer when the descriptor limit is lower); the HTTP port holds 64
  --handshake-timeout SECONDS
                  how long a gRPC connection has for its TLS handshake and HTTP/2 preface,
                  and an HTTP request for its headers (default 10)
  -h, --help      this text

`tollway check FILE` validates a limits file and prints what it limits.";

struct Args {
    config: PathBuf,
    grpc: SocketAddr,
    http: SocketAddr,
    json: bool,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
    connections: tollway_server::Connections,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        config: std::env::var_os("TOLLWAY_CONFIG")
            .map_or_else(|| PathBuf::from("/etc/tollway/limits.toml"), PathBuf::from),
        grpc: SocketAddr::from(([0, 0, 0, 0], 8081)),
        http: SocketAddr::from(([0, 0, 0, 0], 9090)),
        json: true,
        tls_cert: None,
        tls_key: None,
        tls_client_ca: None,
        connections: tollway_server::Connections::default(),
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
            "--tls-cert" => args.tls_cert = Some(PathBuf::from(value()?)),
            "--tls-key" => args.tls_key = Some(PathBuf::from(value()?)),
            "--tls-client-ca" => args.tls_client_ca = Some(PathBuf::from(value()?)),
            "--grpc" => args.grpc = address(value()?)?,
            "--max-connections" => {
                args.connections.grpc = match value()?.parse::<usize>() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(format!("--max-connections is a number above 0\n{USAGE}")),
                }
            }
            "--handshake-timeout" => {
                args.connections.handshake = match value()?.parse::<u64>() {
                    Ok(s) if s > 0 => std::time::Duration::from_secs(s),
                    _ => {
                        return Err(format!(
                            "--handshake-timeout is whole seconds above 0\n{USAGE}"
                        ));
                    }
                }
            }
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
    let tls = (&args.tls_cert, &args.tls_key, &args.tls_client_ca);
    if matches!(
        tls,
        (Some(_), None, _) | (None, Some(_), _) | (None, None, Some(_))
    ) {
        return Err(format!(
            "TLS needs both --tls-cert and --tls-key (and --tls-client-ca for mutual TLS)\n{USAGE}"
        ));
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

async fn run(mut args: Args) -> Result<(), Box<dyn std::error::Error>> {
    args.connections.grpc = within_descriptors(args.connections);
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let grpc = TcpListener::bind(args.grpc).await?;
    let http = TcpListener::bind(args.http).await?;
    tracing::info!(grpc = %grpc.local_addr()?, http = %http.local_addr()?, config = %args.config.display(), "serving");
    // The signals are ours before the store is connected: a SIGHUP meanwhile is no kill.
    let signals = Signals::new()?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(tollway_server::Tls {
            cert: read(cert)?,
            key: read(key)?,
            client_ca: args.tls_client_ca.as_deref().map(read).transpose()?,
        }),
        _ => None,
    };
    let running = tollway_server::start(tollway_server::Options {
        config: &args.config,
        grpc,
        http,
        metrics,
        watch: true,
        tls,
        connections: args.connections,
    })
    .await?;
    signals.stopped(&running).await;
    tracing::info!("stopping: calls in progress finish");
    running.stop().await;
    Ok(())
}

/// The bytes of the PEM file at `path`; an error names the file, never its contents.
fn read(path: &std::path::Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
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

/// Descriptors kept for the rest of the process: the store's connections, the limits
/// file, its watcher, the listeners and logs.
const RESERVE: u64 = 64;

/// Raises the process's soft descriptor limit to its hard one (as Go's runtime does),
/// and returns the gRPC port's connection cap, lowered when the limit leaves no room for
/// it beside the HTTP port and [`RESERVE`].
fn within_descriptors(connections: tollway_server::Connections) -> usize {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if setrlimit(Resource::Nofile, raised).is_ok() {
            limit = raised;
        }
    }
    let Some(descriptors) = limit.current else {
        return connections.grpc;
    };
    let room = descriptors.saturating_sub(RESERVE + connections.http as u64);
    let room = usize::try_from(room).unwrap_or(usize::MAX).max(1);
    if room < connections.grpc {
        tracing::warn!(
            descriptors,
            max_connections = room,
            "the descriptor limit leaves room for fewer gRPC connections than asked"
        );
        return room;
    }
    connections.grpc
}
