//! Accepting connections: each port holds a bounded number, a new connection has a
//! bounded time to say what it is, and the accept loop backs off when the process runs
//! out of descriptors.
//!
//! On the gRPC port, a connection is handed to gRPC only once it has finished its TLS
//! handshake (with TLS) and sent the HTTP/2 preface, within [`Connections::handshake`].
//! When the port is full, the oldest connection still in its handshake is closed for
//! the new one: a client that opens connections and says nothing cannot keep a
//! certified one out. When every connection is established, a new one is refused.
//!
//! On the HTTP port, a request's headers must come within the same time.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tonic::transport::server::Connected;

/// The first bytes of every HTTP/2 connection (RFC 9113, section 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How long the accept loop waits after the process ran out of descriptors.
const BACK_OFF: Duration = Duration::from_millis(50);

/// Bounds on the server's connections.
///
/// ```
/// use std::time::Duration;
///
/// let mut connections = tollway_server::Connections::default();
/// connections.grpc = 4_096;
/// connections.handshake = Duration::from_secs(5);
/// assert_eq!(connections.http, 64);
/// ```
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Connections {
    /// The most connections the gRPC port holds, those in their handshake included
    /// (default 1,024). Keep it under the process's descriptor limit (`ulimit -n`), with
    /// room for the HTTP port and the store.
    pub grpc: usize,
    /// The most connections the HTTP port holds (default 64).
    pub http: usize,
    /// How long a new gRPC connection has to finish its TLS handshake and send the
    /// HTTP/2 preface, and an HTTP request to send its headers (default 10 s).
    pub handshake: Duration,
}

impl Default for Connections {
    fn default() -> Self {
        Connections {
            grpc: 1_024,
            http: 64,
            handshake: Duration::from_secs(10),
        }
    }
}

/// Counts a connection a port dropped, and why.
fn dropped(port: &'static str, reason: &'static str) {
    metrics::counter!(
        tollway_core::metric::CONNECTIONS_DROPPED.name,
        "port" => port,
        "reason" => reason
    )
    .increment(1);
}

/// Whether an accept error is about one connection (the next accept may succeed at
/// once), not about the process (out of descriptors or memory).
fn about_one_connection(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// The next connection on `port`'s `listener`, or `None` once `stopped`. When the
/// process cannot accept (out of descriptors, out of memory), `short` runs and the loop
/// waits [`BACK_OFF`] instead of spinning.
async fn next(
    listener: &TcpListener,
    stopped: &mut watch::Receiver<bool>,
    port: &'static str,
    short: impl Fn(),
) -> Option<TcpStream> {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped.changed() => return None,
        };
        match accepted {
            Ok((tcp, _)) => return Some(tcp),
            Err(error) if about_one_connection(&error) => {}
            Err(error) => {
                dropped(port, "accept");
                tracing::warn!(%error, port, "cannot accept a connection: backing off");
                short();
                tokio::time::sleep(BACK_OFF).await;
            }
        }
    }
}

/// The connections still in their handshake, oldest first, each with the switch that
/// closes it.
#[derive(Default)]
struct Handshaking {
    next: u64,
    open: BTreeMap<u64, oneshot::Sender<()>>,
}

