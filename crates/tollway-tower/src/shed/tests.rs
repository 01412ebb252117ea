use std::time::Duration;

use http::{Method, Request};
use tollway_core::ManualClock;

use super::*;

fn request(method: Method, path: &str, paying: bool) -> Request<()> {
    let mut builder = Request::builder().method(method).uri(path);
    if paying {
        builder = builder.header("authorization", "Bearer a-session");
    }
    builder.body(()).unwrap()
}

fn anonymous() -> Request<()> {
    request(Method::GET, "/search", false)
}

fn paying() -> Request<()> {
    request(Method::GET, "/search", true)
}

fn checkout() -> Request<()> {
    request(Method::POST, "/api/v1/checkout", true)
}

/// A shedder of a fixed limit (floor = ceiling), checkout 0.5 and paying 0.3 of it.
fn fixed(limit: u32) -> Shed {
    Shed::builder()
        .limits(limit, limit)
        .priority(
            Priority::new("checkout", 0.5)
                .when(Match::route(Some(Method::POST), "/api/v1/checkout").unwrap()),
        )
        .priority(
            Priority::new("paying", 0.3).when(Match::header_present(http::header::AUTHORIZATION)),
        )
        .build()
        .unwrap()
}

/// Admits `n` requests made by `make`; returns the permits and how many were refused.
fn fill(shed: &Shed, n: usize, make: fn() -> Request<()>) -> (Vec<Permit>, usize) {
    let (mut permits, mut refused) = (Vec::new(), 0);
    for _ in 0..n {
        match shed.admit(&make(), None) {
            Ok(permit) => permits.push(permit),
            Err(overloaded) => {
                assert_eq!(overloaded.retry_after, 1);
                refused += 1;
            }
        }
    }
    (permits, refused)
}

#[test]
fn requests_are_sorted_into_the_first_priority_they_fit() {
    let shed = fixed(100);
    let _held = [checkout(), paying(), anonymous(), anonymous()].map(|r| shed.admit(&r, None));
    let states = shed.priorities();
    let names: Vec<_> = states.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["checkout", "paying", "other"]);
    let in_flight: Vec<_> = states.iter().map(|p| p.in_flight).collect();
    assert_eq!(in_flight, [1, 1, 2]);
    assert!((states[2].share - 0.2).abs() < 1e-9);
    assert_eq!(shed.in_flight(), 4);
}

// Anonymous traffic may borrow only what checkout and paying leave of their shares
// (50 + 30 of 100): it is refused first, with the service only 20 calls busy.
#[test]
fn a_low_priority_is_shed_before_a_high_one() {
    let shed = fixed(100);
    let (_other, refused) = fill(&shed, 100, anonymous);
    assert_eq!(refused, 80);
    // Paying gets its 30, and may borrow only what checkout's unused 50 leave: nothing.
    let (_paying, refused) = fill(&shed, 100, paying);
    assert_eq!(refused, 70, "30 paying admitted");
    let (_checkout, refused) = fill(&shed, 100, checkout);
    assert_eq!(refused, 50, "50 checkout admitted");
    assert_eq!(shed.in_flight(), 100);
    let shed_counts: Vec<_> = shed.priorities().iter().map(|p| p.shed).collect();
    assert_eq!(shed_counts, [50, 70, 80]);
}

// The service full of borrowed calls: a priority within its share still gets in.
#[test]
fn a_priority_within_its_share_is_never_shed() {
    let shed = fixed(100);
    // Paying fills the limit while checkout is idle... but not checkout's share.
    let (_paying, refused) = fill(&shed, 200, paying);
    assert_eq!(refused, 150, "50 paying in: checkout's 50 stay free");
    let (_checkout, refused) = fill(&shed, 50, checkout);
    assert_eq!(refused, 0);
    // Now at the limit, over it within a share: other's 20 are its own.
    let (_other, refused) = fill(&shed, 30, anonymous);
    assert_eq!(refused, 10, "other's share of 20 is kept even at the limit");
    assert_eq!(shed.in_flight(), 120);
}

