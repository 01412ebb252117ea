//! tollway-server for the end-to-end tests and benches: its gRPC and HTTP ports on free
//! loopback ports (or a gRPC address the test names), no file watcher.

use std::net::SocketAddr;
use std::path::Path;

use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

/// A running tollway-server and its ports.
#[derive(Debug)]
pub struct Served {
    /// The server.
    pub running: tollway_server::Running,
    /// Its gRPC port.
    pub grpc: SocketAddr,
    /// Its HTTP port (`/metrics`, `/ready`, `/live`).
    pub http: SocketAddr,
}

/// Starts tollway-server on `config`, its gRPC port on `grpc` (port 0: a free one) and
/// served with `tls`, its HTTP port free, rendering metrics with `metrics`.
///
/// # Errors
///
/// What [`tollway_server::start`] refuses: a bad file, an unreachable store.
///
/// # Panics
///
/// When a port cannot be bound.
pub async fn start(
    config: &Path,
    grpc: SocketAddr,
    tls: Option<tollway_server::Tls>,
    metrics: PrometheusHandle,
) -> Result<Served, tollway_core::ConfigError> {
    let grpc = TcpListener::bind(grpc).await.expect("a gRPC port");
    let http = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("an HTTP port");
    let (grpc_addr, http_addr) = (
        grpc.local_addr().expect("its address"),
        http.local_addr().expect("its address"),
    );
    let running = tollway_server::start(tollway_server::Options {
        config,
        grpc,
        http,
        metrics,
        watch: false,
        tls,
        connections: tollway_server::Connections::default(),
    })
    .await?;
    Ok(Served {
        running,
        grpc: grpc_addr,
        http: http_addr,
    })
}

/// A free loopback port's address, for [`start`].
pub fn any_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}
