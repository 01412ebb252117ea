//! Tiers looked up at run time, at the service on a paused clock: a slow lookup waited
//! for once and cached, a failing one handled by its rule, unknown keys sharing one
//! budget.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::time::Instant;
use tollway_core::{Calendar, CalendarUnit, ManualClock, Policy, Quota};
use tollway_tower::{ApiKey, Key, OnLookupError, Plan, RateLimitLayer, ResponseBody};
use tower::{Layer, ServiceExt, service_fn};

use support::stores::{EPOCH_US, memory_store, per_minute};

type Reply = Response<ResponseBody<String>>;

/// A request from 203.0.113.9 with `X-API-Key: key`.
fn request(key: &str) -> Request<()> {
    let mut request = Request::get("/").header("x-api-key", key).body(()).unwrap();
    let peer: SocketAddr = "203.0.113.9:4000".parse().unwrap();
    request.extensions_mut().insert(peer);
    request
}

/// Sends one request through a fresh service of `layer`.
async fn send<K>(
    layer: &RateLimitLayer<tollway_core::MemoryStore<ManualClock>, K>,
    key: &str,
) -> Reply
where
    K: tollway_tower::KeyExtractor<()>,
{
    let service = layer.layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new("ok".to_owned()))
    }));
    service.oneshot(request(key)).await.unwrap()
}

fn limit(reply: &Reply) -> Option<&str> {
    header(reply, "x-ratelimit-limit")
}

fn header<'r>(reply: &'r Reply, name: &str) -> Option<&'r str> {
    reply.headers().get(name).map(|v| v.to_str().unwrap())
}

fn layer_with(
    lookup: impl tollway_tower::TierLookup,
    rule: OnLookupError,
) -> RateLimitLayer<tollway_core::MemoryStore<ManualClock>, ApiKey> {
    let clock = ManualClock::at_micros(EPOCH_US);
    let pro: Policy = per_minute("pro", 1_000);
    RateLimitLayer::builder(memory_store(&clock), per_minute("anonymous", 100))
        .key(ApiKey::header("x-api-key").unwrap())
        .tier(pro)
        .tier_lookup(lookup)
        .tier_cache(100_000, Duration::from_secs(60))
        .tier_lookup_timeout(Duration::from_secs(5))
        .on_tier_lookup_error(rule)
        .build()
        .unwrap()
}

/// The lookup takes 2 s: the first request waits for it; the next is answered from the
/// cache at once; after the cache's 60 s the key is looked up again.
#[tokio::test(start_paused = true)]
async fn a_slow_lookup_is_waited_for_once_then_cached_until_its_ttl() {
    let lookups = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&lookups);
    let layer = layer_with(
        move |key: Key| {
            let counted = Arc::clone(&counted);
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(2)).await;
                let tier = (key.value() == b"k-pro").then(|| "pro".to_owned());
                Ok::<_, std::io::Error>(tier)
            }
        },
        OnLookupError::Anonymous,
    );
    let start = Instant::now();
    let first = send(&layer, "k-pro").await;
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(limit(&first), Some("1000"));
    let second = send(&layer, "k-pro").await;
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(limit(&second), Some("1000"));
    assert_eq!(lookups.load(Ordering::SeqCst), 1);

    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(limit(&send(&layer, "k-pro").await), Some("1000"));
    assert_eq!(lookups.load(Ordering::SeqCst), 2);
}

/// A lookup that fails: by default the caller is limited as unknown (the anonymous
/// budget) and asked about again next time; with `Reject`, 503 and the JSON body.
#[tokio::test(start_paused = true)]
async fn a_failing_lookup_follows_its_rule() {
    let lookups = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&lookups);
    let failing = move |_: Key| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Err::<Option<String>, _>(std::io::Error::other("database down")) }
    };
    let anonymous = layer_with(failing.clone(), OnLookupError::Anonymous);
    for _ in 0..3 {
        let reply = send(&anonymous, "k-pro").await;
        assert_eq!(reply.status(), StatusCode::OK);
        assert_eq!(limit(&reply), Some("100"));
    }
    assert_eq!(lookups.load(Ordering::SeqCst), 3);

    let reject = layer_with(failing, OnLookupError::Reject);
    let refused = send(&reject, "k-pro").await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = http_body_util::BodyExt::collect(refused.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(
        body,
        r#"{"error":"Service Unavailable","message":"Rate limiting cannot tell this caller's tier now. Please retry later."}"#
    );
}

/// 10,000 made-up keys, none of which the lookup knows, share one anonymous budget of
/// 100: exactly 100 requests pass.
#[tokio::test(start_paused = true)]
async fn ten_thousand_unknown_keys_share_one_anonymous_budget() {
    let layer = layer_with(
        |_: Key| async { Ok::<Option<String>, std::io::Error>(None) },
        OnLookupError::Anonymous,
    );
    let mut passed = 0;
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for _ in 0..10_000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let reply = send(&layer, &format!("made-up-{seed:016x}")).await;
        if reply.status() == StatusCode::OK {
            passed += 1;
        }
    }
    assert_eq!(passed, 100);
}

