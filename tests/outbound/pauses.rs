//! An upstream's 429 pauses every client sharing its key, once, for as long as its
//! `Retry-After` says (within the maximum); the refused request goes once more when it
//! may.

use super::*;

/// An upstream whose first answer is a 429 with `Retry-After: {retry_after}`, then 200s;
/// it records when (tokio time) each request reached it.
async fn refusing_once(
    retry_after: &str,
) -> (Server, Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>) {
    refusing_first(1, retry_after).await
}

/// An upstream whose first `refusals` answers are 429s with `Retry-After: {retry_after}`,
/// then 200s; it records when (tokio time) each request reached it.
async fn refusing_first(
    refusals: usize,
    retry_after: &str,
) -> (Server, Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>) {
    refusing(refusals, retry_after, false).await
}

/// [`refusing_first`], and when `together`, each of the first `refusals` requests is
/// answered only once all of them have arrived: so that they race, whatever the order
/// in which a loaded machine runs their clients.
async fn refusing(
    refusals: usize,
    retry_after: &str,
    together: bool,
) -> (Server, Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>) {
    use axum::response::IntoResponse;
    let arrivals = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&arrivals);
    let retry_after = retry_after.to_owned();
    let all_in = Arc::new(tokio::sync::Barrier::new(refusals));
    let app = axum::Router::new().route(
        "/",
        axum::routing::any(move || {
            let (seen, retry_after) = (Arc::clone(&seen), retry_after.clone());
            let all_in = Arc::clone(&all_in);
            async move {
                let arrival = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(tokio::time::Instant::now());
                    seen.len()
                };
                if arrival > refusals {
                    return StatusCode::OK.into_response();
                }
                if together {
                    all_in.wait().await;
                }
                (
                    StatusCode::TOO_MANY_REQUESTS,
                    [("retry-after", retry_after)],
                )
                    .into_response()
            }
        }),
    );
    (Server::start(app).await, arrivals)
}

/// An upstream 429 with `Retry-After: 2` pauses all three clients sharing the key: the
/// next request reaches the upstream 2 s after the refusal, not before, though the
/// budget itself (1,000 a second) would have let them through; the refused `GET` goes
/// once more after the pause, so no caller sees the 429.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_upstream_429_pauses_every_client_sharing_the_key() {
    let (server, arrivals) = refusing_once("2").await;
    let server = Arc::new(server);
    let store = paused_store();
    let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(1_000).unwrap()).unwrap();
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let mut client = OutboundLayer::builder(store.clone(), policy.clone())
            .build()
            .unwrap()
            .layer(http_client());
        let server = Arc::clone(&server);
        tasks.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..3 {
                let response = send(&mut client, &server).await.unwrap();
                statuses.push(response.status());
            }
            statuses
        }));
    }
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.extend(task.await.unwrap());
    }
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(
        arrivals.len(),
        10,
        "nine requests and the refused one again"
    );
    let refused_at = arrivals[0];
    // Requests sent before the refusal came back were already on their way; every one
    // sent after it waited out the pause.
    let after_pause: Vec<_> = arrivals[1..].iter().filter(|&&t| t > refused_at).collect();
    assert!(!after_pause.is_empty());
    for &&t in &after_pause {
        assert!(
            t - refused_at >= Duration::from_secs(2),
            "{:?} after the 429",
            t - refused_at
        );
    }
    assert_eq!(statuses, [StatusCode::OK; 9]);
}

