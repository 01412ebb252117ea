//! The ways around the limit an adversarial review found, each attacked over real HTTP
//! or gRPC (and real Redis where the attack is on Redis), each asserting the limit holds.
//!
//! A server here sees every request come from 127.0.0.1. Where a test needs a trusted
//! proxy in front, the test's client plays the proxy: it connects from 127.0.0.1, which
//! the layer trusts, and sends the header that proxy would write — with the client's own
//! forgeries beside it, as a real proxy would pass them on. The forwarding-header
//! parsers also take a million generated headers in process (`headers`).

#![allow(clippy::unwrap_used)]

mod headers;
mod identity;
mod llm;
mod memory;
mod redis;
mod routes;

use support::http::Reply;

/// How many of `replies` the handler answered.
fn admitted(replies: &[Reply]) -> usize {
    replies
        .iter()
        .filter(|r| r.status == axum::http::StatusCode::OK)
        .count()
}
