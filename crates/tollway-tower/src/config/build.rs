//! What a limits file builds: a layer's builder, its costs, settlements, lists and
//! load shedder, each setting checked at its line and column.

use std::collections::BTreeSet;

use http::Method;
use tollway_core::{ConfigError, MAX_UNITS, Store};
use toml::Spanned;

use super::file::{LimitsFile, api_key_value, parse_period, plan_quota};
use super::key::{Address, ConfigKey};
use super::schema::{CostSection, SettleSection};
use crate::headers::HeaderStyle;
use crate::key::{Key, parse_network};
use crate::limits::RouteLimit;
use crate::lookup::Plan;
use crate::pipeline::{MissingKey, OnStoreError, Protocol};
use crate::rate_limit::{RateLimitLayer, RateLimitLayerBuilder};
use crate::settle::Unsettled;
use crate::shed::{self, Match, Priority, Shed};

impl LimitsFile {
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
        for (key, name) in self.keyed_tiers() {
            api_key_value(key.get_ref()).map_err(|m| self.at(Some(key.span()), m))?;
            let policy = self.policy_named(name)?;
            if !used.contains(&policy.name()) {
                used.push(policy.name());
                builder = builder.tier(policy.clone());
            }
        }
        for (key, plan) in &file.plans {
            if let Some((named, _)) = file.tiers.get_key_value(key) {
                return Err(self.at(
                    Some(named.span()),
                    "this key has a plan in [plans], which names its tier: remove it from \
                     [tiers]",
                ));
            }
            let plan = plan.get_ref();
            let tier = self.policy_named(&plan.tier)?;
            let quota = plan_quota(tier, &plan.limit, plan.burst.as_ref())
                .map_err(|(span, message)| self.at(span, &message))?;
            builder = builder.plan(key.get_ref(), Plan::tier(tier.name()).with_quota(quota));
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
        // So does a policy a bucket names, shared among Envoys (tollway-server's RLQS).
        self.buckets()?;
        used.extend(self.bucket_policies());
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

    pub(super) fn try_header_style(&self) -> Result<HeaderStyle, ConfigError> {
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

    pub(super) fn try_on_store_error(&self) -> Result<OnStoreError, ConfigError> {
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
    pub(super) fn header_matches(
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
    pub(super) fn cost<St: Store>(
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
    pub(super) fn cost_bounds(
        &self,
        name: &str,
        cost: &CostSection,
    ) -> Result<Bounds, ConfigError> {
        let read = |value: &Option<Spanned<i64>>, what: &str, unsaid: u64| match value {
            None => Ok(unsaid),
            Some(value) => u64::try_from(*value.get_ref())
                .ok()
                .filter(|&n| (1..=MAX_UNITS).contains(&n))
                .ok_or_else(|| {
                    self.at(
                        Some(value.span()),
                        &format!(
                            "policy {name:?}: cost {what} = {} is not a cost: write 1 to {} \
                             (a request that cost nothing would pass an empty budget)",
                            value.get_ref(),
                            MAX_UNITS
                        ),
                    )
                }),
        };
        let min = read(&cost.min, "min", 1)?;
        let max = read(&cost.max, "max", MAX_UNITS)?;
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
    pub(super) fn settle<St: Store>(
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
        // Strict: a number past u64 is no report, not the most there is.
        let used = move |headers: &http::HeaderMap| -> Option<u64> {
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
    pub(super) fn header_name(
        &self,
        name: &Spanned<String>,
    ) -> Result<http::HeaderName, ConfigError> {
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
    pub(super) fn tier_keys(&self, tiers: &[Spanned<String>]) -> Result<Match, ConfigError> {
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
                .keyed_tiers()
                .any(|(_, t)| t.get_ref() == tier.get_ref())
            {
                let known: BTreeSet<&str> = self
                    .keyed_tiers()
                    .map(|(_, t)| t.get_ref().as_str())
                    .collect();
                return Err(self.at(
                    Some(tier.span()),
                    &format!(
                        "no key in [tiers] or [plans] is of tier {:?}: write one of {known:?}",
                        tier.get_ref()
                    ),
                ));
            }
        }
        let keys = self
            .keyed_tiers()
            .filter(|(_, tier)| tiers.iter().any(|t| t.get_ref() == tier.get_ref()))
            .map(|(key, _)| key.get_ref().clone());
        Ok(Match::header_in(self.header_name(&api_key.header)?, keys))
    }

    /// A `key:` or `ip:` entry of the lists, spelled as the key it must match.
    pub(super) fn listed_key(&self, key: &Spanned<String>) -> Result<Key, ConfigError> {
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
    pub(super) fn method(&self, m: &Spanned<String>) -> Result<Method, ConfigError> {
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
}

/// The whole number in header `name` of `headers`, if there is one (past `u64::MAX`,
/// none).
fn number(headers: &http::HeaderMap, name: &http::HeaderName) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

/// A cost read from a request header: at least `min`, at most `max`, `default` when the
/// header is missing or not a number.
#[derive(Clone, Copy, Debug)]
pub(super) struct Bounds {
    pub(super) min: u64,
    pub(super) max: u64,
    pub(super) default: u64,
}
