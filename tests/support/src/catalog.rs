//! The tonic examples' `demo.Catalog` (generated from `examples/proto/catalog.proto`),
//! behind counters of the calls that reach it: a call the rate limiter denies must never
//! get here.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use demo::catalog::pb::catalog_server;
pub use demo::catalog::{
    CatalogServer, EXPORT, ExportReply, ExportRequest, LookupReply, LookupRequest,
};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// A `demo.Catalog` client over one tonic `Channel`; clones share the connection.
pub type CatalogClient = demo::catalog::CatalogClient<Channel>;

/// The service's full name.
pub const SERVICE: &str = "demo.Catalog";

/// The example's catalog, counting its calls. Clones share their counters.
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

    /// The gRPC service to serve, sharing this catalog's counters.
    pub fn server(&self) -> CatalogServer<Self> {
        CatalogServer::new(self.clone())
    }

    /// How many `Lookup` calls reached the service.
    pub fn lookups(&self) -> usize {
        self.calls.lookup.load(Ordering::SeqCst)
    }

    /// How many `Export` calls reached the service.
    pub fn exports(&self) -> usize {
        self.calls.export.load(Ordering::SeqCst)
    }
}

#[tonic::async_trait]
impl catalog_server::Catalog for Catalog {
    async fn lookup(
        &self,
        request: Request<LookupRequest>,
    ) -> Result<Response<LookupReply>, Status> {
        self.calls.lookup.fetch_add(1, Ordering::SeqCst);
        catalog_server::Catalog::lookup(&demo::catalog::Catalog, request).await
    }

    async fn export(
        &self,
        request: Request<ExportRequest>,
    ) -> Result<Response<ExportReply>, Status> {
        self.calls.export.fetch_add(1, Ordering::SeqCst);
        catalog_server::Catalog::export(&demo::catalog::Catalog, request).await
    }
}
