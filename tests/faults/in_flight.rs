//! A gateway killed with calls in flight: its slots free themselves within one lease.
//!
//! The gateway is a process of its own: this test binary run again as
//! `dead_gateway_child`, which serves three calls that never end through the tower
//! layer over Redis, says so on its stdout, and is then killed (`SIGKILL`: nothing is
//! given back). Its slots were renewed every third of the 2 s lease while it lived.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicUsize;

use tollway_core::Operation;
use tollway_tower::{GlobalKey, RateLimitLayer};
use tower::{Layer, ServiceExt};

use super::*;

/// The lease: slots live this long past their last renewal.
const LEASE: Duration = Duration::from_secs(2);

fn streams() -> Policy {
    Policy::new(
        "streams",
        Algorithm::Concurrency,
        Quota::with_period(5, LEASE).unwrap(),
    )
    .unwrap()
}

/// The child: three calls in flight, held by a handler that never answers. Run only
/// by the test below, through its environment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of a_killed_gateway_frees_its_slots_within_a_lease"]
async fn dead_gateway_child() {
    let (Ok(url), Ok(prefix)) = (
        std::env::var("TOLLWAY_CHILD_REDIS"),
        std::env::var("TOLLWAY_CHILD_PREFIX"),
    ) else {
        return;
    };
    let store = RedisStore::builder()
        .prefix(prefix)
        .connect(&url)
        .await
        .unwrap();
    let layer = RateLimitLayer::builder(store, streams())
        .key(GlobalKey)
        .build()
        .unwrap();
    let entered = Arc::new(AtomicUsize::new(0));
    let inside = Arc::clone(&entered);
    let service = layer.layer(tower::service_fn(move |_: http::Request<()>| {
        inside.fetch_add(1, Ordering::SeqCst);
        std::future::pending::<Result<http::Response<String>, std::convert::Infallible>>()
    }));
    for _ in 0..3 {
        let service = service.clone();
        tokio::spawn(async move { service.oneshot(http::Request::new(())).await });
    }
    within("three calls inside", 10, async {
        while entered.load(Ordering::SeqCst) < 3 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    println!("held");
    std::future::pending::<()>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateway_frees_its_slots_within_a_lease() {
    let server = RedisServer::start();
    let prefix = support::unique_prefix("dead");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "in_flight::dead_gateway_child",
            "--ignored",
            "--nocapture",
        ])
        .env("TOLLWAY_CHILD_REDIS", server.url())
        .env("TOLLWAY_CHILD_PREFIX", &prefix)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let held = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line == "held")
    });
    assert!(within("the child's calls", 60, held).await.unwrap());

    let store = RedisStore::builder()
        .prefix(prefix)
        .connect(&server.url())
        .await
        .unwrap();
    let policy = streams();
    let left = || async {
        store
            .operate(b"global:", &[&policy], Operation::Peek(0))
            .await
            .unwrap()[0]
            .remaining()
    };
    // Held, and kept past a lease by the child's renewals.
    assert_eq!(left().await, 2);
    tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
    assert_eq!(left().await, 2, "the living gateway renews its slots");

    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    within("the dead gateway's slots", 10, async {
        while left().await < 5 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let freed = killed.elapsed();
    println!("the dead gateway's slots were free {freed:?} after the kill");
    // Its last renewal was at most a third of a lease before the kill.
    assert!(freed <= LEASE + Duration::from_millis(500), "{freed:?}");
    assert!(
        freed >= LEASE * 2 / 3 - Duration::from_millis(100),
        "{freed:?}"
    );
}
