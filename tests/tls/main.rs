//! The Redis store over TLS (`rediss://`) and with credentials in the URL, against real
//! `redis-server` processes: a test CA and a server certificate for 127.0.0.1 are made
//! at test time, and the client verifies the server against that CA; a Redis Cluster
//! that speaks only TLS, the same way; and a primary found through a TLS sentinel.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use tollway_core::{
    Algorithm, ManualClock, Policy, Quota, RedisStore, RedisStoreBuilder, StoreError,
};

use support::cluster::RedisCluster;
use support::stores::EPOCH_US;
use support::tls::TestCa;
use support::{CheckOne, RedisServer};

/// Exact decisions: the caller's manual clock, no local deny cache, room for a slow CI
/// machine's handshakes.
fn builder(clock: &ManualClock) -> RedisStoreBuilder {
    support::redis_store()
        .without_local_fallback()
        .prefix("tls-test")
        .timeout(Duration::from_secs(5))
        .caller_time(clock.clone())
        .deny_cache(0)
}

/// Two a minute: allowed, allowed, denied for 30 s, then allowed again.
async fn decides_exactly(store: &RedisStore, clock: &ManualClock) {
    let policy = Policy::new("two", Algorithm::Gcra, Quota::per_minute(2).unwrap()).unwrap();
    let first = store.check_one(b"alice", &policy, 1).await.unwrap();
    assert!(first.is_allowed(), "{first:?}");
    assert_eq!(first.remaining(), 1, "{first:?}");
    let second = store.check_one(b"alice", &policy, 1).await.unwrap();
    assert!(second.is_allowed(), "{second:?}");
    assert_eq!(second.remaining(), 0, "{second:?}");
    let third = store.check_one(b"alice", &policy, 1).await.unwrap();
    assert!(!third.is_allowed(), "{third:?}");
    assert_eq!(third.retry_after_micros(), 30_000_000, "{third:?}");
    // Another key has its own state.
    assert!(
        store
            .check_one(b"bob", &policy, 1)
            .await
            .unwrap()
            .is_allowed()
    );
    clock.advance(Duration::from_secs(30));
    let later = store.check_one(b"alice", &policy, 1).await.unwrap();
    assert!(later.is_allowed(), "{later:?}");
}

/// The connection error, which must come well within the store's timeout.
async fn connect_error(builder: RedisStoreBuilder, url: &str) -> StoreError {
    builder
        .timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .expect_err("the connection should be refused")
}

#[tokio::test]
async fn a_password_in_the_url_authenticates() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let clock = ManualClock::at_micros(EPOCH_US);
    let url = format!("redis://:s3cret@127.0.0.1:{}", server.port());
    let store = builder(&clock).connect(&url).await.unwrap();
    decides_exactly(&store, &clock).await;
}

#[tokio::test]
async fn an_acl_user_and_password_in_the_url_authenticate() {
    let server = RedisServer::start_with(&[
        "--user",
        "gateway",
        "on",
        ">gw-pass",
        "~tls-test:*",
        "+@all",
    ]);
    let clock = ManualClock::at_micros(EPOCH_US);
    let url = format!("redis://gateway:gw-pass@127.0.0.1:{}", server.port());
    let store = builder(&clock).connect(&url).await.unwrap();
    decides_exactly(&store, &clock).await;
}

#[tokio::test]
async fn a_wrong_password_is_a_clear_connection_error() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let clock = ManualClock::at_micros(EPOCH_US);
    let url = format!("redis://:wrong@127.0.0.1:{}", server.port());
    let error = connect_error(builder(&clock), &url).await;
    let message = error.to_string();
    assert!(
        message.contains("could not connect to Redis")
            && message.contains("Password authentication failed"),
        "{message}"
    );
}

#[tokio::test]
async fn rediss_verifies_the_server_against_the_given_ca() {
    let ca = TestCa::new("tollway test CA");
    let server = RedisServer::start_tls(&ca.server_files(), &[]);
    assert!(server.url().starts_with("rediss://127.0.0.1:"));
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = builder(&clock)
        .tls_root_certificate(ca.pem().as_bytes())
        .connect(&server.url())
        .await
        .unwrap();
    decides_exactly(&store, &clock).await;

    // The state is in that server, read over another TLS connection.
    let policy = Policy::new("two", Algorithm::Gcra, Quota::per_minute(2).unwrap()).unwrap();
    let key = store.state_key(b"alice", &policy);
    let ca_pem = server.tls_ca().unwrap().as_bytes().to_vec();
    let certificates = redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(ca_pem),
    };
    let mut con = redis::Client::build_with_tls(server.url(), certificates)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let exists: bool = redis::cmd("EXISTS")
        .arg(&key)
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(exists, "{key}");
}

#[tokio::test]
async fn rediss_refuses_a_server_signed_by_another_ca() {
    let ca = TestCa::new("tollway test CA");
    let other = TestCa::new("some other CA");
    let server = RedisServer::start_tls(&ca.server_files(), &[]);
    let clock = ManualClock::at_micros(EPOCH_US);
    let error = connect_error(
        builder(&clock).tls_root_certificate(other.pem().as_bytes()),
        &server.url(),
    )
    .await;
    let message = error.to_string();
    assert!(
        message.contains("could not connect to Redis") && message.contains("UnknownIssuer"),
        "{message}"
    );
}

