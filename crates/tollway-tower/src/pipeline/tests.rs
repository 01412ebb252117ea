//! The pipeline's rules, one row each: a layer, what came before, a request, and what
//! the pipeline decides, tells the listener and charges after the response. The
//! end-to-end suites (`tests/`) check the same rules through real servers.

use std::future::Ready;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use parking_lot::Mutex;
use tollway_core::{
    Algorithm, Checked, Decisions, ManualClock, MemoryStore, Operation, Policy, Quota, Store,
    StoreError, StoreErrorKind,
};

use super::*;
use crate::key::PeerIp;
use crate::rate_limit::{RateLimitLayer, RateLimitLayerBuilder};
use crate::report::DecisionEvent;

/// How the store answers a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Answers {
    /// At once, as a memory store does.
    AtOnce,
    /// Through its future, as Redis does.
    Later,
    /// With an error, as a Redis that is down does.
    Fails,
}

/// A memory store that answers as it is told.
#[derive(Clone)]
struct Scripted {
    inner: MemoryStore<ManualClock>,
    answers: Arc<AtomicU8>,
}

impl Scripted {
    fn new() -> Self {
        let inner = MemoryStore::builder().clock(ManualClock::new()).build();
        Scripted {
            inner: inner.expect("a memory store with a manual clock builds"),
            answers: Arc::new(AtomicU8::new(Answers::AtOnce as u8)),
        }
    }

    fn answer(&self, answers: Answers) {
        self.answers.store(answers as u8, Ordering::SeqCst);
    }

    /// `answer` (the memory store's) as this store is told to give it.
    fn scripted(
        &self,
        answer: impl FnOnce() -> Checked<Ready<Result<Decisions, StoreError>>>,
    ) -> Checked<Ready<Result<Decisions, StoreError>>> {
        let answers = self.answers.load(Ordering::SeqCst);
        if answers == Answers::Fails as u8 {
            return Checked::Ready(Err(StoreError::new(StoreErrorKind::Connection, "down")));
        }
        let answer = match answer() {
            Checked::Ready(answer) => answer,
            Checked::Pending(future) => future.into_inner(),
        };
        if answers == Answers::Later as u8 {
            Checked::Pending(std::future::ready(answer))
        } else {
            Checked::Ready(answer)
        }
    }
}

impl Store for Scripted {
    type Future = Ready<Result<Decisions, StoreError>>;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future> {
        self.scripted(|| self.inner.check(key, policies, cost))
    }

    fn check_each(&self, key: &[u8], policies: &[&Policy], costs: &[u64]) -> Checked<Self::Future> {
        self.scripted(|| self.inner.check_each(key, policies, costs))
    }

    fn supports_each_cost(&self) -> Result<(), tollway_core::ConfigError> {
        Ok(())
    }

    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        self.scripted(|| self.inner.operate(key, policies, operation))
    }
}

/// What a request came to, in terms a row can say.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// Let through; `X-RateLimit-Remaining`, if sent.
    Allowed(Option<String>),
    /// Denied by the policy named so.
    Denied(String),
    /// Refused by the layer with this status.
    Refused(u16),
}

fn allowed(remaining: Option<&str>) -> Seen {
    Seen::Allowed(remaining.map(str::to_owned))
}

fn denied(policy: &str) -> Seen {
    Seen::Denied(policy.to_owned())
}

/// One rule: a layer, the requests before, the request, and what follows.
struct Row {
    rule: &'static str,
    layer: fn(RateLimitLayerBuilder<Scripted, PeerIp>) -> RateLimitLayerBuilder<Scripted, PeerIp>,
    /// Requests from the same caller before the one the row is about.
    before: usize,
    /// How the store answers the row's request.
    answers: Answers,
    /// Its path (route limits).
    path: &'static str,
    seen: Seen,
    /// What the listener hears of it, in order.
    told: &'static [DecisionOutcome],
    /// How many times it waits (for the store or a tier lookup).
    waits: usize,
    /// Whether it is to be charged after its response.
    charged: bool,
}

fn one_a_minute(name: &str) -> Policy {
    Policy::new(name, Algorithm::Gcra, Quota::per_minute(1).unwrap()).unwrap()
}

