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
/// 2 s of the write the next requests see the new limit (the callers keep what they
/// used), and no request of the run fails or gets a 5xx — only 200 and 429.
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
    let err = reloader.reload().await.unwrap_err().to_string();
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
    /// `other`'s callers keep what they used under its new limit.
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
        reloader.reload().await.unwrap();
        // `api` kept its state (0 left); `other` keeps its 2 used of 50 (but `api` refuses).
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
        builder.settle("tokens", |_, _, _| Some(1))
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

/// Waits until `done` holds, looking again each time what `reloader` says is live
/// changes (a reload, a change seen pending): at most 10 s, then fails saying `what`.
async fn until<St: Store + Clone>(
    reloader: &Reloader<St>,
    what: &str,
    mut done: impl FnMut() -> bool,
) {
    let mut live = reloader.subscribe();
    let waited = tokio::time::timeout(Duration::from_secs(10), live.wait_for(|_| done())).await;
    assert!(matches!(waited, Ok(Ok(_))), "not within 10 s: {what}");
}

/// How many of `n` requests to `/` came back 200, and how many 429.
async fn statuses(client: &support::http::Client, n: usize) -> (usize, usize) {
    let (mut ok, mut limited) = (0, 0);
    for _ in 0..n {
        match client.get("/").await.status {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => limited += 1,
            other => panic!("{other}"),
        }
    }
    (ok, limited)
}

/// The SHA-256 of the file at `path`, as `sha256sum` prints it.
fn sha256sum(path: &Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .unwrap();
    let out = String::from_utf8(out.stdout).unwrap();
    out.split_whitespace().next().unwrap().to_owned()
}

/// A file whose `api` policy (20 a minute) is in shadow mode, with `extra` after it.
fn in_shadow(extra: &str) -> String {
    format!(
        "[layer]\ndefault = \"api\"\nheaders = \"legacy\"\n\n\
         [key]\napi_key = {{ header = \"x-api-key\" }}\n\n\
         [policies.api]\nalgorithm = \"token_bucket\"\nlimit = 20\nperiod = \"1m\"\nshadow = true\n\n\
         [policies.pro]\nalgorithm = \"gcra\"\nlimit = 1000\nperiod = \"1m\"\n\n\
         [tiers]\n\"pro-key-1\" = \"pro\"\n{extra}"
    )
}

/// The case: an admin switches `api` to enforcing, someone adds a tier key to the
/// file and it is reloaded — `api` stays enforcing (20 of 50 through, not 45), the reload
/// says it kept the switch, and the live state shows it. Resetting the switches hands
/// `api` back to its file (in shadow: nothing refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_time_shadow_switch_outlives_a_reload_and_shows() {
    let dir = Dir::new("switch");
    dir.write(&in_shadow(""));
    let clock = ManualClock::at_micros(EPOCH_US);
    let reloader = Reloader::new(dir.file(), memory_store(&clock)).unwrap();
    let server = serve(&reloader).await;
    let client = server.client();
    let layer = reloader.layer();
    layer.set_policy_shadow("api", false).unwrap();

    dir.write(&in_shadow("\"pro-key-2\" = \"pro\"\n"));
    let reloaded = reloader.reload().await.unwrap();
    let kept = reloaded.kept_switches();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].policy(), Some("api"));
    assert!(!kept[0].is_on() && kept[0].is_switched());
    assert_eq!(statuses(&client, 50).await, (20, 30));
    let api = layer
        .shadow_states()
        .into_iter()
        .find(|s| s.policy() == Some("api"));
    assert!(api.is_some_and(|api| !api.is_on() && api.is_switched()));
    assert!(!reloader.layer().is_shadow(Some("api")));

    // Back to the file: `api` in shadow, the spent callers served (and counted).
    layer.reset_shadow();
    assert_eq!(statuses(&client, 5).await, (5, 0));
    // A file that agrees with a switch ends it: the policy follows its file again.
    layer.set_policy_shadow("api", false).unwrap();
    dir.write(&in_shadow("").replace("shadow = true\n", ""));
    let reloaded = reloader.reload().await.unwrap();
    assert!(reloaded.kept_switches().is_empty());
    assert!(layer.shadow_states().iter().all(|s| !s.is_switched()));
}

