//! `demo.Catalog`, a small gRPC service written by hand: no `.proto` file, no `protoc`.
//!
//! What `tonic-build` would generate from
//!
//! ```proto
//! package demo;
//! service Catalog {
//!   rpc Lookup(LookupRequest) returns (LookupReply);  // cheap
//!   rpc Export(ExportRequest) returns (ExportReply);  // expensive
//! }
//! ```
//!
//! is spelled out here: the messages derive `prost::Message`, the server is a
//! `tower::Service` that routes on the request path and hands each method to
//! `tonic::server::Grpc::unary`, and the client calls `tonic::client::Grpc::unary` with the
//! method's path. The `tonic_server` and `tonic_client` examples and the gRPC end-to-end
//! tests share it.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use http::uri::PathAndQuery;
use tonic::body::Body;
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::transport::{Channel, Endpoint};
use tonic::{GrpcMethod, IntoRequest, Status};
use tonic_prost::ProstCodec;
use tower_service::Service;

/// The service's full name.
pub const SERVICE: &str = "demo.Catalog";
/// The path of `Lookup`.
pub const LOOKUP: &str = "/demo.Catalog/Lookup";
/// The path of `Export`.
pub const EXPORT: &str = "/demo.Catalog/Export";

/// `demo.LookupRequest`: one item, by SKU.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LookupRequest {
    /// The item's stock-keeping unit.
    #[prost(string, tag = "1")]
    pub sku: String,
}

/// `demo.LookupReply`: the item.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LookupReply {
    /// The item's stock-keeping unit.
    #[prost(string, tag = "1")]
    pub sku: String,
    /// What it is called.
    #[prost(string, tag = "2")]
    pub name: String,
    /// How many are in stock.
    #[prost(uint32, tag = "3")]
    pub in_stock: u32,
}

/// `demo.ExportRequest`: the whole catalog, in `format` (`csv` or `json`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportRequest {
    /// `csv` or `json`.
    #[prost(string, tag = "1")]
    pub format: String,
}

/// `demo.ExportReply`: the catalog, rendered.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportReply {
    /// How many items it holds.
    #[prost(uint32, tag = "1")]
    pub rows: u32,
    /// The rendered catalog.
    #[prost(string, tag = "2")]
    pub data: String,
}

/// The catalog itself: SKU, name, stock.
const ITEMS: [(&str, &str, u32); 3] = [
    ("SKU-1", "teapot", 12),
    ("SKU-2", "kettle", 0),
    ("SKU-3", "cup", 140),
];

/// The `demo.Catalog` server. Clones share their call counters, which tell a test how
/// many calls reached a method: a call the rate limiter denies must never get here.
#[derive(Clone, Debug, Default)]
pub struct Catalog {
    calls: Arc<Calls>,
}

#[derive(Debug, Default)]
struct Calls {
    lookup: AtomicUsize,
    export: AtomicUsize,
}

impl Catalog {
    /// A catalog whose counters start at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many `Lookup` calls reached the service.
    pub fn lookups(&self) -> usize {
        self.calls.lookup.load(Ordering::SeqCst)
    }

    /// How many `Export` calls reached the service.
    pub fn exports(&self) -> usize {
        self.calls.export.load(Ordering::SeqCst)
    }

    fn lookup(&self, request: &LookupRequest) -> Result<LookupReply, Status> {
        self.calls.lookup.fetch_add(1, Ordering::SeqCst);
        let (sku, name, in_stock) = ITEMS
            .iter()
            .find(|(sku, _, _)| *sku == request.sku)
            .ok_or_else(|| Status::not_found(format!("no item {:?}", request.sku)))?;
        Ok(LookupReply {
            sku: (*sku).to_owned(),
            name: (*name).to_owned(),
            in_stock: *in_stock,
        })
    }

