//! Running the service: its gRPC port (the rate limit service and gRPC health), its
//! HTTP port (`/metrics`, `/ready`, `/live`), readiness from the store, reloads, and a
//! graceful stop.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tollway_core::{Algorithm, BoxStore, ConfigError, Operation, Policy, Quota, Store};
use tollway_tower::config::{LimitsFile, Reloader, Watcher};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::accept::{self, Connections};
use crate::quota::{Buckets, QuotaService};
use crate::service::{Bounded, RateLimitService, Rules};

/// How often readiness asks the store.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// How long a stop waits for calls in progress (and health watchers) to finish.
pub const STOP_WITHIN: Duration = Duration::from_secs(10);

/// The key readiness peeks at: it consumes nothing and writes nothing.
const PROBE_KEY: &[u8] = b"tollway-server:ready";

/// A running server: its service, its reloader, and the switch that stops it.
#[derive(Debug)]
pub struct Running {
    service: RateLimitService,
    reloader: Reloader<BoxStore>,
    readiness: Readiness,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    _watcher: Option<Watcher>,
}

/// Everything [`start`] needs.
#[derive(Debug)]
pub struct Options<'a> {
    /// The limits file: policies, `[[descriptors]]`, `[store]`, `[layer]`.
    pub config: &'a Path,
    /// Where gRPC is served: the rate limit service and `grpc.health.v1.Health`.
    pub grpc: TcpListener,
    /// Where `/metrics`, `/ready` and `/live` are served.
    pub http: TcpListener,
    /// The Prometheus recorder's handle, which `/metrics` renders.
    pub metrics: PrometheusHandle,
    /// Whether to reload when the file changes (a reload can also be asked with
    /// [`Running::reload`], or `SIGHUP` to the binary).
    pub watch: bool,
    /// TLS on the gRPC port, and mutual TLS when it names a client CA; `None`: plain
    /// gRPC, for a port only Envoy can reach.
    pub tls: Option<Tls>,
    /// Bounds on both ports' connections.
    pub connections: Connections,
}

/// TLS on the gRPC port: the server's certificate chain and private key, PEM; with
/// `client_ca`, mutual TLS (a client without a certificate that CA signed is refused in
/// the handshake, before any call).
///
/// TLS uses the process's rustls crypto provider. When none is installed, [`start`]
/// installs ring's (a process with both of rustls's providers compiled in has no
/// default of its own). Its `Debug` never shows the key.
#[derive(Clone)]
pub struct Tls {
    /// The certificate chain, PEM.
    pub cert: Vec<u8>,
    /// The private key, PEM.
    pub key: Vec<u8>,
    /// The CA whose certificates clients must present, PEM.
    pub client_ca: Option<Vec<u8>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("cert", &format_args!("{} bytes", self.cert.len()))
            .field("key", &"<hidden>")
            .field("mutual", &self.client_ca.is_some())
            .finish()
    }
}

