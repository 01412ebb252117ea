//! The LLM gateway example as shipped, an honest client and a hostile one: tokens each
//! got against its budget over two and a half periods.
//!
//! ```sh
//! cargo bench -p tests --bench llm_budget
//! ```
//!
//! The gateway is `demo::llm` with `examples/llm_gateway.toml` as it is in the
//! repository (20,000 tokens a minute a key, 4 streams at once), on the memory store and
//! on a `redis-server` of its own. The stand-in model streams a token a millisecond (the
//! example's streams one every 20 ms, too slowly to spend 20,000 a minute). Time is
//! tokio's, paused: the run is 150 s of it.
//!
//! - **Honest** (`team-1-key`): 4 streams at once, each call asking `max_tokens` 1,000
//!   and using 800, read to its end.
//! - **Hostile** (`team-2-key`): 4 streams at once. Every other call asks `max_tokens` 0,
//!   the others 4,096 and use it all, cut 20 tokens (20 ms) before the end: the
//!   gateway sees the client gone before the model's usage event reaches it.
//!
//! A key's budget is its capacity and what refills over the run: 20,000 + 20,000 × 2.5.

#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use demo::llm;
use support::http::{Server, completion};
use support::{RedisServer, keep_time_moving};
use tokio::time::Instant;
use tollway_core::{MemoryStore, RedisStore, Store};
use tollway_tower::TokioClock;
use tollway_tower::config::LimitsFile;

const RUN: Duration = Duration::from_secs(150);
const STREAMS: usize = 4;
/// How many tokens before its end the hostile client cuts a stream.
const CUT_BEFORE: u32 = 20;

fn main() {
    let file = LimitsFile::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/llm_gateway.toml"
    ))
    .unwrap();
    let redis = RedisServer::start();
    println!("| store | client | budget | delivered | of its budget | calls admitted | refused |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for on_redis in [false, true] {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            // Before the connection: its timeout is a timer the paused clock would jump to.
            let _time = keep_time_moving();
            let clock = TokioClock::new();
            if on_redis {
                let store = RedisStore::builder()
                    .caller_time(clock)
                    // The paused clock moves while a reply is on its way.
                    .timeout(Duration::from_secs(3_600))
                    // The paused clock moves while a reply is on its way: no stall watch either.
                    .without_stall_detection()
                    .grace(Duration::from_secs(3_600))
                    .connect(&redis.url())
                    .await
                    .unwrap();
                run("Redis", &file, store).await;
            } else {
                let store = MemoryStore::builder().clock(clock).build().unwrap();
                run("memory", &file, store).await;
            }
        });
    }
}

#[derive(Default)]
struct Tally {
    delivered: AtomicU64,
    admitted: AtomicU64,
    refused: AtomicU64,
}

async fn run<St: Store + Clone>(store_name: &str, file: &LimitsFile, store: St) {
    let streaming = Arc::new(llm::Streaming::default());
    let model = Server::start(llm::model(Duration::from_millis(1), streaming)).await;
    let layer = file.layer(store, file.key().unwrap()).unwrap();
    let gateway = Arc::new(Server::start(llm::limited(model.addr(), layer)).await);
    let started = Instant::now();
    // Name, key, the max_tokens of its calls in turn, the part of it a call uses (%),
    // whether it cuts its streams.
    let clients = [
        ("honest", "team-1-key", [1_000u32, 1_000], 80u32, false),
        ("hostile", "team-2-key", [0, 4_096], 100, true),
    ];
    let mut tallies = Vec::new();
    let mut tasks = Vec::new();
    for (name, key, max_tokens, part, cut) in clients {
        let tally = Arc::new(Tally::default());
        tallies.push((name, Arc::clone(&tally)));
        for _ in 0..STREAMS {
            let (gateway, tally) = (Arc::clone(&gateway), Arc::clone(&tally));
            tasks.push(tokio::spawn(async move {
                let mut turn = 0;
                while started.elapsed() < RUN {
                    let asked = max_tokens[turn % 2];
                    turn += 1;
                    let used = asked * part / 100;
                    let body = format!(r#"{{"max_tokens":{asked},"simulate_tokens":{used}}}"#);
                    // 20 ms before the end: the gateway sees the client gone before the
                    // model's usage event reaches it.
                    let cut_after = cut.then(|| u64::from(used.saturating_sub(CUT_BEFORE)));
                    let key = [("x-api-key", key)];
                    let (status, got) = completion(gateway.addr(), &key, &body, cut_after).await;
                    if status == http::StatusCode::OK {
                        tally.admitted.fetch_add(1, Ordering::Relaxed);
                        tally.delivered.fetch_add(got, Ordering::Relaxed);
                    } else {
                        tally.refused.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let budget = 20_000.0 + 20_000.0 * elapsed / 60.0;
    for (name, tally) in tallies {
        let delivered = tally.delivered.load(Ordering::Relaxed) as f64;
        println!(
            "| {store_name} | {name} | {budget:.0} | {delivered:.0} | {:.1} % | {} | {} |",
            delivered / budget * 100.0,
            tally.admitted.load(Ordering::Relaxed),
            tally.refused.load(Ordering::Relaxed),
        );
    }
}
