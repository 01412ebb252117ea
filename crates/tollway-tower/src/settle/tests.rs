//! Reserve, then settle, through the tower service: a call reserves its estimate, and
//! the budget is settled to what it used when its body ends, or by the rule when it
//! stops short. The budget is read by a request of cost 1 that reports using nothing:
//! its headers report what is left after its own unit.

use std::convert::Infallible;
use std::future::{Future, Ready};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tollway_core::{
    Algorithm, Checked, Decisions, ManualClock, MemoryStore, Operation, Policy, Quota, Store,
    StoreError,
};
use tower::{Layer, Service, ServiceExt};

use super::*;
use crate::{GlobalKey, RateLimitLayer, ResponseBody};

/// A body whose frames the test sends; it ends when the sender is dropped.
pub(super) struct Frames(pub(super) mpsc::Receiver<Bytes>);

impl Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// What the handler of a call hands the test: the usage to report into, and the sender
/// of its body's frames.
struct Call {
    usage: Option<Usage>,
    frames: mpsc::Sender<Bytes>,
}

/// A memory store that answers through its future, as Redis does.
#[derive(Clone)]
struct Later(MemoryStore<ManualClock>);

impl Store for Later {
    type Future = Ready<Result<Decisions, StoreError>>;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future> {
        later(self.0.check(key, policies, cost))
    }

    fn check_each(&self, key: &[u8], policies: &[&Policy], costs: &[u64]) -> Checked<Self::Future> {
        later(self.0.check_each(key, policies, costs))
    }

    fn operate(&self, key: &[u8], policies: &[&Policy], op: Operation) -> Checked<Self::Future> {
        later(self.0.operate(key, policies, op))
    }

    fn supports_each_cost(&self) -> Result<(), tollway_core::ConfigError> {
        Ok(())
    }
}

fn later(
    answer: Checked<Ready<Result<Decisions, StoreError>>>,
) -> Checked<Ready<Result<Decisions, StoreError>>> {
    match answer {
        Checked::Ready(answer) => Checked::Pending(std::future::ready(answer)),
        pending => pending,
    }
}

/// A service limited to 100 tokens a minute on `/llm`, each call reserving `x-max`
/// (default 50) and settled to the `x-used` its response reports, if any. Its handler
/// hands each call to the test and answers with the headers the request asked for.
fn service<St: Store>(
    store: St,
    unsettled: Unsettled,
) -> (
    impl Service<
        Request<()>,
        Response = Response<ResponseBody<Frames>>,
        Error = std::io::Error,
        Future: Send,
    > + Clone,
    mpsc::UnboundedReceiver<Call>,
) {
    let requests = Policy::new(
        "requests",
        Algorithm::Gcra,
        Quota::per_minute(1_000).unwrap(),
    );
    let tokens = Policy::new(
        "tokens",
        Algorithm::TokenBucket,
        Quota::per_minute(100).unwrap(),
    );
    let layer = RateLimitLayer::builder(store, requests.unwrap())
        .key(GlobalKey)
        .route(None, "/llm", tokens.unwrap())
        .policy_cost("tokens", |_, _, headers, _| {
            number(headers, "x-max").unwrap_or(50)
        })
        .settle("tokens", |_, headers, _| number(headers, "x-used"))
        .on_unsettled(unsettled)
        .build()
        .unwrap();
    let (calls, handed) = mpsc::unbounded_channel();
    let inner = tower::service_fn(move |request: Request<()>| {
        let (frames, body) = mpsc::channel(8);
        let _ = calls.send(Call {
            usage: request.extensions().get::<Usage>().cloned(),
            frames,
        });
        let failed = request.headers().contains_key("x-fail");
        let hang = request.headers().contains_key("x-hang");
        let used = request.headers().get("x-reply-used").cloned();
        let status = number(request.headers(), "x-status")
            .and_then(|s| http::StatusCode::from_u16(u16::try_from(s).ok()?).ok());
        async move {
            if hang {
                std::future::pending::<()>().await;
            }
            if failed {
                return Err(std::io::Error::other("the handler failed"));
            }
            let mut response = Response::new(Frames(body));
            if let Some(status) = status {
                *response.status_mut() = status;
            }
            if let Some(used) = used {
                response.headers_mut().insert("x-used", used);
            }
            Ok(response)
        }
    });
    (layer.layer(inner), handed)
}

fn number(headers: &http::HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.parse().ok()
}

