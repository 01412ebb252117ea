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
            .expect("chromedriver is not installed: apt-get install -y redis-server chromium chromium-driver");
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

/// Waits until the element with id `id` says `wanted` (or, with `prefix`, begins so):
/// the page updates as its requests come back and as it polls. The browser waits, with a
/// `MutationObserver` on the element, within the session's script timeout (15 s).
async fn until(browser: &Client, id: &str, wanted: &str, prefix: bool) -> String {
    const WAIT: &str = r#"
        const [id, wanted, prefix, done] = arguments;
        const element = document.getElementById(id);
        const says = () => prefix ? element.textContent.startsWith(wanted)
                                  : element.textContent === wanted;
        if (says()) return done(element.textContent);
        new MutationObserver((_, observer) => {
            if (says()) { observer.disconnect(); done(element.textContent); }
        }).observe(element, { childList: true, characterData: true, subtree: true });
    "#;
    let args = vec![json!(id), json!(wanted), json!(prefix)];
    match browser.execute_async(WAIT, args).await {
        Ok(serde_json::Value::String(text)) => text,
        other => panic!(
            "#{id} never said {wanted:?}: {other:?}, now {:?}",
            text(browser, id).await
        ),
    }
}

/// Selects the token bucket, fires the burst: exactly 10 allowed and 5 blocked, the last
/// a 429 with `X-RateLimit-Remaining: 0`; one second later on the store's clock the page
/// draws 2 tokens back; the race and the boundary burst show the server's counts. A
/// screenshot is saved under `target/lab/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_drives_the_real_limiter() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let lab = demo::lab::router(memory_store(&clock), &[]).unwrap();
    let server = Server::start(lab).await;
    let addr: SocketAddr = server.addr();
    let driver = Driver::start().await;
    let browser = driver.browser().await;
    let script = Some(Duration::from_secs(15));
    let timeouts = fantoccini::wd::TimeoutConfiguration::new(script, None, None);
    browser.update_timeouts(timeouts).await.unwrap();
    browser.goto(&format!("http://{addr}/lab")).await.unwrap();
    until(&browser, "units", "10 of 10", false).await;

    let picker = browser.find(Locator::Id("algorithm")).await.unwrap();
    picker.select_by_value("token_bucket").await.unwrap();
    browser
        .find(Locator::Id("burst"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    until(&browser, "blocked", "5", false).await;
    assert_eq!(text(&browser, "allowed").await, "10");
    assert!(text(&browser, "status").await.starts_with("429"));
    assert_eq!(text(&browser, "remaining").await, "0");
    assert_eq!(text(&browser, "retry").await, "1 s");
    until(&browser, "units", "0 of 10", false).await;

    clock.advance(Duration::from_secs(1));
    until(&browser, "units", "2 of 10", false).await;

    browser
        .find(Locator::Id("race"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    until(&browser, "race-tollway", "10 of 30", true).await;
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
    let fixed = "20 in a quarter of a second (10 before the boundary, 10 after)";
    until(&browser, "boundary-fixed", fixed, true).await;
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