fn address(n: u8) -> Option<crate::key::Key> {
    Some(crate::key::Key::ip(
        std::net::IpAddr::from([198, 51, 100, n]),
        64,
    ))
}

// The attack: requests whose bodies never come, from one address, held every place of
// a priority's share, and every other caller of it got 503. One address now holds a
// quarter of the share; its other calls borrow, and the rest of the share is everyone
// else's.
#[test]
fn one_address_holds_at_most_its_part_of_a_share() {
    let shed = fixed(20);
    // Other's share: 4 of 20. The slow address takes 1 of them, then borrows what
    // checkout's and paying's shares leave (20 − 10 − 6): 3 more.
    let slow: Vec<_> = (0..10)
        .filter_map(|_| shed.admit(&anonymous(), address(1)).ok())
        .collect();
    assert_eq!(slow.len(), 4);
    // Everyone else still has the other three places of the share, over the limit.
    let others: Vec<_> = (2..5)
        .map(|n| shed.admit(&anonymous(), address(n)))
        .collect();
    assert!(others.iter().all(Result::is_ok), "the rest of the share");
    assert_eq!(shed.in_flight(), 7);
    assert!(shed.admit(&anonymous(), address(9)).is_err(), "and no more");
    // Its calls gone, its place in the share is free again: one more caller gets it.
    drop(slow);
    assert_eq!(shed.in_flight(), 3);
    let later: Vec<_> = (10..14)
        .map(|n| shed.admit(&anonymous(), address(n)))
        .collect();
    assert_eq!(later.iter().filter(|l| l.is_ok()).count(), 1);
}

// An idle service: one address past its part still borrows all that no share needs.
#[test]
fn an_address_past_its_part_borrows_what_no_share_needs() {
    let shed = Shed::builder().limits(100, 100).build().unwrap();
    // Other's share is the whole limit: 25 held by one address, then 75 borrowed.
    let one: Vec<_> = (0..120)
        .map(|_| shed.admit(&anonymous(), address(1)))
        .collect();
    assert_eq!(one.iter().filter(|r| r.is_ok()).count(), 100);
    // What it borrowed is not the share's: 75 places of it are still everyone else's.
    let others: Vec<_> = (2..80)
        .map(|n| shed.admit(&anonymous(), address(n)))
        .collect();
    assert_eq!(others.iter().filter(|r| r.is_ok()).count(), 75);
    // With a part of 1, one address may take the whole share.
    let whole = Shed::builder()
        .limits(100, 100)
        .per_address(1.0)
        .build()
        .unwrap();
    let all: Vec<_> = (0..100)
        .map(|_| whole.admit(&anonymous(), address(1)))
        .collect();
    assert!(all.iter().all(Result::is_ok));
    assert!(whole.admit(&anonymous(), address(2)).is_err());
}

// Made-up API keys: a header's presence is won by anyone who sends it, its known
// values only by those who have one.
#[test]
fn a_made_up_header_value_does_not_win_a_priority() {
    let key = http::HeaderName::from_static("x-api-key");
    let shed = Shed::builder()
        .limits(10, 10)
        .priority(Priority::new("pro", 0.5).when(Match::header_in(key.clone(), ["pro-key"])))
        .build()
        .unwrap();
    let with_key = |value: &str| {
        Request::builder()
            .header(key.clone(), value)
            .body(())
            .unwrap()
    };
    let bots: Vec<_> = (0..12)
        .map(|n| shed.admit(&with_key(&format!("bot-{n}")), address(n)))
        .collect();
    let admitted = bots.iter().filter(|b| b.is_ok()).count();
    assert_eq!(admitted, 5, "bots take other's share only");
    let pro: Vec<_> = (0..5)
        .map(|n| shed.admit(&with_key("pro-key"), address(100 + n)))
        .collect();
    assert!(pro.iter().all(Result::is_ok));
    let state = &shed.priorities()[0];
    assert_eq!((state.in_flight, state.shed), (5, 0));
}

