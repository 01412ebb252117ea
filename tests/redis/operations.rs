//! Peek, charge, refund and reset on both stores, on a manual clock: what each answers
//! and what the next request then gets. (The conformance suite shows the two stores
//! agree on random traces; this pins what they agree on.)

use std::time::Duration;

use support::both_stores;
use tollway_core::{Algorithm, Decisions, Denial, Operation, Policy, Quota, Store};

/// Ten a second, a capacity of ten, for every algorithm.
fn ten_per_second(algorithm: Algorithm) -> Policy {
    let quota = Quota::per_second(10).unwrap();
    Policy::new(format!("ops-{}", algorithm.name()), algorithm, quota).unwrap()
}

async fn run(store: &impl Store, policy: &Policy, operation: Operation) -> Decisions {
    store
        .operate(b"support-call", &[policy], operation)
        .await
        .unwrap()
}

async fn check(store: &impl Store, policy: &Policy, cost: u64) -> Decisions {
    store.check(b"support-call", &[policy], cost).await.unwrap()
}

both_stores! {
    /// Each operation, on each algorithm, does what `Operation` documents.
    async fn each_operation_does_what_it_says(store, clock) {
        let _ = &clock;
        for algorithm in Algorithm::ALL {
            let policy = ten_per_second(algorithm);
            let name = algorithm.name();
            // A charge takes units after the fact.
            assert_eq!(run(&store, &policy, Operation::Charge(4)).await[0].remaining(), 6, "{name}");
            assert_eq!(check(&store, &policy, 1).await[0].remaining(), 5, "{name}");
            // A peek decides and consumes nothing.
            let peek = run(&store, &policy, Operation::Peek(6)).await;
            assert_eq!(peek[0].denial(), Some(Denial::Limited), "{name}");
            let peek = run(&store, &policy, Operation::Peek(5)).await;
            assert!(peek.is_allowed() && peek[0].remaining() == 0, "{name}");
            assert_eq!(run(&store, &policy, Operation::Peek(0)).await[0].remaining(), 5, "{name}");
            // A refund gives units back, up to full.
            assert_eq!(run(&store, &policy, Operation::Refund(2)).await[0].remaining(), 7, "{name}");
            // A charge beyond what is left empties the limit, and the next request waits.
            assert_eq!(run(&store, &policy, Operation::Charge(100)).await[0].remaining(), 0, "{name}");
            let refused = check(&store, &policy, 1).await;
            assert_eq!(refused[0].denial(), Some(Denial::Limited), "{name}");
            let retry = refused[0].retry_after().unwrap();
            if algorithm.keeps_debt() {
                // The buckets and GCRA owe what did not fit, all 93 of it: the debt and
                // one unit refill in 9.4 s.
                assert_eq!(retry, Duration::from_millis(9_400), "{name}");
                // A refund pays the debt back first: 93 back leave the limit empty.
                assert_eq!(run(&store, &policy, Operation::Refund(93)).await[0].remaining(), 0, "{name}");
                assert_eq!(run(&store, &policy, Operation::Refund(1)).await[0].remaining(), 1, "{name}");
            }
            // A reset makes the caller new.
            let fresh = run(&store, &policy, Operation::Reset).await;
            assert_eq!(fresh[0].remaining(), 10, "{name}");
            assert_eq!(check(&store, &policy, 1).await[0].remaining(), 9, "{name}");
            let full = run(&store, &policy, Operation::Refund(1_000)).await;
            assert_eq!(full[0].remaining(), 10, "{name}");
            assert_eq!(full[0].reset_after(), Duration::ZERO, "{name}");
            // A drain leaves at most so many, and takes nothing from a limit with fewer.
            assert_eq!(run(&store, &policy, Operation::Drain(3)).await[0].remaining(), 3, "{name}");
            assert_eq!(run(&store, &policy, Operation::Drain(5)).await[0].remaining(), 3, "{name}");
            assert_eq!(run(&store, &policy, Operation::Drain(0)).await[0].remaining(), 0, "{name}");
            let _ = run(&store, &policy, Operation::Reset).await;
        }
    }
}
