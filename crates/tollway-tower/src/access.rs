//! Allow and deny lists: callers exempt from limiting, and callers refused outright.

use std::collections::HashSet;
use std::net::IpAddr;

use http::Request;
use ipnet::IpNet;
use tollway_core::ConfigError;

use crate::key::{ClientIp, Key, KeyExtractor, canonical, parse_network, peer_addr};

/// Which list a request's caller is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listed {
    /// Exempt: let through without a limit.
    Allowed,
    /// Refused: 403 Forbidden, `PERMISSION_DENIED` over gRPC.
    Denied,
}

/// A layer's allow and deny lists.
///
/// Networks are matched against the client's address. Keys are matched against every
/// key the caller is known by: its [`identities`](KeyExtractor::identities). With
/// `api_key.or(client_ip)`, those are its API key and its address. A caller on both
/// lists, under any of its keys, is denied.
#[derive(Debug, Default)]
pub(crate) struct AccessLists {
    allow: List,
    deny: List,
    /// Where the client's address comes from: the peer (`None`), or behind proxies.
    address: Option<ClientIp>,
}

#[derive(Debug, Default)]
struct List {
    networks: Vec<IpNet>,
    keys: HashSet<Key>,
}

impl List {
    fn is_empty(&self) -> bool {
        self.networks.is_empty() && self.keys.is_empty()
    }

    fn holds_address(&self, address: Option<IpAddr>) -> bool {
        address.is_some_and(|ip| self.networks.iter().any(|net| net.contains(&ip)))
    }
}

impl AccessLists {
    pub(crate) fn allow_network(&mut self, network: &str) -> Result<(), ConfigError> {
        self.allow.networks.push(parse_network(network)?);
        Ok(())
    }

    pub(crate) fn deny_network(&mut self, network: &str) -> Result<(), ConfigError> {
        self.deny.networks.push(parse_network(network)?);
        Ok(())
    }

    pub(crate) fn allow_key(&mut self, key: Key) {
        self.allow.keys.insert(key);
    }

    pub(crate) fn deny_key(&mut self, key: Key) {
        self.deny.keys.insert(key);
    }

    pub(crate) fn address_from(&mut self, client_ip: ClientIp) {
        self.address = Some(client_ip);
    }

    /// The list the caller of `request` is on, if any: `key` is the key it is limited
    /// by, and `extractor` names every key it is known by.
    #[inline]
    pub(crate) fn find<B, K>(
        &self,
        extractor: &K,
        key: Option<&Key>,
        request: &Request<B>,
    ) -> Option<Listed>
    where
        K: KeyExtractor<B> + ?Sized,
    {
        if self.allow.is_empty() && self.deny.is_empty() {
            return None;
        }
        let (mut denied, mut allowed) = (false, false);
        if !(self.allow.keys.is_empty() && self.deny.keys.is_empty()) {
            let mut check = |key: &Key| {
                denied |= self.deny.keys.contains(key);
                allowed |= self.allow.keys.contains(key);
            };
            // The key it is limited by is one of the chain's, but a key extractor of the
            // user's own may not list it.
            key.into_iter().for_each(&mut check);
            extractor.identities(request, &mut |key| check(&key));
        }
        let address = self.client_address(request);
        if denied || self.deny.holds_address(address) {
            Some(Listed::Denied)
        } else if allowed || self.allow.holds_address(address) {
            Some(Listed::Allowed)
        } else {
            None
        }
    }

    /// The client's address, when a network list needs it.
    fn client_address<B>(&self, request: &Request<B>) -> Option<IpAddr> {
        if self.allow.networks.is_empty() && self.deny.networks.is_empty() {
            return None;
        }
        let peer = peer_addr(request)?;
        let client = match &self.address {
            None => peer,
            Some(client_ip) => client_ip.client(peer, request)?,
        };
        Some(canonical(client))
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    fn from(peer: &str) -> Request<()> {
        let mut request = Request::new(());
        let peer: SocketAddr = format!("{peer}:4000").parse().unwrap();
        request.extensions_mut().insert(peer);
        request
    }

    #[test]
    fn deny_wins_over_allow_and_networks_match_the_client() {
        let mut lists = AccessLists::default();
        lists.allow_network("10.0.0.0/8").unwrap();
        lists.deny_network("10.6.6.6").unwrap();
        lists.allow_key(Key::new("key", "partner"));
        let none = |_: &Request<()>| -> Option<Key> { None };
        let ours = from("10.1.2.3");
        assert_eq!(lists.find(&none, None, &ours), Some(Listed::Allowed));
        assert_eq!(
            lists.find(&none, None, &from("10.6.6.6")),
            Some(Listed::Denied)
        );
        assert_eq!(lists.find(&none, None, &from("203.0.113.9")), None);
        let partner = Key::new("key", "partner");
        assert_eq!(
            lists.find(&none, Some(&partner), &from("203.0.113.9")),
            Some(Listed::Allowed)
        );
        // IPv4-mapped peers are their IPv4 address.
        assert_eq!(
            lists.find(&none, None, &from("[::ffff:10.1.2.3]")),
            Some(Listed::Allowed)
        );
    }

    #[test]
    fn a_listed_key_matches_whichever_link_of_the_chain_names_it() {
        use crate::key::{ApiKey, Fallback, PeerIp};

        let mut lists = AccessLists::default();
        lists.deny_key(Key::new("ip", "203.0.113.9"));
        let chain = ApiKey::header("x-api-key").unwrap().or(PeerIp::new());
        let mut request = from("203.0.113.9");
        request
            .headers_mut()
            .insert("x-api-key", http::HeaderValue::from_static("k-pro"));
        // Limited by its API key, denied by its address.
        let key = chain.extract(&request);
        assert_eq!(key, Some(Key::new("key", "k-pro")));
        assert_eq!(
            lists.find(&chain, key.as_ref(), &request),
            Some(Listed::Denied)
        );
        let other = from("203.0.113.10");
        assert_eq!(
            lists.find(&chain, chain.extract(&other).as_ref(), &other),
            None
        );
    }

    #[test]
    fn a_network_that_does_not_parse_says_how_to_write_one() {
        let err = AccessLists::default()
            .deny_network("10.0.0.0/33")
            .unwrap_err();
        assert!(err.to_string().contains("10.0.0.0/8"), "{err}");
    }
}
