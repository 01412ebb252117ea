//! The loans this process holds, one entry a key and set of policies, with each key's
//! demand here.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashTable;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::units::Loan;
use crate::{Decisions, Policy};

/// What a request's lease says, before any store is asked.
#[derive(Debug)]
pub(super) enum Local {
    /// Decided here from a loan's units. `renew`: ask the store for more, in the
    /// background, this many.
    Spent {
        decisions: Decisions,
        renew: Option<u64>,
    },
    /// No good units: lend this many with the request (and mark the entry asking).
    Lend(u64),
    /// No good units, and a loan is on its way: wait for it, then look again.
    Wait(tokio::sync::watch::Receiver<()>),
    /// Refused here: the store was short at its last answer. `renew`: ask the store,
    /// in the background, this many.
    Refused {
        decisions: Decisions,
        renew: Option<u64>,
    },
    /// Ask the store for the request alone.
    Pass,
}

/// A request, as the table sees it: the key, its policies and their identities, the cost.
#[derive(Clone, Copy, Debug)]
pub(super) struct Request<'a> {
    pub(super) key: &'a [u8],
    pub(super) ids: &'a [u64],
    pub(super) policies: &'a [&'a Policy],
    pub(super) cost: u64,
}

/// How the table sizes loans and bounds itself.
#[derive(Clone, Copy, Debug)]
pub(super) struct Sizing {
    /// The time a loan should last at the key's demand here, in µs.
    pub(super) horizon: u64,
    /// The smallest loan worth a call: a key whose demand over a horizon is less
    /// is decided one request at a time.
    pub(super) min_units: u64,
    /// The largest share of a limit's capacity one loan may take.
    pub(super) max_share: f64,
    /// An entry unused this long may be dropped, in µs.
    pub(super) idle: u64,
    /// The most entries a shard holds.
    pub(super) per_shard: usize,
}

/// The loans of one key under one set of policies, and its demand here.
#[derive(Debug)]
struct Entry {
    hash: u64,
    key: Box<[u8]>,
    ids: SmallVec<[u64; 2]>,
    /// The policies, for a give-back.
    policies: SmallVec<[Policy; 2]>,
    /// Units asked since `since`, and over the last horizon that ended.
    since: u64,
    seen: u64,
    per_horizon: u64,
    /// Told apart from an entry of the same key made after this one was forgotten.
    generation: u64,
    /// Units spent from a loan, in order of age.
    loans: SmallVec<[Loan; 2]>,
    /// A call that lends is on its way: dropped when it lands, which wakes the
    /// requests waiting for it.
    asking: Option<tokio::sync::watch::Sender<()>>,
    /// The store's last answer was short: it refused, or lent less than asked.
    dry: Option<Dry>,
    used: u64,
}

/// What the store said when it was short (see `short` in the lease module): from when
/// and until when its next unit comes (this process's clock), and its decisions.
#[derive(Clone, Debug)]
pub(super) struct Dry {
    pub(super) origin: u64,
    pub(super) until: u64,
    pub(super) decisions: Decisions,
}

impl Dry {
    /// The refusal a request gets at `now`: the store's answer, counted down. The limit
    /// with the fewest units left refuses (and any the store refused); the others tell
    /// what they had.
    fn refusal(&self, now: u64) -> Decisions {
        let elapsed = now.saturating_sub(self.origin);
        let left = self.until.saturating_sub(now).max(1);
        let least = self.decisions.iter().map(crate::Decision::remaining).min();
        self.decisions
            .iter()
            .map(|d| {
                let reset = d.reset_after_micros().saturating_sub(elapsed);
                if !d.is_allowed() || Some(d.remaining()) == least {
                    crate::Decision::limited(d.limit(), 0, reset, left)
                } else {
                    crate::Decision::allow(d.limit(), d.remaining(), reset, 0)
                }
            })
            .collect()
    }
}

impl Entry {
    fn is(&self, hash: u64, key: &[u8], ids: &[u64]) -> bool {
        self.hash == hash && *self.key == *key && self.ids[..] == *ids
    }

