//! Limits on calls in flight through the tower service, on a memory store read through
//! tokio's paused clock: a call holds its slot from admission to the end of its body,
//! a body dropped or a request cancelled frees it, a long stream keeps it by renewal,
//! and a request refused by one limit takes nothing from another.

use std::convert::Infallible;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tollway_core::{Algorithm, MemoryStore, Policy, Quota};
use tower::{Layer, Service, ServiceExt};

use super::tests::Frames;
use crate::{GlobalKey, RateLimitLayer, ResponseBody, TokioClock};

type Boxed = tower::util::BoxCloneService<Request<()>, Response<ResponseBody<Frames>>, Infallible>;

/// A service with 2 streams in flight (slots living 30 s unrenewed) and 100 tokens a
/// minute, each call costing its `x-tokens`; its handler hands the test the sender of
/// each call's body, and hangs when asked to.
fn service() -> (Boxed, mpsc::UnboundedReceiver<mpsc::Sender<Bytes>>) {
    let streams = Policy::new(
        "streams",
        Algorithm::Concurrency,
        Quota::with_period(2, Duration::from_secs(30)).unwrap(),
    );
    let tokens = Policy::new(
        "tokens",
        Algorithm::FixedWindow,
        Quota::per_minute(100).unwrap(),
    );
    let store = MemoryStore::builder()
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(store, streams.unwrap())
        .key(GlobalKey)
        .route(None, "/llm", tokens.unwrap())
        .policy_cost("tokens", |_, _, headers, _| {
            headers
                .get("x-tokens")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        })
        .build()
        .unwrap();
    let (calls, handed) = mpsc::unbounded_channel();
    let inner = tower::service_fn(move |request: Request<()>| {
        let (frames, body) = mpsc::channel(8);
        let _ = calls.send(frames);
        let hang = request.headers().contains_key("x-hang");
        async move {
            if hang {
                std::future::pending::<()>().await;
            }
            Ok::<_, Infallible>(Response::new(Frames(body)))
        }
    });
    (Boxed::new(layer.layer(inner)), handed)
}

fn llm(headers: &[(&'static str, &'static str)]) -> Request<()> {
    let mut request = Request::get("/llm").body(()).unwrap();
    for &(name, value) in headers {
        request.headers_mut().insert(name, value.parse().unwrap());
    }
    request
}

/// Sends `request`: its response, and the sender of its body's frames if the handler
/// ran.
async fn send(
    service: &mut Boxed,
    calls: &mut mpsc::UnboundedReceiver<mpsc::Sender<Bytes>>,
    request: Request<()>,
) -> (Response<ResponseBody<Frames>>, Option<mpsc::Sender<Bytes>>) {
    let response = service.ready().await.unwrap().call(request).await.unwrap();
    (response, calls.try_recv().ok())
}

#[tokio::test(start_paused = true)]
async fn a_call_holds_its_slot_until_its_body_ends() {
    let (mut service, mut calls) = service();
    let (first, frames) = send(&mut service, &mut calls, llm(&[])).await;
    let first_frames = frames.unwrap();
    let (_second, second_frames) = send(&mut service, &mut calls, llm(&[])).await;
    assert!(second_frames.is_some());
    // Two streams in flight: a third is refused, and its handler never runs.
    let (refused, frames) = send(&mut service, &mut calls, llm(&[])).await;
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert!(frames.is_none());
    // The first stream sends a chunk: still in flight.
    first_frames.send(Bytes::from_static(b"tok")).await.unwrap();
    let mut body = first.into_body();
    assert!(body.frame().await.is_some());
    assert_eq!(
        send(&mut service, &mut calls, llm(&[])).await.0.status(),
        429
    );
    // Its last chunk, then its end: the slot is free.
    drop(first_frames);
    assert!(body.frame().await.is_none());
    assert_eq!(
        send(&mut service, &mut calls, llm(&[])).await.0.status(),
        200
    );
}

#[tokio::test(start_paused = true)]
async fn a_dropped_body_or_a_cancelled_request_frees_its_slot() {
    let (mut service, mut calls) = service();
    let (first, _frames) = send(&mut service, &mut calls, llm(&[])).await;
    // A request cancelled before its response: its future is dropped.
    let mut hanging = Box::pin(service.ready().await.unwrap().call(llm(&[("x-hang", "1")])));
    let polled = std::future::poll_fn(|cx| Poll::Ready(hanging.as_mut().poll(cx))).await;
    assert!(polled.is_pending());
    assert_eq!(
        send(&mut service, &mut calls, llm(&[])).await.0.status(),
        429
    );
    drop(hanging);
    let (second, _frames) = send(&mut service, &mut calls, llm(&[])).await;
    assert_eq!(second.status(), 200, "the cancelled request's slot is free");
    // The client goes away mid-stream: the body is dropped.
    drop(first);
    assert_eq!(
        send(&mut service, &mut calls, llm(&[])).await.0.status(),
        200
    );
}

