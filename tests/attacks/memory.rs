//! The memory store's bound on keys: a flood of callers fills it, and their expiry must
//! make room again.

use std::time::Duration;

use support::http::{Hits, serve};
use support::stores::{EPOCH_US, per_minute};
use tollway_core::{ManualClock, MemoryStore};
use tollway_tower::{ClientIp, ForwardedHeader, RateLimitLayer};

use super::admitted;

/// Finding 8: after a flood filled a 1,024-key store, 102 new callers in a row were
/// refused although every stored key had expired over 60 s earlier. Expired keys make
/// room before a new caller is refused now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_that_has_expired_does_not_lock_new_callers_out() {
    let clock = ManualClock::at_micros(EPOCH_US);
    let store = MemoryStore::builder()
        .max_keys(1_024)
        .clock(clock.clone())
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(store.clone(), per_minute("per-client", 5))
        .key(ClientIp::new(ForwardedHeader::XForwardedFor, ["127.0.0.1"]).unwrap())
        .wall_clock(clock.clone())
        .build()
        .unwrap();
    let hits = Hits::default();
    let server = serve(layer, &hits).await;
    let client = server.client();
    // The proxy names client `n` as 10.x.y.z.
    let send = |n: u32| {
        let client = client.clone();
        async move {
            let [_, a, b, c] = n.to_be_bytes();
            let address = format!("10.{a}.{b}.{c}");
            client.get_with("/", &[("x-forwarded-for", &address)]).await
        }
    };

    // A botnet's flood, in three waves: 128 addresses, 6 s later 1,100 more (the store
    // fills), and 6.5 s after that, when the first wave's buckets are full again and
    // those keys have expired, 160 more (they take the expired keys' room, and the store
    // is full again).
    let mut flood = Vec::new();
    for (wave, (from, to)) in [(0, 128), (128, 1_228), (1_228, 1_388)]
        .into_iter()
        .enumerate()
    {
        if wave > 0 {
            clock.advance(Duration::from_millis(if wave == 1 { 6_000 } else { 6_500 }));
        }
        for n in from..to {
            flood.push(send(n).await);
        }
    }
    assert!(store.len() <= 1_024, "the bound holds: {}", store.len());
    assert!(admitted(&flood) < 1_388, "the store never filled");
    assert!(
        admitted(&[send(100_000).await]) == 0,
        "a new caller is refused while the flood's keys are live"
    );

    // A minute later every flood key's bucket is full again: nothing left to remember.
    clock.advance(Duration::from_secs(61));
    let mut newcomers = Vec::new();
    for n in 200_000..200_200 {
        newcomers.push(send(n).await);
    }
    assert_eq!(admitted(&newcomers), 200, "expired keys made room");
    assert_eq!(hits.get(), admitted(&flood) + 200);
}
