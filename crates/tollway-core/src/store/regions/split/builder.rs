//! The builder: the regions, the policies they split, and the exchange's timing.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::exchange::exchange_forever;
use super::shares::Plan;
use super::{Inner, MAX_SPAN, Split, SplitStore};
use crate::policy::fnv1a;
use crate::store::Store;
use crate::store::regions::{Board, Failing};
use crate::{Algorithm, Clock, ConfigError, Policy, Quota};

/// Builds a [`SplitStore`].
#[must_use]
pub struct SplitStoreBuilder<S> {
    region: String,
    local: S,
    clock: Arc<dyn Clock>,
    peers: Vec<(String, S)>,
    policies: Vec<Policy>,
    lead: Option<Duration>,
    timeout: Duration,
    max_keys: usize,
}

impl<S> fmt::Debug for SplitStoreBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peers: Vec<&str> = self.peers.iter().map(|p| p.0.as_str()).collect();
        f.debug_struct("SplitStoreBuilder")
            .field("region", &self.region)
            .field("peers", &peers)
            .field("policies", &self.policies)
            .field("lead", &self.lead)
            .field("timeout", &self.timeout)
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}

impl<S: Store + Board + Clone> SplitStoreBuilder<S> {
    /// The defaults, as [`SplitStore::builder`] gives them.
    pub(super) fn new(name: impl Into<String>, local: S, clock: impl Clock) -> Self {
        SplitStoreBuilder {
            region: name.into(),
            local,
            clock: Arc::new(clock),
            peers: Vec::new(),
            policies: Vec::new(),
            lead: None,
            timeout: Duration::from_secs(1),
            max_keys: 100_000,
        }
    }

    /// Another region, `name`d as it names itself, and its store (its board) as this
    /// region reaches it.
    ///
    /// A peer named otherwise is never heard from. This region then counts it as asking
    /// for everything. That is safe, but this region's shares shrink.
    pub fn peer(mut self, name: impl Into<String>, store: S) -> Self {
        self.peers.push((name.into(), store));
        self
    }

    /// A policy whose limit the regions split: a fixed window. Every policy a request
    /// names must be declared.
    pub fn policy(mut self, policy: &Policy) -> Self {
        self.policies.push(policy.clone());
        self
    }

    /// How long before each window's end this region posts its demand.
    ///
    /// The default is a quarter of the policy's period, and the most is half of it. The
    /// region reads the others' posts half the lead later. So half the lead must cover a
    /// post: the write on this region's board, then the way to the others'.
    pub fn lead(mut self, lead: Duration) -> Self {
        self.lead = Some(lead);
        self
    }

    /// How long a post to a peer, or a read of this region's board, may take (default
    /// 1 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many keys a window's demand is counted for (default 100,000).
    ///
    /// Further new keys are taken to ask nothing, so their shares come from the others'
    /// asks. The local store's own bound wants room for about three windows of keys. A
    /// window's counts are kept until a span of 3 or more periods around it ends. The
    /// span is rarely more than 5.
    pub fn max_keys(mut self, keys: usize) -> Self {
        self.max_keys = keys;
        self
    }

