//! Limits as configuration (feature `config`): a TOML file, validated as a whole before
//! anything uses it, and reloaded while the service runs.
//!
//! A [`LimitsFile`] is a file read and checked: every policy, tier, route, list entry
//! and setting, with an error that names the file, the line and the column, what is
//! wrong and what to write instead. [`LimitsFile::layer`] builds the same layer the
//! builder does; [`Reloader`] reads the file again on demand ([`Reloader::reload`], for a
//! SIGHUP or an admin endpoint) or whenever it changes ([`Reloader::watch`]) and swaps the
//! new limits in: requests already being decided finish under the old ones, a file that
//! fails to validate leaves the running limits in place and is reported, an unchanged
//! policy keeps its callers' state and a changed one starts them afresh.
//!
//! What a reload can change: policies, tiers, routes, lists, shadow flags, headers, the
//! protocol and what to do on a store failure or a missing key. The store and how keys
//! are found (`[store]`, `[key]`) take effect at the next start: a reload that changes
//! them is refused.
//!
//! # The file
//!
//! ```toml
//! [store]                       # optional: memory is the default
//! kind = "memory"               # or "redis", with url = "redis://..." or nodes = [...]
//! max_keys = 1_000_000
//!
//! [layer]
//! default = "anonymous"         # the policy of callers without a tier
//! headers = "both"              # legacy | ietf | both | none
//! on_store_error = "allow"      # allow | reject
//!
//! [key]                         # optional: the peer address is the default
//! api_key = { header = "x-api-key", only_known = true }
//! # client_ip = { header = "x-forwarded-for", trusted_proxies = ["10.0.0.0/8"] }
//! # behind a CDN, counted: trusted_hops = 2, hops_through = ["<the CDN's ranges>"]
//!
//! [policies.anonymous]
//! algorithm = "token_bucket"    # token_bucket, leaky_bucket, leaky_bucket_shaper,
//! limit = 20                    # fixed_window, sliding_window_log,
//! period = "1m"                 # sliding_window_counter, gcra
//!
//! [policies.pro]
//! algorithm = "gcra"
//! limit = 10_000
//! period = "1m"
//!
//! [tiers]                       # API key = its tier's policy
//! "demo-pro-key" = "pro"
//!
//! [policies.checkout]          # a route's policy is its own
//! algorithm = "sliding_window_log"
//! limit = 5
//! period = "1m"
//!
//! [[routes]]
//! path = "/api/v1/checkout"     # or grpc_method = "/package.Service/Method"
//! method = "POST"               # optional: any method
//! policy = "checkout"
//!
//! [lists]                       # optional
//! allow_networks = ["10.0.0.0/8"]
//! deny_keys = ["key:stolen-key"]
//! ```
//!
//! # Examples
//!
//! ```
//! use tollway_tower::config::LimitsFile;
//!
//! let file = LimitsFile::parse("limits.toml", r#"
//! [layer]
//! default = "api"
//!
//! [policies.api]
//! algorithm = "gcra"
//! limit = 0
//! period = "1s"
//! "#);
//! let err = file.unwrap_err().to_string();
//! assert!(err.starts_with("limits.toml:7:9: "), "{err}");
//! assert!(err.contains("limit"), "{err}");
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{Method, Request};
use serde::Deserialize;
use tollway_core::{
    Algorithm, BoxStore, ConfigError, MemoryStore, Policy, Quota, RedisStore, Store,
};
use toml::Spanned;

use crate::headers::HeaderStyle;
use crate::key::{
    ApiKey, ClientIp, ForwardedHeader, Key, KeyExtractor, KnownKeys, PeerIp, parse_network,
};
use crate::limits::RouteLimit;
use crate::pipeline::{MissingKey, OnStoreError, Protocol};
use crate::rate_limit::{RateLimitLayer, RateLimitLayerBuilder};

mod reload;
mod watch;

pub use reload::{LiveConfig, Reloaded, Reloader};
pub use watch::Watcher;

/// The whole file, as written.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct File {
    store: Option<Spanned<StoreSection>>,
    layer: LayerSection,
    key: Option<Spanned<KeySection>>,
    policies: BTreeMap<String, Spanned<PolicySection>>,
    #[serde(default)]
    tiers: BTreeMap<Spanned<String>, Spanned<String>>,
    #[serde(default)]
    routes: Vec<Spanned<RouteSection>>,
    #[serde(default)]
    lists: ListsSection,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct StoreSection {
    kind: Option<Spanned<String>>,
    max_keys: Option<Spanned<usize>>,
    url: Option<String>,
    nodes: Option<Vec<String>>,
    prefix: Option<String>,
    timeout_ms: Option<u64>,
    breaker: Option<Spanned<Switch<BreakerSection>>>,
    local_fallback: Option<Spanned<Switch<f64>>>,
}

