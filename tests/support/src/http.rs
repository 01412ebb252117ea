//! Real HTTP for the end-to-end tests: an axum server on a free loopback port, a hyper
//! client that talks to it over TCP, the application the tests limit, and assertions on
//! what comes back.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tollway_core::Store;
use tollway_tower::{KeyExtractor, RateLimitLayer};

/// An axum server on `127.0.0.1:<free port>`, serving with `ConnectInfo<SocketAddr>` as a
/// deployment would, so the layer sees the real peer address; stopped on drop.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Server {
    /// Binds a free loopback port and serves `app` on it from a spawned task. The port
    /// is bound before this returns, so clients may connect at once.
    pub async fn start(app: Router) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a free loopback port");
        let addr = listener.local_addr().expect("the listener's address");
        let task = tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .expect("the axum server failed");
        });
        Server { addr, task }
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A client for this server.
    pub fn client(&self) -> Client {
        Client::new(self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An HTTP client (hyper-util's pooled client) for one server, HTTP/1.1 or HTTP/2.
/// Clones share the pool.
#[derive(Clone, Debug)]
pub struct Client {
    http: HyperClient<HttpConnector, Full<Bytes>>,
    base: String,
}

impl Client {
    /// An HTTP/1.1 client for the server at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        Client {
            http: HyperClient::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{addr}"),
        }
    }

    /// An HTTP/1.1 client for the server at `addr` whose connections leave from `local`:
    /// another peer address as the server sees it (any address in 127.0.0.0/8 reaches a
    /// loopback server).
    pub fn from_address(addr: SocketAddr, local: IpAddr) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_local_address(Some(local));
        Client {
            http: HyperClient::builder(TokioExecutor::new()).build(connector),
            base: format!("http://{addr}"),
        }
    }

    /// An HTTP/2 client (prior knowledge, no TLS) for the server at `addr`.
    pub fn http2(addr: SocketAddr) -> Self {
        Client {
            http: HyperClient::builder(TokioExecutor::new())
                .http2_only(true)
                .build_http(),
            base: format!("http://{addr}"),
        }
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> Reply {
        self.send(Method::GET, path, &[]).await
    }

    /// `GET path` with extra request headers.
    pub async fn get_with(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        self.send(Method::GET, path, headers).await
    }

    /// Sends one request with an empty body and reads the whole response.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached or the response breaks off: every test expects
    /// an answer.
    pub async fn send(&self, method: Method, path: &str, headers: &[(&str, &str)]) -> Reply {
        self.send_body(method, path, headers, Bytes::new()).await
    }

    /// Sends one request with `body` and reads the whole response (trailers included in
    /// [`Reply::headers`]).
    ///
    /// # Panics
    ///
    /// As [`Client::send`].
    pub async fn send_body(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Reply {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(body))
            .expect("a well-formed request");
        let response = self
            .http
            .request(request)
            .await
            .expect("the server answers");
        let (parts, body) = response.into_parts();
        let collected = body.collect().await.expect("the whole response body");
        let mut headers = parts.headers;
        if let Some(trailers) = collected.trailers() {
            headers.extend(trailers.clone());
        }
        let body = collected.to_bytes();
        Reply {
            status: parts.status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }
}

/// A response as the client received it.
#[derive(Debug)]
pub struct Reply {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The body, as text.
    pub body: String,
}

impl Reply {
    /// A response header's value, if present.
    ///
    /// # Panics
    ///
    /// When the value is not visible ASCII.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("a visible-ASCII header value"))
    }
}

/// How many requests reached a handler: a denied request must never get there.
#[derive(Clone, Debug, Default)]
pub struct Hits(Arc<AtomicUsize>);

impl Hits {
    /// Requests the handlers answered.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// The application behind the layer: `GET /`, `GET /api/v1/items` and
/// `POST /api/v1/checkout`, which answer `ok` and count their hits.
pub fn routes(hits: &Hits) -> Router {
    let handler = |hits: Hits| {
        move || {
            hits.0.fetch_add(1, Ordering::SeqCst);
            async { "ok" }
        }
    };
    Router::new()
        .route("/", get(handler(hits.clone())))
        .route("/api/v1/items", get(handler(hits.clone())))
        .route("/api/v1/checkout", post(handler(hits.clone())))
}

/// Serves [`routes`] behind `layer` on a fresh loopback port.
pub async fn serve<St, K>(layer: RateLimitLayer<St, K>, hits: &Hits) -> Server
where
    St: Store,
    K: KeyExtractor<axum::body::Body>,
{
    Server::start(routes(hits).layer(layer)).await
}

/// A 200 from the handler.
#[track_caller]
pub fn assert_ok(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::OK, "{reply:#?}");
    assert_eq!(reply.body, "ok", "{reply:#?}");
}

/// The legacy headers, exactly.
#[track_caller]
pub fn assert_limits(reply: &Reply, limit: u64, remaining: u64, reset: u64) {
    let header = |name| reply.header(name).map(str::to_owned);
    assert_eq!(
        (
            header("x-ratelimit-limit"),
            header("x-ratelimit-remaining"),
            header("x-ratelimit-reset"),
        ),
        (
            Some(limit.to_string()),
            Some(remaining.to_string()),
            Some(reset.to_string()),
        ),
        "{reply:#?}"
    );
}

/// The default denial: 429, `Retry-After` and the JSON body, exactly.
#[track_caller]
pub fn assert_too_many(reply: &Reply, retry_after: u64) {
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS, "{reply:#?}");
    assert_eq!(
        reply.header("retry-after"),
        Some(retry_after.to_string().as_str()),
        "{reply:#?}"
    );
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(
        reply.body,
        format!(
            r#"{{"error":"Too Many Requests","message":"API rate limit exceeded. Please retry after {retry_after} seconds."}}"#
        )
    );
}