#[tokio::test(start_paused = true)]
async fn a_long_stream_keeps_its_slot_by_renewal() {
    let (mut service, mut calls) = service();
    let (_first, _a) = send(&mut service, &mut calls, llm(&[])).await;
    let (_second, _b) = send(&mut service, &mut calls, llm(&[])).await;
    // Five minutes: ten leases of 30 s. The renewals keep both slots.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    assert_eq!(
        send(&mut service, &mut calls, llm(&[])).await.0.status(),
        429
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_refused_by_one_limit_takes_nothing_from_the_other() {
    let (mut service, mut calls) = service();
    // 150 tokens never fit: refused by the token limit, it takes no slot.
    let (refused, _) = send(&mut service, &mut calls, llm(&[("x-tokens", "150")])).await;
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["x-ratelimit-limit"], "100");
    let (_a, _fa) = send(&mut service, &mut calls, llm(&[("x-tokens", "10")])).await;
    let (b, _fb) = send(&mut service, &mut calls, llm(&[("x-tokens", "10")])).await;
    assert_eq!(b.status(), 200, "both slots were free");
    assert_eq!(b.headers()["x-ratelimit-remaining"], "0");
    // Refused by the slots: it takes no token.
    let (refused, _) = send(&mut service, &mut calls, llm(&[("x-tokens", "10")])).await;
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["x-ratelimit-limit"], "2");
    drop((_a, b));
    // 100 − 10 − 10 = 80 left: the refused request took none.
    let (c, _fc) = send(&mut service, &mut calls, llm(&[("x-tokens", "80")])).await;
    assert_eq!(c.status(), 200);
    drop(c);
    let (d, _) = send(&mut service, &mut calls, llm(&[("x-tokens", "1")])).await;
    assert_eq!(d.status(), 429);
    assert_eq!(
        d.headers()["x-ratelimit-limit"],
        "100",
        "the tokens are spent"
    );
}

/// A gRPC server stream's body: messages, then trailers (`grpc-status`), then nothing.
struct Streamed {
    messages: mpsc::Receiver<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        match std::task::ready!(self.messages.poll_recv(cx)) {
            Some(message) => Poll::Ready(Some(Ok(http_body::Frame::data(message)))),
            None => Poll::Ready(
                self.trailers
                    .take()
                    .map(|t| Ok(http_body::Frame::trailers(t))),
            ),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.trailers.is_none()
    }
}

/// A server stream (messages, then trailers) holds its slot until its trailers are
/// handed on, and they arrive whole.
#[tokio::test(start_paused = true)]
async fn a_server_stream_holds_its_slot_until_its_trailers() {
    let one = Quota::with_period(1, Duration::from_secs(30)).unwrap();
    let store = MemoryStore::builder()
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(
        store,
        Policy::new("streams", Algorithm::Concurrency, one).unwrap(),
    )
    .key(GlobalKey)
    .build()
    .unwrap();
    let (calls, mut handed) = mpsc::unbounded_channel();
    let service = layer.layer(tower::service_fn(move |_: Request<()>| {
        let (messages, receiver) = mpsc::channel(8);
        let _ = calls.send(messages);
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        async move {
            Ok::<_, Infallible>(Response::new(Streamed {
                messages: receiver,
                trailers: Some(trailers),
            }))
        }
    }));
    let call = || service.clone().oneshot(Request::new(()));
    let mut body = call().await.unwrap().into_body();
    let messages = handed.recv().await.unwrap();
    messages.send(Bytes::from_static(b"message")).await.unwrap();
    assert!(body.frame().await.unwrap().unwrap().is_data());
    drop(messages);
    assert_eq!(
        call().await.unwrap().status(),
        429,
        "streaming: the slot is held"
    );
    let trailers = body
        .frame()
        .await
        .unwrap()
        .unwrap()
        .into_trailers()
        .unwrap();
    assert_eq!(trailers["grpc-status"], "0");
    assert!(body.frame().await.is_none());
    assert_eq!(call().await.unwrap().status(), 200, "the trailers ended it");
}
