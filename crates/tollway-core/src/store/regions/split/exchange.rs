//! The exchange: each window, a region posts its demand on every board, then reads its
//! own and fixes its shares of the next window.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use smallvec::SmallVec;

use super::shares::{Posted, Shares, UNKNOWN, share};
use super::{Inner, Store};
use crate::Policy;
use crate::store::regions::{Board, Failing};

/// A region's post, as read from a board.
struct Post {
    /// The fingerprint of the regions it splits with.
    fingerprint: u64,
    asks: HashMap<Box<[u8]>, u64>,
}

/// The topic of a policy's window on the boards.
pub(super) fn topic(policy: &Policy, window: u64) -> String {
    format!("split:{:016x}:{window}", policy.state_id())
}

/// `asked` in `elapsed` of a window of `period`, as a whole window's worth (rounded up).
fn whole_window(asked: u64, period: u64, elapsed: u64) -> u64 {
    let scaled = (u128::from(asked) * u128::from(period)).div_ceil(u128::from(elapsed.max(1)));
    u64::try_from(scaled).unwrap_or(u64::MAX)
}

impl<S: Store + Board + Clone> Inner<S> {
    /// Posts this region's demand of `window` under split `i`, once a window and only
    /// within it.
    ///
    /// It posts first on its own board, where a later process under its name reads it.
    /// Only once that is written does it post on every peer's. The post is never
    /// repeated. A peer sees it whole or not at all, and never two versions of it.
    ///
    /// The peers' posts are under way when this returns. The collection does not wait
    /// for their answers, which take a round trip. The set ends when each has been
    /// answered or has failed.
    pub(super) async fn report(&self, i: usize, window: u64) -> tokio::task::JoinSet<()> {
        let mut posts = tokio::task::JoinSet::new();
        let split = &self.splits[i];
        let period = split.policy.quota().period_micros();
        let asked = {
            let mut plan = split.plan.lock();
            let now = self.clock.now_micros();
            if now / period != window || plan.reported.get(window).is_some() {
                return posts;
            }
            let elapsed = now - window * period;
            let asked: HashMap<Box<[u8]>, u64> = if plan.window == window {
                plan.demand
                    .iter()
                    .map(|(key, &n)| (key.clone(), whole_window(n, period, elapsed)))
                    .collect()
            } else {
                HashMap::new()
            };
            // Claimed before it is posted, and kept whatever becomes of the posts: a
            // peer reads these asks or counts this region as asking everything.
            plan.reported.put(window, Posted::Asks(asked.clone()));
            asked
        };
        // The region's own name, with the fingerprint of the regions it splits with,
        // says it posted (so a key it did not name asked nothing); each key's ask is
        // under the name, a zero byte, and the key.
        let mut notes = Vec::with_capacity(asked.len() + 1);
        notes.push((self.region.as_bytes().to_vec(), self.fingerprint));
        for (key, n) in asked {
            let mut name = Vec::with_capacity(self.region.len() + 1 + key.len());
            name.extend_from_slice(self.region.as_bytes());
            name.push(0);
            name.extend_from_slice(&key);
            notes.push((name, n));
        }
        let topic = topic(&split.policy, window);
        let keep = Duration::from_micros(period.saturating_mul(3));
        let own = self.local.post(&topic, notes.clone(), keep);
        if !matches!(tokio::time::timeout(self.timeout, own).await, Ok(Ok(()))) {
            let region = &self.region;
            tell(&self.board_failing, false, || {
                format!("region {region}'s own board")
            });
            return posts;
        }
        for ((peer, board), failing) in self.peers.iter().zip(&self.peers_failing) {
            let post = board.post(&topic, notes.clone(), keep);
            let (peer, timeout, failing) = (peer.clone(), self.timeout, Arc::clone(failing));
            posts.spawn(async move {
                let posted = matches!(tokio::time::timeout(timeout, post).await, Ok(Ok(())));
                tell(&failing, posted, || format!("peer {peer}'s board"));
            });
        }
        posts
    }

    /// The posts on this region's board for `window` under split `i`, by region: the
    /// fingerprint of the region set each poster splits with, and its asks; `Err` when
    /// the board could not be read.
    async fn read_board(&self, i: usize, window: u64) -> Result<HashMap<Vec<u8>, Post>, ()> {
        let read = self.local.read(&topic(&self.splits[i].policy, window));
        let Ok(Ok(notes)) = tokio::time::timeout(self.timeout, read).await else {
            let region = &self.region;
            tell(&self.board_failing, false, || {
                format!("region {region}'s own board")
            });
            return Err(());
        };
        tell(&self.board_failing, true, String::new);
        let mut posted: HashMap<Vec<u8>, Post> = HashMap::new();
        for (name, n) in &notes {
            if !name.contains(&0) {
                posted.insert(
                    name.clone(),
                    Post {
                        fingerprint: *n,
                        asks: HashMap::new(),
                    },
                );
            }
        }
        for (name, n) in notes {
            let Some(zero) = name.iter().position(|&b| b == 0) else {
                continue;
            };
            if let Some(post) = posted.get_mut(&name[..zero]) {
                post.asks.insert(name[zero + 1..].into(), n);
            }
        }
        Ok(posted)
    }

