//! `StreamRateLimitQuotas`: Envoy's rate limit quota service (RLQS). Each Envoy decides
//! locally from token buckets the server assigns, and the assignments of all Envoys, on
//! all replicas sharing a store, divide the policy exactly (see
//! [`share`](tollway_core::share)).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    self, AbandonAction, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    self, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tokio::sync::{mpsc, watch};
use tollway_core::{BoxStore, Policy, ShareAsk, Store};
use tollway_tower::config::{ConfigKey, LimitsFile};
use tollway_tower::{OnStoreError, RateLimitLayer};
use tonic::{Request, Response, Status};

use crate::descriptors::Descriptors;

/// How long an Envoy keeps an assignment: two of Envoy's report intervals (5 s, fixed in
/// Envoy 1.40), so one late report costs nothing.
pub const ASSIGNMENT_TTL: Duration = Duration::from_secs(12);

/// How much longer than its assignment the server holds an Envoy's share: for the
/// assignment's way to Envoy. An Envoy that receives it later than this may enforce it
/// past its share.
pub const TRANSIT: Duration = Duration::from_secs(1);

/// Reports of no requests in a row after which a bucket is abandoned: a minute of
/// Envoy's. Till then it keeps a share (what no demand takes, divided evenly), so a
/// caller that comes back is admitted at once.
pub const IDLE_REPORTS: u32 = 12;

/// The most buckets one stream keeps. A bucket past it is told `DENY_ALL` and counted.
pub const MAX_BUCKETS: usize = 4_096;

/// Bytes of a usage report message: as for a rate limit request.
pub const MESSAGE_BYTES: usize = crate::bounds::MESSAGE_BYTES;

/// What the quota service decides by: the file's `[[buckets]]`, and what to assign when
/// the store fails.
#[derive(Debug)]
pub struct Buckets {
    rules: Descriptors,
    on_error: OnStoreError,
}

impl Buckets {
    /// The bucket rules of `file`.
    ///
    /// # Errors
    ///
    /// Never for a file that [`LimitsFile::parse`] accepted.
    pub fn from_file(file: &LimitsFile) -> Result<Self, tollway_core::ConfigError> {
        Ok(Buckets {
            rules: Descriptors::new(file.buckets()?),
            on_error: file.on_store_error(),
        })
    }
}

/// The quota service as gRPC serves it.
pub type QuotaServer = RateLimitQuotaServiceServer<QuotaService>;

/// The rate limit quota service: Envoy's `RateLimitQuotaService` over the file's
/// `[[buckets]]` and its store. Clones share everything.
#[derive(Clone)]
pub struct QuotaService {
    inner: Arc<Inner>,
}

struct Inner {
    /// The file's limits: their store and shadow switches.
    limits: RateLimitLayer<BoxStore, ConfigKey>,
    store: BoxStore,
    rules: ArcSwap<Buckets>,
    /// Bumped on each new version of the rules: streams look at their buckets again.
    version: watch::Sender<u64>,
    /// This process, among replicas sharing the store.
    replica: String,
    streams: AtomicU64,
}

impl std::fmt::Debug for QuotaService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaService")
            .field("replica", &self.inner.replica)
            .finish_non_exhaustive()
    }
}

impl QuotaService {
    /// A service assigning shares of `rules`' policies from the store of `limits`, and
    /// allowing all of a policy `limits` has in shadow mode.
    #[must_use]
    pub fn new(limits: RateLimitLayer<BoxStore, ConfigKey>, rules: Buckets) -> Self {
        QuotaService {
            inner: Arc::new(Inner {
                store: limits.store(),
                limits,
                rules: ArcSwap::from_pointee(rules),
                version: watch::channel(0).0,
                replica: replica_id(),
                streams: AtomicU64::new(0),
            }),
        }
    }

    /// Puts `rules` in force. Every stream looks at its buckets again: a bucket whose
    /// policy went is abandoned, one whose policy changed is assigned anew.
    pub fn set_rules(&self, rules: Buckets) {
        self.inner.rules.store(Arc::new(rules));
        self.inner.version.send_modify(|v| *v += 1);
    }

