//! `ShouldRateLimit`: a request's descriptors, decided all or nothing by the file's
//! policies, in the store the file names.

use std::borrow::Cow;
use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use futures_util::future::join_all;
use tollway_core::{BoxStore, CalendarUnit, Decision, Operation, Policy, Quota, Store, StoreError};
use tollway_tower::config::{ConfigKey, LimitsFile};
use tollway_tower::{
    DecisionOutcome, HeaderStyle, OnStoreError, RateLimitLayer, Verdict, rate_limit_headers,
};

use crate::descriptors::{Descriptors, Matched};
use tonic::{Request, Response, Status};

/// The most a request may carry, far past what Envoy sends: a descriptor for each rate
/// limit of the route and its virtual host (a handful), an entry for each action of one
/// (a few), keys from Envoy's configuration, and values of request headers, which Envoy
/// caps at 60 KiB for all of a request's headers unless told otherwise
/// (`max_request_headers_kb`). A request past one is refused `INVALID_ARGUMENT` before
/// the store is asked, and counted (`tollway_rls_requests_refused_total`).
pub mod bounds {
    /// Descriptors a request.
    pub const DESCRIPTORS: usize = 64;
    /// Entries a descriptor.
    pub const ENTRIES: usize = 16;
    /// Bytes of the domain, and of an entry's key.
    pub const KEY_BYTES: usize = 256;
    /// Bytes of an entry's value.
    pub const VALUE_BYTES: usize = 65_536;
    /// Bytes of a whole request, as gRPC decodes it: past it, the message is refused
    /// unread.
    pub const MESSAGE_BYTES: usize = 4 << 20;
}

/// The rate limit service with its messages bounded at [`bounds::MESSAGE_BYTES`].
///
/// gRPC refuses a longer message `OUT_OF_RANGE` before the service reads it. This says
/// `INVALID_ARGUMENT` instead, as for every other bound, and counts it (`message_bytes`).
/// The service never answers `OUT_OF_RANGE` itself.
#[derive(Clone, Debug)]
pub(crate) struct Bounded<S>(S);

