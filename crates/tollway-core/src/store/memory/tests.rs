//! The memory store's unit tests.

use std::time::Duration;

use super::table::operate;
use super::*;
use crate::algorithm::{SlotState, fixed_window, leaky_bucket, sliding_counter, token_bucket};
use crate::{Algorithm, Denial, ManualClock, Quota};

fn store(max_keys: usize, when_full: WhenFull) -> (MemoryStore<ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    let store = MemoryStore::builder()
        .max_keys(max_keys)
        .shards(1)
        .when_full(when_full)
        .clock(clock.clone())
        .build()
        .unwrap();
    (store, clock)
}

#[test]
fn a_full_store_denies_new_keys_and_keeps_limiting_known_ones() {
    let (store, _clock) = store(300, WhenFull::Deny);
    let policy = Policy::new("p", Algorithm::TokenBucket, Quota::per_minute(2).unwrap()).unwrap();
    for i in 0..300u32 {
        assert!(store.check_sync(&i.to_le_bytes(), &policy, 1).is_allowed());
    }
    assert_eq!(store.len(), 300);
    let stranger = store.check_sync(b"stranger", &policy, 1);
    assert_eq!(stranger.denial(), Some(Denial::StoreFull));
    // Known keys keep their state: key 0 has one token left, then none.
    assert!(
        store
            .check_sync(&0u32.to_le_bytes(), &policy, 1)
            .is_allowed()
    );
    assert!(
        !store
            .check_sync(&0u32.to_le_bytes(), &policy, 1)
            .is_allowed()
    );
}

#[test]
fn a_full_store_can_let_new_keys_through_untracked() {
    let (store, _clock) = store(256, WhenFull::AllowUntracked);
    let policy = Policy::new("p", Algorithm::Gcra, Quota::per_minute(1).unwrap()).unwrap();
    for i in 0..256u32 {
        store.check_sync(&i.to_le_bytes(), &policy, 1);
    }
    for _ in 0..3 {
        assert!(store.check_sync(b"stranger", &policy, 1).is_allowed());
    }
    assert_eq!(store.len(), 256);
}

#[test]
fn idle_keys_are_dropped_so_a_flood_of_unique_keys_stays_bounded() {
    // Every key spends one token; a second later its bucket is full again and the
    // key is equivalent to a fresh one, so the store may forget it.
    let (store, clock) = store(1_000, WhenFull::Deny);
    let policy = Policy::new("p", Algorithm::TokenBucket, Quota::per_second(10).unwrap()).unwrap();
    for i in 0..100_000u32 {
        let d = store.check_sync(&i.to_le_bytes(), &policy, 1);
        assert!(d.is_allowed(), "request {i} was denied: {d:?}");
        clock.advance(Duration::from_micros(1_000));
        assert!(store.len() <= 1_000);
    }
    clock.advance(Duration::from_secs(1));
    assert_eq!(store.sweep(), 0);
}

#[test]
fn a_request_that_changes_nothing_stores_nothing() {
    let (store, _clock) = store(100, WhenFull::Deny);
    let policy = Policy::new(
        "p",
        Algorithm::SlidingWindowLog,
        Quota::per_second(1).unwrap(),
    )
    .unwrap();
    assert_eq!(
        store.check_sync(b"k", &policy, 2).denial(),
        Some(Denial::CostExceedsCapacity)
    );
    assert!(store.check_sync(b"k", &policy, 0).is_allowed());
    assert!(store.is_empty());
}

#[test]
fn policies_do_not_share_state_for_the_same_key() {
    let (store, _clock) = store(100, WhenFull::Deny);
    let a = Policy::new("a", Algorithm::FixedWindow, Quota::per_minute(1).unwrap()).unwrap();
    let b = Policy::new("b", Algorithm::FixedWindow, Quota::per_minute(1).unwrap()).unwrap();
    assert!(store.check_sync(b"k", &a, 1).is_allowed());
    assert!(store.check_sync(b"k", &b, 1).is_allowed());
    assert!(!store.check_sync(b"k", &a, 1).is_allowed());
}

