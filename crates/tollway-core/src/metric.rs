//! Every metric tollway records: its name, type, labels and meaning, in one place.
//!
//! The stores (feature `metrics` here) and the tower layer (feature `metrics` of
//! `tollway-tower`) record through the [`metrics`](https://docs.rs/metrics) facade, by
//! these names. [`ALL`] lists them for a dashboard or an alert rule.
//!
//! ```
//! use tollway_core::metric::{self, Kind};
//!
//! assert_eq!(metric::DECISIONS.name, "tollway_decisions_total");
//! assert_eq!(metric::DECISIONS.kind, Kind::Counter);
//! assert!(metric::ALL.iter().all(|m| m.name.starts_with("tollway_")));
//! ```

/// What a metric is: its name, its type, its labels and what it counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metric {
    /// The name, as Prometheus shows it.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// The labels it carries.
    pub labels: &'static [&'static str],
    /// What it means (the help text).
    pub help: &'static str,
}

/// The type of a [`Metric`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution of values, in seconds.
    Histogram,
}

/// Units a [`Leased`](crate::Leased) store took, spent and lost (core, `metrics` and
/// `leases`).
pub const LEASE_UNITS: Metric = Metric {
    name: "tollway_lease_units_total",
    kind: Kind::Counter,
    labels: &["event"],
    help: "Units of leases: lent by the shared store, spent here, given back, or gone bad unspent (event: lent, spent, returned, expired)",
};

/// Where a [`Leased`](crate::Leased) store decided its hot and cold keys' requests
/// (core, `metrics` and `leases`).
pub const LEASE_DECISIONS: Metric = Metric {
    name: "tollway_lease_decisions_total",
    kind: Kind::Counter,
    labels: &["where"],
    help: "Requests a leasing store decided here from a lease (local) or by a call to the shared store (store)",
};

/// Requests the layer decided (tower, `metrics`).
pub const DECISIONS: Metric = Metric {
    name: "tollway_decisions_total",
    kind: Kind::Counter,
    labels: &["policy", "outcome"],
    help: "Requests the rate limiter decided, by the policy it reported and the outcome",
};

/// Slots of calls in flight the layer holds, by policy (tower, `metrics`): see
/// [`Algorithm::Concurrency`](crate::Algorithm::Concurrency).
pub const IN_FLIGHT: Metric = Metric {
    name: "tollway_in_flight",
    kind: Kind::Gauge,
    labels: &["policy"],
    help: "Slots of calls in flight this layer holds (taken at admission, given back when the response ends)",
};

/// The load shedder's limit on the service's calls in flight (tower, `metrics`): see
/// tollway-tower's `shed` module.
pub const SHED_LIMIT: Metric = Metric {
    name: "tollway_shed_limit",
    kind: Kind::Gauge,
    labels: &[],
    help: "The load shedder's adaptive limit on the service's calls in flight",
};

/// Calls in flight through the load shedder, by priority (tower, `metrics`).
pub const SHED_IN_FLIGHT: Metric = Metric {
    name: "tollway_shed_in_flight",
    kind: Kind::Gauge,
    labels: &["priority"],
    help: "Calls the load shedder admitted whose responses have not come yet, by priority",
};

/// Requests the load shedder refused, or in shadow mode would have refused (tower,
/// `metrics`).
pub const SHED: Metric = Metric {
    name: "tollway_shed_total",
    kind: Kind::Counter,
    labels: &["priority", "shadow"],
    help: "Requests the load shedder refused with 503 (shadow=true: let through in shadow mode, would have been refused)",
};

/// Calls settled after their responses, by how (tower, `metrics`).
pub const SETTLEMENTS: Metric = Metric {
    name: "tollway_settlements_total",
    kind: Kind::Counter,
    labels: &["policy", "settled"],
    help: "Calls settled after their responses (settled: charged, used more than reserved; refunded, used less; exact; kept or given back, nothing reported)",
};

/// How long a call to a remote store took (core, `metrics` and `redis`).
pub const STORE_DURATION: Metric = Metric {
    name: "tollway_store_duration_seconds",
    kind: Kind::Histogram,
    labels: &["store"],
    help: "How long a call to the rate limiter's remote store took",
};