    /// Counts a request of `cost` at `now` into the demand: the units of the last
    /// horizon; or, for a key not yet hot, of the first `min_units` units, so that a
    /// key turning hot leases after a loan's worth of requests rather than a horizon.
    fn observe(&mut self, now: u64, cost: u64, sizing: &Sizing) {
        self.seen += cost;
        self.used = now;
        let elapsed = now.saturating_sub(self.since);
        let warming = self.per_horizon < sizing.min_units && self.seen >= sizing.min_units;
        if elapsed >= sizing.horizon || warming {
            let horizon = sizing.horizon;
            self.per_horizon = self.seen.saturating_mul(horizon) / elapsed.max(1);
            self.since = now;
            self.seen = 0;
        }
    }

    /// Units neither spent nor good any more, dropping the loans that have none good.
    fn drop_spent(&mut self, now: u64) -> u64 {
        let mut lost = 0;
        self.loans.retain(|loan| {
            let keep = loan.good(now) > 0;
            if !keep {
                lost += loan.unspent();
            }
            keep
        });
        lost
    }
}

/// Every loan this process holds, sharded by key.
#[derive(Debug)]
pub(super) struct Table {
    shards: Box<[Mutex<HashTable<Entry>>]>,
    generations: AtomicU64,
    hasher: foldhash::fast::RandomState,
    sizing: Sizing,
}

/// A loan's good units to give back to the windows they came from.
#[derive(Debug)]
pub(super) struct GiveBack {
    pub(super) key: Box<[u8]>,
    pub(super) policies: SmallVec<[Policy; 2]>,
    pub(super) units: u64,
    pub(super) ends: SmallVec<[u64; 2]>,
}

/// What [`Table::spend`] found, beside its answer: units gone bad unspent, the time it
/// read, and the generation of the key's entry.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) expired: u64,
    pub(super) now: u64,
    pub(super) generation: u64,
}

/// Spends `cost` units at `now` from `loans`, oldest first: from one loan when one has
/// as many good, else from several in order (each unit is good on its own). `None` when
/// they hold fewer good units than that, all told.
fn spend_from(loans: &mut [Loan], now: u64, cost: u64) -> Option<Decisions> {
    if let Some(decisions) = loans.iter_mut().find_map(|loan| loan.spend(now, cost)) {
        return Some(decisions);
    }
    let good: u64 = loans.iter().map(|loan| loan.good(now)).sum();
    if good < cost || loans.is_empty() {
        return None;
    }
    let mut need = cost;
    let mut told = None;
    for loan in loans.iter_mut() {
        let take = loan.good(now).min(need);
        if take > 0 {
            told = loan.spend(now, take);
            need -= take;
        }
        if need == 0 {
            break;
        }
    }
    told
}

impl Table {
    pub(super) fn new(shards: usize, sizing: Sizing) -> Self {
        Table {
            shards: (0..shards.next_power_of_two())
                .map(|_| Mutex::new(HashTable::new()))
                .collect(),
            generations: AtomicU64::new(0),
            hasher: foldhash::fast::RandomState::default(),
            sizing,
        }
    }

    fn hash(&self, key: &[u8], ids: &[u64]) -> u64 {
        self.hasher.hash_one((key, ids))
    }

    fn shard(&self, key: &[u8]) -> &Mutex<HashTable<Entry>> {
        // Every set of policies of one key in one shard, so a reset finds them all.
        let hash = self.hasher.hash_one(key);
        &self.shards[(hash as usize) & (self.shards.len() - 1)]
    }

    /// The most units one loan for `policies` may hold: a share of the smallest
    /// capacity, at least one.
    fn most(&self, policies: &[&Policy]) -> u64 {
        let capacity = capacity(policies) as f64;
        ((capacity * self.sizing.max_share) as u64).max(1)
    }

