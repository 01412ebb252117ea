//! Stalls: Redis stopped answering while calls wait.
//!
//! A stalled Redis (`CLIENT PAUSE`, a fork, a dead link) answers nothing. A loaded one
//! answers late but keeps answering. A busy gateway is a third case: Redis answered,
//! and the reply waits in the socket until this process reads it.
//!
//! So the watch looks at the socket, not at the callers. The store's own connections
//! run over a [`Wire`], which times every read and write where the connection driver
//! does them. A call that has waited `after` asks its connection's [`Pulse`]:
//!
//! - Was its request written? If not, Redis was not asked yet: no stall.
//! - Did Redis send anything since it was asked, or since the call began? Then it is
//!   alive: no stall yet.
//! - Is a reply waiting unread in the socket? Then the process is slow: no stall.
//! - Otherwise Redis owes a reply and sent nothing for `after`: a stall.
//!
//! A stall fails that call and every call waiting on the same connection at once, to
//! the breaker and its fallback, instead of each waiting its timeout. Connection set-up
//! (TCP, TLS, `AUTH`) happens before a connection carries calls, so it never counts.
//! `after` must exceed the round trip to Redis and its slowest script. A call sent
//! before the stall may still run when Redis comes back: its charge stands.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::time::Instant;

/// The default time without a reply, with a call waiting, that declares a stall.
pub(super) const DEFAULT_STALL_AFTER: Duration = Duration::from_millis(20);

/// The call failed because a stall was declared while it waited.
#[derive(Debug)]
pub(super) struct Stalled;

/// What one connection's socket did, as its driver read and wrote it.
pub(super) struct Pulse {
    origin: Instant,
    /// µs since `origin`, plus one (0: never): the last read that brought bytes.
    read: AtomicU64,
    /// The last write.
    wrote: AtomicU64,
    /// The first write after the last read: since then Redis owes a reply.
    asked: AtomicU64,
    /// Bumped before and after each read of the socket: odd while one is under way, so
    /// the watch never mistakes bytes being read for none.
    reading: AtomicU64,
    /// The socket itself (a second handle), to look for unread bytes.
    socket: socket2::Socket,
    /// Bumped at each stall declared: the calls waiting on this connection fail.
    declared: watch::Sender<u64>,
}

/// What a connection's socket says about a call that has waited.
#[derive(Debug, PartialEq, Eq)]
enum Heard {
    /// Its request is not on the wire yet: the process has not sent it.
    NotAsked,
    /// Redis has been quiet since this time (µs), with something to answer.
    QuietSince(u64),
    /// Bytes from Redis wait unread: the process is slow, not Redis.
    Unread,
    /// Redis owes a reply, sent nothing, and nothing waits in the socket.
    Silent,
}

impl Pulse {
    fn new(socket: socket2::Socket) -> Self {
        Pulse {
            origin: Instant::now(),
            read: AtomicU64::new(0),
            wrote: AtomicU64::new(0),
            asked: AtomicU64::new(0),
            reading: AtomicU64::new(0),
            socket,
            declared: watch::channel(0).0,
        }
    }

