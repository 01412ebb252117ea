//! What region stores refuse: a policy they were not told about, and a reset or refund
//! that would change one region only.

use super::*;

/// Issue 34: a layer over a split store built without one of its policies answered every
/// request of that policy with a store error, which the default `OnStoreError::Allow`
/// let through unlimited. The layer refuses to build now, naming the policy.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_layer_over_a_split_store_refuses_a_policy_the_store_was_not_told_about() {
    let clock = TokioClock::new();
    let local = tollway_core::MemoryStore::builder()
        .clock(clock.clone())
        .build()
        .unwrap();
    let peer = tollway_core::MemoryStore::builder()
        .clock(clock.clone())
        .build()
        .unwrap();
    let declared = hundred_a_minute();
    let split = SplitStore::builder("eu", local, clock)
        .policy(&declared)
        .peer("us", peer)
        .build()
        .await
        .unwrap();
    let undeclared = Policy::new(
        "checkout",
        Algorithm::FixedWindow,
        Quota::per_minute(5).unwrap(),
    )
    .unwrap();
    let err = tollway_tower::RateLimitLayer::builder(split.clone(), declared.clone())
        .route(None, "/checkout", undeclared)
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"checkout\"") && err.contains(".policy("),
        "{err}"
    );
    assert!(
        tollway_tower::RateLimitLayer::builder(split, declared)
            .build()
            .is_ok()
    );
}

/// Issue 34: a reset or refund on a region's store changed that region only, and the
/// others' state (replicated back, or counted in the split) undid it without a word. Both
/// region stores refuse them now, saying what to do; a peek still answers.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn region_stores_refuse_a_reset_or_refund_that_would_change_one_region() {
    let clock = TokioClock::new();
    let memory = || {
        tollway_core::MemoryStore::builder()
            .clock(clock.clone())
            .build()
            .unwrap()
    };
    let policy = hundred_a_minute();
    let replicated = ReplicatedStore::builder(memory())
        .peer("us", memory())
        .build()
        .unwrap();
    let split = SplitStore::builder("eu", memory(), clock.clone())
        .policy(&policy)
        .peer("us", memory())
        .build()
        .await
        .unwrap();
    for (name, answer) in [
        (
            "ReplicatedStore",
            replicated.operate(b"k", &[&policy], Operation::Reset).await,
        ),
        (
            "ReplicatedStore",
            replicated
                .operate(b"k", &[&policy], Operation::Refund(1))
                .await,
        ),
        (
            "SplitStore",
            split.operate(b"k", &[&policy], Operation::Reset).await,
        ),
        (
            "SplitStore",
            split.operate(b"k", &[&policy], Operation::Refund(1)).await,
        ),
    ] {
        let err = answer.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Other);
        let message = err.to_string();
        assert!(
            message.contains(name) && message.contains("each region's own store"),
            "{message}"
        );
    }
    assert!(
        replicated
            .operate(b"k", &[&policy], Operation::Peek(1))
            .await
            .is_ok()
    );
    assert!(
        split
            .operate(b"k", &[&policy], Operation::Peek(1))
            .await
            .is_ok()
    );
}
