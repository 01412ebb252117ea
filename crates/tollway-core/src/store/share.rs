//! Shares: a policy's rate divided among holders that each decide alone.
//!
//! A holder (an Envoy's quota bucket, for tollway-server) enforces a token bucket of its
//! own: a rate and a size. Rates are max-min fair by the demands holders last reported,
//! and what no demand takes is divided evenly. The store keeps a ledger a key: every holder's share, and a
//! pool that pays for new buckets. Each holder asks again before its share runs out.
//!
//! The ledger keeps two sums within the policy's quota:
//! - the holders' rates sum to no more than the policy's rate, less a reserve (a 64th of
//!   the limit, at least 1 unit);
//! - the pool and every holder's size sum to no more than the burst.
//!
//! A new bucket starts full, so a holder's new (or changed) share is paid from the pool,
//! which refills at the rate no holder holds. So across all holders, in any window of
//! time `T`, at most `burst + limit × T / period` units are spent: what one bucket of the
//! policy would admit. This holds while each holder stops at its share's end. A ledger
//! whose shares all ended keeps its pool until the reserve alone would have refilled
//! it: a holder that gives its share back and asks again pays for its new bucket.
//!
//! ```
//! use std::time::Duration;
//! use tollway_core::{Algorithm, ManualClock, MemoryStore, Policy, Quota, ShareAsk, Store};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MemoryStore::builder().clock(ManualClock::new()).build()?;
//! let policy = Policy::new("api", Algorithm::TokenBucket, Quota::per_second(640)?)?;
//! let hold = Duration::from_secs(10);
//!
//! // One busy holder takes what is not reserved.
//! let a = store.share(b"k", &policy, &ShareAsk::new("a", 1_000, hold)).expect("shares").await?;
//! assert_eq!((a.rate(), a.size(), a.is_new()), (630, 79, true));
//!
//! // A second is given what is free now (nothing), and its demand is noted: the first
//! // gives half back when it asks again.
//! let b = store.share(b"k", &policy, &ShareAsk::new("b", 1_000, hold)).expect("shares").await?;
//! assert_eq!(b.rate(), 0);
//! let a = store.share(b"k", &policy, &ShareAsk::new("a", 1_000, hold)).expect("shares").await?;
//! assert_eq!(a.rate(), 315);
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::{ConfigError, Policy};

/// The future of a [`Store::share`](super::Store::share).
pub type ShareFuture =
    Pin<Box<dyn Future<Output = Result<Share, crate::StoreError>> + Send + 'static>>;

/// The reserve: a `RESERVE_PART`th of the limit (at least 1) is never held, so the pool
/// refills even when every holder is busy.
pub const RESERVE_PART: u64 = 64;

/// A share's size is its part of the burst divided by `SIZE_PART`: the rest of the burst
/// is the pool's, to pay for new buckets.
pub const SIZE_PART: u64 = 8;

/// The smallest bucket of a share: a bucket of one token refills while full between
/// requests that come at its rate, and wastes much of it.
pub const MIN_SIZE: u64 = 2;

/// The most holders a key's ledger keeps; another is given nothing.
pub const MAX_HOLDERS: usize = 256;

/// While the pool is under half its room, a share changes only by more than its
/// `CHANGE_PART`th: each change costs a new bucket.
pub const CHANGE_PART: u64 = 8;

/// The longest a holder may hold a share without asking again.
pub const MAX_HOLD: Duration = Duration::from_secs(3_600);

/// What a holder asks of a key's ledger.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareAsk {
    holder: String,
    demand: u64,
    hold_ms: u64,
}

impl ShareAsk {
    /// A share for `holder`, which wants `demand` units a period of the policy, held for
    /// `hold` (at most [`MAX_HOLD`]) from when the store decides.
    #[must_use]
    pub fn new(holder: impl Into<String>, demand: u64, hold: Duration) -> Self {
        let hold_ms = u64::try_from(hold.min(MAX_HOLD).as_millis()).unwrap_or(u64::MAX);
        ShareAsk {
            holder: holder.into(),
            demand: demand.min(crate::MAX_UNITS),
            hold_ms: hold_ms.max(1),
        }
    }

    /// `holder` gives its share back: it enforces it no more.
    #[must_use]
    pub fn release(holder: impl Into<String>) -> Self {
        ShareAsk {
            holder: holder.into(),
            demand: 0,
            hold_ms: 0,
        }
    }

    /// Who asks.
    #[must_use]
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Units a period it wants.
    #[must_use]
    pub fn demand(&self) -> u64 {
        self.demand
    }

    /// For how long, in ms; 0 gives the share back.
    #[must_use]
    pub fn hold_ms(&self) -> u64 {
        self.hold_ms
    }
}

/// A holder's share: a token bucket of `size` that refills `rate` units a period of the
/// policy, until `until`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    rate: u64,
    size: u64,
    new: bool,
    until_ms: u64,
}

