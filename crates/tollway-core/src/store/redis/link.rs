//! The store's own connection: one multiplexed connection to one server, made again
//! when it breaks, over a timed [`Wire`] that the stall watch reads. The server is the
//! one a URL names, or the primary the sentinels name (`sentinel.rs`).
//!
//! The first caller that finds no connection makes one; the others wait for it. A
//! connection is handed out only once it is set up (TCP, TLS, `AUTH`, `SELECT`).

use std::io;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionAddr, ConnectionInfo, RedisError};
use tokio::sync::{Mutex, oneshot};

use super::sentinel::Resolver;
use super::stall::{Pulse, Wire, socket_of};
use crate::{StoreError, StoreErrorKind};

/// A connection in hand: the redis-rs handle, its socket's pulse, and which one it is.
#[derive(Clone)]
pub(super) struct Connection {
    pub(super) generation: u64,
    pub(super) redis: MultiplexedConnection,
    pub(super) pulse: Arc<Pulse>,
}

/// Where the server is.
pub(super) enum Source {
    /// One server, at a fixed address.
    Server(Dial),
    /// The primary the sentinels name now.
    Sentinel(Resolver),
}

/// The connection a store keeps, and how to make the next.
pub(super) struct Link {
    source: Source,
    /// Held by the one caller making a connection.
    asking: Mutex<()>,
    current: RwLock<Current>,
    pub(super) config: AsyncConnectionConfig,
    /// The most one of the link's own steps takes (a connect, a sentinel's answer).
    pub(super) timeout: Duration,
    /// Told each time a new connection is in hand (the breaker's hint to probe).
    on_new: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Dropped with the store: ends a sentinel watch.
    _closed: Option<oneshot::Sender<()>>,
}

struct Current {
    generation: u64,
    connection: Option<Connection>,
}

impl Link {
    /// A link to `source`, with its first connection made; a sentinel's also starts the
    /// watch that follows its failovers.
    pub(super) async fn connect(
        source: Source,
        timeout: Duration,
    ) -> Result<Arc<Self>, RedisError> {
        let sentinel = matches!(source, Source::Sentinel(_));
        let (closed, on_close) = oneshot::channel();
        let link = Arc::new(Link {
            source,
            asking: Mutex::new(()),
            current: RwLock::new(Current {
                generation: 0,
                connection: None,
            }),
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout)),
            timeout,
            on_new: OnceLock::new(),
            _closed: sentinel.then_some(closed),
        });
        link.connection().await?;
        if sentinel {
            tokio::spawn(super::sentinel::watch(Arc::downgrade(&link), on_close));
        }
        Ok(link)
    }

    /// The resolver of a link to a sentinel's primary.
    pub(super) fn resolver(&self) -> Option<&Resolver> {
        match &self.source {
            Source::Sentinel(resolver) => Some(resolver),
            Source::Server(_) => None,
        }
    }

    /// The connection in hand, or a new one.
    pub(super) async fn connection(&self) -> Result<Connection, RedisError> {
        if let Some(current) = self.in_hand() {
            return Ok(current);
        }
        let _asking = self.asking.lock().await;
        // Another caller may have made it while this one waited.
        if let Some(current) = self.in_hand() {
            return Ok(current);
        }
        let made = async {
            match &self.source {
                Source::Server(dial) => dial.open(&self.config).await,
                Source::Sentinel(resolver) => resolver.primary(&self.config).await,
            }
        };
        let (redis, pulse) = tokio::time::timeout(self.timeout, made)
            .await
            .map_err(|_| {
                RedisError::from(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no connection to Redis within the timeout",
                ))
            })??;
        Ok(self.install(redis, pulse))
    }

    /// Makes `redis` the connection in hand, a new generation.
    pub(super) fn install(&self, redis: MultiplexedConnection, pulse: Arc<Pulse>) -> Connection {
        let connection = {
            let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
            current.generation += 1;
            let connection = Connection {
                generation: current.generation,
                redis,
                pulse,
            };
            current.connection = Some(connection.clone());
            connection
        };
        #[cfg(feature = "metrics")]
        if self.resolver().is_some() {
            metrics::counter!(crate::metric::SENTINEL_RESOLVED.name).increment(1);
        }
        if let Some(hint) = self.on_new.get() {
            hint();
        }
        connection
    }

    /// Calls `hint` each time a new connection is in hand: a breaker opened by a
    /// failover or a restart probes at once, instead of after its cool-down.
    pub(super) fn on_new_connection(&self, hint: impl Fn() + Send + Sync + 'static) {
        let _ = self.on_new.set(Box::new(hint));
    }

    fn in_hand(&self) -> Option<Connection> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        current.connection.clone()
    }

    /// Drops generation `generation`'s connection, if it is still the one in hand: the
    /// next call makes another.
    pub(super) fn forget(&self, generation: u64) {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        if current
            .connection
            .as_ref()
            .is_some_and(|c| c.generation == generation)
        {
            current.connection = None;
        }
    }

    pub(super) fn forget_current(&self) {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        current.connection = None;
    }
}

/// Whether `e` says the server at hand is no longer there, or no longer the primary.
pub(super) fn moved(e: &RedisError) -> bool {
    e.is_connection_dropped() || e.is_connection_refusal() || e.is_io_error() || read_only(e)
}

/// `READONLY`: the server is a replica now, and ran nothing.
pub(super) fn read_only(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
}

