//! Keys from addresses: the connection's peer, or the client behind trusted proxies.

use std::net::{IpAddr, SocketAddr};

use http::Request;
use smallvec::SmallVec;
use tollway_core::ConfigError;

use super::{Key, KeyExtractor, canonical};

/// The address of the connection's peer, as the server recorded it in the request's
/// extensions: axum's `ConnectInfo<SocketAddr>` (feature `axum`; serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`), tonic's `TcpConnectInfo`
/// (feature `tonic`), or a plain `SocketAddr`.
#[must_use]
pub fn peer_addr<B>(request: &Request<B>) -> Option<IpAddr> {
    let ext = request.extensions();
    #[cfg(feature = "axum")]
    if let Some(info) = ext.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(info.0.ip());
    }
    #[cfg(feature = "tonic")]
    if let Some(info) = ext.get::<tonic::transport::server::TcpConnectInfo>() {
        if let Some(addr) = info.remote_addr() {
            return Some(addr.ip());
        }
    }
    ext.get::<SocketAddr>().map(SocketAddr::ip)
}

/// The connection's peer address, IPv6 grouped by prefix (default /64): right when
/// clients connect directly, wrong behind a proxy (every caller would be the proxy) — use
/// [`ClientIp`] there.
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

/// A network in CIDR notation, such as `10.0.0.0/8` or `2001:db8::/32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// Parses `addr/prefix`, or a bare address (a single host).
    ///
    /// # Errors
    ///
    /// When the text is not an address, or the prefix is too long for it.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let bad = || {
            ConfigError::new(format!(
                "{text:?} is not a network: write an address or address/prefix, like 10.0.0.0/8 or 2001:db8::/32"
            ))
        };
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr: IpAddr = addr.trim().parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p.trim().parse::<u8>().map_err(|_| bad())?,
            None => max,
        };
        if prefix > max {
            return Err(bad());
        }
        Ok(IpNet { addr, prefix })
    }

    /// Whether `ip` is inside this network (IPv4-mapped IPv6 counts as IPv4).
    #[must_use]
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// The client's address behind reverse proxies.
///
/// `Forwarded`, `X-Forwarded-For` and `X-Real-IP` are read **only** when the connection's
/// peer is one of the configured trusted proxies; otherwise the peer itself is the client,
/// so a caller cannot pick its own key by sending the headers. Behind trusted proxies the
/// client is the right-most address in the chain that is not itself a trusted proxy: each
/// proxy appends the address it saw, so everything to the left of the first untrusted hop
/// may be forged. `Forwarded` is used when present, else `X-Forwarded-For`, else
/// `X-Real-IP`. An entry that does not parse ends the walk at the proxy that passed it on.
/// At most 32 hops are read.
///
/// # Examples
///
/// ```
/// use std::net::SocketAddr;
/// use http::Request;
/// use tollway_tower::{ClientIp, Key, KeyExtractor};
///
/// let client_ip = ClientIp::trusting(["10.0.0.0/8"])?;
///
/// // Through the trusted load balancer at 10.0.0.5: the header is believed.
/// let mut req = Request::get("/").header("x-forwarded-for", "198.51.100.7, 10.0.0.9").body(())?;
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
    trusted: Vec<IpNet>,
    ipv6_prefix: u8,
}

const MAX_HOPS: usize = 32;

impl ClientIp {
    /// Trusts proxies in `networks` (CIDR, such as `10.0.0.0/8`, or single addresses).
    ///
    /// # Errors
    ///
    /// When a network does not parse.
    pub fn trusting<I, S>(networks: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let trusted = networks
            .into_iter()
            .map(|n| IpNet::parse(n.as_ref()))
            .collect::<Result<_, _>>()?;
        Ok(ClientIp {
            trusted,
            ipv6_prefix: 64,
        })
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
        self.trusted.iter().any(|net| net.contains(ip))
    }