#[tokio::test]
async fn rediss_with_a_password() {
    let ca = TestCa::new("tollway test CA");
    let server = RedisServer::start_tls(&ca.server_files(), &["--requirepass", "s3cret"]);
    let clock = ManualClock::at_micros(EPOCH_US);
    let url = format!("rediss://:s3cret@127.0.0.1:{}", server.port());
    let store = builder(&clock)
        .tls_root_certificate(ca.pem())
        .connect(&url)
        .await
        .unwrap();
    decides_exactly(&store, &clock).await;

    let error = connect_error(
        builder(&clock).tls_root_certificate(ca.pem()),
        &format!("rediss://:wrong@127.0.0.1:{}", server.port()),
    )
    .await;
    assert!(
        error.to_string().contains("Password authentication failed"),
        "{error}"
    );
}

#[tokio::test]
async fn a_root_certificate_needs_a_rediss_url() {
    let ca = TestCa::new("tollway test CA");
    let clock = ManualClock::at_micros(EPOCH_US);
    let error = connect_error(
        builder(&clock).tls_root_certificate(ca.pem()),
        "redis://127.0.0.1:1",
    )
    .await;
    assert!(error.to_string().contains("rediss://"), "{error}");
}

/// A cluster that speaks only TLS (clients, replication, the cluster bus): the store
/// learns the slot map over `rediss://`, verifies every node it is sent to against the
/// given CA, and decides on all three masters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_is_verified_against_the_given_ca_on_every_node() {
    let ca = TestCa::new("tollway test CA");
    let cluster = RedisCluster::start_tls(&ca.server_files()).await;
    let urls = cluster.urls();
    assert!(urls.iter().all(|u| u.starts_with("rediss://")), "{urls:?}");
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let clock = ManualClock::at_micros(EPOCH_US);
    // Through one node: the others are learned from its slot map.
    let store = builder(&clock)
        .tls_root_certificate(ca.pem().as_bytes())
        .connect_cluster(&urls[..1])
        .await
        .unwrap();
    decides_exactly(&store, &clock).await;
    let policy = Policy::new(
        "spread",
        Algorithm::TokenBucket,
        Quota::per_minute(5).unwrap(),
    )
    .unwrap();
    let callers: Vec<String> = (0..24).map(|c| format!("caller-{c}")).collect();
    for caller in &callers {
        let decision = store
            .check_one(caller.as_bytes(), &policy, 1)
            .await
            .unwrap();
        assert!(
            decision.is_allowed() && decision.remaining() == 4,
            "{decision:?}"
        );
    }
    let keys: Vec<String> = callers
        .iter()
        .map(|c| store.state_key(c.as_bytes(), &policy))
        .collect();
    cluster.assert_on_every_master(&keys).await;

    // A CA that did not sign the nodes' certificates is refused.
    let other = TestCa::new("some other CA");
    let error = builder(&clock)
        .timeout(Duration::from_secs(5))
        .tls_root_certificate(other.pem().as_bytes())
        .connect_cluster(&urls)
        .await
        .expect_err("no node should be trusted");
    let message = error.to_string();
    assert!(
        message.contains("could not connect to the Redis Cluster")
            && message.contains("UnknownIssuer"),
        "{message}"
    );
}

#[tokio::test]
async fn a_root_certificate_needs_rediss_urls_for_every_cluster_node() {
    let ca = TestCa::new("tollway test CA");
    let clock = ManualClock::at_micros(EPOCH_US);
    let error = builder(&clock)
        .tls_root_certificate(ca.pem())
        .connect_cluster(&["rediss://127.0.0.1:1", "redis://127.0.0.1:2"])
        .await
        .expect_err("a plain node URL with a root certificate");
    let message = error.to_string();
    assert!(
        message.contains("rediss://") && message.contains("tls_root_certificate"),
        "{message}"
    );
}

/// Through Sentinel, TLS end to end: the sentinel speaks only TLS (`rediss://` in its
/// URL) and reaches the primary over TLS; the store asks it over TLS, then reaches the
/// primary over TLS (`Sentinel::tls`), with its password, both verified against the
/// test CA. Without `tls`, the primary (TLS only) cannot be reached: a clear error.
#[tokio::test]
async fn a_primary_found_through_sentinel_over_tls() {
    use tollway_core::Sentinel;

    let ca = TestCa::new("tollway test CA");
    let files = ca.server_files();
    let primary = RedisServer::start_tls(&files, &["--requirepass", "s3cret"]);
    let sentinel = RedisServer::start_sentinel_tls(
        &files,
        &format!(
            "sentinel resolve-hostnames no\nsentinel announce-ip 127.0.0.1\n\
             sentinel monitor tw 127.0.0.1 {} 1\nsentinel auth-pass tw s3cret",
            primary.port()
        ),
    );
    assert!(sentinel.url().starts_with("rediss://127.0.0.1:"));
    let clock = ManualClock::at_micros(EPOCH_US);
    let found = Sentinel::new("tw", [sentinel.url()]).password("s3cret");
    let store = builder(&clock)
        .tls_root_certificate(ca.pem())
        .connect_sentinel(&found.clone().tls())
        .await
        .unwrap();
    decides_exactly(&store, &clock).await;

    let error = builder(&clock)
        .tls_root_certificate(ca.pem())
        .connect_sentinel(&found)
        .await
        .expect_err("a TLS primary reached without TLS");
    assert!(
        error
            .to_string()
            .contains("no primary found through Redis Sentinel"),
        "{error}"
    );
    assert!(
        !format!("{error} {error:?}").contains("s3cret"),
        "{error:?}"
    );
}
