//! The breaker's unit tests: opening, probing, closing, the fallback's share, logging.

use std::future::{IntoFuture, Ready, ready};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use super::*;
use crate::{Algorithm, ManualClock};

/// A store that fails while told to, and counts its calls.
#[derive(Clone, Default)]
struct Flaky {
    down: Arc<AtomicBool>,
    calls: Arc<AtomicU32>,
}

/// It answers through a future, as a store that calls out does.
impl Store for Flaky {
    type Future = Ready<Result<Decisions, StoreError>>;
    fn check(&self, _: &[u8], policies: &[&Policy], _: u64) -> Checked<Self::Future> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            Checked::Pending(ready(Err(StoreError::new(
                StoreErrorKind::Connection,
                "down",
            ))))
        } else {
            let allowed = policies.iter().map(|p| {
                let limit = p.quota().burst();
                crate::Decision::allow(limit, limit, 0, 0)
            });
            Checked::Pending(ready(Ok(allowed.collect())))
        }
    }
    fn operate(&self, key: &[u8], policies: &[&Policy], _: Operation) -> Checked<Self::Future> {
        self.check(key, policies, 0)
    }
}

fn poll<F: Future>(f: F) -> F::Output {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("the test stores answer at once"),
    }
}

#[test]
fn the_breaker_opens_skips_the_store_probes_and_closes() {
    let clock = ManualClock::new();
    let flaky = Flaky::default();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let store = CircuitBreaker::builder(flaky.clone())
        .threshold(3)
        .cool_down(Duration::from_millis(100))
        .on_state_change(move |s| log.lock().push(s))
        .clock(clock.clone())
        .build()
        .unwrap();
    let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(10).unwrap()).unwrap();
    flaky.down.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        assert!(poll(store.check(b"k", &[&policy], 1).into_future()).is_err());
    }
    assert_eq!(store.state(), BreakerState::Open);
    // Open: the store is not called at all.
    for _ in 0..100 {
        assert!(poll(store.check(b"k", &[&policy], 1).into_future()).is_err());
    }
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 3);
    // An operation goes to the store all the same, and does not move the breaker —
    // but a charge (serving requests) is not sent while it is open (with no
    // fallback, it fails).
    let peek = store.operate(b"k", &[&policy], Operation::Peek(1));
    assert!(poll(peek.into_future()).is_err());
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 4);
    let charge = store.operate(b"k", &[&policy], Operation::Charge(5));
    assert!(poll(charge.into_future()).is_err());
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 4);
    flaky.calls.store(3, Ordering::SeqCst);
    // After the cool-down one probe goes through; it fails, so open again.
    clock.advance(Duration::from_millis(100));
    assert!(poll(store.check(b"k", &[&policy], 1).into_future()).is_err());
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 4);
    assert_eq!(store.state(), BreakerState::Open);
    // The store recovers; the next probe, after the doubled cool-down, closes it.
    flaky.down.store(false, Ordering::SeqCst);
    clock.advance(Duration::from_millis(100));
    assert!(poll(store.check(b"k", &[&policy], 1).into_future()).is_err());
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 4);
    clock.advance(Duration::from_millis(100));
    assert!(poll(store.check(b"k", &[&policy], 1).into_future()).is_ok());
    assert_eq!(store.state(), BreakerState::Closed);
    assert_eq!(
        *seen.lock(),
        [
            BreakerState::Open,
            BreakerState::HalfOpen,
            BreakerState::Open,
            BreakerState::HalfOpen,
            BreakerState::Closed
        ]
    );
}

#[test]
fn the_local_fallback_gives_this_node_its_share() {
    let clock = ManualClock::new();
    let flaky = Flaky::default();
    flaky.down.store(true, Ordering::SeqCst);
    let store = CircuitBreaker::builder(flaky)
        .local_fallback(0.25)
        .clock(clock)
        .build()
        .unwrap();
    let policy = Policy::new("p", Algorithm::TokenBucket, Quota::per_minute(100).unwrap()).unwrap();
    let admitted = (0..100)
        .filter(|_| {
            poll(store.check(b"k", &[&policy], 1).into_future()).is_ok_and(|d| d.is_allowed())
        })
        .count();
    assert_eq!(admitted, 25);
}

// A primary that answers without waiting keeps answering so through the breaker:
// wrapping a store must not cost its fast path.
#[test]
fn a_ready_answer_stays_ready_through_the_breaker() {
    let store = CircuitBreaker::builder(MemoryStore::new()).build().unwrap();
    let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(1).unwrap()).unwrap();
    match store.check(b"k", &[&policy], 1) {
        Checked::Ready(Ok(decisions)) => assert!(decisions.is_allowed()),
        Checked::Ready(Err(error)) => panic!("the memory store failed: {error}"),
        Checked::Pending(_) => panic!("a decision the memory store made at once waits"),
    }
}