#[test]
fn clones_share_one_limit() {
    let (store, _clock) = store(100, WhenFull::Deny);
    let other = store.clone();
    let p = Policy::new(
        "p",
        Algorithm::SlidingWindowCounter,
        Quota::per_minute(1).unwrap(),
    )
    .unwrap();
    assert!(store.check_sync(b"k", &p, 1).is_allowed());
    assert!(!other.check_sync(b"k", &p, 1).is_allowed());
}

#[test]
fn a_request_refused_by_one_limit_is_charged_by_none() {
    let (store, _clock) = store(100, WhenFull::Deny);
    let tier = Policy::new(
        "tier",
        Algorithm::TokenBucket,
        Quota::per_minute(10).unwrap(),
    )
    .unwrap();
    let route = Policy::new(
        "route",
        Algorithm::SlidingWindowLog,
        Quota::per_minute(1).unwrap(),
    )
    .unwrap();
    let first = store.decide(b"k", &[&tier, &route], 1);
    assert!(first.is_allowed());
    assert_eq!((first[0].remaining(), first[1].remaining()), (9, 0));
    for _ in 0..5 {
        let refused = store.decide(b"k", &[&tier, &route], 1);
        assert_eq!(refused[1].denial(), Some(Denial::Limited));
        // The tier reports its state as it is: not charged.
        assert!(refused[0].is_allowed());
        assert_eq!(refused[0].remaining(), 9);
    }
    assert_eq!(store.check_sync(b"k", &tier, 1).remaining(), 8);
}

#[test]
fn a_new_key_that_does_not_fit_refuses_the_whole_request() {
    let (store, _clock) = store(1, WhenFull::Deny);
    let a = Policy::new("a", Algorithm::Gcra, Quota::per_minute(5).unwrap()).unwrap();
    let b = Policy::new("b", Algorithm::Gcra, Quota::per_minute(5).unwrap()).unwrap();
    let refused = store.decide(b"k", &[&a, &b], 1);
    assert_eq!(refused[1].denial(), Some(Denial::StoreFull));
    assert!(store.is_empty(), "nothing was charged");
    assert!(store.decide(b"k", &[&a], 1).is_allowed());
    assert_eq!(store.len(), 1);
}

/// A policy named `api` of `limit` a minute.
fn api(algorithm: Algorithm, limit: u64) -> Policy {
    Policy::new("api", algorithm, Quota::per_minute(limit).unwrap()).unwrap()
}

#[test]
fn a_changed_limit_keeps_what_each_caller_used() {
    for algorithm in Algorithm::ALL {
        let (store, clock) = store(100, WhenFull::Deny);
        let policy = |limit| api(algorithm, limit);
        clock.set_micros(1_000_000_000);
        assert!(store.check_sync(b"k", &policy(20), 20).is_allowed());
        // Cut to 10 with 20 used: nothing left. Raised to 100: the other 80.
        let cut = store.check_sync(b"k", &policy(10), 1);
        assert!(!cut.is_allowed(), "{algorithm:?}");
        assert_eq!(cut.remaining(), 0, "{algorithm:?}");
        let raised = store.check_sync(b"k", &policy(100), 0);
        assert_eq!(raised.remaining(), 80, "{algorithm:?}");
        // Another period starts afresh; but a slot in flight is held whatever the period
        // (how long it lives unrenewed).
        let hourly = Policy::new("api", algorithm, Quota::per_hour(100).unwrap()).unwrap();
        let fresh = if algorithm == Algorithm::Concurrency {
            80
        } else {
            100
        };
        let got = store.check_sync(b"k", &hourly, 0).remaining();
        assert_eq!(got, fresh, "{algorithm:?}");
    }
}

