//! A tonic client that meets tollway's limit and honours it: it calls `Export` until the
//! server answers `RESOURCE_EXHAUSTED`, reads the `google.rpc.RetryInfo` in the status
//! details (and the `retry-after` / `grpc-retry-pushback-ms` metadata), waits exactly that
//! long, and calls again — successfully.
//!
//! ```sh
//! cargo run --example tonic_server                          # first, in another terminal
//! cargo run --example tonic_client                          # as demo-free-key
//! API_KEY=demo-pro-key cargo run --example tonic_client     # another caller
//! PORT=50052 cargo run --example tonic_client               # a server on another port
//! ```
//!
//! It exits non-zero when anything is not as the server promises: no denial, a denial
//! without `RetryInfo`, metadata that disagrees with it, or a refused call after the wait.

use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use demo::catalog::{CatalogClient, ExportRequest, LookupRequest};
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};
use tonic_types::StatusExt;

/// Calls made before giving up on being limited (the server allows 3 a minute).
const MAX_CALLS: u32 = 10;

#[tokio::main]
async fn main() -> ExitCode {
    demo::exit(run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let port = demo::port(50051)?;
    let api_key = std::env::var("API_KEY").unwrap_or_else(|_| "demo-free-key".to_owned());
    let uri = format!("http://127.0.0.1:{port}");
    let mut client = CatalogClient::connect(uri.clone()).await.map_err(|e| {
        format!("cannot reach {uri}: {e}\nStart the server first: cargo run --example tonic_server")
    })?;
    println!("calling demo.Catalog at {uri} as x-api-key: {api_key}");

    let item = client
        .lookup(keyed(
            LookupRequest {
                sku: "SKU-1".to_owned(),
            },
            &api_key,
        )?)
        .await?;
    println!(
        "Lookup SKU-1: {} ({} in stock); {}",
        item.get_ref().name,
        item.get_ref().in_stock,
        limits(item.metadata())
    );

    let export = || {
        keyed(
            ExportRequest {
                format: "csv".to_owned(),
            },
            &api_key,
        )
    };
    let mut denial = None;
    for call in 1..=MAX_CALLS {
        match client.export(export()?).await {
            Ok(reply) => println!(
                "Export #{call}: OK, {} rows; {}",
                reply.get_ref().rows,
                limits(reply.metadata())
            ),
            Err(status) if status.code() == Code::ResourceExhausted => {
                println!("Export #{call}: refused");
                denial = Some(status);
                break;
            }
            Err(status) => return Err(format!("Export #{call}: unexpected {status:?}").into()),
        }
    }
    let status = denial.ok_or_else(|| {
        format!("Export was never refused in {MAX_CALLS} calls: is the server rate limiting?")
    })?;
    let wait = explain(&status)?;

    println!("waiting {wait:?}, as RetryInfo says ...");
    tokio::time::sleep(wait).await;
    let reply = client
        .export(export()?)
        .await
        .map_err(|status| format!("Export after waiting {wait:?} was refused: {status:?}"))?;
    println!(
        "Export again: OK, {} rows; {}",
        reply.get_ref().rows,
        limits(reply.metadata())
    );
    Ok(())
}

/// A request for `message` with `x-api-key: <api_key>` metadata.
fn keyed<T>(message: T, api_key: &str) -> Result<tonic::Request<T>, Box<dyn Error>> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert("x-api-key", api_key.parse()?);
    Ok(request)
}

/// Prints what a denial says and checks that its parts agree; returns the wait.
fn explain(status: &Status) -> Result<Duration, Box<dyn Error>> {
    println!(
        "  status:                 {:?} ({}): {}",
        status.code(),
        status.code() as i32,
        status.message()
    );
    let details = status.get_error_details();
    let wait = details
        .retry_info()
        .and_then(|info| info.retry_delay)
        .ok_or("the denial carries no google.rpc.RetryInfo with a retry delay")?;
    println!("  RetryInfo.retry_delay:  {wait:?}");
    if let Some(failure) = details.quota_failure() {
        for violation in &failure.violations {
            println!(
                "  QuotaFailure:           {} — {}",
                violation.subject, violation.description
            );
        }
    }
    let metadata = status.metadata();
    let retry_after = text(metadata, "retry-after");
    let pushback = text(metadata, "grpc-retry-pushback-ms");
    println!(
        "  retry-after:            {}",
        retry_after.unwrap_or("(none)")
    );
    println!("  grpc-retry-pushback-ms: {}", pushback.unwrap_or("(none)"));
    println!("  {}", limits(metadata));

    // retry-after is whole seconds rounded up (never 0); the pushback is milliseconds
    // rounded up: both must say what RetryInfo says.
    let micros = wait.as_micros();
    let secs = micros.div_ceil(1_000_000).max(1).to_string();
    let millis = micros.div_ceil(1_000).to_string();
    if retry_after != Some(secs.as_str()) || pushback != Some(millis.as_str()) {
        return Err(format!(
            "the retry metadata disagrees with RetryInfo ({wait:?}): \
             retry-after {retry_after:?}, grpc-retry-pushback-ms {pushback:?}"
        )
        .into());
    }
    Ok(wait)
}

/// `x-ratelimit-limit/remaining/reset`, for printing.
fn limits(metadata: &MetadataMap) -> String {
    let get = |name| text(metadata, name).unwrap_or("-");
    format!(
        "x-ratelimit-limit {} remaining {} reset {}",
        get("x-ratelimit-limit"),
        get("x-ratelimit-remaining"),
        get("x-ratelimit-reset")
    )
}

fn text<'a>(metadata: &'a MetadataMap, name: &str) -> Option<&'a str> {
    metadata.get(name).and_then(|value| value.to_str().ok())
}
