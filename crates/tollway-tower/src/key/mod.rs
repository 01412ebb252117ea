//! Who is calling: keys and the extractors that find them.
//!
//! A [`Key`] names the caller a limit applies to. It is built by a [`KeyExtractor`]. That
//! is one of the built-ins ([`PeerIp`], [`ClientIp`], [`ApiKey`], [`UserId`],
//! [`GlobalKey`]), or any closure `Fn(&Request<B>) -> Option<Key>`. Built-ins chain with
//! [`Fallback::or`]. So `api_key.or(client_ip)` is the API key when there is a known one,
//! else the client's address.

mod ip;

use std::collections::{HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::marker::PhantomData;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use http::{HeaderName, Request};
use smallvec::SmallVec;
use tollway_core::ConfigError;

pub(crate) use ip::parse_network;
pub use ip::{ClientIp, ForwardedHeader, PeerIp, peer_addr};

/// A caller's identity for rate limiting: a namespace (`ip`, `key`, `user`, ...) and a
/// value.
///
/// It is kept as `namespace:value` bytes. So an API key can never share a limit with an
/// IP address that happens to spell the same.
///
/// # Examples
///
/// ```
/// use std::net::IpAddr;
/// use tollway_tower::Key;
///
/// let key = Key::new("key", "demo-pro-key");
/// assert_eq!(key.namespace(), "key");
/// assert_eq!(key.value(), b"demo-pro-key");
/// assert_eq!(key.as_bytes(), b"key:demo-pro-key");
///
/// let ip: IpAddr = "203.0.113.9".parse().unwrap();
/// assert_eq!(Key::ip(ip, 64).as_bytes(), b"ip:203.0.113.9");
/// // IPv6 callers are grouped by prefix: one host owns a whole /64.
/// let v6: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
/// assert_eq!(Key::ip(v6, 64).as_bytes(), b"ip:2001:db8:1:2::/64");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key {
    bytes: SmallVec<[u8; 56]>,
    namespace_len: u8,
}

impl Key {
    /// A key `namespace:value`. The namespace is cut to 32 bytes.
    pub fn new(namespace: &str, value: impl AsRef<[u8]>) -> Self {
        let mut key = Key::empty(namespace);
        key.bytes.extend_from_slice(value.as_ref());
        key
    }

    /// `namespace:`, for a value still to be written.
    fn empty(namespace: &str) -> Self {
        let namespace = &namespace.as_bytes()[..namespace.len().min(32)];
        let mut bytes = SmallVec::new();
        bytes.extend_from_slice(namespace);
        bytes.push(b':');
        Key {
            bytes,
            namespace_len: namespace.len() as u8,
        }
    }

    /// The key of a client address: IPv4 as it is, IPv4-mapped IPv6 as IPv4, other IPv6
    /// addresses grouped by their first `ipv6_prefix` bits (0 to 128).
    #[must_use]
    pub fn ip(ip: IpAddr, ipv6_prefix: u8) -> Self {
        match canonical(ip) {
            IpAddr::V4(v4) => Key::ipv4(v4),
            IpAddr::V6(v6) => {
                let mut key = Key::empty("ip");
                if ipv6_prefix >= 128 {
                    key.write(format_args!("{v6}"));
                } else {
                    let mask = u128::MAX
                        .checked_shl(128 - u32::from(ipv6_prefix))
                        .unwrap_or(0);
                    let network = Ipv6Addr::from(u128::from(v6) & mask);
                    key.write(format_args!("{network}/{ipv6_prefix}"));
                }
                key
            }
        }
    }

    /// `ip:a.b.c.d`, the key of most callers: at most 18 bytes, written digit by digit
    /// into the key's inline buffer.
    fn ipv4(v4: Ipv4Addr) -> Self {
        let mut buf = [0u8; 56];
        buf[..3].copy_from_slice(b"ip:");
        let mut len = 3;
        for (i, octet) in v4.octets().into_iter().enumerate() {
            if i > 0 {
                buf[len] = b'.';
                len += 1;
            }
            if octet >= 100 {
                buf[len] = b'0' + octet / 100;
                len += 1;
            }
            if octet >= 10 {
                buf[len] = b'0' + octet / 10 % 10;
                len += 1;
            }
            buf[len] = b'0' + octet % 10;
            len += 1;
        }
        Key {
            bytes: SmallVec::from_buf_and_len(buf, len),
            namespace_len: 2,
        }
    }