/// Refusals answered from the Redis store's deny cache (core, `metrics` and `redis`).
pub const DENY_CACHE_HITS: Metric = Metric {
    name: "tollway_deny_cache_hits_total",
    kind: Kind::Counter,
    labels: &[],
    help: "Refusals the Redis store answered from its local deny cache",
};

/// A store's circuit breaker: 0 closed, 1 half-open, 2 open (core, `metrics`).
pub const BREAKER_STATE: Metric = Metric {
    name: "tollway_breaker_state",
    kind: Kind::Gauge,
    labels: &["store"],
    help: "The store's circuit breaker: 0 closed, 1 half-open, 2 open",
};

/// Keys the memory store holds (core, `metrics`).
pub const MEMORY_STORE_KEYS: Metric = Metric {
    name: "tollway_memory_store_keys",
    kind: Kind::Gauge,
    labels: &[],
    help: "Keys the memory store holds, idle ones not yet swept included",
};

/// Tier lookups refused before they reached the backend (tower, `metrics`).
pub const TIER_LOOKUPS_REFUSED: Metric = Metric {
    name: "tollway_tier_lookups_refused_total",
    kind: Kind::Counter,
    labels: &["reason"],
    help: "Tier lookups refused before they reached the backend, by reason",
};

/// Limits files applied (tower, `config` and `metrics`).
pub const CONFIG_RELOADS: Metric = Metric {
    name: "tollway_config_reloads_total",
    kind: Kind::Counter,
    labels: &[],
    help: "Limits files applied by a reload",
};

/// Limits files that failed to load (tower, `config` and `metrics`).
pub const CONFIG_RELOAD_ERRORS: Metric = Metric {
    name: "tollway_config_reload_errors_total",
    kind: Kind::Counter,
    labels: &[],
    help: "Limits files that failed to load; the running limits stayed",
};

/// The live limits file: 1 for its version, 0 for the one it replaced (tower).
pub const CONFIG_INFO: Metric = Metric {
    name: "tollway_config_info",
    kind: Kind::Gauge,
    labels: &["version"],
    help: "The live limits file's version (a hash of its bytes): 1 live, 0 replaced",
};

/// When the live limits file was loaded (tower, `config` and `metrics`).
pub const CONFIG_LOADED: Metric = Metric {
    name: "tollway_config_loaded_timestamp_seconds",
    kind: Kind::Gauge,
    labels: &[],
    help: "When the live limits file was loaded, in Unix seconds",
};

/// Envoy rate limit requests tollway-server refused unread, past a bound (server).
pub const RLS_REFUSED: Metric = Metric {
    name: "tollway_rls_requests_refused_total",
    kind: Kind::Counter,
    labels: &["reason"],
    help: "Rate limit requests refused before any store call: descriptors, entries, key_bytes, value_bytes or message_bytes past their bound; buckets, a quota stream's past its bound",
};

/// Descriptors tollway-server decided, by policy (server).
pub const RLS_DECISIONS: Metric = Metric {
    name: "tollway_rls_decisions_total",
    kind: Kind::Counter,
    labels: &["policy", "outcome"],
    help: "Descriptors the Envoy rate limit service decided, by the file's policy and outcome: allowed, limited, shadow_limited",
};

/// Descriptors allowed with under a fifth of their policy's capacity left (server).
pub const RLS_NEAR_LIMIT: Metric = Metric {
    name: "tollway_rls_near_limit_total",
    kind: Kind::Counter,
    labels: &["policy"],
    help: "Descriptors the Envoy rate limit service allowed with under a fifth of the policy's capacity left",
};

/// New token buckets tollway-server assigned to Envoys' quota buckets (server).
pub const RLQS_BUCKETS: Metric = Metric {
    name: "tollway_rlqs_buckets_total",
    kind: Kind::Counter,
    labels: &["policy"],
    help: "Token buckets the rate limit quota service assigned anew (each starts full), by the file's policy",
};

/// Requests Envoys reported deciding from their assignments (server).
pub const RLQS_REPORTED: Metric = Metric {
    name: "tollway_rlqs_reported_requests_total",
    kind: Kind::Counter,
    labels: &["policy", "outcome"],
    help: "Requests Envoys reported to the rate limit quota service, by the file's policy and outcome: allowed, denied",
};

