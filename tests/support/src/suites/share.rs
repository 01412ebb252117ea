//! Shares from Redis: `lua/share.lua` against the memory store's ledger, on the caller's
//! clock.

use std::time::Duration;

use tollway_core::{
    Algorithm, Clock as _, ManualClock, MemoryStore, Policy, Quota, ShareAsk, Store,
};

use super::{Target, builder};
use crate::Rng;
use crate::redis::unique_prefix;
use crate::stores::EPOCH_US;

/// `events` asks of random holders, demands, holds, gaps and give-backs, on three
/// policies and two keys, through Redis and through the memory store on one pinned
/// clock: every share the same, field by field. Holders' names sort differently by
/// bytes and by a locale, and some hold a `:`.
pub async fn share_conformance(target: &Target, events: usize) {
    let clock = ManualClock::at_micros(EPOCH_US);
    let redis = target
        .connect(builder(&clock).prefix(unique_prefix("share")))
        .await;
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let policies = [
        Policy::new(
            "tb",
            Algorithm::TokenBucket,
            Quota::per_second(100).unwrap(),
        )
        .unwrap(),
        Policy::new(
            "gcra",
            Algorithm::Gcra,
            Quota::per_minute(6_000).unwrap().with_burst(300).unwrap(),
        )
        .unwrap(),
        Policy::new(
            "meter",
            Algorithm::LeakyBucket,
            Quota::per_second(7).unwrap(),
        )
        .unwrap(),
    ];
    let holders = ["a", "B", "_x", "Z9", "envoy-1:7:b", "é"];
    let mut rng = Rng(0x5a_a7e5);
    let mut new_buckets = 0;
    let mut zero = 0;
    for event in 0..events {
        let policy = &policies[rng.below(3) as usize];
        let key: &[u8] = if rng.below(2) == 0 { b"k1" } else { b"k2" };
        let holder = holders[rng.below(holders.len() as u64) as usize];
        let ask = if rng.below(12) == 0 {
            ShareAsk::release(holder)
        } else {
            let demand = [0, 1, 3, 40, 90, 5_000, u64::MAX][rng.below(7) as usize];
            ShareAsk::new(
                holder,
                demand,
                Duration::from_millis(500 + rng.below(9_500)),
            )
        };
        let ours = memory.share(key, policy, &ask).unwrap().await.unwrap();
        let theirs = redis.share(key, policy, &ask).unwrap().await.unwrap();
        assert_eq!(
            ours,
            theirs,
            "event {event}: {ask:?} on {} at {} ms",
            policy.name(),
            clock.now_micros() / 1_000
        );
        new_buckets += usize::from(ours.is_new());
        zero += usize::from(ours.rate() == 0);
        clock.advance(Duration::from_millis(rng.below(1_500)));
    }
    // The trace went through changes and refusals, not one kind of answer.
    assert!(new_buckets > events / 20, "{new_buckets} new buckets");
    assert!(zero > events / 20, "{zero} shares of nothing");
}