impl Share {
    /// A share as a store's reply says it.
    #[must_use]
    pub fn new(rate: u64, size: u64, new: bool, until_ms: u64) -> Self {
        Share {
            rate,
            size,
            new,
            until_ms,
        }
    }

    /// Units a period of the policy. 0: the holder admits nothing.
    #[must_use]
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// The most units its bucket holds.
    #[must_use]
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether the ledger paid for a new bucket: the holder installs this one, full.
    /// Otherwise it keeps the bucket it has, with what is left in it.
    #[must_use]
    pub fn is_new(&self) -> bool {
        self.new
    }

    /// When it ends, in ms on the store's clock. The holder stops before then.
    #[must_use]
    pub fn until_ms(&self) -> u64 {
        self.until_ms
    }
}

/// Whether `policy` can be shared: a bucket algorithm (token bucket, GCRA, the leaky
/// meter), a period of fixed length, and numbers the ledger keeps exactly.
///
/// # Errors
///
/// Says why not, and what to change.
pub fn shareable(policy: &Policy) -> Result<(), ConfigError> {
    use crate::Algorithm;
    let quota = policy.quota();
    let name = policy.name();
    match policy.algorithm() {
        Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket => {}
        Algorithm::FixedWindow
        | Algorithm::SlidingWindowLog
        | Algorithm::SlidingWindowCounter
        | Algorithm::LeakyBucketShaper
        | Algorithm::Concurrency => {
            return Err(ConfigError::new(format!(
                "policy {name:?} is {}: a shared policy is divided into token buckets; \
                 give it algorithm = \"token_bucket\", \"gcra\" or \"leaky_bucket\"",
                policy.algorithm().name()
            )));
        }
    }
    if quota.calendar().is_some() {
        return Err(ConfigError::new(format!(
            "policy {name:?} has a calendar period: a shared policy has a fixed one"
        )));
    }
    let terms = Terms::of(policy);
    if terms.limit < 2
        || terms.burst < MIN_SIZE
        || terms.period_ms == 0
        || !quota.period_micros().is_multiple_of(1_000)
    {
        return Err(ConfigError::new(format!(
            "policy {name:?} cannot be shared: give it a limit and a burst of 2 or more \
             and a period of whole milliseconds"
        )));
    }
    let exact = |a: u64, b: u64| u128::from(a) * u128::from(b) < 1 << 53;
    if !exact(terms.burst, terms.period_ms) || !exact(terms.limit, terms.burst) {
        return Err(ConfigError::new(format!(
            "policy {name:?} is too large to share exactly: its burst times its period in \
             ms, and its limit times its burst, are each under 2^53"
        )));
    }
    Ok(())
}

/// A policy's numbers, as the ledger reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Terms {
    pub(crate) limit: u64,
    pub(crate) period_ms: u64,
    pub(crate) burst: u64,
}

impl Terms {
    pub(crate) fn of(policy: &Policy) -> Self {
        let quota = policy.quota();
        Terms {
            limit: quota.limit(),
            period_ms: quota.period_micros() / 1_000,
            burst: quota.burst(),
        }
    }
}

/// A holder's entry in a ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holding {
    pub(crate) rate: u64,
    pub(crate) size: u64,
    pub(crate) demand: u64,
    pub(crate) until: u64,
}

/// A key's ledger: the pool (units × the period in ms), when it was last brought up to
/// date (ms), and the holders.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Ledger {
    pub(crate) pool: u64,
    pub(crate) at: Option<u64>,
    pub(crate) holdings: BTreeMap<String, Holding>,
}

impl Ledger {
    /// Whether it decides as a fresh one would: no holder, and a full pool.
    pub(crate) fn is_fresh(&self, terms: Terms) -> bool {
        self.holdings.is_empty() && self.pool == terms.burst * terms.period_ms
    }

    /// When it surely decides as a fresh one, in ms: its last share's end, and then the
    /// time the reserve alone takes to refill the whole pool. A Redis ledger expires
    /// then.
    pub(crate) fn forgotten_at(&self, terms: Terms) -> u64 {
        let last = self
            .holdings
            .values()
            .map(|h| h.until)
            .max()
            .unwrap_or(0)
            .max(self.at.unwrap_or(0));
        last.saturating_add(refill_ms(terms))
    }
}

/// The max-min fair part of `capacity` for a demand of `mine` among `others`: the
/// smallest demands are met first, ties by holder; what no demand takes is divided
/// evenly, so a holder has room to grow until its next ask.
fn fair(capacity: u64, mine: (&str, u64), others: &[(&str, u64)]) -> u64 {
    let mut all: Vec<(u64, &str)> = others.iter().map(|&(h, d)| (d, h)).collect();
    all.push((mine.1, mine.0));
    all.sort_unstable();
    let count = all.len() as u64;
    let mut left = capacity;
    let mut n = count;
    let mut part_of_mine = 0;
    for (demand, holder) in all {
        let part = demand.min(left / n);
        if holder == mine.0 {
            part_of_mine = part;
        }
        left -= part;
        n -= 1;
    }
    part_of_mine + left / count
}

