//! The LLM gateway example under load: three gateways (`demo::llm`, real HTTP) share one
//! Redis and a stand-in model that streams tokens, and callers of one API key send
//! calls whose estimates (`max_tokens`) are off by −50 % to +100 % of what the calls
//! use. The fleet's token spend stays within the budget plus what the calls in flight
//! used past it when it ran dry (well under a capacity here), and never more than the
//! streams allowed are in flight. The hostile client is in `tests/attacks/llm.rs`.
//!
//! Time is tokio's, paused: the stores decide on it (caller time), the model streams on
//! it, and the run lasts 6 s of it. `cargo test -p tests --test llm -- --nocapture`
//! prints the figures BENCHMARKS.md quotes.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use demo::llm;
use support::http::Server;
use support::{Rng, keep_time_moving, shared_server, unique_prefix};
use tokio::time::Instant;
use tollway_tower::TokioClock;
use tollway_tower::config::LimitsFile;

/// The example's limits (`examples/llm_gateway.toml`) at a scale a short run fills:
/// 100 tokens a second (capacity 6,000), 4 streams.
const LIMITS: &str = r#"
[layer]
default = "anonymous"

[key]
api_key = { header = "x-api-key" }

[tiers]
"team-1-key" = "team"

[policies.anonymous]
algorithm = "gcra"
limit = 10
period = "1m"

[policies.team]
algorithm = "gcra"
limit = 60_000
period = "1m"

[policies.tokens]
algorithm = "token_bucket"
limit = 6_000
period = "1m"
cost = { header = "x-max-tokens", default = 1_000 }
settle = { unsettled = "refund" }

[policies.streams]
algorithm = "concurrency"
limit = 4
period = "30s"

[[routes]]
path = "/v1/completions"
policy = "tokens"

[[routes]]
path = "/v1/completions"
policy = "streams"
"#;

const CAPACITY: f64 = 6_000.0;
const PER_SECOND: f64 = 100.0;
const STREAMS: usize = 4;
const RUN: Duration = Duration::from_secs(6);

#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    /// Tokens the model reported using, over the admitted calls.
    used: AtomicU64,
    /// Tokens the admitted calls reserved.
    reserved: AtomicU64,
    refused_tokens: AtomicU64,
    refused_streams: AtomicU64,
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_fleet_spends_its_token_budget_and_streams_no_more_than_allowed() {
    let _time = keep_time_moving();
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .unwrap();
    let streaming = Arc::new(llm::Streaming::default());
    let model = Server::start(llm::model(
        Duration::from_micros(500),
        Arc::clone(&streaming),
    ))
    .await;
    let file = LimitsFile::parse("llm.toml", LIMITS).unwrap();
    let prefix = unique_prefix("llm");
    // One clock for the fleet, as Redis's TIME would be.
    let clock = TokioClock::new();
    let mut gateways = Vec::new();
    for _ in 0..3 {
        // An hour's timeout and grace: the paused clock moves while a reply is on its way,
        // and Redis expires keys by its own clock.
        let store = support::redis_store()
            .prefix(prefix.clone())
            .caller_time(clock.clone())
            .timeout(Duration::from_secs(3_600))
            // The paused clock moves while a reply is on its way: no stall watch either.
            .without_stall_detection()
            .grace(Duration::from_secs(3_600))
            .connect(&shared_server().url())
            .await
            .unwrap();
        let layer = file.layer(store, file.key().unwrap()).unwrap();
        gateways.push(Server::start(llm::limited(model.addr(), layer)).await);
    }

    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let mut callers = Vec::new();
    for (g, gateway) in gateways.iter().enumerate() {
        for c in 0..8u64 {
            let (client, tally) = (gateway.client(), Arc::clone(&tally));
            let mut rng = Rng(0x11_0000 + g as u64 * 100 + c);
            callers.push(tokio::spawn(async move {
                while started.elapsed() < RUN {
                    // 50 to 300 tokens, estimated at half to twice that.
                    let actual = 50 + rng.below(251);
                    let estimate = actual * (50 + rng.below(151)) / 100;
                    let body = format!(r#"{{"max_tokens":{estimate},"simulate_tokens":{actual}}}"#);
                    let reply = client
                        .send_body(
                            http::Method::POST,
                            "/v1/completions",
                            &[("x-api-key", "team-1-key")],
                            body.into(),
                        )
                        .await;
                    match (reply.status.as_u16(), reply.header("x-ratelimit-limit")) {
                        (200, _) => {
                            let used = usage(&reply.body).expect("a usage event");
                            assert_eq!(used, actual);
                            tally.admitted.fetch_add(1, Ordering::Relaxed);
                            tally.used.fetch_add(used, Ordering::Relaxed);
                            tally.reserved.fetch_add(estimate, Ordering::Relaxed);
                        }
                        (429, Some("4")) => {
                            tally.refused_streams.fetch_add(1, Ordering::Relaxed);
                            // A stream ends within a fraction of a second here.
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        (429, _) => {
                            tally.refused_tokens.fetch_add(1, Ordering::Relaxed);
                            // Back off as told, a little: the bucket refills 100 a second.
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        (status, _) => panic!("answered {status}: {}", reply.body),
                    }
                }
            }));
        }
    }
    for caller in callers {
        caller.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let used = tally.used.load(Ordering::Relaxed) as f64;
    let budget = CAPACITY + PER_SECOND * elapsed;
    let most = streaming.most("team-1-key");
    println!(
        "{:.1} s, 3 gateways x 8 callers: {} calls admitted ({} tokens reserved, {} used), \
         {} refused by tokens, {} by streams",
        elapsed,
        tally.admitted.load(Ordering::Relaxed),
        tally.reserved.load(Ordering::Relaxed),
        used,
        tally.refused_tokens.load(Ordering::Relaxed),
        tally.refused_streams.load(Ordering::Relaxed),
    );
    println!(
        "budget {budget:.0} tokens (capacity + refill); used {used:.0}: {:+.1} % of the \
         budget, {:+.1} % of one capacity; at most {most} streams at once (limit {STREAMS})",
        (used - budget) / budget * 100.0,
        (used - budget) / CAPACITY * 100.0,
    );
    assert!(
        used <= budget + CAPACITY,
        "spent {used} tokens, over the budget {budget:.0} and one capacity of debt"
    );
    assert!(
        used >= 0.9 * budget,
        "spent {used} of {budget:.0}: the budget was not used"
    );
    assert_eq!(most, STREAMS, "the streams' ceiling was reached and held");

    // The metrics tell the settlements and the slots: none held once all have ended.
    let scrape = metrics.render();
    let value = |series: &str| {
        scrape
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert_eq!(
        value(r#"tollway_in_flight{policy="streams"}"#),
        0.0,
        "{scrape}"
    );
    let settled = |how: &str| {
        value(&format!(
            r#"tollway_settlements_total{{policy="tokens",settled="{how}"}}"#
        ))
    };
    let admitted = tally.admitted.load(Ordering::Relaxed) as f64;
    assert!(
        settled("charged") > 0.0 && settled("refunded") > 0.0,
        "{scrape}"
    );
    assert_eq!(
        settled("charged") + settled("refunded") + settled("exact"),
        admitted,
        "{scrape}"
    );
}

/// The `completion_tokens` of the usage event in a stream.
fn usage(stream: &str) -> Option<u64> {
    let line = stream.lines().find(|l| l.contains("\"usage\""))?;
    let value: serde_json::Value = serde_json::from_str(line.strip_prefix("data:")?.trim()).ok()?;
    value["usage"]["completion_tokens"].as_u64()
}
