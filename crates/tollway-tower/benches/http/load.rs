//! The load generator: one thread driving keep-alive HTTP/1.1 connections, each with one
//! request in flight (closed loop), through a small hand-written client (`httparse` for
//! the response head, no allocation per request); what a run measured (requests/s,
//! latency percentiles, the CPU time of the server's threads and its own); and a fixed
//! amount of work for an instruction counter.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use crate::BoxError;

/// Connections a run opens.
pub(crate) const CONNECTIONS: usize = 32;
/// Requests before a run starts measuring.
pub(crate) const WARMUP: Duration = Duration::from_millis(300);
/// A bound on each connection's requests in a timed run.
const MAX_REQUESTS_PER_CONNECTION: usize = 1_000_000;
const REQUEST: &[u8] = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: tollway-bench\r\n\r\n";

/// What one run of one variant measured.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) requests_per_sec: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) requests: usize,
    pub(crate) unexpected: usize,
    /// CPU time of the server's threads and of the load generator's, each as a share of
    /// one core over the measured window.
    pub(crate) server_cpu: f64,
    pub(crate) client_cpu: f64,
    /// Requests per second of server CPU time: the throughput of one fully busy server
    /// core, unaffected by time the host takes from this guest.
    pub(crate) per_server_cpu_sec: f64,
}

/// The server's thread ids, for their CPU time.
pub(crate) static SERVER_THREADS: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// This thread's id, from `/proc/thread-self` (`<pid>/task/<tid>`).
pub(crate) fn thread_id() -> Option<u32> {
    std::fs::read_link("/proc/thread-self")
        .ok()?
        .file_name()?
        .to_str()?
        .parse()
        .ok()
}

/// CPU time of thread `tid` of this process, in nanoseconds: the first field of its
/// `schedstat`, the scheduler's own account, which on a KVM guest with paravirtual time
/// accounting leaves out the time the host stole.
fn cpu_ns(tid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// (server ns, client ns) now.
fn cpu_now(client: u32) -> (u64, u64) {
    let server = SERVER_THREADS
        .lock()
        .map(|tids| tids.iter().map(|&t| cpu_ns(t)).sum())
        .unwrap_or(0);
    (server, cpu_ns(client))
}

/// What one connection saw during the measured window.
#[derive(Debug, Default)]
struct ConnectionResult {
    latencies_ns: Vec<u32>,
    unexpected: usize,
    last_done: Option<Instant>,
}

/// A keep-alive HTTP/1.1 connection with one request in flight.
struct Connection {
    stream: TcpStream,
    buf: Vec<u8>,
    filled: usize,
}

impl Connection {
    async fn open(addr: SocketAddr) -> io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Connection {
            stream,
            buf: vec![0; 16 * 1024],
            filled: 0,
        })
    }

    /// Sends `GET /` and reads the whole response; returns its status.
    async fn get(&mut self) -> io::Result<u16> {
        self.stream.write_all(REQUEST).await?;
        loop {
            if let Some((status, len)) = parse(&self.buf[..self.filled])? {
                self.buf.copy_within(len..self.filled, 0);
                self.filled -= len;
                return Ok(status);
            }
            if self.filled == self.buf.len() {
                return Err(io::Error::other("response larger than the client's buffer"));
            }
            let n = self.stream.read(&mut self.buf[self.filled..]).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.filled += n;
        }
    }
}

/// The status and total length of the complete response at the start of `bytes`, or
/// `None` when more bytes are needed.
fn parse(bytes: &[u8]) -> io::Result<Option<(u16, usize)>> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut headers);
    let head = match response.parse(bytes) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
    };
    let status = response.code.unwrap_or(0);
    let length = response
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| {
            std::str::from_utf8(h.value)
                .ok()?
                .trim()
                .parse::<usize>()
                .ok()
        })
        .ok_or_else(|| io::Error::other("response without Content-Length (chunked?)"))?;
    Ok((bytes.len() >= head + length).then_some((status, head + length)))
}