    /// The gRPC service, its messages bounded at [`MESSAGE_BYTES`].
    #[must_use]
    pub fn into_server(self) -> QuotaServer {
        RateLimitQuotaServiceServer::new(self).max_decoding_message_size(MESSAGE_BYTES)
    }
}

/// A name for this process no other replica has: its id, start time and address of a
/// fresh allocation, hashed.
fn replica_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(now.as_nanos());
    }
    format!("{:016x}", hasher.finish())
}

/// A bucket id as a map key: its entries, sorted.
type BucketKey = Vec<(String, String)>;

fn bucket_key(id: &BucketId) -> BucketKey {
    let mut key: BucketKey = id
        .bucket
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    key.sort();
    key
}

/// One bucket of a stream: its holder's name in the ledgers, and what it was last told.
struct Bucket {
    id: BucketId,
    holder: String,
    /// The policy and key its share is held under, when it is limited.
    held: Option<(Policy, tollway_tower::Key)>,
    /// Its last demand, units a period of its policy; `None` before one is known.
    demand: Option<u64>,
    /// Reports of no requests in a row.
    idle: u32,
    /// When its last report came.
    reported: Option<tokio::time::Instant>,
    /// When this stream first named it.
    named: tokio::time::Instant,
    told: Option<Strategy>,
}

/// A stream: its buckets, and the domain its reports name.
struct Stream {
    number: u64,
    /// Buckets this stream has named so far: each its own holder.
    named: u64,
    domain: String,
    buckets: HashMap<BucketKey, Bucket>,
}

/// What a bucket is told.
enum Told {
    Assign(Strategy),
    Abandon,
}

impl Inner {
    /// Answers one usage report: an action for each bucket it names.
    async fn report(
        &self,
        stream: &mut Stream,
        reports: RateLimitQuotaUsageReports,
    ) -> Result<Vec<BucketAction>, Status> {
        if !reports.domain.is_empty() {
            if stream.domain.is_empty() {
                stream.domain = reports.domain;
            } else if stream.domain != reports.domain {
                return Err(Status::invalid_argument(
                    "a quota stream's reports name one domain",
                ));
            }
        }
        let mut actions = Vec::new();
        for usage in reports.bucket_quota_usages {
            let Some(id) = usage.bucket_id else {
                return Err(Status::invalid_argument("a usage report names its bucket"));
            };
            if let Some((reason, bound)) = past_bounds(&id) {
                metrics::counter!(tollway_core::metric::RLS_REFUSED.name, "reason" => reason)
                    .increment(1);
                return Err(Status::invalid_argument(format!(
                    "a bucket id past tollway-server's bounds: {bound}"
                )));
            }
            let key = bucket_key(&id);
            let count = stream.buckets.len();
            let holder = format!("{}/{}/{}", self.replica, stream.number, stream.named);
            let Some(bucket) = (match stream.buckets.entry(key.clone()) {
                std::collections::hash_map::Entry::Occupied(e) => Some(e.into_mut()),
                std::collections::hash_map::Entry::Vacant(_) if count >= MAX_BUCKETS => None,
                std::collections::hash_map::Entry::Vacant(e) => {
                    stream.named += 1;
                    Some(e.insert(Bucket {
                        holder,
                        id: id.clone(),
                        held: None,
                        demand: None,
                        idle: 0,
                        reported: None,
                        named: tokio::time::Instant::now(),
                        told: None,
                    }))
                }
            }) else {
                metrics::counter!(tollway_core::metric::RLS_REFUSED.name, "reason" => "buckets")
                    .increment(1);
                actions.push(assign(
                    id,
                    Strategy::BlanketRule(BlanketRule::DenyAll as i32),
                ));
                continue;
            };
            let elapsed = usage.time_elapsed.map_or(Duration::ZERO, |d| {
                Duration::new(
                    u64::try_from(d.seconds).unwrap_or(0),
                    u32::try_from(d.nanos).unwrap_or(0).min(999_999_999),
                )
            });
            // Envoy 1.40 truncates its time to whole seconds: a report 5.9 s after the
            // last says 5 s, and its demand would read a fifth high. The time between
            // reports as they came is the truer one.
            let now = tokio::time::Instant::now();
            let since = bucket.reported.map_or(Duration::ZERO, |then| now - then);
            bucket.reported = Some(now);
            let elapsed = if elapsed.is_zero() {
                elapsed
            } else {
                elapsed.max(since)
            };
            let report = (
                usage.num_requests_allowed,
                usage.num_requests_denied,
                elapsed,
            );
            let action = self.decide(&stream.domain, bucket, Some(report)).await;
            if let Some(action) = action {
                if is_abandon(&action) {
                    stream.buckets.remove(&key);
                }
                actions.push(action);
            }
        }
        Ok(actions)
    }