/// A link into another directory: the file it points at is edited there (saved
/// atomically), and the watcher reloads it — it used to watch only the link's directory,
/// and never fire.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_behind_a_link_into_another_directory_is_reloaded() {
    let (links, real) = (Dir::new("link-from"), Dir::new("link-to"));
    real.write(&limits(10, 5));
    std::os::unix::fs::symlink(real.file(), links.file()).unwrap();
    let reloader = Reloader::new(links.file(), tollway_core::MemoryStore::new()).unwrap();
    let _watcher = reloader.watch().unwrap();
    let layer = reloader.layer();

    real.write(&limits(1_000, 5));
    until(&reloader, "the edit behind the link is live", || {
        layer.policy("api").unwrap().quota().limit() == 1_000
    })
    .await;
    assert_eq!(reloader.live().version(), sha256sum(&real.file()));
    // And the link itself pointed elsewhere: the new target is read and watched.
    let other = real.0.join("other.toml");
    std::fs::write(&other, limits(7, 5)).unwrap();
    let swap = links.0.join(".limits.toml.link");
    std::os::unix::fs::symlink(&other, &swap).unwrap();
    std::fs::rename(&swap, links.file()).unwrap();
    until(&reloader, "the link's new target is live", || {
        layer.policy("api").unwrap().quota().limit() == 7
    })
    .await;
    std::fs::write(&other, limits(8, 5)).unwrap();
    until(
        &reloader,
        "an in-place edit of the new target is live",
        || layer.policy("api").unwrap().quota().limit() == 8,
    )
    .await;
}

/// A Kubernetes ConfigMap: `limits.toml -> ..data/limits.toml`, `..data -> ..<stamp>`, and
/// an update writes a new `..<stamp>` directory, swaps `..data` to it by a rename, and
/// removes the old one. The watcher follows the swap.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_update_by_swapping_its_data_link_is_reloaded() {
    use std::os::unix::fs::symlink;
    let dir = Dir::new("configmap");
    let stamp = |n: u32| dir.0.join(format!("..2026_12_03_{n}"));
    let publish = |n: u32, limit: u32| {
        std::fs::create_dir_all(stamp(n)).unwrap();
        std::fs::write(stamp(n).join("limits.toml"), limits(limit, 5)).unwrap();
        let tmp = dir.0.join("..data_tmp");
        symlink(stamp(n).file_name().unwrap(), &tmp).unwrap();
        std::fs::rename(&tmp, dir.0.join("..data")).unwrap();
    };
    publish(1, 10);
    symlink("..data/limits.toml", dir.file()).unwrap();
    let reloader = Reloader::new(dir.file(), tollway_core::MemoryStore::new()).unwrap();
    let _watcher = reloader.watch().unwrap();
    let layer = reloader.layer();

    for (n, limit) in [(2, 1_000), (3, 30)] {
        publish(n, limit);
        std::fs::remove_dir_all(stamp(n - 1)).unwrap();
        until(&reloader, &format!("update {n} is live"), || {
            layer.policy("api").unwrap().quota().limit() == u64::from(limit)
        })
        .await;
    }
    assert_eq!(reloader.live().reloads(), 2);
    assert_eq!(
        reloader.live().version(),
        sha256sum(&stamp(3).join("limits.toml"))
    );
}

/// A FIFO in place of the file used to block the reload (and with it an async worker)
/// until something wrote to it. Now it is refused at once, well within the read timeout,
/// counted as a failed reload; the running limits stay.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_in_place_of_the_file_fails_the_reload_without_blocking() {
    let dir = Dir::new("fifo");
    dir.write(&limits(10, 5));
    let reloader = Reloader::new(dir.file(), tollway_core::MemoryStore::new())
        .unwrap()
        .read_timeout(Duration::from_secs(2));
    std::fs::remove_file(dir.file()).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(dir.file())
        .status()
        .unwrap();
    assert!(made.success());
    let started = Instant::now();
    let reload = tokio::time::timeout(Duration::from_secs(10), reloader.reload()).await;
    let err = reload
        .expect("the reload returned")
        .unwrap_err()
        .to_string();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(err.contains("not a regular file"), "{err}");
    assert_eq!(reloader.layer().policy("api").unwrap().quota().limit(), 10);
    let live = reloader.live();
    assert_eq!((live.reloads(), live.failures()), (0, 1));
    assert_eq!(live.last_error(), Some(err.as_str()));
    // And the server kept serving meanwhile: nothing blocked.
    let server = serve(&reloader).await;
    assert_eq!(server.client().get("/").await.status, StatusCode::OK);
}

