//! Shared test support: real `redis-server` processes on free loopback ports.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};

/// A `redis-server` this test started, on a free loopback port; stopped on drop.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    dir: PathBuf,
    /// The options it was started with, given again on a restart.
    extra: Vec<String>,
    /// The CA certificate (PEM) when it listens only for TLS on `port`.
    tls_ca: Option<String>,
}

/// What a TLS server needs, all PEM: the CA that signed its certificate, the certificate
/// (valid for 127.0.0.1) and its private key.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub ca_cert: String,
    pub cert: String,
    pub key: String,
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
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port();
            let dir =
                std::env::temp_dir().join(format!("tollway-redis-{}-{port}", std::process::id()));
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
                child: None,
                dir,
                extra: options.clone(),
                tls_ca: tls.map(|files| files.ca_cert.clone()),
            };
            match server.spawn() {
                Ok(()) => return server,
                Err(e) => last_error = e,
            }
        }
        panic!("redis-server did not start: {last_error}");
    }

    fn spawn(&mut self) -> Result<(), String> {
        let port = self.port.to_string();
        // A TLS server listens on `port` for TLS only.
        let ports: &[&str] = if self.tls_ca.is_some() {
            &["--port", "0", "--tls-port", &port]
        } else {
            &["--port", &port]
        };
        let mut child = Command::new("redis-server")
            .args(ports)
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--logfile", "", "--daemonize", "no", "--protected-mode", "no"])
            .args(&self.extra)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    panic!(
                        "redis-server is not installed: the Redis tests start their own servers. \
                         Install it (apt-get install -y redis-server); .ci/run does so when it is missing."
                    );
                }
                format!("spawn redis-server: {e}")
            })?;
        // The server says when it is ready; no polling, no sleeping.
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut seen = Vec::new();
        loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if line.contains("Ready to accept connections") {
                        break;
                    }
                    seen.push(line);
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "redis-server on port {} exited: {}",
                        self.port,
                        seen.join("\n")
                    ));
                }
            }
        }
        // Keep draining its output so that it never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        self.child = Some(child);
        Ok(())
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
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
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

    /// A plain connection for inspecting a plain server (with no password: a server
    /// started with `--requirepass` needs its own client, and so does a TLS server, which
    /// needs redis-rs's TLS support that not every includer of this file builds).
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

/// A loopback port nothing listens on, and never one this process handed out before:
/// a server a test killed keeps its port, so another test's server cannot come up where
/// a client still looks for the dead one (it would then answer in its place).
pub(crate) fn free_port() -> u16 {
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

/// splitmix64: a small deterministic generator, so failures replay exactly.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One policy's decision, which is what most store tests ask.
pub trait CheckOne: tollway_core::Store {
    /// [`Store::check`](tollway_core::Store::check) of one policy: its decision.
    fn check_one(
        &self,
        key: &[u8],
        policy: &tollway_core::Policy,
        cost: u32,
    ) -> impl std::future::Future<Output = Result<tollway_core::Decision, tollway_core::StoreError>>
    + Send
    + 'static {
        let checked = self.check(key, &[policy], cost);
        async move { checked.await.map(|decisions| decisions[0]) }
    }
}

impl<S: tollway_core::Store> CheckOne for S {}