    fn micros(&self, at: Instant) -> u64 {
        u64::try_from(at.duration_since(self.origin).as_micros())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    fn instant(&self, micros: u64) -> Instant {
        self.origin + Duration::from_micros(micros.saturating_sub(1))
    }

    /// Bytes came in. Only the driver reads and writes: plain stores suffice.
    fn on_read(&self) {
        self.read
            .store(self.micros(Instant::now()), Ordering::SeqCst);
    }

    fn on_write(&self) {
        let now = self.micros(Instant::now());
        self.wrote.store(now, Ordering::SeqCst);
        if self.asked.load(Ordering::SeqCst) <= self.read.load(Ordering::SeqCst) {
            self.asked.store(now, Ordering::SeqCst);
        }
    }

    /// What the socket says at `now` of a call that began at `started` and waits `after`.
    fn hears(&self, started: u64, now: u64, after: u64) -> Heard {
        if self.wrote.load(Ordering::SeqCst) < started {
            return Heard::NotAsked;
        }
        let reading = self.reading.load(Ordering::SeqCst);
        let read = self.read.load(Ordering::SeqCst);
        let since = read.max(self.asked.load(Ordering::SeqCst)).max(started);
        if now.saturating_sub(since) < after {
            return Heard::QuietSince(since);
        }
        let mut byte = [MaybeUninit::<u8>::uninit(); 1];
        match self.socket.peek(&mut byte) {
            // Nothing unread, and the socket is non-blocking: it says so at once.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            // Bytes wait, or the peer closed (the driver sees that as an error), or the
            // socket failed: none of them is a stall.
            _ => return Heard::Unread,
        }
        // The driver may have taken the bytes just before the peek: a read under way,
        // or one since `read` was loaded, says so.
        if reading % 2 == 1 || self.reading.load(Ordering::SeqCst) != reading {
            return Heard::Unread;
        }
        Heard::Silent
    }
}

/// A socket whose reads and writes are timed in a [`Pulse`].
pub(super) struct Wire<S> {
    io: S,
    pulse: std::sync::Arc<Pulse>,
}

impl<S> Wire<S>
where
    for<'a> socket2::SockRef<'a>: From<&'a S>,
{
    /// Wraps `io`, with a second handle on its socket for the watch.
    pub(super) fn new(io: S) -> io::Result<(Self, std::sync::Arc<Pulse>)> {
        let socket = socket2::SockRef::from(&io).try_clone()?;
        let pulse = std::sync::Arc::new(Pulse::new(socket));
        Ok((
            Wire {
                io,
                pulse: std::sync::Arc::clone(&pulse),
            },
            pulse,
        ))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Wire<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        self.pulse.reading.fetch_add(1, Ordering::SeqCst);
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.pulse.on_read();
        }
        self.pulse.reading.fetch_add(1, Ordering::SeqCst);
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Wire<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.pulse.on_write();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.pulse.on_write();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Waits for `call`, sent on the connection `pulse` watches, unless a stall is declared
/// first (by this call or another on that connection).
pub(super) async fn wait<F: Future>(
    after: Duration,
    pulse: &Pulse,
    call: F,
) -> Result<F::Output, Stalled> {
    let started = pulse.micros(Instant::now());
    let after = u64::try_from(after.as_micros()).unwrap_or(u64::MAX / 2);
    let mut declared = pulse.declared.subscribe();
    let mut call = std::pin::pin!(call);
    let mut check = started.saturating_add(after);
    loop {
        tokio::select! {
            biased;
            out = &mut call => return Ok(out),
            // Another call declared a stall (the sender lives as long as `pulse`).
            _ = declared.changed() => return Err(Stalled),
            () = tokio::time::sleep_until(pulse.instant(check)) => {
                let now = pulse.micros(Instant::now());
                check = match pulse.hears(started, now, after) {
                    Heard::Silent => {
                        pulse.declared.send_modify(|n| *n += 1);
                        #[cfg(feature = "metrics")]
                        metrics::counter!(crate::metric::STORE_STALLS.name).increment(1);
                        return Err(Stalled);
                    }
                    Heard::QuietSince(since) => since.saturating_add(after),
                    // The process is behind: look again a quarter of `after` on.
                    Heard::NotAsked | Heard::Unread => now.saturating_add(after / 4),
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A connected pair of loopback sockets, the first wrapped.
    async fn pair() -> (
        Wire<tokio::net::TcpStream>,
        std::sync::Arc<Pulse>,
        tokio::net::TcpStream,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, server) = tokio::join!(tokio::net::TcpStream::connect(addr), async {
            listener.accept().await.unwrap().0
        });
        let (wire, pulse) = Wire::new(client.unwrap()).unwrap();
        (wire, pulse, server)
    }

    // The four answers, each from what the socket did: nothing sent, a reply owed and
    // missing, a reply unread, and a reply read.
    #[tokio::test]
    async fn the_socket_tells_a_silent_server_from_a_slow_reader() {
        let (mut wire, pulse, mut server) = pair().await;
        let far = 1 << 40;
        assert_eq!(pulse.hears(1, far, 20_000), Heard::NotAsked);
        wire.write_all(b"PING\r\n").await.unwrap();
        let asked = pulse.asked.load(Ordering::Relaxed);
        assert!(asked > 0);
        // Just asked: quiet since then, not yet for long.
        assert_eq!(pulse.hears(1, asked, 20_000), Heard::QuietSince(asked));
        let mut got = [0; 6];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(pulse.hears(1, far, 20_000), Heard::Silent);
        server.write_all(b"+PONG\r\n").await.unwrap();
        // The reply is in the socket, unread.
        let mut waited = 0;
        while pulse.hears(1, far, 20_000) != Heard::Unread {
            tokio::task::yield_now().await;
            waited += 1;
            assert!(waited < 1_000_000, "the reply never reached the socket");
        }
        let mut reply = [0; 7];
        wire.read_exact(&mut reply).await.unwrap();
        let read = pulse.read.load(Ordering::Relaxed);
        assert!(read >= asked);
        assert_eq!(pulse.hears(1, read, 20_000), Heard::QuietSince(read));
    }
}