fn ten_a_minute(name: &str) -> Policy {
    Policy::new(name, Algorithm::TokenBucket, Quota::per_minute(10).unwrap()).unwrap()
}

/// One call in flight; a slot lives 30 s unrenewed.
fn one_in_flight(name: &str) -> Policy {
    let quota = Quota::with_period(1, std::time::Duration::from_secs(30)).unwrap();
    Policy::new(name, Algorithm::Concurrency, quota).unwrap()
}

fn hundred_a_minute(name: &str) -> Policy {
    Policy::new(
        name,
        Algorithm::TokenBucket,
        Quota::per_minute(100).unwrap(),
    )
    .unwrap()
}

/// The default policy at `per_minute` of the caller's own.
fn own_plan(per_minute: u64) -> crate::Plan {
    crate::Plan::tier("default").with_quota(Quota::per_minute(per_minute).unwrap())
}

fn request(path: &str) -> Request<()> {
    let mut request = Request::get(path).body(()).unwrap();
    let peer: SocketAddr = "203.0.113.9:5000".parse().unwrap();
    request.extensions_mut().insert(peer);
    request
}

/// Drives `request` through the pipeline as the service and its future do: decide, then
/// wait and resume until decided. With the number of waits.
async fn drive<'l>(limiter: &'l Limiter<Scripted>, request: &Request<()>) -> (Decided<'l>, usize) {
    let mut progress = limiter.decision(&PeerIp::new(), request);
    let mut waits = 0;
    loop {
        match progress {
            Progress::Decided(decided) => return (decided, waits),
            Progress::Waiting(wait, at) => {
                waits += 1;
                progress = limiter.waited(at, wait.await, request);
            }
        }
    }
}

fn seen(outcome: Outcome<'_>) -> Seen {
    match outcome {
        Outcome::Allow { headers, .. } => {
            let mut map = HeaderMap::new();
            headers.insert_into(&mut map);
            let remaining = map.get("x-ratelimit-remaining");
            Seen::Allowed(remaining.map(|v| v.to_str().unwrap().to_owned()))
        }
        Outcome::Deny { policy, .. } => denied(policy.policy().name()),
        Outcome::Refuse(refusal) => Seen::Refused(refusal.response().status().as_u16()),
    }
}

/// A layer settling `tokens`, one a minute on `/llm`, to 3 units after each response.
fn charged_route(
    builder: RateLimitLayerBuilder<Scripted, PeerIp>,
) -> RateLimitLayerBuilder<Scripted, PeerIp> {
    builder
        .route(None, "/llm", one_a_minute("tokens"))
        .settle("tokens", |_, _, _| Some(3))
}

/// A layer whose `tokens` policy, a hundred a minute on `/api/*`, costs 40 a request.
fn tokens_route(
    builder: RateLimitLayerBuilder<Scripted, PeerIp>,
) -> RateLimitLayerBuilder<Scripted, PeerIp> {
    builder
        .route(None, "/api/*", hundred_a_minute("tokens"))
        .policy_cost("tokens", |_, _, _, _| 40)
}