impl Bounded<rate_limit_service_server::RateLimitServiceServer<RateLimitService>> {
    /// `service`, bounded.
    pub(crate) fn new(service: RateLimitService) -> Self {
        Bounded(
            rate_limit_service_server::RateLimitServiceServer::new(service)
                .max_decoding_message_size(bounds::MESSAGE_BYTES),
        )
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Bounded<S> {
    const NAME: &'static str = S::NAME;
}

type GrpcResponse = http::Response<tonic::body::Body>;

impl<S> tonic::codegen::Service<http::Request<tonic::body::Body>> for Bounded<S>
where
    S: tonic::codegen::Service<http::Request<tonic::body::Body>, Response = GrpcResponse>,
{
    type Response = GrpcResponse;
    type Error = S::Error;
    type Future = futures_util::future::MapOk<S::Future, fn(GrpcResponse) -> GrpcResponse>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        use futures_util::TryFutureExt;
        self.0.call(request).map_ok(past_message_bytes)
    }
}

/// `response`, or `INVALID_ARGUMENT` when gRPC refused the message as too long.
fn past_message_bytes(response: GrpcResponse) -> GrpcResponse {
    let too_long = response
        .extensions()
        .get::<Status>()
        .is_some_and(|status| status.code() == tonic::Code::OutOfRange);
    if !too_long {
        return response;
    }
    metrics::counter!(tollway_core::metric::RLS_REFUSED.name, "reason" => "message_bytes")
        .increment(1);
    Status::invalid_argument(format!(
        "a rate limit request past tollway-server's bounds: a message of at most {} bytes",
        bounds::MESSAGE_BYTES
    ))
    .into_http()
}

/// Why a request is past [`bounds`]: its reason (a metric label) and what it says.
fn out_of_bounds(request: &RateLimitRequest) -> Option<(&'static str, String)> {
    use bounds::{DESCRIPTORS, ENTRIES, KEY_BYTES, VALUE_BYTES};
    if request.descriptors.len() > DESCRIPTORS {
        let n = request.descriptors.len();
        return Some((
            "descriptors",
            format!("{n} descriptors: at most {DESCRIPTORS}"),
        ));
    }
    if request.domain.len() > KEY_BYTES {
        return Some((
            "key_bytes",
            format!("a domain of at most {KEY_BYTES} bytes"),
        ));
    }
    for descriptor in &request.descriptors {
        if descriptor.entries.len() > ENTRIES {
            let n = descriptor.entries.len();
            return Some((
                "entries",
                format!("a descriptor of {n} entries: at most {ENTRIES}"),
            ));
        }
        for entry in &descriptor.entries {
            if entry.key.len() > KEY_BYTES {
                return Some((
                    "key_bytes",
                    format!("an entry's key of at most {KEY_BYTES} bytes"),
                ));
            }
            if entry.value.len() > VALUE_BYTES {
                return Some((
                    "value_bytes",
                    format!("an entry's value of at most {VALUE_BYTES} bytes"),
                ));
            }
        }
    }
    None
}

/// What a file says the service does: its descriptors, headers and what to answer when
/// the store fails. Swapped whole on a reload.
#[derive(Debug)]
pub struct Rules {
    descriptors: Descriptors,
    style: HeaderStyle,
    on_error: OnStoreError,
}

impl Rules {
    /// The rules of `file`.
    ///
    /// # Errors
    ///
    /// Never for a file that [`LimitsFile::parse`] accepted.
    pub fn from_file(file: &LimitsFile) -> Result<Self, tollway_core::ConfigError> {
        Ok(Rules {
            descriptors: Descriptors::new(file.descriptors()?),
            style: file.header_style(),
            on_error: file.on_store_error(),
        })
    }
}

/// The rate limit service: Envoy's `RateLimitService` over the file's limits and the live
/// rules.
///
/// The limits are a layer's ([`RateLimitLayer`]): its store, its shadow switches (the
/// file's, and any switched at run time), its decision counters and its clock. So the
/// service counts and shadows exactly as the layer does. Clones share all of it.
#[derive(Clone)]
pub struct RateLimitService {
    limits: RateLimitLayer<BoxStore, ConfigKey>,
    store: BoxStore,
    rules: Arc<ArcSwap<Rules>>,
}

impl std::fmt::Debug for RateLimitService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitService")
            .field("rules", &self.rules.load())
            .finish_non_exhaustive()
    }
}

/// One descriptor of a request: what limits it, under which key, at what cost.
// A request has a few plans, kept for its life: boxing the policy would allocate for
// each one limited.
#[allow(clippy::large_enum_variant)]
enum Plan<'r> {
    /// No rule: allowed, unlimited, as envoyproxy/ratelimit answers.
    Unknown,
    Unlimited,
    Limited {
        /// The file's policy, or the one the descriptor's `limit` asks for.
        policy: Cow<'r, Policy>,
        key: tollway_tower::Key,
        cost: u64,
        /// Envoy's `is_negative_hits`: `cost` is given back (a settlement), not taken.
        back: bool,
        /// The rule's `shadow_mode`: decided and counted, never refused.
        shadow: bool,
    },
}

/// What the store said of one limited descriptor.
enum Said {
    Decided(Decision),
    /// Admitted, then given back: another descriptor refused the request.
    Refunded(Decision),
    /// The store failed and the file fails open: allowed, no status.
    Open,
}

/// Whether to look at the limits or decide them.
#[derive(Clone, Copy)]
enum Ask {
    Look,
    Check,
}

