//! Stalls: Redis stopped answering while calls wait.
//!
//! A stalled Redis (`CLIENT PAUSE`, a fork, a dead link) answers nothing. A loaded one
//! answers late but keeps answering. A busy gateway is a third case: Redis answered,
//! and the reply waits in the socket until this process reads it; or the request still
//! waits in this process, unwritten.
//!
//! So the watch looks at the connection, not at the callers. The store's own
//! connections run over a [`Wire`], which counts the requests written and the replies
//! read (RESP frames), and times each read, where the connection's driver does them. A
//! call that has waited `after` asks its connection's [`Pulse`]:
//!
//! - Does Redis owe a reply (more requests written than replies read)? If not, the
//!   requests wait in this process: no stall.
//! - Did Redis send anything in the last `after`? Then it is alive: no stall yet.
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
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::time::Instant;

use super::frames::Frames;

/// The default time without a reply, with a call waiting, that declares a stall.
pub(super) const DEFAULT_STALL_AFTER: Duration = Duration::from_millis(20);

/// What one connection did, as its driver read and wrote it.
pub(super) struct Pulse {
    origin: Instant,
    /// µs since `origin`, plus one (0: never): the last read that brought bytes.
    read: AtomicU64,
    /// When Redis last came to owe a reply (a request written while none was owed).
    asked: AtomicU64,
    /// Requests written whole, and replies read whole.
    sent: AtomicU64,
    answered: AtomicU64,
    /// The stream stopped being RESP: the counts mean nothing, no stall is declared.
    lost: AtomicBool,
    /// Bumped before and after each read of the socket: odd while one is under way, so
    /// the watch never mistakes bytes being read for none.
    reading: AtomicU64,
    /// The socket itself (a second handle), to look for unread bytes.
    socket: socket2::Socket,
    /// Bumped at each stall declared: the calls waiting on this connection fail.
    declared: watch::Sender<u64>,
}

/// What a connection says about a call that has waited.
#[derive(Debug, PartialEq, Eq)]
enum Heard {
    /// Redis owes nothing: the requests still wait in this process.
    Owed0,
    /// Redis has owed a reply since this time (µs), and it is not long yet.
    QuietSince(u64),
    /// Bytes from Redis wait unread: the process is slow, not Redis.
    Unread,
    /// Redis owes a reply, sent nothing for `after`, and nothing waits in the socket.
    Silent,
}