/// However the upstream states it — an HTTP date 3 s ahead (whole seconds: 2 to 3 s
/// from now), garbage, -5, a day — the pause follows the rule of `pause_of` and is never
/// longer than `max_pause` (5 s here).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn retry_after_in_any_form_pauses_by_the_rule_and_never_past_the_maximum() {
    let in_3_s = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(3));
    // (Retry-After, the least and the most pause the next request sees)
    let cases: [(&str, u64, u64); 4] = [
        // Whole seconds, less the time the first call took: a little under 2 s at worst.
        (in_3_s.as_str(), 1_800, 3_000),
        ("soon", 1_000, 1_001),
        ("-5", 1_000, 1_001),
        ("86400", 5_000, 5_001),
    ];
    for (retry_after, least_ms, most_ms) in cases {
        let (server, arrivals) = refusing_once(retry_after).await;
        let store = paused_store();
        let policy =
            Policy::new("api", Algorithm::Gcra, Quota::per_second(1_000).unwrap()).unwrap();
        let mut client = OutboundLayer::builder(store, policy)
            .max_pause(Duration::from_secs(5))
            // No jitter, so the wait is the pause itself (with it, up to 10% more).
            .jitter(0.0)
            .build()
            .unwrap()
            .layer(http_client());
        for _ in 0..2 {
            send(&mut client, &server).await.unwrap();
        }
        let arrivals = arrivals.lock().unwrap().clone();
        let pause = arrivals[1] - arrivals[0];
        assert!(
            pause >= Duration::from_millis(least_ms) && pause <= Duration::from_millis(most_ms),
            "Retry-After {retry_after:?}: paused {pause:?}"
        );
    }
}

/// A refused request goes once more after the pause when it may: a `GET` by default, a
/// `POST` only when the layer's `replay` allows it; never a third time; and not at all
/// when the pause would outlast `max_wait` — the caller then gets the upstream's 429 at
/// once.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refused_request_goes_once_more_when_it_may_and_the_pause_fits() {
    let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(1_000).unwrap()).unwrap();
    let layer = |max_wait| {
        OutboundLayer::builder(paused_store(), policy.clone())
            .jitter(0.0)
            .max_wait(max_wait)
    };
    let post = |server: &Server| {
        Request::post(format!("http://{}/", server.addr()))
            .body(Empty::<Bytes>::new())
            .unwrap()
    };
    let thirty = Duration::from_secs(30);

    // A GET: refused, sent again 1 s later, served.
    let (server, arrivals) = refusing_once("1").await;
    let mut client = layer(thirty).build().unwrap().layer(http_client());
    assert_eq!(
        outcome(&mut client, get(&server), &arrivals).await,
        (StatusCode::OK, 2)
    );
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals[1] - arrivals[0], Duration::from_secs(1));

    // A POST: the 429 is the answer, by default...
    let (server, arrivals) = refusing_once("1").await;
    let mut client = layer(thirty).build().unwrap().layer(http_client());
    let answer = outcome(&mut client, post(&server), &arrivals).await;
    assert_eq!(answer, (StatusCode::TOO_MANY_REQUESTS, 1));
    // ...and goes again when the layer allows it.
    let (server, arrivals) = refusing_once("1").await;
    let again = |request: &Request<Empty<Bytes>>| {
        let mut copy = Request::new(Empty::new());
        *copy.method_mut() = request.method().clone();
        *copy.uri_mut() = request.uri().clone();
        Some(copy)
    };
    let mut client = layer(thirty)
        .replay(again)
        .build()
        .unwrap()
        .layer(http_client());
    assert_eq!(
        outcome(&mut client, post(&server), &arrivals).await,
        (StatusCode::OK, 2)
    );

    // Refused twice: the second 429 is the answer, no third try.
    let (server, arrivals) = refusing_first(5, "1").await;
    let mut client = layer(thirty).build().unwrap().layer(http_client());
    let answer = outcome(&mut client, get(&server), &arrivals).await;
    assert_eq!(answer, (StatusCode::TOO_MANY_REQUESTS, 2));

    // Two layers stacked (requests, then tokens): still one more send, not one a layer.
    let (server, arrivals) = refusing_first(5, "1").await;
    let (outer, inner) = (
        layer(thirty).build().unwrap(),
        layer(thirty).build().unwrap(),
    );
    let mut client = outer.layer(inner.layer(http_client()));
    let answer = outcome(&mut client, get(&server), &arrivals).await;
    assert_eq!(answer, (StatusCode::TOO_MANY_REQUESTS, 2));

    // A pause of 2 s and a wait of at most 1 s: the 429 at once, sent once.
    let (server, arrivals) = refusing_once("2").await;
    let mut client = layer(Duration::from_secs(1))
        .build()
        .unwrap()
        .layer(http_client());
    let before = tokio::time::Instant::now();
    let answer = outcome(&mut client, get(&server), &arrivals).await;
    assert_eq!(answer, (StatusCode::TOO_MANY_REQUESTS, 1));
    assert_eq!(before.elapsed(), Duration::ZERO);

    // NoReplay: never again, even a GET.
    let (server, arrivals) = refusing_once("1").await;
    let mut client = layer(thirty)
        .replay(NoReplay)
        .build()
        .unwrap()
        .layer(http_client());
    let answer = outcome(&mut client, get(&server), &arrivals).await;
    assert_eq!(answer, (StatusCode::TOO_MANY_REQUESTS, 1));
}