fn rows() -> Vec<Row> {
    let row = |rule| Row {
        rule,
        layer: |b| b,
        before: 0,
        answers: Answers::AtOnce,
        path: "/",
        seen: allowed(Some("9")),
        told: &[DecisionOutcome::Allowed],
        waits: 0,
        charged: false,
    };
    vec![
        Row {
            ..row("a request within its limit is let through with its headers")
        },
        Row {
            before: 10,
            seen: denied("default"),
            told: &[DecisionOutcome::Limited],
            ..row("a request over its limit is denied by that limit")
        },
        Row {
            layer: |b| b.shadow(true),
            before: 10,
            seen: allowed(None),
            told: &[DecisionOutcome::ShadowLimited],
            ..row("a layer in shadow lets a denied request through, without headers")
        },
        Row {
            layer: |b| {
                b.route(None, "/api/*", one_a_minute("api"))
                    .shadow_policy("api")
            },
            before: 1,
            path: "/api/x",
            seen: allowed(Some("8")),
            told: &[DecisionOutcome::ShadowLimited, DecisionOutcome::Allowed],
            ..row("a policy in shadow that denies leaves the others to decide")
        },
        Row {
            layer: |b| b.plan("203.0.113.9", own_plan(3)),
            seen: allowed(Some("2")),
            ..row("a caller with a plan of its own is limited at its own quota")
        },
        Row {
            layer: |b| b.plan("203.0.113.9", own_plan(3)),
            before: 3,
            answers: Answers::Later,
            seen: denied("default"),
            told: &[DecisionOutcome::Limited],
            waits: 1,
            ..row("a caller's own quota denies, and its policy is named, after a wait")
        },
        Row {
            layer: |b| {
                b.plan("203.0.113.9", own_plan(1))
                    .shadow_policy("default")
                    .route(None, "/api/*", ten_a_minute("api"))
            },
            before: 1,
            path: "/api/x",
            seen: allowed(Some("8")),
            told: &[DecisionOutcome::ShadowLimited, DecisionOutcome::Allowed],
            ..row("a caller's own quota in shadow that denies leaves the others to decide")
        },
        Row {
            layer: |b| b.allow_network("203.0.113.0/24"),
            before: 10,
            seen: allowed(None),
            told: &[DecisionOutcome::AllowListed],
            ..row("an allow-listed caller passes unlimited")
        },
        Row {
            layer: |b| {
                b.allow_network("203.0.113.0/24")
                    .deny_network("203.0.113.9")
            },
            seen: Seen::Refused(403),
            told: &[DecisionOutcome::DenyListed],
            ..row("the deny list wins over the allow list")
        },
        Row {
            answers: Answers::Fails,
            seen: allowed(None),
            told: &[DecisionOutcome::StoreError],
            ..row("a failed store lets through by default (fail open)")
        },
        Row {
            layer: |b| b.on_store_error(OnStoreError::Reject),
            answers: Answers::Fails,
            seen: Seen::Refused(503),
            told: &[DecisionOutcome::StoreError],
            ..row("a failed store refuses with 503 when told to (fail closed)")
        },
        Row {
            answers: Answers::Later,
            waits: 1,
            ..row("a pending store is waited for, then decides")
        },
        Row {
            layer: |b| {
                b.route(None, "/api/*", one_a_minute("api"))
                    .shadow_policy("api")
            },
            before: 1,
            answers: Answers::Later,
            path: "/api/x",
            seen: allowed(Some("8")),
            told: &[DecisionOutcome::ShadowLimited, DecisionOutcome::Allowed],
            waits: 2,
            ..row("a pending store asked again after a shadow denial is waited for twice")
        },
        Row {
            layer: |b| {
                b.tier(hundred_a_minute("pro"))
                    .tier_lookup(|_key| async { Ok::<_, std::io::Error>(Some("pro".to_owned())) })
            },
            seen: allowed(Some("99")),
            waits: 1,
            ..row("a tier lookup is waited for, then its tier decides")
        },
        Row {
            layer: |b| {
                b.tier(hundred_a_minute("pro"))
                    .tier_lookup(|_key| async { Ok::<_, std::io::Error>(Some("pro".to_owned())) })
            },
            answers: Answers::Later,
            seen: allowed(Some("99")),
            waits: 2,
            ..row("a tier lookup, then a pending store")
        },
        Row {
            layer: |b| {
                b.tier_lookup(|_key| async {
                    Err::<Option<String>, _>(std::io::Error::other("down"))
                })
                .on_tier_lookup_error(OnLookupError::Reject)
            },
            seen: Seen::Refused(503),
            // Its own outcome: the store did not fail.
            told: &[DecisionOutcome::LookupFailed],
            waits: 1,
            ..row("a failed tier lookup refuses when told to")
        },
        Row {
            layer: tokens_route,
            before: 1,
            path: "/api/x",
            seen: allowed(Some("8")),
            ..row("each limit is charged its own cost: 2 of 10 requests, 80 of 100 tokens")
        },
        Row {
            layer: tokens_route,
            before: 2,
            path: "/api/x",
            seen: denied("tokens"),
            told: &[DecisionOutcome::Limited],
            ..row("a request its token limit refuses is refused by that limit")
        },
        Row {
            layer: |b| tokens_route(b).shadow_policy("tokens"),
            before: 2,
            answers: Answers::Later,
            path: "/api/x",
            seen: allowed(Some("7")),
            told: &[DecisionOutcome::ShadowLimited, DecisionOutcome::Allowed],
            waits: 2,
            ..row("a policy in shadow refusing its own cost leaves the others at theirs")
        },
        Row {
            layer: |b| b.route(None, "/api/*", one_in_flight("streams")),
            path: "/api/x",
            seen: allowed(Some("0")),
            charged: true,
            ..row("a request under a limit on calls in flight holds a slot to give back")
        },
        Row {
            layer: |b| b.route(None, "/api/*", one_in_flight("streams")),
            before: 1,
            path: "/api/x",
            seen: denied("streams"),
            told: &[DecisionOutcome::Limited],
            ..row("a request with no slot free is refused and holds none")
        },
        Row {
            layer: |b| {
                b.route(None, "/api/*", one_in_flight("streams"))
                    .shadow_policy("streams")
            },
            before: 1,
            path: "/api/x",
            seen: allowed(Some("8")),
            told: &[DecisionOutcome::ShadowLimited, DecisionOutcome::Allowed],
            ..row("a limit on calls in flight in shadow refuses nothing and holds no slot")
        },
        Row {
            layer: charged_route,
            path: "/llm",
            seen: allowed(Some("0")),
            charged: true,
            ..row("a request let through on the charged route is settled after its response")
        },
        Row {
            layer: charged_route,
            path: "/other",
            ..row("a request off the settled route is not settled")
        },
        Row {
            layer: charged_route,
            before: 1,
            path: "/llm",
            seen: denied("tokens"),
            told: &[DecisionOutcome::Limited],
            ..row("a denied request is not settled")
        },
        Row {
            layer: charged_route,
            answers: Answers::Fails,
            path: "/llm",
            seen: allowed(None),
            told: &[DecisionOutcome::StoreError],
            ..row("a request the store failed to decide is not settled")
        },
    ]
}

