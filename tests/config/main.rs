//! Limits from a file, over real HTTP: edited while requests flow, reloaded within the
//! time the issue allows, never failing a request; a broken edit refused with its line;
//! and one file deciding alike on the memory store and on Redis.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use http::StatusCode;
use support::both_stores;
use support::http::Server;
use support::stores::{EPOCH_US, memory_store};
use tollway_core::{ManualClock, Store};
use tollway_tower::config::Reloader;

/// A directory of its own for a test's limits file, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tollway-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }

    fn file(&self) -> PathBuf {
        self.0.join("limits.toml")
    }

    /// Writes the limits file as an editor that saves atomically does: a copy, renamed
    /// over the file.
    fn write(&self, text: &str) {
        let copy = self.0.join(".limits.toml.new");
        std::fs::write(&copy, text).unwrap();
        std::fs::rename(&copy, self.file()).unwrap();
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A file whose default policy `api` is a token bucket of `limit` a minute, and a second
/// policy `other` for the `/other` route of `other` a minute.
fn limits(limit: u32, other: u32) -> String {
    format!(
        "[layer]\ndefault = \"api\"\nheaders = \"legacy\"\n\n\
         [policies.api]\nalgorithm = \"token_bucket\"\nlimit = {limit}\nperiod = \"1m\"\n\n\
         [policies.other]\nalgorithm = \"gcra\"\nlimit = {other}\nperiod = \"1m\"\n\n\
         [[routes]]\npath = \"/other\"\npolicy = \"other\"\n"
    )
}

async fn serve<St: Store + Clone>(reloader: &Reloader<St>) -> Server {
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/other", get(|| async { "ok" }))
        .layer(reloader.layer());
    Server::start(app).await
}

/// Under a steady stream of requests, the file goes from 10 a minute to 1,000: within
/// 2 s of the write the next requests see the new limit (a changed quota: the callers
/// start afresh), and no request of the run fails or gets a 5xx — only 200 and 429.
/// Then a broken edit: the error names its line and column, and the 1,000 stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_under_load_takes_effect_within_two_seconds_and_a_broken_one_never() {
    let dir = Dir::new("reload");
    dir.write(&limits(10, 5));
    let clock = ManualClock::at_micros(EPOCH_US);
    let reloader = Reloader::new(dir.file(), memory_store(&clock)).unwrap();
    let _watcher = reloader.watch().unwrap();
    let server = serve(&reloader).await;

    // The load: four connections, one request after another on each, until told to stop
    // (at most 5,000 each).
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let load: Vec<_> = (0..4)
        .map(|_| {
            let (client, stop, sent) = (server.client(), Arc::clone(&stop), Arc::clone(&sent));
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) && seen.len() < 5_000 {
                    let reply = client.get("/").await;
                    let limit = reply.header("x-ratelimit-limit").map(str::to_owned);
                    seen.push((reply.status, limit));
                    sent.fetch_add(1, Ordering::Relaxed);
                }
                seen
            })
        })
        .collect();
    let client = server.client();
    // 10 a minute: spent, then refused, while the load has sent 200 requests.
    loop {
        let reply = client.get("/").await;
        if reply.status == StatusCode::TOO_MANY_REQUESTS && sent.load(Ordering::Relaxed) >= 200 {
            assert_eq!(reply.header("x-ratelimit-limit"), Some("10"));
            break;
        }
    }

    dir.write(&limits(1_000, 5));
    let written = Instant::now();
    let raised = loop {
        let reply = client.get("/").await;
        if reply.header("x-ratelimit-limit") == Some("1000") {
            break written.elapsed();
        }
        assert!(
            written.elapsed() < Duration::from_secs(2),
            "not reloaded within 2 s"
        );
    };
    assert_eq!(client.get("/").await.status, StatusCode::OK);

    // A broken edit: refused with its place; the running limits stay.
    dir.write(&limits(0, 5));
    let err = reloader.reload().unwrap_err().to_string();
    let at = format!("{}:7:9: ", dir.file().display());
    assert!(err.starts_with(&at), "{err}");
    let reply = client.get("/").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("x-ratelimit-limit"), Some("1000"));

    stop.store(true, Ordering::Relaxed);
    let mut seen = Vec::new();
    for task in load {
        seen.extend(task.await.unwrap());
    }
    assert!(seen.len() >= 200, "the load ran: {} requests", seen.len());
    for (status, limit) in &seen {
        assert!(
            *status == StatusCode::OK || *status == StatusCode::TOO_MANY_REQUESTS,
            "{status}"
        );
        assert!(matches!(limit.as_deref(), Some("10" | "1000")), "{limit:?}");
    }
    eprintln!(
        "reloaded {raised:?} after the write; {} requests in the load",
        seen.len()
    );
}