    /// What a horizon refills of the slowest bucket or GCRA among `policies` (0 when
    /// none is one): the least a loan of them must hold to last a horizon.
    ///
    /// A bucket's units go bad as the state refills them (see `units`). Taken while it
    /// is full, a loan of `n` units lasts `n` refills, whatever the demand here. So a
    /// loan sized to the demand alone would go bad before it is spent, and its renewals
    /// would come as often as the refill.
    fn refill(&self, policies: &[&Policy]) -> u64 {
        policies
            .iter()
            .filter(|p| p.algorithm().uses_burst())
            .map(|p| {
                let quota = p.quota();
                let per = u128::from(quota.limit()) * u128::from(self.sizing.horizon);
                u64::try_from(per / u128::from(quota.period_micros().max(1))).unwrap_or(u64::MAX)
            })
            .min()
            .unwrap_or(0)
    }

    /// Decides `request` from a loan if it can, or says what to ask the store. The time
    /// is read from `clock` under the shard's lock, so no unit is spent later than the
    /// time it was checked at. `waited`: the request waited for a loan already (its
    /// demand is counted). `counts` tells the time read and the entry's generation.
    pub(super) fn spend(
        &self,
        request: &Request<'_>,
        clock: &impl crate::Clock,
        waited: bool,
        counts: &mut Counts,
    ) -> Local {
        let Request {
            key,
            ids,
            policies,
            cost,
        } = *request;
        let hash = self.hash(key, ids);
        let mut shard = self.shard(key).lock();
        let now = clock.now_micros();
        counts.now = now;
        let sizing = &self.sizing;
        let entry = match shard.find_mut(hash, |e| e.is(hash, key, ids)) {
            Some(entry) => entry,
            None => {
                if shard.len() >= sizing.per_shard {
                    let idle = sizing.idle;
                    shard.retain(|e| {
                        let keep = now.saturating_sub(e.used) < idle;
                        if !keep {
                            counts.expired += e.loans.iter().map(Loan::unspent).sum::<u64>();
                        }
                        keep
                    });
                    if shard.len() >= sizing.per_shard {
                        return Local::Pass;
                    }
                }
                let entry = Entry {
                    hash,
                    key: key.into(),
                    ids: ids.into(),
                    policies: policies.iter().map(|&p| p.clone()).collect(),
                    generation: self.generations.fetch_add(1, Ordering::Relaxed),
                    since: now,
                    seen: 0,
                    per_horizon: 0,
                    loans: SmallVec::new(),
                    asking: None,
                    dry: None,
                    used: now,
                };
                shard.insert_unique(hash, entry, |e| e.hash).into_mut()
            }
        };
        counts.generation = entry.generation;
        if !waited {
            entry.observe(now, cost, sizing);
        }
        counts.expired += entry.drop_spent(now);
        let most = self.most(policies);
        let ask = entry.per_horizon.max(self.refill(policies)).clamp(1, most);
        let hot = entry.per_horizon >= sizing.min_units && ask >= sizing.min_units;
        if let Some(decisions) = spend_from(&mut entry.loans, now, cost) {
            let good: u64 = entry.loans.iter().map(|loan| loan.good(now)).sum();
            // Half a loan left: ask for the next one now, so that it comes before this
            // one runs out.
            let renew = (entry.asking.is_none() && 2 * good < ask && hot).then(|| {
                entry.asking = Some(tokio::sync::watch::Sender::new(()));
                ask
            });
            return Local::Spent { decisions, renew };
        }
        if let Some(dry) = &entry.dry {
            // The store was short at its last answer: refused here at once, until a loan
            // comes back whole. Nothing waits on a store that had too little to lend.
            // The loan is asked for in the background once the store's retry time has
            // passed, not before: what the store said ran out stays out here until then,
            // even if the store loses its state (a flush, a restart, a failover to a
            // replica behind) and would lend it again. Past that time, a key no longer
            // hot (or with nothing asked) goes the usual way.
            if now < dry.until || (entry.asking.is_some() || hot) {
                let decisions = dry.refusal(now);
                let renew = (entry.asking.is_none() && hot && now >= dry.until).then(|| {
                    entry.asking = Some(tokio::sync::watch::Sender::new(()));
                    ask
                });
                return Local::Refused { decisions, renew };
            }
            entry.dry = None;
        }
        if let Some(asking) = &entry.asking {
            // Waiting once: a loan too small for every waiter sends the rest to the store.
            return if waited {
                Local::Pass
            } else {
                Local::Wait(asking.subscribe())
            };
        }
        // Cold: too little demand here for a loan to pay.
        if !hot {
            return Local::Pass;
        }
        entry.asking = Some(tokio::sync::watch::Sender::new(()));
        let ask = ask.max(cost);
        Local::Lend(ask)
    }

