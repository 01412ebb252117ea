//! A TCP proxy on loopback that adds latency and cuts the link on demand: the distance
//! between simulated regions, without touching the machine's network.
//!
//! Every byte a side sends reaches the other side `one_way` later (tokio time, so a test
//! on a paused clock simulates the distance without waiting it out), in order. A cut
//! holds everything in flight and everything sent meanwhile, as a partition does to TCP
//! segments that get retransmitted: nothing is delivered, nothing is refused, the
//! connection stays open; a heal delivers what was held. The latency and the cut apply to
//! connections already open as well as new ones.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// What every connection of one proxy obeys.
struct Link {
    one_way_us: AtomicU64,
    /// `true` while the link is cut.
    cut: watch::Sender<bool>,
}

/// A delaying, cuttable TCP proxy to one target; stops (its connections closed) on drop.
pub struct LatencyProxy {
    addr: SocketAddr,
    link: Arc<Link>,
    accepting: tokio::task::JoinHandle<()>,
}

impl LatencyProxy {
    /// Listens on a free loopback port and forwards each connection to `target`, every
    /// byte `one_way` late in each direction.
    pub async fn start(target: SocketAddr, one_way: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let link = Arc::new(Link {
            one_way_us: AtomicU64::new(micros(one_way)),
            cut: watch::Sender::new(false),
        });
        let shared = Arc::clone(&link);
        let accepting = tokio::spawn(async move {
            // Dropped with this task: every connection's pumps are aborted with it.
            let mut connections = JoinSet::new();
            loop {
                // A failed accept (out of descriptors, say) drops that one connection.
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                connections.spawn(pump(client_read, server_write, Arc::clone(&shared)));
                connections.spawn(pump(server_read, client_write, Arc::clone(&shared)));
                // Forget the pumps that ended (their connection closed).
                while connections.try_join_next().is_some() {}
            }
        });
        LatencyProxy {
            addr,
            link,
            accepting,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A `redis://` URL through the proxy, for a target that is a Redis server.
    pub fn redis_url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// Each direction's delay from now on, bytes already in flight included.
    pub fn set_one_way(&self, one_way: Duration) {
        self.link
            .one_way_us
            .store(micros(one_way), Ordering::Relaxed);
    }

    /// Cuts the link: nothing gets through until [`heal`](Self::heal).
    pub fn cut(&self) {
        self.link.cut.send_replace(true);
    }

    /// Restores the link: what was held goes on its way.
    pub fn heal(&self) {
        self.link.cut.send_replace(false);
    }
}

impl std::fmt::Debug for LatencyProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencyProxy")
            .field("addr", &self.addr)
            .field("one_way_us", &self.link.one_way_us.load(Ordering::Relaxed))
            .field("cut", &*self.link.cut.borrow())
            .finish()
    }
}

impl Drop for LatencyProxy {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Carries one direction of a connection: reads chunks as they come, stamps each with
/// when it was sent, and a writer delivers it `one_way` after that, once the link is up;
/// the end of the stream (`None`) travels the same way, so a close is late and held by a
/// cut like the bytes before it.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, link: Arc<Link>) {
    let (chunks, mut pending) = mpsc::unbounded_channel::<(Instant, Option<Vec<u8>>)>();
    let deliver = async move {
        let mut up = link.cut.subscribe();
        while let Some((sent, bytes)) = pending.recv().await {
            let one_way = Duration::from_micros(link.one_way_us.load(Ordering::Relaxed));
            tokio::time::sleep_until(sent + one_way).await;
            // (The watch's guard is dropped at once: holding it would block `cut`.)
            let up_again = up.wait_for(|cut| !cut).await.is_ok();
            let Some(bytes) = bytes.filter(|_| up_again) else {
                break;
            };
            // A failed write drops the receiver, which stops the reader.
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    let read = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let chunk = match from.read(&mut buffer).await {
                Ok(0) | Err(_) => None,
                Ok(n) => Some(buffer[..n].to_vec()),
            };
            let end = chunk.is_none();
            if chunks.send((Instant::now(), chunk)).is_err() || end {
                return;
            }
        }
    };
    tokio::join!(read, deliver);
}
