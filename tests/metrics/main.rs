//! The axum example's `/metrics`, scraped over real HTTP after a scripted sequence of
//! requests: the counts are exactly the decisions made, enforcing and in shadow mode.
//!
//! A binary of its own: the Prometheus recorder is process-wide, and no other test may
//! add to its counts.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use http::{Method, StatusCode};
use metrics_exporter_prometheus::PrometheusBuilder;
use std::time::Duration;
use support::http::{Client, Server};
use support::stores::{EPOCH_US, memory_store};

use support::CheckOne;
use tollway_core::{BreakerState, CircuitBreaker, ManualClock};
use tollway_tower::BoxStore;

const ADMIN: (&str, &str) = ("authorization", "Bearer test-admin");

/// The decision counts in a scrape: `tollway_decisions_total` by its labels.
fn decisions(scrape: &str) -> BTreeMap<String, u64> {
    scrape
        .lines()
        .filter_map(|line| line.strip_prefix("tollway_decisions_total"))
        .filter_map(|rest| {
            let (labels, count) = rest.rsplit_once(' ')?;
            Some((labels.to_owned(), count.parse().ok()?))
        })
        .collect()
}

/// How much each count grew from `before` to `after` (counts that did not grow left out).
fn grown(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(labels, n)| (labels.clone(), n - before.get(labels).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// 30 requests: 25 anonymous (the limit is 20 a minute, so 5 are refused), 2 from a
/// Free key, 2 from the partner on the allow list, 1 from the key on the deny list.
/// Returns how many of each status came back.
async fn scripted_sequence(client: &Client) -> BTreeMap<u16, u32> {
    let mut statuses = BTreeMap::new();
    let mut sent = Vec::new();
    for _ in 0..25 {
        sent.push(client.get("/").await.status);
    }
    for key in [
        "demo-free-key",
        "demo-free-key",
        "demo-partner-key",
        "demo-partner-key",
        "demo-banned-key",
    ] {
        sent.push(client.get_with("/", &[("x-api-key", key)]).await.status);
    }
    assert_eq!(sent.len(), 30);
    for status in sent {
        *statuses.entry(status.as_u16()).or_insert(0) += 1;
    }
    statuses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_counts_every_decision_in_its_metrics() {
    let metrics = PrometheusBuilder::new().install_recorder().unwrap();
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = BoxStore::new(memory_store(&clock));
    let (app, _limits) = demo::axum_app::app(
        std::path::Path::new(demo::axum_app::DEFAULT_CONFIG),
        store,
        metrics,
        &demo::axum_app::Doors {
            admin_token: Some("test-admin".to_owned()),
            lab: false,
            ..Default::default()
        },
    )
    .unwrap();
    let server = Server::start(app).await;
    let client = server.client();

    // Enforcing: 5 refused with 429, 1 forbidden.
    let before = decisions(&client.get("/metrics").await.body);
    let statuses = scripted_sequence(&client).await;
    assert_eq!(statuses, BTreeMap::from([(200, 24), (403, 1), (429, 5)]));
    let after = decisions(&client.get("/metrics").await.body);
    assert_eq!(
        grown(&before, &after),
        BTreeMap::from([
            (r#"{policy="anonymous",outcome="allowed"}"#.to_owned(), 20),
            (r#"{policy="anonymous",outcome="limited"}"#.to_owned(), 5),
            (r#"{policy="free",outcome="allowed"}"#.to_owned(), 2),
            (r#"{outcome="allow_listed"}"#.to_owned(), 2),
            (r#"{outcome="deny_listed"}"#.to_owned(), 1),
        ]),
        "{after:?}"
    );

    // Shadow mode for the whole layer, the callers back to fresh: the same sequence gets
    // no 429, and the metrics show the 5 that would have been refused.
    let admin = [ADMIN];
    let shadow = client
        .send_body(Method::PUT, "/admin/shadow/all", &admin, "on".into())
        .await;
    assert_eq!(shadow.status, StatusCode::NO_CONTENT);
    for (policy, key) in [("anonymous", "ip:127.0.0.1"), ("free", "key:demo-free-key")] {
        let path = format!("/admin/limits/{policy}/{key}");
        assert_eq!(
            client.send(Method::DELETE, &path, &admin).await.status,
            StatusCode::OK
        );
    }
    let before = after;
    let statuses = scripted_sequence(&client).await;
    assert_eq!(statuses, BTreeMap::from([(200, 29), (403, 1)]));
    let after = decisions(&client.get("/metrics").await.body);
    assert_eq!(
        grown(&before, &after),
        BTreeMap::from([
            // The three admin requests, through the admin API's own limit.
            (r#"{policy="admin",outcome="allowed"}"#.to_owned(), 3),
            (r#"{policy="anonymous",outcome="allowed"}"#.to_owned(), 20),
            (
                r#"{policy="anonymous",outcome="shadow_limited"}"#.to_owned(),
                5
            ),
            (r#"{policy="free",outcome="allowed"}"#.to_owned(), 2),
            (r#"{outcome="allow_listed"}"#.to_owned(), 2),
            (r#"{outcome="deny_listed"}"#.to_owned(), 1),
        ]),
        "{after:?}"
    );
    // The memory store's own metric is there too.
    let scrape = client.get("/metrics").await.body;
    assert!(scrape.contains("tollway_memory_store_keys 2"), "{scrape}");
    // The file's load shedder: its limit, and the calls in flight (none now) of the
    // priorities the sequence used: free keys, and anonymous callers (other).
    assert!(scrape.contains("tollway_shed_limit 20\n"), "{scrape}");
    for priority in ["free", "other"] {
        let line = format!("tollway_shed_in_flight{{priority=\"{priority}\"}} 0\n");
        assert!(scrape.contains(&line), "{line} in {scrape}");
    }

    // The same application on Redis: its calls are timed by store kind, and a flood of
    // refusals from one caller is answered by the deny cache, which counts its hits.
    let redis = BoxStore::new(support::stores::redis_store(&clock).await);
    let metrics = PrometheusBuilder::new().build_recorder().handle();
    let (app, _limits) = demo::axum_app::app(
        std::path::Path::new(demo::axum_app::DEFAULT_CONFIG),
        redis,
        metrics,
        &demo::axum_app::Doors {
            admin_token: Some("test-admin".to_owned()),
            lab: false,
            ..Default::default()
        },
    )
    .unwrap();
    let on_redis = Server::start(app).await;
    let redis_client = on_redis.client();
    let mut refused = 0;
    for _ in 0..30 {
        if redis_client.get("/").await.status == StatusCode::TOO_MANY_REQUESTS {
            refused += 1;
        }
    }
    assert_eq!(refused, 10);
    let scrape = client.get("/metrics").await.body;
    let line = |prefix: &str| {
        scrape
            .lines()
            .find_map(|l| l.strip_prefix(prefix)?.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {prefix} in {scrape}"))
    };
    // 20 admitted and 1 refused by a script call; the other 9 refusals from the cache.
    assert_eq!(
        line(r#"tollway_store_duration_seconds_count{store="redis"}"#),
        21.0
    );
    assert_eq!(line("tollway_deny_cache_hits_total"), 9.0);

    // Regression: the breaker's gauge had no label, so two stores wrote one series and
    // the last state change hid the other. Each breaker's carries its store's name.
    let mut dead = support::RedisServer::start();
    let redis = support::redis_store()
        .timeout(Duration::from_millis(200))
        .without_breaker()
        .without_local_fallback()
        .connect(&dead.url())
        .await
        .unwrap();
    dead.kill();
    let policy = support::stores::per_minute("p", 10);
    for name in ["sessions", "checkout"] {
        let store = CircuitBreaker::builder(redis.clone())
            .threshold(1)
            .name(name)
            .build()
            .unwrap();
        assert!(store.check_one(b"k", &policy, 1).await.is_err());
        assert_eq!(store.state(), BreakerState::Open);
    }
    let scrape = client.get("/metrics").await.body;
    for name in ["sessions", "checkout"] {
        let series = format!("tollway_breaker_state{{store=\"{name}\"}} 2");
        assert!(
            scrape.lines().any(|l| l == series),
            "no {series} in {scrape}"
        );
    }
}
