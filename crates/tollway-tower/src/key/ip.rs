//! Keys from addresses: the connection's peer, or the client behind trusted proxies.

use std::net::{IpAddr, SocketAddr};

use http::Request;
use tollway_core::ConfigError;

use super::{Key, KeyExtractor, canonical};

/// The address of the connection's peer, as the server recorded it in the request's
/// extensions.
///
/// That is axum's `ConnectInfo<SocketAddr>` (feature `axum`). Serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`. Or it is tonic's
/// `TcpConnectInfo` (feature `tonic`), or a plain `SocketAddr`.
#[must_use]
pub fn peer_addr<B>(request: &Request<B>) -> Option<IpAddr> {
    let ext = request.extensions();
    #[cfg(feature = "axum")]
    if let Some(info) = ext.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(info.0.ip());
    }
    #[cfg(feature = "tonic")]
    if let Some(info) = ext.get::<tonic::transport::server::TcpConnectInfo>()
        && let Some(addr) = info.remote_addr()
    {
        return Some(addr.ip());
    }
    ext.get::<SocketAddr>().map(SocketAddr::ip)
}

/// The connection's peer address, IPv6 grouped by prefix (default /64).
///
/// It is right when clients connect directly. It is wrong behind a proxy, where every
/// caller would be the proxy. Use [`ClientIp`] there.
#[derive(Clone, Copy, Debug)]
pub struct PeerIp {
    ipv6_prefix: u8,
}

impl PeerIp {
    /// Peer addresses, IPv6 grouped by /64.
    #[must_use]
    pub const fn new() -> Self {
        PeerIp { ipv6_prefix: 64 }
    }

    /// Groups IPv6 addresses by their first `bits` bits (128: no grouping).
    ///
    /// # Errors
    ///
    /// When `bits` is more than 128.
    pub fn ipv6_prefix(self, bits: u8) -> Result<Self, ConfigError> {
        check_prefix(bits)?;
        Ok(PeerIp { ipv6_prefix: bits })
    }
}

impl Default for PeerIp {
    fn default() -> Self {
        Self::new()
    }
}

impl<B> KeyExtractor<B> for PeerIp {
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        peer_addr(request).map(|ip| Key::ip(ip, self.ipv6_prefix))
    }
}

fn check_prefix(bits: u8) -> Result<(), ConfigError> {
    if bits > 128 {
        return Err(ConfigError::new(format!(
            "IPv6 prefix must be 0 to 128 bits (got {bits}); 64 groups one host's addresses"
        )));
    }
    Ok(())
}

/// The header a trusted proxy writes with the address of the client it serves.
///
/// Proxies write one of these, and pass the others through as the client sent them. So
/// [`ClientIp`] reads exactly the one named. A client can put any of the others in its
/// request, and none of them is believed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `Forwarded: for=...` (RFC 7239), one element a hop, each proxy appending its own.
    Forwarded,
    /// `X-Forwarded-For: <client>, <proxy 1>, ...`, each proxy appending the address it saw.
    XForwardedFor,
    /// `X-Real-IP: <client>`: one address, written by the one proxy in front.
    XRealIp,
}

impl ForwardedHeader {
    fn name(self) -> http::HeaderName {
        match self {
            ForwardedHeader::Forwarded => http::header::FORWARDED,
            ForwardedHeader::XForwardedFor => http::HeaderName::from_static("x-forwarded-for"),
            ForwardedHeader::XRealIp => http::HeaderName::from_static("x-real-ip"),
        }
    }
}