/// A cache kept "forever" is refused when the layer is built, not a panic.
#[test]
fn a_cache_time_to_live_beyond_reason_is_a_configuration_error() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let err = RateLimitLayer::builder(memory_store(&clock), per_minute("anonymous", 1))
        .tier_lookup(|_: Key| async { Ok::<Option<String>, std::io::Error>(None) })
        .tier_cache(10, Duration::MAX)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("at most 100 years"), "{err}");
}

/// A lookup that does not answer within the layer's bound (5 s here) fails: the caller
/// is limited as unknown, after exactly the bound.
#[tokio::test(start_paused = true)]
async fn a_lookup_that_hangs_fails_at_its_timeout() {
    let layer = layer_with(
        |_: Key| async {
            tokio::time::sleep(Duration::from_secs(3_600)).await;
            Ok::<_, std::io::Error>(Some("pro".to_owned()))
        },
        OnLookupError::Anonymous,
    );
    let start = Instant::now();
    let reply = send(&layer, "k-pro").await;
    assert_eq!(start.elapsed(), Duration::from_secs(5));
    assert_eq!(reply.status(), StatusCode::OK);
    assert_eq!(limit(&reply), Some("100"));
}

/// 50 requests of one caller arriving together while its tier is looked up wait for the
/// same lookup: one call, and every request limited by its answer.
#[tokio::test(start_paused = true)]
async fn requests_arriving_together_wait_for_one_lookup() {
    let lookups = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&lookups);
    let layer = layer_with(
        move |_: Key| {
            let counted = Arc::clone(&counted);
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(2)).await;
                Ok::<_, std::io::Error>(Some("pro".to_owned()))
            }
        },
        OnLookupError::Anonymous,
    );
    let replies = futures_util::future::join_all((0..50).map(|_| send(&layer, "k-pro"))).await;
    assert!(replies.iter().all(|r| limit(r) == Some("1000")));
    assert_eq!(lookups.load(Ordering::SeqCst), 1);
}

/// A request from `peer` with `X-API-Key: key`.
fn request_from(key: &str, peer: &str) -> Request<()> {
    let mut request = request(key);
    let peer: SocketAddr = peer.parse().unwrap();
    request.extensions_mut().insert(peer);
    request
}

/// A lookup that counts its calls and the most under way at once, takes 2 s, and knows
/// `k-pro` only.
#[derive(Clone, Default)]
struct Counted {
    calls: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl Counted {
    /// A layer keyed by API key looking tiers up with this lookup (5 s timeout): unknown
    /// callers share `anonymous` a minute, `k-pro` gets `pro`.
    fn layer(
        &self,
        anonymous: u64,
        pro: u64,
    ) -> tollway_tower::RateLimitLayerBuilder<tollway_core::MemoryStore<ManualClock>, ApiKey> {
        let clock = ManualClock::at_micros(EPOCH_US);
        RateLimitLayer::builder(memory_store(&clock), per_minute("anonymous", anonymous))
            .key(ApiKey::header("x-api-key").unwrap())
            .tier(per_minute("pro", pro))
            .tier_lookup(self.lookup())
            .tier_lookup_timeout(Duration::from_secs(5))
    }

    fn lookup(&self) -> impl tollway_tower::TierLookup {
        let counted = self.clone();
        move |key: Key| {
            let counted = counted.clone();
            async move {
                counted.calls.fetch_add(1, Ordering::SeqCst);
                let now = counted.running.fetch_add(1, Ordering::SeqCst) + 1;
                counted.most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(2)).await;
                counted.running.fetch_sub(1, Ordering::SeqCst);
                let tier = (key.value() == b"k-pro").then(|| "pro".to_owned());
                Ok::<_, std::io::Error>(tier)
            }
        }
    }
}

/// Regression: every made-up key cost a call to the lookup's backend, however many one
/// address sent. Now an address starts at most its lookups per source (5 a minute here):
/// a thousand made-up keys from one address cost the backend 5 calls, and its callers
/// past that are limited as unknown, for the request only — the same caller from another
/// address is looked up, and the first address may look up again as its budget refills.
#[tokio::test(start_paused = true)]
async fn made_up_keys_from_one_address_cost_the_backend_its_lookups_per_source() {
    let counted = Counted::default();
    let layer = counted
        .layer(100, 1_000)
        .tier_lookups_per_source(tollway_core::Quota::per_minute(5).unwrap())
        .build()
        .unwrap();
    let send_from = |key: String, peer: &'static str| {
        let service = layer.layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new("ok".to_owned()))
        }));
        service.oneshot(request_from(&key, peer))
    };
    for n in 0..1_000 {
        let reply = send_from(format!("made-up-{n}"), "203.0.113.9:4000")
            .await
            .unwrap();
        assert_eq!(limit(&reply), Some("100"));
    }
    assert_eq!(counted.calls.load(Ordering::SeqCst), 5);
    // The address has no lookups left: a real key from it is unknown this time...
    let reply = send_from("k-pro".into(), "203.0.113.9:4000").await.unwrap();
    assert_eq!(limit(&reply), Some("100"));
    assert_eq!(counted.calls.load(Ordering::SeqCst), 5);
    // ...and looked up from another address.
    let reply = send_from("k-pro".into(), "198.51.100.7:4000")
        .await
        .unwrap();
    assert_eq!(limit(&reply), Some("1000"));
    assert_eq!(counted.calls.load(Ordering::SeqCst), 6);
    // One lookup refills every 12 s.
    tokio::time::advance(Duration::from_secs(12)).await;
    send_from("made-up-again".into(), "203.0.113.9:4000")
        .await
        .unwrap();
    assert_eq!(counted.calls.load(Ordering::SeqCst), 7);
}