/// A file over the bound (64 MiB, sparse) is refused before it is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_over_the_size_bound_is_refused() {
    let dir = Dir::new("huge");
    dir.write(&limits(10, 5));
    let reloader = Reloader::new(dir.file(), tollway_core::MemoryStore::new()).unwrap();
    std::fs::File::options()
        .write(true)
        .open(dir.file())
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let err = reloader.reload().await.unwrap_err().to_string();
    assert!(err.contains("67108864 bytes, over the 1048576"), "{err}");
    assert_eq!(reloader.live().failures(), 1);
}

/// A file rewritten in place, with a pause after a prefix that is valid on its own but
/// lacks the deny list: the watcher reads the prefix, and waits for it to settle on a
/// manual clock that does not move — so however long the writer pauses, the prefix is
/// never applied (it used to be, after 100 ms). The whole file, once settled, is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_half_written_in_place_is_never_applied() {
    use std::io::Write as _;
    let dir = Dir::new("half");
    let deny = "\n[lists]\ndeny_networks = [\"127.0.0.0/8\"]\n";
    dir.write(&format!("{}{deny}", limits(10, 5)));
    let settle = ManualClock::new();
    let reloader = Reloader::new(dir.file(), tollway_core::MemoryStore::new())
        .unwrap()
        .settle(Duration::from_secs(1))
        .settle_clock(settle.clone());
    let _watcher = reloader.watch().unwrap();
    let server = serve(&reloader).await;
    let client = server.client();
    assert_eq!(client.get("/").await.status, StatusCode::FORBIDDEN);

    // In place: truncated, the prefix written and flushed, the file left open.
    let prefix = limits(20, 5);
    let mut file = std::fs::File::create(dir.file()).unwrap();
    file.write_all(prefix.as_bytes()).unwrap();
    file.flush().unwrap();
    let prefix_version = sha256sum(&dir.file());
    until(&reloader, "the watcher has read the prefix", || {
        reloader.live().pending() == Some(prefix_version.as_str())
    })
    .await;
    // Seen, not applied: the deny list holds.
    assert_eq!(client.get("/").await.status, StatusCode::FORBIDDEN);
    assert_eq!(reloader.live().reloads(), 0);

    file.write_all(deny.as_bytes()).unwrap();
    drop(file);
    let whole = sha256sum(&dir.file());
    until(&reloader, "the watcher has read the whole file", || {
        reloader.live().pending() == Some(whole.as_str())
    })
    .await;
    assert_eq!(reloader.live().reloads(), 0);
    settle.advance(Duration::from_secs(1));
    until(&reloader, "the whole file is live", || {
        reloader.live().version() == whole
    })
    .await;
    let live = reloader.live();
    assert_eq!((live.reloads(), live.failures()), (1, 0));
    assert_eq!(reloader.layer().policy("api").unwrap().quota().limit(), 20);
    assert_eq!(client.get("/").await.status, StatusCode::FORBIDDEN);
}

