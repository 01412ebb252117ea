//! What guards the lab and `/metrics`, which answer without a token: a `Host` that a
//! DNS rebinding attack cannot send, no cross-site writes, and headers that keep the
//! lab's page out of frames and its answers from being sniffed.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use sha2::{Digest, Sha256};

/// The host names routes behind a [`Guard`] answer at.
#[derive(Debug)]
pub struct Guard {
    names: Vec<String>,
    csp: HeaderValue,
}

impl Guard {
    /// A guard answering at `localhost`, any IP address, and `names` (your server's
    /// own names); `page` is the HTML served behind it, whose inline `<script>` and
    /// `<style>` its Content-Security-Policy allows by digest (and nothing else inline).
    pub fn new(names: &[String], page: &str) -> Arc<Self> {
        let digest = |open: &str, close: &str| {
            let body = page
                .split_once(open)
                .and_then(|(_, rest)| rest.split_once(close))
                .map_or("", |(body, _)| body);
            let sum = Sha256::digest(body.as_bytes());
            format!(
                "'sha256-{}'",
                base64::engine::general_purpose::STANDARD.encode(sum)
            )
        };
        let csp = format!(
            "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; \
             img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            digest("<script>", "</script>"),
            digest("<style>", "</style>"),
        );
        Arc::new(Guard {
            names: names.iter().map(|n| n.to_ascii_lowercase()).collect(),
            // Base64 and ASCII only: always a valid header value.
            csp: HeaderValue::from_str(&csp)
                .unwrap_or(HeaderValue::from_static("default-src 'none'")),
        })
    }

    /// Whether `authority` (a `Host`, or an `Origin` without its scheme) is one of
    /// ours: `localhost`, an IP address (a rebinding attack needs a name of its own),
    /// or one of the names given.
    pub fn allows(&self, authority: &str) -> bool {
        let host = host_of(authority);
        host.eq_ignore_ascii_case("localhost")
            || host.parse::<IpAddr>().is_ok()
            || self.names.iter().any(|n| n.eq_ignore_ascii_case(host))
    }

    /// Why a request is refused, if it is: a `Host` that is not ours, or a write
    /// (anything but `GET`/`HEAD`) that another site's page sent.
    fn refusal(&self, method: &Method, headers: &HeaderMap) -> Option<&'static str> {
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
        // No Host at all is no browser: nothing to rebind.
        if host.is_some_and(|h| !self.allows(h)) {
            return Some(
                "this page answers at localhost or an IP address only; \
                 add your server's name to TOLLWAY_HOSTS",
            );
        }
        if matches!(*method, Method::GET | Method::HEAD) {
            return None;
        }
        if headers
            .get("sec-fetch-site")
            .is_some_and(|v| v.as_bytes() == b"cross-site")
        {
            return Some("a cross-site request may not change anything here");
        }
        let origin = headers.get(header::ORIGIN)?;
        let same = origin
            .to_str()
            .ok()
            .and_then(|o| o.split_once("://"))
            .is_some_and(|(_, authority)| {
                self.allows(authority) && host.is_some_and(|h| h.eq_ignore_ascii_case(authority))
            });
        (!same).then_some("a request from another origin may not change anything here")
    }
}

/// The host of `authority`, without its port: `[::1]:3000` is `::1`.
fn host_of(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split_once(']').map_or(rest, |(host, _)| host);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// The middleware: refuses what [`Guard`] refuses (403), and marks every answer
/// `nosniff`, unframeable, with the page's Content-Security-Policy and no referrer.
pub async fn guard(State(guard): State<Arc<Guard>>, request: Request, next: Next) -> Response {
    let mut response = match guard.refusal(request.method(), request.headers()) {
        Some(why) => (StatusCode::FORBIDDEN, why).into_response(),
        None => next.run(request).await,
    };
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, guard.csp.clone());
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_local_names_addresses_and_configured_names_are_ours() {
        let guard = Guard::new(&["Gateway.Example".to_owned()], "");
        for ours in [
            "localhost:3000",
            "127.0.0.1:3000",
            "[::1]:3000",
            "10.0.0.5",
            "gateway.example",
        ] {
            assert!(guard.allows(ours), "{ours}");
        }
        for theirs in [
            "attacker.example:3000",
            "localhost.attacker.example",
            "127.0.0.1.nip.io",
        ] {
            assert!(!guard.allows(theirs), "{theirs}");
        }
    }
}