/// A store that, while told to, never answers: its calls wait like a stalled Redis's.
#[derive(Clone, Default)]
struct Stalled {
    flaky: Flaky,
    stalled: Arc<AtomicBool>,
}

impl Store for Stalled {
    type Future = BoxStoreFuture;
    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future> {
        if self.stalled.load(Ordering::SeqCst) {
            self.flaky.calls.fetch_add(1, Ordering::SeqCst);
            return Checked::Pending(Box::pin(std::future::pending()));
        }
        boxed(self.flaky.check(key, policies, cost))
    }
    fn operate(&self, key: &[u8], policies: &[&Policy], op: Operation) -> Checked<Self::Future> {
        boxed(self.flaky.operate(key, policies, op))
    }
}

// While the probe waits for a stalled store, every other decision is the fallback's,
// at once: only the probe's caller waits for the store.
#[test]
fn half_open_sends_one_probe_and_answers_the_rest_at_once() {
    let clock = ManualClock::new();
    let store = Stalled::default();
    let breaker = CircuitBreaker::builder(store.clone())
        .threshold(1)
        .local_fallback(1.0)
        .clock(clock.clone())
        .build()
        .unwrap();
    let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(1_000).unwrap()).unwrap();
    store.flaky.down.store(true, Ordering::SeqCst);
    assert!(poll(breaker.check(b"k", &[&policy], 1).into_future()).is_ok());
    assert_eq!(breaker.state(), BreakerState::Open);
    store.stalled.store(true, Ordering::SeqCst);
    clock.advance(DEFAULT_COOL_DOWN);
    let probe = breaker.check(b"k", &[&policy], 1);
    assert!(
        matches!(probe, Checked::Pending(_)),
        "the probe calls the store"
    );
    assert_eq!(breaker.state(), BreakerState::HalfOpen);
    for _ in 0..100 {
        match breaker.check(b"k", &[&policy], 1) {
            Checked::Ready(answer) => assert!(answer.is_ok_and(|d| d.is_allowed())),
            Checked::Pending(_) => panic!("a second call waits for the stalled store"),
        }
    }
    assert_eq!(
        store.flaky.calls.load(Ordering::SeqCst),
        2,
        "one failure, one probe"
    );
    drop(probe);
}

// Regression: the cool-down was fixed, so a dead store was probed (and a caller made
// to wait for the probe's timeout) every 350 ms for as long as it was down. Each
// failed probe now doubles it, up to the cap; an answer brings it back to the start.
#[test]
fn the_cool_down_doubles_while_probes_fail_up_to_a_cap_and_resets_on_success() {
    let clock = ManualClock::new();
    let flaky = Flaky::default();
    let store = CircuitBreaker::builder(flaky.clone())
        .threshold(1)
        .cool_down(Duration::from_millis(100))
        .max_cool_down(Duration::from_millis(1_000))
        .clock(clock.clone())
        .build()
        .unwrap();
    let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(10).unwrap()).unwrap();
    let check = || {
        let _ = poll(store.check(b"k", &[&policy], 1).into_future());
    };
    // How long, in ms stepped, until the store is called again.
    let next_probe = || {
        let before = flaky.calls.load(Ordering::SeqCst);
        let mut waited = 0;
        while flaky.calls.load(Ordering::SeqCst) == before {
            assert!(waited < 10_000, "no probe in 10 s");
            clock.advance(Duration::from_millis(1));
            waited += 1;
            check();
        }
        waited
    };
    flaky.down.store(true, Ordering::SeqCst);
    check();
    assert_eq!(store.state(), BreakerState::Open);
    let waits: Vec<u64> = (0..6).map(|_| next_probe()).collect();
    assert_eq!(waits, [100, 200, 400, 800, 1_000, 1_000]);
    flaky.down.store(false, Ordering::SeqCst);
    assert_eq!(next_probe(), 1_000);
    assert_eq!(store.state(), BreakerState::Closed);
    flaky.down.store(true, Ordering::SeqCst);
    check();
    assert_eq!(store.state(), BreakerState::Open);
    assert_eq!(
        next_probe(),
        100,
        "the next outage starts from the cool-down again"
    );
}