/// How to open a connection to one server: its address, login and TLS.
pub(super) struct Dial {
    addr: ConnectionAddr,
    login: redis::RedisConnectionInfo,
    #[cfg(feature = "tls")]
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl Dial {
    /// The way to `info`'s server; over TLS, trusting `root` (PEM) when given, else the
    /// system's roots.
    pub(super) fn new(info: &ConnectionInfo, root: Option<&[u8]>) -> Result<Self, StoreError> {
        let bad = |message: String| StoreError::new(StoreErrorKind::Other, message);
        let addr = info.addr().clone();
        let tls = matches!(addr, ConnectionAddr::TcpTls { .. });
        if root.is_some() && !tls {
            return Err(bad(format!(
                "a TLS root certificate was given, but {addr} is not a rediss:// address: use \
                 rediss://, or leave out tls_root_certificate"
            )));
        }
        if let ConnectionAddr::TcpTls { insecure: true, .. } = addr {
            return Err(bad(
                "rediss:// with #insecure turns certificate checks off: tollway does not; \
                 give the server's CA with tls_root_certificate instead"
                    .to_owned(),
            ));
        }
        #[cfg(not(feature = "tls"))]
        if tls {
            return Err(bad(
                "rediss:// needs tollway-core's `tls` feature, which this build does not have"
                    .to_owned(),
            ));
        }
        Ok(Dial {
            addr,
            login: info.redis_settings().clone(),
            #[cfg(feature = "tls")]
            tls: if tls {
                Some(Arc::new(tls_config(root)?))
            } else {
                None
            },
        })
    }

    /// The way to `host:port` with the same login and TLS.
    pub(super) fn to(&self, host: String, port: u16) -> Dial {
        let addr = match self.addr {
            ConnectionAddr::TcpTls { .. } => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: false,
                tls_params: None,
            },
            _ => ConnectionAddr::Tcp(host, port),
        };
        Dial {
            addr,
            login: self.login.clone(),
            #[cfg(feature = "tls")]
            tls: self.tls.clone(),
        }
    }

    /// A new connection, set up and ready for calls; its driver runs on its own task.
    pub(super) async fn open(
        &self,
        config: &AsyncConnectionConfig,
    ) -> Result<(MultiplexedConnection, Arc<Pulse>), RedisError> {
        match &self.addr {
            ConnectionAddr::Tcp(host, port) => {
                let tcp = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                // Calls are small and pipelined: each goes at once (see `tcp_settings`).
                tcp.set_nodelay(true)?;
                let socket = socket_of(&tcp)?;
                let (wire, pulse) = Wire::new(tcp, socket);
                self.set_up(wire, pulse, config).await
            }
            #[cfg(feature = "tls")]
            ConnectionAddr::TcpTls { host, port, .. } => {
                let tcp = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                tcp.set_nodelay(true)?;
                let socket = socket_of(&tcp)?;
                let Some(tls) = &self.tls else {
                    return Err(unsupported("TLS without its configuration"));
                };
                let name = rustls::pki_types::ServerName::try_from(host.clone()).map_err(|e| {
                    RedisError::from((
                        redis::ErrorKind::InvalidClientConfig,
                        "not a TLS server name",
                        e.to_string(),
                    ))
                })?;
                let stream = tokio_rustls::TlsConnector::from(Arc::clone(tls))
                    .connect(name, tcp)
                    .await?;
                // Counted above TLS, where the requests and replies are readable.
                let (wire, pulse) = Wire::new(stream, socket);
                self.set_up(wire, pulse, config).await
            }
            #[cfg(unix)]
            ConnectionAddr::Unix(path) => {
                let unix = tokio::net::UnixStream::connect(path).await?;
                let socket = socket_of(&unix)?;
                let (wire, pulse) = Wire::new(unix, socket);
                self.set_up(wire, pulse, config).await
            }
            _ => Err(unsupported("this kind of Redis address")),
        }
    }

    async fn set_up<S>(
        &self,
        stream: S,
        pulse: Arc<Pulse>,
        config: &AsyncConnectionConfig,
    ) -> Result<(MultiplexedConnection, Arc<Pulse>), RedisError>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        // The store bounds each call itself (the stall watch, the timeout): redis-rs's own
        // response timeout would fail a call that a busy process reads late.
        let config = config.clone().set_response_timeout(None);
        let (redis, driver) =
            MultiplexedConnection::new_with_config(&self.login, stream, config).await?;
        // It ends when the last handle on the connection is dropped.
        tokio::spawn(driver);
        Ok((redis, pulse))
    }
}

fn unsupported(what: &'static str) -> RedisError {
    RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "not supported",
        what.to_owned(),
    ))
}

/// The client TLS configuration: `root` (PEM) alone when given, else the system's roots.
#[cfg(feature = "tls")]
fn tls_config(root: Option<&[u8]>) -> Result<rustls::ClientConfig, StoreError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    let bad = |message: String| StoreError::new(StoreErrorKind::Other, message);
    super::builder::ensure_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    match root {
        Some(pem) => {
            for certificate in CertificateDer::pem_slice_iter(pem) {
                let certificate =
                    certificate.map_err(|e| bad(format!("bad TLS root certificate (PEM): {e}")))?;
                roots
                    .add(certificate)
                    .map_err(|e| bad(format!("bad TLS root certificate: {e}")))?;
            }
            if roots.is_empty() {
                return Err(bad(
                    "the TLS root certificate holds no certificate: give PEM text with a \
                     -----BEGIN CERTIFICATE----- block"
                        .to_owned(),
                ));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for certificate in found.certs {
                // A system certificate rustls cannot read is skipped, as redis-rs does.
                let _ = roots.add(certificate);
            }
            if roots.is_empty() {
                return Err(bad(
                    "no system root certificate found for rediss://: give the server's CA \
                     with tls_root_certificate"
                        .to_owned(),
                ));
            }
        }
    }
    Ok(rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth())
}
