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

/// The most buckets one stream keeps. A new bucket past it takes the place of the
/// quietest (the least demand, the longest unreported), which Envoy is told to abandon.
pub const MAX_BUCKETS: usize = 4_096;

/// The longest bucket id kept whole, in bytes of keys and values. A longer one is kept
/// as its hash: it learns of a new version of the rules at its next report, not at once.
pub const KEPT_ID_BYTES: usize = 512;

/// Bytes of a usage report message. Envoy reports every bucket it holds in one message,
/// so this is larger than a rate limit request's bound. A longer report ends its stream
/// `RESOURCE_EXHAUSTED`, logged and counted.
pub const MESSAGE_BYTES: usize = 8 << 20;

/// The most quota streams the server serves at once. Each Envoy opens one.
pub const MAX_STREAMS: usize = 1_024;

/// The most quota streams one connection opens at once.
pub const STREAMS_PER_CONNECTION: usize = 4;

/// The most requests one report may say a bucket allowed, or denied: past it, it says
/// this many. Far past what an Envoy decides in a report's 5 s.
pub const MAX_REPORTED: u64 = u32::MAX as u64;

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
    /// Streams numbered so far.
    streams: AtomicU64,
    /// Streams open now: in all, and by connection.
    open: std::sync::Mutex<Open>,
}

#[derive(Default)]
struct Open {
    all: usize,
    by_connection: HashMap<std::net::SocketAddr, usize>,
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
                open: std::sync::Mutex::default(),
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

/// A bucket id as a map key: a hash of its entries, sorted. The id itself is kept once,
/// and only when short (see [`KEPT_ID_BYTES`]).
type BucketKey = [u8; 16];

fn bucket_key(id: &BucketId) -> BucketKey {
    use sha2::Digest;
    let mut entries: Vec<(&String, &String)> = id.bucket.iter().collect();
    entries.sort();
    let mut hasher = sha2::Sha256::new();
    for (k, v) in entries {
        // Lengths first: no two ids hash the same bytes.
        hasher.update((k.len() as u64).to_le_bytes());
        hasher.update(k.as_bytes());
        hasher.update((v.len() as u64).to_le_bytes());
        hasher.update(v.as_bytes());
    }
    let digest = hasher.finalize();
    let mut key = [0; 16];
    key.copy_from_slice(&digest[..16]);
    key
}

/// Bytes of an id's keys and values.
fn id_bytes(id: &BucketId) -> usize {
    id.bucket.iter().map(|(k, v)| k.len() + v.len()).sum()
}

/// The key a share is held under: `key` when short, else `#` and a hash of it, so that
/// a store keeps no more than that for a long bucket id (the Redis store hashes long
/// keys too; the memory store keeps them as they are).
fn share_key(key: &tollway_tower::Key) -> Vec<u8> {
    use sha2::Digest;
    let bytes = key.as_bytes();
    if bytes.len() <= tollway_core::MAX_LITERAL_KEY {
        return bytes.to_vec();
    }
    let digest = sha2::Sha256::digest(bytes);
    let mut out = Vec::with_capacity(33);
    out.push(b'#');
    for b in &digest[..16] {
        out.extend_from_slice(format!("{b:02x}").as_bytes());
    }
    out
}

/// One bucket of a stream: its holder's name in the ledgers, and what it was last told.
struct Bucket {
    /// Its id, when short enough to keep: a new version of the rules reaches it at once.
    id: Option<BucketId>,
    holder: String,
    /// The policy and key its share is held under, when it is limited.
    held: Option<(Policy, Vec<u8>)>,
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
    Abandon(&'static str),
}

/// What one report's bucket came to: an action for Envoy (or none), and whether the
/// stream keeps the bucket.
struct Decided {
    action: Option<BucketAction>,
    keep: bool,
}

impl Inner {
    /// Answers one usage report: an action for each bucket it names. A bucket past the
    /// bounds is abandoned; the others are answered whatever it holds.
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
                // Nothing to answer it by: skipped.
                refused("bucket_id");
                continue;
            };
            if let Some(reason) = past_bounds(&id) {
                refused(reason);
                abandoned("bounds");
                actions.push(abandon(id));
                continue;
            }
            let key = bucket_key(&id);
            if !stream.buckets.contains_key(&key) {
                // Only a limited bucket is kept: one no rule names, or an unlimited one,
                // is answered and forgotten.
                let rules = self.rules.load();
                match rules.rules.find_bucket(&stream.domain, &id.bucket) {
                    Some(m) if m.policy.is_some() => {}
                    Some(_) => {
                        actions.push(assign(id, allow_all()));
                        continue;
                    }
                    // Envoy's first report of a bucket (no time elapsed) is answered, so
                    // it stops asking; a later one is abandoned, so Envoy forgets it.
                    None if is_zero(usage.time_elapsed.as_ref()) => {
                        actions.push(assign(id, allow_all()));
                        continue;
                    }
                    None => {
                        abandoned("unknown");
                        actions.push(abandon(id));
                        continue;
                    }
                }
                if stream.buckets.len() >= MAX_BUCKETS
                    && let Some(action) = self.evict_quietest(stream).await
                {
                    actions.push(action);
                }
                let holder = format!("{}/{}/{}", self.replica, stream.number, stream.named);
                stream.named += 1;
                stream.buckets.insert(
                    key,
                    Bucket {
                        id: (id_bytes(&id) <= KEPT_ID_BYTES).then(|| id.clone()),
                        holder,
                        held: None,
                        demand: None,
                        idle: 0,
                        reported: None,
                        named: tokio::time::Instant::now(),
                        told: None,
                    },
                );
            }
            let Some(bucket) = stream.buckets.get_mut(&key) else {
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
            // A report of no time from a bucket already reported (Envoy rounds down to
            // whole seconds) measures from the last one: its demand is known sooner.
            let elapsed = if elapsed.is_zero() && since.is_zero() {
                elapsed
            } else {
                elapsed.max(since)
            };
            // What a client reports is bounded: it cannot wrap a counter.
            let report = (
                usage.num_requests_allowed.min(MAX_REPORTED),
                usage.num_requests_denied.min(MAX_REPORTED),
                elapsed,
            );
            let decided = self
                .decide(&stream.domain, Some(&id), bucket, Some(report))
                .await;
            if !decided.keep {
                stream.buckets.remove(&key);
            }
            actions.extend(decided.action);
        }
        Ok(actions)
    }