/// Accounts share an upstream, each with its own quota there: the first request of
/// `Authorization: Bearer a` is refused (`Retry-After: 2`), every other is served. The
/// upstream records when (tokio time) each request reached it, and whose it was.
async fn refusing_account_a() -> (
    Server,
    Arc<std::sync::Mutex<Vec<(String, tokio::time::Instant)>>>,
) {
    use axum::response::IntoResponse;
    let arrivals = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&arrivals);
    let app = axum::Router::new().route(
        "/",
        axum::routing::any(move |headers: http::HeaderMap| {
            let seen = Arc::clone(&seen);
            async move {
                let who = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let mut seen = seen.lock().unwrap();
                let first_of_a = who == "Bearer a" && !seen.iter().any(|(w, _)| *w == who);
                seen.push((who, tokio::time::Instant::now()));
                if first_of_a {
                    return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "2")]).into_response();
                }
                StatusCode::OK.into_response()
            }
        }),
    );
    (Server::start(app).await, arrivals)
}

/// One account's 429 pauses that account, not every account of the upstream: the
/// default pause key is the upstream and a digest of the request's `Authorization`.
/// Account `a` is refused (`Retry-After: 2`); `b`, right after, goes at once, and `a`'s
/// next request waits the 2 s out. (The pause used to be keyed by the upstream alone:
/// `b` waited 2 s for `a`'s quota.)
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_accounts_429_pauses_that_account_and_no_other() {
    let (server, arrivals) = refusing_account_a().await;
    let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(1_000).unwrap()).unwrap();
    let mut client = OutboundLayer::builder(paused_store(), policy)
        .replay(NoReplay)
        .jitter(0.0)
        .build()
        .unwrap()
        .layer(http_client());
    let as_account = |who: &str| {
        Request::get(format!("http://{}/", server.addr()))
            .header("authorization", format!("Bearer {who}"))
            .body(Empty::<Bytes>::new())
            .unwrap()
    };
    let mut status = async |who: &str| {
        let response = client.ready().await.unwrap().call(as_account(who)).await;
        response.unwrap().status()
    };
    assert_eq!(status("a").await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status("b").await, StatusCode::OK);
    assert_eq!(status("a").await, StatusCode::OK);
    let arrivals = arrivals.lock().unwrap().clone();
    let whose: Vec<&str> = arrivals.iter().map(|(who, _)| who.as_str()).collect();
    assert_eq!(whose, ["Bearer a", "Bearer b", "Bearer a"]);
    let refused_at = arrivals[0].1;
    assert!(
        arrivals[1].1 - refused_at < Duration::from_millis(100),
        "b waited {:?}",
        arrivals[1].1 - refused_at
    );
    assert!(
        arrivals[2].1 - refused_at >= Duration::from_secs(2),
        "a waited {:?}",
        arrivals[2].1 - refused_at
    );
}

