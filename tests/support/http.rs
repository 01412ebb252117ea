//! Real HTTP for the end-to-end tests: an axum server on a free loopback port, and a
//! hyper client that talks to it over TCP.
//!
//! Declared by the HTTP tests with `#[path]` rather than from `support/mod.rs`, which
//! tollway-core's Redis bench includes too and which must not need axum.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;

use axum::Router;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

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

/// An HTTP/1.1 client (hyper-util's pooled client) for one server. Clones share the pool.
#[derive(Clone, Debug)]
pub struct Client {
    http: HyperClient<HttpConnector, Full<Bytes>>,
    base: String,
}

impl Client {
    /// A client for the server at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        Client {
            http: HyperClient::builder(TokioExecutor::new()).build_http(),
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
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(Bytes::new()))
            .expect("a well-formed request");
        let response = self
            .http
            .request(request)
            .await
            .expect("the server answers");
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .expect("the whole response body")
            .to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8(body.to_vec()).expect("a UTF-8 response body"),
        }
    }
}

/// A response as the client received it.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
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