    /// Keeps the units of `loan` for the key, and what the store said if it was short
    /// (`dry`); ends the call's asking. Nothing, when the entry is not the one the call
    /// was made for (`generation`: it was forgotten and made anew since).
    pub(super) fn lent(
        &self,
        key: &[u8],
        ids: &[u64],
        generation: u64,
        loan: Option<Loan>,
        dry: Option<Dry>,
    ) {
        let hash = self.hash(key, ids);
        let mut shard = self.shard(key).lock();
        if let Some(entry) = shard.find_mut(hash, |e| e.is(hash, key, ids))
            && entry.generation == generation
        {
            entry.asking = None;
            entry.loans.extend(loan);
            entry.dry = dry;
        }
    }

    /// Takes the loans of the keys unused since `since` out of the table: the good
    /// units of a window's loan, to give back; the others' are counted as gone bad.
    pub(super) fn idle_loans(&self, since: u64, now: u64, counts: &mut Counts) -> Vec<GiveBack> {
        let mut back = Vec::new();
        for shard in &self.shards {
            let mut shard = shard.lock();
            for entry in shard
                .iter_mut()
                .filter(|e| e.used < since && !e.loans.is_empty())
            {
                for loan in entry.loans.drain(..) {
                    let good = loan.good(now);
                    if loan.windowed() && good > 0 {
                        counts.expired += loan.unspent() - good;
                        back.push(GiveBack {
                            key: entry.key.clone(),
                            policies: entry.policies.clone(),
                            units: good,
                            ends: loan.ends(),
                        });
                    } else {
                        counts.expired += loan.unspent();
                    }
                }
            }
        }
        back
    }

    /// Ends the key's asking: its call was never sent, failed or was dropped. `dry`: it
    /// was never sent, so nothing will clear the key's shortness: forget it too.
    pub(super) fn unask(&self, key: &[u8], ids: &[u64], generation: u64, dry: bool) {
        let hash = self.hash(key, ids);
        let mut shard = self.shard(key).lock();
        if let Some(entry) = shard.find_mut(hash, |e| e.is(hash, key, ids))
            && entry.generation == generation
        {
            entry.asking = None;
            if dry {
                entry.dry = None;
            }
        }
    }

    /// Forgets every loan of `key`: its state was reset. Returns the units unspent.
    pub(super) fn forget(&self, key: &[u8]) -> u64 {
        let mut shard = self.shard(key).lock();
        let mut unspent = 0;
        shard.retain(|e| {
            let keep = *e.key != *key;
            if !keep {
                unspent += e.loans.iter().map(Loan::unspent).sum::<u64>();
            }
            keep
        });
        unspent
    }

    /// The horizon, in µs.
    pub(super) fn horizon(&self) -> u64 {
        self.sizing.horizon
    }

    /// How many keys and sets of policies the table holds.
    pub(super) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}

/// The most units a request under all of `policies` can take at once: the smallest
/// capacity (the burst of a bucket or GCRA, the limit of a window).
fn capacity(policies: &[&Policy]) -> u64 {
    policies
        .iter()
        .map(|p| capacity_of(p.algorithm(), p.quota()))
        .min()
        .unwrap_or(0)
}

fn capacity_of(algorithm: crate::Algorithm, quota: &crate::Quota) -> u64 {
    if algorithm.uses_burst() {
        quota.burst()
    } else {
        quota.limit()
    }
}
