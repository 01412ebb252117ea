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
        .priority(Priority::new("paying", 0.3).when(Match::header(http::header::AUTHORIZATION)))
        .build()
        .unwrap()
}

/// Admits `n` requests made by `make`; returns the permits and how many were refused.
fn fill(shed: &Shed, n: usize, make: fn() -> Request<()>) -> (Vec<Permit>, usize) {
    let (mut permits, mut refused) = (Vec::new(), 0);
    for _ in 0..n {
        match shed.admit(&make()) {
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
    let _held = [checkout(), paying(), anonymous(), anonymous()].map(|r| shed.admit(&r));
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

#[test]
fn bad_settings_fail_when_built() {
    let bad = [
        Shed::builder().limits(0, 10),
        Shed::builder().limits(20, 10),
        Shed::builder().initial(5),
        Shed::builder().tolerance(0.5),
        Shed::builder().window(Duration::ZERO, 10),
        Shed::builder().priority(Priority::new("a", 0.5)),
        Shed::builder()
            .priority(Priority::new("other", 0.5).when(Match::header(http::header::AUTHORIZATION))),
        Shed::builder()
            .priority(Priority::new("a", 0.7).when(Match::header(http::header::AUTHORIZATION)))
            .priority(Priority::new("b", 0.7).when(Match::header(http::header::COOKIE))),
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
