//! Who the caller is: forwarding headers, API keys, the fallback chain.

use std::collections::HashMap;

use axum::http::StatusCode;
use support::http::{Hits, serve};
use support::stores::{EPOCH_US, memory_store, per_minute};
use tollway_core::ManualClock;
use tollway_tower::config::LimitsFile;
use tollway_tower::{
    ApiKey, ClientIp, Fallback, ForwardedHeader, Key, KeyExtractor, PeerIp, RateLimitLayer,
};

use super::admitted;

/// Finding 1: behind a proxy that writes `X-Forwarded-For`, a client added a
/// `Forwarded: for=<random>` of its own and got 60 of 60 through a 20/min limit, since
/// `Forwarded` was preferred. Only the header the proxy writes is read now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_choose_its_key_with_a_header_the_proxy_does_not_write() {
    let key = ClientIp::new(ForwardedHeader::XForwardedFor, ["127.0.0.1"]).unwrap();
    let server = limited(key, 20).await;
    let client = server.client();
    let mut replies = Vec::new();
    for i in 0..60 {
        let forged = format!("for=198.18.{}.{}", i / 250, i % 250);
        let forged_xff = format!("198.19.0.{i}");
        // The proxy appends the client's real address; the client's forgeries ride along.
        let xff = format!("{forged_xff}, 203.0.113.5");
        let headers = [
            ("forwarded", forged.as_str()),
            ("x-real-ip", forged_xff.as_str()),
            ("x-forwarded-for", xff.as_str()),
        ];
        replies.push(client.get_with("/", &headers).await);
    }
    assert_eq!(admitted(&replies), 20);

    // The same with a proxy that writes X-Real-IP, and a client that adds
    // X-Forwarded-For.
    let key = ClientIp::new(ForwardedHeader::XRealIp, ["127.0.0.1"]).unwrap();
    let server = limited(key, 20).await;
    let client = server.client();
    let mut replies = Vec::new();
    for i in 0..60 {
        let forged = format!("198.18.0.{i}");
        let headers = [
            ("x-forwarded-for", forged.as_str()),
            ("x-real-ip", "203.0.113.5"),
        ];
        replies.push(client.get_with("/", &headers).await);
    }
    assert_eq!(admitted(&replies), 20);
}

/// Finding 1, with the proxies counted rather than recognised: a CDN (any address) in
/// front of the load balancer (the test's client, from 127.0.0.1). Whatever a client
/// writes to the left, the entry the CDN wrote for it is its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_behind_counted_proxies_cannot_choose_its_key() {
    let key = ClientIp::new(ForwardedHeader::XForwardedFor, ["127.0.0.1"])
        .unwrap()
        .trusted_hops(2)
        .unwrap();
    let server = limited(key, 20).await;
    let client = server.client();
    let mut replies = Vec::new();
    for i in 0..60 {
        // The client's forgeries, the client by the CDN, the CDN by the balancer (a
        // different CDN edge each time).
        let xff = format!("198.18.0.{i}, 198.19.0.{i}, 203.0.113.5, 192.0.2.{i}");
        replies.push(
            client
                .get_with("/", &[("x-forwarded-for", xff.as_str())])
                .await,
        );
    }
    assert_eq!(admitted(&replies), 20);
}

/// Finding 4: keyed by a raw `X-API-Key`, a new random key per request got 200 of 200
/// through. Only issued keys are keys now; any other is the caller's address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_random_api_key_per_request_is_still_the_same_caller() {
    let issued = HashMap::from([("demo-pro-key".to_owned(), "pro".to_owned())]);
    let key = ApiKey::header("x-api-key")
        .unwrap()
        .known(issued)
        .or(PeerIp::new());
    let server = limited(key, 20).await;
    let client = server.client();
    let mut replies = Vec::new();
    for i in 0..200 {
        let random = format!("made-up-{i}");
        replies.push(
            client
                .get_with("/", &[("x-api-key", random.as_str())])
                .await,
        );
    }
    assert_eq!(admitted(&replies), 20);
    // The issued key is its own caller.
    let pro = client.get_with("/", &[("x-api-key", "demo-pro-key")]).await;
    assert_eq!(admitted(&[pro]), 1);
}