/// The client's address behind reverse proxies.
///
/// It is read from the one header the proxies write. It is read only when the
/// connection comes from a trusted proxy. The rules, all of them:
///
/// - The connection's peer is not a trusted proxy. Then the peer is the client, and no
///   header is read. A client cannot pick its own key by sending one.
/// - The peer is trusted. Then the configured header is read from its last entry
///   backwards. Each proxy appends the address it saw. So only the entries the trusted
///   proxies added are true. The first one that is not itself a trusted proxy is the
///   client. With [`trusted_hops`](ClientIp::trusted_hops), the client is instead the
///   entry as many places from the right as there are proxies. No other header is read,
///   whatever it says.
/// - At most 32 entries are read, from the right. An entry longer than 64 bytes is not an
///   address. So a huge or long header costs no more than a short one.
/// - The header is missing. Then the peer itself is the client: a proxy's own health
///   check, say. A proxy that writes the header writes it on every request it forwards.
/// - The entry where the client should be is not an address. It may be `for=unknown`, an
///   obfuscated identifier, an empty value, garbage, or bytes that are not ASCII. Or
///   every entry read is a trusted proxy. Or, counting hops, there are fewer entries than
///   proxies. Then the client is unknown, and `ClientIp` finds no key. The layer does
///   what its fallback says: a chain with [`or`](crate::Fallback::or), or
///   [`MissingKey`](crate::MissingKey). What a client wrote further left is never
///   reached.
/// - IPv4-mapped IPv6 addresses count as IPv4, in entries and in trusted networks.
///
/// # Examples
///
/// ```
/// use std::net::SocketAddr;
/// use http::Request;
/// use tollway_tower::{ClientIp, ForwardedHeader, Key, KeyExtractor};
///
/// // The load balancers at 10.0.0.0/8 write X-Forwarded-For.
/// let client_ip = ClientIp::new(ForwardedHeader::XForwardedFor, ["10.0.0.0/8"])?;
///
/// // Through the load balancer at 10.0.0.5: the entry it appended is believed, not the
/// // one the client wrote before it.
/// let mut req = Request::get("/")
///     .header("x-forwarded-for", "6.6.6.6, 198.51.100.7")
///     .header("forwarded", "for=7.7.7.7") // not the configured header: never read
///     .body(())?;
/// req.extensions_mut().insert("10.0.0.5:40000".parse::<SocketAddr>()?);
/// assert_eq!(client_ip.extract(&req), Some(Key::new("ip", "198.51.100.7")));
///
/// // Straight from the internet: the same header is ignored.
/// let mut req = Request::get("/").header("x-forwarded-for", "198.51.100.7").body(())?;
/// req.extensions_mut().insert("203.0.113.66:5000".parse::<SocketAddr>()?);
/// assert_eq!(client_ip.extract(&req), Some(Key::new("ip", "203.0.113.66")));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct ClientIp {
    header: ForwardedHeader,
    trusted: Vec<ipnet::IpNet>,
    /// `Some(n)`: exactly `n` proxies in front, counted rather than recognised.
    hops: Option<usize>,
    /// Where the counted proxies' own addresses must be (empty: anywhere).
    hops_through: Vec<ipnet::IpNet>,
    ipv6_prefix: u8,
}

/// The most entries of a forwarding header read, from the right.
const MAX_HOPS: usize = 32;
/// The longest entry that can be an address (`for="[v6]:port"` with room to spare).
const MAX_ENTRY: usize = 64;

impl ClientIp {
    /// Reads the client's address from `header`, believed only from proxies in
    /// `trusted_proxies` (networks such as `10.0.0.0/8`, or single addresses).
    ///
    /// # Errors
    ///
    /// When a network does not parse, or is written in IPv4-mapped IPv6 with a prefix
    /// shorter than 96 bits (it would cover both IPv4 and IPv6 addresses).
    pub fn new<I, S>(header: ForwardedHeader, trusted_proxies: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let trusted = trusted_proxies
            .into_iter()
            .map(|n| parse_network(n.as_ref()))
            .collect::<Result<_, _>>()?;
        Ok(ClientIp {
            header,
            trusted,
            hops: None,
            hops_through: Vec::new(),
            ipv6_prefix: 64,
        })
    }