#[test]
fn a_cut_refills_at_the_new_rate_from_the_first_request_under_it() {
    // A bucket of 20 a minute, spent; cut to 10 a minute. Refused at once, the carried
    // state is kept: at the old rate a unit would be back at 33 s, at the new one at 66 s.
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let (store, clock) = store(100, WhenFull::Deny);
        let policy = |limit| api(algorithm, limit);
        assert!(store.check_sync(b"k", &policy(20), 20).is_allowed());
        let refused = store.check_sync(b"k", &policy(10), 1);
        assert_eq!(refused.retry_after_micros(), 66_000_000, "{algorithm:?}");
        clock.set_micros(33_000_000);
        assert!(!store.check_sync(b"k", &policy(10), 1).is_allowed());
        clock.set_micros(66_000_000);
        assert!(store.check_sync(b"k", &policy(10), 1).is_allowed());
    }
}

#[test]
fn a_look_at_a_new_rate_moves_nothing() {
    // 20 a minute, spent at 0. A peek at 10 a minute then changes nothing: at 30 s the
    // old rate has refilled 10, so the first request at the new rate finds 10 missing
    // of 10 and waits 6 s. (Had the peek carried it, 15 would be missing: 36 s.)
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let (store, clock) = store(100, WhenFull::Deny);
        let policy = |limit| api(algorithm, limit);
        assert!(store.check_sync(b"k", &policy(20), 20).is_allowed());
        let peeked = store.apply(b"k", &[&policy(10)], Operation::Peek(1));
        assert!(!peeked[0].is_allowed(), "{algorithm:?}");
        clock.set_micros(30_000_000);
        let first = store.check_sync(b"k", &policy(10), 1);
        assert_eq!(first.retry_after_micros(), 6_000_000, "{algorithm:?}");
    }
}

#[test]
fn a_caller_last_seen_under_a_limit_older_than_four_starts_afresh() {
    // One shard. Key a spends 10 under 10 a minute; other keys bring the policy to four
    // new limits. Under the fifth, key a has 10 used while the limit it was seen under
    // is among the last four, and a full bucket once it is not.
    let (store, _clock) = store(100, WhenFull::Deny);
    let policy = |limit| api(Algorithm::TokenBucket, limit);
    assert!(store.check_sync(b"a", &policy(10), 10).is_allowed());
    for (i, limit) in [20, 30, 40].into_iter().enumerate() {
        let other = format!("other-{i}");
        assert!(
            store
                .check_sync(other.as_bytes(), &policy(limit), 1)
                .is_allowed()
        );
    }
    assert_eq!(store.check_sync(b"a", &policy(50), 0).remaining(), 40);
    let (store, _clock) = self::store(100, WhenFull::Deny);
    assert!(store.check_sync(b"a", &policy(10), 10).is_allowed());
    for (i, limit) in [20, 30, 40, 50].into_iter().enumerate() {
        let other = format!("other-{i}");
        assert!(
            store
                .check_sync(other.as_bytes(), &policy(limit), 1)
                .is_allowed()
        );
    }
    assert_eq!(store.check_sync(b"a", &policy(60), 0).remaining(), 60);
}

// Regression: a store filled by a flood refused new callers for an eighth of its
// bound after every key had expired, waiting out a sweep credit. Expired keys make
// room at once.
#[test]
fn expired_keys_make_room_for_new_callers_at_once() {
    let (store, clock) = store(1_024, WhenFull::Deny);
    let policy = Policy::new("p", Algorithm::TokenBucket, Quota::per_minute(10).unwrap()).unwrap();
    for i in 0..1_024u32 {
        assert!(store.check_sync(&i.to_le_bytes(), &policy, 1).is_allowed());
    }
    let stranger = store.check_sync(b"stranger", &policy, 1);
    assert_eq!(stranger.denial(), Some(Denial::StoreFull));
    clock.advance(Duration::from_secs(61));
    for i in 0..200u32 {
        let d = store.check_sync(format!("new-{i}").as_bytes(), &policy, 1);
        assert!(d.is_allowed(), "new caller {i}: {d:?}");
    }
}

