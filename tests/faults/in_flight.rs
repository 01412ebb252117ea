//! A gateway killed with calls in flight: its slots free themselves within one lease.
//!
//! The gateway is a process of its own: this test binary run again on this one test,
//! with the Redis to use in its environment. There it is the gateway: it serves three
//! calls that never end through the tower layer over Redis, says so on its stdout, and
//! is then killed (`SIGKILL`: nothing is given back). Its slots were renewed every third
//! of the 2 s lease while it lived.
//!
//! Real time passes here, as elsewhere in this binary: a killed process cannot share a
//! manual clock, and Redis expires by its own `TIME`. The test waits for conditions
//! (the first lease over on Redis's clock, the slots free), never a fixed time.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateway_frees_its_slots_within_a_lease() {
    if let (Ok(url), Ok(prefix)) = (
        std::env::var("TOLLWAY_CHILD_REDIS"),
        std::env::var("TOLLWAY_CHILD_PREFIX"),
    ) {
        return gateway_with_calls_in_flight(url, prefix).await;
    }
    let server = RedisServer::start();
    let prefix = support::unique_prefix("dead");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "in_flight::a_killed_gateway_frees_its_slots_within_a_lease",
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

    let store = support::redis_store()
        .prefix(prefix)
        .timeout(Duration::from_secs(30))
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
    // Held, and kept past their first lease (on Redis's clock) by the child's renewals.
    let mut node = server.connection().await;
    let first_lease_ends = redis_now(&mut node).await + LEASE;
    assert_eq!(left().await, 2);
    within("the first lease's end", 10, async {
        while redis_now(&mut node).await <= first_lease_ends {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert_eq!(left().await, 2, "the living gateway renews its slots");

    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    within("the dead gateway's slots", 10, async {
        while left().await < 5 {
            tokio::task::yield_now().await;
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

/// The gateway, in the child process: three calls in flight, held by a handler that
/// never answers, on the Redis at `url` under `prefix`.
async fn gateway_with_calls_in_flight(url: String, prefix: String) {
    let store = support::redis_store()
        .prefix(prefix)
        .timeout(Duration::from_secs(30))
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

/// Redis's own clock (`TIME`).
async fn redis_now(node: &mut redis::aio::MultiplexedConnection) -> Duration {
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(node).await.unwrap();
    Duration::from_secs(s) + Duration::from_micros(us)
}