    /// Counts the proxies instead of recognising each by its address.
    ///
    /// Every request passes through exactly `proxies` of them (1 to 32). The last is the
    /// peer, which must still be in the trusted networks. Each proxy appends what it saw.
    /// So the client is the `proxies`-th entry from the right, whatever the entries to its
    /// right are. This is for proxies whose addresses are not known in advance, such as a
    /// CDN in front of a load balancer (2).
    ///
    /// Fewer entries than that means the request did not come through all of them. Then
    /// the client is unknown. No header at all, as ever, makes the peer the client.
    ///
    /// Counting is safe only if no request reaches the trusted proxy without passing the
    /// others. Say a client connects to the load balancer directly, past the CDN. It then
    /// stands where the CDN's address should be. The entry counted as the client is one it
    /// wrote itself. Firewall the balancer to the CDN, or name the CDN's networks with
    /// [`hops_through`](Self::hops_through).
    ///
    /// # Errors
    ///
    /// When `proxies` is 0 or more than 32. When the header is `X-Real-IP`: it has one
    /// entry, so only 1 proxy can write it, the default.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::net::SocketAddr;
    /// use http::Request;
    /// use tollway_tower::{ClientIp, ForwardedHeader, Key, KeyExtractor};
    ///
    /// // A CDN (any address) in front of the load balancers at 10.0.0.0/8.
    /// let client_ip =
    ///     ClientIp::new(ForwardedHeader::XForwardedFor, ["10.0.0.0/8"])?.trusted_hops(2)?;
    /// let mut req = Request::get("/")
    ///     // what the client forged, the client (by the CDN), the CDN (by the balancer)
    ///     .header("x-forwarded-for", "6.6.6.6, 198.51.100.7, 203.0.113.80")
    ///     .body(())?;
    /// req.extensions_mut().insert("10.0.0.5:40000".parse::<SocketAddr>()?);
    /// assert_eq!(client_ip.extract(&req), Some(Key::new("ip", "198.51.100.7")));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn trusted_hops(mut self, proxies: usize) -> Result<Self, ConfigError> {
        if proxies == 0 || proxies > MAX_HOPS {
            return Err(ConfigError::new(format!(
                "trusted hops must be 1 to {MAX_HOPS} proxies (got {proxies}): count the \
                 proxies a request passes through, the one that connects included"
            )));
        }
        if self.header == ForwardedHeader::XRealIp && proxies > 1 {
            return Err(ConfigError::new(
                "X-Real-IP holds one address, written by the one proxy in front: count 1 hop, \
                 or read X-Forwarded-For or Forwarded",
            ));
        }
        self.hops = Some(proxies);
        Ok(self)
    }

    /// Counts a hop only through the proxies in `networks`, such as a CDN's published
    /// ranges. It applies after [`trusted_hops`](Self::trusted_hops).
    ///
    /// Where a counted proxy's address should be, an entry outside `networks` is the
    /// client. It came in past the proxies. So a client that reaches the load balancer
    /// directly is keyed by its own address, not by what it wrote.
    ///
    /// # Errors
    ///
    /// When `trusted_hops` was not set first, `networks` is empty, or a network does not
    /// parse.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::net::SocketAddr;
    /// use http::Request;
    /// use tollway_tower::{ClientIp, ForwardedHeader, Key, KeyExtractor};
    ///
    /// // The CDN at 203.0.113.0/24 in front of the load balancers at 10.0.0.0/8.
    /// let client_ip = ClientIp::new(ForwardedHeader::XForwardedFor, ["10.0.0.0/8"])?
    ///     .trusted_hops(2)?
    ///     .hops_through(["203.0.113.0/24"])?;
    /// // Past the CDN, straight to the balancer, with a forged entry: its own address.
    /// let mut direct = Request::get("/")
    ///     .header("x-forwarded-for", "6.6.6.6, 198.51.100.7")
    ///     .body(())?;
    /// direct.extensions_mut().insert("10.0.0.5:40000".parse::<SocketAddr>()?);
    /// assert_eq!(client_ip.extract(&direct), Some(Key::new("ip", "198.51.100.7")));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn hops_through<I, S>(mut self, networks: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        if self.hops.is_none() {
            return Err(ConfigError::new(
                "hops_through names where counted proxies are: set trusted_hops first",
            ));
        }
        let networks: Vec<ipnet::IpNet> = networks
            .into_iter()
            .map(|n| parse_network(n.as_ref()))
            .collect::<Result<_, _>>()?;
        if networks.is_empty() {
            return Err(ConfigError::new(
                "hops_through needs the networks the counted proxies are in, like a CDN's \
                 published ranges",
            ));
        }
        self.hops_through = networks;
        Ok(self)
    }

    /// Groups IPv6 addresses by their first `bits` bits (default 64; 128: no grouping).
    ///
    /// # Errors
    ///
    /// When `bits` is more than 128.
    pub fn ipv6_prefix(mut self, bits: u8) -> Result<Self, ConfigError> {
        check_prefix(bits)?;
        self.ipv6_prefix = bits;
        Ok(self)
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    /// The client's address for a request whose connection came from `peer`, or `None`
    /// when the trusted proxies could not name it (see the rules above).
    #[must_use]
    pub fn client<B>(&self, peer: IpAddr, request: &Request<B>) -> Option<IpAddr> {
        if !self.trusts(peer) {
            return Some(peer);
        }
        let mut entries = self.entries(request.headers()).take(MAX_HOPS).peekable();
        if entries.peek().is_none() {
            return Some(peer);
        }
        if let Some(proxies) = self.hops {
            // Counted: the client is the entry the first of the proxies wrote. Through
            // named networks only: an entry where a proxy should be that is not one is
            // the client.
            let mut entries = entries.map(|entry| entry.map(canonical));
            if !self.hops_through.is_empty() {
                for _ in 1..proxies {
                    let proxy = entries.next()??;
                    if !self.hops_through.iter().any(|net| net.contains(&proxy)) {
                        return Some(proxy);
                    }
                }
                return entries.next().flatten();
            }
            return entries.nth(proxies - 1).flatten();
        }
        for entry in entries {
            let ip = canonical(entry?);
            if !self.trusts(ip) {
                return Some(ip);
            }
        }
        // Every entry read was a trusted proxy: whoever came before is not known.
        None
    }

    /// The configured header's entries, last first, each an address or `None`.
    fn entries<'h>(
        &self,
        headers: &'h http::HeaderMap,
    ) -> impl Iterator<Item = Option<IpAddr>> + 'h {
        let header = self.header;
        // Entries are separated by commas, but X-Real-IP is one address: its last line's,
        // whole.
        let (separator, lines): (fn(&u8) -> bool, usize) = match header {
            ForwardedHeader::XRealIp => (|_| false, 1),
            ForwardedHeader::Forwarded | ForwardedHeader::XForwardedFor => {
                (|&b| b == b',', usize::MAX)
            }
        };
        let lines = headers.get_all(header.name()).into_iter().rev().take(lines);
        lines.flat_map(move |line| {
            line.as_bytes()
                .rsplit(separator)
                .map(move |entry| match header {
                    ForwardedHeader::Forwarded => forwarded_for(entry),
                    ForwardedHeader::XForwardedFor | ForwardedHeader::XRealIp => address(entry),
                })
        })
    }
}