impl Tls {
    /// The rustls configuration: the certificate and key, the client CA if any, and
    /// HTTP/2 by ALPN.
    fn config(&self) -> Result<rustls::ServerConfig, ConfigError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};

        let bad = |what: &str, e: &dyn std::fmt::Display| {
            ConfigError::new(format!("TLS on the gRPC port: {what}: {e}"))
        };
        let chain = CertificateDer::pem_slice_iter(&self.cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad("the certificate (PEM)", &e))?;
        if chain.is_empty() {
            return Err(ConfigError::new(
                "TLS on the gRPC port: the certificate file holds no -----BEGIN CERTIFICATE----- block",
            ));
        }
        let key = PrivateKeyDer::from_pem_slice(&self.key).map_err(|e| bad("the key (PEM)", &e))?;
        let builder = rustls::ServerConfig::builder();
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for certificate in CertificateDer::pem_slice_iter(ca) {
                    let certificate = certificate.map_err(|e| bad("the client CA (PEM)", &e))?;
                    roots
                        .add(certificate)
                        .map_err(|e| bad("the client CA", &e))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
                    .build()
                    .map_err(|e| bad("the client CA", &e))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| bad("the certificate and key", &e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// How often the gRPC port pings a quiet peer, and how long it waits for the answer.
const KEEPALIVE: Duration = Duration::from_secs(30);

/// Reads the limits file, connects its store, and serves until [`Running::stop`].
///
/// # Errors
///
/// When the file is not valid, or its store cannot be reached, or the file watcher
/// cannot be set up.
pub async fn start(options: Options<'_>) -> Result<Running, ConfigError> {
    // A bad certificate or key fails here, before anything is served.
    let tls = match &options.tls {
        None => None,
        Some(tls) => {
            if rustls::crypto::CryptoProvider::get_default().is_none() {
                // Lost only to another thread installing one first, which then serves.
                let _ = rustls::crypto::ring::default_provider().install_default();
            }
            Some(tokio_rustls::TlsAcceptor::from(Arc::new(tls.config()?)))
        }
    };
    // Keepalive pings end the calls (quota streams above all) of a peer that went.
    let grpc_server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE));
    let file = LimitsFile::read(options.config)?;
    let store = file.store().await?;
    let rules = Rules::from_file(&file)?;
    let buckets = Buckets::from_file(&file)?;
    // One follower of the file: the layer's limits first (it refuses a file whose
    // [store] or [key] changed), then the descriptors.
    let reloader = Reloader::from_file(options.config, file, store)?;
    let service = RateLimitService::new(reloader.layer(), rules);
    let quota = QuotaService::new(reloader.layer(), buckets);
    reloader.follower().follow({
        let (service, quota) = (service.clone(), quota.clone());
        move |file| {
            let (rules, buckets) = (Rules::from_file(file)?, Buckets::from_file(file)?);
            service.set_rules(rules);
            quota.set_rules(buckets);
            Ok(())
        }
    });
    let watcher = if options.watch {
        Some(reloader.watch()?)
    } else {
        None
    };
    let (stop, stopped) = watch::channel(false);
    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, ServingStatus::NotServing).await;
    let readiness = Readiness {
        store: service.store().clone(),
        probe: Policy::new(
            "tollway-server-ready",
            Algorithm::Gcra,
            Quota::per_second(1)?,
        )?,
        ready: Arc::new(AtomicBool::new(false)),
        health,
    };
    let mut tasks = Vec::new();

    // Readiness: the store answers a peek, once a second.
    tasks.push(tokio::spawn({
        let (readiness, mut stopped) = (readiness.clone(), stopped.clone());
        async move {
            let mut every = tokio::time::interval(PROBE_EVERY);
            loop {
                tokio::select! {
                    _ = every.tick() => {}
                    _ = stopped.changed() => break,
                }
                readiness.probe().await;
            }
        }
    }));

    // gRPC: connections bounded and handshaken apart (`accept`), then served.
    tasks.push(tokio::spawn({
        let mut grpc_server = grpc_server;
        let router = grpc_server
            .add_service(health_service)
            .add_service(Bounded::new(service.clone()))
            .add_service(quota.clone().into_server());
        let (listener, connections) = (options.grpc, options.connections);
        let (stopped, mut stop_signal) = (stopped.clone(), stopped.clone());
        let signal = async move {
            let _ = stop_signal.changed().await;
        };
        async move {
            let served = match tls {
                Some(tls) => {
                    let incoming = accept::grpc(listener, accept::Tls(tls), connections, stopped);
                    router
                        .serve_with_incoming_shutdown(ReceiverStream::new(incoming), signal)
                        .await
                }
                None => {
                    let incoming = accept::grpc(listener, accept::Plain, connections, stopped);
                    router
                        .serve_with_incoming_shutdown(ReceiverStream::new(incoming), signal)
                        .await
                }
            };
            if let Err(error) = served {
                tracing::error!(%error, "the gRPC server failed");
            }
        }
    }));

    // HTTP: metrics and probes.
    tasks.push(tokio::spawn({
        let metrics = options.metrics;
        let ready = Arc::clone(&readiness.ready);
        let app = Router::new()
            .route(
                "/metrics",
                get(move || std::future::ready(metrics.render())),
            )
            .route(
                "/ready",
                get(move || {
                    let status = if ready.load(Ordering::SeqCst) {
                        http::StatusCode::OK
                    } else {
                        http::StatusCode::SERVICE_UNAVAILABLE
                    };
                    std::future::ready(status)
                }),
            )
            .route("/live", get(|| std::future::ready("live")));
        accept::http(options.http, app, options.connections, stopped)
    }));

    Ok(Running {
        service,
        reloader,
        readiness,
        stop,
        tasks,
        _watcher: watcher,
    })
}

/// Whether the store answers: the readiness that `/ready` and gRPC health say.
#[derive(Clone, Debug)]
struct Readiness {
    store: BoxStore,
    /// A policy to peek under: a peek consumes nothing and writes nothing.
    probe: Policy,
    ready: Arc<AtomicBool>,
    health: HealthReporter,
}

impl Readiness {
    /// Asks the store now, and says what it answered; returns whether it did.
    async fn probe(&self) -> bool {
        let answered = self
            .store
            .operate(PROBE_KEY, &[&self.probe], Operation::Peek(1))
            .await;
        let now = answered.is_ok();
        if self.ready.swap(now, Ordering::SeqCst) != now {
            tracing::info!(ready = now, "readiness changed");
        }
        let status = if now {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        set_health(&self.health, status).await;
        now
    }
}

/// Says `status` for the rate limit service and for the server as a whole (`""`, what
/// Envoy's and Kubernetes' gRPC probes ask by default).
async fn set_health(health: &HealthReporter, status: ServingStatus) {
    let name = <RateLimitServiceServer<RateLimitService> as tonic::server::NamedService>::NAME;
    health.set_service_status(name, status).await;
    let quota = <crate::quota::QuotaServer as tonic::server::NamedService>::NAME;
    health.set_service_status(quota, status).await;
    health.set_service_status("", status).await;
}

impl Running {
    /// The service, as it answers now.
    #[must_use]
    pub fn service(&self) -> &RateLimitService {
        &self.service
    }

    /// Whether the store answered the last readiness probe.
    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.readiness.ready.load(Ordering::SeqCst)
    }

    /// Asks the store now, rather than at the next probe (every second), and puts what it
    /// answered in `/ready` and gRPC health; returns whether it answered.
    pub async fn probe(&self) -> bool {
        self.readiness.probe().await
    }

    /// Reads the limits file again and puts it in force (what `SIGHUP` does).
    ///
    /// # Errors
    ///
    /// When the file is not valid: the running rules stay.
    pub async fn reload(&self) -> Result<(), ConfigError> {
        self.reloader.reload().await.map(drop)
    }

    /// Stops serving: health says not serving first, then new calls are refused and
    /// calls in progress finish, for up to [`STOP_WITHIN`]; what is left then is dropped.
    pub async fn stop(self) {
        set_health(&self.readiness.health, ServingStatus::NotServing).await;
        let _ = self.stop.send(true);
        for mut task in self.tasks {
            if tokio::time::timeout(STOP_WITHIN, &mut task).await.is_err() {
                task.abort();
            }
        }
    }
}