impl Pulse {
    fn new(socket: socket2::Socket) -> Self {
        Pulse {
            origin: Instant::now(),
            read: AtomicU64::new(0),
            asked: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            lost: AtomicBool::new(false),
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

    /// Bytes came in, making `answered` replies whole so far.
    fn on_read(&self, answered: u64, lost: bool) {
        self.read
            .store(self.micros(Instant::now()), Ordering::SeqCst);
        self.answered.store(answered, Ordering::SeqCst);
        if lost {
            self.lost.store(true, Ordering::SeqCst);
        }
    }

    /// Bytes went out, making `sent` requests whole so far.
    fn on_write(&self, sent: u64, lost: bool) {
        let was = self.sent.swap(sent, Ordering::SeqCst);
        if sent > was && was <= self.answered.load(Ordering::SeqCst) {
            self.asked
                .store(self.micros(Instant::now()), Ordering::SeqCst);
        }
        if lost {
            self.lost.store(true, Ordering::SeqCst);
        }
    }

    /// What the connection says at `now` of a call that began at `started` and waits
    /// `after`.
    fn hears(&self, started: u64, now: u64, after: u64) -> Heard {
        let reading = self.reading.load(Ordering::SeqCst);
        let read = self.read.load(Ordering::SeqCst);
        let answered = self.answered.load(Ordering::SeqCst);
        if self.lost.load(Ordering::SeqCst) || self.sent.load(Ordering::SeqCst) <= answered {
            return Heard::Owed0;
        }
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
        // or one since the counts were loaded, says so.
        if reading % 2 == 1 || self.reading.load(Ordering::SeqCst) != reading {
            return Heard::Unread;
        }
        Heard::Silent
    }
}

/// A connection's stream (TLS included, when there is TLS) whose requests and replies
/// are counted and timed in a [`Pulse`].
pub(super) struct Wire<S> {
    io: S,
    written: Frames,
    replies: Frames,
    pulse: Arc<Pulse>,
}

impl<S> Wire<S> {
    /// Wraps `io`, whose socket `socket` is (a second handle on it, for the watch).
    pub(super) fn new(io: S, socket: socket2::Socket) -> (Self, Arc<Pulse>) {
        let pulse = Arc::new(Pulse::new(socket));
        (
            Wire {
                io,
                written: Frames::new(),
                replies: Frames::new(),
                pulse: Arc::clone(&pulse),
            },
            pulse,
        )
    }

    fn wrote(&mut self, bytes: &[u8]) {
        self.written.feed(bytes);
        self.pulse
            .on_write(self.written.complete(), self.written.is_lost());
    }
}

/// A second handle on `io`'s socket.
pub(super) fn socket_of<S>(io: &S) -> io::Result<socket2::Socket>
where
    for<'a> socket2::SockRef<'a>: From<&'a S>,
{
    socket2::SockRef::from(io).try_clone()
}

impl<S: AsyncRead + Unpin> AsyncRead for Wire<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        this.pulse.reading.fetch_add(1, Ordering::SeqCst);
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.replies.feed(&buf.filled()[before..]);
            this.pulse
                .on_read(this.replies.complete(), this.replies.is_lost());
        }
        this.pulse.reading.fetch_add(1, Ordering::SeqCst);
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
        if let Poll::Ready(Ok(n)) = polled
            && n > 0
        {
            self.wrote(&buf[..n]);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = polled {
            let mut left = n;
            for slice in bufs {
                if left == 0 {
                    break;
                }
                let take = left.min(slice.len());
                self.wrote(&slice[..take]);
                left -= take;
            }
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

/// How many times its timeout a call may wait while Redis keeps answering (the calls
/// ahead of it, or this process reading late).
pub(super) const BEHIND_AT_MOST: u32 = 10;

/// Why a watched call ended without its reply.
#[derive(Debug)]
pub(super) enum Ended {
    /// Redis owed a reply and sent nothing for `after`.
    Stalled,
    /// The call waited [`BEHIND_AT_MOST`] times `timeout`.
    TimedOut,
}

/// Waits for `call`, sent on the connection `pulse` watches, unless a stall is declared
/// first (by this call or another on that connection), or it waits [`BEHIND_AT_MOST`]
/// times `timeout`.
///
/// While Redis keeps answering, a call is not failed at its timeout: a loaded Redis
/// reaches it in turn, and a busy process reads its reply late. Either way the store
/// decides exactly, where a failure would hand the call, and after a few the whole
/// store, to the fallback.
pub(super) async fn wait<F: Future>(
    after: Duration,
    timeout: Duration,
    pulse: &Pulse,
    call: F,
) -> Result<F::Output, Ended> {
    let started = pulse.micros(Instant::now());
    let after = u64::try_from(after.as_micros()).unwrap_or(u64::MAX / 4);
    let timeout = u64::try_from(timeout.as_micros()).unwrap_or(u64::MAX / 4);
    let last = started.saturating_add(timeout.saturating_mul(u64::from(BEHIND_AT_MOST)));
    let mut declared = pulse.declared.subscribe();
    let mut call = std::pin::pin!(call);
    let mut check = started.saturating_add(after);
    loop {
        tokio::select! {
            biased;
            out = &mut call => return Ok(out),
            // Another call declared a stall (the sender lives as long as `pulse`).
            _ = declared.changed() => return Err(Ended::Stalled),
            () = tokio::time::sleep_until(pulse.instant(check.min(last))) => {
                let now = pulse.micros(Instant::now());
                let next = match pulse.hears(started, now, after) {
                    Heard::Silent => {
                        pulse.declared.send_modify(|n| *n += 1);
                        #[cfg(feature = "metrics")]
                        metrics::counter!(crate::metric::STORE_STALLS.name).increment(1);
                        return Err(Ended::Stalled);
                    }
                    Heard::QuietSince(since) => since.saturating_add(after),
                    // The process is behind: look again a quarter of `after` on.
                    Heard::Owed0 | Heard::Unread => now.saturating_add(after / 4),
                };
                if now >= last {
                    return Err(Ended::TimedOut);
                }
                check = next.max(now.saturating_add(1));
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
        Arc<Pulse>,
        tokio::net::TcpStream,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, server) = tokio::join!(tokio::net::TcpStream::connect(addr), async {
            listener.accept().await.unwrap().0
        });
        let client = client.unwrap();
        let socket = socket_of(&client).unwrap();
        let (wire, pulse) = Wire::new(client, socket);
        (wire, pulse, server)
    }

    // The four answers, each from what the connection did: nothing owed (a request half
    // written), a reply owed and missing, a reply unread, and a reply read.
    #[tokio::test]
    async fn the_connection_tells_a_silent_server_from_a_slow_reader() {
        let (mut wire, pulse, mut server) = pair().await;
        let far = 1 << 40;
        let ping = b"*1\r\n$4\r\nPING\r\n";
        wire.write_all(&ping[..7]).await.unwrap();
        assert_eq!(pulse.hears(1, far, 20_000), Heard::Owed0, "half a request");
        wire.write_all(&ping[7..]).await.unwrap();
        let asked = pulse.asked.load(Ordering::SeqCst);
        assert!(asked > 0);
        // Just asked: quiet since then, not yet for long.
        assert_eq!(pulse.hears(1, asked, 20_000), Heard::QuietSince(asked));
        let mut got = [0; 14];
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
        assert_eq!(pulse.hears(1, far, 20_000), Heard::Owed0, "answered");
    }
}