fn llm(headers: &[(&str, &str)]) -> Request<()> {
    let mut request = Request::get("/llm").body(()).unwrap();
    for &(name, value) in headers {
        request.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    request
}

/// The tokens left: a request that reserves 1 and reports using none reports them (its
/// own unit aside), and is settled back to where it found the budget.
async fn tokens_left<S>(service: &mut S, calls: &mut mpsc::UnboundedReceiver<Call>) -> String
where
    S: Service<Request<()>, Response = Response<ResponseBody<Frames>>, Error = std::io::Error>,
{
    let response = service
        .ready()
        .await
        .unwrap()
        .call(llm(&[("x-max", "1"), ("x-reply-used", "0")]))
        .await
        .unwrap();
    drop(calls.recv().await);
    let left: u64 = number(response.headers(), "x-ratelimit-remaining").unwrap();
    response.into_body().collect().await.unwrap();
    (left + 1).to_string()
}

fn store() -> MemoryStore<ManualClock> {
    MemoryStore::builder()
        .clock(ManualClock::new())
        .build()
        .unwrap()
}

/// Sends `request` and returns its response and the call its handler handed over.
async fn send<S>(
    service: &mut S,
    calls: &mut mpsc::UnboundedReceiver<Call>,
    request: Request<()>,
) -> (Response<ResponseBody<Frames>>, Call)
where
    S: Service<Request<()>, Response = Response<ResponseBody<Frames>>, Error = std::io::Error>,
{
    let response = service.ready().await.unwrap().call(request).await.unwrap();
    (response, calls.recv().await.unwrap())
}

#[tokio::test]
async fn a_call_reserves_its_estimate_and_is_settled_to_what_it_used_at_its_end() {
    for answers_later in [false, true] {
        let (mut service, mut calls) = either(answers_later, Unsettled::Keep);
        // Used less than reserved: the rest comes back when the body ends.
        let request = llm(&[("x-max", "50"), ("x-reply-used", "20")]);
        let (response, call) = send(&mut service, &mut calls, request).await;
        assert!(call.usage.is_some(), "the handler gets a Usage");
        assert_eq!(
            tokens_left(&mut service, &mut calls).await,
            "50",
            "reserved"
        );
        call.frames
            .send(Bytes::from_static(b"answer"))
            .await
            .unwrap();
        drop(call.frames);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"answer");
        assert_eq!(
            tokens_left(&mut service, &mut calls).await,
            "80",
            "settled to 20"
        );

        // Used more: the rest is charged.
        let request = llm(&[("x-max", "10"), ("x-reply-used", "70")]);
        let (response, call) = send(&mut service, &mut calls, request).await;
        drop(call.frames);
        response.into_body().collect().await.unwrap();
        assert_eq!(
            tokens_left(&mut service, &mut calls).await,
            "10",
            "settled to 70"
        );
    }
}

/// [`service`] on a memory store that answers at once, or (`answers_later`) through
/// its future, as Redis does: one type for both.
fn either(answers_later: bool, unsettled: Unsettled) -> (Boxed, mpsc::UnboundedReceiver<Call>) {
    if answers_later {
        let (service, calls) = service(Later(store()), unsettled);
        (tollway_boxed(service), calls)
    } else {
        let (service, calls) = service(store(), unsettled);
        (tollway_boxed(service), calls)
    }
}

/// The service, boxed.
type Boxed =
    tower::util::BoxCloneService<Request<()>, Response<ResponseBody<Frames>>, std::io::Error>;

/// The service boxed, so that the two stores' services are one type.
fn tollway_boxed<S>(service: S) -> Boxed
where
    S: Service<Request<()>, Response = Response<ResponseBody<Frames>>, Error = std::io::Error>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    tower::util::BoxCloneService::new(service)
}

#[tokio::test]
async fn a_streamed_answer_is_settled_to_what_its_handler_reported_when_it_ends() {
    let (mut service, mut calls) = service(store(), Unsettled::Keep);
    let (response, call) = send(&mut service, &mut calls, llm(&[("x-max", "60")])).await;
    let usage = call.usage.unwrap();
    let mut body = response.into_body();
    for _ in 0..3 {
        usage.add(10);
        call.frames
            .send(Bytes::from_static(b"token"))
            .await
            .unwrap();
        assert!(body.frame().await.unwrap().unwrap().is_data());
    }
    // Still streaming: the reservation stands.
    assert_eq!(tokens_left(&mut service, &mut calls).await, "40");
    drop(call.frames);
    assert!(body.frame().await.is_none());
    assert_eq!(tokens_left(&mut service, &mut calls).await, "70");
}