impl<B> KeyExtractor<B> for ClientIp {
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        let peer = peer_addr(request)?;
        let client = self.client(peer, request)?;
        Some(Key::ip(client, self.ipv6_prefix))
    }
}

/// A trusted network: CIDR (`10.0.0.0/8`, `2001:db8::/32`) or one address, IPv4-mapped
/// IPv6 networks written as the IPv4 network they are.
pub(crate) fn parse_network(text: &str) -> Result<ipnet::IpNet, ConfigError> {
    let text = text.trim();
    let bad = || {
        ConfigError::new(format!(
            "{text:?} is not a network: write an address or address/prefix, like 10.0.0.0/8 or 2001:db8::/32"
        ))
    };
    let net = match text.parse::<ipnet::IpNet>() {
        Ok(net) => net,
        Err(_) => ipnet::IpNet::from(text.parse::<IpAddr>().map_err(|_| bad())?),
    };
    if net != net.trunc() {
        return Err(ConfigError::new(format!(
            "{text:?} has bits set past its /{prefix} prefix, so it would mean {whole}: write \
             {whole} for the whole network, or {host}/{bits} for the one address",
            prefix = net.prefix_len(),
            whole = net.trunc(),
            host = net.addr(),
            bits = net.max_prefix_len(),
        )));
    }
    match net {
        // Written in IPv4-mapped form: the IPv4 network it means, which is what mapped
        // addresses are compared with.
        ipnet::IpNet::V6(v6) if v6.addr().to_ipv4_mapped().is_some() => {
            let prefix = v6.prefix_len();
            let v4 = v6.network().to_ipv4_mapped().filter(|_| prefix >= 96);
            let v4 = v4.ok_or_else(|| {
                ConfigError::new(format!(
                    "{text:?} is an IPv4-mapped IPv6 network wider than IPv4 (a prefix under \
                     96): write the IPv4 network, like 127.0.0.0/8"
                ))
            })?;
            let v4 = ipnet::Ipv4Net::new(v4, prefix - 96).map_err(|_| bad())?;
            Ok(ipnet::IpNet::V4(v4))
        }
        ipnet::IpNet::V4(_) | ipnet::IpNet::V6(_) => Ok(net),
    }
}