#[tokio::test]
async fn each_rule_of_the_pipeline() {
    for row in rows() {
        let store = Scripted::new();
        let told = Arc::new(Mutex::new(Vec::new()));
        let heard = Arc::clone(&told);
        let builder = RateLimitLayer::builder(store.clone(), ten_a_minute("default"))
            .on_decision(move |event: &DecisionEvent<'_>| heard.lock().push(event.outcome()));
        let layer = (row.layer)(builder).build().unwrap();
        let limiter = layer.limiter();
        for _ in 0..row.before {
            drive(&limiter, &request(row.path)).await;
        }
        told.lock().clear();
        store.answer(row.answers);
        let request = request(row.path);
        let (decided, waits) = drive(&limiter, &request).await;
        let rule = row.rule;
        assert_eq!(waits, row.waits, "{rule}: waits");
        assert_eq!(
            decided.charge.is_some(),
            row.charged,
            "{rule}: charged after"
        );
        assert_eq!(seen(decided.outcome), row.seen, "{rule}");
        assert_eq!(*told.lock(), row.told, "{rule}: told");
    }
}

/// A store that decides one cost for all of a request's limits.
struct OneCost(MemoryStore);

impl Store for OneCost {
    type Future = Ready<Result<Decisions, StoreError>>;

    fn check(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Checked<Self::Future> {
        self.0.check(key, policies, cost)
    }

    fn operate(
        &self,
        key: &[u8],
        policies: &[&Policy],
        operation: Operation,
    ) -> Checked<Self::Future> {
        self.0.operate(key, policies, operation)
    }
}

#[test]
fn a_cost_per_policy_needs_a_store_that_decides_each_and_a_known_policy() {
    let builder = || RateLimitLayer::builder(OneCost(MemoryStore::new()), ten_a_minute("default"));
    let error = builder()
        .policy_cost("default", |_, _, _, _| 2)
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("one cost for all"), "{error}");
    let error = RateLimitLayer::builder(MemoryStore::new(), ten_a_minute("default"))
        .policy_cost("tokens", |_, _, _, _| 2)
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("tokens"), "{error}");
    assert!(builder().build().is_ok());
}