#[test]
fn a_permit_gives_its_place_back_when_dropped() {
    let shed = fixed(20);
    let (permits, refused) = fill(&shed, 5, anonymous);
    assert_eq!((permits.len(), refused), (4, 1));
    drop(permits);
    assert_eq!(shed.in_flight(), 0);
    assert_eq!(fill(&shed, 5, anonymous).1, 1);
}

#[test]
fn shadow_mode_sheds_nothing_and_counts_what_it_would_have() {
    let shed = fixed(100);
    shed.set_shadow(true);
    let (held, refused) = fill(&shed, 150, anonymous);
    assert_eq!((held.len(), refused), (150, 0));
    let other = &shed.priorities()[2];
    assert_eq!(
        (other.admitted, other.would_shed, other.shed),
        (150, 130, 0)
    );
}

/// Runs a window of 20 calls on `clock`, `in_flight` at once, each taking `latency`.
fn window(shed: &Shed, clock: &ManualClock, in_flight: usize, latency: Duration) {
    for _ in 0..(20 / in_flight).max(1) {
        let (permits, _) = fill(shed, in_flight, paying);
        clock.advance(latency);
        for permit in permits {
            permit.answered();
        }
    }
    clock.advance(Duration::from_secs(1));
    let (permits, _) = fill(shed, 1, paying);
    permits.into_iter().for_each(Permit::answered);
}

// The limit follows latency: it rises while the service answers as fast as it did
// unloaded, and falls when the service slows.
#[test]
fn the_limit_rises_and_falls_with_the_services_latency() {
    let clock = ManualClock::new();
    let shed = Shed::builder()
        .limits(10, 500)
        .initial(20)
        .clock(clock.clone())
        .build()
        .unwrap();
    let fast = Duration::from_millis(10);
    let mut last = shed.limit();
    for _ in 0..15 {
        window(&shed, &clock, last as usize, fast);
        let limit = shed.limit();
        assert!(limit >= last, "rises: {limit} >= {last}");
        last = limit;
    }
    assert!(last >= 30, "rose from 20 to {last}");
    for _ in 0..30 {
        window(&shed, &clock, last as usize, fast * 5);
        let limit = shed.limit();
        assert!(limit <= last, "falls: {limit} <= {last}");
        last = limit;
    }
    assert_eq!(last, 10, "down to the floor");
}

/// A shedder of limit 50 (between 10 and 500) on `clock`, with a baseline of 10 ms
/// learnt over ten busy windows.
fn learnt(clock: &ManualClock) -> Shed {
    let shed = Shed::builder()
        .limits(10, 500)
        .initial(50)
        .clock(clock.clone())
        .build()
        .unwrap();
    for _ in 0..10 {
        window(&shed, clock, 50, Duration::from_millis(10));
    }
    shed
}

/// Admits `n` calls, waits `before` (a store, a delay), calls the service, waits
/// `latency`, then answers them: `before` is not the service's time.
fn called_after(shed: &Shed, clock: &ManualClock, n: usize, before: Duration, latency: Duration) {
    let (mut permits, _) = fill(shed, n, paying);
    clock.advance(before);
    permits.iter_mut().for_each(Permit::calling);
    clock.advance(latency);
    permits.into_iter().for_each(Permit::answered);
}

#[test]
fn latency_is_timed_from_the_call_to_the_service() {
    let clock = ManualClock::new();
    let shed = learnt(&clock);
    let before = shed.limit();
    for _ in 0..3 {
        let limit = shed.limit() as usize;
        called_after(
            &shed,
            &clock,
            limit,
            Duration::from_millis(500),
            Duration::from_millis(10),
        );
        clock.advance(Duration::from_secs(1));
        called_after(&shed, &clock, 1, Duration::ZERO, Duration::from_millis(10));
    }
    assert!(
        shed.limit() > before,
        "{} > {before}: the waits were not the service's",
        shed.limit()
    );
}