/// A setting that is `false` (off), `true` (on, the defaults) or its settings.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(untagged)]
enum Switch<T> {
    Toggle(bool),
    Set(T),
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct BreakerSection {
    threshold: Option<u32>,
    cool_down_ms: Option<u64>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct LayerSection {
    default: Spanned<String>,
    headers: Option<Spanned<String>>,
    protocol: Option<Spanned<String>>,
    on_store_error: Option<Spanned<String>>,
    missing_key: Option<Spanned<String>>,
    #[serde(default)]
    shadow: bool,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct KeySection {
    api_key: Option<ApiKeySection>,
    client_ip: Option<Spanned<ClientIpSection>>,
    ipv6_prefix: Option<Spanned<u8>>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct ApiKeySection {
    header: Spanned<String>,
    /// Only the keys in `[tiers]`: any other value is no key.
    #[serde(default = "yes")]
    only_known: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct ClientIpSection {
    header: Spanned<String>,
    trusted_proxies: Vec<Spanned<String>>,
    trusted_hops: Option<Spanned<usize>>,
    /// Where the counted proxies are (`ClientIp::hops_through`).
    hops_through: Option<Spanned<Vec<Spanned<String>>>>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct PolicySection {
    algorithm: Spanned<String>,
    limit: Spanned<i64>,
    period: Spanned<String>,
    burst: Option<Spanned<i64>>,
    #[serde(default)]
    shadow: bool,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct RouteSection {
    path: Option<Spanned<String>>,
    grpc_method: Option<Spanned<String>>,
    method: Option<Spanned<String>>,
    policy: Spanned<String>,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct ListsSection {
    #[serde(default)]
    allow_networks: Vec<Spanned<String>>,
    #[serde(default)]
    deny_networks: Vec<Spanned<String>>,
    #[serde(default)]
    allow_keys: Vec<Spanned<String>>,
    #[serde(default)]
    deny_keys: Vec<Spanned<String>>,
}

/// The store a file describes, ready to build.
enum StoreBuilder<'f> {
    Memory(tollway_core::MemoryStoreBuilder),
    Redis(tollway_core::RedisStoreBuilder, &'f StoreSection),
}

/// The most parts a key of the file has (`policies.api.limit`, `store.breaker.threshold`).
const DEPTH: usize = 3;

const REDIS_WHERE: &str = "a Redis store has url = \"redis://host:6379\" or nodes = [...] for a cluster, not both or neither";

/// A limits file, read and validated: every policy, tier, route, list entry and setting
/// in it is usable. See the [module docs](self) for what it may say.
pub struct LimitsFile {
    name: String,
    text: String,
    file: File,
    /// The policies, validated, by name.
    policies: BTreeMap<String, Policy>,
}

impl fmt::Debug for LimitsFile {
    /// The name and the policies: the file's text holds API keys.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitsFile")
            .field("name", &self.name)
            .field("policies", &self.policies.keys())
            .finish_non_exhaustive()
    }
}

impl LimitsFile {
    /// Reads and validates the file at `path`: a regular file of at most 1 MiB (a FIFO
    /// in its place is refused, not waited on).
    ///
    /// # Errors
    ///
    /// When it cannot be read, is not a regular file, is over 1 MiB, or says something
    /// tollway cannot do: the message starts
    /// with `path:line:column:` and says what to write instead.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let bytes = reload::read_bytes(path, reload::MAX_FILE_SIZE)?;
        Self::from_bytes(&path.display().to_string(), &bytes)
    }

    /// Validates `bytes`, a limits file called `name` in its messages, which must be
    /// UTF-8 text.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read); a byte that is not UTF-8 is named by its line and column.
    pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<Self, ConfigError> {
        match std::str::from_utf8(bytes) {
            Ok(text) => Self::parse(name, text),
            Err(e) => {
                let good = &bytes[..e.valid_up_to()];
                let good = std::str::from_utf8(good).unwrap_or_default();
                Err(locate(
                    name,
                    good,
                    Some(good.len()..good.len()),
                    &format!(
                        "byte 0x{:02x} is not UTF-8: save the file as UTF-8 text",
                        bytes[e.valid_up_to()]
                    ),
                ))
            }
        }
    }

    /// Validates `text`, a limits file called `name` in its messages.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read).
    pub fn parse(name: &str, text: &str) -> Result<Self, ConfigError> {
        let at = |span: Option<Range<usize>>, message: &str| locate(name, text, span, message);
        let file: File = toml::from_str(text).map_err(|e| {
            // serde's words for a `Switch` that is neither: say what to write instead.
            let message = if e.message().contains("untagged enum Switch") {
                "write breaker = false, true or { threshold = 5, cool_down_ms = 250 }, and \
                 local_fallback = false, true or a share of each quota like 0.1"
                    .to_owned()
            } else if e.message() == "recursion limit" {
                format!(
                    "this key has more parts than toml reads; tollway's keys have at most \
                     {DEPTH}, like policies.api.limit: write the key as the module docs show"
                )
            } else {
                redact_strings(e.message())
            };
            at(e.span().or_else(|| line_of(text, e.message())), &message)
        })?;
        let mut policies = BTreeMap::new();
        for (policy_name, section) in &file.policies {
            let policy = policy(policy_name, section.get_ref())
                .map_err(|(span, message)| at(Some(span.unwrap_or(section.span())), &message))?;
            policies.insert(policy_name.clone(), policy);
        }
        let limits = LimitsFile {
            name: name.to_owned(),
            text: text.to_owned(),
            file,
            policies,
        };
        // Everything else is checked by building a layer with it, over a throwaway store.
        limits
            .builder(MemoryStore::new(), limits.key()?)
            .and_then(RateLimitLayerBuilder::build)?;
        Ok(limits)
    }

    /// The file's name, as its messages give it.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the file has a `[store]` section (without one, [`store`](Self::store) is
    /// a memory store).
    #[must_use]
    pub fn has_store(&self) -> bool {
        self.file.store.is_some()
    }

    /// The store the file describes: a memory store with its bound, or a Redis store
    /// (standalone at `url`, or a cluster of `nodes`) with its settings, connected.
    ///
    /// # Errors
    ///
    /// When Redis cannot be reached or refuses the settings.
    pub async fn store(&self) -> Result<BoxStore, ConfigError> {
        let span = self.file.store.as_ref().map(Spanned::span);
        let (builder, section) = match self.store_builder()? {
            StoreBuilder::Memory(memory) => {
                let store = memory.build().map_err(|e| self.err(span, e))?;
                return Ok(BoxStore::new(store));
            }
            StoreBuilder::Redis(builder, section) => (builder, section),
        };
        let connected = match (&section.url, &section.nodes) {
            (Some(url), None) => builder.connect(url).await,
            (None, Some(nodes)) => {
                let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
                builder.connect_cluster(&nodes).await
            }
            _ => return Err(self.at(span, REDIS_WHERE)),
        };
        connected
            .map(BoxStore::new)
            .map_err(|e| self.at(span, &e.to_string()))
    }

    /// The builder of the store the file describes, its settings checked.
    fn store_builder(&self) -> Result<StoreBuilder<'_>, ConfigError> {
        let Some(spanned) = &self.file.store else {
            return Ok(StoreBuilder::Memory(MemoryStore::builder()));
        };
        let (section, span) = (spanned.get_ref(), Some(spanned.span()));
        let kind = section
            .kind
            .as_ref()
            .map_or("memory", |k| k.get_ref().as_str());
        if kind == "memory" {
            let mut builder = MemoryStore::builder();
            if let Some(max) = &section.max_keys {
                builder = builder.max_keys(*max.get_ref());
                // The bound's own check, now rather than at start.
                builder
                    .clone()
                    .build()
                    .map_err(|e| self.err(Some(max.span()), e))?;
            }
            return Ok(StoreBuilder::Memory(builder));
        }
        let mut builder = RedisStore::builder();
        if let Some(prefix) = &section.prefix {
            builder = builder.prefix(prefix.clone());
        }
        if let Some(ms) = section.timeout_ms {
            builder = builder.timeout(Duration::from_millis(ms));
        }
        match section.breaker.as_ref().map(Spanned::get_ref) {
            Some(Switch::Toggle(false)) => builder = builder.without_breaker(),
            Some(Switch::Set(b)) => {
                builder = builder.breaker(
                    b.threshold.unwrap_or(5),
                    Duration::from_millis(b.cool_down_ms.unwrap_or(250)),
                );
            }
            Some(Switch::Toggle(true)) | None => {}
        }
        match section.local_fallback.as_ref().map(Spanned::get_ref) {
            Some(Switch::Toggle(false)) => builder = builder.without_local_fallback(),
            Some(Switch::Set(share)) => builder = builder.local_fallback(*share),
            Some(Switch::Toggle(true)) | None => {}
        }
        builder.validate().map_err(|e| self.err(span, e))?;
        Ok(StoreBuilder::Redis(builder, section))
    }

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
        let api_key = match section.and_then(|k| k.api_key.as_ref()) {
            None => None,
            Some(api) => Some(Known {
                header: ApiKey::header(api.header.get_ref())
                    .map_err(|e| self.err(Some(api.header.span()), e))?,
                only_known: api.only_known,
            }),
        };
        Ok(ConfigKey {
            api_key,
            address,
            known: Arc::new(ArcSwap::from_pointee(self.known_keys())),
        })
    }

    /// A layer with the file's limits over `store`, keyed by `key` (from
    /// [`key`](Self::key)).
    ///
    /// # Errors
    ///
    /// Never for a file that [`parse`](Self::parse) accepted.
    pub fn layer<St: Store>(
        &self,
        store: St,
        key: ConfigKey,
    ) -> Result<RateLimitLayer<St, ConfigKey>, ConfigError> {
        self.builder(store, key)?.build()
    }

    /// The builder the file describes over `store`: the layer before `build`, to add what
    /// a file cannot say (closures: a cost, a listener, a rejection body).
    ///
    /// # Errors
    ///
    /// When a setting is not one tollway knows, with its line and column.
    pub fn builder<St: Store>(
        &self,
        store: St,
        key: ConfigKey,
    ) -> Result<RateLimitLayerBuilder<St, ConfigKey>, ConfigError> {
        let file = &self.file;
        let layer = &file.layer;
        let default = self.policy_named(&layer.default)?;
        // The lists' networks match the client's address as the keys find it.
        let client_ip = match &key.address {
            Address::Client(client_ip) => Some(client_ip.clone()),
            Address::Peer(_) => None,
        };
        let mut builder = RateLimitLayer::builder(store, default.clone())
            .named_by_file(&self.name)
            .key(key)
            .shadow(layer.shadow);
        if let Some(client_ip) = client_ip {
            builder = builder.list_address(client_ip);
        }
        if !file.tiers.is_empty() {
            builder = builder.tiers(self.tier_map());
        }
        // Each policy serves one place: the default, a tier (however many keys name it),
        // or one route — two places sharing one policy would share its counts.
        let mut used: Vec<&str> = vec![default.name()];
        for (key, name) in &file.tiers {
            api_key_value(key.get_ref()).map_err(|m| self.at(Some(key.span()), m))?;
            let policy = self.policy_named(name)?;
            if !used.contains(&policy.name()) {
                used.push(policy.name());
                builder = builder.tier(policy.clone());
            }
        }
        for route in &file.routes {
            let r = route.get_ref();
            let policy = self.policy_named(&r.policy)?;
            if used.contains(&policy.name()) {
                return Err(self.at(
                    Some(r.policy.span()),
                    &format!(
                        "policy {:?} already limits callers elsewhere (the default, a tier or \
                         another route): give this route a policy of its own, so that their \
                         counts stay apart",
                        policy.name()
                    ),
                ));
            }
            used.push(policy.name());
            builder = match (&r.path, &r.grpc_method) {
                (Some(path), None) => {
                    let method = match &r.method {
                        None => None,
                        Some(m) => Some(self.method(m)?),
                    };
                    RouteLimit::new(method.clone(), path.get_ref(), 0)
                        .map_err(|e| self.err(Some(path.span()), e))?;
                    builder.route(method, path.get_ref(), policy.clone())
                }
                (None, Some(grpc)) => {
                    RouteLimit::grpc(grpc.get_ref(), 0)
                        .map_err(|e| self.err(Some(grpc.span()), e))?;
                    builder.grpc_method(grpc.get_ref(), policy.clone())
                }
                _ => {
                    return Err(self.at(
                        Some(route.span()),
                        "a route has a path = \"/api/v1/checkout\" or a grpc_method = \
                         \"/package.Service/Method\", not both or neither",
                    ));
                }
            };
        }
        for (name, section) in &file.policies {
            if !used.contains(&name.as_str()) {
                return Err(self.at(
                    Some(section.span()),
                    &format!(
                        "policy {name:?} limits nothing: no route, tier or [layer] default \
                         names it. Name it (a [[routes]] entry or a tier with policy = \
                         {name:?}), or remove [policies.{name}]"
                    ),
                ));
            }
        }
        if let Some(style) = &layer.headers {
            builder = builder.headers(match style.get_ref().as_str() {
                "legacy" => HeaderStyle::Legacy,
                "ietf" => HeaderStyle::Ietf,
                "both" => HeaderStyle::Both,
                "none" => HeaderStyle::None,
                _ => {
                    return Err(self.choice(style, "headers", &["legacy", "ietf", "both", "none"]));
                }
            });
        }
        if let Some(protocol) = &layer.protocol {
            builder = builder.protocol(match protocol.get_ref().as_str() {
                "detect" => Protocol::Detect,
                "http" => Protocol::Http,
                "grpc" => Protocol::Grpc,
                _ => return Err(self.choice(protocol, "protocol", &["detect", "http", "grpc"])),
            });
        }
        if let Some(on_error) = &layer.on_store_error {
            builder = builder.on_store_error(match on_error.get_ref().as_str() {
                "allow" => OnStoreError::Allow,
                "reject" => OnStoreError::Reject,
                _ => return Err(self.choice(on_error, "on_store_error", &["allow", "reject"])),
            });
        }
        if let Some(missing) = &layer.missing_key {
            builder = builder.on_missing_key(match missing.get_ref().as_str() {
                "shared" => MissingKey::Shared,
                "allow" => MissingKey::Allow,
                "reject" => MissingKey::Reject(http::StatusCode::UNAUTHORIZED),
                _ => {
                    return Err(self.choice(
                        missing,
                        "missing_key",
                        &["shared", "allow", "reject"],
                    ));
                }
            });
        }
        for (name, section) in &file.policies {
            if section.get_ref().shadow {
                builder = builder.shadow_policy(name.clone());
            }
        }
        let lists = &file.lists;
        for network in &lists.allow_networks {
            parse_network(network.get_ref()).map_err(|e| self.err(Some(network.span()), e))?;
            builder = builder.allow_network(network.get_ref());
        }
        for network in &lists.deny_networks {
            parse_network(network.get_ref()).map_err(|e| self.err(Some(network.span()), e))?;
            builder = builder.deny_network(network.get_ref());
        }
        for key in &lists.allow_keys {
            builder = builder.allow_key(self.listed_key(key)?);
        }
        for key in &lists.deny_keys {
            builder = builder.deny_key(self.listed_key(key)?);
        }
        self.check_store()?;
        Ok(builder)
    }

    /// The limits the file describes, a line each: what `tollway check` prints.
    #[must_use]
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let file = &self.file;
        // Writing to a String cannot fail.
        let _ = writeln!(out, "{}: valid", self.name);
        for (name, policy) in &self.policies {
            let q = policy.quota();
            let _ = writeln!(
                out,
                "  policy {name}: {} of {} per {:?}, burst {}{}{}",
                policy.algorithm().name(),
                q.limit(),
                q.period(),
                q.burst(),
                if *name == *file.layer.default.get_ref() {
                    " (default)"
                } else {
                    ""
                },
                if file.policies[name].get_ref().shadow {
                    " (shadow)"
                } else {
                    ""
                },
            );
        }
        for (key, tier) in &file.tiers {
            let key = redact(key.get_ref());
            let _ = writeln!(out, "  tier: key {key} -> {}", tier.get_ref());
        }
        for route in &file.routes {
            let r = route.get_ref();
            let method = r.method.as_ref().map_or("*", |m| m.get_ref().as_str());
            let target = r
                .path
                .as_ref()
                .or(r.grpc_method.as_ref())
                .map_or("", |p| p.get_ref().as_str());
            let _ = writeln!(out, "  route: {method} {target} -> {}", r.policy.get_ref());
        }
        let lists = &file.lists;
        for (what, entries) in [
            ("allow network", &lists.allow_networks),
            ("deny network", &lists.deny_networks),
            ("allow key", &lists.allow_keys),
            ("deny key", &lists.deny_keys),
        ] {
            for entry in entries {
                let entry = entry.get_ref();
                let shown = match entry.strip_prefix("key:") {
                    Some(key) => format!("key:{}", redact(key)),
                    None => entry.clone(),
                };
                let _ = writeln!(out, "  {what}: {shown}");
            }
        }
        out
    }

    /// The API keys the file names: in `[tiers]`, and as `key:` entries of the lists (a
    /// key on the deny list must be seen to be denied).
    fn known_keys(&self) -> HashSet<String> {
        let lists = &self.file.lists;
        let listed = lists.allow_keys.iter().chain(&lists.deny_keys);
        let listed = listed.filter_map(|k| k.get_ref().strip_prefix("key:").map(str::to_owned));
        let tiers = self.file.tiers.keys().map(|k| k.get_ref().clone());
        tiers.chain(listed).collect()
    }

    fn tier_map(&self) -> HashMap<String, String> {
        self.file
            .tiers
            .iter()
            .map(|(key, tier)| (key.get_ref().clone(), tier.get_ref().clone()))
            .collect()
    }

    fn policy_named(&self, name: &Spanned<String>) -> Result<&Policy, ConfigError> {
        self.policies.get(name.get_ref()).ok_or_else(|| {
            let known: Vec<&str> = self.policies.keys().map(String::as_str).collect();
            self.at(
                Some(name.span()),
                &format!(
                    "no policy is named {:?}: name one of {known:?}, or add [policies.{}]",
                    name.get_ref(),
                    name.get_ref()
                ),
            )
        })
    }

    /// A `key:` or `ip:` entry of the lists, spelled as the key it must match.
    fn listed_key(&self, key: &Spanned<String>) -> Result<Key, ConfigError> {
        let at = |message: &str| self.at(Some(key.span()), message);
        let (namespace, value) = key.get_ref().split_once(':').unwrap_or(("", ""));
        match namespace {
            "key" => {
                api_key_value(value).map_err(at)?;
                Ok(Key::new("key", value))
            }
            "ip" => {
                let prefix = self.file.key.as_ref();
                let prefix = prefix.and_then(|k| k.get_ref().ipv6_prefix.as_ref());
                let prefix = prefix.map_or(64, |p| *p.get_ref());
                let address = value.parse::<std::net::IpAddr>().ok().or_else(|| {
                    let net = value.parse::<ipnet::IpNet>().ok();
                    net.filter(|n| n.prefix_len() == prefix).map(|n| n.addr())
                });
                let Some(address) = address else {
                    return Err(at(&format!(
                        "ip:{value:?} is not an address: write \"ip:203.0.113.9\", or put a \
                         network in allow_networks / deny_networks"
                    )));
                };
                let listed = Key::ip(address, prefix);
                if listed.as_bytes() != key.get_ref().as_bytes() {
                    return Err(at(&format!(
                        "a caller from that address has the key {:?} (IPv6 grouped by /{prefix}): \
                         write that, or put the address in allow_networks / deny_networks",
                        String::from_utf8_lossy(listed.as_bytes())
                    )));
                }
                Ok(listed)
            }
            _ => Err(at(
                "a listed key is \"key:\" and an API key, or \"ip:\" and an address, in lower \
                 case and without spaces, like \"ip:203.0.113.9\": the keys this file's [key] \
                 finds",
            )),
        }
    }

    /// The method `m` names: upper case, as HTTP methods are compared (RFC 9110, 9.1).
    fn method(&self, m: &Spanned<String>) -> Result<Method, ConfigError> {
        let upper = m.get_ref().to_ascii_uppercase();
        match Method::from_bytes(m.get_ref().as_bytes()) {
            Ok(method) if upper == *m.get_ref() => Ok(method),
            Ok(_) if Method::from_bytes(upper.as_bytes()).is_ok() => Err(self.at(
                Some(m.span()),
                &format!(
                    "HTTP methods are case-sensitive and a request's is upper case, so \
                     {:?} would never match: write method = {upper:?}",
                    m.get_ref()
                ),
            )),
            _ => Err(self.at(
                Some(m.span()),
                "not an HTTP method: write method = \"GET\", \"POST\", ...",
            )),
        }
    }

    fn check_store(&self) -> Result<(), ConfigError> {
        let Some(spanned) = &self.file.store else {
            return Ok(());
        };
        self.check_store_kind(spanned)?;
        self.store_builder().map(|_| ())
    }

    fn check_store_kind(&self, spanned: &Spanned<StoreSection>) -> Result<(), ConfigError> {
        let section = spanned.get_ref();
        let kind = section.kind.as_ref();
        match (
            kind.map(|k| k.get_ref().as_str()),
            &section.url,
            &section.nodes,
        ) {
            (None | Some("memory"), None, None) => Ok(()),
            (Some("redis"), Some(_), None) | (Some("redis"), None, Some(_)) => Ok(()),
            (Some("redis"), _, _) => Err(self.at(Some(spanned.span()), REDIS_WHERE)),
            (None | Some("memory"), _, _) => Err(self.at(
                Some(spanned.span()),
                "a memory store has no url or nodes: write kind = \"redis\" to use Redis",
            )),
            (Some(_), _, _) => Err(kind.map_or_else(
                || ConfigError::new("unreachable"),
                |k| self.choice(k, "kind", &["memory", "redis"]),
            )),
        }
    }

    fn choice(&self, value: &Spanned<String>, what: &str, choices: &[&str]) -> ConfigError {
        self.at(
            Some(value.span()),
            &format!(
                "{what} = {:?} is not one tollway knows: write one of {choices:?}",
                value.get_ref()
            ),
        )
    }

    fn at(&self, span: Option<Range<usize>>, message: &str) -> ConfigError {
        locate(&self.name, &self.text, span, message)
    }

    fn err(&self, span: Option<Range<usize>>, error: ConfigError) -> ConfigError {
        self.at(span, &error.to_string())
    }

    /// Whether `other` keeps this file's store and keys, which a reload cannot change.
    fn same_foundations(&self, other: &LimitsFile) -> Result<(), ConfigError> {
        let (old, new) = (&self.file, &other.file);
        if old.store.as_ref().map(Spanned::get_ref) != new.store.as_ref().map(Spanned::get_ref) {
            return Err(other.at(
                new.store.as_ref().map(Spanned::span),
                "[store] changed: the store is chosen at start; restart to use the new one \
                 (the running limits stay)",
            ));
        }
        if old.key.as_ref().map(Spanned::get_ref) != new.key.as_ref().map(Spanned::get_ref) {
            return Err(other.at(
                new.key.as_ref().map(Spanned::span),
                "[key] changed: how keys are found is chosen at start; restart to use it \
                 (the running limits stay)",
            ));
        }
        Ok(())
    }
}

/// A validated policy, or the span and message of what is wrong with it.
fn policy(name: &str, section: &PolicySection) -> Result<Policy, (Option<Range<usize>>, String)> {
    let algorithm = Algorithm::ALL
        .into_iter()
        .find(|a| a.name() == section.algorithm.get_ref())
        .ok_or_else(|| {
            let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
            (
                Some(section.algorithm.span()),
                format!(
                    "algorithm {:?} is not one tollway knows: write one of {names:?}",
                    section.algorithm.get_ref()
                ),
            )
        })?;
    let limit = *section.limit.get_ref();
    let limit = u32::try_from(limit)
        .ok()
        .filter(|&l| l > 0)
        .ok_or_else(|| {
            (
                Some(section.limit.span()),
                format!(
                    "policy {name:?}: limit = {limit} lets nothing through: write a limit of 1 to \
                 {} (units a period)",
                    u32::MAX
                ),
            )
        })?;
    let period = parse_period(section.period.get_ref()).ok_or_else(|| {
        (
            Some(section.period.span()),
            format!(
                "policy {name:?}: period = {:?} is not a period: write \"1s\", \"1m\", \"1h\", \
                 \"1d\" or \"250ms\"",
                section.period.get_ref()
            ),
        )
    })?;
    let mut quota = Quota::with_period(limit, period)
        .map_err(|e| (Some(section.period.span()), e.to_string()))?;
    if let Some(burst) = &section.burst {
        let value = *burst.get_ref();
        let burst_ok = u32::try_from(value).ok().filter(|&b| b >= limit);
        let Some(b) = burst_ok else {
            return Err((
                Some(burst.span()),
                format!(
                    "policy {name:?}: burst = {value} is below the limit ({limit}), so a whole \
                     period's units could never pass at once: write a burst of at least {limit}, \
                     or leave it out (the limit)"
                ),
            ));
        };
        quota = quota
            .with_burst(b)
            .map_err(|e| (Some(burst.span()), e.to_string()))?;
    }
    Policy::new(name, algorithm, quota).map_err(|e| (None, e.to_string()))
}

/// `1s`, `30s`, `1m`, `1h`, `1d`, `250ms`: a whole number and a unit.
fn parse_period(text: &str) -> Option<Duration> {
    let digits = text.trim().find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.trim().split_at(digits);
    let n: u64 = number.parse().ok()?;
    let seconds = match unit {
        "ms" => return Some(Duration::from_millis(n)),
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return None,
    };
    n.checked_mul(seconds).map(Duration::from_secs)
}

/// Whether `value` can be an API key a request sends: a header's value has no
/// whitespace at its ends (HTTP trims it) and no control characters. The message never
/// repeats the value (API keys stay out of logs).
fn api_key_value(value: &str) -> Result<(), &'static str> {
    if value.is_empty() {
        Err("an API key is empty here: write the key, like \"key:partner-key\"")
    } else if value.trim() != value {
        Err(
            "this API key starts or ends with whitespace, which a request's header never \
             does (HTTP trims it), so it would never match: remove the spaces",
        )
    } else if value.chars().any(char::is_control) {
        Err("this API key has a control character, which no header carries: remove it")
    } else {
        Ok(())
    }
}

/// An API key as `tollway check` shows it: its first characters (at most 3, a quarter
/// of it) and an ellipsis, so that a CI log holds no key.
fn redact(key: &str) -> String {
    let shown: String = key.chars().take(3.min(key.chars().count() / 4)).collect();
    format!("\"{shown}…\"")
}

/// `message` with the text of every `string "..."` it quotes (serde's words for a value
/// of the wrong type, which may be an API key) left out.
fn redact_strings(message: &str) -> String {
    let mut out = String::new();
    let mut rest = message;
    while let Some(i) = rest.find("string \"") {
        let (before, quoted) = rest.split_at(i + "string \"".len());
        out.push_str(before);
        out.push_str("…\"");
        let mut escaped = false;
        let end = quoted.char_indices().find(|&(_, c)| {
            let close = c == '"' && !escaped;
            escaped = c == '\\' && !escaped;
            close
        });
        rest = end.map_or("", |(j, _)| &quoted[j + 1..]);
    }
    out.push_str(rest);
    out
}

/// Where an error toml gives without a place comes from: the first line that, read on
/// its own, fails with the same `message` (a key is on one line), from its first
/// character.
fn line_of(text: &str, message: &str) -> Option<Range<usize>> {
    let mut start = 0;
    for line in text.split_inclusive('\n') {
        let alone = toml::from_str::<toml::Table>(line);
        if alone.is_err_and(|e| e.message() == message) {
            let indent = line.len() - line.trim_start().len();
            return Some(start + indent..start + line.len());
        }
        start += line.len();
    }
    None
}

/// `message`, prefixed with `name:line:column:` of the start of `span`.
fn locate(name: &str, text: &str, span: Option<Range<usize>>, message: &str) -> ConfigError {
    let Some(span) = span else {
        return ConfigError::new(format!("{name}: {message}"));
    };
    let before = text.get(..span.start).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    ConfigError::new(format!("{name}:{line}:{column}: {message}"))
}

/// How a config file finds a caller's key: an API key (only the keys in `[tiers]`, by
/// default, read afresh on every reload), else the client's address (the peer's, or
/// behind trusted proxies).
#[derive(Clone)]
pub struct ConfigKey {
    api_key: Option<Known>,
    address: Address,
    /// The API keys the file names — in `[tiers]` and on the lists — swapped on reload.
    known: Arc<ArcSwap<HashSet<String>>>,
}

#[derive(Clone)]
struct Known {
    header: ApiKey,
    only_known: bool,
}

#[derive(Clone)]
enum Address {
    Peer(PeerIp),
    Client(ClientIp),
}

impl fmt::Debug for ConfigKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConfigKey")
            .field(
                "api_key",
                &self.api_key.as_ref().map(|k| k.header.header_name()),
            )
            .finish_non_exhaustive()
    }
}