/// Drives one connection: warm up until `start`, then measure until `end`.
async fn drive(
    mut conn: Connection,
    expected: u16,
    start: Instant,
    end: Instant,
) -> io::Result<ConnectionResult> {
    let mut result = ConnectionResult {
        latencies_ns: Vec::with_capacity(64 * 1024),
        ..ConnectionResult::default()
    };
    loop {
        let sent = Instant::now();
        if sent >= end || result.latencies_ns.len() >= MAX_REQUESTS_PER_CONNECTION {
            return Ok(result);
        }
        let status = conn.get().await?;
        if sent < start {
            continue;
        }
        let done = Instant::now();
        let ns = done.duration_since(sent).as_nanos();
        result
            .latencies_ns
            .push(u32::try_from(ns).unwrap_or(u32::MAX));
        result.last_done = Some(done);
        if status != expected {
            result.unexpected += 1;
        }
    }
}

/// One run of `variant` at `addr`: fresh connections, warm-up, measurement.
pub(crate) async fn run(
    name: &str,
    expected: u16,
    addr: SocketAddr,
    measure: Duration,
) -> Result<Run, BoxError> {
    let mut conns = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        conns.push(Connection::open(addr).await?);
    }
    let start = Instant::now() + WARMUP;
    let end = start + measure;
    let mut tasks = JoinSet::new();
    for conn in conns {
        tasks.spawn(drive(conn, expected, start, end));
    }
    // CPU time over the measured window, sampled by a task of the load generator's own
    // thread when the window opens and closes.
    let client = thread_id().unwrap_or(0);
    let cpu = tokio::spawn(async move {
        tokio::time::sleep_until(start.into()).await;
        let ((s0, c0), t0) = (cpu_now(client), Instant::now());
        tokio::time::sleep_until(end.into()).await;
        let ((s1, c1), t1) = (cpu_now(client), Instant::now());
        let wall = t1.duration_since(t0).as_nanos() as f64;
        (s1 - s0, (s1 - s0) as f64 / wall, (c1 - c0) as f64 / wall)
    });
    let mut latencies = Vec::new();
    let mut unexpected = 0;
    let mut last = start;
    while let Some(joined) = tasks.join_next().await {
        let result = joined??;
        latencies.extend_from_slice(&result.latencies_ns);
        unexpected += result.unexpected;
        last = last.max(result.last_done.unwrap_or(start));
    }
    if latencies.is_empty() {
        return Err(format!("{name}: no request completed").into());
    }
    let (server_ns, server_cpu, client_cpu) = cpu.await?;
    let elapsed = last.duration_since(start).as_secs_f64();
    let requests = latencies.len();
    let p50 = percentile(&mut latencies, 0.50);
    let p99 = percentile(&mut latencies, 0.99);
    Ok(Run {
        requests_per_sec: requests as f64 / elapsed,
        p50_us: f64::from(p50) / 1_000.0,
        p99_us: f64::from(p99) / 1_000.0,
        requests,
        unexpected,
        server_cpu,
        client_cpu,
        // The requests counted are those sent inside the window, as the CPU time is.
        per_server_cpu_sec: requests as f64 / (server_ns.max(1) as f64 / 1e9),
    })
}

/// A fixed amount of work, for an instruction counter (`valgrind --tool=callgrind`):
/// `warm` then `count` requests on each of `CONNECTIONS` connections, untimed.
pub(crate) async fn run_count(
    expected: u16,
    addr: SocketAddr,
    warm: usize,
    count: usize,
) -> Result<usize, BoxError> {
    let mut tasks = JoinSet::new();
    for _ in 0..CONNECTIONS {
        let mut conn = Connection::open(addr).await?;
        tasks.spawn(async move {
            for i in 0..warm + count {
                let status = conn.get().await?;
                if i >= warm && status != expected {
                    return Err(io::Error::other(format!(
                        "status {status}, expected {expected}"
                    )));
                }
            }
            Ok::<_, io::Error>(count)
        });
    }
    let mut done = 0;
    while let Some(joined) = tasks.join_next().await {
        done += joined??;
    }
    Ok(done)
}

fn percentile(samples: &mut [u32], q: f64) -> u32 {
    let i = ((samples.len() as f64 * q) as usize).min(samples.len() - 1);
    *samples.select_nth_unstable(i).1
}
