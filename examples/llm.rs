//! The LLM gateway's parts (see `examples/llm_gateway.rs`): a stand-in model API that
//! streams tokens, and the gateway in front of it that limits each API key.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde::Deserialize;
use tollway_tower::config::ConfigKey;
use tollway_tower::{RateLimitLayer, Store, Usage};

/// The largest request body the gateway reads, to find its `max_tokens`.
pub const MAX_BODY: usize = 64 * 1024;

/// The header the gateway puts a call's `max_tokens` in, for the limits file's `cost`.
pub const MAX_TOKENS: &str = "x-max-tokens";

/// The most `max_tokens` a call may ask for: the limits file's `max` for its cost. A
/// call asking more is refused, so that what it reserves is what the model may stream.
pub const MOST_TOKENS: u32 = 4_096;

/// A completion call, as the model and the gateway read it.
#[derive(Debug, Deserialize)]
pub struct Completion {
    /// The most tokens the call may use: the gateway reserves this many.
    pub max_tokens: u32,
    /// How many tokens the call uses; half of `max_tokens` when unsaid. The stand-in
    /// streams at most `max_tokens` of them, as a model does, and counts the rest as its
    /// prompt's in its usage event. (A real model decides this itself; the tests and
    /// benches choose it to set the estimate's error.)
    #[serde(default)]
    pub simulate_tokens: Option<u32>,
}

/// Calls streaming at the model, by API key: now and at most. The model counts them,
/// so that a test sees what got past the gateway.
#[derive(Debug, Default)]
pub struct Streaming {
    by_key: Mutex<HashMap<String, (usize, usize)>>,
}

impl Streaming {
    /// The most calls of `key` that streamed at once.
    pub fn most(&self, key: &str) -> usize {
        self.by_key.lock().get(key).map_or(0, |&(_, most)| most)
    }

    fn start(self: &Arc<Self>, key: String) -> StreamGuard {
        let mut by_key = self.by_key.lock();
        let (now, most) = by_key.entry(key.clone()).or_insert((0, 0));
        *now += 1;
        *most = (*most).max(*now);
        StreamGuard {
            streaming: Arc::clone(self),
            key,
        }
    }
}

/// One call streaming; counted out when its stream ends or is dropped.
struct StreamGuard {
    streaming: Arc<Streaming>,
    key: String,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if let Some((now, _)) = self.streaming.by_key.lock().get_mut(&self.key) {
            *now -= 1;
        }
    }
}

/// The stand-in model API: `POST /v1/completions` with a JSON [`Completion`] streams
/// server-sent events, one a token (`data: {"token":"tok"}`), one token every `every`,
/// at most `max_tokens` of them, then `data: {"usage":{"completion_tokens":N}}` with all
/// it used, and `data: [DONE]`.
pub fn model(every: Duration, streaming: Arc<Streaming>) -> Router {
    Router::new().route(
        "/v1/completions",
        post(move |request: Request| stream_tokens(request, every, Arc::clone(&streaming))),
    )
}

async fn stream_tokens(request: Request, every: Duration, streaming: Arc<Streaming>) -> Response {
    let key = request
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let Ok(body) = axum::body::to_bytes(request.into_body(), MAX_BODY).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let Ok(call) = serde_json::from_slice::<Completion>(&body) else {
        return (StatusCode::BAD_REQUEST, "a JSON body with max_tokens").into_response();
    };
    let used = call.simulate_tokens.unwrap_or(call.max_tokens / 2);
    let tokens = used.min(call.max_tokens);
    let guard = streaming.start(key);
    let events =
        futures_util::stream::unfold((0u32, Some(guard)), move |(sent, guard)| async move {
            let guard = guard?;
            let event = if sent < tokens {
                if !every.is_zero() {
                    tokio::time::sleep(every).await;
                }
                Bytes::from_static(b"data: {\"token\":\"tok\"}\n\n")
            } else if sent == tokens {
                Bytes::from(format!(
                    "data: {{\"usage\":{{\"completion_tokens\":{used}}}}}\n\n"
                ))
            } else if sent == tokens + 1 {
                Bytes::from_static(b"data: [DONE]\n\n")
            } else {
                return None;
            };
            Some((Ok::<_, Infallible>(event), (sent + 1, Some(guard))))
        });
    (
        [("content-type", "text/event-stream")],
        Body::from_stream(events),
    )
        .into_response()
}

