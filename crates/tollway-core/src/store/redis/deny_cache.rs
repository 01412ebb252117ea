//! The deny cache: refusals Redis gave, answered locally while they hold.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::clock::Clock;
use crate::{Decision, Decisions, Denial, Policy};

/// Refusals of unit-cost requests that Redis gave, answered locally while they hold.
///
/// Say Redis refuses a one-unit request because a limit is out of units until `T`.
/// Then that limit has less than one unit until `T`. Time only refills it, and a request
/// of any cost can only make it emptier. So every node refuses the same request (same
/// key, same limits) until the earliest such `T` among its denying limits. Each node may
/// answer it itself until then.
///
/// The local answer is the one Redis would give, field by field, for the denying
/// limits. Their remaining is 0, and their retry and reset times are counted down. The
/// limits that did not deny report what Redis said of them at the refusal. Their reset
/// is counted down. Their remaining is as it was then: a little low, never high.
///
/// The cache never admits anything. A flood from one key then costs Redis about one call
/// per node per retry period, instead of one per request.
///
/// Counting down uses this node's clock. With the server's `TIME`, local and server time
/// differ by the call's latency. So a local refusal can outlast Redis's by that much.
pub(super) struct DenyCache {
    clock: Arc<dyn Clock>,
    hasher: foldhash::quality::RandomState,
    shards: Box<[Mutex<HashMap<u64, Refused>>]>,
    per_shard: usize,
}

/// Where a request's refusal is kept: the hash of its caller's key, and of that and its
/// limits.
#[derive(Clone, Copy)]
pub(super) struct DenyEntry {
    caller: u64,
    request: u64,
}

/// A refusal, kept until `until_us`.
#[derive(Clone)]
struct Refused {
    caller: u64,
    until_us: u64,
    /// Each limit's decision, its times as instants of this node's clock.
    limits: SmallVec<[Remembered; 2]>,
}

#[derive(Clone, Copy)]
struct Remembered {
    denial: Option<Denial>,
    limit: u64,
    remaining: u64,
    reset_at_us: u64,
    retry_at_us: u64,
}

impl DenyCache {
    const SHARDS: usize = 16;

    pub(super) fn new(capacity: usize, clock: Arc<dyn Clock>) -> Self {
        DenyCache {
            clock,
            hasher: foldhash::quality::RandomState::default(),
            shards: (0..Self::SHARDS).map(|_| Mutex::default()).collect(),
            per_shard: capacity.div_ceil(Self::SHARDS),
        }
    }

    /// The entry of a request — its key and every limit's policy (which covers its
    /// quota) — if it can have one: only unit-cost requests are remembered.
    pub(super) fn entry(&self, key: &[u8], policies: &[&Policy], cost: u64) -> Option<DenyEntry> {
        // A slot frees when a call ends, which no retry time foresees: never cached.
        let in_flight = policies
            .iter()
            .any(|p| p.algorithm() == crate::Algorithm::Concurrency);
        if cost != 1 || in_flight {
            return None;
        }
        let caller = self.hasher.hash_one(key);
        let mut hasher = self.hasher.build_hasher();
        hasher.write_u64(caller);
        for policy in policies {
            hasher.write_u64(policy.id());
        }
        Some(DenyEntry {
            caller,
            request: hasher.finish(),
        })
    }

    /// A caller's refusals all live in one shard, so that they can be forgotten together.
    fn shard(&self, caller: u64) -> &Mutex<HashMap<u64, Refused>> {
        &self.shards[(caller as usize) % Self::SHARDS]
    }

    /// Forgets every refusal of `key`'s requests (its state was changed).
    pub(super) fn forget(&self, key: &[u8]) {
        let caller = self.hasher.hash_one(key);
        self.shard(caller).lock().retain(|_, r| r.caller != caller);
    }

    /// The local answer for the request of `entry`, if a refusal still covers it.
    pub(super) fn lookup(&self, entry: DenyEntry) -> Option<Decisions> {
        let now = self.clock.now_micros();
        let mut map = self.shard(entry.caller).lock();
        let refused = map.get(&entry.request)?;
        if now >= refused.until_us {
            map.remove(&entry.request);
            return None;
        }
        let decisions = refused
            .limits
            .iter()
            .map(|r| {
                let reset = r.reset_at_us.saturating_sub(now);
                match r.denial {
                    None => Decision::allow(r.limit, r.remaining, reset, 0),
                    Some(Denial::Limited) => {
                        Decision::limited(r.limit, 0, reset, r.retry_at_us - now)
                    }
                    Some(denial) => Decision::refused(denial, r.limit, r.remaining, reset),
                }
            })
            .collect();
        Some(decisions)
    }

    /// Remembers the refusal of the (unit-cost) request of `entry` by limits out of
    /// units. (A unit never exceeds a capacity, which is at least 1.)
    pub(super) fn remember(&self, entry: DenyEntry, decisions: &Decisions) {
        let Some(retry_us) = decisions
            .iter()
            .filter(|d| d.denial() == Some(Denial::Limited))
            .map(Decision::retry_after_micros)
            .min()
        else {
            return;
        };
        let now = self.clock.now_micros();
        let refused = Refused {
            caller: entry.caller,
            until_us: now + retry_us,
            limits: decisions
                .iter()
                .map(|d| Remembered {
                    denial: d.denial(),
                    limit: d.limit(),
                    remaining: d.remaining(),
                    reset_at_us: now + d.reset_after_micros(),
                    retry_at_us: now + d.retry_after_micros(),
                })
                .collect(),
        };
        let mut map = self.shard(entry.caller).lock();
        if map.len() >= self.per_shard && !map.contains_key(&entry.request) {
            map.retain(|_, r| r.until_us > now);
            if map.len() >= self.per_shard {
                return;
            }
        }
        map.insert(entry.request, refused);
    }
}