    /// Makes room for a new bucket: the quietest is given up (its share released) and,
    /// when its id is kept, Envoy is told to abandon it. The quietest: the least demand,
    /// then the most reports of no requests, then the oldest. A bucket that showed a
    /// demand keeps its place against any number of new ones that have not.
    async fn evict_quietest(&self, stream: &mut Stream) -> Option<BucketAction> {
        let key = *stream
            .buckets
            .iter()
            .min_by_key(|(_, b)| (b.demand.unwrap_or(0), std::cmp::Reverse(b.idle), b.named))
            .map(|(key, _)| key)?;
        let mut bucket = stream.buckets.remove(&key)?;
        self.release(&mut bucket).await;
        abandoned("evicted");
        bucket.id.map(abandon)
    }

    /// Decides `bucket` anew: from a report of requests allowed and denied in a time,
    /// or from its last demand (a new version of the rules). `id`: the bucket's, when
    /// known; without it nothing is told, and a bucket whose rule changed is let go.
    async fn decide(
        &self,
        domain: &str,
        id: Option<&BucketId>,
        bucket: &mut Bucket,
        report: Option<(u64, u64, Duration)>,
    ) -> Decided {
        let Some(id) = id else {
            // A long id after a new version of the rules: let go, and decided afresh at
            // its next report.
            self.release(bucket).await;
            return Decided {
                action: None,
                keep: false,
            };
        };
        let rules = self.rules.load_full();
        let matched = rules.rules.find_bucket(domain, &id.bucket);
        let known = matched.is_some();
        let limited = matched.and_then(|m| Some((m.policy?.clone(), share_key(&m.key))));
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
        let (told, keep) = match limited {
            // Quiet for a minute: Envoy forgets the bucket, and asks at once when a
            // request comes again.
            Some(_) if idle => (Told::Abandon("idle"), false),
            // In shadow mode: refused nothing. Envoy cannot count what a bucket would
            // have refused, so no share is held.
            Some(_) if shadow => {
                self.release(bucket).await;
                (Told::Assign(allow_all()), true)
            }
            // Unlimited by its rule now: answered, not kept.
            None if known => (Told::Assign(allow_all()), false),
            // No rule now: a bucket the file does not know is not the server's to limit.
            None => (Told::Abandon("unknown"), false),
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
                (Told::Assign(strategy), true)
            }
        };
        let action = match told {
            Told::Abandon(reason) => {
                self.release(bucket).await;
                bucket.told = None;
                abandoned(reason);
                Some(abandon(id.clone()))
            }
            Told::Assign(strategy) => 'told: {
                if !keep {
                    self.release(bucket).await;
                }
                // A report is answered every time: the same assignment again keeps
                // Envoy's bucket and renews its time to live.
                if report.is_none() && bucket.told == Some(strategy) {
                    break 'told None;
                }
                // Nothing to give a bucket new to this stream, while a share held for an
                // earlier stream may still be in force: say nothing. An Envoy that
                // reconnected keeps the assignment it has (that share is counted until
                // it ends); a new bucket admits nothing without one anyway (DENY_ALL,
                // the documented configuration).
                let deny = Strategy::BlanketRule(BlanketRule::DenyAll as i32);
                let young = bucket.named.elapsed() < ASSIGNMENT_TTL + TRANSIT;
                if bucket.told.is_none() && strategy == deny && young {
                    break 'told None;
                }
                bucket.told = Some(strategy);
                Some(assign(id.clone(), strategy))
            }
        };
        Decided { action, keep }
    }

    /// The assignment of `bucket`'s share of `policy` for `key`.
    async fn share(
        &self,
        policy: &Policy,
        key: &[u8],
        bucket: &Bucket,
        on_error: OnStoreError,
    ) -> Strategy {
        // Not known yet (a first report): the whole limit, which the others' demands
        // share out fairly.
        let demand = bucket.demand.unwrap_or(policy.quota().limit());
        let ask = ShareAsk::new(bucket.holder.clone(), demand, ASSIGNMENT_TTL + TRANSIT);
        let answer = match self.store.share(key, policy, &ask) {
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
                    _ => allow_all(),
                }
            }
        }
    }

    /// Gives `bucket`'s share back: Envoy enforces it no more.
    async fn release(&self, bucket: &mut Bucket) {
        if let Some((policy, key)) = bucket.held.take() {
            let ask = ShareAsk::release(bucket.holder.clone());
            if let Some(future) = self.store.share(&key, &policy, &ask) {
                // A share not given back ends at its time anyway.
                let _ = future.await;
            }
        }
    }

    /// Serves one stream until Envoy closes it, or it fails. A stream that ends on an
    /// error is logged and counted, and Envoy is told why.
    async fn serve(
        self: Arc<Self>,
        mut inbound: tonic::Streaming<RateLimitQuotaUsageReports>,
        outbound: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
        _open: OpenStream,
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
                    // Envoy closed the stream: its shares end at their time, since Envoy
                    // enforces its assignments until then.
                    Ok(None) => break,
                    Err(status) => {
                        // A report past the bound (tonic says OUT_OF_RANGE), or a broken
                        // connection.
                        let (reason, status) = if status.code() == tonic::Code::OutOfRange {
                            ("message_bytes", Status::resource_exhausted(format!(
                                "a usage report past tollway-server's bound of {MESSAGE_BYTES} \
                                 bytes: {}", status.message()
                            )))
                        } else {
                            ("broken", status)
                        };
                        ended(&stream, reason, &status);
                        let _ = outbound.try_send(Err(status));
                        break;
                    }
                },
                changed = version.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let mut actions = Vec::new();
                    let mut gone = Vec::new();
                    for (key, bucket) in &mut stream.buckets {
                        let id = bucket.id.clone();
                        let decided = self.decide(&stream.domain, id.as_ref(), bucket, None).await;
                        if !decided.keep {
                            gone.push(*key);
                        }
                        actions.extend(decided.action);
                    }
                    for key in gone {
                        stream.buckets.remove(&key);
                    }
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
                Err(status) => {
                    ended(&stream, "domain", &status);
                    Err(status)
                }
            };
            let failed = answer.is_err();
            // An Envoy that does not read its answers for an assignment's life has
            // none in force: the stream ends.
            let sent = tokio::time::timeout(ASSIGNMENT_TTL, outbound.send(answer)).await;
            if !matches!(sent, Ok(Ok(()))) {
                if sent.is_err() {
                    ended(
                        &stream,
                        "unread",
                        &Status::deadline_exceeded("answers unread"),
                    );
                }
                break;
            }
            if failed {
                break;
            }
        }
        // The stream's shares end at their time; the ledgers forget them then.
        for bucket in stream.buckets.values_mut() {
            bucket.held = None;
        }
    }

    /// Opens a stream for the connection at `peer`, within [`MAX_STREAMS`] and
    /// [`STREAMS_PER_CONNECTION`].
    fn open(self: &Arc<Self>, peer: Option<std::net::SocketAddr>) -> Result<OpenStream, Status> {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let on_connection = peer.map_or(0, |p| open.by_connection.get(&p).copied().unwrap_or(0));
        if open.all >= MAX_STREAMS || on_connection >= STREAMS_PER_CONNECTION {
            metrics::counter!(tollway_core::metric::RLQS_STREAMS_ENDED.name, "reason" => "streams")
                .increment(1);
            tracing::warn!(?peer, "a quota stream refused: too many open");
            return Err(Status::resource_exhausted(format!(
                "tollway-server serves at most {MAX_STREAMS} quota streams, \
                 {STREAMS_PER_CONNECTION} a connection"
            )));
        }
        open.all += 1;
        if let Some(peer) = peer {
            *open.by_connection.entry(peer).or_default() += 1;
        }
        Ok(OpenStream {
            inner: Arc::clone(self),
            peer,
        })
    }
}