    fn export(&self, request: &ExportRequest) -> Result<ExportReply, Status> {
        self.calls.export.fetch_add(1, Ordering::SeqCst);
        let data = match request.format.as_str() {
            "csv" => ITEMS
                .iter()
                .map(|(sku, name, stock)| format!("{sku},{name},{stock}\n"))
                .collect(),
            "json" => {
                let rows: Vec<String> = ITEMS
                    .iter()
                    .map(|(sku, name, stock)| {
                        format!(r#"{{"sku":"{sku}","name":"{name}","in_stock":{stock}}}"#)
                    })
                    .collect();
                format!("[{}]", rows.join(","))
            }
            other => {
                return Err(Status::invalid_argument(format!(
                    "format must be \"csv\" or \"json\" (got {other:?})"
                )));
            }
        };
        Ok(ExportReply {
            rows: ITEMS.len() as u32,
            data,
        })
    }
}

/// One method of the catalog, as tonic's unary handler wants it.
struct Method<F> {
    catalog: Catalog,
    handler: F,
}

impl<Req, Rep, F> UnaryService<Req> for Method<F>
where
    F: Fn(&Catalog, &Req) -> Result<Rep, Status>,
{
    type Response = Rep;
    type Future = std::future::Ready<Result<tonic::Response<Rep>, Status>>;

    fn call(&mut self, request: tonic::Request<Req>) -> Self::Future {
        let reply = (self.handler)(&self.catalog, request.get_ref());
        std::future::ready(reply.map(tonic::Response::new))
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl Service<http::Request<Body>> for Catalog {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let catalog = self.clone();
        match request.uri().path() {
            LOOKUP => Box::pin(async move {
                let method = Method {
                    catalog,
                    handler: Catalog::lookup,
                };
                let mut grpc = Grpc::new(ProstCodec::<LookupReply, LookupRequest>::default());
                Ok(grpc.unary(method, request).await)
            }),
            EXPORT => Box::pin(async move {
                let method = Method {
                    catalog,
                    handler: Catalog::export,
                };
                let mut grpc = Grpc::new(ProstCodec::<ExportReply, ExportRequest>::default());
                Ok(grpc.unary(method, request).await)
            }),
            path => {
                let status = Status::unimplemented(format!("{SERVICE} has no method at {path}"));
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

impl NamedService for Catalog {
    const NAME: &'static str = SERVICE;
}

/// A `demo.Catalog` client over one tonic `Channel`; clones share the connection.
#[derive(Clone, Debug)]
pub struct CatalogClient {
    grpc: tonic::client::Grpc<Channel>,
}

impl CatalogClient {
    /// A client for the server at `uri` (`http://127.0.0.1:50051`).
    ///
    /// # Errors
    ///
    /// When `uri` is not a URI or the server cannot be reached.
    pub async fn connect(uri: String) -> Result<Self, tonic::transport::Error> {
        let channel = Endpoint::from_shared(uri)?.connect().await?;
        Ok(Self::new(channel))
    }

    /// A client over `channel`.
    pub fn new(channel: Channel) -> Self {
        CatalogClient {
            grpc: tonic::client::Grpc::new(channel),
        }
    }

    /// Calls `Lookup`.
    ///
    /// # Errors
    ///
    /// The call's status when it is not OK.
    pub async fn lookup(
        &mut self,
        request: impl IntoRequest<LookupRequest>,
    ) -> Result<tonic::Response<LookupReply>, Status> {
        self.unary(request.into_request(), "Lookup", LOOKUP).await
    }

    /// Calls `Export`.
    ///
    /// # Errors
    ///
    /// The call's status when it is not OK.
    pub async fn export(
        &mut self,
        request: impl IntoRequest<ExportRequest>,
    ) -> Result<tonic::Response<ExportReply>, Status> {
        self.unary(request.into_request(), "Export", EXPORT).await
    }

    async fn unary<Req, Rep>(
        &mut self,
        mut request: tonic::Request<Req>,
        method: &'static str,
        path: &'static str,
    ) -> Result<tonic::Response<Rep>, Status>
    where
        Req: prost::Message + Send + Sync + 'static,
        Rep: prost::Message + Default + Send + Sync + 'static,
    {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(format!("{SERVICE} is not reachable: {e}")))?;
        request
            .extensions_mut()
            .insert(GrpcMethod::new(SERVICE, method));
        let codec = ProstCodec::<Req, Rep>::default();
        self.grpc
            .unary(request, PathAndQuery::from_static(path), codec)
            .await
    }
}