/// The `for=` parameter of one `Forwarded` element (RFC 7239), if it is an address.
fn forwarded_for(element: &[u8]) -> Option<IpAddr> {
    element.split(|&b| b == b';').find_map(|pair| {
        let pair = pair.trim_ascii();
        let (name, value) = pair.split_at(pair.iter().position(|&b| b == b'=')?);
        if !name.trim_ascii().eq_ignore_ascii_case(b"for") {
            return None;
        }
        let value = value[1..].trim_ascii();
        let value = value
            .strip_prefix(b"\"")
            .and_then(|v| v.strip_suffix(b"\""))
            .unwrap_or(value);
        // `for=unknown`, an obfuscated `_identifier`: not an address.
        address(value)
    })
}

/// An address as proxies write it: bare (`192.0.2.43`, `2001:db8::1`), with a port
/// (`192.0.2.43:47011`), or bracketed (`[2001:db8::1]` or `[2001:db8::1]:4711`).
fn address(entry: &[u8]) -> Option<IpAddr> {
    let entry = entry.trim_ascii();
    if entry.len() > MAX_ENTRY {
        return None;
    }
    let text = std::str::from_utf8(entry).ok()?;
    if let Some(rest) = text.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        let port_ok = after.is_empty() || after.strip_prefix(':').is_some_and(is_port);
        return port_ok.then(|| v6.parse().ok()).flatten();
    }
    text.parse::<IpAddr>()
        .ok()
        .or_else(|| text.parse::<SocketAddr>().ok().map(|s| s.ip()))
}