    /// Appends formatted text to the value.
    fn write(&mut self, args: fmt::Arguments<'_>) {
        struct Writer<'a>(&'a mut SmallVec<[u8; 56]>);
        impl fmt::Write for Writer<'_> {
            fn write_str(&mut self, s: &str) -> fmt::Result {
                self.0.extend_from_slice(s.as_bytes());
                Ok(())
            }
        }
        // Writing to memory cannot fail.
        let _ = Writer(&mut self.bytes).write_fmt(args);
    }

    /// The namespace (`ip`, `key`, `user`, `global`, or a custom one).
    #[must_use]
    pub fn namespace(&self) -> &str {
        std::str::from_utf8(&self.bytes[..usize::from(self.namespace_len)]).unwrap_or("")
    }

    /// The value, after `namespace:`.
    #[must_use]
    pub fn value(&self) -> &[u8] {
        &self.bytes[usize::from(self.namespace_len) + 1..]
    }

    /// `namespace:value`, as handed to the store.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({:?})", String::from_utf8_lossy(&self.bytes))
    }
}

/// An address as its key sees it: IPv4-mapped IPv6 is IPv4.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Finds the caller's [`Key`] in a request.
///
/// Implemented by the built-in extractors and by every closure
/// `Fn(&Request<B>) -> Option<Key>`. `None` means no key could be found; the layer then
/// does what its [`MissingKey`](crate::MissingKey) setting says.
///
/// # Examples
///
/// ```
/// use http::Request;
/// use tollway_tower::{Key, KeyExtractor};
///
/// // Limit per tenant, named by the first path segment.
/// let tenant = |req: &Request<()>| {
///     let segment = req.uri().path().trim_start_matches('/').split('/').next()?;
///     (!segment.is_empty()).then(|| Key::new("tenant", segment))
/// };
/// let req = Request::get("/acme/orders").body(()).unwrap();
/// assert_eq!(tenant.extract(&req), Some(Key::new("tenant", "acme")));
/// ```
pub trait KeyExtractor<B>: Send + Sync + 'static {
    /// The caller's key, or `None` when this request carries none.
    fn extract(&self, request: &Request<B>) -> Option<Key>;

    /// Hands `found` every key the caller of `request` could be known by: what the
    /// allow and deny lists match (see
    /// [`deny_key`](crate::RateLimitLayerBuilder::deny_key)).
    ///
    /// The default hands over the key [`extract`](Self::extract) finds. A chain
    /// ([`Or`]) hands over every link's keys, not only the one that limits the caller.
    /// Take `api_key.or(client_ip)`. A caller that sends a known API key is known by that
    /// key and by its address. So `ip:<address>` on the deny list refuses it. A closure
    /// has one key, its own. To list more, implement this trait on a type of your own.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::net::SocketAddr;
    /// use http::Request;
    /// use tollway_tower::{ApiKey, Fallback, Key, KeyExtractor, PeerIp};
    ///
    /// let key = ApiKey::header("x-api-key")?.or(PeerIp::new());
    /// let mut req = Request::get("/").header("x-api-key", "k-123").body(())?;
    /// req.extensions_mut().insert("203.0.113.7:5000".parse::<SocketAddr>()?);
    ///
    /// let mut known_by = Vec::new();
    /// key.identities(&req, &mut |key| known_by.push(key));
    /// assert_eq!(known_by, [Key::new("key", "k-123"), Key::new("ip", "203.0.113.7")]);
    /// // The API key alone is what the caller is limited by.
    /// assert_eq!(key.extract(&req), Some(Key::new("key", "k-123")));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn identities(&self, request: &Request<B>, found: &mut dyn FnMut(Key)) {
        if let Some(key) = self.extract(request) {
            found(key);
        }
    }
}

impl<B, F> KeyExtractor<B> for F
where
    F: Fn(&Request<B>) -> Option<Key> + Send + Sync + 'static,
{
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        self(request)
    }
}