    /// Reads this region's board for `window` under split `i`, and fixes this region's
    /// shares of the next window. It does so only while `window` lasts. So a window's
    /// shares never change once it has begun. A window this region has not posted for by
    /// then is closed: it will post nothing for it.
    pub(super) async fn collect(&self, i: usize, window: u64) {
        let split = &self.splits[i];
        let period = split.policy.quota().period_micros();
        let mut posted = self.read_board(i, window).await.unwrap_or_default();
        // Each peer's asks; `None`: not heard from, or splitting with other regions.
        let asks: Vec<Option<HashMap<Box<[u8]>, u64>>> = self
            .peers
            .iter()
            .map(|(name, _)| {
                let post = posted.remove(name.as_bytes())?;
                if post.fingerprint != self.fingerprint {
                    tracing::warn!(
                        region = %self.region,
                        peer = %name,
                        "split store: a peer splits with other regions than this one does; \
                         counting it as asking for everything"
                    );
                    return None;
                }
                Some(post.asks)
            })
            .collect();
        let own = {
            let mut plan = split.plan.lock();
            if plan.reported.get(window).is_none() {
                plan.reported.put(window, Posted::Nothing);
            }
            match plan.reported.get(window) {
                Some(Posted::Asks(asks)) => Posted::Asks(asks.clone()),
                Some(Posted::Unsure) => Posted::Unsure,
                Some(Posted::Nothing) | None => Posted::Nothing,
            }
        };
        let limit = split.policy.quota().limit();
        let share_of = |key: Option<&[u8]>| {
            let others: SmallVec<[u64; 4]> = asks
                .iter()
                .map(|asked| match (asked, key) {
                    (None, _) => UNKNOWN,
                    (Some(asked), Some(key)) => asked.get(key).copied().unwrap_or(0),
                    (Some(_), None) => 0,
                })
                .collect();
            share(limit, own.ask(key), &others)
        };
        let mut keys: HashMap<Box<[u8]>, u64> = HashMap::new();
        let own_keys = match &own {
            Posted::Asks(asks) => Some(asks.keys()),
            Posted::Nothing | Posted::Unsure => None,
        };
        let named = own_keys
            .into_iter()
            .flatten()
            .chain(asks.iter().flatten().flat_map(HashMap::keys));
        for key in named {
            if !keys.contains_key(key) {
                keys.insert(key.clone(), share_of(Some(key)));
            }
        }
        let shares = Shares {
            keys,
            other: share_of(None),
        };
        let mut plan = split.plan.lock();
        if self.clock.now_micros() / period == window {
            plan.shares.put(window + 1, shares);
        }
    }

    /// What an earlier process under this region's name posted for the window before
    /// `now`'s and for `now`'s.
    ///
    /// It is read from this region's board, where a post goes before any peer's. So this
    /// process neither posts a second version, nor counts as none a post the others
    /// read.
    pub(super) async fn recover(&self, i: usize) {
        let period = self.splits[i].policy.quota().period_micros();
        let window = self.clock.now_micros() / period;
        for w in [window.saturating_sub(1), window] {
            let posted = match self.read_board(i, w).await {
                // Whatever region set it was posted with: the others may have read it.
                Ok(mut posted) => match posted.remove(self.region.as_bytes()) {
                    Some(post) => Posted::Asks(post.asks),
                    // Nothing posted: this process may post for the window.
                    None => continue,
                },
                Err(()) => Posted::Unsure,
            };
            self.splits[i].plan.lock().reported.put(w, posted);
        }
    }
}

/// Logs a board's answer: at warn when it starts failing and when it answers again,
/// at debug for each failure in between. `board` names it.
fn tell(failing: &Failing, ok: bool, board: impl FnOnce() -> String) {
    if ok {
        if failing.answered() {
            tracing::warn!(board = %board(), "split store: the board answers again");
        }
    } else if failing.failed() {
        tracing::warn!(
            board = %board(),
            "split store: the board failed; this region decides on what it knows until it answers"
        );
    } else {
        tracing::debug!(board = %board(), "split store: the board failed again");
    }
}

/// Split `i`'s exchange: in every window, its report `lead` before the end and its
/// collection half the lead later, while the store lives. Times are the store's clock's,
/// waited out on tokio's timer.
pub(super) async fn exchange_forever<S: Store + Board + Clone>(store: Weak<Inner<S>>, i: usize) {
    let wait = |micros: u64| tokio::time::sleep(Duration::from_micros(micros));
    loop {
        let Some((now, period, lead)) = store.upgrade().map(|inner| {
            let split = &inner.splits[i];
            let period = split.policy.quota().period_micros();
            (inner.clock.now_micros(), period, split.lead)
        }) else {
            return;
        };
        let window = now / period;
        let end = (window + 1) * period;
        if now < end - lead {
            wait(end - lead - now).await;
            let Some(inner) = store.upgrade() else { return };
            inner.report(i, window).await.detach_all();
            let now = inner.clock.now_micros();
            drop(inner);
            wait((end - lead / 2).saturating_sub(now)).await;
            let Some(inner) = store.upgrade() else { return };
            inner.collect(i, window).await;
        }
        let Some(now) = store.upgrade().map(|inner| inner.clock.now_micros()) else {
            return;
        };
        // On to the next window (at least a microsecond on: a clock that does not move
        // with tokio's timer must not make this spin).
        wait(end.saturating_sub(now).max(1)).await;
    }
}