#[tokio::test]
async fn a_body_dropped_mid_stream_is_settled_to_what_was_reported() {
    for answers_later in [false, true] {
        let (mut service, mut calls) = either(answers_later, Unsettled::Keep);
        let (response, call) = send(&mut service, &mut calls, llm(&[("x-max", "60")])).await;
        call.usage.unwrap().add(10);
        call.frames
            .send(Bytes::from_static(b"token"))
            .await
            .unwrap();
        let mut body = response.into_body();
        assert!(body.frame().await.is_some());
        // The client goes away.
        drop(body);
        // A store that answers later settles on a task of its own.
        tokio::task::yield_now().await;
        assert_eq!(
            tokens_left(&mut service, &mut calls).await,
            "90",
            "later: {answers_later}"
        );
    }
}

#[tokio::test]
async fn an_unreported_call_keeps_its_reservation_unless_it_failed_and_the_rule_refunds() {
    for (rule, status, left) in [
        (Unsettled::Keep, "200", "50"),
        (Unsettled::Keep, "503", "50"),
        // Answered: a response that started is not refunded.
        (Unsettled::Refund, "200", "50"),
        // Failed: an error status.
        (Unsettled::Refund, "503", "100"),
        (Unsettled::Refund, "400", "100"),
    ] {
        let (mut service, mut calls) = service(store(), rule);
        let request = llm(&[("x-max", "50"), ("x-status", status)]);
        let (response, call) = send(&mut service, &mut calls, request).await;
        drop(call.frames);
        response.into_body().collect().await.unwrap();
        assert_eq!(
            tokens_left(&mut service, &mut calls).await,
            left,
            "{rule:?}, {status}"
        );
    }
}

// The attack this rule stops: a client read every token, then hung up before the
// model's usage event. Refunded, it streamed for free, call after call.
#[tokio::test]
async fn a_stream_its_client_cut_is_charged_what_it_delivered_under_either_rule() {
    for rule in [Unsettled::Keep, Unsettled::Refund] {
        for answers_later in [false, true] {
            let (mut service, mut calls) = either(answers_later, rule);
            // Counted as it streams: 3 of 50 tokens delivered, then the client leaves.
            let (response, call) = send(&mut service, &mut calls, llm(&[("x-max", "50")])).await;
            let usage = call.usage.unwrap();
            let mut body = response.into_body();
            for _ in 0..3 {
                usage.add(1);
                call.frames.send(Bytes::from_static(b"tok")).await.unwrap();
                assert!(body.frame().await.is_some());
            }
            drop(body);
            tokio::task::yield_now().await;
            assert_eq!(
                tokens_left(&mut service, &mut calls).await,
                "97",
                "{rule:?}, later: {answers_later}"
            );
            // Nothing counted, the usage event never reached: the reservation stands.
            let (response, call) = send(&mut service, &mut calls, llm(&[("x-max", "50")])).await;
            call.frames.send(Bytes::from_static(b"tok")).await.unwrap();
            let mut body = response.into_body();
            assert!(body.frame().await.is_some());
            drop(body);
            tokio::task::yield_now().await;
            assert_eq!(
                tokens_left(&mut service, &mut calls).await,
                "47",
                "{rule:?}, later: {answers_later}"
            );
        }
    }
}

#[tokio::test]
async fn a_call_that_fails_or_whose_client_goes_away_is_settled_by_the_rule() {
    for (rule, left) in [(Unsettled::Keep, "50"), (Unsettled::Refund, "100")] {
        let (mut service, mut calls) = service(store(), rule);
        let request = llm(&[("x-max", "50"), ("x-fail", "1")]);
        let failed = service.ready().await.unwrap().call(request).await;
        assert!(failed.is_err());
        drop(calls.recv().await);
        assert_eq!(
            tokens_left(&mut service, &mut calls).await,
            left,
            "failed, {rule:?}"
        );
    }
    // The client goes away before the response: the response future is dropped.
    for (rule, left) in [(Unsettled::Keep, "50"), (Unsettled::Refund, "100")] {
        let (mut service, mut calls) = service(store(), rule);
        let request = llm(&[("x-max", "50"), ("x-hang", "1")]);
        let mut future = Box::pin(service.ready().await.unwrap().call(request));
        let polled = std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await;
        assert!(polled.is_pending(), "the handler never answers");
        drop(calls.recv().await);
        drop(future);
        assert_eq!(
            tokens_left(&mut service, &mut calls).await,
            left,
            "gone, {rule:?}"
        );
    }
}

/// A memory store whose charges and refunds never answer.
#[derive(Clone)]
struct Stalled(MemoryStore<ManualClock>);

type Never = Pin<Box<dyn Future<Output = Result<Decisions, StoreError>> + Send>>;

