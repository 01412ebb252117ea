//! The file as serde reads it: one type a section, each field spanned where an error
//! may point at it.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

/// The whole file, as written.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct File {
    pub(super) store: Option<Spanned<StoreSection>>,
    pub(super) layer: LayerSection,
    pub(super) key: Option<Spanned<KeySection>>,
    pub(super) policies: BTreeMap<String, Spanned<PolicySection>>,
    #[serde(default)]
    pub(super) tiers: BTreeMap<Spanned<String>, Spanned<String>>,
    /// API keys with a quota of their own, on a tier's policy.
    #[serde(default)]
    pub(super) plans: BTreeMap<Spanned<String>, Spanned<PlanSection>>,
    #[serde(default)]
    pub(super) routes: Vec<Spanned<RouteSection>>,
    #[serde(default)]
    pub(super) lists: ListsSection,
    pub(super) shed: Option<Spanned<ShedSection>>,
    /// Envoy rate limit descriptors, for tollway-server.
    #[serde(default)]
    pub(super) descriptors: Vec<Spanned<DescriptorSection>>,
    /// Envoy rate limit quota buckets, for tollway-server.
    #[serde(default)]
    pub(super) buckets: Vec<Spanned<BucketSection>>,
}

/// A key's plan: its tier, at a limit (and burst) of its own.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct PlanSection {
    pub(super) tier: Spanned<String>,
    pub(super) limit: Spanned<i64>,
    pub(super) burst: Option<Spanned<i64>>,
}

/// A descriptor rule: a domain and entries, and the policy that limits them.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct DescriptorSection {
    pub(super) domain: Spanned<String>,
    pub(super) entries: Spanned<Vec<Spanned<EntrySection>>>,
    pub(super) policy: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) unlimited: bool,
    /// The namespace of the key the entries' values make (`ip`: the layer's peer keys).
    pub(super) key: Option<Spanned<String>>,
    /// The most hits one descriptor charges or gives back; more count as this many.
    pub(super) max_hits: Option<Spanned<i64>>,
    /// The fewest hits one descriptor charges; fewer (0 included) count as this many.
    pub(super) min_hits: Option<Spanned<i64>>,
    /// The entry whose value is a descriptor's hits (not matched, not in the key).
    pub(super) hits_entry: Option<Spanned<String>>,
    /// The hits of a descriptor without that entry, or with a value not a number.
    pub(super) default_hits: Option<Spanned<i64>>,
    /// Decided and counted, never refused (envoyproxy/ratelimit's name).
    #[serde(default)]
    pub(super) shadow_mode: bool,
    /// A name other rules' `replaces` can give.
    pub(super) name: Option<Spanned<String>>,
    /// The named rules whose limits a request matching this one does not apply.
    #[serde(default)]
    pub(super) replaces: Vec<Spanned<String>>,
}

/// A bucket rule: a domain and the entries of a bucket id, and the policy that limits
/// them. None of a descriptor's `max_hits`, `shadow_mode`, `name` or `replaces`.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct BucketSection {
    pub(super) domain: Spanned<String>,
    pub(super) entries: Spanned<Vec<Spanned<EntrySection>>>,
    pub(super) policy: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) unlimited: bool,
    /// The namespace of the key the entries' values make (`ip`: the layer's peer keys).
    pub(super) key: Option<Spanned<String>>,
}

/// One entry of a descriptor or bucket rule: a key, and a value, a pattern, or any value.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct EntrySection {
    pub(super) key: Spanned<String>,
    pub(super) value: Option<Spanned<String>>,
}

/// Load shedding: an adaptive limit on the service's calls in flight.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct ShedSection {
    pub(super) floor: Option<Spanned<u32>>,
    pub(super) ceiling: Option<Spanned<u32>>,
    pub(super) initial: Option<Spanned<u32>>,
    pub(super) tolerance: Option<Spanned<f64>>,
    pub(super) window: Option<Spanned<String>>,
    /// The part of a priority's share one address may hold.
    pub(super) per_address: Option<Spanned<f64>>,
    #[serde(default)]
    pub(super) shadow: bool,
    #[serde(default)]
    pub(super) priorities: Vec<Spanned<PrioritySection>>,
}

