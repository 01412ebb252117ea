//! How a file finds a caller's key: an API key, else the client's address.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;
use http::Request;
use tollway_core::ConfigError;
use toml::Spanned;

use super::LimitsFile;
use crate::key::{
    ApiKey, ClientIp, Fallback, ForwardedHeader, Key, KeyExtractor, KnownKeys, Or, PeerIp,
    parse_network,
};

impl LimitsFile {
    /// How the file says to find a caller's key.
    ///
    /// # Errors
    ///
    /// Never for a file that [`parse`](Self::parse) accepted.
    pub fn key(&self) -> Result<ConfigKey, ConfigError> {
        let section = self.file.key.as_ref().map(Spanned::get_ref);
        let prefix = section.and_then(|k| k.ipv6_prefix.as_ref());
        let ipv6 = prefix.map_or(64, |p| *p.get_ref());
        let prefix_span = prefix.map(Spanned::span);
        let address = match section.and_then(|k| k.client_ip.as_ref()) {
            None => Address::Peer(
                PeerIp::new()
                    .ipv6_prefix(ipv6)
                    .map_err(|e| self.err(prefix_span, e))?,
            ),
            Some(client) => {
                let c = client.get_ref();
                let header = match c.header.get_ref().to_ascii_lowercase().as_str() {
                    "forwarded" => ForwardedHeader::Forwarded,
                    "x-forwarded-for" => ForwardedHeader::XForwardedFor,
                    "x-real-ip" => ForwardedHeader::XRealIp,
                    other => {
                        return Err(self.at(
                            Some(c.header.span()),
                            &format!(
                                "client_ip reads {other:?}: write header = \"forwarded\", \
                                 \"x-forwarded-for\" or \"x-real-ip\" (the one your proxies write)"
                            ),
                        ));
                    }
                };
                for network in &c.trusted_proxies {
                    parse_network(network.get_ref())
                        .map_err(|e| self.err(Some(network.span()), e))?;
                }
                let proxies = c.trusted_proxies.iter().map(|n| n.get_ref().as_str());
                let mut client_ip =
                    ClientIp::new(header, proxies).map_err(|e| self.err(Some(client.span()), e))?;
                if let Some(hops) = &c.trusted_hops {
                    client_ip = client_ip
                        .trusted_hops(*hops.get_ref())
                        .map_err(|e| self.err(Some(hops.span()), e))?;
                }
                if let Some(through) = &c.hops_through {
                    for network in through.get_ref() {
                        parse_network(network.get_ref())
                            .map_err(|e| self.err(Some(network.span()), e))?;
                    }
                    let networks = through.get_ref().iter().map(|n| n.get_ref().as_str());
                    client_ip = client_ip
                        .hops_through(networks)
                        .map_err(|e| self.err(Some(through.span()), e))?;
                }
                Address::Client(
                    client_ip
                        .ipv6_prefix(ipv6)
                        .map_err(|e| self.err(prefix_span, e))?,
                )
            }
        };
        let known = Arc::new(ArcSwap::from_pointee(self.known_keys()));
        let chain = match section.and_then(|k| k.api_key.as_ref()) {
            None => Chain::Address(address.clone()),
            Some(api) => {
                let header = ApiKey::header(api.header.get_ref())
                    .map_err(|e| self.err(Some(api.header.span()), e))?;
                let keys = FileKeys {
                    only_known: api.only_known,
                    known: Arc::clone(&known),
                };
                Chain::ApiKey(header.known(keys).or(address.clone()))
            }
        };
        Ok(ConfigKey {
            chain,
            address,
            known,
        })
    }
}

/// How a config file finds a caller's key.
///
/// It is an API key: by default only the keys in `[tiers]`, read afresh on every reload.
/// Else it is the client's address: the peer's, or the one behind trusted proxies. That
/// is `ApiKey::header(..).known(..).or(address)`, built from the file.
#[derive(Clone)]
pub struct ConfigKey {
    chain: Chain,
    /// The address part, for the lists' networks.
    pub(super) address: Address,
    /// The API keys the file names — in `[tiers]` and on the lists — swapped on reload.
    pub(super) known: Arc<ArcSwap<HashSet<String>>>,
}

/// The extractors a file chains: an API key, then the address; or the address alone.
#[derive(Clone)]
enum Chain {
    ApiKey(Or<ApiKey<FileKeys>, Address>),
    Address(Address),
}

/// The API keys a file accepts: those it names, or with `only_known = false` any.
#[derive(Clone)]
struct FileKeys {
    only_known: bool,
    known: Arc<ArcSwap<HashSet<String>>>,
}

impl KnownKeys for FileKeys {
    fn is_known(&self, value: &[u8]) -> bool {
        !self.only_known || self.known.load().is_known(value)
    }
}

/// The caller's address: the peer's, or the client's behind trusted proxies.
#[derive(Clone)]
pub(super) enum Address {
    Peer(PeerIp),
    Client(ClientIp),
}

impl<B> KeyExtractor<B> for Address {
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        match self {
            Address::Peer(peer) => KeyExtractor::<B>::extract(peer, request),
            Address::Client(client) => KeyExtractor::<B>::extract(client, request),
        }
    }
}

impl fmt::Debug for ConfigKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let api_key = match &self.chain {
            Chain::ApiKey(_) => "an API key, then the address",
            Chain::Address(_) => "the address",
        };
        f.debug_struct("ConfigKey")
            .field("keys_by", &api_key)
            .finish_non_exhaustive()
    }
}

impl<B> KeyExtractor<B> for ConfigKey {
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        match &self.chain {
            Chain::ApiKey(chain) => chain.extract(request),
            Chain::Address(address) => address.extract(request),
        }
    }

    /// The API key and the address, both: the lists match either.
    fn identities(&self, request: &Request<B>, found: &mut dyn FnMut(Key)) {
        match &self.chain {
            Chain::ApiKey(chain) => chain.identities(request, found),
            Chain::Address(address) => address.identities(request, found),
        }
    }
}
