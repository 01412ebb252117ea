//! Over real HTTP: a full service answers 503 at once, and a refused request never
//! reaches Redis; slow clients and made-up API keys cannot hold it.

use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use support::http::Server;
use support::redis::{RedisServer, script_calls};
use tokio::sync::{Semaphore, mpsc};
use tollway_core::{Algorithm, Policy, Quota};
use tollway_tower::RateLimitLayer;
use tollway_tower::config::LimitsFile;
use tollway_tower::shed::{Match, Priority, Shed};

/// A held call's answer, once the gate lets it go.
type Held = std::pin::Pin<Box<dyn Future<Output = &'static str> + Send>>;

/// A handler that says when a call is inside, and holds it until the test adds a permit
/// to the gate; the gate, the handler, and where it says so.
fn holding() -> (
    Arc<Semaphore>,
    impl Fn() -> Held + Clone + Send + 'static,
    mpsc::UnboundedReceiver<()>,
) {
    let gate = Arc::new(Semaphore::new(0));
    let (entered, inside) = mpsc::unbounded_channel::<()>();
    let hold = {
        let gate = Arc::clone(&gate);
        move || {
            let (gate, entered) = (Arc::clone(&gate), entered.clone());
            Box::pin(async move {
                let _ = entered.send(());
                gate.acquire().await.unwrap().forget();
                "done"
            }) as Held
        }
    };
    (gate, hold, inside)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_service_answers_503_and_a_refusal_never_reaches_redis() {
    // A server of its own: its script count is this test's alone.
    let redis = RedisServer::start();
    let store = support::redis_store()
        .timeout(std::time::Duration::from_secs(30))
        .connect(&redis.url())
        .await
        .unwrap();
    let policy = Policy::new("api", Algorithm::Gcra, Quota::per_minute(6_000).unwrap()).unwrap();
    // Two calls at once; checkout may always count on one of them.
    let checkout = Priority::new("checkout", 0.5)
        .when(Match::route(Some(http::Method::POST), "/api/v1/checkout").unwrap());
    let shed = Shed::builder()
        .limits(2, 2)
        .priority(checkout)
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(store, policy)
        .shed(shed.clone())
        .build()
        .unwrap();
    let (gate, hold, mut inside) = holding();
    let app = Router::new()
        .route("/search", get(hold.clone()))
        .route("/api/v1/checkout", axum::routing::post(hold))
        .layer(layer);
    let server = Server::start(app).await;
    let client = server.client();

    // A search holds one place; the other is checkout's own.
    let search = tokio::spawn({
        let client = client.clone();
        async move { client.get("/search").await }
    });
    inside.recv().await.unwrap();
    let mut node = redis.connection().await;
    let scripts = script_calls(&mut node).await;
    for _ in 0..20 {
        let refused = client.get("/search").await;
        assert_eq!(refused.status, http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refused.header("retry-after"), Some("1"));
        assert!(refused.header("x-ratelimit-limit").is_none());
        assert!(refused.body.contains("overloaded"), "{}", refused.body);
    }
    assert_eq!(
        script_calls(&mut node).await,
        scripts,
        "twenty refusals, no script call"
    );
    // Checkout within its share is admitted while searches are refused.
    let checkout = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .send(http::Method::POST, "/api/v1/checkout", &[])
                .await
        }
    });
    inside.recv().await.unwrap();
    assert_eq!(script_calls(&mut node).await, scripts + 1);
    gate.add_permits(2);
    for call in [search, checkout] {
        let reply = call.await.unwrap();
        assert_eq!(reply.status, http::StatusCode::OK);
        assert!(reply.header("x-ratelimit-remaining").is_some());
    }
    // Each place is given back when the service answers, before the answer is sent.
    assert_eq!(shed.in_flight(), 0);
    let states = shed.priorities();
    assert_eq!((states[0].admitted, states[0].shed), (1, 0), "checkout");
    assert_eq!((states[1].admitted, states[1].shed), (1, 20), "other");
}

/// What a call through the shedder came to: inside its handler, or refused with 503.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Inside,
    Refused,
}

/// Opens a connection from `local` to `server` and sends a POST whose 100-byte body it
/// never sends; reports on `outcomes` when the server refuses it. The connection stays
/// open while the returned task runs.
async fn slow_upload(
    server: std::net::SocketAddr,
    local: std::net::IpAddr,
    outcomes: mpsc::UnboundedSender<Outcome>,
) -> tokio::task::JoinHandle<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind((local, 0).into()).unwrap();
    let mut stream = socket.connect(server).await.unwrap();
    stream
        .write_all(b"POST /upload HTTP/1.1\r\nhost: tollway\r\ncontent-length: 100\r\n\r\n")
        .await
        .unwrap();
    tokio::spawn(async move {
        let mut head = [0u8; 12];
        if stream.read_exact(&mut head).await.is_ok() && &head == b"HTTP/1.1 503" {
            let _ = outcomes.send(Outcome::Refused);
        }
        // Held open, its body never sent, until the test ends.
        std::future::pending::<()>().await;
    })
}

