//! Calls in flight across gateways: each gateway's slots are its own field of one hash,
//! counted together, renewed and lost apart.

use std::time::Duration;

use tollway_core::{Algorithm, Decision, ManualClock, Operation, Policy, Quota, RedisStore, Store};

use super::{Target, builder};
use crate::redis::unique_prefix;
use crate::stores::EPOCH_US;

/// Three gateways share 3 slots a caller, whose slots live 10 s unrenewed. Slots are
/// counted across gateways and given back by the gateway that holds them. A gateway
/// that stops renewing (as one that died would) loses its slots one period after its
/// last renewal, while the others keep theirs by renewing. Returns the keys it used.
///
/// # Panics
///
/// When a decision is not the one the slots make.
pub async fn concurrency_across_gateways(target: &Target) -> Vec<String> {
    let clock = ManualClock::at_micros(EPOCH_US);
    let prefix = unique_prefix("inflight");
    let connect = || target.connect(builder(&clock).prefix(prefix.clone()).deny_cache(0));
    let (a, b, c) = (connect().await, connect().await, connect().await);
    let streams = Policy::new(
        "streams",
        Algorithm::Concurrency,
        Quota::with_period(3, Duration::from_secs(10)).unwrap(),
    )
    .unwrap();
    let take = |store: &RedisStore| {
        let (store, streams) = (store.clone(), streams.clone());
        async move { store.check(b"team", &[&streams], 1).await.unwrap()[0] }
    };
    let operate = |store: &RedisStore, operation| {
        let (store, streams) = (store.clone(), streams.clone());
        async move {
            store
                .operate(b"team", &[&streams], operation)
                .await
                .unwrap()[0]
        }
    };
    let allowed = |d: Decision| d.is_allowed();

    assert!(allowed(take(&a).await) && allowed(take(&a).await));
    let d = take(&b).await;
    assert!(allowed(d) && d.remaining() == 0, "{d:?}");
    let refused = take(&c).await;
    assert!(!allowed(refused), "a fourth call while three are in flight");
    assert_eq!(refused.retry_after(), Some(Duration::from_secs(1)));
    // A gives one back: C's call fits.
    assert_eq!(operate(&a, Operation::Refund(1)).await.remaining(), 1);
    assert!(allowed(take(&c).await));
    // A gives back what it does not hold: nobody else's slot.
    operate(&a, Operation::Refund(5)).await;
    operate(&a, Operation::Refund(5)).await;
    assert_eq!(operate(&b, Operation::Peek(0)).await.remaining(), 1);
    assert!(allowed(take(&a).await), "A holds one again");

    // B and C renew at 6 s; A never does after 0 s, as a gateway that died.
    clock.advance(Duration::from_secs(6));
    for store in [&b, &c] {
        operate(store, Operation::Charge(0)).await;
    }
    assert!(!allowed(take(&c).await), "all three still held at 6 s");
    // At 10 s A's slot has expired; B's and C's live until 16 s.
    clock.advance(Duration::from_secs(4));
    assert!(
        allowed(take(&c).await),
        "A's slot freed one period after its renewal"
    );
    assert!(
        !allowed(take(&b).await),
        "B's and C's renewed slots still held"
    );
    clock.advance(Duration::from_secs(6));
    // At 16 s B's slot has expired too; C's two, renewed at 10 s, hold until 20 s.
    assert_eq!(operate(&a, Operation::Peek(0)).await.remaining(), 1);
    vec![a.state_key(b"team", &streams)]
}

/// Three gateways (axum servers over real HTTP, each with its own `RedisStore` on the
/// server's clock) share 5 slots for one caller, and 64 clients a gateway call them at
/// once, 12 calls each. The handler counts the calls inside it: never more than 5 at
/// once, and 5 at some point (the limit was reached). A call waits inside until the
/// handler has been full since it came in (or every caller left is inside), so the
/// calls inside are held while others are refused, not by luck of timing. Returns
/// (calls admitted, calls refused, the most inside at once) and the keys it used.
///
/// # Panics
///
/// When more than 5 calls are inside the handler at once, or an answer is neither a 200
/// nor a 429.
pub async fn in_flight_across_gateways(target: &Target) -> ((u64, u64, usize), Vec<String>) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    use axum::Router;
    use axum::routing::get;
    use tollway_tower::{GlobalKey, RateLimitLayer};

    const SLOTS: usize = 5;
    let prefix = unique_prefix("inflight-http");
    let streams = Policy::new(
        "streams",
        Algorithm::Concurrency,
        Quota::with_period(SLOTS as u64, Duration::from_secs(30)).unwrap(),
    )
    .unwrap();
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    // (times the handler was full, callers still calling): a call inside waits for the
    // first to grow, or for the second to fall to the calls inside.
    const CALLERS: usize = 3 * 64;
    let (told, seen) = tokio::sync::watch::channel((0u64, CALLERS));
    let told = Arc::new(told);
    let mut servers = Vec::new();
    let mut key = String::new();
    for _ in 0..3 {
        let store = target
            .connect(
                crate::redis_store()
                    .prefix(prefix.clone())
                    .deny_cache(0)
                    .timeout(std::time::Duration::from_secs(30)),
            )
            .await;
        key = store.state_key(b"global:", &streams);
        let layer = RateLimitLayer::builder(store, streams.clone())
            .key(GlobalKey)
            .build()
            .unwrap();
        let (inside, most) = (Arc::clone(&inside), Arc::clone(&most));
        let (seen, told) = (seen.clone(), Arc::clone(&told));
        let app = Router::new()
            .route(
                "/work",
                get(move || {
                    let (inside, most) = (Arc::clone(&inside), Arc::clone(&most));
                    let (mut seen, told) = (seen.clone(), Arc::clone(&told));
                    async move {
                        let full = seen.borrow_and_update().0;
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        if now >= SLOTS {
                            told.send_modify(|(f, _)| *f += 1);
                        }
                        let waited = seen
                            .wait_for(|&(f, calling)| {
                                f > full || calling <= inside.load(Ordering::SeqCst)
                            })
                            .await;
                        assert!(waited.is_ok(), "the sender lives as long as the test");
                        inside.fetch_sub(1, Ordering::SeqCst);
                        "done"
                    }
                }),
            )
            .layer(layer);
        servers.push(crate::http::Server::start(app).await);
    }
    let (admitted, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut tasks = Vec::new();
    for server in &servers {
        for _ in 0..64 {
            let client = server.client();
            let (admitted, refused) = (Arc::clone(&admitted), Arc::clone(&refused));
            let told = Arc::clone(&told);
            tasks.push(tokio::spawn(async move {
                for _ in 0..12 {
                    let reply = client.get("/work").await;
                    match reply.status.as_u16() {
                        200 => admitted.fetch_add(1, Ordering::Relaxed),
                        429 => refused.fetch_add(1, Ordering::Relaxed),
                        other => panic!("answered {other}: {}", reply.body),
                    };
                }
                told.send_modify(|(_, calling)| *calling -= 1);
            }));
        }
    }
    crate::within("3 x 64 callers", 60, async {
        for task in tasks {
            task.await.unwrap();
        }
    })
    .await;
    let most = most.load(Ordering::SeqCst);
    assert!(
        most <= SLOTS,
        "{most} calls inside at once, with {SLOTS} slots"
    );
    assert_eq!(most, SLOTS, "the slots were all taken at some point");
    let counts = (
        admitted.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        most,
    );
    assert!(counts.0 > 0 && counts.1 > 0, "{counts:?}");
    ((counts), vec![key])
}