    /// Decides `bucket` anew: from a report of requests allowed and denied in a time,
    /// or from its last demand (a new version of the rules). `None`: nothing to tell it.
    async fn decide(
        &self,
        domain: &str,
        bucket: &mut Bucket,
        report: Option<(u64, u64, Duration)>,
    ) -> Option<BucketAction> {
        let rules = self.rules.load_full();
        let matched = rules.rules.find_bucket(domain, &bucket.id.bucket);
        let known = matched.is_some();
        let limited = matched.and_then(|m| Some((m.policy?.clone(), m.key)));
        if let Some((allowed, denied, elapsed)) = report {
            let quiet = allowed == 0 && denied == 0 && !elapsed.is_zero();
            bucket.idle = if quiet { bucket.idle + 1 } else { 0 };
        }
        let idle = bucket.idle >= IDLE_REPORTS;
        // A policy that went, or changed: the old share is given back.
        if let Some((held, _)) = &bucket.held {
            let same = limited.as_ref().is_some_and(|(p, _)| p == held);
            if !same {
                self.release(bucket).await;
            }
        }
        let shadow = limited.as_ref().is_some_and(|(policy, _)| {
            self.limits.is_shadow(None) || self.limits.is_shadow(Some(policy.name()))
        });
        let told = match limited {
            // Quiet for a minute: Envoy forgets the bucket, and asks at once when a
            // request comes again.
            Some(_) if idle => Told::Abandon,
            // In shadow mode: refused nothing. Envoy cannot count what a bucket would
            // have refused, so no share is held.
            Some(_) if shadow => {
                self.release(bucket).await;
                Told::Assign(Strategy::BlanketRule(BlanketRule::AllowAll as i32))
            }
            None if known => {
                // Unlimited by its rule.
                Told::Assign(Strategy::BlanketRule(BlanketRule::AllowAll as i32))
            }
            None => {
                // No rule: a bucket the file does not know is not the server's to limit.
                if bucket.told.is_some() {
                    Told::Abandon
                } else {
                    Told::Assign(Strategy::BlanketRule(BlanketRule::AllowAll as i32))
                }
            }
            Some((policy, key)) => {
                if let Some((allowed, denied, elapsed)) = report {
                    let name = policy.name().to_owned();
                    let reported = tollway_core::metric::RLQS_REPORTED.name;
                    metrics::counter!(reported, "policy" => name.clone(), "outcome" => "allowed")
                        .increment(allowed);
                    metrics::counter!(reported, "policy" => name, "outcome" => "denied")
                        .increment(denied);
                    let seen = allowed.saturating_add(denied);
                    bucket.demand = demand(&policy, seen, elapsed);
                }
                let strategy = self.share(&policy, &key, bucket, rules.on_error).await;
                bucket.held = Some((policy, key));
                Told::Assign(strategy)
            }
        };
        match told {
            Told::Abandon => {
                self.release(bucket).await;
                bucket.told = None;
                Some(BucketAction {
                    bucket_id: Some(bucket.id.clone()),
                    bucket_action: Some(bucket_action::BucketAction::AbandonAction(
                        AbandonAction {},
                    )),
                })
            }
            Told::Assign(strategy) => {
                // A report is answered every time: the same assignment again keeps
                // Envoy's bucket and renews its time to live.
                if report.is_none() && bucket.told == Some(strategy) {
                    return None;
                }
                // Nothing to give a bucket new to this stream, while a share held for an
                // earlier stream may still be in force: say nothing. An Envoy that
                // reconnected keeps the assignment it has (that share is counted until
                // it ends); a new bucket admits nothing without one anyway (DENY_ALL,
                // the documented configuration).
                let deny = Strategy::BlanketRule(BlanketRule::DenyAll as i32);
                let young = bucket.named.elapsed() < ASSIGNMENT_TTL + TRANSIT;
                if bucket.told.is_none() && strategy == deny && young {
                    return None;
                }
                bucket.told = Some(strategy);
                Some(assign(bucket.id.clone(), strategy))
            }
        }
    }