impl ConfigKey {
    /// The caller's API key, when the file reads one and the caller sent one it accepts.
    fn api_key<B>(&self, request: &Request<B>) -> Option<Key> {
        let api = self.api_key.as_ref()?;
        let key = api.header.extract(request)?;
        (!api.only_known || self.known.load().is_known(key.value())).then_some(key)
    }

    /// The caller's address key.
    fn address<B>(&self, request: &Request<B>) -> Option<Key> {
        match &self.address {
            Address::Peer(peer) => KeyExtractor::<B>::extract(peer, request),
            Address::Client(client) => KeyExtractor::<B>::extract(client, request),
        }
    }
}

impl<B> KeyExtractor<B> for ConfigKey {
    fn extract(&self, request: &Request<B>) -> Option<Key> {
        self.api_key(request).or_else(|| self.address(request))
    }

    /// The API key and the address, both: the lists match either.
    fn identities(&self, request: &Request<B>, found: &mut dyn FnMut(Key)) {
        self.api_key(request).into_iter().for_each(&mut *found);
        self.address(request).into_iter().for_each(found);
    }
}

#[cfg(test)]
mod validation_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// A valid file with `extra` appended, or `policy` in place of the one policy's body.
    pub(super) fn file(policy: &str, extra: &str) -> String {
        format!("[layer]\ndefault = \"api\"\n\n[policies.api]\n{policy}\n{extra}")
    }

    pub(super) const API: &str = "algorithm = \"gcra\"\nlimit = 10\nperiod = \"1s\"";

    /// The error `text` gets, which must start with `limits.toml:line:column:`.
    pub(super) fn error(text: &str, line: usize, column: usize) -> String {
        let err = LimitsFile::parse("limits.toml", text)
            .unwrap_err()
            .to_string();
        let at = format!("limits.toml:{line}:{column}: ");
        assert!(err.starts_with(&at), "{err:?} is not at {at:?}\n{text}");
        err
    }

    #[test]
    fn a_valid_file_describes_its_limits() {
        let text = file(
            API,
            "\n[policies.export]\nalgorithm = \"fixed_window\"\nlimit = 2\nperiod = \"1h\"\n\n[[routes]]\ngrpc_method = \"/demo.Catalog/Export\"\npolicy = \"export\"\n",
        );
        let limits = LimitsFile::parse("limits.toml", &text).unwrap();
        let summary = limits.summary();
        assert!(
            summary.contains("policy api: gcra of 10 per 1s, burst 10 (default)"),
            "{summary}"
        );
        assert!(
            summary.contains("route: * /demo.Catalog/Export -> export"),
            "{summary}"
        );
    }

    #[test]
    fn a_quota_of_zero_is_refused_at_its_limit() {
        let err = error(
            &file("algorithm = \"gcra\"\nlimit = 0\nperiod = \"1s\"", ""),
            6,
            9,
        );
        assert!(err.contains("write a limit of 1"), "{err}");
    }

    #[test]
    fn an_unknown_algorithm_lists_the_known_ones() {
        let err = error(
            &file("algorithm = \"leaky\"\nlimit = 1\nperiod = \"1s\"", ""),
            5,
            13,
        );
        assert!(err.contains("\"token_bucket\""), "{err}");
    }

    #[test]
    fn a_route_naming_an_unknown_policy_says_which_exist() {
        let text = file(API, "\n[[routes]]\npath = \"/x\"\npolicy = \"nope\"\n");
        let err = error(&text, 11, 10);
        assert!(
            err.contains("no policy is named \"nope\"") && err.contains("[\"api\"]"),
            "{err}"
        );
    }

    #[test]
    fn a_network_that_does_not_parse_says_how_to_write_one() {
        let text = file(
            API,
            "\n[lists]\nallow_networks = [\"10.0.0.0/8\", \"10.0.0.0/33\"]\n",
        );
        let err = error(&text, 10, 33);
        assert!(err.contains("10.0.0.0/8"), "{err}");
    }

    #[test]
    fn a_burst_below_the_limit_is_refused_at_the_burst() {
        let text = file(
            "algorithm = \"token_bucket\"\nlimit = 10\nperiod = \"1s\"\nburst = 5",
            "",
        );
        let err = error(&text, 8, 9);
        assert!(err.contains("at least 10"), "{err}");
    }

    #[test]
    fn a_period_that_is_not_one_says_how_to_write_one() {
        let err = error(
            &file("algorithm = \"gcra\"\nlimit = 1\nperiod = \"soon\"", ""),
            7,
            10,
        );
        assert!(err.contains("\"1m\""), "{err}");
    }

    #[test]
    fn an_unknown_field_is_refused_where_it_is() {
        let err = error(&file(API, "limt = 3\n"), 8, 1);
        assert!(err.contains("limt"), "{err}");
    }

    #[test]
    fn a_route_may_not_share_a_policy_with_the_default() {
        let text = file(API, "\n[[routes]]\npath = \"/x\"\npolicy = \"api\"\n");
        let err = error(&text, 11, 10);
        assert!(err.contains("a policy of its own"), "{err}");
    }

    #[test]
    fn a_choice_that_is_not_one_lists_the_choices() {
        let text = "[layer]\ndefault = \"api\"\nheaders = \"fancy\"\n\n[policies.api]\nalgorithm = \"gcra\"\nlimit = 1\nperiod = \"1s\"\n";
        let err = error(text, 3, 11);
        assert!(
            err.contains("[\"legacy\", \"ietf\", \"both\", \"none\"]"),
            "{err}"
        );
    }

    #[test]
    fn store_settings_are_checked_before_start() {
        let store = |settings: &str| format!("[store]\n{settings}\n\n{}", file(API, ""));
        let err = error(
            &store("kind = \"redis\"\nurl = \"redis://127.0.0.1\"\ntimeout_ms = 0"),
            1,
            1,
        );
        assert!(err.contains("timeout"), "{err}");
        let err = error(
            &store("kind = \"redis\"\nurl = \"redis://127.0.0.1\"\nbreaker = { treshold = 3 }"),
            4,
            11,
        );
        assert!(err.contains("cool_down_ms = 250"), "{err}");
        let err = error(&store("max_keys = 0"), 2, 12);
        assert!(err.contains("max_keys"), "{err}");
    }

    #[test]
    fn a_listed_api_key_is_seen_even_outside_the_tiers() {
        let text = format!(
            "[key]\napi_key = {{ header = \"x-api-key\" }}\n\n{}",
            file(API, "\n[lists]\ndeny_keys = [\"key:stolen\"]\n")
        );
        let limits = LimitsFile::parse("limits.toml", &text).unwrap();
        let request = Request::get("/")
            .header("x-api-key", "stolen")
            .body(())
            .unwrap();
        let key = KeyExtractor::<()>::extract(&limits.key().unwrap(), &request);
        assert_eq!(key, Some(Key::new("key", "stolen")));
        let unknown = Request::get("/")
            .header("x-api-key", "made-up")
            .body(())
            .unwrap();
        // Not known, and no peer address in this request: no key.
        assert_eq!(
            KeyExtractor::<()>::extract(&limits.key().unwrap(), &unknown),
            None
        );
    }

    #[test]
    fn hops_counted_through_a_cdn_are_read_from_the_file() {
        let text = format!(
            "[key]\nclient_ip = {{ header = \"x-forwarded-for\", trusted_proxies = \
             [\"10.0.0.0/8\"], trusted_hops = 2, hops_through = [\"203.0.113.0/24\"] }}\n\n{}",
            file(API, "")
        );
        let limits = LimitsFile::parse("limits.toml", &text).unwrap();
        let mut direct = Request::get("/")
            .header("x-forwarded-for", "6.6.6.6, 198.51.100.7")
            .body(())
            .unwrap();
        let balancer: std::net::SocketAddr = "10.0.0.5:40000".parse().unwrap();
        direct.extensions_mut().insert(balancer);
        let key = KeyExtractor::<()>::extract(&limits.key().unwrap(), &direct);
        assert_eq!(key, Some(Key::new("ip", "198.51.100.7")));
        let bad = text.replace("203.0.113.0/24", "203.0.113.0/33");
        assert!(LimitsFile::parse("limits.toml", &bad).is_err());
    }

    #[test]
    fn periods_are_a_number_and_a_unit() {
        assert_eq!(parse_period("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_period("1m"), Some(Duration::from_secs(60)));
        assert_eq!(parse_period("2d"), Some(Duration::from_secs(172_800)));
        assert_eq!(parse_period("m"), None);
        assert_eq!(parse_period("10"), None);
    }
}