/// The time the reserve alone takes to refill a whole pool, in ms.
fn refill_ms(terms: Terms) -> u64 {
    let reserve = terms.limit.div_ceil(RESERVE_PART);
    (terms.burst * terms.period_ms).div_ceil(reserve)
}

/// The size of a bucket of `rate`.
fn size_of(rate: u64, terms: Terms) -> u64 {
    if rate == 0 {
        return 0;
    }
    let scaled = u128::from(rate) * u128::from(terms.burst);
    let part = u128::from(terms.limit) * u128::from(SIZE_PART);
    u64::try_from(scaled.div_ceil(part))
        .unwrap_or(u64::MAX)
        .max(MIN_SIZE)
}

/// Decides `ask` at `now` (ms) on `ledger`: the pure twin of `lua/share.lua`.
pub(crate) fn decide(ledger: &mut Ledger, now: u64, terms: Terms, ask: &ShareAsk) -> Share {
    let Terms {
        limit,
        period_ms,
        burst,
    } = terms;
    // The pool refills at the rate no holder holds, up to what the sizes leave.
    let rates: u64 = ledger.holdings.values().map(|h| h.rate).sum();
    let sizes: u64 = ledger.holdings.values().map(|h| h.size).sum();
    let cap = burst.saturating_sub(sizes) * period_ms;
    match ledger.at {
        None => ledger.pool = cap,
        Some(at) => {
            let gained =
                u128::from(now.saturating_sub(at)) * u128::from(limit.saturating_sub(rates));
            if gained >= u128::from(cap.saturating_sub(ledger.pool)) {
                ledger.pool = cap;
            } else {
                // Below the cap, which is below 2^53.
                ledger.pool += gained as u64;
            }
            ledger.pool = ledger.pool.min(cap);
        }
    }
    ledger.at = Some(ledger.at.map_or(now, |at| at.max(now)));
    ledger.holdings.retain(|_, h| h.until > now);
    if ask.hold_ms == 0 {
        ledger.holdings.remove(&ask.holder);
        return Share::new(0, 0, false, now);
    }
    let until = now + ask.hold_ms;
    let held = ledger.holdings.get(&ask.holder).copied();
    if held.is_none() && ledger.holdings.len() >= MAX_HOLDERS {
        return Share::new(0, 0, false, until);
    }
    let (rate, size) = held.map_or((0, 0), |h| (h.rate, h.size));
    let others: Vec<(&str, u64)> = ledger
        .holdings
        .iter()
        .filter(|(h, _)| **h != ask.holder)
        .map(|(h, held)| (h.as_str(), held.demand))
        .collect();
    let held_by_others: u64 = ledger
        .holdings
        .iter()
        .filter(|(h, _)| **h != ask.holder)
        .map(|(_, held)| held.rate)
        .sum();
    let sized_by_others: u64 = ledger
        .holdings
        .iter()
        .filter(|(h, _)| **h != ask.holder)
        .map(|(_, held)| held.size)
        .sum();
    let capacity = limit - limit.div_ceil(RESERVE_PART);
    let free = capacity.saturating_sub(held_by_others);
    let mut target = fair(capacity, (&ask.holder, ask.demand), &others).min(free);
    // Near enough, while the pool is low: keep the bucket it has. A pool past half its
    // room pays for the change.
    let room = burst.saturating_sub(sized_by_others + size) * period_ms;
    let low = u128::from(ledger.pool) * 2 < u128::from(room);
    if low && rate > 0 && target > 0 && rate <= free && rate.abs_diff(target) * CHANGE_PART <= rate
    {
        target = rate;
    }
    let wanted = size_of(target, terms);
    let cost = wanted * period_ms;
    let over = rate > free;
    let fits = sized_by_others + wanted <= burst;
    let paid = target == 0 || ledger.pool >= cost || over;
    let (rate, size, new) = if (target, wanted) == (rate, size) {
        (rate, size, false)
    } else if fits && paid {
        ledger.pool = ledger.pool.saturating_sub(cost);
        (target, wanted, true)
    } else {
        (rate, size, false)
    };
    ledger.holdings.insert(
        ask.holder.clone(),
        Holding {
            rate,
            size,
            demand: ask.demand,
            until,
        },
    );
    let sizes = sized_by_others + size;
    ledger.pool = ledger.pool.min(burst.saturating_sub(sizes) * period_ms);
    Share::new(rate, size, new, until)
}

#[cfg(test)]
mod tests;