impl Store for Stalled {
    type Future = Never;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Never> {
        Checked::Ready(self.0.check(key, policies, cost).into_ready())
    }

    fn check_each(&self, key: &[u8], policies: &[&Policy], costs: &[u64]) -> Checked<Never> {
        Checked::Ready(self.0.check_each(key, policies, costs).into_ready())
    }

    fn operate(&self, _: &[u8], _: &[&Policy], _: Operation) -> Checked<Never> {
        Checked::Pending(Box::pin(std::future::pending()))
    }

    fn supports_each_cost(&self) -> Result<(), tollway_core::ConfigError> {
        Ok(())
    }
}

trait IntoReady {
    fn into_ready(self) -> Result<Decisions, StoreError>;
}

impl<F> IntoReady for Checked<F> {
    fn into_ready(self) -> Result<Decisions, StoreError> {
        match self {
            Checked::Ready(answer) => answer,
            Checked::Pending(_) => panic!("the memory store answers at once"),
        }
    }
}

// A settlement still waiting on its store when the runtime shut down: the runtime drops
// its task as it spawns one, and each drop spawned the rest anew, until the stack
// overflowed. It is abandoned now, and told as failed.
#[test]
fn a_settlement_waiting_when_its_runtime_shuts_down_is_abandoned() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (mut service, mut calls) = service(Stalled(store()), Unsettled::Keep);
        let (response, call) = send(&mut service, &mut calls, llm(&[("x-max", "60")])).await;
        call.usage.unwrap().add(10);
        // The client goes away: the settlement waits on a task of its own.
        drop(response);
        drop(call.frames);
    });
    drop(runtime);
}

/// A memory store that notes the limit of each policy it is asked to operate on.
#[derive(Clone)]
struct Noting(
    MemoryStore<ManualClock>,
    std::sync::Arc<parking_lot::Mutex<Vec<u64>>>,
);

impl Store for Noting {
    type Future = Ready<Result<Decisions, StoreError>>;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future> {
        self.0.check(key, policies, cost)
    }

    fn check_each(&self, key: &[u8], policies: &[&Policy], costs: &[u64]) -> Checked<Self::Future> {
        self.0.check_each(key, policies, costs)
    }

    fn operate(&self, key: &[u8], policies: &[&Policy], op: Operation) -> Checked<Self::Future> {
        let limits = policies.iter().map(|p| p.quota().limit());
        self.1.lock().extend(limits);
        self.0.operate(key, policies, op)
    }

    fn supports_each_cost(&self) -> Result<(), tollway_core::ConfigError> {
        Ok(())
    }
}

/// A caller with a plan of its own on the settled policy is settled at its own quota:
/// reserved 600 of its 1,000 a minute, settled to 100, 899 left after one more.
#[tokio::test]
async fn a_plan_of_its_own_is_settled_at_its_own_quota() {
    let noted = std::sync::Arc::default();
    let tokens = Policy::new(
        "tokens",
        Algorithm::TokenBucket,
        Quota::per_minute(100).unwrap(),
    );
    let own = Quota::per_minute(1_000).unwrap();
    let layer = RateLimitLayer::builder(
        Noting(store(), std::sync::Arc::clone(&noted)),
        tokens.unwrap(),
    )
    .key(crate::ApiKey::header("x-api-key").unwrap())
    .plan("k-acme", crate::Plan::tier("tokens").with_quota(own))
    .policy_cost("tokens", |_, _, headers, _| {
        number(headers, "x-max").unwrap_or(1)
    })
    .settle("tokens", |_, headers, _| number(headers, "x-used"))
    .build()
    .unwrap();
    let mut service = layer.layer(tower::service_fn(|request: Request<()>| async move {
        let mut response = Response::new(http_body_util::Empty::<Bytes>::new());
        if let Some(used) = request.headers().get("x-reply-used") {
            response.headers_mut().insert("x-used", used.clone());
        }
        Ok::<_, Infallible>(response)
    }));
    for (max, used, left) in [("600", "100", "400"), ("1", "1", "899")] {
        let mut request = llm(&[("x-max", max), ("x-reply-used", used)]);
        request
            .headers_mut()
            .insert("x-api-key", "k-acme".parse().unwrap());
        let response = service.ready().await.unwrap().call(request).await.unwrap();
        assert_eq!(response.headers()["x-ratelimit-remaining"], left);
        response.into_body().collect().await.unwrap();
    }
    assert_eq!(
        *noted.lock(),
        [1_000],
        "the refund of 500, at the plan's quota"
    );
}