    /// Builds the store, then starts the exchange on the current tokio runtime, a task
    /// a policy.
    ///
    /// First it reads what an earlier process under this region's name posted, from
    /// this region's board. If the board cannot be read, this region counts itself as
    /// asking nothing for this window and the next.
    ///
    /// # Errors
    ///
    /// When there is no peer or no policy. When a policy is not a fixed window, is
    /// declared twice, or has a period that times 64 passes 2^50 µs. When a region or
    /// peer name is empty, has a zero byte, or repeats. When a lead is zero, or over
    /// half a policy's period. When a timeout or `max_keys` is zero. When called
    /// outside a tokio runtime.
    pub async fn build(self) -> Result<SplitStore<S>, ConfigError> {
        if self.peers.is_empty() || self.policies.is_empty() {
            return Err(ConfigError::new(
                "a split store needs a peer and a policy: add the other regions with \
                 .peer(name, store) and the limits they split with .policy(&policy)",
            ));
        }
        let mut names: Vec<&str> = self.peers.iter().map(|p| p.0.as_str()).collect();
        names.push(&self.region);
        if let Some(bad) = names.iter().find(|n| n.is_empty() || n.contains('\0')) {
            return Err(ConfigError::new(format!(
                "split store region names must be non-empty, without a zero byte; got {bad:?}"
            )));
        }
        names.sort_unstable();
        if let Some(twice) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(ConfigError::new(format!(
                "split store region {:?} is named twice: each region (this one and every \
                 peer) needs a name of its own",
                twice[0]
            )));
        }
        let mut splits = Vec::with_capacity(self.policies.len());
        for policy in &self.policies {
            if !splittable(policy.algorithm()) {
                return Err(ConfigError::new(format!(
                    "policy {:?} is a {}: a split store splits fixed windows only (a share \
                     changes when a window starts afresh; a bucket or a log would carry a \
                     share over that no longer holds); use a fixed window, or a \
                     ReplicatedStore",
                    policy.name(),
                    policy.algorithm().name()
                )));
            }
            if splits.iter().any(|s: &Split| s.policy.id() == policy.id()) {
                return Err(ConfigError::new(format!(
                    "policy {:?} is declared twice to the split store",
                    policy.name()
                )));
            }
            let period = policy.quota().period_micros();
            let lead = self.lead.map_or(period / 4, |lead| {
                u64::try_from(lead.as_micros()).unwrap_or(u64::MAX)
            });
            if Quota::counting(policy.quota().limit(), period.saturating_mul(MAX_SPAN)).is_none() {
                return Err(ConfigError::new(format!(
                    "policy {:?}: a split store counts each window under a fixed window up to \
                     {MAX_SPAN} periods long, which must stay within 2^50 µs; use a period of \
                     at most {:?}",
                    policy.name(),
                    Duration::from_micros((1 << 50) / MAX_SPAN)
                )));
            }
            if lead == 0 || lead.saturating_mul(2) > period {
                return Err(ConfigError::new(format!(
                    "split store lead must be above zero and at most half of policy {:?}'s \
                     period ({:?}); got {lead} µs",
                    policy.name(),
                    policy.quota().period()
                )));
            }
            splits.push(Split {
                policy: policy.clone(),
                lead,
                plan: Mutex::new(Plan::default()),
            });
        }
        if self.timeout.is_zero() || self.max_keys == 0 {
            return Err(ConfigError::new(format!(
                "a split store's timeout and max_keys must be above zero; got {:?} and {}",
                self.timeout, self.max_keys
            )));
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            ConfigError::new("build a split store inside a tokio runtime: its exchange runs on it")
        })?;
        let mut names: Vec<&str> = self.peers.iter().map(|p| p.0.as_str()).collect();
        names.push(&self.region);
        names.sort_unstable();
        let fingerprint = fnv1a(names.iter().flat_map(|n| n.bytes().chain([0])));
        let inner = Arc::new(Inner {
            region: self.region,
            fingerprint,
            local: self.local,
            peers_failing: self.peers.iter().map(|_| Arc::default()).collect(),
            board_failing: Failing::default(),
            peers: self.peers,
            clock: self.clock,
            timeout: self.timeout,
            max_keys: self.max_keys,
            splits,
            tasks: Mutex::new(Vec::new()),
        });
        for i in 0..inner.splits.len() {
            inner.recover(i).await;
        }
        let tasks = (0..inner.splits.len())
            .map(|i| runtime.spawn(exchange_forever(Arc::downgrade(&inner), i)))
            .collect();
        *inner.tasks.lock() = tasks;
        Ok(SplitStore { inner })
    }
}

/// Whether a split store can split `algorithm`'s limits: only a fixed window's, whose
/// count starts afresh everywhere at once.
fn splittable(algorithm: Algorithm) -> bool {
    match algorithm {
        Algorithm::FixedWindow => true,
        Algorithm::TokenBucket
        | Algorithm::LeakyBucket
        | Algorithm::LeakyBucketShaper
        | Algorithm::SlidingWindowLog
        | Algorithm::SlidingWindowCounter
        | Algorithm::Gcra
        | Algorithm::Concurrency => false,
    }
}