/// One 429 is one pause. The upstream refuses a `GET` and its copy (`Retry-After: 2`):
/// the first refusal pauses the key for 2 s, the copy waits that out and is refused too,
/// and the caller gets the 429 — without a second pause. So another client's request,
/// right after, goes at once. (It used to wait 2 s more: the copy's refusal paused
/// everyone again, two pauses for the one 429 the caller saw.)
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refused_copy_pauses_nobody_a_second_time() {
    let (server, arrivals) = refusing_first(2, "2").await;
    let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(1_000).unwrap()).unwrap();
    let store = paused_store();
    let layer = || {
        OutboundLayer::builder(store.clone(), policy.clone())
            .jitter(0.0)
            .build()
            .unwrap()
            .layer(http_client())
    };
    let (mut first, mut second) = (layer(), layer());
    assert_eq!(
        send(&mut first, &server).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&mut second, &server).await.unwrap().status(),
        StatusCode::OK
    );
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(
        arrivals.len(),
        3,
        "the request, its copy, the other client's"
    );
    assert_eq!(arrivals[1] - arrivals[0], Duration::from_secs(2));
    assert!(
        arrivals[2] - arrivals[1] < Duration::from_millis(100),
        "the other client waited {:?} after the copy's refusal",
        arrivals[2] - arrivals[1]
    );
}

/// `request` through `client` to an upstream recording its `arrivals`: the status the
/// caller got, and how many times the request reached the upstream.
async fn outcome<S, B>(
    client: &mut S,
    request: Request<Empty<Bytes>>,
    arrivals: &std::sync::Mutex<Vec<tokio::time::Instant>>,
) -> (StatusCode, usize)
where
    S: Service<Request<Empty<Bytes>>, Response = http::Response<B>>,
    S::Error: std::fmt::Debug,
{
    let response = client.ready().await.unwrap().call(request).await.unwrap();
    (response.status(), arrivals.lock().unwrap().len())
}

/// A copy waiting out the pause that is dropped sends nothing and charges nothing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_copy_dropped_while_it_waits_out_the_pause_is_never_sent() {
    let (server, arrivals) = refusing_once("2").await;
    let store = paused_store();
    let policy = Policy::new("api", Algorithm::Gcra, Quota::per_hour(10).unwrap()).unwrap();
    let mut client = OutboundLayer::builder(store.clone(), policy.clone())
        .build()
        .unwrap()
        .layer(http_client());
    let call = client.ready().await.unwrap().call(get(&server));
    assert!(
        tokio::time::timeout(Duration::from_secs(1), call)
            .await
            .is_err()
    );
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(arrivals.lock().unwrap().len(), 1);
    // The refused request's charge stands (it was sent); the copy's was never made.
    let key = format!("upstream:{}", server.addr());
    let peek = store
        .operate(key.as_bytes(), &[&policy], Operation::Peek(0))
        .await
        .unwrap();
    assert_eq!(peek[0].remaining(), 9);
}

/// Three 429s at once (three clients' first requests, each `Retry-After: 2`) pause the
/// fleet for 2 s, not 6: each asks the store for "at least 2 s" in one atomic step
/// (`Operation::Drain`), so racing pauses do not add up. Through Redis, where the three
/// responses' store calls interleave; a read-then-charge pause paused them for 4 to 6 s.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn pauses_from_racing_429s_do_not_add_up() {
    let _time = support::keep_time_moving();
    let (server, arrivals) = refusing(3, "2", true).await;
    let server = Arc::new(server);
    let prefix = support::unique_prefix("outbound-pause");
    let policy = Policy::new("api", Algorithm::Gcra, Quota::per_second(1_000).unwrap()).unwrap();
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let store = redis_store(&prefix).await;
        let mut client = OutboundLayer::builder(store, policy.clone())
            .jitter(0.0)
            .build()
            .unwrap()
            .layer(http_client());
        let server = Arc::clone(&server);
        tasks.push(tokio::spawn(async move {
            for _ in 0..2 {
                send(&mut client, &server).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(
        arrivals.len(),
        9,
        "six requests and the three refused again"
    );
    // The first three arrivals were refused (answered together). Nothing got through
    // before the first pause ended, and the first request that did came when one pause
    // would end, not two or three added up.
    let offsets: Vec<Duration> = arrivals.iter().map(|&a| a - arrivals[0]).collect();
    let first_through = offsets[3];
    assert!(
        first_through >= Duration::from_millis(1_900) && first_through <= Duration::from_secs(3),
        "the first request through came {first_through:?} after the first 429; arrivals: {offsets:?}"
    );
}