/// The value of a request header, such as an API key: `key:<value>`. A request without
/// the header (or with an empty one) has no key.
///
/// A raw header value is whatever the caller sends. Keyed by it alone, a caller that
/// sends a new value with every request gets a fresh limit every time. So accept only the
/// keys you issued, with [`ApiKey::known`]: a set, your tier map, or a lookup of your
/// own. Any other value is no key, and the chain goes on to its fallback. That is usually
/// the caller's address, with [`Fallback::or`]. Or key by the [`UserId`] an
/// authentication layer has checked.
///
/// # Examples
///
/// ```
/// use std::collections::HashSet;
/// use std::net::SocketAddr;
/// use http::Request;
/// use tollway_tower::{ApiKey, Fallback, Key, KeyExtractor, PeerIp};
///
/// let issued = HashSet::from(["k-123".to_owned()]);
/// let key = ApiKey::header("x-api-key")?.known(issued).or(PeerIp::new());
///
/// let request = |api_key: &str| {
///     let mut req = Request::get("/").header("x-api-key", api_key).body(()).unwrap();
///     req.extensions_mut().insert("203.0.113.7:5000".parse::<SocketAddr>().unwrap());
///     req
/// };
/// assert_eq!(key.extract(&request("k-123")), Some(Key::new("key", "k-123")));
/// // A made-up key is the caller's address: it cannot mint a fresh limit.
/// assert_eq!(key.extract(&request("k-random")), Some(Key::new("ip", "203.0.113.7")));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct ApiKey<V = AnyValue> {
    header: HeaderName,
    known: V,
}

impl ApiKey {
    /// Keys callers by the value of the header `name`, any value (see
    /// [`ApiKey::known`]).
    ///
    /// # Errors
    ///
    /// When `name` is not a valid header name.
    pub fn header(name: &str) -> Result<Self, ConfigError> {
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| ConfigError::new(format!("{name:?} is not a valid header name")))?;
        Ok(ApiKey {
            header,
            known: AnyValue,
        })
    }
}

impl<V> ApiKey<V> {
    /// Accepts only the values `known` knows; any other is no key.
    pub fn known<W: KnownKeys>(self, known: W) -> ApiKey<W> {
        ApiKey {
            header: self.header,
            known,
        }
    }

    /// The header's name.
    #[must_use]
    pub fn header_name(&self) -> &HeaderName {
        &self.header
    }
}

impl<B, V: KnownKeys> KeyExtractor<B> for ApiKey<V> {
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        let value = request.headers().get(&self.header)?.as_bytes();
        (!value.is_empty() && self.known.is_known(value)).then(|| Key::new("key", value))
    }
}

/// Which API keys an [`ApiKey`] accepts.
///
/// Implemented by a `HashSet<String>` of issued keys, a `HashMap<String, String>` from key
/// to tier name (the map the layer's tiers are looked up in), closures
/// `Fn(&[u8]) -> bool`, an `Arc` of any of them, and [`AnyValue`].
pub trait KnownKeys: Send + Sync + 'static {
    /// Whether `value` is a key this service issued.
    fn is_known(&self, value: &[u8]) -> bool;
}

/// Every value is a key: a caller that makes up a new one gets a new limit. The default
/// of [`ApiKey::header`]; see [`ApiKey::known`].
#[derive(Clone, Copy, Debug, Default)]
pub struct AnyValue;

impl KnownKeys for AnyValue {
    fn is_known(&self, _value: &[u8]) -> bool {
        true
    }
}

impl KnownKeys for HashSet<String> {
    fn is_known(&self, value: &[u8]) -> bool {
        std::str::from_utf8(value).is_ok_and(|v| self.contains(v))
    }
}

impl KnownKeys for HashMap<String, String> {
    fn is_known(&self, value: &[u8]) -> bool {
        std::str::from_utf8(value).is_ok_and(|v| self.contains_key(v))
    }
}

impl<F> KnownKeys for F
where
    F: Fn(&[u8]) -> bool + Send + Sync + 'static,
{
    fn is_known(&self, value: &[u8]) -> bool {
        self(value)
    }
}

impl<K: KnownKeys + ?Sized> KnownKeys for Arc<K> {
    fn is_known(&self, value: &[u8]) -> bool {
        (**self).is_known(value)
    }
}

/// Chains key extractors: [`or`](Fallback::or) tries another when this one finds no
/// key. Implemented by the built-in extractors and their chains; wrap a closure in
/// [`Or::new`] to chain it.
pub trait Fallback: Sized {
    /// This extractor's key, or when it finds none, `other`'s.
    fn or<O>(self, other: O) -> Or<Self, O> {
        Or::new(self, other)
    }
}