/// Quota buckets tollway-server told Envoy to abandon, by why (server).
pub const RLQS_ABANDONED: Metric = Metric {
    name: "tollway_rlqs_buckets_abandoned_total",
    kind: Kind::Counter,
    labels: &["reason"],
    help: "Quota buckets the rate limit quota service told an Envoy to abandon: idle, unknown (no rule), bounds (an id past them), evicted (the quietest, for a new bucket past a stream's cap)",
};

/// Quota streams that ended on an error, by why (server).
pub const RLQS_STREAMS_ENDED: Metric = Metric {
    name: "tollway_rlqs_streams_ended_total",
    kind: Kind::Counter,
    labels: &["reason"],
    help: "Rate limit quota streams that ended on an error: message_bytes (a report past the bound), streams (past the server's or a connection's), domain, broken (the connection failed), unread (Envoy read no answer)",
};

/// Connections tollway-server closed or refused to keep its ports up (server).
pub const CONNECTIONS_DROPPED: Metric = Metric {
    name: "tollway_server_connections_dropped_total",
    kind: Kind::Counter,
    labels: &["port", "reason"],
    help: "Connections a tollway-server port closed before serving them: handshake (no TLS handshake or HTTP/2 preface in time), evicted (the oldest unfinished handshake, for a new one), full (at the connection cap), accept (the process out of descriptors)",
};

/// Stalls the Redis store declared: no reply for a while with calls waiting (core).
pub const STORE_STALLS: Metric = Metric {
    name: "tollway_store_stalls_total",
    kind: Kind::Counter,
    labels: &[],
    help: "Stalls the Redis store declared: no reply of any call for stall_after while calls waited; they failed at once",
};

/// Primaries the Redis store found through Sentinel: its first, and one after each
/// failover or lost connection (core).
pub const SENTINEL_RESOLVED: Metric = Metric {
    name: "tollway_store_sentinel_resolved_total",
    kind: Kind::Counter,
    labels: &[],
    help: "Connections the Redis store made to the primary Sentinel named: the first, then one after each failover or lost connection",
};

/// Every metric, in the order above.
pub const ALL: &[Metric] = &[
    DECISIONS,
    IN_FLIGHT,
    SETTLEMENTS,
    SHED_LIMIT,
    SHED_IN_FLIGHT,
    SHED,
    STORE_DURATION,
    DENY_CACHE_HITS,
    BREAKER_STATE,
    MEMORY_STORE_KEYS,
    LEASE_UNITS,
    LEASE_DECISIONS,
    TIER_LOOKUPS_REFUSED,
    CONFIG_RELOADS,
    CONFIG_RELOAD_ERRORS,
    CONFIG_INFO,
    CONFIG_LOADED,
    RLS_REFUSED,
    RLS_DECISIONS,
    RLS_NEAR_LIMIT,
    RLQS_BUCKETS,
    RLQS_REPORTED,
    RLQS_ABANDONED,
    RLQS_STREAMS_ENDED,
    CONNECTIONS_DROPPED,
    STORE_STALLS,
    SENTINEL_RESOLVED,
];

/// Tells the installed recorder every metric's type and help text.
///
/// The tower layer calls it when built; call it yourself when you use a store alone.
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub fn describe() {
    for m in ALL {
        match m.kind {
            Kind::Counter => metrics::describe_counter!(m.name, m.help),
            Kind::Gauge => metrics::describe_gauge!(m.name, m.help),
            Kind::Histogram => {
                metrics::describe_histogram!(m.name, metrics::Unit::Seconds, m.help);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prometheus_shaped() {
        let mut names: Vec<&str> = ALL.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
        for m in ALL {
            let suffix_ok = match m.kind {
                Kind::Counter => m.name.ends_with("_total"),
                Kind::Histogram => m.name.ends_with("_seconds"),
                Kind::Gauge => !m.name.ends_with("_total"),
            };
            assert!(suffix_ok, "{}", m.name);
            assert!(m.name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'));
        }
    }
}