/// Whether a limit that enforces refuses the request.
fn refuses(limits: &Limits, plans: &[Plan<'_>], saids: &[Option<Said>]) -> bool {
    plans
        .iter()
        .zip(saids)
        .any(|(plan, said)| match (plan, said) {
            (
                Plan::Limited {
                    policy,
                    back: false,
                    shadow,
                    ..
                },
                Some(Said::Decided(d)),
            ) => !d.is_allowed() && !*shadow && !in_shadow(limits, policy),
            _ => false,
        })
}

/// The limits a service decides by.
type Limits = RateLimitLayer<BoxStore, ConfigKey>;

/// Whether `policy` is in shadow mode, the whole layer or the policy: as the layer says,
/// run-time switches included.
fn in_shadow(limits: &Limits, policy: &Policy) -> bool {
    limits.is_shadow(None) || limits.is_shadow(Some(policy.name()))
}

impl RateLimitService {
    /// A service deciding by `limits` (its store, shadow switches, counters and clock)
    /// and `rules` (which [`set_rules`](Self::set_rules) swaps).
    #[must_use]
    pub fn new(limits: RateLimitLayer<BoxStore, ConfigKey>, rules: Rules) -> Self {
        RateLimitService {
            store: limits.store(),
            limits,
            rules: Arc::new(ArcSwap::from_pointee(rules)),
        }
    }

    /// Puts `rules` in force for the next request (a reload).
    pub fn set_rules(&self, rules: Rules) {
        self.rules.store(Arc::new(rules));
    }

    /// The store, for a readiness probe.
    #[must_use]
    pub fn store(&self) -> &BoxStore {
        &self.store
    }

    /// Decides `request`: every descriptor it carries, all or nothing.
    ///
    /// # Examples
    ///
    /// ```
    /// use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    /// use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    /// use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    /// use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    /// use tollway_core::{BoxStore, MemoryStore};
    /// use tollway_server::{RateLimitService, Rules};
    /// use tollway_tower::config::LimitsFile;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let file = LimitsFile::parse("limits.toml", r#"
    /// [layer]
    /// default = "per_address"
    ///
    /// [policies.per_address]
    /// algorithm = "fixed_window"
    /// limit = 1
    /// period = "1m"
    ///
    /// [[descriptors]]
    /// domain = "edge"
    /// entries = [{ key = "remote_address" }]
    /// policy = "per_address"
    /// "#)?;
    /// let limits = file.layer(BoxStore::new(MemoryStore::new()), file.key()?)?;
    /// let service = RateLimitService::new(limits, Rules::from_file(&file)?);
    /// let entry = Entry { key: "remote_address".into(), value: "203.0.113.9".into() };
    /// let request = RateLimitRequest {
    ///     domain: "edge".into(),
    ///     descriptors: vec![RateLimitDescriptor { entries: vec![entry], ..Default::default() }],
    ///     hits_addend: 1,
    /// };
    /// assert_eq!(service.decide(&request).await?.overall_code, Code::Ok as i32);
    /// assert_eq!(service.decide(&request).await?.overall_code, Code::OverLimit as i32);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// `INVALID_ARGUMENT` for a request without a domain or descriptors, or past one of
    /// the [`bounds`]; `UNAVAILABLE` when the store fails and the file says `on_store_error = "reject"`
    /// (Envoy's `failure_mode_deny` then decides).
    pub async fn decide(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        if request.domain.is_empty() {
            return Err(Status::invalid_argument(
                "a rate limit request names its domain",
            ));
        }
        if request.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "a rate limit request carries at least one descriptor",
            ));
        }
        if let Some((reason, bound)) = out_of_bounds(request) {
            metrics::counter!(tollway_core::metric::RLS_REFUSED.name, "reason" => reason)
                .increment(1);
            return Err(Status::invalid_argument(format!(
                "a rate limit request past tollway-server's bounds: {bound}"
            )));
        }
        let rules = self.rules.load();
        let matched: Vec<Option<Matched<'_>>> = request
            .descriptors
            .iter()
            .map(|d| {
                let entries: Vec<(&str, &str)> = d
                    .entries
                    .iter()
                    .map(|e| (e.key.as_str(), e.value.as_str()))
                    .collect();
                rules.descriptors.find(&request.domain, &entries)
            })
            .collect();
        // A matched rule's `replaces` skips the named rules' limits for this request.
        let replaced: Vec<&str> = matched
            .iter()
            .flatten()
            .flat_map(|m| m.replaces.iter().map(String::as_str))
            .collect();
        let plans: Vec<Plan<'_>> = request
            .descriptors
            .iter()
            .zip(matched)
            .map(|(d, matched)| match matched {
                Some(m) if m.name.is_some_and(|name| replaced.contains(&name)) => Plan::Unknown,
                Some(m) => plan(m, d, request.hits_addend),
                None => Plan::Unknown,
            })
            .collect();
        let limited = plans
            .iter()
            .filter(|p| matches!(p, Plan::Limited { .. }))
            .count();
        // Several limits: look first, so that a refusal charges none of them. A store that
        // cannot look now is asked to decide, and its failure answered there.
        if limited > 1 {
            let looked = self.ask(&plans, Ask::Look).await;
            if looked.iter().all(Result::is_ok) {
                let looked: Vec<Option<Said>> = looked.into_iter().flatten().collect();
                if refuses(&self.limits, &plans, &looked) {
                    return Ok(self.respond(&rules, &plans, &looked, true));
                }
            }
        }
        let said = self.ask(&plans, Ask::Check).await;
        let mut failed = None;
        let mut saids: Vec<Option<Said>> = Vec::with_capacity(said.len());
        for said in said {
            match said {
                Ok(said) => saids.push(said),
                Err(error) => {
                    failed.get_or_insert(error);
                    saids.push(Some(Said::Open));
                }
            }
        }
        if let Some(error) = failed {
            if rules.on_error == OnStoreError::Reject {
                tracing::warn!(%error, "the store failed; refusing as the file says");
                self.refund(&plans, &saids).await;
                return Err(Status::unavailable("rate limiting is unavailable"));
            }
            tracing::warn!(%error, "the store failed; allowing as the file says");
        }
        // Refused by a limit that enforces (a race with another request since the look):
        // every other descriptor's charge is given back.
        let refused = refuses(&self.limits, &plans, &saids);
        if refused {
            self.refund(&plans, &saids).await;
            for said in &mut saids {
                if let Some(Said::Decided(d)) = said
                    && d.is_allowed()
                {
                    *said = Some(Said::Refunded(*d));
                }
            }
        }
        Ok(self.respond(&rules, &plans, &saids, refused))
    }

    /// Asks the store about every limited descriptor at once: to look, or to decide.
    async fn ask(&self, plans: &[Plan<'_>], ask: Ask) -> Vec<Result<Option<Said>, StoreError>> {
        let asks = plans.iter().map(|plan| async move {
            let Plan::Limited {
                policy,
                key,
                cost,
                back,
                ..
            } = plan
            else {
                return Ok(None);
            };
            let key = key.as_bytes();
            // A give-back refuses nothing: it looks at nothing, and is given once.
            let operation = match (ask, back) {
                (Ask::Check, false) => None,
                (Ask::Check, true) => Some(Operation::Refund(*cost)),
                (Ask::Look, false) => Some(Operation::Peek(*cost)),
                (Ask::Look, true) => Some(Operation::Peek(0)),
            };
            let decisions = match operation {
                None => self.store.check(key, &[policy], *cost).await?,
                Some(operation) => self.store.operate(key, &[policy], operation).await?,
            };
            Ok(decisions.first().copied().map(Said::Decided))
        });
        join_all(asks).await
    }

    /// Gives back what the admitted descriptors were charged.
    async fn refund(&self, plans: &[Plan<'_>], saids: &[Option<Said>]) {
        let refunds = plans
            .iter()
            .zip(saids)
            .filter_map(|(plan, said)| match (plan, said) {
                (
                    Plan::Limited {
                        policy,
                        key,
                        cost,
                        back: false,
                        ..
                    },
                    Some(Said::Decided(d)),
                ) if d.is_allowed() && *cost > 0 => {
                    let operation = Operation::Refund(*cost);
                    Some(
                        self.store
                            .operate(key.as_bytes(), &[policy], operation)
                            .into_future(),
                    )
                }
                _ => None,
            });
        for refunded in join_all(refunds).await {
            if let Err(error) = refunded {
                tracing::warn!(%error, "a refund of an all-or-nothing refusal failed");
            }
        }
    }
}

/// Counts a descriptor's decision by its policy (the file's names: a bounded set), and
/// an allowed one that leaves under a fifth of the capacity as near its limit.
fn count(policy: &Policy, decision: &Decision, outcome: DecisionOutcome) {
    use tollway_core::metric::{RLS_DECISIONS, RLS_NEAR_LIMIT};
    let name = policy.name().to_owned();
    let label = match outcome {
        DecisionOutcome::Allowed => "allowed",
        DecisionOutcome::Limited => "limited",
        _ => "shadow_limited",
    };
    metrics::counter!(RLS_DECISIONS.name, "policy" => name.clone(), "outcome" => label)
        .increment(1);
    if decision.is_allowed() && decision.remaining() * 5 < decision.limit() {
        metrics::counter!(RLS_NEAR_LIMIT.name, "policy" => name).increment(1);
    }
}

/// Envoy's units of time, in seconds, shortest first: a month is 30 days, a year 365.
const UNITS: [(u64, Unit); 7] = [
    (1, Unit::Second),
    (60, Unit::Minute),
    (3_600, Unit::Hour),
    (86_400, Unit::Day),
    (7 * 86_400, Unit::Week),
    (30 * 86_400, Unit::Month),
    (365 * 86_400, Unit::Year),
];

/// The policy a descriptor's `limit` asks for instead of `policy`: its name and algorithm
/// at `requests_per_unit` a unit (a month is 30 days, a year 365), burst the limit.
///
/// Envoy sends `limit` when a route's rate limit action says so, often from a request's
/// dynamic metadata: whoever can set that chooses the limit (see the crate docs). Under
/// the same period as the file's policy, a caller keeps what it used: the limit is an
/// argument, not part of the state's identity. `None` for no `limit`, or one that cannot
/// be a policy (0, an unknown unit, numbers the algorithm cannot keep exact): the file's
/// policy then decides.
fn overridden(policy: &Policy, limit: Option<&RateLimitOverride>) -> Option<Policy> {
    let limit = limit?;
    // `RateLimitUnit` numbers its units as the response's `Unit` does.
    let &(secs, _) = UNITS.iter().find(|&&(_, unit)| unit as i32 == limit.unit)?;
    let quota = Quota::with_period(limit.requests_per_unit.into(), Duration::from_secs(secs));
    let own = quota.and_then(|quota| Policy::new(policy.name(), policy.algorithm(), quota));
    match own {
        Ok(own) => Some(own),
        Err(error) => {
            tracing::debug!(%error, policy = policy.name(), "a descriptor's limit is not a policy");
            None
        }
    }
}

/// How `descriptor`, which matched a rule as `matched` says, is limited.
fn plan<'r>(matched: Matched<'r>, descriptor: &RateLimitDescriptor, request_hits: u32) -> Plan<'r> {
    let Some(policy) = matched.policy else {
        return Plan::Unlimited;
    };
    let policy = match overridden(policy, descriptor.limit.as_ref()) {
        Some(own) => Cow::Owned(own),
        None => Cow::Borrowed(policy),
    };
    // A give-back gives its own hits. A charge: the rule's hits entry if it has one
    // (never the descriptor's hits, which a format may drop or zero); else the
    // descriptor's own hits (0 is a look), else the request's, at least 1. At least the
    // rule's floor, at most its cap.
    let back = descriptor.is_negative_hits;
    let own = descriptor.hits_addend.as_ref().map(|h| h.value);
    let cost = match matched.entry_hits {
        Some(hits) if !back => hits,
        _ => own.unwrap_or(u64::from(request_hits.max(1))),
    };
    let cost = match matched.min_hits {
        Some(min) if !back => cost.max(min),
        _ => cost,
    };
    let cost = matched.max_hits.map_or(cost, |max| cost.min(max));
    Plan::Limited {
        policy,
        key: matched.key,
        cost,
        back: descriptor.is_negative_hits,
        shadow: matched.shadow,
    }
}

