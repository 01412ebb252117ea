//! Real `redis-server` processes on free loopback ports.
//!
//! Every server runs under a small `sh` that holds it: the shell launches the server,
//! then waits on its standard input, which this process holds open; when this process
//! ends — every test passed, one panicked, or it was killed — the pipe closes and the
//! shell kills the server. So a server shared by a whole test binary
//! ([`shared_server`]) needs no destructor to go away, and no test leaves a server behind.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// A `redis-server` this process started, on a free loopback port; stopped on drop, and
/// when this process ends.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    running: Option<Running>,
    dir: PathBuf,
    /// The options it was started with, given again on a restart.
    extra: Vec<String>,
    /// The CA certificate (PEM) when it listens only for TLS on `port`.
    tls_ca: Option<String>,
    /// A sentinel (`redis-sentinel sentinel.conf`), not a server.
    sentinel: bool,
}

/// A running server: the shell that holds it, the pipe that keeps the shell waiting, and
/// the server's process id (the shell's child: the id cannot be reused while the shell
/// lives, so killing it by id cannot hit another process).
#[derive(Debug)]
struct Running {
    shell: Child,
    hold: Option<ChildStdin>,
    pid: String,
}

/// What a TLS server needs, all PEM: the CA that signed its certificate, the certificate
/// (valid for 127.0.0.1) and its private key.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA certificate.
    pub ca_cert: String,
    /// The server's certificate.
    pub cert: String,
    /// The server's private key.
    pub key: String,
}

/// The shell that holds a server: starts it with the arguments it is given, says its
/// process id, waits for its standard input to close, then kills it. The server stays
/// the shell's unreaped child until then, so its id names it and nothing else.
const HOLDER: &str = r#""$@" & pid=$!
echo "tollway-test-pid $pid"
read -r _
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
exit 0"#;

/// The longest a server may take to say it is ready.
const START_WITHIN: Duration = Duration::from_secs(20);

/// The one server of this test binary, started by the first test that asks, for the
/// tests that can share a server: each keeps to its own key prefix ([`unique_prefix`]).
/// It stops when the binary ends.
pub fn shared_server() -> &'static RedisServer {
    static SHARED: OnceLock<RedisServer> = OnceLock::new();
    SHARED.get_or_init(RedisServer::start)
}

