//! The outbound layer tells its decisions as the server side does.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::{Request, Response, StatusCode};
use parking_lot::Mutex;
use tollway_core::{Algorithm, MemoryStore, Policy, Quota};
use tower::ServiceExt;
use tower_layer::Layer;

use super::{OutboundError, OutboundLayer};
use crate::report::{DecisionEvent, DecisionOutcome};
use crate::{Key, TokioClock};

/// What a listener heard: each decision's outcome, key and reported policy.
type Heard = Arc<Mutex<Vec<(DecisionOutcome, Option<Key>, Option<String>)>>>;

fn listener(heard: &Heard) -> impl Fn(&DecisionEvent<'_>) + Send + Sync + 'static {
    let heard = Arc::clone(heard);
    move |event: &DecisionEvent<'_>| {
        let policy = event.verdict().map(|v| v.policy.name().to_owned());
        heard
            .lock()
            .push((event.outcome(), event.key().cloned(), policy));
    }
}

fn call() -> Request<()> {
    Request::get("https://api.example.com/v1/charges")
        .body(())
        .unwrap()
}

// A fleet's operators watch the client side's decisions with the same listener,
// metrics and debug events as the server side's; a request that waits is told at each
// check, so that its wait shows.
#[tokio::test(start_paused = true)]
async fn outbound_decisions_reach_the_listener_at_each_check() {
    let client =
        tower::service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(())) });
    let policy = Policy::new("upstream", Algorithm::Gcra, Quota::per_second(1).unwrap()).unwrap();
    let store = MemoryStore::builder()
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let heard = Heard::default();
    let failing = OutboundLayer::builder(store.clone(), policy.clone())
        .fail_fast()
        .on_decision(listener(&heard))
        .build()
        .unwrap()
        .layer(client);
    let waiting = OutboundLayer::builder(store, policy)
        .jitter(0.0)
        .on_decision(listener(&heard))
        .build()
        .unwrap()
        .layer(client);

    failing.clone().oneshot(call()).await.unwrap();
    let refused = failing.oneshot(call()).await.unwrap_err();
    assert!(matches!(
        refused.downcast_ref::<OutboundError>(),
        Some(OutboundError::Limited { .. })
    ));
    waiting.oneshot(call()).await.unwrap();

    let key = Some(Key::new("outbound", "upstream:api.example.com"));
    let policy = Some("upstream".to_owned());
    let told = |outcome| (outcome, key.clone(), policy.clone());
    assert_eq!(
        *heard.lock(),
        [
            told(DecisionOutcome::Allowed),
            told(DecisionOutcome::Limited),
            // The waiting request: refused, then let through after its wait.
            told(DecisionOutcome::Limited),
            told(DecisionOutcome::Allowed),
        ]
    );
}

// A request held by an upstream's pause shows as refused by the pause's policy, so an
// operator sees why it waited. Here the upstream's first answer is a 429 asking for a
// second: the copy sent again waits that out.
#[tokio::test(start_paused = true)]
async fn a_running_pause_reaches_the_listener_as_limited_by_the_pause() {
    let refused_once = Arc::new(AtomicBool::new(false));
    let client = tower::service_fn(move |_: Request<()>| {
        let first = !refused_once.swap(true, Ordering::Relaxed);
        async move {
            let mut response = Response::new(());
            if first {
                *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                response
                    .headers_mut()
                    .insert("retry-after", http::HeaderValue::from_static("1"));
            }
            Ok::<_, Infallible>(response)
        }
    });
    let policy = Policy::new("upstream", Algorithm::Gcra, Quota::per_second(10).unwrap()).unwrap();
    let store = MemoryStore::builder()
        .clock(TokioClock::new())
        .build()
        .unwrap();
    let heard = Heard::default();
    let layer = OutboundLayer::builder(store, policy)
        .jitter(0.0)
        .on_decision(listener(&heard))
        .build()
        .unwrap();

    let response = layer.layer(client).oneshot(call()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    let key = Some(Key::new("outbound", "upstream:api.example.com"));
    let told = |outcome, policy: &str| (outcome, key.clone(), Some(policy.to_owned()));
    assert_eq!(
        *heard.lock(),
        [
            told(DecisionOutcome::Allowed, "upstream"),
            told(DecisionOutcome::Limited, "outbound-pause"),
            told(DecisionOutcome::Allowed, "upstream"),
        ]
    );
}