    /// The assignment of `bucket`'s share of `policy` for `key`.
    async fn share(
        &self,
        policy: &Policy,
        key: &tollway_tower::Key,
        bucket: &Bucket,
        on_error: OnStoreError,
    ) -> Strategy {
        // Not known yet (a first report): the whole limit, which the others' demands
        // share out fairly.
        let demand = bucket.demand.unwrap_or(policy.quota().limit());
        let ask = ShareAsk::new(bucket.holder.clone(), demand, ASSIGNMENT_TTL + TRANSIT);
        let answer = match self.store.share(key.as_bytes(), policy, &ask) {
            Some(future) => future.await,
            None => Err(tollway_core::StoreError::new(
                tollway_core::StoreErrorKind::Connection,
                "the store does not share this policy now",
            )),
        };
        if let Ok(share) = &answer {
            tracing::debug!(
                holder = %bucket.holder,
                policy = policy.name(),
                demand,
                rate = share.rate(),
                size = share.size(),
                new = share.is_new(),
                "shared"
            );
        }
        match answer {
            Ok(share) if share.rate() == 0 => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
            Ok(share) => {
                if share.is_new() {
                    metrics::counter!(tollway_core::metric::RLQS_BUCKETS.name, "policy" => policy.name().to_owned())
                        .increment(1);
                }
                Strategy::TokenBucket(token_bucket(policy, share.rate(), share.size()))
            }
            Err(error) => {
                tracing::warn!(%error, policy = policy.name(), "the store did not share");
                match on_error {
                    OnStoreError::Reject => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
                    _ => Strategy::BlanketRule(BlanketRule::AllowAll as i32),
                }
            }
        }
    }

    /// Gives `bucket`'s share back: Envoy enforces it no more.
    async fn release(&self, bucket: &mut Bucket) {
        if let Some((policy, key)) = bucket.held.take() {
            let ask = ShareAsk::release(bucket.holder.clone());
            if let Some(future) = self.store.share(key.as_bytes(), &policy, &ask) {
                // A share not given back ends at its time anyway.
                let _ = future.await;
            }
        }
    }

    /// Serves one stream until Envoy closes it.
    async fn serve(
        self: Arc<Self>,
        mut inbound: tonic::Streaming<RateLimitQuotaUsageReports>,
        outbound: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    ) {
        let mut stream = Stream {
            number: self.streams.fetch_add(1, Ordering::Relaxed),
            named: 0,
            domain: String::new(),
            buckets: HashMap::new(),
        };
        let mut version = self.version.subscribe();
        loop {
            let mut reported = false;
            let actions = tokio::select! {
                message = inbound.message() => match message {
                    Ok(Some(reports)) => {
                        reported = true;
                        self.report(&mut stream, reports).await
                    }
                    // Envoy closed the stream, or it broke: its shares end at their time,
                    // since Envoy enforces its assignments until then.
                    Ok(None) | Err(_) => break,
                },
                changed = version.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let mut actions = Vec::new();
                    for bucket in stream.buckets.values_mut() {
                        if let Some(action) = self.decide(&stream.domain, bucket, None).await {
                            actions.push(action);
                        }
                    }
                    stream.buckets.retain(|_, b| b.told.is_some());
                    Ok(actions)
                }
            };
            let answer = match actions {
                // A report is answered, if only with nothing: Envoy then keeps what it
                // has. A new version of the rules that changes nothing says nothing.
                Ok(actions) if actions.is_empty() && !reported => continue,
                Ok(actions) => Ok(RateLimitQuotaResponse {
                    bucket_action: actions,
                }),
                Err(status) => Err(status),
            };
            let failed = answer.is_err();
            // An Envoy that does not read its answers for an assignment's life has
            // none in force: the stream ends.
            let sent = tokio::time::timeout(ASSIGNMENT_TTL, outbound.send(answer)).await;
            if !matches!(sent, Ok(Ok(()))) || failed {
                break;
            }
        }
    }
}