/// Finding 5: callers without a key fell back to the socket peer — behind a proxy, the
/// proxy's one bucket for all of them. The fallback is the chain the user writes now:
/// here the API key, else the client's address behind the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_callers_behind_a_proxy_fall_back_to_their_own_address() {
    let issued = HashMap::from([("demo-free-key".to_owned(), "free".to_owned())]);
    let key = ApiKey::header("x-api-key")
        .unwrap()
        .known(issued)
        .or(ClientIp::new(ForwardedHeader::XForwardedFor, ["127.0.0.1"]).unwrap());
    let server = limited(key, 5).await;
    let client = server.client();
    // Two keyless clients behind the proxy: five each, not five together.
    let mut replies = Vec::new();
    for client_ip in ["203.0.113.1", "203.0.113.2"] {
        for _ in 0..8 {
            replies.push(
                client
                    .get_with("/", &[("x-forwarded-for", client_ip)])
                    .await,
            );
        }
    }
    assert_eq!(admitted(&replies), 10);
}

/// Finding 9: `Forwarded: for=unknown`, an empty `Forwarded`, or a byte that is not ASCII
/// in the client's part of `X-Forwarded-For` made every such caller the proxy — charging
/// the proxy's own limit — and a chain of 10,000 hops was parsed whole. Now: garbage the
/// client wrote left of its real entry changes nothing; a client the proxy cannot name
/// has no address, and such callers share one limit of their own (or go to the
/// fallback), never the proxy's; and at most 32 entries are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_unknowns_in_forwarding_headers_do_not_lift_the_limit() {
    // Non-ASCII in the client's part: its real address is still read.
    let key = ClientIp::new(ForwardedHeader::XForwardedFor, ["127.0.0.1"]).unwrap();
    let server = limited(key, 5).await;
    let client = server.client();
    let mut replies = Vec::new();
    for i in 0..10 {
        // Latin-1 bytes, then the address the proxy appended.
        let value = format!("caf\u{e9}-{i}, 203.0.113.9");
        let bytes = value.chars().map(|c| c as u8).collect::<Vec<u8>>();
        let value = String::from_utf8_lossy(&bytes).into_owned();
        replies.push(
            client
                .get_with("/", &[("x-forwarded-for", value.as_str())])
                .await,
        );
    }
    assert_eq!(admitted(&replies), 5, "one caller: 203.0.113.9");
    // The proxy's own requests (no header) were not charged for them.
    assert_eq!(admitted(&[client.get("/").await]), 1, "the proxy paid");

    // Unknown clients (`for=unknown`, obfuscated, no `for`, an empty element) share one
    // limit under the default `MissingKey::Shared`.
    let key = ClientIp::new(ForwardedHeader::Forwarded, ["127.0.0.1"]).unwrap();
    let server = limited(key, 5).await;
    let client = server.client();
    let mut replies = Vec::new();
    for forwarded in ["for=unknown", "for=_hidden", "proto=https", "for=\"\"", ","] {
        for _ in 0..2 {
            replies.push(client.get_with("/", &[("forwarded", forwarded)]).await);
        }
    }
    assert_eq!(admitted(&replies), 5);
    assert_eq!(admitted(&[client.get("/").await]), 1, "the proxy paid");

    // A 60 KB chain of 5,000 hops, all but the first the trusted proxy: nobody named the
    // client within 32 hops, so these callers share the unknowns' limit too.
    let hops = std::iter::repeat_n("for=127.0.0.1", 5_000)
        .collect::<Vec<_>>()
        .join(",");
    let mut replies = Vec::new();
    for i in 0..3 {
        let chain = format!("for=198.18.0.{i},{hops}");
        replies.push(client.get_with("/", &[("forwarded", chain.as_str())]).await);
    }
    assert_eq!(admitted(&replies), 0, "the shared limit is spent");
}