fn is_port(text: &str) -> bool {
    text.parse::<u16>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(peer: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::get("/");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let mut r = b.body(()).unwrap();
        r.extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
        r
    }

    fn xff(trusted: &[&str]) -> ClientIp {
        ClientIp::new(ForwardedHeader::XForwardedFor, trusted).unwrap()
    }

    #[test]
    fn the_rightmost_untrusted_hop_is_the_client() {
        let c = xff(&["10.0.0.0/8", "192.0.2.1"]);
        let r = req(
            "10.1.1.1:1",
            &[(
                "x-forwarded-for",
                "1.1.1.1, 203.0.113.5, 192.0.2.1, 10.9.9.9",
            )],
        );
        assert_eq!(c.extract(&r), Some(Key::new("ip", "203.0.113.5")));
    }

    #[test]
    fn only_the_configured_header_is_read() {
        // The proxy writes X-Forwarded-For; the client adds the others.
        let c = xff(&["10.0.0.0/8"]);
        let r = req(
            "10.1.1.1:1",
            &[
                ("forwarded", "for=6.6.6.6"),
                ("x-real-ip", "7.7.7.7"),
                ("x-forwarded-for", "198.51.100.9"),
            ],
        );
        assert_eq!(c.extract(&r), Some(Key::new("ip", "198.51.100.9")));
        // Without it, the peer (the proxy) is the caller, whatever else is there.
        let r = req("10.1.1.1:1", &[("forwarded", "for=6.6.6.6")]);
        assert_eq!(c.extract(&r), Some(Key::new("ip", "10.1.1.1")));
    }

    #[test]
    fn forwarded_understands_ports_quotes_and_ipv6() {
        let c = ClientIp::new(ForwardedHeader::Forwarded, ["10.0.0.0/8"]).unwrap();
        let r = req(
            "10.1.1.1:1",
            &[(
                "forwarded",
                "for=198.51.100.1;proto=https, for=\"[2001:db8:cafe::17]:4711\"",
            )],
        );
        assert_eq!(c.extract(&r), Some(Key::new("ip", "2001:db8:cafe::/64")));
        let r = req(
            "10.1.1.1:1",
            &[("forwarded", "for=192.0.2.60:8080;by=10.0.0.1")],
        );
        assert_eq!(c.extract(&r), Some(Key::new("ip", "192.0.2.60")));
    }

    #[test]
    fn counted_hops_take_the_entry_the_first_proxy_wrote() {
        let c = ClientIp::new(ForwardedHeader::XForwardedFor, ["10.0.0.0/8"])
            .unwrap()
            .trusted_hops(2)
            .unwrap();
        // client forgery, the client, the CDN: the CDN's address is not in 10/8.
        let r = req(
            "10.1.1.1:1",
            &[("x-forwarded-for", "1.1.1.1, 198.51.100.7, 203.0.113.80")],
        );
        assert_eq!(c.extract(&r), Some(Key::new("ip", "198.51.100.7")));
        // Around the CDN: one entry, fewer than the proxies counted.
        let r = req("10.1.1.1:1", &[("x-forwarded-for", "198.51.100.7")]);
        assert_eq!(c.extract(&r), None);
        // No header: the balancer itself. An untrusted peer: itself, whatever it sends.
        assert_eq!(
            c.extract(&req("10.1.1.1:1", &[])),
            Some(Key::new("ip", "10.1.1.1"))
        );
        let r = req("192.0.2.9:1", &[("x-forwarded-for", "1.1.1.1, 2.2.2.2")]);
        assert_eq!(c.extract(&r), Some(Key::new("ip", "192.0.2.9")));
        let f = ClientIp::new(ForwardedHeader::Forwarded, ["10.0.0.0/8"])
            .unwrap()
            .trusted_hops(3)
            .unwrap();
        let r = req(
            "10.1.1.1:1",
            &[(
                "forwarded",
                "for=1.1.1.1, for=198.51.100.8;proto=https, for=_cdn, for=10.2.2.2",
            )],
        );
        assert_eq!(f.extract(&r), Some(Key::new("ip", "198.51.100.8")));
        let xff = || ClientIp::new(ForwardedHeader::XForwardedFor, ["10.0.0.0/8"]).unwrap();
        assert!(xff().trusted_hops(0).is_err());
        assert!(xff().trusted_hops(33).is_err());
        let real = ClientIp::new(ForwardedHeader::XRealIp, ["10.0.0.0/8"]).unwrap();
        assert!(real.clone().trusted_hops(2).is_err());
        assert!(real.trusted_hops(1).is_ok());
    }

    #[test]
    fn an_unknown_or_garbled_client_is_no_key_and_what_is_left_of_it_is_never_read() {
        let c = ClientIp::new(ForwardedHeader::Forwarded, ["10.0.0.0/8"]).unwrap();
        for header in ["for=unknown", "for=_hidden", "proto=https", "for=", "", ","] {
            let r = req("10.1.1.1:1", &[("forwarded", header)]);
            assert_eq!(c.extract(&r), None, "{header:?}");
        }
        // No header at all: the proxy itself.
        let r = req("10.1.1.1:1", &[]);
        assert_eq!(c.extract(&r), Some(Key::new("ip", "10.1.1.1")));
        let c = xff(&["10.0.0.0/8"]);
        let r = req("10.1.1.1:1", &[("x-forwarded-for", "1.2.3.4, not-an-ip")]);
        assert_eq!(c.extract(&r), None);
        // Garbage (not even ASCII) the client wrote left of its real entry changes
        // nothing.
        let mut r = req("10.1.1.1:1", &[]);
        r.headers_mut().insert(
            "x-forwarded-for",
            http::HeaderValue::from_bytes(b"\xff\xfe, 203.0.113.8").unwrap(),
        );
        assert_eq!(c.extract(&r), Some(Key::new("ip", "203.0.113.8")));
        // Every entry a trusted proxy: nobody named the client.
        let r = req("10.1.1.1:1", &[("x-forwarded-for", "10.2.2.2, 10.3.3.3")]);
        assert_eq!(c.extract(&r), None);
    }

    #[test]
    fn x_real_ip_is_one_address() {
        let c = ClientIp::new(ForwardedHeader::XRealIp, ["10.0.0.0/8"]).unwrap();
        let r = req("10.1.1.1:1", &[("x-real-ip", "198.51.100.77")]);
        assert_eq!(c.extract(&r), Some(Key::new("ip", "198.51.100.77")));
        let r = req("10.1.1.1:1", &[("x-real-ip", "1.2.3.4, 5.6.7.8")]);
        assert_eq!(c.extract(&r), None);
    }

    #[test]
    // Regression: with a CDN counted in front of the balancer, a client that reached the
    // balancer directly picked its own key (the entry it wrote stood where the client's
    // should be). Counted through the CDN's networks, it is keyed by its own address.
    fn counted_hops_through_named_networks_key_a_client_that_skipped_them() {
        let counted = xff(&["10.0.0.0/8"]).trusted_hops(2).unwrap();
        let through = counted.clone().hops_through(["203.0.113.0/24"]).unwrap();
        // Straight to the balancer: the forged entry, then the client as the balancer saw it.
        let direct = req(
            "10.0.0.5:1",
            &[("x-forwarded-for", "6.6.6.6, 198.51.100.7")],
        );
        assert_eq!(counted.extract(&direct), Some(Key::new("ip", "6.6.6.6")));
        assert_eq!(
            through.extract(&direct),
            Some(Key::new("ip", "198.51.100.7"))
        );
        // Through the CDN: the client, then the CDN's edge.
        let via = req(
            "10.0.0.5:1",
            &[("x-forwarded-for", "6.6.6.6, 198.51.100.7, 203.0.113.80")],
        );
        assert_eq!(through.extract(&via), Some(Key::new("ip", "198.51.100.7")));
        assert!(
            xff(&["10.0.0.0/8"])
                .hops_through(["203.0.113.0/24"])
                .is_err()
        );
        assert!(counted.hops_through(Vec::<&str>::new()).is_err());
    }

    #[test]
    fn a_long_chain_is_read_to_32_hops_only() {
        let c = xff(&["10.0.0.0/8"]);
        let chain = std::iter::repeat_n("10.0.0.1", 10_000)
            .collect::<Vec<_>>()
            .join(", ");
        let r = req(
            "10.1.1.1:1",
            &[("x-forwarded-for", &format!("203.0.113.1, {chain}"))],
        );
        assert_eq!(c.extract(&r), None);
        let chain = std::iter::repeat_n("10.0.0.1", 31)
            .collect::<Vec<_>>()
            .join(", ");
        let r = req(
            "10.1.1.1:1",
            &[("x-forwarded-for", &format!("203.0.113.1, {chain}"))],
        );
        assert_eq!(c.extract(&r), Some(Key::new("ip", "203.0.113.1")));
    }

    #[test]
    fn networks_parse_normalise_or_say_what_is_wrong() {
        let c = xff(&["::ffff:127.0.0.0/104"]);
        let r = req("127.0.0.1:1", &[("x-forwarded-for", "198.51.100.1")]);
        assert_eq!(c.extract(&r), Some(Key::new("ip", "198.51.100.1")));
        let r = req(
            "[::ffff:127.0.0.1]:1",
            &[("x-forwarded-for", "198.51.100.1")],
        );
        assert_eq!(c.extract(&r), Some(Key::new("ip", "198.51.100.1")));
        assert!(ClientIp::new(ForwardedHeader::XForwardedFor, ["::ffff:0:0/90"]).is_err());
        assert!(ClientIp::new(ForwardedHeader::XForwardedFor, ["10.0.0.0/33"]).is_err());
        assert!(ClientIp::new(ForwardedHeader::XForwardedFor, ["nonsense"]).is_err());
        assert!(ClientIp::new(ForwardedHeader::XForwardedFor, ["192.0.2.1"]).is_ok());
        assert!(PeerIp::new().ipv6_prefix(129).is_err());
    }
}