/// No rate-limit header of any style.
#[track_caller]
pub fn assert_no_limit_headers(reply: &Reply) {
    for name in [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit",
        "ratelimit-policy",
        "retry-after",
    ] {
        assert_eq!(reply.header(name), None, "{name} in {reply:#?}");
    }
}

/// An LLM completion call through a gateway at `addr` (`POST /v1/completions`, the
/// `demo::llm` example's): its status, and the token events it read (`"token"` in
/// server-sent events). With `cut_after`, the client goes away once it has read that
/// many or more (events may share a frame): its connection closes with the stream half
/// read.
///
/// # Panics
///
/// When the gateway cannot be reached, or answers what is not UTF-8.
pub async fn completion(
    addr: SocketAddr,
    headers: &[(&str, &str)],
    body: &str,
    cut_after: Option<u64>,
) -> (StatusCode, u64) {
    let client: HyperClient<_, Full<Bytes>> =
        HyperClient::builder(TokioExecutor::new()).build_http();
    let mut request = Request::post(format!("http://{addr}/v1/completions"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("a well-formed request");
    let response = client.request(request).await.expect("the gateway answers");
    let status = response.status();
    let mut body = response.into_body();
    let (mut tokens, mut read) = (0, Vec::new());
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(data) = frame.data_ref() {
            read.extend_from_slice(data);
        }
        // Whole events only: one may be split across frames.
        while let Some(end) = read.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = read.drain(..end + 2).collect();
            let text = std::str::from_utf8(&event).expect("server-sent events are UTF-8");
            tokens += text.matches("\"token\"").count() as u64;
        }
        if cut_after.is_some_and(|cut| tokens >= cut) {
            break;
        }
    }
    (status, tokens)
}

/// An application that stamps each `GET /` it serves with the time it came, and answers
/// `ok`: what passed a proxy in front of it, and when.
#[derive(Clone, Debug, Default)]
pub struct Stamps(Arc<std::sync::Mutex<Vec<std::time::Instant>>>);

impl Stamps {
    /// The application, started on a free loopback port, and its stamps.
    pub async fn serve() -> (Server, Stamps) {
        let stamps = Stamps::default();
        let app = Router::new().route(
            "/",
            get({
                let stamps = stamps.clone();
                move || async move {
                    stamps
                        .0
                        .lock()
                        .expect("stamps")
                        .push(std::time::Instant::now());
                    "ok"
                }
            }),
        );
        (Server::start(app).await, stamps)
    }

    /// The stamps since `started`, in order.
    pub fn since(&self, started: std::time::Instant) -> Vec<std::time::Duration> {
        let mut times: Vec<_> = self
            .0
            .lock()
            .expect("stamps")
            .iter()
            .map(|t| t.saturating_duration_since(started))
            .collect();
        times.sort();
        times
    }
}

/// The most of `times` (in order) within any window of `window`.
pub fn most_within(times: &[std::time::Duration], window: std::time::Duration) -> usize {
    let mut most = 0;
    let mut start = 0;
    for end in 0..times.len() {
        while times[end] - times[start] >= window {
            start += 1;
        }
        most = most.max(end + 1 - start);
    }
    most
}