// At the bound with nothing expired, a new caller is turned away without a sweep
// each time, and a key that expires later still makes room once the shard's sweep
// gap has passed.
#[test]
fn a_full_store_sweeps_at_most_once_per_gap() {
    let (store, clock) = store(256, WhenFull::Deny);
    let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(1).unwrap()).unwrap();
    for i in 0..256u32 {
        assert!(store.check_sync(&i.to_le_bytes(), &policy, 1).is_allowed());
        clock.advance(Duration::from_micros(10));
    }
    // Key 0 expires 1 s after it was set; the others a little later each.
    clock.set_micros(1_000_000);
    assert!(store.check_sync(b"first", &policy, 1).is_allowed());
    assert_eq!(
        store.check_sync(b"second", &policy, 1).denial(),
        Some(Denial::StoreFull),
        "nothing else has expired"
    );
    // 10 µs later key 1 has expired; the gap has passed (384 cells a sweep walks,
    // 7.68 µs, rounded up to 8).
    clock.advance(Duration::from_micros(10));
    assert!(store.check_sync(b"second", &policy, 1).is_allowed());
}

// Keys that come and are reset beside long-lived ones leave tombstones in a small
// shard's cells; a new key must still get a cell, never go untracked.
#[test]
fn keys_reset_over_and_over_leave_room_for_new_ones() {
    let (store, _clock) = store(4, WhenFull::Deny);
    let policy = Policy::new("p", Algorithm::Gcra, Quota::per_minute(1).unwrap()).unwrap();
    for stays in [b"a", b"b", b"c"] {
        assert!(store.check_sync(stays, &policy, 1).is_allowed());
    }
    for i in 0..10_000u32 {
        let key = i.to_le_bytes();
        assert!(store.check_sync(&key, &policy, 1).is_allowed());
        assert!(
            !store.check_sync(&key, &policy, 1).is_allowed(),
            "key {i} is tracked"
        );
        store.apply(&key, &[&policy], Operation::Reset);
    }
    assert_eq!(store.len(), 3);
}

// A policy listed twice in one request is decided once, and charges once.
#[test]
fn a_policy_listed_twice_counts_once() {
    let (store, _clock) = store(100, WhenFull::Deny);
    let policy = Policy::new("p", Algorithm::Gcra, Quota::per_minute(5).unwrap()).unwrap();
    for left in [4, 3] {
        let both = store.decide(b"k", &[&policy, &policy], 1);
        assert!(both.is_allowed());
        assert_eq!((both[0].remaining(), both[1].remaining()), (left, left));
    }
    assert_eq!(store.len(), 1);
    assert_eq!(store.check_sync(b"k", &policy, 1).remaining(), 2);
}

// A request under two limits whose second is a new key may sweep to make room for
// it after the first limit was read. The first limit's state, idle but not yet
// dropped, counts as a new key too: a sweep cannot drop it between its read and its
// write (it did, and what the request took was lost: the next request had a whole
// limit again), and the keys never pass the bound. (A log is in the shard's table; a
// sliding counter's state in its cell, which the read pins, so a sweep passes it.)
#[test]
fn an_idle_state_read_by_a_request_counts_as_a_new_key() {
    for algorithm in [Algorithm::SlidingWindowCounter, Algorithm::SlidingWindowLog] {
        let first = Policy::new("first", algorithm, Quota::per_second(1).unwrap()).unwrap();
        let second = Policy::new("second", algorithm, Quota::per_hour(1).unwrap()).unwrap();
        // Four keys, the shard's bound, all idle 2 s on: a sweep makes room.
        let (idle, clock) = store(4, WhenFull::Deny);
        for key in [b"k", b"a", b"b", b"c"] {
            assert!(idle.check_sync(key, &first, 1).is_allowed());
        }
        clock.set_micros(2_500_000);
        assert!(idle.decide(b"k", &[&first, &second], 1).is_allowed());
        let again = idle.check_sync(b"k", &first, 1);
        assert!(
            !again.is_allowed(),
            "{algorithm:?}: the first limit counted it"
        );
        assert_eq!(idle.len(), 2);
        // Four keys, three of them live for an hour: no room for two.
        let (full, full_clock) = store(4, WhenFull::Deny);
        assert!(full.check_sync(b"k", &first, 1).is_allowed());
        for key in [b"a", b"b", b"c"] {
            assert!(full.check_sync(key, &second, 1).is_allowed());
        }
        full_clock.set_micros(2_500_000);
        let both = full.decide(b"k", &[&first, &second], 1);
        assert!(!both.is_allowed());
        assert_eq!(both[1].denial(), Some(Denial::StoreFull), "{algorithm:?}");
        assert!(full.len() <= 4, "{algorithm:?}: {} keys", full.len());
    }
}