impl RateLimitService {
    /// The response: one status a descriptor, the overall code, and the headers the
    /// layer would write. Each decision is told as the layer tells its own.
    fn respond(
        &self,
        rules: &Rules,
        plans: &[Plan<'_>],
        saids: &[Option<Said>],
        refused: bool,
    ) -> RateLimitResponse {
        let mut verdicts = Vec::new();
        let statuses = plans
            .iter()
            .zip(saids)
            .map(|(plan, said)| match (plan, said) {
                // A give-back is no decision: not told, no headers, never over.
                (
                    Plan::Limited {
                        policy, back: true, ..
                    },
                    Some(Said::Decided(decision) | Said::Refunded(decision)),
                ) => DescriptorStatus {
                    code: Code::Ok as i32,
                    current_limit: Some(current_limit(policy)),
                    limit_remaining: u32::try_from(decision.remaining()).unwrap_or(u32::MAX),
                    duration_until_reset: Some(proto_duration(decision.reset_after())),
                    ..Default::default()
                },
                (
                    Plan::Limited {
                        policy,
                        key,
                        shadow,
                        ..
                    },
                    Some(Said::Decided(decision) | Said::Refunded(decision)),
                ) => {
                    let shadow = *shadow || in_shadow(&self.limits, policy);
                    let over = !decision.is_allowed() && !shadow;
                    let verdict = Verdict {
                        policy,
                        decision: *decision,
                    };
                    let outcome = match (decision.is_allowed(), over) {
                        (true, _) => DecisionOutcome::Allowed,
                        (false, true) => DecisionOutcome::Limited,
                        (false, false) => DecisionOutcome::ShadowLimited,
                    };
                    count(policy, decision, outcome);
                    self.limits.tell(key, verdict, outcome);
                    // A limit in shadow mode says nothing to the client, as in the layer.
                    if !shadow {
                        verdicts.push(verdict);
                    }
                    DescriptorStatus {
                        code: if over { Code::OverLimit } else { Code::Ok } as i32,
                        current_limit: Some(current_limit(policy)),
                        limit_remaining: u32::try_from(decision.remaining()).unwrap_or(u32::MAX),
                        duration_until_reset: Some(proto_duration(decision.reset_after())),
                        ..Default::default()
                    }
                }
                (Plan::Unlimited, _) => DescriptorStatus {
                    code: Code::Ok as i32,
                    limit_remaining: u32::MAX,
                    ..Default::default()
                },
                _ => DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                },
            })
            .collect();
        let now = self.limits.wall_clock().now_micros();
        let headers = rate_limit_headers(rules.style, &verdicts, now);
        let response_headers_to_add = headers
            .iter()
            .filter_map(|(name, value)| {
                Some(HeaderValue {
                    key: name.as_str().to_owned(),
                    value: value.to_str().ok()?.to_owned(),
                    ..Default::default()
                })
            })
            .collect();
        RateLimitResponse {
            overall_code: if refused { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            response_headers_to_add,
            ..Default::default()
        }
    }
}

/// A policy's limit in Envoy's terms: so many a second, minute, hour, day, week, month
/// or year, never more than the policy allows in that unit's time. A calendar policy's
/// is its limit a calendar unit.
///
/// The unit is the longest one no longer than the period in which at least one request
/// passes and the count fits Envoy's 32 bits, the count rounded down: 100 per 90 s is
/// 66 a minute; 10^10 a 31-day month is 2,258,064,516 a week. When every such unit is
/// too short (5 per 10 s is half a request a second), the next unit up, its count cut to
/// the burst: 5 a minute. Envoy reads the count as what passes in one unit's window, so a
/// count above the burst would promise a burst the policy never grants.
fn current_limit(policy: &Policy) -> RateLimit {
    let quota = policy.quota();
    // A calendar's unit is Envoy's own, when its count fits.
    if let Some(calendar) = quota.calendar()
        && let Ok(per_unit) = u32::try_from(quota.limit())
    {
        let unit = match calendar.unit() {
            CalendarUnit::Minute => Unit::Minute,
            CalendarUnit::Hour => Unit::Hour,
            CalendarUnit::Day => Unit::Day,
            CalendarUnit::Week => Unit::Week,
            CalendarUnit::Month => Unit::Month,
            _ => Unit::Year,
        };
        return RateLimit {
            name: policy.name().to_owned(),
            requests_per_unit: per_unit,
            unit: unit as i32,
        };
    }
    let period_us = u128::from(quota.period_micros().max(1));
    let in_unit = |secs: u64| u128::from(quota.limit()) * u128::from(secs) * 1_000_000 / period_us;
    let within = UNITS.iter().rev().find(|&&(secs, _)| {
        let count = in_unit(secs);
        u128::from(secs) * 1_000_000 <= period_us && count >= 1 && count <= u128::from(u32::MAX)
    });
    let (per_unit, unit) = match within {
        Some(&(secs, unit)) => (in_unit(secs), unit),
        None => {
            let &(secs, unit) = UNITS
                .iter()
                .find(|&&(secs, _)| u128::from(secs) * 1_000_000 > period_us)
                .unwrap_or(&UNITS[6]);
            // A period above a year still states one a year.
            (in_unit(secs).min(u128::from(quota.burst())).max(1), unit)
        }
    };
    RateLimit {
        name: policy.name().to_owned(),
        requests_per_unit: u32::try_from(per_unit).unwrap_or(u32::MAX),
        unit: unit as i32,
    }
}

fn proto_duration(duration: Duration) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(duration.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(duration.subsec_nanos()).unwrap_or(0),
    }
}

