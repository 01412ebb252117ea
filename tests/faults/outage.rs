//! One Redis server killed and restarted under load, paused, its scripts flushed.

use super::*;

/// Kills the server under a load of 16 concurrent callers through a breaker, measures a
/// request's cost while the breaker is open, restarts the server and measures how soon
/// decisions come from Redis again.
async fn redis_dies_and_comes_back_under_load(fallback: bool) {
    let mut server = RedisServer::start();
    let redis = unguarded().connect(&server.url()).await.unwrap();
    let states = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&states);
    let mut resilient = CircuitBreaker::builder(redis)
        .threshold(5)
        .cool_down(COOL_DOWN)
        .on_state_change(move |s| log.lock().unwrap().push(s));
    if fallback {
        resilient = resilient.local_fallback(0.5);
    }
    let store = resilient.build().unwrap();
    let policy = Policy::new(
        "outage",
        Algorithm::Gcra,
        Quota::per_second(1_000_000).unwrap(),
    )
    .unwrap();
    let redis_limit = store
        .check_one(b"warm-up", &policy, 1)
        .await
        .unwrap()
        .limit();
    let callers: Vec<String> = (0..16).map(|c| format!("caller-{c}")).collect();
    let load = Load::start(&store, &policy, &callers, redis_limit);
    let within = WAIT_WITHIN;
    wait_for("answers from Redis", within, &load, || {
        load.redis_answers() >= 100
    })
    .await;

    server.kill();
    let killed = load.now();
    wait_for("the breaker to open", within, &load, || {
        store.state() == BreakerState::Open
    })
    .await;
    // While the breaker is open a request costs microseconds, not a timeout.
    let mut open = Vec::with_capacity(1_000);
    for _ in 0..1_000 {
        let began = Instant::now();
        let answer = store.check_one(b"while-open", &policy, 1).await;
        open.push(began.elapsed());
        match answer {
            Ok(d) => assert!(fallback && d.limit() < redis_limit, "{d:?}"),
            Err(_) => assert!(!fallback),
        }
    }
    open.sort_unstable();
    let (median, p99) = (open[500], open[990]);
    // A probe while Redis is down fails, and the breaker opens again.
    wait_for("a failed probe", within, &load, || {
        let states = states.lock().unwrap();
        states
            .windows(2)
            .any(|w| w == [BreakerState::HalfOpen, BreakerState::Open])
    })
    .await;

    server.restart();
    let restarted = load.now();
    wait_for(
        "a decision from Redis after the restart",
        within,
        &load,
        || (0..callers.len()).any(|c| load.redis_answered_since(c, restarted)),
    )
    .await;
    let recovered_count = load.redis_answers();
    wait_for("more decisions from Redis", within, &load, || {
        load.redis_answers() >= recovered_count + 300
    })
    .await;
    let answers = load.finish().await;

    // Every request was answered: within the timeout, plus the scheduler's slack.
    let slowest = slowest(&answers);
    assert!(slowest <= TIMEOUT + SLACK, "an answer took {slowest:?}");
    // While Redis was away, answers came from the fallback or were errors, per policy.
    let (local, errors) = (
        count(&answers, Source::Fallback),
        count(&answers, Source::Error),
    );
    if fallback {
        assert!(local > 0 && errors == 0, "{local} local, {errors} errors");
    } else {
        assert!(local == 0 && errors > 0, "{local} local, {errors} errors");
    }
    // From the restart, how long until a decision came from Redis again; once one did,
    // every call that began afterwards went to Redis.
    let first = answers
        .iter()
        .filter(|a| a.source == Source::Redis && a.began >= restarted)
        .min_by_key(|a| a.ended)
        .unwrap();
    let recovery = first.ended - restarted;
    assert!(
        recovery < RECOVER_WITHIN,
        "decisions came from Redis {recovery:?} after the restart"
    );
    let stragglers: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.began > first.ended && a.source != Source::Redis)
        .collect();
    assert!(
        stragglers.is_empty(),
        "after recovery: {:?}",
        &stragglers[..stragglers.len().min(5)]
    );
    // And they did reach the restarted server.
    assert!(script_calls(&mut server.connection().await).await > 0);
    // While open, no call waited for Redis: not one took the timeout.
    assert!(
        p99 < TIMEOUT / 2,
        "p99 {p99:?} while open (median {median:?})"
    );
    println!(
        "fallback {fallback}: {} answers ({} from Redis, {local} local, {errors} errors), \
         slowest {slowest:?}; Redis killed at {killed:?}; while the breaker was open a \
         request took {median:?} (median), {p99:?} (p99); decisions from Redis again \
         {recovery:?} after the restart; breaker states {:?}",
        answers.len(),
        count(&answers, Source::Redis),
        states.lock().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_redis_under_load_falls_back_locally_in_time_and_recovers() {
    redis_dies_and_comes_back_under_load(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_redis_under_load_fails_fast_without_a_fallback_and_recovers() {
    redis_dies_and_comes_back_under_load(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pause_longer_than_the_timeout_is_answered_within_it() {
    // Longer than the timeout plus the slack, so that answering within those is
    // answering during the pause.
    const PAUSE: Duration = Duration::from_secs(5);
    let server = RedisServer::start();
    // Every call waits for Redis: no breaker to stop calling it, no fallback to answer,
    // no stall detection to fail it before its timeout.
    let store = unguarded()
        .without_stall_detection()
        .connect(&server.url())
        .await
        .unwrap();
    let policy = Policy::new(
        "pause",
        Algorithm::TokenBucket,
        Quota::per_minute(1_000).unwrap(),
    )
    .unwrap();
    assert!(
        store
            .check_one(b"k", &policy, 1)
            .await
            .unwrap()
            .is_allowed()
    );

    let mut admin = server.connection().await;
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(PAUSE.as_millis().to_string())
        .arg("ALL")
        .query_async(&mut admin)
        .await
        .unwrap();
    let paused = Instant::now();
    let calls: Vec<_> = (0..32)
        .map(|_| {
            let (store, policy) = (store.clone(), policy.clone());
            tokio::spawn(async move {
                let began = Instant::now();
                let answer = store.check_one(b"k", &policy, 1).await;
                (began.elapsed(), answer)
            })
        })
        .collect();
    for call in calls {
        let (took, answer) = call.await.unwrap();
        assert!(answer.is_err(), "answered while paused: {answer:?}");
        assert!(took <= TIMEOUT + SLACK, "an answer took {took:?}");
    }
    let answered = paused.elapsed();
    assert!(answered < PAUSE, "answers came {answered:?} into the pause");

    // When the pause ends, decisions come back. (The timed-out calls were already sent;
    // Redis may still run them then, so a timeout is not a promise that nothing counted.)
    let mut back = None;
    for _ in 0..200 {
        if let Ok(d) = store.check_one(b"k", &policy, 1).await {
            back = Some((paused.elapsed(), d));
            break;
        }
        // A failed call took the whole timeout: no sleep needed between tries.
    }
    let (back, decision) = back.expect("decisions after the pause");
    // Not before the pause ends (a clock's grain early at most), and not long after.
    assert!(
        back >= PAUSE - Duration::from_millis(50) && back < PAUSE + RECOVER_WITHIN,
        "decisions came back {back:?} into a {PAUSE:?} pause"
    );
    println!(
        "CLIENT PAUSE {PAUSE:?}: 32 concurrent calls answered (errors) within {answered:?}; \
         decisions back after {back:?}, remaining {} of 1000",
        decision.remaining()
    );
}

// Redis stops answering: the calls waiting fail when the stall is detected (no reply
// for 25 ms), not at their 5 s timeout. Redis runs them when it is back, and their
// charges stand: the window counts every call sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_fails_the_waiting_calls_when_detected_not_at_their_timeout() {
    let server = RedisServer::start();
    let store = unguarded()
        .timeout(Duration::from_secs(5))
        .stall_after(Duration::from_millis(25))
        .connect(&server.url())
        .await
        .unwrap();
    let policy = Policy::new(
        "stall",
        Algorithm::FixedWindow,
        Quota::per_hour(1_000).unwrap(),
    )
    .unwrap();
    assert!(
        store
            .check_one(b"k", &policy, 1)
            .await
            .unwrap()
            .is_allowed()
    );
    // Scripts wait; the admin connection still works.
    let mut admin = server.connection().await;
    support::redis::pause_writes(&mut admin).await;
    let paused = Instant::now();
    let calls: Vec<_> = (0..32)
        .map(|_| {
            let (store, policy) = (store.clone(), policy.clone());
            tokio::spawn(async move { store.check_one(b"k", &policy, 1).await })
        })
        .collect();
    for call in calls {
        let answer = call.await.unwrap();
        let error = answer.expect_err("no answer while paused");
        assert!(error.to_string().contains("stalled"), "{error}");
    }
    let answered = paused.elapsed();
    // The timeout is 5 s: well within it, whatever runs beside the test.
    assert!(
        answered < Duration::from_secs(2),
        "answered after {answered:?}"
    );
    support::redis::unpause(&mut admin).await;
    let after = store.check_one(b"k", &policy, 1).await.unwrap();
    assert_eq!(after.remaining(), 1_000 - 34, "the 32 stalled calls ran");
}

// A busy gateway is not a stalled Redis: its two workers are held 30 ms at a time by
// tasks that never yield, while 64 callers call Redis back to back with the default
// watch (a stall after 20 ms). The replies wait unread in the socket: every call is
// answered by Redis. The CPU flood of tollway-server is measured in BENCHMARKS.md
// ("Fleet and outages").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_gateway_is_not_a_stalled_redis() {
    let server = RedisServer::start();
    let store = unguarded()
        .stall_after(Duration::from_millis(20))
        .connect(&server.url())
        .await
        .unwrap();
    let policy = Policy::new(
        "busy",
        Algorithm::Gcra,
        Quota::per_second(1_000_000).unwrap(),
    )
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let hogs: Vec<_> = (0..2)
        .map(|_| {
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let held = Instant::now();
                    while held.elapsed() < Duration::from_millis(30) {
                        std::hint::spin_loop();
                    }
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    let callers: Vec<_> = (0..64u32)
        .map(|c| {
            let (store, policy) = (store.clone(), policy.clone());
            tokio::spawn(async move {
                let key = format!("k{c}");
                for _ in 0..(6_400 / 64) {
                    store
                        .check_one(key.as_bytes(), &policy, 1)
                        .await
                        .expect("a busy gateway's Redis answers");
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for hog in hogs {
        hog.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_mid_load_fails_no_decision() {
    const TASKS: usize = 16;
    const PER_TASK: usize = 150;
    const LIMIT: u64 = 250;
    let server = RedisServer::start();
    let clock = ManualClock::at_micros(EPOCH_US);
    let mut gateways = Vec::new();
    for _ in 0..2 {
        // No deny cache: every request is a script call that a flush can hit.
        gateways.push(
            builder(&clock)
                .deny_cache(0)
                .connect(&server.url())
                .await
                .unwrap(),
        );
    }
    let policy = Policy::new(
        "flush",
        Algorithm::SlidingWindowLog,
        Quota::per_minute(250).unwrap(),
    )
    .unwrap();
    let tasks: Vec<JoinHandle<(usize, u64, Vec<StoreError>)>> = (0..TASKS)
        .map(|t| {
            let store = gateways[t % 2].clone();
            let policy = policy.clone();
            let key = t / 2 % 4;
            tokio::spawn(async move {
                let (mut admitted, mut errors) = (0, Vec::new());
                for _ in 0..PER_TASK {
                    match store
                        .check_one(format!("k{key}").as_bytes(), &policy, 1)
                        .await
                    {
                        Ok(d) => admitted += u64::from(d.is_allowed()),
                        Err(e) => errors.push(e),
                    }
                }
                (key, admitted, errors)
            })
        })
        .collect();
    let mut admin = server.connection().await;
    let mut flushes = 0;
    while flushes < 1_000 && !tasks.iter().all(JoinHandle::is_finished) {
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
        flushes += 1;
        // Each flush is a round trip: that paces the loop, and the load runs meanwhile.
        tokio::task::yield_now().await;
    }
    let mut admitted = [0u64; 4];
    for task in tasks {
        let (key, n, errors) = task.await.unwrap();
        assert!(errors.is_empty(), "failed decisions: {errors:?}");
        admitted[key] += n;
    }
    // Exact, as if nothing had happened: each key admitted its limit.
    assert_eq!(admitted, [LIMIT; 4]);
    // The flushes did land mid-load: scripts were reloaded with EVAL after NOSCRIPT.
    let reloads = command_calls(&mut admin, "eval").await;
    assert!(
        flushes >= 3 && reloads >= 3,
        "{flushes} flushes, {reloads} reloads"
    );
    println!(
        "{} decisions, {flushes} SCRIPT FLUSHes, {reloads} reloads by EVAL, none failed",
        TASKS * PER_TASK
    );
}