// The attack: POSTs whose bodies never come, to a handler that reads its body, held
// every place of a priority and the service refused everyone else with 503. One address
// now holds a quarter of a share; everyone else keeps the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_from_one_address_do_not_shed_other_callers() {
    // Eight calls at once, all "other": one address holds two places of the share; its
    // other calls borrow the rest, and hold no place in it.
    let shed = Shed::builder().limits(8, 8).build().unwrap();
    let policy = Policy::new("api", Algorithm::Gcra, Quota::per_minute(6_000).unwrap()).unwrap();
    let layer = RateLimitLayer::builder(tollway_core::MemoryStore::new(), policy)
        .shed(shed.clone())
        .build()
        .unwrap();
    let (outcomes, mut told) = mpsc::unbounded_channel();
    let upload = {
        let outcomes = outcomes.clone();
        move |request: axum::extract::Request| {
            let outcomes = outcomes.clone();
            async move {
                let _ = outcomes.send(Outcome::Inside);
                let body = axum::body::to_bytes(request.into_body(), 1_024).await;
                if body.is_ok() { "stored" } else { "no body" }
            }
        }
    };
    let app = Router::new()
        .route("/upload", axum::routing::post(upload))
        .route("/search", get(|| async { "found" }))
        .layer(layer);
    let server = Server::start(app).await;

    let slow_address = std::net::IpAddr::from([127, 0, 0, 2]);
    let mut held = Vec::new();
    for _ in 0..10 {
        held.push(slow_upload(server.addr(), slow_address, outcomes.clone()).await);
    }
    let mut seen = Vec::new();
    for _ in 0..10 {
        let fate = support::within("a slow upload's fate", 10, told.recv()).await;
        seen.push(fate.unwrap());
    }
    let inside = seen.iter().filter(|o| **o == Outcome::Inside).count();
    assert_eq!(inside, 8, "{seen:?}: the whole limit, waiting for bodies");
    assert_eq!(shed.in_flight(), 8);

    // Twenty other callers, each from its own address: all served, from the share.
    for n in 0..20u8 {
        let client = support::http::Client::from_address(
            server.addr(),
            std::net::IpAddr::from([127, 0, 1, n + 1]),
        );
        let reply = client.get("/search").await;
        assert_eq!(reply.status, http::StatusCode::OK, "caller {n}: {reply:?}");
    }
    for task in held {
        task.abort();
    }
}

/// Team API keys and a pro tier; 10 calls at once, pro's share half of them.
const PRIORITIES: &str = r#"
[layer]
default = "api"

[key]
api_key = { header = "x-api-key" }

[policies.api]
algorithm = "gcra"
limit = 6_000
period = "1m"

[policies.pro]
algorithm = "gcra"
limit = 6_000
period = "1m"

[tiers]
"pro-key" = "pro"

[shed]
floor = 10
ceiling = 10

[[shed.priorities]]
name = "pro"
share = 0.5
tiers = ["pro"]
"#;

// Twelve bots sent made-up API keys: with the documented `headers = ["x-api-key"]`, they
// took the pro priority and a real pro customer got 503 ten times in a row. A header's
// presence is refused now (claimable); a tier's keys are known values, which bots do
// not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_made_up_header_value_does_not_win_a_priority() {
    let presence = PRIORITIES.replace("tiers = [\"pro\"]", "headers = [\"x-api-key\"]");
    let err = LimitsFile::parse("limits.toml", &presence)
        .unwrap_err()
        .to_string();
    assert!(err.contains("any client can send a header"), "{err}");
    assert!(err.contains("headers_present"), "{err}");

    let file = LimitsFile::parse("limits.toml", PRIORITIES).unwrap();
    let layer = file
        .layer(tollway_core::MemoryStore::new(), file.key().unwrap())
        .unwrap();
    let shed = layer.shed().unwrap();
    let (gate, hold, mut inside) = holding();
    let app = Router::new().route("/work", get(hold)).layer(layer);
    let server = Server::start(app).await;
    // Each call says when it is refused; the handler says when one is inside.
    let (refusals, mut refused) = mpsc::unbounded_channel::<()>();
    let call = |n: u8, key: String| {
        let client = support::http::Client::from_address(
            server.addr(),
            std::net::IpAddr::from([127, 0, 2, n]),
        );
        let refusals = refusals.clone();
        tokio::spawn(async move {
            let reply = client.get_with("/work", &[("x-api-key", &key)]).await;
            if reply.status == http::StatusCode::SERVICE_UNAVAILABLE {
                let _ = refusals.send(());
            }
            reply
        })
    };

    // Twelve bots, each from its own address: other's five places, then 503.
    let bots: Vec<_> = (1..=12).map(|n| call(n, format!("made-up-{n}"))).collect();
    let (mut admitted, mut shed_bots) = (0, 0);
    while admitted + shed_bots < 12 {
        tokio::select! {
            Some(()) = inside.recv() => admitted += 1,
            Some(()) = refused.recv() => shed_bots += 1,
        }
    }
    assert_eq!((admitted, shed_bots), (5, 7), "twelve bots, five places");
    // The pro customer is served beside them.
    let pro = call(100, "pro-key".to_owned());
    support::within("the pro customer inside", 10, inside.recv())
        .await
        .unwrap();
    let states = shed.priorities();
    assert_eq!(
        (states[0].name.as_str(), states[0].in_flight, states[0].shed),
        ("pro", 1, 0)
    );
    assert_eq!(
        (states[1].in_flight, states[1].admitted, states[1].shed),
        (5, 5, 7),
        "{states:?}"
    );
    gate.add_permits(100);
    assert_eq!(pro.await.unwrap().status, http::StatusCode::OK);
    for bot in bots {
        bot.await.unwrap();
    }
}