/// A priority of load shedding: its share, and the requests it takes.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct PrioritySection {
    pub(super) name: Spanned<String>,
    pub(super) share: Spanned<f64>,
    /// `"POST /api/v1/checkout"` or `"/api/*"`.
    #[serde(default)]
    pub(super) routes: Vec<Spanned<String>>,
    /// Requests whose header (the key) has one of its values: `{ x-plan = ["gold"] }`.
    /// Read as any value, so that a list of names alone (a header's presence, which is
    /// claimable) is refused with a sentence that says what to write.
    pub(super) headers: Option<Spanned<toml::Value>>,
    /// Requests carrying one of these headers, whatever its value: claimable.
    #[serde(default)]
    pub(super) headers_present: Vec<Spanned<String>>,
    /// Requests whose API key is in `[tiers]` under one of these policies.
    #[serde(default)]
    pub(super) tiers: Vec<Spanned<String>>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct StoreSection {
    pub(super) kind: Option<Spanned<String>>,
    pub(super) max_keys: Option<Spanned<usize>>,
    pub(super) url: Option<String>,
    pub(super) nodes: Option<Vec<String>>,
    /// The primary Redis Sentinel names.
    pub(super) sentinel: Option<Spanned<SentinelSection>>,
    pub(super) prefix: Option<String>,
    pub(super) timeout_ms: Option<u64>,
    /// Time without a reply, with calls waiting, that declares Redis stalled; 0: never.
    pub(super) stall_after_ms: Option<u64>,
    pub(super) breaker: Option<Spanned<Switch<BreakerSection>>>,
    pub(super) local_fallback: Option<Spanned<Switch<f64>>>,
    pub(super) leases: Option<Spanned<Switch<LeaseSection>>>,
}

/// `[store.sentinel]`: the sentinels, the name they monitor, the primary's login.
#[derive(Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct SentinelSection {
    pub(super) master: String,
    pub(super) nodes: Vec<String>,
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
    pub(super) db: Option<i64>,
    pub(super) tls: Option<bool>,
}

/// Without the password, and the sentinels' URLs (which may hold theirs).
impl std::fmt::Debug for SentinelSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelSection")
            .field("master", &self.master)
            .field("nodes", &self.nodes.len())
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("db", &self.db)
            .field("tls", &self.tls)
            .finish()
    }
}

/// A setting that is `false` (off), `true` (on, the defaults) or its settings.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub(super) enum Switch<T> {
    Toggle(bool),
    Set(T),
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct LeaseSection {
    pub(super) horizon_ms: Option<u64>,
    pub(super) min_units: Option<u64>,
    pub(super) max_share: Option<f64>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct BreakerSection {
    pub(super) threshold: Option<u32>,
    pub(super) cool_down_ms: Option<u64>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct LayerSection {
    pub(super) default: Spanned<String>,
    pub(super) headers: Option<Spanned<String>>,
    pub(super) protocol: Option<Spanned<String>>,
    pub(super) on_store_error: Option<Spanned<String>>,
    pub(super) missing_key: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) shadow: bool,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct KeySection {
    pub(super) api_key: Option<ApiKeySection>,
    pub(super) client_ip: Option<Spanned<ClientIpSection>>,
    pub(super) ipv6_prefix: Option<Spanned<u8>>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct ApiKeySection {
    pub(super) header: Spanned<String>,
    /// Only the keys in `[tiers]`: any other value is no key.
    #[serde(default = "yes")]
    pub(super) only_known: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct ClientIpSection {
    pub(super) header: Spanned<String>,
    pub(super) trusted_proxies: Vec<Spanned<String>>,
    pub(super) trusted_hops: Option<Spanned<usize>>,
    /// Where the counted proxies are (`ClientIp::hops_through`).
    pub(super) hops_through: Option<Spanned<Vec<Spanned<String>>>>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct PolicySection {
    pub(super) algorithm: Spanned<String>,
    pub(super) limit: Spanned<i64>,
    pub(super) period: Spanned<String>,
    /// The time zone of a calendar period (`UTC` if unsaid).
    pub(super) zone: Option<Spanned<String>>,
    pub(super) burst: Option<Spanned<i64>>,
    #[serde(default)]
    pub(super) shadow: bool,
    /// A cost of its own, read from a request header.
    pub(super) cost: Option<Spanned<CostSection>>,
    /// Reserve, then settle to what the call used.
    pub(super) settle: Option<Spanned<SettleSection>>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct CostSection {
    /// The request header whose number is the cost.
    pub(super) header: Spanned<String>,
    /// The cost when the header is missing or not a number (`min` if unsaid).
    pub(super) default: Option<Spanned<i64>>,
    /// The least a request costs, whatever the header says (1 if unsaid).
    pub(super) min: Option<Spanned<i64>>,
    /// The most a request costs, whatever the header says (none if unsaid).
    pub(super) max: Option<Spanned<i64>>,
    /// `gateway` (a layer before tollway writes the header) or `client`.
    pub(super) written_by: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct SettleSection {
    /// The response header whose number is what the call used; without it, only the
    /// handler reports (`Usage`).
    pub(super) header: Option<Spanned<String>>,
    /// `keep` (the default) or `refund`: what an unreported call's reservation becomes.
    pub(super) unsettled: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct RouteSection {
    pub(super) path: Option<Spanned<String>>,
    pub(super) grpc_method: Option<Spanned<String>>,
    pub(super) method: Option<Spanned<String>>,
    pub(super) policy: Spanned<String>,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct ListsSection {
    #[serde(default)]
    pub(super) allow_networks: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) deny_networks: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) allow_keys: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) deny_keys: Vec<Spanned<String>>,
}

/// The most parts a key of the file has (`policies.api.limit`, `store.breaker.threshold`).
pub(super) const DEPTH: usize = 3;