/// Regression: nothing bounded the lookups under way. Now at most
/// `tier_lookup_concurrency` (8 here) run at once: of 100 new keys arriving together, 8
/// are looked up and the other 92 answered at once as unknown; once the 8 end, lookups
/// start again.
#[tokio::test(start_paused = true)]
async fn lookups_under_way_are_bounded() {
    let counted = Counted::default();
    let layer = counted
        .layer(1_000, 10_000)
        .tier_lookup_concurrency(8)
        .tier_lookups_per_source(tollway_core::Quota::per_minute(1_000_000).unwrap())
        .build()
        .unwrap();
    let keys: Vec<String> = (0..100).map(|n| format!("new-{n}")).collect();
    let replies = futures_util::future::join_all(keys.iter().map(|key| send(&layer, key))).await;
    assert!(replies.iter().all(|r| r.status() == StatusCode::OK));
    assert_eq!(counted.calls.load(Ordering::SeqCst), 8);
    assert_eq!(counted.most.load(Ordering::SeqCst), 8);
    // The 8 answered (None: unknown, cached); new keys are looked up again.
    let reply = send(&layer, "k-pro").await;
    assert_eq!(limit(&reply), Some("10000"));
    assert_eq!(counted.calls.load(Ordering::SeqCst), 9);
}

/// A bound of no lookups at all is refused when the layer is built.
#[test]
fn no_lookups_at_once_is_a_configuration_error() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let err = RateLimitLayer::builder(memory_store(&clock), per_minute("anonymous", 1))
        .tier_lookup(|_: Key| async { Ok::<Option<String>, std::io::Error>(None) })
        .tier_lookup_concurrency(0)
        .build()
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("tier_lookup_concurrency at least 1"),
        "{err}"
    );
}

/// A lookup that answers a customer's own quota, as a contracts table would: `k-acme`
/// gets the pro tier at 20 a minute and spends it. Its contract goes to 40; once the
/// cached answer expires, it has 40 and keeps the 20 it used. An answer whose quota
/// does not suit the tier (a calendar month for GCRA) is a failed lookup.
#[tokio::test(start_paused = true)]
async fn a_looked_up_quota_of_its_own_keeps_what_was_used_when_it_changes() {
    let contract = Arc::new(AtomicU64::new(20));
    let table = Arc::clone(&contract);
    let layer = layer_with(
        move |key: Key| {
            let per_minute = table.load(Ordering::SeqCst);
            async move {
                let plan = match key.value() {
                    b"k-acme" => Plan::tier("pro").with_quota(Quota::per_minute(per_minute)?),
                    b"k-monthly" => {
                        let month = Calendar::utc(CalendarUnit::Month);
                        Plan::tier("pro").with_quota(Quota::per_calendar(per_minute, month)?)
                    }
                    _ => return Ok(None),
                };
                Ok::<_, tollway_core::ConfigError>(Some(plan))
            }
        },
        OnLookupError::Anonymous,
    );
    let remaining = |reply: &Reply| header(reply, "x-ratelimit-remaining").map(str::to_owned);
    for left in (0..20).rev() {
        let reply = send(&layer, "k-acme").await;
        assert_eq!(reply.status(), StatusCode::OK);
        assert_eq!(limit(&reply), Some("20"));
        assert_eq!(remaining(&reply), Some(left.to_string()));
    }
    assert_eq!(
        send(&layer, "k-acme").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    contract.store(40, Ordering::SeqCst);
    // Still the cached 20 until the cache's 60 s pass (the store's clock stands still).
    assert_eq!(limit(&send(&layer, "k-acme").await), Some("20"));
    tokio::time::advance(Duration::from_secs(61)).await;
    let reply = send(&layer, "k-acme").await;
    assert_eq!(reply.status(), StatusCode::OK);
    assert_eq!(
        (limit(&reply), remaining(&reply)),
        (Some("40"), Some("19".to_owned()))
    );

    let monthly = send(&layer, "k-monthly").await;
    assert_eq!(monthly.status(), StatusCode::OK);
    assert_eq!(
        limit(&monthly),
        Some("100"),
        "limited as unknown: the anonymous 100"
    );
}
