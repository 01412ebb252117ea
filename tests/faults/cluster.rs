//! A cluster master killed under load.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_cluster_master_is_replaced_and_the_limiter_carries_on() {
    let mut cluster = RedisCluster::start().await;
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let redis = unguarded().connect_cluster(&urls).await.unwrap();
    let store = CircuitBreaker::builder(redis)
        .threshold(5)
        .cool_down(COOL_DOWN)
        .local_fallback(0.5)
        .build()
        .unwrap();
    let policy = Policy::new(
        "failover",
        Algorithm::Gcra,
        Quota::per_second(1_000_000).unwrap(),
    )
    .unwrap();
    let callers: Vec<String> = (0..24).map(|c| format!("caller-{c}")).collect();
    // GCRA keeps one Redis key per caller.
    let keys: Vec<String> = callers
        .iter()
        .map(|c| store.primary().state_key(c.as_bytes(), &policy))
        .collect();
    cluster.assert_on_every_master(&keys).await;
    let owners = cluster.masters_of(&keys).await;
    let victim = owners[&keys[0]];
    let orphans: Vec<usize> = (0..callers.len())
        .filter(|&c| owners[&keys[c]] == victim)
        .collect();
    let redis_limit = store
        .check_one(b"warm-up", &policy, 1)
        .await
        .unwrap()
        .limit();
    let load = Load::start(&store, &policy, &callers, redis_limit);
    let within = WAIT_WITHIN;
    wait_for("answers from Redis", within, &load, || {
        load.redis_answers() >= 100
    })
    .await;

    // State held only by the dead master (writes its replica had not received yet) is
    // lost with it: its callers' limits restart from what the replica had, at worst
    // from nothing. The limiter itself carries on.
    let killed = load.now();
    let (promoted, failover) = cluster.kill_master(victim).await;
    let settled = load.now();
    let every_caller_back = holds_within(within, &load, || {
        (0..callers.len()).all(|c| load.redis_answered_since(c, settled))
    })
    .await;
    if !every_caller_back {
        // Say what the store answers those callers now, past the breaker.
        let mut now = String::new();
        for c in (0..callers.len()).filter(|&c| !load.redis_answered_since(c, settled)) {
            let answer = store
                .primary()
                .check_one(callers[c].as_bytes(), &policy, 1)
                .await;
            let owner = if orphans.contains(&c) {
                "the dead master's"
            } else {
                "a live master's"
            };
            now.push_str(&format!("\n  caller {c} ({owner}): {answer:?}"));
        }
        panic!(
            "waited {within:?} after the cluster settled for decisions from Redis for every \
             caller; breaker {:?}; none came for these, which Redis answers now:{now}",
            store.state()
        );
    }
    let answers = load.finish().await;

    let slowest = slowest(&answers);
    assert!(slowest <= TIMEOUT + SLACK, "an answer took {slowest:?}");
    assert_eq!(count(&answers, Source::Error), 0);
    let back = orphans
        .iter()
        .map(|&c| {
            answers
                .iter()
                .filter(|a| a.caller == c && a.source == Source::Redis && a.began >= settled)
                .map(|a| a.ended - settled)
                .min()
                .unwrap()
        })
        .max()
        .unwrap();
    assert!(back < RECOVER_WITHIN, "{back:?}");
    println!(
        "master {victim} killed at {killed:?}; replica {promoted} took over, cluster settled \
         {failover:?} later; the dead master's {} callers reached Redis again {back:?} after \
         that; {} answers, {} local, slowest {slowest:?}",
        orphans.len(),
        answers.len(),
        count(&answers, Source::Fallback)
    );
}
