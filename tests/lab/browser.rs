//! The lab in a real browser: headless Chromium driven through chromedriver (Debian's
//! `chromium` and `chromium-driver`), the lab served on a free loopback port over a
//! memory store on a manual clock.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;
use support::http::Server;
use support::stores::{EPOCH_US, memory_store};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tollway_core::ManualClock;
use tollway_tower::BoxStore;

/// chromedriver on a free loopback port, killed when dropped.
struct Driver {
    _child: Child,
    url: String,
}

impl Driver {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let mut child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver is installed (apt-get install chromium chromium-driver)");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        support::within("chromedriver to start", 30, async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if line.contains("started successfully") {
                    return;
                }
            }
            panic!("chromedriver ended before it started");
        })
        .await;
        Driver {
            _child: child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }

    async fn browser(&self) -> Client {
        let capabilities = json!({
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=800,1400"],
            }
        });
        let serde_json::Value::Object(capabilities) = capabilities else {
            unreachable!("an object")
        };
        // fantoccini's client is built with rustls, which wants a crypto provider (the
        // WebDriver connection itself is plain HTTP on loopback).
        let _ = rustls::crypto::ring::default_provider().install_default();
        ClientBuilder::rustls()
            .unwrap()
            .capabilities(capabilities)
            .connect(&self.url)
            .await
            .unwrap()
    }
}

/// The text of the element with id `id`.
async fn text(browser: &Client, id: &str) -> String {
    let found = browser.find(Locator::Id(id)).await.unwrap();
    found.text().await.unwrap()
}

/// Waits (at most 10 s) until the element with id `id` says `wanted`: the page updates
/// as its requests come back and as it polls.
async fn until(browser: &Client, id: &str, wanted: impl Fn(&str) -> bool) -> String {
    until_within(browser, id, 10, wanted).await
}

/// [`until`], waiting at most `seconds`.
async fn until_within(
    browser: &Client,
    id: &str,
    seconds: u64,
    wanted: impl Fn(&str) -> bool,
) -> String {
    let mut seen = String::new();
    for _ in 0..seconds * 20 {
        seen = text(browser, id).await;
        if wanted(&seen) {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("#{id} still says {seen:?}");
}

/// Selects the token bucket, fires the burst: exactly 10 allowed and 5 blocked, the last
/// a 429 with `X-RateLimit-Remaining: 0`; one second later on the store's clock the page
/// draws 2 tokens back; the race and the boundary burst show the server's counts. A
/// screenshot is saved under `target/lab/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_drives_the_real_limiter() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let lab = demo::lab::router(BoxStore::new(memory_store(&clock)), None).unwrap();
    let server = Server::start(lab).await;
    let addr: SocketAddr = server.addr();
    let driver = Driver::start().await;
    let browser = driver.browser().await;
    browser.goto(&format!("http://{addr}/lab")).await.unwrap();
    until(&browser, "units", |t| t == "10 of 10").await;

    let picker = browser.find(Locator::Id("algorithm")).await.unwrap();
    picker.select_by_value("token_bucket").await.unwrap();
    browser
        .find(Locator::Id("burst"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    until(&browser, "blocked", |t| t == "5").await;
    assert_eq!(text(&browser, "allowed").await, "10");
    assert!(text(&browser, "status").await.starts_with("429"));
    assert_eq!(text(&browser, "remaining").await, "0");
    assert_eq!(text(&browser, "retry").await, "1 s");
    until(&browser, "units", |t| t == "0 of 10").await;

    clock.advance(Duration::from_secs(1));
    until(&browser, "units", |t| t == "2 of 10").await;

    browser
        .find(Locator::Id("race"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let tollway = until(&browser, "race-tollway", |t| t != "–").await;
    assert!(tollway.starts_with("10 of 30"), "{tollway}");
    let naive = text(&browser, "race-naive").await;
    assert!(naive.starts_with("30 of 30"), "{naive}");

    // The boundary burst waits for the lab's window to end: up to 5 s of real time.
    browser
        .find(Locator::Id("boundary"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let fixed = until_within(&browser, "boundary-fixed", 12, |t| {
        t.starts_with(char::is_numeric)
    })
    .await;
    assert!(
        fixed.starts_with("20 in a quarter of a second (10 before the boundary, 10 after)"),
        "{fixed}"
    );
    let log = text(&browser, "boundary-log").await;
    assert!(
        log.starts_with("10 in a quarter of a second (10 before the boundary, 0 after)"),
        "{log}"
    );

    let png = browser.screenshot().await.unwrap();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/lab");
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(format!("{dir}/lab-browser.png"), png).unwrap();
    browser.close().await.unwrap();
}
