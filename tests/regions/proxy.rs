//! The harness: the proxy delays each way and a cut holds traffic; a store across the
//! distance pays the round trip, and times out when the link is cut.

use super::*;

/// An echo server on loopback.
async fn echo() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = [0u8; 1024];
                while let Ok(n) = socket.read(&mut buffer).await {
                    if n == 0 || socket.write_all(&buffer[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

async fn ping(stream: &mut TcpStream) {
    stream.write_all(b"ping").await.unwrap();
    let mut answer = [0u8; 4];
    stream.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"ping");
}

/// On tokio's paused clock, which the proxy's delays run on: a round trip takes twice
/// the one-way delay, exactly, and follows a change of it; a cut holds a message for as
/// long as it lasts (10 s here) on an open connection, and the heal delivers it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_proxy_delays_each_way_and_a_cut_holds_traffic_until_healed() {
    let proxy = LatencyProxy::start(echo().await, Duration::from_millis(40)).await;
    let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
    let before = tokio::time::Instant::now();
    ping(&mut stream).await;
    assert_eq!(before.elapsed(), Duration::from_millis(80));

    proxy.set_one_way(Duration::from_millis(75));
    let before = tokio::time::Instant::now();
    ping(&mut stream).await;
    assert_eq!(before.elapsed(), Duration::from_millis(150));

    proxy.cut();
    let before = tokio::time::Instant::now();
    let held = tokio::time::timeout(Duration::from_secs(10), ping(&mut stream)).await;
    assert!(held.is_err(), "a message crossed a cut link");
    proxy.heal();
    // The ping sent into the cut is delivered now; its echo comes a one-way later.
    let mut answer = [0u8; 4];
    stream.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"ping");
    assert_eq!(before.elapsed(), Duration::from_millis(10_075));
}

/// A gateway deciding against a Redis one region away (35 ms each way; the store in
/// caller time on tokio's paused clock, which the proxy's delays and the store's timeout
/// run on) pays the round trip per decision; with the link cut, a decision fails with a
/// timeout after the store's 300 ms instead of hanging, and decisions come back once the
/// link heals.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_store_across_the_distance_pays_the_round_trip_and_a_cut_times_out() {
    let _time = support::keep_time_moving();
    let server = RedisServer::start();
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = LatencyProxy::start(target, Duration::from_millis(35)).await;
    let store = within(
        "connecting across the proxy",
        10,
        support::redis_store()
            .prefix(support::unique_prefix("regions"))
            .caller_time(TokioClock::new())
            .timeout(Duration::from_millis(300))
            // A round trip of 70 ms: a stall watch would take every call for a stall
            // (stall_after is for a near Redis); the timeout decides here.
            .without_stall_detection()
            .without_breaker()
            .without_local_fallback()
            .connect(&proxy.redis_url()),
    )
    .await
    .unwrap();
    let policy = Policy::new("global", Algorithm::Gcra, Quota::per_minute(100).unwrap()).unwrap();
    for _ in 0..3 {
        let before = tokio::time::Instant::now();
        let decisions = store.check(b"customer-1", &[&policy], 1).await.unwrap();
        assert!(decisions.is_allowed());
        let took = before.elapsed();
        assert!(
            took >= Duration::from_millis(70),
            "a decision took {took:?}"
        );
    }

    proxy.cut();
    let before = tokio::time::Instant::now();
    let cut = within("a decision across a cut link", 5, async {
        store.check(b"customer-1", &[&policy], 1).await
    })
    .await;
    assert_eq!(cut.unwrap_err().kind(), StoreErrorKind::Timeout);
    assert!(before.elapsed() >= Duration::from_millis(300));
    proxy.heal();
    let healed = within("a decision after the heal", 10, async {
        store.check(b"customer-1", &[&policy], 1).await
    })
    .await;
    assert!(healed.unwrap().is_allowed());
}