impl Handshaking {
    fn lock(this: &Mutex<Self>) -> std::sync::MutexGuard<'_, Self> {
        this.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A connection that passed its handshake: its stream, the preface it sent (read again
/// first), and its place in the port's count.
pub(crate) struct Admitted<S> {
    inner: S,
    preface: [u8; 24],
    replayed: usize,
    _permit: OwnedSemaphorePermit,
}

impl<S: AsyncRead + Unpin> AsyncRead for Admitted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.replayed < PREFACE.len() {
            let left = &self.preface[self.replayed..];
            let n = left.len().min(buf.remaining());
            buf.put_slice(&left[..n]);
            self.replayed += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Admitted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S: Connected> Connected for Admitted<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// What makes a TCP connection one gRPC serves: TLS or nothing, then the preface.
pub(crate) trait Handshake: Clone + Send + Sync + 'static {
    /// The stream after the handshake.
    type Stream: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static;
    /// The handshake.
    fn shake(&self, tcp: TcpStream) -> impl Future<Output = io::Result<Self::Stream>> + Send;
}

/// Plain gRPC: no handshake before the preface.
#[derive(Clone)]
pub(crate) struct Plain;

impl Handshake for Plain {
    type Stream = TcpStream;

    async fn shake(&self, tcp: TcpStream) -> io::Result<TcpStream> {
        Ok(tcp)
    }
}

/// gRPC over TLS.
#[derive(Clone)]
pub(crate) struct Tls(pub(crate) tokio_rustls::TlsAcceptor);

impl Handshake for Tls {
    type Stream = tokio_rustls::server::TlsStream<TcpStream>;

    async fn shake(&self, tcp: TcpStream) -> io::Result<Self::Stream> {
        self.0.accept(tcp).await
    }
}

/// Accepts gRPC connections on `listener` until `stopped`, within `connections`, and
/// sends each one that passed `handshake` and sent the preface.
pub(crate) fn grpc<H: Handshake>(
    listener: TcpListener,
    handshake: H,
    connections: Connections,
    mut stopped: watch::Receiver<bool>,
) -> mpsc::Receiver<io::Result<Admitted<H::Stream>>> {
    const PORT: &str = "grpc";
    let (admitted, incoming) = mpsc::channel(64);
    tokio::spawn(async move {
        let slots = Arc::new(Semaphore::new(connections.grpc.max(1)));
        let pending = Arc::new(Mutex::new(Handshaking::default()));
        loop {
            // Out of descriptors, the oldest handshake gives one back.
            let Some(tcp) = next(&listener, &mut stopped, PORT, || {
                evict_oldest(&pending);
            })
            .await
            else {
                break;
            };
            let permit = match Arc::clone(&slots).try_acquire_owned() {
                Ok(permit) => permit,
                Err(_) => {
                    // Full: the oldest connection still in its handshake makes room.
                    if !evict_oldest(&pending) {
                        dropped(PORT, "full");
                        continue;
                    }
                    match tokio::time::timeout(BACK_OFF, Arc::clone(&slots).acquire_owned()).await {
                        Ok(Ok(permit)) => permit,
                        _ => {
                            dropped(PORT, "full");
                            continue;
                        }
                    }
                }
            };
            let (close, closed) = oneshot::channel();
            let id = {
                let mut pending = Handshaking::lock(&pending);
                let id = pending.next;
                pending.next += 1;
                pending.open.insert(id, close);
                id
            };
            let (handshake, pending, admitted) =
                (handshake.clone(), Arc::clone(&pending), admitted.clone());
            tokio::spawn(async move {
                let shaken = tokio::select! {
                    shaken = tokio::time::timeout(connections.handshake, async {
                        let mut stream = handshake.shake(tcp).await?;
                        let mut preface = [0; 24];
                        stream.read_exact(&mut preface).await?;
                        if &preface != PREFACE {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "not HTTP/2",
                            ));
                        }
                        Ok((stream, preface))
                    }) => Some(shaken),
                    _ = closed => None,
                };
                Handshaking::lock(&pending).open.remove(&id);
                match shaken {
                    Some(Ok(Ok((inner, preface)))) => {
                        let _ = admitted
                            .send(Ok(Admitted {
                                inner,
                                preface,
                                replayed: 0,
                                _permit: permit,
                            }))
                            .await;
                    }
                    Some(Ok(Err(error))) => {
                        tracing::debug!(%error, "a gRPC connection failed its handshake");
                    }
                    Some(Err(_)) => dropped(PORT, "handshake"),
                    None => dropped(PORT, "evicted"),
                }
            });
        }
    });
    incoming
}

/// Closes the oldest connection still in its handshake; whether there was one.
fn evict_oldest(pending: &Mutex<Handshaking>) -> bool {
    let oldest = Handshaking::lock(pending).open.pop_first();
    match oldest {
        Some((_, close)) => {
            let _ = close.send(());
            true
        }
        None => false,
    }
}

/// Serves `app` on `listener` until `stopped`: HTTP/1.1, at most
/// `connections.http` connections, each request's headers within
/// `connections.handshake`. A stop lets requests in progress finish.
pub(crate) async fn http(
    listener: TcpListener,
    app: axum::Router,
    connections: Connections,
    mut stopped: watch::Receiver<bool>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;

    const PORT: &str = "http";
    let slots = Arc::new(Semaphore::new(connections.http.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let Some(tcp) = next(&listener, &mut stopped, PORT, || {}).await else {
            break;
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            dropped(PORT, "full");
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        let mut stopped = stopped.clone();
        tasks.spawn(async move {
            let _permit = permit;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(connections.handshake);
            let connection = builder.serve_connection(TokioIo::new(tcp), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = stopped.changed() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        });
        // Finished connections leave the set as new ones come.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    // A connection that sends nothing holds a slot only until its handshake time; the
    // oldest one makes room for a new one when the port is full; a real HTTP/2 preface
    // is read again by whoever serves the connection.
    #[tokio::test]
    async fn silent_connections_give_way_and_the_preface_is_kept() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_stop, stopped) = watch::channel(false);
        let connections = Connections {
            grpc: 2,
            http: 1,
            handshake: Duration::from_secs(10),
        };
        let mut incoming = grpc(listener, Plain, connections, stopped);
        let silent: Vec<TcpStream> = {
            let mut silent = Vec::new();
            for _ in 0..2 {
                silent.push(TcpStream::connect(addr).await.unwrap());
            }
            silent
        };
        // The port is full of silent connections: a third that speaks HTTP/2 is served.
        let mut speaker = TcpStream::connect(addr).await.unwrap();
        speaker.write_all(PREFACE).await.unwrap();
        speaker.write_all(b"then frames").await.unwrap();
        let mut served = incoming.recv().await.unwrap().unwrap();
        let mut read = vec![0; PREFACE.len() + 11];
        served.read_exact(&mut read).await.unwrap();
        assert_eq!(&read[..24], PREFACE);
        assert_eq!(&read[24..], b"then frames");
        // The oldest silent one was closed for it.
        let mut first = silent.into_iter().next().unwrap();
        let mut byte = [0; 1];
        assert_eq!(first.read(&mut byte).await.unwrap(), 0, "closed");
    }
}
