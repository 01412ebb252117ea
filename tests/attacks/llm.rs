//! The LLM gateway example (`demo::llm`) against a hostile client, over real HTTP: a
//! stream cut before the model's usage event, and calls that ask for no tokens.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use demo::llm;
use futures_util::StreamExt;
use support::http::{Server, completion};
use support::{keep_time_moving, shared_server, unique_prefix, within};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tollway_core::{MemoryStore, Operation, Store};
use tollway_tower::TokioClock;
use tollway_tower::config::LimitsFile;

/// The example's limits file, as shipped.
const SHIPPED: &str = include_str!("../../examples/llm_gateway.toml");

/// The shipped limits with the token budget's quota changed to `limit` a `period`, its
/// cost between 1 and `max` (`default` unsaid).
fn shipped_with(limit: u32, period: &str, default: u32, max: u32) -> String {
    let text = SHIPPED
        .replace(
            "limit = 20_000\nperiod = \"1m\"",
            &format!("limit = {limit}\nperiod = \"{period}\""),
        )
        .replace(
            "default = 1_000, max = 4_096",
            &format!("default = {default}, max = {max}"),
        );
    assert!(
        !text.contains("20_000") && !text.contains("4_096"),
        "the shipped file changed: {text}"
    );
    text
}

/// A model whose streams the test holds: `simulate_tokens` token events at once, then
/// (with `"hold": true`) nothing more until its client goes away, which it reports on
/// `ended`; else its usage and `[DONE]`.
fn holding_model(ended: mpsc::UnboundedSender<()>) -> Router {
    Router::new().route(
        "/v1/completions",
        post(move |request: Request| {
            let ended = ended.clone();
            async move {
                let body = axum::body::to_bytes(request.into_body(), llm::MAX_BODY)
                    .await
                    .unwrap();
                let call: serde_json::Value = serde_json::from_slice(&body).unwrap();
                let tokens = call["simulate_tokens"].as_u64().unwrap();
                let hold = call["hold"].as_bool().unwrap_or(false);
                let guard = Ended(ended);
                let token =
                    || Ok::<_, Infallible>(Bytes::from_static(b"data: {\"token\":\"tok\"}\n\n"));
                let events = futures_util::stream::iter((0..tokens).map(move |_| token()));
                let rest: Vec<Result<Bytes, Infallible>> = vec![
                    Ok(Bytes::from(format!(
                        "data: {{\"usage\":{{\"completion_tokens\":{tokens}}}}}\n\n"
                    ))),
                    Ok(Bytes::from_static(b"data: [DONE]\n\n")),
                ];
                let tail = if hold {
                    futures_util::stream::pending().boxed()
                } else {
                    futures_util::stream::iter(rest).boxed()
                };
                let stream = events.chain(tail).map(move |event| {
                    let _ = &guard;
                    event
                });
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(stream))
                    .unwrap()
                    .into_response()
            }
        }),
    )
}

/// Reports on drop that a stream of the model ended.
struct Ended(mpsc::UnboundedSender<()>);