// A refund can leave a key idle sooner than its shard noted when it last swept: at
// the bound, a new key then gets the room a sweep makes (it was refused until the
// key's old expiry: six minutes on for GCRA and the token bucket, an hour for the
// fixed window and the log).
#[test]
fn a_refund_that_idles_a_key_makes_room_at_the_bound() {
    for algorithm in [
        Algorithm::Gcra,
        Algorithm::TokenBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
    ] {
        let (store, clock) = store(1, WhenFull::Deny);
        let policy = Policy::new("p", algorithm, Quota::per_hour(10).unwrap()).unwrap();
        assert!(store.check_sync(b"a", &policy, 1).is_allowed());
        assert_eq!(store.sweep(), 1, "a sweep notes when the key goes idle");
        store.apply(b"a", &[&policy], Operation::Refund(1));
        clock.set_micros(1_000);
        let b = store.check_sync(b"b", &policy, 1);
        assert!(b.is_allowed(), "{algorithm:?}: {b:?}");
        assert_eq!(store.len(), 1);
    }
}

/// Token bucket states held in the store's tables (the rest are in cells).
fn in_tables<C>(store: &MemoryStore<C>) -> usize {
    let shards = store.shared.shards.iter();
    shards.map(|shard| shard.table.lock().slots.len()).sum()
}

/// Replays checks, refunds and charges of one key under `policy` through the store, and
/// through the algorithm's functions. It runs from `start` in steps of 150 ms.
///
/// It asserts every decision the same. It also asserts that the state sits in a cell
/// until its instant first reaches `edge`, where it stops packing. Past `edge`, the
/// state sits in the table.
#[allow(clippy::type_complexity)]
fn replay_across_the_edge<S: SlotState + Default>(
    policy: &Policy,
    start: u64,
    edge: u64,
    check: fn(S, u64, &Quota, u64) -> (Decision, S),
    refund: fn(S, u64, &Quota, u64) -> S,
    charge: fn(S, u64, &Quota, u64) -> S,
) {
    let quota = policy.quota().clone();
    let (store, clock) = store(100, WhenFull::Deny);
    let (mut state, mut moved) = (S::default(), false);
    for step in 0..60u64 {
        let now = start + step * 150_000;
        clock.set_micros(now);
        let units = 1 + step % 3;
        if step % 7 == 6 {
            store.apply(b"k", &[policy], Operation::Refund(units));
            state = refund(state, now, &quota, units);
        } else if step % 11 == 10 {
            store.apply(b"k", &[policy], Operation::Charge(units));
            state = operate(
                state,
                Operation::Charge(units),
                |s, cost| check(s, now, &quota, cost),
                |s, units| charge(s, now, &quota, units),
            );
        } else {
            let (want, next) = check(state, now, &quota, units);
            if want.is_allowed() {
                state = next;
            }
            let got = store.check_sync(b"k", policy, units);
            assert_eq!(got, want, "{policy:?}, step {step}");
        }
        // In a cell until it reaches the edge; in the table while past it, and
        // after, until an access finds it idle and drops it.
        let instant = state.to_slot()[0];
        moved |= instant >= edge;
        let tables = in_tables(&store);
        if instant >= edge || !moved {
            assert_eq!(tables, usize::from(moved), "{policy:?}, step {step}");
        }
        assert!(store.len() <= 1);
    }
    assert!(moved, "the key moved out of its cell");
}