/// A stream counted open until dropped.
struct OpenStream {
    inner: Arc<Inner>,
    peer: Option<std::net::SocketAddr>,
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        let mut open = self
            .inner
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        open.all = open.all.saturating_sub(1);
        if let Some(peer) = self.peer
            && let std::collections::hash_map::Entry::Occupied(mut entry) =
                open.by_connection.entry(peer)
        {
            *entry.get_mut() -= 1;
            if *entry.get() == 0 {
                entry.remove();
            }
        }
    }
}

/// Logs and counts a stream that ended on an error.
fn ended(stream: &Stream, reason: &'static str, status: &Status) {
    metrics::counter!(tollway_core::metric::RLQS_STREAMS_ENDED.name, "reason" => reason)
        .increment(1);
    tracing::warn!(
        stream = stream.number,
        domain = %stream.domain,
        buckets = stream.buckets.len(),
        code = ?status.code(),
        message = status.message(),
        "a quota stream ended on an error"
    );
}

fn refused(reason: &'static str) {
    metrics::counter!(tollway_core::metric::RLS_REFUSED.name, "reason" => reason).increment(1);
}

fn abandoned(reason: &'static str) {
    metrics::counter!(tollway_core::metric::RLQS_ABANDONED.name, "reason" => reason).increment(1);
}

fn allow_all() -> Strategy {
    Strategy::BlanketRule(BlanketRule::AllowAll as i32)
}

fn is_zero(elapsed: Option<&ProtoDuration>) -> bool {
    elapsed.is_none_or(|d| d.seconds <= 0 && d.nanos <= 0)
}

fn abandon(id: BucketId) -> BucketAction {
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(bucket_action::BucketAction::AbandonAction(AbandonAction {})),
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
fn past_bounds(id: &BucketId) -> Option<&'static str> {
    use crate::bounds::{ENTRIES, KEY_BYTES, VALUE_BYTES};
    if id.bucket.len() > ENTRIES {
        return Some("entries");
    }
    if id.bucket.keys().any(|k| k.len() > KEY_BYTES) {
        return Some("key_bytes");
    }
    if id.bucket.values().any(|v| v.len() > VALUE_BYTES) {
        return Some("value_bytes");
    }
    None
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
        let open = self.inner.open(request.remote_addr())?;
        let (outbound, answers) = mpsc::channel(16);
        tokio::spawn(Arc::clone(&self.inner).serve(request.into_inner(), outbound, open));
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            answers,
        )))
    }
}
