//! Whose budget an outbound request draws on, and whose pause it waits out: the
//! built-in keys of the client side.
//!
//! They are [`KeyExtractor`]s, like the server side's. So any of those works here too:
//! [`GlobalKey`](crate::GlobalKey), [`ApiKey`](crate::ApiKey), a closure, a chain.

use std::fmt::Write as _;

use http::{HeaderMap, Request, Uri};
use sha2::{Digest, Sha256};

use crate::key::{Key, KeyExtractor};

/// The headers that say which account a request is made for, in the order they are
/// read: the first one present names it.
pub const ACCOUNT_HEADERS: [&str; 3] = ["authorization", "x-api-key", "api-key"];

/// Keys a request by its upstream, the URI's authority: `upstream:api.example.com`.
///
/// The outbound layer's default key: every upstream has its own budget.
///
/// # Examples
///
/// ```
/// use http::Request;
/// use tollway_tower::{Key, KeyExtractor};
/// use tollway_tower::outbound::Upstream;
///
/// let request = Request::get("https://api.example.com/v1/charges").body(())?;
/// assert_eq!(Upstream.extract(&request), Some(Key::new("upstream", "api.example.com")));
/// # Ok::<(), http::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct Upstream;

impl<B> KeyExtractor<B> for Upstream {
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        Some(Key::new("upstream", authority(request.uri())))
    }
}

/// Keys a request by its upstream and the account it names: the outbound layer's
/// default pause key.
///
/// The account is the first of the [`ACCOUNT_HEADERS`] the request carries, as a
/// digest. So one account's 429 pauses that account only. The credentials never reach
/// the store: only 16 bytes of their SHA-256. A request naming no account is keyed by its
/// upstream alone.
///
/// # Examples
///
/// ```
/// use http::Request;
/// use tollway_tower::{Key, KeyExtractor};
/// use tollway_tower::outbound::UpstreamAccount;
///
/// let anonymous = Request::get("https://api.example.com/v1/charges").body(())?;
/// let key = UpstreamAccount.extract(&anonymous);
/// assert_eq!(key, Some(Key::new("upstream", "api.example.com")));
///
/// let signed = Request::get("https://api.example.com/v1/charges")
///     .header("authorization", "Bearer sk-secret")
///     .body(())?;
/// let key = UpstreamAccount.extract(&signed).unwrap();
/// let value = String::from_utf8_lossy(key.value()).into_owned();
/// assert!(value.starts_with("api.example.com#account:"));
/// assert!(!value.contains("sk-secret"));
/// # Ok::<(), http::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct UpstreamAccount;

impl<B> KeyExtractor<B> for UpstreamAccount {
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        Some(Key::new(
            "upstream",
            account_key(request.uri(), request.headers()),
        ))
    }
}

fn authority(uri: &Uri) -> &str {
    uri.authority().map_or("", |a| a.as_str())
}

/// The upstream and the account the request names, as a digest:
/// `api.example.com#account:3f1c…`, or `api.example.com` when it names none.
fn account_key(uri: &Uri, headers: &HeaderMap) -> String {
    let upstream = authority(uri);
    let Some((name, value)) = ACCOUNT_HEADERS
        .iter()
        .find_map(|&name| Some((name, headers.get(name)?)))
    else {
        return upstream.to_owned();
    };
    let digest = Sha256::new()
        .chain_update(name)
        .chain_update(b":")
        .chain_update(value.as_bytes())
        .finalize();
    let mut key = String::with_capacity(upstream.len() + 41);
    key.push_str(upstream);
    key.push_str("#account:");
    for byte in &digest[..16] {
        // Writing to a String cannot fail.
        let _ = write!(key, "{byte:02x}");
    }
    key
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn the_pause_key_names_the_account_by_a_digest_never_its_credentials() {
        let uri: Uri = "https://api.example.com/v1/charges"
            .parse()
            .unwrap_or_default();
        let mut headers = HeaderMap::new();
        assert_eq!(account_key(&uri, &headers), "api.example.com");
        headers.insert("x-api-key", HeaderValue::from_static("key-b"));
        let by_key = account_key(&uri, &headers);
        headers.insert("authorization", HeaderValue::from_static("Bearer sk-a"));
        let by_bearer = account_key(&uri, &headers);
        assert!(
            by_bearer.starts_with("api.example.com#account:"),
            "{by_bearer}"
        );
        assert_eq!(by_bearer.len(), "api.example.com#account:".len() + 32);
        assert!(!by_bearer.contains("sk-a"), "{by_bearer}");
        assert_ne!(by_key, by_bearer);
        // The same credentials, the same key, in every process.
        assert_eq!(account_key(&uri, &headers), by_bearer);
    }
}