impl Drop for Ended {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// A completion call of team-1's through `gateway`: its status, and the token events it
/// read (see [`completion`]).
async fn complete(gateway: &Server, body: &str, cut_after: Option<u64>) -> (u16, u64) {
    let team = [("x-api-key", "team-1-key")];
    let (status, tokens) = completion(gateway.addr(), &team, body, cut_after).await;
    (status.as_u16(), tokens)
}

/// The cut, on a store: a call reserves 40 tokens, reads 30, and hangs up before the
/// model's usage event. Refunded as "unsettled", it would stream for free, call after
/// call; it is charged the 30 it got, so 70 of 100 are left.
async fn a_cut_stream_is_charged_what_it_delivered<St: Store + Clone>(store: St) {
    let (ended, mut model_ended) = mpsc::unbounded_channel();
    let model = Server::start(holding_model(ended)).await;
    // 100 tokens an hour: what a cut call was charged shows in what the next may reserve.
    let file = LimitsFile::parse("hourly.toml", &shipped_with(100, "1h", 10, 100)).unwrap();
    let layer = file.layer(store, file.key().unwrap()).unwrap();
    let (store, tokens) = (layer.store(), layer.policy("tokens").unwrap());
    let gateway = Server::start(llm::limited(model.addr(), layer)).await;

    let cut = r#"{"max_tokens":40,"simulate_tokens":30,"hold":true}"#;
    let (status, read) = within("the cut call", 10, complete(&gateway, cut, Some(30))).await;
    assert_eq!((status, read), (200, 30));
    // The gateway settles a call cut short as it lets go of the model's stream: at once
    // in memory, a round trip later in Redis (which may first load the script).
    within("the model's stream to end", 10, model_ended.recv()).await;
    within("the settlement", 10, async {
        loop {
            let left = store
                .operate(b"key:team-1-key", &[&tokens], Operation::Peek(1))
                .await
                .unwrap()[0]
                .remaining();
            // Reserved 40 when admitted; 30 once settled.
            if left <= 70 {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;

    // 70 left, whatever a few seconds refill (100 an hour): 75 cannot be reserved...
    let more = r#"{"max_tokens":75,"simulate_tokens":1}"#;
    let (status, _) = within("a call of 75", 10, complete(&gateway, more, None)).await;
    assert_eq!(
        status, 429,
        "75 tokens reserved after a cut call that got 30"
    );
    // ...and 70 can.
    let fits = r#"{"max_tokens":70,"simulate_tokens":1}"#;
    let (status, read) = within("a call of 70", 10, complete(&gateway, fits, None)).await;
    assert_eq!(
        (status, read),
        (200, 1),
        "the cut call was charged no more than it got"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_before_its_usage_is_charged_what_it_delivered_in_memory() {
    a_cut_stream_is_charged_what_it_delivered(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_before_its_usage_is_charged_what_it_delivered_on_redis() {
    // A timeout a loaded machine cannot reach: a settlement that timed out would be
    // dropped, and the test would see a budget that was never charged.
    let store = support::redis_store()
        .prefix(unique_prefix("llm-cut"))
        .timeout(Duration::from_secs(30))
        .connect(&shared_server().url())
        .await
        .unwrap();
    a_cut_stream_is_charged_what_it_delivered(store).await;
}

/// 100 tokens a second (capacity 100), each call's cost in its own `x-max-tokens` (a
/// service that takes the client's number), and 4 calls at once.
const CLIENT_COST: &str = r#"
[layer]
default = "tokens"

[policies.tokens]
algorithm = "token_bucket"
limit = 100
period = "1s"
cost = { header = "x-max-tokens", default = 10, written_by = "client" }
settle = { unsettled = "refund" }

[policies.calls]
algorithm = "concurrency"
limit = 4
period = "30s"

[[routes]]
path = "/v1/completions"
policy = "calls"
"#;

// Calls that say they cost 0 tokens and use 500 each, as many at once as allowed, to a
// service that reports what they used. At cost 0 they passed an empty budget, and what
// they used past one capacity was let go: they went on every two capacities' refill.
// Each costs 1 now, and the debt is kept until it is paid: the calls in flight when the
// budget ran dry are all they get.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn calls_that_say_they_cost_nothing_stay_within_the_budget_and_one_overdraft() {
    const RUN: Duration = Duration::from_secs(10);
    const AT_ONCE: u64 = 4;
    const USED: u64 = 500;
    let _time = keep_time_moving();
    let file = LimitsFile::parse("client-cost.toml", CLIENT_COST).unwrap();
    let store = MemoryStore::builder()
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let layer = file.layer(store, file.key().unwrap()).unwrap();
    // The service uses 500 tokens a call, and says so.
    let app = Router::new()
        .route(
            "/v1/completions",
            post(|request: Request| async move {
                if let Some(usage) = request.extensions().get::<tollway_tower::Usage>() {
                    usage.add(500);
                }
                "data: {\"token\":\"tok\"}\n\n".repeat(500)
            }),
        )
        .layer(layer);
    let server = Arc::new(Server::start(app).await);

    let started = Instant::now();
    let mut callers = Vec::new();
    for _ in 0..8 {
        let server = Arc::clone(&server);
        callers.push(tokio::spawn(async move {
            let mut got = 0;
            while started.elapsed() < RUN {
                let free = [("x-max-tokens", "0")];
                match completion(server.addr(), &free, "{}", None).await {
                    (status, tokens) if status == 200 => got += tokens,
                    (status, _) if status == 429 => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    (status, _) => panic!("answered {status}"),
                }
            }
            got
        }));
    }
    let mut delivered = 0;
    for caller in callers {
        delivered += caller.await.unwrap();
    }
    let budget = 100 + 100 * started.elapsed().as_secs();
    println!("calls that cost 0: {delivered} tokens delivered, budget {budget}");
    assert!(delivered >= USED, "{delivered}: the first calls got theirs");
    assert!(
        delivered <= budget + AT_ONCE * USED,
        "{delivered} tokens, over the budget {budget} and what {AT_ONCE} calls in flight \
         used past it"
    );
}