#[tonic::async_trait]
impl rate_limit_service_server::RateLimitService for RateLimitService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.decide(request.get_ref()).await.map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tollway_core::{Algorithm, Quota};

    use super::*;

    fn stated(limit: u64, period_s: u64, burst: Option<u64>) -> (u32, Unit) {
        let mut quota = Quota::with_period(limit, Duration::from_secs(period_s)).unwrap();
        if let Some(burst) = burst {
            quota = quota.with_burst(burst).unwrap();
        }
        let policy = Policy::new("p", Algorithm::Gcra, quota).unwrap();
        let limit = current_limit(&policy);
        (limit.requests_per_unit, Unit::try_from(limit.unit).unwrap())
    }

    // Envoy reads (count, unit) as what passes in one unit's window: 5 per 10 s was (30,
    // MINUTE), a burst six times the policy's.
    #[test]
    fn the_stated_limit_never_passes_more_than_the_policy() {
        assert_eq!(stated(3, 60, None), (3, Unit::Minute));
        assert_eq!(stated(10, 1, None), (10, Unit::Second));
        assert_eq!(stated(100, 90, None), (66, Unit::Minute));
        assert_eq!(stated(7, 2 * 86_400, None), (3, Unit::Day));
        assert_eq!(stated(5, 10, None), (5, Unit::Minute));
        assert_eq!(stated(5, 10, Some(50)), (30, Unit::Minute));
        // Past Envoy's 32 bits in a month: stated a week.
        let month = 31 * 86_400;
        assert_eq!(
            stated(10_000_000_000, month, None),
            (2_258_064_516, Unit::Week)
        );
        assert_eq!(stated(1, 400 * 86_400, None), (1, Unit::Year));
        // A calendar month is Envoy's month.
        let month = tollway_core::Calendar::utc(CalendarUnit::Month);
        let quota = Quota::per_calendar(1_000, month).unwrap();
        let policy = Policy::new("p", Algorithm::FixedWindow, quota).unwrap();
        let limit = current_limit(&policy);
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (1_000, Unit::Month as i32)
        );
    }
}