/// Finding 11: a trusted network written as IPv4-mapped IPv6 (`::ffff:127.0.0.0/104`)
/// parsed and matched nothing, so the proxy's header was never believed and every client
/// behind it shared the proxy's limit. It means 127.0.0.0/8 now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv4_mapped_trusted_network_trusts_the_ipv4_proxy() {
    let key = ClientIp::new(ForwardedHeader::XForwardedFor, ["::ffff:127.0.0.0/104"]).unwrap();
    let server = limited(key, 5).await;
    let client = server.client();
    let mut replies = Vec::new();
    for client_ip in ["203.0.113.1", "203.0.113.2", "203.0.113.3"] {
        for _ in 0..5 {
            replies.push(
                client
                    .get_with("/", &[("x-forwarded-for", client_ip)])
                    .await,
            );
        }
    }
    assert_eq!(admitted(&replies), 15, "three clients, five each");
}

/// Issue 34: `deny_keys = ["ip:<addr>"]` was skipped whenever the caller also sent a
/// known API key (5 of 5 served), since the list was matched against the one key the
/// chain limited by. Now every key the chain knows the caller by is matched: the API
/// key and the address, through the builder and through a limits file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_on_the_deny_list_is_refused_whatever_api_key_it_sends() {
    let issued = HashMap::from([("demo-pro-key".to_owned(), "pro".to_owned())]);
    let clock = ManualClock::at_micros(EPOCH_US);
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("attacked", 20))
        .key(
            ApiKey::header("x-api-key")
                .unwrap()
                .known(issued)
                .or(PeerIp::new()),
        )
        .deny_key(Key::new("ip", "127.0.0.1"))
        .build()
        .unwrap();
    let hits = Hits::default();
    let server = serve(layer, &hits).await;
    let client = server.client();
    for api_key in [None, Some("demo-pro-key"), Some("made-up")] {
        let headers: Vec<_> = api_key.map(|k| ("x-api-key", k)).into_iter().collect();
        for _ in 0..5 {
            let reply = client.get_with("/", &headers).await;
            assert_eq!(reply.status, StatusCode::FORBIDDEN, "{api_key:?}");
        }
    }
    assert_eq!(hits.get(), 0);

    // The same through a limits file, keyed as the axum example keys: known API keys,
    // else the peer.
    let file = LimitsFile::parse(
        "limits.toml",
        r#"
[layer]
default = "anonymous"

[key]
api_key = { header = "x-api-key", only_known = true }

[policies.anonymous]
algorithm = "gcra"
limit = 20
period = "1m"

[policies.pro]
algorithm = "gcra"
limit = 1000
period = "1m"

[tiers]
"demo-pro-key" = "pro"

[lists]
deny_keys = ["ip:127.0.0.1"]
"#,
    )
    .unwrap();
    let layer = file
        .layer(memory_store(&clock), file.key().unwrap())
        .unwrap();
    let server = serve(layer, &hits).await;
    let client = server.client();
    for _ in 0..5 {
        let reply = client.get_with("/", &[("x-api-key", "demo-pro-key")]).await;
        assert_eq!(reply.status, StatusCode::FORBIDDEN);
    }
    assert_eq!(hits.get(), 0);
}

/// Serves `routes` behind a layer over a memory store: `per_minute` (`limit`) keyed by
/// `key`, on a manual clock that does not move.
async fn limited<K>(key: K, limit: u32) -> support::http::Server
where
    K: KeyExtractor<axum::body::Body>,
{
    let clock = ManualClock::at_micros(EPOCH_US);
    let layer = RateLimitLayer::builder(memory_store(&clock), per_minute("attacked", limit.into()))
        .key(key)
        .wall_clock(clock)
        .build()
        .unwrap();
    serve(layer, &Hits::default()).await
}