impl<V> Fallback for ApiKey<V> {}
impl Fallback for ClientIp {}
impl Fallback for PeerIp {}
impl<T> Fallback for UserId<T> {}
impl<A, O> Fallback for Or<A, O> {}

/// The key of `first`, or when it finds none, of `then`: see [`Fallback::or`].
#[derive(Clone, Copy, Debug)]
pub struct Or<A, O> {
    first: A,
    then: O,
}

impl<A, O> Or<A, O> {
    /// `first`'s key, or `then`'s.
    pub fn new(first: A, then: O) -> Self {
        Or { first, then }
    }
}

impl<B, A, O> KeyExtractor<B> for Or<A, O>
where
    A: KeyExtractor<B>,
    O: KeyExtractor<B>,
{
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        self.first
            .extract(request)
            .or_else(|| self.then.extract(request))
    }

    fn identities(&self, request: &Request<B>, found: &mut dyn FnMut(Key)) {
        self.first.identities(request, found);
        self.then.identities(request, found);
    }
}

/// A user ID that an authentication layer put in the request's extensions as a `T`:
/// `user:<T as Display>`.
///
/// # Examples
///
/// ```
/// use http::Request;
/// use tollway_tower::{Key, KeyExtractor, UserId};
///
/// #[derive(Clone)]
/// struct AccountId(u64);
/// impl std::fmt::Display for AccountId {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         self.0.fmt(f)
///     }
/// }
///
/// let mut req = Request::get("/").body(()).unwrap();
/// req.extensions_mut().insert(AccountId(42));
/// assert_eq!(UserId::<AccountId>::new().extract(&req), Some(Key::new("user", "42")));
/// ```
pub struct UserId<T> {
    _marker: PhantomData<fn() -> T>,
}

impl<T> UserId<T> {
    /// Keys callers by the `T` in their request's extensions.
    #[must_use]
    pub const fn new() -> Self {
        UserId {
            _marker: PhantomData,
        }
    }
}

impl<T> Default for UserId<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for UserId<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for UserId<T> {}

impl<T> fmt::Debug for UserId<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UserId<{}>", std::any::type_name::<T>())
    }
}

impl<B, T> KeyExtractor<B> for UserId<T>
where
    T: fmt::Display + Send + Sync + 'static,
{
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        let user = request.extensions().get::<T>()?;
        let mut key = Key::empty("user");
        key.write(format_args!("{user}"));
        Some(key)
    }
}

/// One key for everyone: a limit on the whole service (or route).
#[derive(Clone, Copy, Debug, Default)]
pub struct GlobalKey;

impl<B> KeyExtractor<B> for GlobalKey {
    fn extract(&self, _request: &Request<B>) -> Option<Key> {
        Some(Key::new("global", ""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_keys_are_the_dotted_quad() {
        for text in ["0.10.100.255", "1.2.3.4", "199.9.0.20", "255.255.255.255"] {
            let ip: IpAddr = text.parse().unwrap();
            assert_eq!(Key::ip(ip, 64), Key::new("ip", text));
        }
        // Every octet value, in every position, as `Display` writes it.
        for o in 0..=255u8 {
            let ip = Ipv4Addr::new(o, 255 - o, o / 3, o.wrapping_mul(7));
            assert_eq!(Key::ip(IpAddr::V4(ip), 64), Key::new("ip", ip.to_string()));
            assert_eq!(
                Key::ip(IpAddr::V4(ip), 64).value(),
                ip.to_string().as_bytes()
            );
        }
    }

    #[test]
    fn ipv4_mapped_addresses_are_ipv4() {
        let mapped: IpAddr = "::ffff:198.51.100.1".parse().unwrap();
        assert_eq!(Key::ip(mapped, 64), Key::new("ip", "198.51.100.1"));
    }

    #[test]
    fn ipv6_keys_are_grouped_by_prefix() {
        let v6: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        assert_eq!(Key::ip(v6, 64), Key::new("ip", "2001:db8:1:2::/64"));
        assert_eq!(Key::ip(v6, 128), Key::new("ip", "2001:db8:1:2:aaaa::1"));
        assert_eq!(Key::ip(v6, 0), Key::new("ip", "::/0"));
    }

    #[test]
    fn long_namespaces_are_cut() {
        let key = Key::new(&"n".repeat(40), "v");
        assert_eq!(key.namespace().len(), 32);
        assert_eq!(key.value(), b"v");
    }
}