/// Units a period of `policy` that `seen` requests in `elapsed` ask for; `None` for a
/// first report (nothing elapsed), which tells nothing yet.
fn demand(policy: &Policy, seen: u64, elapsed: Duration) -> Option<u64> {
    let quota = policy.quota();
    let elapsed = elapsed.as_millis();
    if elapsed == 0 {
        return None;
    }
    let period = u128::from(quota.period_micros() / 1_000);
    let wanted = u128::from(seen) * period / elapsed;
    Some(u64::try_from(wanted).unwrap_or(u64::MAX))
}

/// A token bucket of `size` that fills `rate` units a period of `policy`. The file's check
/// keeps both within 32 bits.
fn token_bucket(policy: &Policy, rate: u64, size: u64) -> TokenBucket {
    let period = policy.quota().period();
    TokenBucket {
        max_tokens: u32::try_from(size).unwrap_or(u32::MAX),
        tokens_per_fill: Some(envoy_types::pb::google::protobuf::UInt32Value {
            value: u32::try_from(rate).unwrap_or(u32::MAX),
        }),
        fill_interval: Some(ProtoDuration {
            seconds: i64::try_from(period.as_secs()).unwrap_or(i64::MAX),
            nanos: i32::try_from(period.subsec_nanos()).unwrap_or(0),
        }),
    }
}

/// Why a bucket id is past the bounds a descriptor has (`crate::bounds`): entries, key
/// and value lengths.
fn past_bounds(id: &BucketId) -> Option<(&'static str, String)> {
    use crate::bounds::{ENTRIES, KEY_BYTES, VALUE_BYTES};
    if id.bucket.len() > ENTRIES {
        return Some(("entries", format!("at most {ENTRIES} entries")));
    }
    if id.bucket.keys().any(|k| k.len() > KEY_BYTES) {
        return Some(("key_bytes", format!("keys of at most {KEY_BYTES} bytes")));
    }
    if id.bucket.values().any(|v| v.len() > VALUE_BYTES) {
        return Some((
            "value_bytes",
            format!("values of at most {VALUE_BYTES} bytes"),
        ));
    }
    None
}

fn is_abandon(action: &BucketAction) -> bool {
    matches!(
        action.bucket_action,
        Some(bucket_action::BucketAction::AbandonAction(_))
    )
}

fn assign(id: BucketId, strategy: Strategy) -> BucketAction {
    let ttl = ProtoDuration {
        seconds: i64::try_from(ASSIGNMENT_TTL.as_secs()).unwrap_or(i64::MAX),
        nanos: 0,
    };
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(
            QuotaAssignmentAction {
                assignment_time_to_live: Some(ttl),
                rate_limit_strategy: Some(RateLimitStrategy {
                    strategy: Some(strategy),
                }),
            },
        )),
    }
}

#[tonic::async_trait]
impl rate_limit_quota_service_server::RateLimitQuotaService for QuotaService {
    type StreamRateLimitQuotasStream =
        tokio_stream::wrappers::ReceiverStream<Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<tonic::Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let (outbound, answers) = mpsc::channel(16);
        tokio::spawn(Arc::clone(&self.inner).serve(request.into_inner(), outbound));
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            answers,
        )))
    }
}