/// The gateway's routes: `POST /v1/completions` forwarded to the model at `upstream`,
/// its stream handed back as it comes. The limits go around it: see [`read_max_tokens`].
pub fn gateway(upstream: SocketAddr) -> Router {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let state = Upstream {
        client,
        uri: format!("http://{upstream}/v1/completions"),
    };
    Router::new()
        .route("/v1/completions", post(forward))
        .with_state(state)
}

/// The gateway under `layer`, the limits: [`read_max_tokens`] first, then the limits,
/// then the call forwarded to the model at `upstream`.
pub fn limited<St>(upstream: SocketAddr, layer: RateLimitLayer<St, ConfigKey>) -> Router
where
    St: Store + Clone,
{
    gateway(upstream)
        .layer(layer)
        .layer(axum::middleware::from_fn(read_max_tokens))
}

#[derive(Clone)]
struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    uri: String,
}

/// A layer's middleware, outside the limits: reads the call's JSON body (at most
/// [`MAX_BODY`]) and puts its `max_tokens` in [`MAX_TOKENS`], so that the limits file
/// reserves it. It replaces whatever the client sent in that header: the gateway writes
/// it (`written_by = "gateway"` in the file). A body that is too large, not a completion,
/// or asking more than [`MOST_TOKENS`] is refused here.
pub async fn read_max_tokens(request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_BODY).await else {
        return (StatusCode::PAYLOAD_TOO_LARGE, "a body of at most 64 KiB").into_response();
    };
    let Ok(call) = serde_json::from_slice::<Completion>(&bytes) else {
        return (StatusCode::BAD_REQUEST, "a JSON body with max_tokens").into_response();
    };
    if call.max_tokens > MOST_TOKENS {
        return (StatusCode::BAD_REQUEST, "max_tokens is at most 4096").into_response();
    }
    parts
        .headers
        .insert(MAX_TOKENS, HeaderValue::from(call.max_tokens));
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// Forwards a call to the model and streams its answer back, counting its tokens as
/// they pass into the call's [`Usage`], which settles its tokens.
async fn forward(State(upstream): State<Upstream>, request: Request) -> Response {
    let usage = request.extensions().get::<Usage>().cloned();
    let key = request.headers().get("x-api-key").cloned();
    let Ok(body) = axum::body::to_bytes(request.into_body(), MAX_BODY).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let mut call = http::Request::post(&upstream.uri).header("content-type", "application/json");
    if let Some(key) = key {
        call = call.header("x-api-key", key);
    }
    let Ok(call) = call.body(Full::new(body)) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    match upstream.client.request(call).await {
        Ok(answer) => {
            let (parts, body) = answer.into_parts();
            let metered = Metered {
                inner: body,
                usage,
                line: Vec::new(),
            };
            Response::from_parts(parts, Body::new(metered))
        }
        Err(_) => (StatusCode::BAD_GATEWAY, "the model did not answer").into_response(),
    }
}

/// The model's stream, read as it passes: each token event adds one to the call's
/// [`Usage`], and the usage event's `completion_tokens` raises it to that (a model
/// counts its prompt too). A client that cuts the stream is charged what it got.
struct Metered<B> {
    inner: B,
    usage: Option<Usage>,
    /// The event read so far, across frames.
    line: Vec<u8>,
}

impl<B> http_body::Body for Metered<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(frame)) = &frame
            && let Some(data) = frame.data_ref()
        {
            self.read(data);
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

impl<B> Metered<B> {
    /// Reads `data`'s whole events; an event split across frames waits for its end.
    fn read(&mut self, data: &[u8]) {
        self.line.extend_from_slice(data);
        while let Some(end) = self.line.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.line.drain(..end + 2).collect();
            let Some(usage) = &self.usage else {
                continue;
            };
            match read_event(&event) {
                Some(Event::Token) => usage.add(1),
                Some(Event::Usage(used)) => usage.at_least(used),
                None => {}
            }
        }
        // A line that never ends is not an event: keep memory bounded.
        if self.line.len() > MAX_BODY {
            self.line.clear();
        }
    }
}

/// What a server-sent event of the model says.
enum Event {
    /// A token.
    Token,
    /// The call's usage: its `completion_tokens`.
    Usage(u64),
}

/// Reads a model's event: a token, its usage, or neither (`[DONE]`).
fn read_event(event: &[u8]) -> Option<Event> {
    let json = std::str::from_utf8(event)
        .ok()?
        .trim()
        .strip_prefix("data:")?;
    let value: serde_json::Value = serde_json::from_str(json.trim()).ok()?;
    if value.get("token").is_some() {
        return Some(Event::Token);
    }
    let used = value.get("usage")?.get("completion_tokens")?.as_u64()?;
    Some(Event::Usage(used))
}
