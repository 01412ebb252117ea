//! A leased hot key while its Redis stalls: decided here from the units the gateways
//! hold, exactly, until they run out or go bad; never over the limit, before, during or
//! after.

use super::*;
use tollway_core::{Clock as _, Leased};

/// Three gateways lease one hot key (GCRA, 1,000 a second, a burst of 5,000) on a manual
/// clock. Half the limit for 1 s, then Redis stalls (`CLIENT PAUSE WRITE`: every script
/// waits) for 40 steps of 10 ms, then it answers again for 1 s more. While it stalls,
/// requests are answered from the loans the gateways hold, at once; the rest fail (no
/// fallback here, so a failure admits nothing). The exact algorithm, fed every
/// admission at its instant, admits them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_hot_key_is_decided_here_while_redis_stalls_and_never_over_the_limit() {
    let server = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let policy = Policy::new(
        "stalled",
        Algorithm::Gcra,
        Quota::per_second(1_000).unwrap().with_burst(5_000).unwrap(),
    )
    .unwrap();
    let mut gateways = Vec::new();
    for _ in 0..3 {
        let store = builder(&clock)
            .prefix("stalled")
            .timeout(TIMEOUT)
            .without_local_fallback()
            .connect(&server.url())
            .await
            .unwrap();
        gateways.push(Leased::builder(store).clock(clock.clone()).build().unwrap());
    }
    let mut node = server.connection().await;
    let mut admitted: Vec<u64> = Vec::new();
    let (mut during, mut failed_during, mut waited_during) = (0, 0, Duration::ZERO);
    for step in 0..240 {
        let stalled = (100..140).contains(&step);
        if step == 100 {
            support::redis::pause_writes(&mut node).await;
        }
        if step == 140 {
            support::redis::unpause(&mut node).await;
        }
        clock.advance(Duration::from_millis(10));
        // 5 requests a gateway a step: 1,500 a second, under the limit with its burst.
        for gateway in &gateways {
            for _ in 0..5 {
                let started = Instant::now();
                let answer = gateway.check(b"hot", &[&policy], 1).await;
                let allowed = answer.as_ref().is_ok_and(|d| d.is_allowed());
                if allowed {
                    admitted.push(clock.now_micros());
                }
                if stalled {
                    during += usize::from(allowed);
                    failed_during += usize::from(answer.is_err());
                    if allowed {
                        waited_during = waited_during.max(started.elapsed());
                    }
                }
            }
        }
    }
    println!(
        "while Redis stalled: {during} admitted from loans (the slowest in {waited_during:?}), \
         {failed_during} failed; {} admitted in all",
        admitted.len()
    );
    assert!(
        during > 0,
        "no request was decided from a loan while Redis stalled"
    );
    assert!(
        waited_during < TIMEOUT,
        "a request decided from a loan waited {waited_during:?}"
    );
    assert!(
        failed_during > 0,
        "the loans never ran out: the stall was not felt"
    );
    // Never over the limit: the exact algorithm admits every admission at its instant.
    let model_clock = ManualClock::at_micros(0);
    let model = tollway_core::MemoryStore::builder()
        .clock(model_clock.clone())
        .build()
        .unwrap();
    for (i, &at) in admitted.iter().enumerate() {
        model_clock.set_micros(at);
        assert!(
            model.check_sync(b"model", &policy, 1).is_allowed(),
            "admission {i} at {at} µs is over the limit"
        );
    }
    // Redis decides again after the stall.
    assert!(
        admitted.iter().any(|&at| at > EPOCH_US + 1_450_000),
        "nothing was admitted after the stall"
    );
}

/// How Redis loses the state in [`a_lost_state_is_not_lent_again_in_its_window`].
#[derive(Clone, Copy, Debug)]
enum Loss {
    Flush,
    Restart,
}

/// Three gateways lease one hot key far over a fixed window of 300 per 2 s (15 requests
/// a millisecond between them, on a manual clock): the window runs out early. Then
/// Redis loses its state mid-window. The gateways knew the window had run out until its
/// end: they refuse locally until then, and do not ask for loans from the empty state.
/// So the window admits at most its 300, and the next one serves again.
async fn a_lost_state_is_not_lent_again_in_its_window(loss: Loss) {
    const WINDOW: u64 = 2_000_000;
    let mut server = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    assert_eq!(EPOCH_US % WINDOW, 0, "the test starts at a window's start");
    let policy = Policy::new(
        "lost",
        Algorithm::FixedWindow,
        Quota::with_period(300, Duration::from_micros(WINDOW)).unwrap(),
    )
    .unwrap();
    let (mut gateways, mut stores) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let store = builder(&clock)
            .prefix("lost")
            .timeout(TIMEOUT)
            .connect(&server.url())
            .await
            .unwrap();
        stores.push(store.clone());
        gateways.push(Leased::builder(store).clock(clock.clone()).build().unwrap());
    }
    let (mut first, mut after_loss) = (0, 0);
    // The first window: 1 ms a step, 15 requests a step.
    for step in 0..(WINDOW / 1_000 - 1) {
        if step == 1_000 {
            match loss {
                Loss::Flush => {
                    let mut node = server.connection().await;
                    let () = redis::cmd("FLUSHALL").query_async(&mut node).await.unwrap();
                }
                Loss::Restart => {
                    server.restart();
                    // The manual clock waits for the restart: each gateway reaches the
                    // new server (its breaker's cool-down passed) before time moves on.
                    for store in &stores {
                        reaches_redis_again(store, &policy).await;
                    }
                }
            }
        }
        clock.advance(Duration::from_millis(1));
        assert!(clock.now_micros() < EPOCH_US + WINDOW);
        for gateway in &gateways {
            for _ in 0..5 {
                let allowed = gateway
                    .check(b"hot", &[&policy], 1)
                    .await
                    .is_ok_and(|d| d.is_allowed());
                first += u64::from(allowed);
                after_loss += u64::from(allowed && step >= 1_000);
            }
        }
        // Background loans land between steps, as they would in real time.
        tokio::task::yield_now().await;
    }
    eprintln!("{loss:?}: the window admitted {first} of 300, {after_loss} after the loss");
    assert!(first <= 300, "{loss:?}: the window admitted {first} of 300");
    // The next window serves again: each gateway, asked with time standing at the
    // window's start, admits a request once its loan lands.
    clock.advance(Duration::from_millis(1));
    assert_eq!(clock.now_micros(), EPOCH_US + WINDOW);
    for gateway in &gateways {
        within(&format!("{loss:?}: the next window to serve"), 20, async {
            while !gateway
                .check(b"hot", &[&policy], 1)
                .await
                .is_ok_and(|d| d.is_allowed())
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
    }
}

/// Waits until `store` answers a look at another key of `policy` (a peek: nothing is
/// charged, nothing lent).
async fn reaches_redis_again(store: &RedisStore, policy: &Policy) {
    within("a gateway to reach the restarted Redis", 20, async {
        while store
            .operate(b"probe", &[policy], tollway_core::Operation::Peek(0))
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_state_is_not_lent_again_in_its_window() {
    a_lost_state_is_not_lent_again_in_its_window(Loss::Flush).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_lost_in_a_restart_is_not_lent_again_in_its_window() {
    a_lost_state_is_not_lent_again_in_its_window(Loss::Restart).await;
}