// A token bucket's state, or a fixed window's, is packed in a cell while it fits one
// word, and moves to the table when it no longer does. On both sides of the move
// every decision, refund and charge is the algorithm's.
#[test]
fn packed_states_decide_exactly_in_their_cells_and_after_moving_out() {
    // 3 a second: `limit / gcd` takes 2 bits, so a state packs while it is full
    // again before 2^57 µs.
    let quota = Quota::per_second(3).unwrap().with_burst(5).unwrap();
    let (start, edge) = ((1 << 57) - 4_000_000, 1 << 57);
    let policy = Policy::new("tb", Algorithm::TokenBucket, quota.clone()).unwrap();
    replay_across_the_edge(
        &policy,
        start,
        edge,
        token_bucket::check,
        token_bucket::refund,
        token_bucket::charge,
    );
    let policy = Policy::new("lb", Algorithm::LeakyBucket, quota).unwrap();
    replay_across_the_edge(
        &policy,
        start,
        edge,
        leaky_bucket::meter,
        leaky_bucket::meter_refund,
        leaky_bucket::meter_charge,
    );
    // 5 a second: a count takes 3 bits, so a window packs while it ends before 2^56
    // µs. A charge does not count past the limit.
    let quota = Quota::per_second(5).unwrap();
    let policy = Policy::new("fw", Algorithm::FixedWindow, quota).unwrap();
    replay_across_the_edge(
        &policy,
        (1 << 56) - 4_000_000,
        1 << 56,
        fixed_window::check,
        fixed_window::refund,
        |s, _, _, _| s,
    );
    // 32,767 a second: counts of 15 bits each, so a counter packs while its instant
    // is within 2^19 units of 2^19 µs (the largest power of two up to the period):
    // up to 2^38 − 2^19 µs. A charge does not count past the limit.
    let quota = Quota::per_second(32_767).unwrap();
    let policy = Policy::new("swc", Algorithm::SlidingWindowCounter, quota).unwrap();
    let edge = (1 << 38) - (1 << 19) + 1;
    replay_across_the_edge(
        &policy,
        edge - 4_000_000,
        edge,
        sliding_counter::check,
        sliding_counter::refund,
        |s, _, _, _| s,
    );
}

// A sliding window counter in a cell says when it is fresh again to the end of the
// unit its window's end falls in (its word keeps the instant in units of the largest
// power of two up to the period): a sweep keeps it up to a period longer than the
// table would, never less.
#[test]
fn packed_sliding_counters_are_swept_by_the_end_of_their_unit() {
    let quota = Quota::per_second(10).unwrap();
    let policy = Policy::new("swc", Algorithm::SlidingWindowCounter, quota).unwrap();
    let (store, clock) = store(1_000, WhenFull::Deny);
    clock.set_micros(1_200_000);
    assert!(store.check_sync(b"k", &policy, 3).is_allowed());
    assert_eq!((store.len(), in_tables(&store)), (1, 0));
    // Its window [1 s, 2 s) weighs on the next: fresh at 3 s, which falls in the unit
    // of 2^19 µs ending at 6 × 524,288 µs.
    clock.set_micros(2_999_999);
    assert_eq!(store.check_sync(b"k", &policy, 0).remaining(), 9);
    clock.set_micros(3_000_000);
    assert_eq!(store.sweep(), 1);
    clock.set_micros(3_145_727);
    assert_eq!(store.sweep(), 1);
    clock.set_micros(3_145_728);
    assert_eq!(store.sweep(), 0);
    assert_eq!(store.check_sync(b"k", &policy, 0).remaining(), 10);
    // Past the cells' range, in the table, it is swept at its instant.
    clock.set_micros(1 << 62);
    assert!(store.check_sync(b"k", &policy, 1).is_allowed());
    assert_eq!((store.len(), in_tables(&store)), (1, 1));
    let fresh = (1 << 62) / 1_000_000 * 1_000_000 + 2_000_000;
    clock.set_micros(fresh - 1);
    assert_eq!(store.sweep(), 1);
    clock.set_micros(fresh);
    assert_eq!(store.sweep(), 0);
}