// Callers who give up on a hung service still teach the limit: their time so far is a
// sample.
#[test]
fn calls_given_up_lower_the_limit() {
    let clock = ManualClock::new();
    let shed = learnt(&clock);
    let before = shed.limit();
    for _ in 0..5 {
        let (permits, _) = fill(&shed, shed.limit() as usize, paying);
        clock.advance(Duration::from_secs(1));
        drop(permits);
    }
    assert!(shed.limit() < before, "{} < {before}", shed.limit());
    // A call a limit refused counts no time at all.
    let limit = shed.limit();
    for _ in 0..5 {
        let (permits, _) = fill(&shed, limit as usize, paying);
        clock.advance(Duration::from_secs(2));
        permits.into_iter().for_each(Permit::discard);
    }
    assert_eq!(shed.limit(), limit);
}

// A shedder replacing another takes its limit, whatever clock either counts on: its
// windows start on its own clock and close as they should.
#[test]
fn a_shedder_continued_on_another_clock_still_adapts() {
    let old_clock = ManualClock::new();
    old_clock.advance(Duration::from_secs(1_000));
    let old = Shed::builder()
        .limits(10, 500)
        .initial(100)
        .clock(old_clock)
        .build()
        .unwrap();
    let clock = ManualClock::new();
    let new = Shed::builder()
        .limits(10, 500)
        .clock(clock.clone())
        .build()
        .unwrap();
    new.continue_from(&old);
    assert_eq!(new.limit(), 100);
    window(&new, &clock, 100, Duration::from_millis(10));
    assert!(
        new.limit() > 100,
        "{}: the window closed on the new clock",
        new.limit()
    );
}

#[test]
fn bad_settings_fail_when_built() {
    let bad = [
        Shed::builder().limits(0, 10),
        Shed::builder().limits(20, 10),
        Shed::builder().initial(5),
        Shed::builder().tolerance(0.5),
        Shed::builder().window(Duration::ZERO, 10),
        Shed::builder().priority(Priority::new("a", 0.5)),
        Shed::builder().priority(
            Priority::new("other", 0.5).when(Match::header_present(http::header::AUTHORIZATION)),
        ),
        Shed::builder()
            .priority(
                Priority::new("a", 0.7).when(Match::header_present(http::header::AUTHORIZATION)),
            )
            .priority(Priority::new("b", 0.7).when(Match::header_present(http::header::COOKIE))),
    ];
    for builder in bad {
        let error = builder.build().unwrap_err().to_string();
        assert!(error.starts_with("load shedding: "), "{error}");
    }
}

#[test]
fn a_shedder_with_new_settings_starts_from_the_old_limit() {
    let clock = ManualClock::new();
    let old = Shed::builder()
        .limits(10, 500)
        .initial(100)
        .clock(clock.clone())
        .build()
        .unwrap();
    let new = Shed::builder().limits(10, 50).clock(clock).build().unwrap();
    assert!(!old.same_settings(&new) && old.same_settings(&old.clone()));
    new.continue_from(&old);
    assert_eq!(new.limit(), 50, "the old limit, under the new ceiling");
}

/// Through the layer: what a full service answers, and what it leaves untouched.
mod layer {
    use std::convert::Infallible;
    use std::net::SocketAddr;

    use http::{Response, StatusCode};
    use http_body_util::BodyExt;
    use tollway_core::{Algorithm, MemoryStore, Policy, Quota};
    use tower::{Service, ServiceExt};

    use super::*;
    use crate::RateLimitLayer;

    fn from(peer: u8, grpc: bool) -> Request<()> {
        let mut request = anonymous();
        if grpc {
            *request.version_mut() = http::Version::HTTP_2;
            request
                .headers_mut()
                .insert("content-type", "application/grpc".parse().unwrap());
        }
        let addr: SocketAddr = ([203, 0, 113, peer], 5000).into();
        request.extensions_mut().insert(addr);
        request
    }

    type Answer = std::future::Ready<Result<Response<String>, Infallible>>;