both_stores! {
    /// An incident: `api` (a token bucket of 20 a minute) cut to 10 after a caller used
    /// its 20. The caller gets nothing more for that minute, nor until 66 s (20 used, 10
    /// a minute now). Then a plan upgrade from 100 to 10,000 keeps the 100 used.
    async fn a_cut_admits_nothing_more_and_an_upgrade_keeps_what_was_used(store, clock) {
        let dir = Dir::new(&format!("requota-{}", std::any::type_name::<St>().len()));
        dir.write(&limits(20, 5));
        let reloader = Reloader::new(dir.file(), store).unwrap();
        let server = serve(&reloader).await;
        let client = server.client();
        let remaining = |reply: &support::http::Reply| {
            reply.header("x-ratelimit-remaining").map(str::to_owned)
        };
        for _ in 0..20 {
            assert_eq!(client.get("/").await.status, StatusCode::OK);
        }
        dir.write(&limits(10, 5));
        assert!(reloader.reload().await.unwrap().reset_policies().is_empty());
        for second in [0, 10, 30, 59, 65] {
            clock.set_micros(EPOCH_US + second * 1_000_000);
            let reply = client.get("/").await;
            assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS, "at {second} s");
            assert_eq!(remaining(&reply).as_deref(), Some("0"));
        }
        clock.set_micros(EPOCH_US + 66_000_000);
        assert_eq!(client.get("/").await.status, StatusCode::OK);

        // A new day, a new plan: 100 a minute, all used, then 10,000.
        clock.set_micros(EPOCH_US + 86_400_000_000);
        dir.write(&limits(100, 5));
        reloader.reload().await.unwrap();
        for _ in 0..100 {
            assert_eq!(client.get("/").await.status, StatusCode::OK);
        }
        dir.write(&limits(10_000, 5));
        reloader.reload().await.unwrap();
        let reply = client.get("/").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(remaining(&reply).as_deref(), Some("9899"));
    }
}

/// A month of 10^10 tokens in Paris, each request's tokens in `x-tokens` (written by a
/// gateway in front).
const MONTHLY: &str = "[layer]\ndefault = \"tokens\"\nheaders = \"legacy\"\n\n\
    [policies.tokens]\nalgorithm = \"fixed_window\"\nlimit = 10000000000\n\
    period = \"calendar month\"\nzone = \"Europe/Paris\"\n\n\
    [policies.tokens.cost]\nheader = \"x-tokens\"\nwritten_by = \"gateway\"\n";

both_stores! {
    /// A monthly budget of 10^10 tokens on Paris's calendar, through the layer: February
    /// 2027 (28 days) ends at midnight in Paris, not 30 days after the first request;
    /// March ends at midnight summer time, an hour earlier in UTC than it began.
    async fn a_calendar_month_of_ten_billion_tokens_resets_at_midnight_in_paris(store, clock) {
        // 2027-02-10 12:00 UTC, and midnights in Paris as UTC µs.
        const FEB_10: u64 = 1_802_260_800_000_000;
        const MARCH_1: u64 = 1_803_855_600_000_000; // 2027-02-28 23:00 UTC (CET)
        const APRIL_1: u64 = 1_806_530_400_000_000; // 2027-03-31 22:00 UTC (CEST)
        const HOUR: u64 = 3_600_000_000;

        let dir = Dir::new(&format!("monthly-{}", std::any::type_name::<St>().len()));
        dir.write(MONTHLY);
        let reloader = Reloader::new(dir.file(), store).unwrap();
        let server = serve(&reloader).await;
        let client = server.client();
        let spend = |tokens: u64| {
            let client = client.clone();
            async move {
                let reply = client.get_with("/", &[("x-tokens", &tokens.to_string())]).await;
                (reply.status.as_u16(), reply.header("x-ratelimit-remaining").map(str::to_owned))
            }
        };
        let spend_month = async || {
            for _ in 0..3 {
                assert_eq!(spend(3_000_000_000).await.0, 200);
            }
            assert_eq!(spend(2_000_000_000).await.0, 429, "9e9 spent: 2e9 do not fit");
            assert_eq!(spend(1_000_000_000).await, (200, Some("0".to_owned())));
        };
        clock.set_micros(FEB_10);
        assert_eq!(spend(1).await, (200, Some("9999999999".to_owned())));
        // The rest of February's budget, less that one token.
        for _ in 0..3 {
            assert_eq!(spend(3_000_000_000).await.0, 200);
        }
        assert_eq!(spend(999_999_999).await, (200, Some("0".to_owned())));
        // An hour before midnight in Paris: refused, told to come back in an hour.
        clock.set_micros(MARCH_1 - HOUR);
        let refused = client.get_with("/", &[("x-tokens", "1")]).await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.header("retry-after"), Some("3600"));
        clock.set_micros(MARCH_1 - 1);
        assert_eq!(spend(1).await.0, 429);
        // March: the whole budget again, from midnight.
        clock.set_micros(MARCH_1);
        spend_month().await;
        // Summer time began on the 28th: March ends at 22:00 UTC, not 23:00.
        clock.set_micros(APRIL_1 - 1);
        assert_eq!(spend(1).await.0, 429);
        clock.set_micros(APRIL_1);
        spend_month().await;
    }
}