    /// The client address for a request whose connection came from `peer`.
    #[must_use]
    pub fn client<B>(&self, peer: IpAddr, request: &Request<B>) -> IpAddr {
        if !self.trusts(peer) {
            return peer;
        }
        let headers = request.headers();
        let mut hops: SmallVec<[Option<IpAddr>; 8]> = SmallVec::new();
        let forwarded = headers.get_all(http::header::FORWARDED);
        if forwarded.iter().next().is_some() {
            for value in forwarded {
                let Ok(value) = value.to_str() else {
                    hops.push(None);
                    continue;
                };
                for element in value.split(',') {
                    hops.push(forwarded_for(element));
                }
            }
        } else {
            let xff = headers.get_all("x-forwarded-for");
            for value in xff {
                let Ok(value) = value.to_str() else {
                    hops.push(None);
                    continue;
                };
                hops.extend(value.split(',').map(|a| parse_addr(a.trim())));
            }
            if hops.is_empty() {
                if let Some(real) = headers.get("x-real-ip") {
                    hops.push(real.to_str().ok().and_then(|a| parse_addr(a.trim())));
                }
            }
        }
        let mut client = peer;
        for hop in hops.iter().rev().take(MAX_HOPS) {
            match hop {
                Some(ip) => {
                    client = *ip;
                    if !self.trusts(*ip) {
                        break;
                    }
                }
                None => break,
            }
        }
        client
    }
}

impl<B> KeyExtractor<B> for ClientIp {
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        let peer = peer_addr(request)?;
        Some(Key::ip(self.client(peer, request), self.ipv6_prefix))
    }
}

/// The `for=` parameter of one `Forwarded` element (RFC 7239), if it is an address.
fn forwarded_for(element: &str) -> Option<IpAddr> {
    element.split(';').find_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("for") {
            return None;
        }
        let value = value.trim().trim_matches('"');
        // [2001:db8::1]:4711, 192.0.2.43:47011, or a bare address.
        let host = if let Some(rest) = value.strip_prefix('[') {
            rest.split(']').next()?
        } else {
            value
                .split(':')
                .next()
                .filter(|_| value.matches(':').count() <= 1)
                .unwrap_or(value)
        };
        host.parse().ok()
    })
}

/// An address as proxies write it in X-Forwarded-For: bare, or with a port.
fn parse_addr(text: &str) -> Option<IpAddr> {
    text.parse::<IpAddr>()
        .ok()
        .or_else(|| text.parse::<SocketAddr>().ok().map(|s| s.ip()))
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

    #[test]
    fn the_rightmost_untrusted_hop_is_the_client() {
        let c = ClientIp::trusting(["10.0.0.0/8", "192.0.2.1"]).unwrap();
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
    fn forwarded_wins_over_x_forwarded_for_and_understands_ports_and_ipv6() {
        let c = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
        let r = req(
            "10.1.1.1:1",
            &[
                (
                    "forwarded",
                    "for=198.51.100.1;proto=https, for=\"[2001:db8:cafe::17]:4711\"",
                ),
                ("x-forwarded-for", "9.9.9.9"),
            ],
        );
        assert_eq!(c.extract(&r), Some(Key::new("ip", "2001:db8:cafe::/64")));
        let r = req(
            "10.1.1.1:1",
            &[("forwarded", "for=192.0.2.60:8080;by=10.0.0.1")],
        );
        assert_eq!(c.extract(&r), Some(Key::new("ip", "192.0.2.60")));
    }

    #[test]
    fn garbage_in_the_chain_stops_at_the_proxy_that_passed_it_on() {
        let c = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
        let r = req("10.1.1.1:1", &[("x-forwarded-for", "1.2.3.4, not-an-ip")]);
        assert_eq!(c.extract(&r), Some(Key::new("ip", "10.1.1.1")));
        let r = req("10.1.1.1:1", &[("x-real-ip", "198.51.100.77")]);
        assert_eq!(c.extract(&r), Some(Key::new("ip", "198.51.100.77")));
    }

    #[test]
    fn networks_parse_or_say_what_is_wrong() {
        assert!(
            IpNet::parse("10.0.0.0/8")
                .unwrap()
                .contains("10.200.0.1".parse().unwrap())
        );
        assert!(IpNet::parse("::ffff:10.0.0.0/104").is_ok());
        assert!(IpNet::parse("10.0.0.0/33").is_err());
        assert!(ClientIp::trusting(["nonsense"]).is_err());
        assert!(PeerIp::new().ipv6_prefix(129).is_err());
    }
}