// Regression: charges after a response (an LLM's tokens) failed while the breaker was
// open, so an outage lifted the budget: a caller spent 400 times its tokens in one
// stall. They are charged to the local fallback now, which then refuses the caller.
#[test]
fn charges_while_the_breaker_is_open_reach_the_fallback() {
    let clock = ManualClock::new();
    let flaky = Flaky::default();
    let store = CircuitBreaker::builder(flaky.clone())
        .threshold(1)
        .local_fallback(1.0)
        .clock(clock)
        .build()
        .unwrap();
    let tokens = Policy::new(
        "t",
        Algorithm::TokenBucket,
        Quota::per_minute(1_000).unwrap(),
    )
    .unwrap();
    flaky.down.store(true, Ordering::SeqCst);
    let first = poll(store.check(b"k", &[&tokens], 0).into_future()).unwrap();
    assert!(first.is_allowed());
    assert_eq!(store.state(), BreakerState::Open);
    let calls = flaky.calls.load(Ordering::SeqCst);
    let charged = store.operate(b"k", &[&tokens], Operation::Charge(900));
    let charged = poll(charged.into_future()).unwrap();
    assert_eq!(charged[0].remaining(), 100);
    assert_eq!(
        flaky.calls.load(Ordering::SeqCst),
        calls,
        "not sent to the store"
    );
    // The fallback remembers: 200 more tokens do not fit.
    let next = poll(store.check(b"k", &[&tokens], 200).into_future()).unwrap();
    assert!(!next.is_allowed());
}

// A call that took its slot from the fallback during an outage gives it back there:
// the slot is free again for the next call, while the store is still down.
#[test]
fn slots_taken_while_the_breaker_is_open_are_given_back_to_the_fallback() {
    let flaky = Flaky::default();
    let store = CircuitBreaker::builder(flaky.clone())
        .threshold(1)
        .local_fallback(1.0)
        .clock(ManualClock::new())
        .build()
        .unwrap();
    let slots = Quota::with_period(1, Duration::from_secs(30)).unwrap();
    let streams = Policy::new("s", Algorithm::Concurrency, slots).unwrap();
    flaky.down.store(true, Ordering::SeqCst);
    assert!(
        poll(store.check(b"k", &[&streams], 1).into_future())
            .unwrap()
            .is_allowed()
    );
    assert_eq!(store.state(), BreakerState::Open);
    assert!(
        !poll(store.check(b"k", &[&streams], 1).into_future())
            .unwrap()
            .is_allowed()
    );
    let calls = flaky.calls.load(Ordering::SeqCst);
    let freed = store.operate(b"k", &[&streams], Operation::Refund(1));
    assert_eq!(poll(freed.into_future()).unwrap()[0].remaining(), 1);
    assert_eq!(
        flaky.calls.load(Ordering::SeqCst),
        calls,
        "not sent to the store"
    );
    assert!(
        poll(store.check(b"k", &[&streams], 1).into_future())
            .unwrap()
            .is_allowed()
    );
    // A refund of a rate is an administrator's: still the store's, and it is down.
    let rate = Policy::new("r", Algorithm::Gcra, Quota::per_second(10).unwrap()).unwrap();
    let refund = store.operate(b"k", &[&rate], Operation::Refund(1));
    assert!(poll(refund.into_future()).is_err());
}

// Regression: a dead store logged an open/half-open pair every 350 ms for as long as
// it was down. Now: one warning when it fails, one summary every 10 s while it stays
// down, one line when it answers again, each naming the store.
#[test]
fn an_outage_is_logged_when_it_starts_every_10_s_and_when_it_ends() {
    let lines = crate::test_log::Lines::of("store");
    let clock = ManualClock::new();
    let flaky = Flaky::default();
    let store = CircuitBreaker::builder(flaky.clone())
        .threshold(1)
        .name("sessions")
        .clock(clock.clone())
        .build()
        .unwrap();
    let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(10).unwrap()).unwrap();
    tracing::subscriber::with_default(lines.clone(), || {
        flaky.down.store(true, Ordering::SeqCst);
        // 25 s down, a request every 10 ms.
        for _ in 0..2_500 {
            let _ = poll(store.check(b"k", &[&policy], 1).into_future());
            clock.advance(Duration::from_millis(10));
        }
        flaky.down.store(false, Ordering::SeqCst);
        while store.state() != BreakerState::Closed {
            let _ = poll(store.check(b"k", &[&policy], 1).into_future());
            clock.advance(Duration::from_millis(10));
        }
    });
    let warn = (tracing::Level::WARN, "sessions".to_owned());
    assert_eq!(
        *lines.seen.lock(),
        [warn.clone(), warn.clone(), warn.clone(), warn]
    );
}

#[test]
fn bad_settings_fail_when_built() {
    assert!(
        CircuitBreaker::builder(Flaky::default())
            .threshold(0)
            .build()
            .is_err()
    );
    assert!(
        CircuitBreaker::builder(Flaky::default())
            .local_fallback(0.0)
            .build()
            .is_err()
    );
    assert!(
        CircuitBreaker::builder(Flaky::default())
            .local_fallback(1.5)
            .build()
            .is_err()
    );
}