/// A key prefix no other test in this process uses: `name-<n>`.
pub fn unique_prefix(name: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{name}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

impl RedisServer {
    /// Starts a server and waits until it accepts connections.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed or will not start: tests that need Redis
    /// cannot run without it.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra command-line options (`["--cluster-enabled", "yes"]`).
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_inner(extra, None)
    }

    /// Starts a server that accepts only TLS (`rediss://`, no plain port) with `files`'
    /// certificate and extra options, and does not ask clients for certificates.
    pub fn start_tls(files: &TlsFiles, extra: &[&str]) -> Self {
        Self::start_inner(extra, Some(files))
    }

    fn start_inner(extra: &[&str], tls: Option<&TlsFiles>) -> Self {
        // The TLS files are written into the server's directory, its working directory.
        let tls_options = [
            "--tls-cert-file",
            "server.pem",
            "--tls-key-file",
            "server.key",
            "--tls-ca-cert-file",
            "ca.pem",
            "--tls-auth-clients",
            "no",
        ];
        let options: Vec<String> = tls
            .map_or(&[][..], |_| &tls_options[..])
            .iter()
            .chain(extra)
            .map(|s| (*s).to_owned())
            .collect();
        Self::start_at("redis", tls, |server| server.extra = options.clone())
    }

    /// Starts a sentinel (`redis-sentinel`) whose configuration is `conf` (lines such as
    /// `sentinel monitor ...`; the port and address are added), and waits until it
    /// monitors its first primary.
    pub fn start_sentinel(conf: &str) -> Self {
        Self::start_sentinel_inner(conf, None)
    }

    /// Starts a sentinel that accepts only TLS with `files`' certificate, and reaches the
    /// servers it watches over TLS.
    pub fn start_sentinel_tls(files: &TlsFiles, conf: &str) -> Self {
        Self::start_sentinel_inner(conf, Some(files))
    }

    fn start_sentinel_inner(conf: &str, tls: Option<&TlsFiles>) -> Self {
        Self::start_at("sentinel", tls, |server| {
            let port = server.port;
            let listen = match tls {
                None => format!("port {port}\n"),
                Some(_) => format!(
                    "port 0\ntls-port {port}\ntls-cert-file server.pem\n\
                     tls-key-file server.key\ntls-ca-cert-file ca.pem\n\
                     tls-auth-clients no\ntls-replication yes\n"
                ),
            };
            // The sentinel rewrites its file as it learns: it must be its own, writable.
            std::fs::write(
                server.dir.join("sentinel.conf"),
                format!(
                    "{listen}bind 127.0.0.1\ndir {}\n{conf}\n",
                    server.dir.display()
                ),
            )
            .expect("write sentinel.conf");
            server.sentinel = true;
        })
    }

    /// Starts a server (`what`: `redis` or `sentinel`) on a free port in a directory of
    /// its own, holding `tls`' files; `prepare` completes it before it is spawned. Tries
    /// five ports.
    fn start_at(what: &str, tls: Option<&TlsFiles>, prepare: impl Fn(&mut RedisServer)) -> Self {
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port();
            let dir =
                std::env::temp_dir().join(format!("tollway-{what}-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("create a directory for redis-server");
            if let Some(files) = tls {
                for (name, pem) in [
                    ("ca.pem", &files.ca_cert),
                    ("server.pem", &files.cert),
                    ("server.key", &files.key),
                ] {
                    std::fs::write(dir.join(name), pem).expect("write a TLS file for redis-server");
                }
            }
            let mut server = RedisServer {
                port,
                running: None,
                dir,
                extra: Vec::new(),
                tls_ca: tls.map(|files| files.ca_cert.clone()),
                sentinel: false,
            };
            prepare(&mut server);
            match server.spawn() {
                Ok(()) => return server,
                Err(e) => last_error = e,
            }
        }
        panic!("{what} did not start: {last_error}");
    }

    fn spawn(&mut self) -> Result<(), String> {
        let port = self.port.to_string();
        // A TLS server listens on `port` for TLS only; a sentinel's port is in its file.
        let (program, ports): (&[&str], &[&str]) = if self.sentinel {
            (&["redis-sentinel", "sentinel.conf"], &[])
        } else if self.tls_ca.is_some() {
            (&["redis-server"], &["--port", "0", "--tls-port", &port])
        } else {
            (&["redis-server"], &["--port", &port])
        };
        ensure_installed(program[0]);
        let storage: &[&str] = if self.sentinel {
            &[]
        } else {
            &["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        };
        let mut shell = Command::new("sh")
            .arg("-c")
            .arg(HOLDER)
            .arg("sh")
            .args(program)
            .args(ports)
            .args(storage)
            .args([
                "--logfile",
                "",
                "--daemonize",
                "no",
                "--protected-mode",
                "no",
            ])
            .args(&self.extra)
            .current_dir(&self.dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawn sh for redis-server: {e}"))?;
        let hold = shell.stdin.take();
        let stdout = shell.stdout.take().ok_or("no stdout")?;
        // Its output is read on a thread of its own, to the end, so that it never blocks
        // on a full pipe; the lines until it is ready come here.
        let (lines, output) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
        let mut running = Running {
            shell,
            hold,
            pid: String::new(),
        };
        // The server says when it is ready; while waiting, a server that exited (a port
        // taken meanwhile, a bad option) is noticed from its process state.
        let deadline = Instant::now() + START_WITHIN;
        let mut seen = Vec::new();
        loop {
            match output.recv_timeout(Duration::from_millis(50)) {
                Ok(line) => {
                    if let Some(id) = line.strip_prefix("tollway-test-pid ") {
                        running.pid = id.trim().to_owned();
                    } else if line.contains("Ready to accept connections")
                        || (self.sentinel && line.contains("+monitor master"))
                    {
                        self.running = Some(running);
                        return Ok(());
                    } else {
                        seen.push(line);
                    }
                }
                Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(_) => seen.push(format!("not ready within {START_WITHIN:?}")),
            }
            let exited = !running.pid.is_empty() && !alive(&running.pid);
            if exited || Instant::now() >= deadline {
                drop(running.hold.take());
                let _ = running.shell.wait();
                return Err(format!(
                    "redis-server on port {} did not start: {}",
                    self.port,
                    seen.join("\n")
                ));
            }
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`, or `rediss://` for a TLS server.
    pub fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Kills the server (like a crash: no shutdown, state lost).
    pub fn kill(&mut self) {
        if let Some(mut running) = self.running.take() {
            let _ = Command::new("kill")
                .args(["-9", &running.pid])
                .stderr(Stdio::null())
                .status();
            // The shell reaps the server once its input closes, then exits.
            drop(running.hold.take());
            let _ = running.shell.wait();
        }
    }

    /// Starts it again on the same port with the same options, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn().expect("restart redis-server on the same port");
    }

    /// The file holding the CA certificate a TLS server's certificate is signed by, for
    /// `redis-cli --cacert`.
    pub fn tls_ca_file(&self) -> Option<PathBuf> {
        self.tls_ca.as_ref().map(|_| self.dir.join("ca.pem"))
    }

    /// The CA certificate (PEM) a TLS server's certificate is signed by.
    pub fn tls_ca(&self) -> Option<&str> {
        self.tls_ca.as_deref()
    }

    /// A plain connection for inspecting a plain server with no password.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the test redis-server")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether the process `pid` runs (and is not a zombie waiting to be reaped).
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // `pid (comm) state ...`: the state follows the last parenthesis.
        stat.rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next())
            != Some("Z")
    })
}

/// Panics with what to do when `program` (`redis-server`, `redis-sentinel`) is not
/// installed.
fn ensure_installed(program: &str) {
    let installed = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok();
    assert!(
        installed,
        "{program} is not installed: the Redis tests start their own servers. \
         Install it: apt-get install -y redis-server redis-sentinel (bash tests/setup does so \
         when they are missing)."
    );
}

/// A loopback port nothing listens on, and never one this process handed out before:
/// a server a test killed keeps its port, so another test's server cannot come up where
/// a client still looks for the dead one (it would then answer in its place).
pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        if handed_out.insert(port) {
            return port;
        }
    }
}

/// How many times a node ran `command` (`INFO commandstats`), failed calls included.
pub async fn command_calls(node: &mut redis::aio::MultiplexedConnection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(node)
        .await
        .expect("INFO commandstats");
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().expect("a call count"))
}

/// Pauses a node's writes for up to a minute (`CLIENT PAUSE 60000 WRITE`): scripts wait,
/// while reads and `node`'s own admin commands still run. [`unpause`] ends it.
pub async fn pause_writes(node: &mut redis::aio::MultiplexedConnection) {
    let () = redis::cmd("CLIENT")
        .arg(&["PAUSE", "60000", "WRITE"])
        .query_async(node)
        .await
        .expect("CLIENT PAUSE");
}

/// Ends a [`pause_writes`].
pub async fn unpause(node: &mut redis::aio::MultiplexedConnection) {
    let () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query_async(node)
        .await
        .expect("CLIENT UNPAUSE");
}

/// Script calls a node took: `EVALSHA` (`NOSCRIPT` replies included) and `EVAL`.
pub async fn script_calls(node: &mut redis::aio::MultiplexedConnection) -> u64 {
    command_calls(node, "evalsha").await + command_calls(node, "eval").await
}