/// Tightening a limit keeps its callers' usage, a new period starts them afresh (state
/// keys name the algorithm and period): the reload says which policies, and `live` what
/// is loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_names_the_policies_whose_counts_start_afresh() {
    let dir = Dir::new("afresh");
    dir.write(&limits(20, 5));
    let reloader = Reloader::new(dir.file(), tollway_core::MemoryStore::new()).unwrap();
    let first = reloader.live();
    assert_eq!(first.version(), sha256sum(&dir.file()));
    assert_eq!((first.reloads(), first.failures()), (0, 0));

    dir.write(&limits(10, 5));
    assert!(reloader.reload().await.unwrap().reset_policies().is_empty());
    dir.write(&limits(10, 5).replacen("period = \"1m\"", "period = \"1h\"", 1));
    let reloaded = reloader.reload().await.unwrap();
    assert_eq!(reloaded.reset_policies(), ["api".to_owned()]);
    assert_eq!(reloaded.version(), sha256sum(&dir.file()));
    let live = reloader.live();
    assert_eq!(live.version(), reloaded.version());
    assert_eq!(live.reloads(), 2);
    assert!(live.loaded_at() >= first.loaded_at());
    // Unchanged policies are not named.
    let again = reloader.reload().await.unwrap();
    assert!(again.reset_policies().is_empty());
}

/// A file whose pro tier is GCRA at 100 a minute, and whose key `k-acme` has a plan of
/// its own on it: `acme` a minute.
fn plans(acme: u64) -> String {
    format!(
        "[layer]\ndefault = \"anonymous\"\nheaders = \"legacy\"\n\n\
         [key]\napi_key = {{ header = \"x-api-key\" }}\n\n\
         [policies.anonymous]\nalgorithm = \"token_bucket\"\nlimit = 5\nperiod = \"1m\"\n\n\
         [policies.pro]\nalgorithm = \"gcra\"\nlimit = 100\nperiod = \"1m\"\n\n\
         [tiers]\n\"k-pro\" = \"pro\"\n\n\
         [plans]\n\"k-acme\" = {{ tier = \"pro\", limit = {acme} }}\n"
    )
}

both_stores! {
    /// A customer's own quota from the file: `k-acme` has 20 a minute on the pro tier
    /// (100), spends them and is refused; its contract goes to 40 and it keeps the 20 it
    /// used (19 left after one more), while `k-pro` stays on the tier's 100.
    async fn a_plan_of_its_own_is_kept_across_a_change_of_its_quota(store, clock) {
        let dir = Dir::new(&format!("plans-{}", std::any::type_name::<St>().len()));
        dir.write(&plans(20));
        let reloader = Reloader::new(dir.file(), store).unwrap();
        let server = serve(&reloader).await;
        let client = server.client();
        let send = |key: &'static str| {
            let client = client.clone();
            async move {
                let reply = client.get_with("/", &[("x-api-key", key)]).await;
                let header = |name| reply.header(name).map(str::to_owned);
                (reply.status.as_u16(), header("x-ratelimit-limit"), header("x-ratelimit-remaining"))
            }
        };
        let some = |n: &str| Some(n.to_owned());
        assert_eq!(send("k-acme").await, (200, some("20"), some("19")));
        for _ in 0..19 {
            assert_eq!(send("k-acme").await.0, 200);
        }
        assert_eq!(send("k-acme").await, (429, some("20"), some("0")));
        assert_eq!(send("k-pro").await, (200, some("100"), some("99")));

        dir.write(&plans(40));
        assert!(reloader.reload().await.unwrap().reset_policies().is_empty());
        assert_eq!(send("k-acme").await, (200, some("40"), some("19")));
        for _ in 0..19 {
            assert_eq!(send("k-acme").await.0, 200);
        }
        assert_eq!(send("k-acme").await.0, 429);
        // A minute on, 40 again: the new rate runs.
        clock.set_micros(EPOCH_US + 60_000_000);
        assert_eq!(send("k-acme").await, (200, some("40"), some("39")));
        assert_eq!(send("k-pro").await, (200, some("100"), some("99")));
    }
}
