//! A limits file read and validated: its policies, tiers, routes, lists and settings,
//! each error at its `file:line:column`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use http::Method;
use tollway_core::{Algorithm, ConfigError, MemoryStore, Policy, Quota, Store};
use toml::Spanned;

use super::key::{Address, ConfigKey};
use super::reload;
use super::schema::{CostSection, DEPTH, File, PolicySection, SettleSection};
use crate::headers::HeaderStyle;
use crate::key::{Key, parse_network};
use crate::limits::RouteLimit;
use crate::pipeline::{MissingKey, OnStoreError, Protocol};
use crate::rate_limit::{RateLimitLayer, RateLimitLayerBuilder};
use crate::settle::Unsettled;
use crate::shed::{self, Match, Priority, Shed};

/// A limits file, read and validated: every policy, tier, route, list entry and setting
/// in it is usable. See the [module docs](crate::config) for what it may say.
pub struct LimitsFile {
    name: String,
    pub(super) text: String,
    pub(super) file: File,
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
                "write breaker = false, true or { threshold = 5, cool_down_ms = 250 }; \
                 local_fallback = false, true or a share of each quota like 0.1; and \
                 leases = false, true or { horizon_ms = 200, min_units = 8, max_share = 0.1 }"
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
        // A policy a descriptor names limits an Envoy edge's requests (tollway-server).
        self.descriptors()?;
        used.extend(self.descriptor_policies());
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
        builder = builder.headers(self.try_header_style()?);
        if let Some(protocol) = &layer.protocol {
            builder = builder.protocol(match protocol.get_ref().as_str() {
                "detect" => Protocol::Detect,
                "http" => Protocol::Http,
                "grpc" => Protocol::Grpc,
                _ => return Err(self.choice(protocol, "protocol", &["detect", "http", "grpc"])),
            });
        }
        builder = builder.on_store_error(self.try_on_store_error()?);
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
        let mut settled: Option<&str> = None;
        for (name, section) in &file.policies {
            let section = section.get_ref();
            if section.shadow {
                builder = builder.shadow_policy(name.clone());
            }
            if let Some(cost) = &section.cost {
                builder = self.cost(builder, name, cost.get_ref())?;
            }
            if let Some(settle) = &section.settle {
                if let Some(first) = settled {
                    return Err(self.at(
                        Some(settle.span()),
                        &format!(
                            "policy {name:?} settles after responses, and so does {first:?}: \
                             one policy of a layer is settled; keep settle on one of them"
                        ),
                    ));
                }
                settled = Some(name);
                builder = self.settle(builder, name, settle)?;
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
        if let Some(shed) = self.shed()? {
            builder = builder.shed(shed);
        }
        self.check_store()?;
        Ok(builder)
    }

    /// `[key] ipv6_prefix`: how many bits of an IPv6 address make a caller (default 64).
    pub(super) fn ipv6_prefix(&self) -> u8 {
        let key = self.file.key.as_ref().map(Spanned::get_ref);
        key.and_then(|k| k.ipv6_prefix.as_ref())
            .map_or(64, |bits| *bits.get_ref())
    }

    /// The names of the file's policies.
    pub fn policy_names(&self) -> impl Iterator<Item = &str> {
        self.policies.keys().map(String::as_str)
    }

    /// `[layer] headers`: which rate-limit headers responses carry (default legacy).
    #[must_use]
    pub fn header_style(&self) -> HeaderStyle {
        self.try_header_style().unwrap_or(HeaderStyle::Legacy)
    }

    /// `[layer] on_store_error`: what to answer when the store cannot decide (default
    /// allow).
    #[must_use]
    pub fn on_store_error(&self) -> OnStoreError {
        self.try_on_store_error().unwrap_or(OnStoreError::Allow)
    }

    /// Whether the file puts the whole layer (`None`) or the named policy in shadow mode.
    #[must_use]
    pub fn is_shadow(&self, policy: Option<&str>) -> bool {
        match policy {
            None => self.file.layer.shadow,
            Some(name) => self
                .file
                .policies
                .get(name)
                .is_some_and(|p| p.get_ref().shadow),
        }
    }

    fn try_header_style(&self) -> Result<HeaderStyle, ConfigError> {
        let Some(style) = &self.file.layer.headers else {
            return Ok(HeaderStyle::Legacy);
        };
        Ok(match style.get_ref().as_str() {
            "legacy" => HeaderStyle::Legacy,
            "ietf" => HeaderStyle::Ietf,
            "both" => HeaderStyle::Both,
            "none" => HeaderStyle::None,
            _ => return Err(self.choice(style, "headers", &["legacy", "ietf", "both", "none"])),
        })
    }

    fn try_on_store_error(&self) -> Result<OnStoreError, ConfigError> {
        let Some(on_error) = &self.file.layer.on_store_error else {
            return Ok(OnStoreError::Allow);
        };
        Ok(match on_error.get_ref().as_str() {
            "allow" => OnStoreError::Allow,
            "reject" => OnStoreError::Reject,
            _ => return Err(self.choice(on_error, "on_store_error", &["allow", "reject"])),
        })
    }

    /// The load shedder `[shed]` describes, if the file has one: a new one, learning
    /// from scratch.
    ///
    /// # Errors
    ///
    /// When a setting is out of range or a priority is malformed, with its line and
    /// column.
    pub fn shed(&self) -> Result<Option<Shed>, ConfigError> {
        let Some(section) = &self.file.shed else {
            return Ok(None);
        };
        let whole = Some(section.span());
        let section = section.get_ref();
        let mut builder = Shed::builder();
        let floor = section.floor.as_ref().map_or(shed::FLOOR, |f| *f.get_ref());
        let ceiling = section
            .ceiling
            .as_ref()
            .map_or(shed::CEILING, |c| *c.get_ref());
        builder = builder.limits(floor, ceiling);
        if let Some(initial) = &section.initial {
            builder = builder.initial(*initial.get_ref());
        }
        if let Some(tolerance) = &section.tolerance {
            builder = builder.tolerance(*tolerance.get_ref());
        }
        if let Some(part) = &section.per_address {
            builder = builder.per_address(*part.get_ref());
        }
        if let Some(window) = &section.window {
            let Some(length) = parse_period(window.get_ref()) else {
                return Err(self.at(
                    Some(window.span()),
                    "window is a duration: write window = \"1s\" or \"500ms\"",
                ));
            };
            builder = builder.window(length, shed::MIN_CALLS);
        }
        for priority in &section.priorities {
            let p = priority.get_ref();
            let mut made = Priority::new(p.name.get_ref().clone(), *p.share.get_ref());
            for route in &p.routes {
                let text = route.get_ref();
                let (method, path) = match text.split_once(' ') {
                    Some((method, path)) => (Some(method), path),
                    None => (None, text.as_str()),
                };
                let method = match method {
                    None => None,
                    Some(m) => match Method::from_bytes(m.as_bytes()) {
                        Ok(method) if m.bytes().all(|b| !b.is_ascii_lowercase()) => Some(method),
                        _ => {
                            return Err(self.at(
                                Some(route.span()),
                                &format!(
                                    "{m:?} is not an upper-case HTTP method: write \
                                     \"POST /api/v1/checkout\", or \"/api/v1/checkout\" \
                                     for any method"
                                ),
                            ));
                        }
                    },
                };
                let matched = Match::route(method, path).map_err(|e| {
                    self.at(
                        Some(route.span()),
                        &format!("{e} (a priority's route is \"POST /path\" or \"/path\")"),
                    )
                })?;
                made = made.when(matched);
            }
            if let Some(headers) = &p.headers {
                for matched in self.header_matches(p.name.get_ref(), headers)? {
                    made = made.when(matched);
                }
            }
            for header in &p.headers_present {
                made = made.when(Match::header_present(self.header_name(header)?));
            }
            if !p.tiers.is_empty() {
                made = made.when(self.tier_keys(&p.tiers)?);
            }
            if p.routes.is_empty()
                && p.headers.is_none()
                && p.headers_present.is_empty()
                && p.tiers.is_empty()
            {
                return Err(self.at(
                    Some(priority.span()),
                    &format!(
                        "priority {:?} matches no request: give it routes = [\"POST \
                         /api/v1/checkout\"], tiers = [\"pro\"] or headers = {{ x-plan = \
                         [\"gold\"] }}",
                        p.name.get_ref()
                    ),
                ));
            }
            builder = builder.priority(made);
        }
        builder
            .shadow(section.shadow)
            .build()
            .map(Some)
            .map_err(|e| self.err(whole, e))
    }

    /// The matches of a priority's `headers`: each header's known values. A list of
    /// names alone is refused: any client can send a header.
    fn header_matches(
        &self,
        priority: &str,
        headers: &Spanned<toml::Value>,
    ) -> Result<Vec<Match>, ConfigError> {
        let at = || Some(headers.span());
        let shape = || {
            self.at(
                at(),
                &format!(
                    "priority {priority:?}: headers is a table of each header's values that \
                     win it: write headers = {{ x-plan = [\"gold\", \"platinum\"] }}"
                ),
            )
        };
        let table = match headers.get_ref() {
            toml::Value::Table(table) if !table.is_empty() => table,
            toml::Value::Array(names) => {
                let names: Vec<&str> = names.iter().filter_map(toml::Value::as_str).collect();
                return Err(self.at(
                    at(),
                    &format!(
                        "priority {priority:?}: headers = {names:?} would match any request \
                         that carries them, and any client can send a header (made-up API \
                         keys would win it): list the values that count, headers = {{ {} = \
                         [\"...\"] }}, or tiers = [\"pro\"] for a tier's API keys; to match \
                         presence knowingly, write headers_present = {names:?}",
                        names.first().copied().unwrap_or("x-plan")
                    ),
                ));
            }
            _ => return Err(shape()),
        };
        table
            .iter()
            .map(|(name, values)| {
                let name = http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                    self.at(
                        at(),
                        &format!("{name:?} is not a header name: write one like \"x-plan\""),
                    )
                })?;
                let values: Vec<&str> = match values.as_array() {
                    Some(values) => values.iter().filter_map(toml::Value::as_str).collect(),
                    None => return Err(shape()),
                };
                if values.is_empty() {
                    return Err(self.at(
                        at(),
                        &format!(
                            "priority {priority:?}: header {name} lists no value: list the \
                             values that win it"
                        ),
                    ));
                }
                Ok(Match::header_in(name, values))
            })
            .collect()
    }

    /// `builder` with policy `name` costing the number in `cost`'s request header, within
    /// its `min` and `max`.
    fn cost<St: Store>(
        &self,
        builder: RateLimitLayerBuilder<St, ConfigKey>,
        name: &str,
        cost: &CostSection,
    ) -> Result<RateLimitLayerBuilder<St, ConfigKey>, ConfigError> {
        let header = self.header_name(&cost.header)?;
        let Bounds { min, max, default } = self.cost_bounds(name, cost)?;
        Ok(builder.policy_cost(name, move |_, _, headers, _| {
            number(headers, &header).map_or(default, |n| n.clamp(min, max))
        }))
    }

    /// A cost's floor, ceiling and default, checked: `1 <= min <= default <= max`.
    fn cost_bounds(&self, name: &str, cost: &CostSection) -> Result<Bounds, ConfigError> {
        let read = |value: &Option<Spanned<i64>>, what: &str, unsaid: u32| match value {
            None => Ok(unsaid),
            Some(value) => u32::try_from(*value.get_ref())
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| {
                    self.at(
                        Some(value.span()),
                        &format!(
                            "policy {name:?}: cost {what} = {} is not a cost: write 1 to {} \
                             (a request that cost nothing would pass an empty budget)",
                            value.get_ref(),
                            u32::MAX
                        ),
                    )
                }),
        };
        let min = read(&cost.min, "min", 1)?;
        let max = read(&cost.max, "max", u32::MAX)?;
        let default = read(&cost.default, "default", min)?;
        if let (Some(at), true) = (&cost.max, max < min) {
            return Err(self.at(
                Some(at.span()),
                &format!("policy {name:?}: cost max = {max} is under min = {min}: raise it"),
            ));
        }
        if let (Some(at), false) = (&cost.default, (min..=max).contains(&default)) {
            return Err(self.at(
                Some(at.span()),
                &format!(
                    "policy {name:?}: cost default = {default} is outside min = {min} and \
                     max = {max}: write one between them"
                ),
            ));
        }
        if let Some(by) = &cost.written_by
            && !matches!(by.get_ref().as_str(), "gateway" | "client")
        {
            return Err(self.choice(by, "written_by", &["gateway", "client"]));
        }
        Ok(Bounds { min, max, default })
    }

    /// `builder` settling policy `name` to what `settle`'s response header says.
    fn settle<St: Store>(
        &self,
        builder: RateLimitLayerBuilder<St, ConfigKey>,
        name: &str,
        section: &Spanned<SettleSection>,
    ) -> Result<RateLimitLayerBuilder<St, ConfigKey>, ConfigError> {
        let settle = section.get_ref();
        let algorithm = self.policies[name].algorithm();
        if !algorithm.keeps_debt() {
            return Err(self.at(
                Some(section.span()),
                &format!(
                    "policy {name:?} is settled after responses, but a {} forgets at the end \
                     of its window what a call used beyond it: settle a token_bucket, \
                     leaky_bucket or gcra, which keep it as a debt",
                    algorithm.name()
                ),
            ));
        }
        let header = match &settle.header {
            Some(header) => Some(self.header_name(header)?),
            None => None,
        };
        let unsettled = match &settle.unsettled {
            None => Unsettled::Keep,
            Some(rule) => match rule.get_ref().as_str() {
                "keep" => Unsettled::Keep,
                "refund" => Unsettled::Refund,
                _ => return Err(self.choice(rule, "unsettled", &["keep", "refund"])),
            },
        };
        // Strict: a number past u32 is no report, not the most there is.
        let used = move |headers: &http::HeaderMap| -> Option<u32> {
            headers
                .get(header.as_ref()?)?
                .to_str()
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        Ok(builder
            .settle(name, move |_, headers, _| used(headers))
            .on_unsettled(unsettled))
    }

    /// A header name the file gives, checked.
    fn header_name(&self, name: &Spanned<String>) -> Result<http::HeaderName, ConfigError> {
        http::HeaderName::from_bytes(name.get_ref().as_bytes()).map_err(|_| {
            self.at(
                Some(name.span()),
                &format!(
                    "{:?} is not a header name: write one like \"x-max-tokens\"",
                    name.get_ref()
                ),
            )
        })
    }

    /// Requests whose API key (`[key] api_key`) is in `[tiers]` under one of `tiers`.
    fn tier_keys(&self, tiers: &[Spanned<String>]) -> Result<Match, ConfigError> {
        let api_key = self
            .file
            .key
            .as_ref()
            .and_then(|k| k.get_ref().api_key.as_ref());
        let Some(api_key) = api_key else {
            return Err(self.at(
                Some(tiers[0].span()),
                "a priority by tier needs callers' API keys: add [key] api_key = { header = \
                 \"x-api-key\" }",
            ));
        };
        for tier in tiers {
            if !self
                .file
                .tiers
                .values()
                .any(|t| t.get_ref() == tier.get_ref())
            {
                let known: BTreeSet<&str> = self
                    .file
                    .tiers
                    .values()
                    .map(|t| t.get_ref().as_str())
                    .collect();
                return Err(self.at(
                    Some(tier.span()),
                    &format!(
                        "no key in [tiers] is of tier {:?}: write one of {known:?}",
                        tier.get_ref()
                    ),
                ));
            }
        }
        let keys = self
            .file
            .tiers
            .iter()
            .filter(|(_, tier)| tiers.iter().any(|t| t.get_ref() == tier.get_ref()))
            .map(|(key, _)| key.get_ref().clone());
        Ok(Match::header_in(self.header_name(&api_key.header)?, keys))
    }

    /// What the file lets a client do that it may not mean to, a sentence each, at its
    /// line and column: what `tollway check` prints as warnings. The file is valid
    /// either way.
    ///
    /// Today: a cost read from a request header that nothing says the gateway writes.
    /// A client can send any header, so it chooses its own cost, between `min` and
    /// `max`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_tower::config::LimitsFile;
    ///
    /// let text = r#"
    /// [layer]
    /// default = "tokens"
    ///
    /// [policies.tokens]
    /// algorithm = "token_bucket"
    /// limit = 20_000
    /// period = "1m"
    /// cost = { header = "x-max-tokens", default = 1_000, max = 4_096 }
    /// "#;
    /// let file = LimitsFile::parse("limits.toml", text)?;
    /// let warnings = file.warnings();
    /// assert_eq!(warnings.len(), 1);
    /// assert!(warnings[0].starts_with("limits.toml:9:19: "), "{}", warnings[0]);
    /// assert!(warnings[0].contains("written_by = \"gateway\""), "{}", warnings[0]);
    ///
    /// let file = LimitsFile::parse("limits.toml", &text.replace("max = 4_096", "max = 4_096, written_by = \"gateway\""))?;
    /// assert!(file.warnings().is_empty());
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    #[must_use]
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for (name, policy) in &self.file.policies {
            let Some(cost) = &policy.get_ref().cost else {
                continue;
            };
            let cost = cost.get_ref();
            if cost.written_by.is_some() {
                continue;
            }
            let header = cost.header.get_ref();
            let (min, max) = self
                .cost_bounds(name, cost)
                .map_or((1, u32::MAX), |b| (b.min, b.max));
            let max = if max == u32::MAX {
                "none, so up to the policy's capacity".to_owned()
            } else {
                max.to_string()
            };
            warnings.push(
                self.at(
                    Some(cost.header.span()),
                    &format!(
                        "policy {name:?} costs what request header {header} says, and any \
                         client can send it: a client picks its own cost between min = {min} \
                         and max = {max}. If a layer before tollway writes the header (as \
                         examples/llm_gateway.rs does from the body), say so: written_by = \
                         \"gateway\"; to take the client's number knowingly, written_by = \
                         \"client\""
                    ),
                )
                .to_string(),
            );
        }
        warnings
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
            let quota = if policy.algorithm() == Algorithm::Concurrency {
                format!(
                    "{} at once, a slot living {:?} unrenewed",
                    q.limit(),
                    q.period()
                )
            } else {
                format!("{} per {:?}, burst {}", q.limit(), q.period(), q.burst())
            };
            let _ = write!(
                out,
                "  policy {name}: {} of {quota}{}{}",
                policy.algorithm().name(),
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
            let section = file.policies[name].get_ref();
            if let Some(cost) = &section.cost {
                let cost = cost.get_ref();
                // Checked when the file was read.
                let bounds = self.cost_bounds(name, cost).ok();
                let (min, max, default) =
                    bounds.map_or((1, u32::MAX, 1), |b| (b.min, b.max, b.default));
                let max = if max == u32::MAX {
                    "none".to_owned()
                } else {
                    max.to_string()
                };
                let by = cost.written_by.as_ref().map_or("unsaid", |b| b.get_ref());
                let _ = write!(
                    out,
                    " (cost: {}, default {default}, min {min}, max {max}, written by {by})",
                    cost.header.get_ref()
                );
            }
            if let Some(settle) = &section.settle {
                let settle = settle.get_ref();
                let header = settle
                    .header
                    .as_ref()
                    .map_or("the handler's Usage", |h| h.get_ref());
                let rule = settle.unsettled.as_ref().map_or("keep", |r| r.get_ref());
                let _ = write!(out, " (settled: {header}, unsettled {rule})");
            }
            let _ = writeln!(out);
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
        self.descriptor_summary(&mut out);
        if let Some(shed) = &file.shed {
            let shed = shed.get_ref();
            let floor = shed.floor.as_ref().map_or(shed::FLOOR, |f| *f.get_ref());
            let ceiling = shed
                .ceiling
                .as_ref()
                .map_or(shed::CEILING, |c| *c.get_ref());
            let tolerance = shed.tolerance.as_ref().map_or(1.5, |t| *t.get_ref());
            let window = shed.window.as_ref().map_or("1s", |w| w.get_ref());
            let part = shed
                .per_address
                .as_ref()
                .map_or(shed::PER_ADDRESS, |p| *p.get_ref());
            let _ = writeln!(
                out,
                "  shed: calls in flight between {floor} and {ceiling}, latency tolerance \
                 {tolerance}, window {window}, {part} of a share per address{}",
                if shed.shadow { " (shadow)" } else { "" }
            );
            let mut left = 1.0;
            for priority in &shed.priorities {
                let p = priority.get_ref();
                let matches: Vec<String> = p
                    .routes
                    .iter()
                    .map(|r| r.get_ref().clone())
                    .chain(
                        p.headers
                            .iter()
                            .filter_map(|h| h.get_ref().as_table())
                            .flatten()
                            .map(|(name, values)| {
                                let n = values.as_array().map_or(0, Vec::len);
                                format!("header {name} in {n} values")
                            }),
                    )
                    .chain(
                        p.headers_present
                            .iter()
                            .map(|h| format!("header {} present (claimable)", h.get_ref())),
                    )
                    .chain(p.tiers.iter().map(|t| format!("tier {}", t.get_ref())))
                    .collect();
                left -= p.share.get_ref();
                let _ = writeln!(
                    out,
                    "  shed priority {}: share {} ({})",
                    p.name.get_ref(),
                    p.share.get_ref(),
                    matches.join(", ")
                );
            }
            let _ = writeln!(
                out,
                "  shed priority {}: share {} (the rest)",
                shed::OTHER,
                (f64::max(left, 0.0) * 1_000.0).round() / 1_000.0
            );
        }
        out
    }

    /// The API keys the file names: in `[tiers]`, and as `key:` entries of the lists (a
    /// key on the deny list must be seen to be denied).
    pub(super) fn known_keys(&self) -> HashSet<String> {
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

    pub(super) fn policy_named(&self, name: &Spanned<String>) -> Result<&Policy, ConfigError> {
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
    pub(super) fn choice(
        &self,
        value: &Spanned<String>,
        what: &str,
        choices: &[&str],
    ) -> ConfigError {
        self.at(
            Some(value.span()),
            &format!(
                "{what} = {:?} is not one tollway knows: write one of {choices:?}",
                value.get_ref()
            ),
        )
    }

    pub(super) fn at(&self, span: Option<Range<usize>>, message: &str) -> ConfigError {
        locate(&self.name, &self.text, span, message)
    }

    pub(super) fn err(&self, span: Option<Range<usize>>, error: ConfigError) -> ConfigError {
        self.at(span, &error.to_string())
    }

    /// Whether `other` keeps this file's store and keys, which a reload cannot change.
    pub(super) fn same_foundations(&self, other: &LimitsFile) -> Result<(), ConfigError> {
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
pub(super) fn parse_period(text: &str) -> Option<Duration> {
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

/// The whole number in header `name` of `headers`, if there is one, at most `u32::MAX`:
/// a cost past it costs the most there is.
fn number(headers: &http::HeaderMap, name: &http::HeaderName) -> Option<u32> {
    let n: u64 = headers.get(name)?.to_str().ok()?.trim().parse().ok()?;
    Some(u32::try_from(n).unwrap_or(u32::MAX))
}

/// A cost read from a request header: at least `min`, at most `max`, `default` when the
/// header is missing or not a number.
#[derive(Clone, Copy, Debug)]
struct Bounds {
    min: u32,
    max: u32,
    default: u32,
}