    /// A layer shedding over one call at once, per caller 1 a minute, on `store`.
    fn service(
        store: MemoryStore,
        shed: &Shed,
    ) -> impl Service<
        Request<()>,
        Response = Response<crate::ResponseBody<String>>,
        Error = Infallible,
    > + Clone {
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_minute(1).unwrap()).unwrap();
        let layer = RateLimitLayer::builder(store, policy)
            .shed(shed.clone())
            .build()
            .unwrap();
        let answer =
            |_: Request<()>| -> Answer { std::future::ready(Ok(Response::new("ok".into()))) };
        tower_layer::Layer::layer(&layer, tower::service_fn(answer))
    }

    #[tokio::test]
    async fn a_full_service_answers_503_with_retry_after_and_asks_no_store() {
        let store = MemoryStore::new();
        let shed = Shed::builder().limits(1, 1).build().unwrap();
        let mut service = service(store.clone(), &shed);
        // Admitted and not yet answered: the one call the service may hold.
        let held = service.ready().await.unwrap().call(from(1, false));
        assert_eq!(shed.in_flight(), 1);
        for peer in 2..12 {
            let refused = service
                .ready()
                .await
                .unwrap()
                .call(from(peer, false))
                .await
                .unwrap();
            assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(refused.headers()["retry-after"], "1");
            assert!(refused.headers().get("x-ratelimit-limit").is_none());
            let bytes = refused.into_body().collect().await.unwrap().to_bytes();
            let text = std::str::from_utf8(&bytes).unwrap();
            assert!(text.contains("\"error\":\"Service Unavailable\""), "{text}");
        }
        assert_eq!(
            store.len(),
            1,
            "only the admitted caller's state: no refusal asked"
        );
        let answered = held.await.unwrap();
        assert_eq!(answered.status(), StatusCode::OK);
        assert_eq!(
            shed.in_flight(),
            0,
            "its place is given back with the answer"
        );
    }

    #[tokio::test]
    async fn a_grpc_call_over_the_limit_is_unavailable_with_a_retry_time() {
        let shed = Shed::builder().limits(1, 1).build().unwrap();
        let mut service = service(MemoryStore::new(), &shed);
        let _held = service.ready().await.unwrap().call(from(1, true));
        let refused = service
            .ready()
            .await
            .unwrap()
            .call(from(2, true))
            .await
            .unwrap();
        assert_eq!(
            refused.status(),
            StatusCode::OK,
            "a trailers-only gRPC answer"
        );
        assert_eq!(refused.headers()["grpc-status"], "14", "UNAVAILABLE");
        assert_eq!(refused.headers()["retry-after"], "1");
        assert_eq!(refused.headers()["grpc-retry-pushback-ms"], "1000");
    }

    #[tokio::test]
    async fn a_call_its_own_limit_refuses_gives_its_place_back_at_once() {
        let shed = Shed::builder().limits(1, 1).build().unwrap();
        let mut service = service(MemoryStore::new(), &shed);
        let first = service
            .ready()
            .await
            .unwrap()
            .call(from(1, false))
            .await
            .unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        let second = service
            .ready()
            .await
            .unwrap()
            .call(from(1, false))
            .await
            .unwrap();
        assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(shed.in_flight(), 0);
        let other = service
            .ready()
            .await
            .unwrap()
            .call(from(2, false))
            .await
            .unwrap();
        assert_eq!(other.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn in_shadow_mode_a_full_service_still_calls_and_counts() {
        let shed = Shed::builder().limits(1, 1).shadow(true).build().unwrap();
        let mut service = service(MemoryStore::new(), &shed);
        let _held = service.ready().await.unwrap().call(from(1, false));
        let passed = service
            .ready()
            .await
            .unwrap()
            .call(from(2, false))
            .await
            .unwrap();
        assert_eq!(passed.status(), StatusCode::OK);
        assert_eq!(shed.priorities()[0].would_shed, 1);
    }

    // An interceptor never sees the response, so it could never give a place back.
    #[cfg(feature = "tonic")]
    #[test]
    fn a_shedding_layer_has_no_interceptor() {
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_minute(1).unwrap()).unwrap();
        let layer = RateLimitLayer::builder(MemoryStore::new(), policy)
            .shed(Shed::builder().build().unwrap())
            .build()
            .unwrap();
        let error = layer.interceptor().unwrap_err().to_string();
        assert!(error.contains("sheds load"), "{error}");
    }
}
