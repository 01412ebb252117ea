//! Real gRPC for the end-to-end tests: a tonic server on a free loopback port serving
//! the demo `Catalog` behind a layer, a tonic client, and assertions on statuses and
//! metadata.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tollway_core::Store;
use tollway_tower::{KeyExtractor, RateLimitLayer};
use tonic::metadata::MetadataMap;
use tonic::transport::Server;
use tonic::{Code, Status};
use tonic_types::StatusExt;

use crate::catalog::{
    Catalog, CatalogClient, ExportReply, ExportRequest, LookupReply, LookupRequest,
};
use crate::within;

/// What `QuotaFailure` says about a [`per_minute`](crate::stores::per_minute) policy of `n`.
pub fn per_minute_violation(name: &str, n: u32) -> (String, String) {
    (
        format!("policy:{name}"),
        format!("at most {n} units per 60 s (token_bucket)"),
    )
}

/// A tonic server on `127.0.0.1:<free port>`, serving from a spawned task; stopped on
/// drop.
#[derive(Debug)]
pub struct GrpcServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl GrpcServer {
    /// Binds a free loopback port and serves what `serve` makes of it. The port is bound
    /// before this returns, so clients may connect at once.
    pub async fn start<F>(serve: impl FnOnce(TcpListenerStream) -> F) -> Self
    where
        F: Future<Output = Result<(), tonic::transport::Error>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a free loopback port");
        let addr = listener.local_addr().expect("the listener's address");
        let server = serve(TcpListenerStream::new(listener));
        let task = tokio::spawn(async move {
            server.await.expect("the tonic server failed");
        });
        GrpcServer { addr, task }
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A tonic client connected to this server.
    pub async fn client(&self) -> CatalogClient {
        within(
            "connecting",
            10,
            CatalogClient::connect(format!("http://{}", self.addr)),
        )
        .await
        .expect("connect to the test server")
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `catalog` behind `layer`, as `Server::builder().layer(..)` does in a
/// deployment. HTTP/1.1 is accepted too, for the plain-HTTP test.
pub async fn serve<St, K>(layer: RateLimitLayer<St, K>, catalog: &Catalog) -> GrpcServer
where
    St: Store,
    K: KeyExtractor<tonic::body::Body>,
{
    let router = Server::builder()
        .accept_http1(true)
        .layer(layer)
        .add_service(catalog.server());
    GrpcServer::start(|incoming| router.serve_with_incoming(incoming)).await
}

/// A request for `message`, with `x-api-key` metadata when `key` is given.
pub fn request<T>(message: T, key: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("x-api-key", key.parse().unwrap());
    }
    request
}

/// `Lookup` of `SKU-1`, with `x-api-key: key` when given.
pub async fn lookup(
    client: &mut CatalogClient,
    key: Option<&str>,
) -> Result<tonic::Response<LookupReply>, Status> {
    let message = LookupRequest {
        sku: "SKU-1".to_owned(),
    };
    within("Lookup", 10, client.lookup(request(message, key))).await
}

/// `Export` as CSV, with `x-api-key: key` when given.
pub async fn export(
    client: &mut CatalogClient,
    key: Option<&str>,
) -> Result<tonic::Response<ExportReply>, Status> {
    let message = ExportRequest {
        format: "csv".to_owned(),
    };
    within("Export", 10, client.export(request(message, key))).await
}

/// One metadata value's bytes, if present.
pub fn meta<'a>(metadata: &'a MetadataMap, name: &str) -> Option<&'a [u8]> {
    metadata.get(name).map(|v| v.as_bytes())
}

/// An OK Lookup answered by the service.
#[track_caller]
pub fn assert_found(reply: &Result<tonic::Response<LookupReply>, Status>) -> &MetadataMap {
    match reply {
        Ok(reply) => {
            assert_eq!(
                reply.get_ref(),
                &LookupReply {
                    sku: "SKU-1".to_owned(),
                    name: "teapot".to_owned(),
                    in_stock: 12,
                }
            );
            reply.metadata()
        }
        Err(status) => panic!("Lookup failed: {status:?}"),
    }
}

/// An OK Export answered by the service.
#[track_caller]
pub fn assert_exported(reply: &Result<tonic::Response<ExportReply>, Status>) -> &MetadataMap {
    match reply {
        Ok(reply) => {
            assert_eq!(reply.get_ref().rows, 3);
            reply.metadata()
        }
        Err(status) => panic!("Export failed: {status:?}"),
    }
}

/// The `x-ratelimit-*` metadata, byte for byte.
#[track_caller]
pub fn assert_limits(metadata: &MetadataMap, limit: u64, remaining: u64, reset: u64) {
    let (limit, remaining, reset) = (limit.to_string(), remaining.to_string(), reset.to_string());
    assert_eq!(
        (
            meta(metadata, "x-ratelimit-limit"),
            meta(metadata, "x-ratelimit-remaining"),
            meta(metadata, "x-ratelimit-reset"),
        ),
        (
            Some(limit.as_bytes()),
            Some(remaining.as_bytes()),
            Some(reset.as_bytes()),
        ),
        "{metadata:?}"
    );
}

/// No rate-limit metadata of any kind.
#[track_caller]
pub fn assert_no_limits(metadata: &MetadataMap) {
    for name in [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit",
        "ratelimit-policy",
        "retry-after",
        "grpc-retry-pushback-ms",
    ] {
        assert_eq!(meta(metadata, name), None, "{name} in {metadata:?}");
    }
}

/// A denial: `RESOURCE_EXHAUSTED`; `RetryInfo` of exactly `wait`; `QuotaFailure` with
/// the one `violation` (subject, description); `retry-after` in whole seconds rounded up
/// and `grpc-retry-pushback-ms` in milliseconds rounded up, byte for byte. Returns the
/// status's metadata for further checks.
#[track_caller]
pub fn assert_exhausted<'a, T: std::fmt::Debug>(
    reply: &'a Result<T, Status>,
    wait: Duration,
    violation: &(String, String),
) -> &'a MetadataMap {
    let status = match reply {
        Ok(reply) => panic!("expected RESOURCE_EXHAUSTED, got {reply:?}"),
        Err(status) => status,
    };
    let secs = wait.as_micros().div_ceil(1_000_000).max(1);
    let millis = wait.as_micros().div_ceil(1_000);
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        status.message(),
        format!("API rate limit exceeded. Please retry after {secs} seconds.")
    );
    let details = status.get_error_details();
    assert_eq!(
        details.retry_info().map(|info| info.retry_delay),
        Some(Some(wait)),
        "{status:?}"
    );
    let violations: Vec<(String, String)> = details
        .quota_failure()
        .map(|failure| {
            failure
                .violations
                .iter()
                .map(|v| (v.subject.clone(), v.description.clone()))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(violations, std::slice::from_ref(violation), "{status:?}");
    let metadata = status.metadata();
    let (secs, millis) = (secs.to_string(), millis.to_string());
    assert_eq!(
        meta(metadata, "retry-after"),
        Some(secs.as_bytes()),
        "{metadata:?}"
    );
    assert_eq!(
        meta(metadata, "grpc-retry-pushback-ms"),
        Some(millis.as_bytes()),
        "{metadata:?}"
    );
    metadata
}
