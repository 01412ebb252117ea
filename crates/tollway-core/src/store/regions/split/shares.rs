//! Shares: what this region knows of each window's demand, and its share of a limit.

use std::collections::HashMap;

use smallvec::SmallVec;

use super::{Inner, Split};

#[derive(Default)]
pub(super) struct Plan {
    /// The window `demand` counts (its start over the period).
    pub(super) window: u64,
    /// Units asked of each key in `window`.
    pub(super) demand: HashMap<Box<[u8]>, u64>,
    /// What this region posted for a window (once a window): what the others take it to
    /// ask.
    pub(super) reported: TwoWindows<Posted>,
    /// This region's shares of a window, fixed before it began.
    pub(super) shares: TwoWindows<Shares>,
}

/// Something for each of at most two windows: the current one and the next, or the last
/// and the current. What is kept for a window never changes while it is current.
pub(super) struct TwoWindows<T>([Option<(u64, T)>; 2]);

impl<T> Default for TwoWindows<T> {
    fn default() -> Self {
        TwoWindows([None, None])
    }
}

impl<T> TwoWindows<T> {
    pub(super) fn get(&self, window: u64) -> Option<&T> {
        self.0
            .iter()
            .flatten()
            .find(|(w, _)| *w == window)
            .map(|(_, t)| t)
    }

    /// Keeps `t` for `window`, in place of what was kept for it or for the older window.
    pub(super) fn put(&mut self, window: u64, t: T) {
        let slot = match &self.0 {
            [Some((w, _)), _] if *w == window => 0,
            [_, Some((w, _))] if *w == window => 1,
            [None, _] => 0,
            [_, None] => 1,
            [Some((a, _)), Some((b, _))] => usize::from(b < a),
        };
        self.0[slot] = Some((window, t));
    }
}

/// What a region posted for a window, as far as this process knows.
pub(super) enum Posted {
    /// These asks (a key not named asked nothing): the others read them or nothing.
    Asks(HashMap<Box<[u8]>, u64>),
    /// Nothing, and nothing will be: the others count it as asking everything.
    Nothing,
    /// Unknown: an earlier process under this name may have posted anything (its board
    /// could not be read at start), so count this region as asking nothing.
    Unsure,
}

impl Posted {
    /// What the others take this region to ask of `key` (`None`: a key it did not name).
    pub(super) fn ask(&self, key: Option<&[u8]>) -> u64 {
        match (self, key) {
            (Posted::Asks(asks), Some(key)) => asks.get(key).copied().unwrap_or(0),
            (Posted::Asks(_) | Posted::Unsure, _) => 0,
            (Posted::Nothing, _) => UNKNOWN,
        }
    }
}

pub(super) struct Shares {
    pub(super) keys: HashMap<Box<[u8]>, u64>,
    /// The share of any key not in `keys`.
    pub(super) other: u64,
}

/// Stands for the demand of a region not heard from: everything.
pub(super) const UNKNOWN: u64 = u64::MAX;

/// A region's share of `limit` when it asks for `own` units and the other regions for
/// `others`: max-min fair. [`UNKNOWN`] stands for a region not heard from.
///
/// Where all asks fit, each region gets its ask and an even part of what is left,
/// rounded down. So a region whose demand has just arrived finds some room. Else each
/// region gets its ask, up to the highest level the limit allows. What is left then is
/// less than a unit a region.
///
/// Asking more elsewhere never grows a share. The shares of all regions, computed from
/// the same asks, add up to at most `limit`. `SplitStore`'s "never over-admits" rests
/// on these two facts. The tests check them exhaustively for small limits.
pub(super) fn share(limit: u64, own: u64, others: &[u64]) -> u64 {
    let regions = others.len() as u64 + 1;
    let asked_at = |level: u64| {
        others.iter().fold(own.min(level), |sum, &ask| {
            sum.saturating_add(ask.min(level))
        })
    };
    // The highest level up to `limit` whose asks fit.
    let (mut fits, mut over) = (0, limit + 1);
    while over - fits > 1 {
        let mid = fits + (over - fits) / 2;
        if asked_at(mid) <= limit {
            fits = mid;
        } else {
            over = mid;
        }
    }
    own.min(fits) + (limit - asked_at(fits)) / regions
}

impl Shares {
    fn of(&self, key: &[u8]) -> u64 {
        self.keys.get(key).copied().unwrap_or(self.other)
    }
}

impl Plan {
    /// What the others take this region to ask of `key` in `window`: its post, or
    /// everything when it posted nothing (nobody can have heard less). A window this
    /// process has no record of is one it did not post for: the store read what an
    /// earlier process had posted for the windows before it started.
    fn asked(&self, window: u64, key: &[u8]) -> u64 {
        self.reported
            .get(window)
            .map_or(UNKNOWN, |posted| posted.ask(Some(key)))
    }
}

impl<S> Inner<S> {
    /// This region's share of `key` under `split` in the window of `now`, counting
    /// `cost` units of demand for it.
    pub(super) fn share(&self, split: &Split, key: &[u8], now: u64, cost: u64) -> u64 {
        let period = split.policy.quota().period_micros();
        let window = now / period;
        let mut plan = split.plan.lock();
        if plan.window != window {
            plan.window = window;
            plan.demand.clear();
        }
        if cost > 0 {
            if let Some(asked) = plan.demand.get_mut(key) {
                *asked += cost;
            } else if plan.demand.len() < self.max_keys {
                plan.demand.insert(key.into(), cost);
            }
        }
        match plan.shares.get(window) {
            Some(shares) => shares.of(key),
            // Nothing fixed before the window began: what this region can count on
            // whatever the others ask.
            None => {
                let others: SmallVec<[u64; 4]> = smallvec::smallvec![UNKNOWN; self.peers.len()];
                let own = plan.asked(window.wrapping_sub(1), key);
                share(split.policy.quota().limit(), own, &others)
            }
        }
    }
}
