//! `demo.Catalog` for the tonic examples: the code `build.rs` generates from
//! `proto/catalog.proto` (messages, client, server trait), and the service behind it.

/// What tonic-prost-build generated.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("demo");
}

pub use pb::catalog_client::CatalogClient;
pub use pb::catalog_server::CatalogServer;
pub use pb::{ExportReply, ExportRequest, LookupReply, LookupRequest};
use tonic::{Request, Response, Status};

/// The path of `Export`, which the server limits on its own.
pub const EXPORT: &str = "/demo.Catalog/Export";

/// The catalog itself: SKU, name, stock.
const ITEMS: [(&str, &str, u32); 3] = [
    ("SKU-1", "teapot", 12),
    ("SKU-2", "kettle", 0),
    ("SKU-3", "cup", 140),
];

/// The catalog service.
#[derive(Clone, Copy, Debug, Default)]
pub struct Catalog;

#[tonic::async_trait]
impl pb::catalog_server::Catalog for Catalog {
    async fn lookup(
        &self,
        request: Request<LookupRequest>,
    ) -> Result<Response<LookupReply>, Status> {
        let sku = &request.get_ref().sku;
        let (sku, name, in_stock) = ITEMS
            .iter()
            .find(|(s, _, _)| s == sku)
            .ok_or_else(|| Status::not_found(format!("no item {sku:?}")))?;
        Ok(Response::new(LookupReply {
            sku: (*sku).to_owned(),
            name: (*name).to_owned(),
            in_stock: *in_stock,
        }))
    }

    async fn export(
        &self,
        request: Request<ExportRequest>,
    ) -> Result<Response<ExportReply>, Status> {
        let data = match request.get_ref().format.as_str() {
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
        Ok(Response::new(ExportReply {
            rows: ITEMS.len() as u32,
            data,
        }))
    }
}