both_stores! {
    /// One file decides alike on both stores: the same statuses and remaining counts;
    /// a reload that changes only `other` keeps `api`'s callers where they were, and
    /// `other`'s callers start afresh under its new quota.
    async fn one_file_decides_alike_on_both_stores_and_a_reload_keeps_unchanged_state(store, clock) {
        let _ = &clock;
        let dir = Dir::new(&format!("alike-{}", std::any::type_name::<St>().len()));
        dir.write(&limits(3, 2));
        let reloader = Reloader::new(dir.file(), store).unwrap();
        let server = serve(&reloader).await;
        let client = server.client();
        let remaining = |path: &'static str| {
            let client = client.clone();
            async move {
                let reply = client.get(path).await;
                (reply.status.as_u16(), reply.header("x-ratelimit-remaining").map(str::to_owned))
            }
        };
        assert_eq!(remaining("/").await, (200, Some("2".into())));
        // /other is limited by both: `api` is charged too.
        assert_eq!(remaining("/other").await, (200, Some("1".into())));
        assert_eq!(remaining("/other").await, (200, Some("0".into())));
        assert_eq!(remaining("/other").await, (429, Some("0".into())));

        dir.write(&limits(3, 50));
        reloader.reload().unwrap();
        // `api` kept its state (0 left); `other` starts afresh at 50 (but `api` refuses).
        assert_eq!(remaining("/").await, (429, Some("0".into())));
        assert_eq!(reloader.layer().policy("other").unwrap().quota().limit(), 50);
        assert!(Path::new(&dir.file()).exists());
    }
}

/// The file whose policy lost its route: `tokens`, charged after each response by the
/// service, without the route that put it in the layer. It used to pass `check` and then
/// fail at the server with no file or line; both refuse it at its table now. And a
/// service charging a policy the file never had names the file.
#[test]
fn a_policy_that_lost_its_route_is_refused_at_its_line_before_the_server_starts() {
    let dir = Dir::new("lost-route");
    let kept = "[layer]\ndefault = \"api\"\n\n\
                [policies.api]\nalgorithm = \"gcra\"\nlimit = 10\nperiod = \"1m\"\n\n\
                [policies.tokens]\nalgorithm = \"token_bucket\"\nlimit = 1000\nperiod = \"1m\"\n";
    dir.write(kept);
    let at = format!("{}:9:1: ", dir.file().display());
    let checked = tollway_tower::config::LimitsFile::read(dir.file()).unwrap_err();
    assert!(checked.to_string().starts_with(&at), "{checked}");
    let charge = |builder: tollway_tower::RateLimitLayerBuilder<_, _>| {
        builder.charge_after("tokens", |_, _, _| 1)
    };
    let clock = ManualClock::at_micros(EPOCH_US);
    let served = Reloader::new(dir.file(), memory_store(&clock)).unwrap_err();
    assert!(served.to_string().starts_with(&at), "{served}");

    // Without [policies.tokens] at all: the file is valid, and the service's charge
    // names the file it could not find the policy in.
    dir.write("[layer]\ndefault = \"api\"\n\n[policies.api]\nalgorithm = \"gcra\"\nlimit = 10\nperiod = \"1m\"\n");
    let file = tollway_tower::config::LimitsFile::read(dir.file()).unwrap();
    let err = Reloader::from_file_with(dir.file(), file, memory_store(&clock), charge)
        .unwrap_err()
        .to_string();
    let named = format!("{}: ", dir.file().display());
    assert!(
        err.starts_with(&named) && err.contains("\"tokens\""),
        "{err}"
    );
}