// Packed instants count from the store's origin, its clock when made: on an epoch
// clock a window of 1,000 a minute (a count of 10 bits, so 2^49 µs, 17.8 years, from
// the origin) packs as it does on a clock from zero. A state from before the origin
// (a clock set back) is kept in the table.
#[test]
fn packed_states_count_from_the_stores_origin() {
    let origin = 1_780_000_000_000_000;
    let clock = ManualClock::at_micros(origin);
    let store = MemoryStore::builder()
        .max_keys(1_000)
        .shards(1)
        .clock(clock.clone())
        .build()
        .unwrap();
    let quota = Quota::per_minute(1_000).unwrap();
    let policy = Policy::new("fw", Algorithm::FixedWindow, quota).unwrap();
    for _ in 0..1_000 {
        assert!(store.check_sync(b"k", &policy, 1).is_allowed());
    }
    assert!(!store.check_sync(b"k", &policy, 1).is_allowed());
    assert_eq!((store.len(), in_tables(&store)), (1, 0));
    clock.set_micros(origin - 120_000_000);
    assert!(store.check_sync(b"early", &policy, 1).is_allowed());
    assert_eq!((store.len(), in_tables(&store)), (2, 1));
    clock.set_micros(origin + 60_000_000);
    assert_eq!(store.sweep(), 0, "both windows over");
}

// Keys whose token buckets are packed in cells are swept once full again, as the
// table's are: a sweep reads a packed cell's instant, not its word.
#[test]
fn packed_token_buckets_are_swept_once_full_again() {
    // 7 a second: packed with 3 bits of a partial microsecond.
    let quota = Quota::per_second(7).unwrap();
    let policy = Policy::new("tb", Algorithm::TokenBucket, quota.clone()).unwrap();
    let (store, clock) = store(1_000, WhenFull::Deny);
    clock.set_micros(1_000_000);
    for i in 0..100u32 {
        let cost = 1 + u64::from(i % 7);
        assert!(
            store
                .check_sync(&i.to_le_bytes(), &policy, cost)
                .is_allowed()
        );
    }
    assert_eq!((store.len(), in_tables(&store)), (100, 0));
    // Key i is full again (1 + i % 7) / 7 s on, rounded up to a microsecond: those
    // of cost 1 to 3 at 428,572 µs, and not a microsecond sooner.
    let costing = |most: u32| (0..100u32).filter(|i| i % 7 < most).count();
    clock.advance(Duration::from_micros(428_571));
    assert_eq!(
        store.sweep(),
        100 - costing(2),
        "cost 3 is a microsecond short"
    );
    clock.advance(Duration::from_micros(1));
    assert_eq!(store.sweep(), 100 - costing(3), "keys left");
    clock.advance(Duration::from_secs(1));
    assert_eq!(store.sweep(), 0);
}

// What the docs say a shard takes before any key.
#[test]
fn a_shard_is_128_bytes() {
    assert_eq!(std::mem::size_of::<Shard>(), 128);
}

#[test]
fn bad_bounds_fail_when_the_store_is_built() {
    let err = MemoryStore::builder().shards(3).build().unwrap_err();
    assert!(err.to_string().contains("power of two"), "{err}");
    assert!(MemoryStore::builder().max_keys(0).build().is_err());
    let err = MemoryStore::builder()
        .max_keys(1_000_000)
        .shards(1)
        .build()
        .unwrap_err();
    assert!(
        err.to_string().contains("at most 245736 keys each"),
        "{err}"
    );
}
