//! Cells that threads read and update without a lock.
//!
//! The cells are the memory store's home for the states that fit in one 64-bit word.
//! GCRA's and the leaky bucket shaper's state is an instant. The buckets', the fixed
//! window's and the sliding window counter's states are packed: see
//! [`word`](super::word).
//!
//! # Levels
//!
//! A shard's cells are a few open-addressing tables, called *levels*. Each level is half
//! as large again as the one before. Each is allocated once and kept until the store is
//! dropped. So a thread can hold a reference into one without a lock or a reclamation
//! scheme.
//!
//! A key has one cell at most. A lookup first reads its home cell in every level. These
//! reads do not wait for one another. Then it probes the levels, newest first.
//!
//! A level is one allocation for up to 64 shards at a time. The first level, for all of
//! them, is made with the store. Which levels each shard uses is a byte beside the other
//! shards' bytes. A lookup reads nothing of its shard but its cells and that byte. The
//! other lines it reads are the store's table of levels and the bytes. Many shards share
//! those lines, so they stay in the processor's cache. `benches/check_instructions.sh`
//! counts the misses, and `benches/key_count.rs` the time.
//!
//! A level keeps eight keys on one cache line and their eight states on the next. Looking
//! a key up reads only key words, which change when a key comes or goes. A check writes
//! only its own state word. So checks on different keys write no line but the states'.
//! The processor fetches a key's line and its state's line together, as a 128-byte pair.
//! `BENCHMARKS.md` ("Tried and dropped") measures keys beside their states.
//!
//! # Who writes what
//!
//! Without the lock, a state word changes only by compare-and-swap. Everything else
//! happens under the shard's lock: a key word, and a state's plain stores and swaps.
//! Every caller of [`Cells::insert`], [`Cells::remove`], [`Cells::sweep`],
//! [`Cells::pin`] and [`Cells::has_vacancy`] holds that lock. The `Meta` they take is kept
//! behind it.
//!
//! Insertion writes the state, then the key (release). Removal swaps the state for
//! [`REMOVED`], then marks the key a tombstone. A later insertion reuses a tombstone. Or
//! the tombstone is emptied once no probe passes through it.
//!
//! # Decisions under the lock
//!
//! Some requests are decided under the lock: several limits, or an operation such as a
//! charge. Such a request *pins* each cell it reads. It swaps the state for `REMOVED`.
//! So every check without the lock that meets the cell meanwhile fails, and waits for the
//! lock. When done, the request stores the state to keep. If it changed nothing, that is
//! the state it pinned.
//!
//! A state may instead move out of the cells, because it no longer packs in a word. Then
//! the request takes the cell away with [`Pinned::remove`]. The state stays `REMOVED`, and
//! the key becomes a tombstone.
//!
//! Between the pin and that store, nothing else writes the cell. So the locked decision
//! is made on the state as it is, and is never undone.
//!
//! # Why a stale reader cannot write a wrong cell
//!
//! A reader finds the key, reads the state (acquire), then reads the key again. Say the
//! cell was removed, or emptied and given to another key. Then the cell fails that check
//! or holds `REMOVED`. The reader gives up, and the store takes its shard's lock.
//!
//! One case remains. A reader read a state of another key's tenure. Then it saw its own
//! key back (removed, reinserted) before its compare-and-swap. That compare-and-swap
//! succeeds only if the cell's word is the one it read.
//!
//! Every state is stored XORed with its key. The key here is 63 random bits of a hash,
//! from the store's hasher seeded per store, and a bit that says how the state is
//! written. So two keys' words agree by chance only, with probability 2⁻⁶³ per such race.
//! A state may happen to equal `REMOVED`'s pattern, by a chance as small. Checks of that
//! key then go through the lock.
//!
//! The transitions are checked by `loom` for two and three threads. Run
//! `RUSTFLAGS="--cfg tollway_loom" cargo test -p tollway-core --release --lib loom`.

use std::sync::OnceLock;

use super::word;

#[cfg(tollway_loom)]
use loom::sync::atomic::{AtomicU8, AtomicU64, Ordering, fence};
#[cfg(not(tollway_loom))]
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering, fence};

/// A key word no key has yet.
const EMPTY: u64 = 0;
/// A key word whose key was removed: probes pass over it.
const TOMB: u64 = 1;
/// The state word of a cell being removed.
const REMOVED: u64 = u64::MAX;
/// Cells in a shard's first level. (Four under loom, whose models grow with every atomic
/// a sweep reads.)
const FIRST: usize = if cfg!(tollway_loom) { 4 } else { 16 };

/// Cells in each level: [`FIRST`], then half as many again each time, in whole blocks.
/// Levels growing by half keep a key in 21 to 33 bytes of cells once a shard holds a
/// few hundred keys. Doubling would take 21 to 43. The cost is one level more to look
/// in.
const CAPS: [usize; LEVELS] = {
    let mut caps = [FIRST; LEVELS];
    let mut n = 1;
    while n < LEVELS {
        caps[n] = (caps[n - 1] * 3 / 2).div_ceil(BLOCK / 2) * (BLOCK / 2);
        n += 1;
    }
    caps
};

/// Keys a level of `cap` cells takes before the next one is made: three quarters.
///
/// So every probe meets an empty cell, and soon. A lookup may miss a level: its key
/// lives in an older one, or is new. It then probes the level to an empty cell. That is
/// about 8 cells on average in a level three quarters full, and 32 in one seven eighths
/// full. `BENCHMARKS.md` has what each costs a check and a key.
const fn room(cap: usize) -> usize {
    cap * 3 / 4
}

/// The home of `key` in a level of `cap` cells: its low 32 bits scaled to `cap` (the
/// store picks a shard with higher bits).
#[inline]
fn home(key: u64, cap: usize) -> usize {
    (((key & 0xffff_ffff) * cap as u64) >> 32) as usize
}

/// The cells of a store's shards. A level's cells for a segment of shards (up to
/// [`SEGMENT`]) are one allocation, a run of `cap` cells a shard. A lookup reads nothing
/// of its shard but its cells and its byte of `used` (and this struct, the same for every
/// shard, which stays in the processor's cache).
pub(crate) struct Levels {
    /// How many levels each shard uses (has or had keys in), the first included: the
    /// levels its lookups read. A byte a shard, side by side, so that lookups in
    /// neighbouring shards read the same line or two; raised by the holder of the
    /// shard's lock.
    used: Box<[AtomicU8]>,
    /// How many levels a shard's bound allows.
    limit: usize,
    /// The first level, made with the store.
    first: Box<[Block]>,
    /// The levels after the first, by segments of `segment` shards: level `n`'s segment
    /// `j` is `more[(n - 1) × segments + j]`, made when a key of one of its shards first
    /// needs it.
    more: Box<[OnceLock<Box<[Block]>>]>,
    /// Segments a level has.
    segments: usize,
    /// Shards a segment has: `1 << shift`.
    shift: u32,
}

/// The most shards whose cells of a level are made together, in one allocation.
///
/// For the largest level a shard may have, that allocation is at most
/// [`SEGMENT_BYTES`]. The thread that needs a segment first makes it, holding its
/// shard's lock. So a segment bounds how long that one check takes. A level's cells for
/// all 1,024 shards at once would be 8–12 MB.
const SEGMENT: usize = 64;
const SEGMENT_BYTES: usize = 4 << 20;

/// A shard's cells.
#[derive(Clone, Copy)]
pub(crate) struct Cells<'a> {
    levels: &'a Levels,
    shard: usize,
}

/// Levels a shard may have.
const LEVELS: usize = 24;

/// The most keys a shard may be bounded to: its levels hold twice as many.
pub(crate) const MAX_SHARD_KEYS: usize = {
    let (mut n, mut keys) = (0, 0);
    while n < LEVELS {
        keys += room(CAPS[n]);
        n += 1;
    }
    keys / 2
};

/// What the shard's lock guards of its cells: how many keys they hold, and how many
/// cells of each level hold a key or a tombstone.
#[derive(Debug)]
pub(crate) struct Meta {
    live: usize,
    used: Box<[usize]>,
}

/// A level of a shard's cells.
#[derive(Clone, Copy)]
struct Level<'a> {
    /// `cap / 8` blocks: cells `8b..8b + 8`'s keys, then their states. Whole aligned
    /// line pairs, so that nothing else shares a line with the states checks write.
    blocks: &'a [Block],
}

/// Words in a [`Block`]: 128 bytes, the pair of lines x86's adjacent-line prefetcher
/// fetches together (under loom, a first level's cells).
const BLOCK: usize = 2 * if FIRST < 8 { FIRST } else { 8 };

#[repr(align(128))]
struct Block([AtomicU64; BLOCK]);

/// A key's cell, found without a lock.
struct Cell<'a> {
    level: Level<'a>,
    /// The level's place among the shard's levels.
    n: usize,
    index: usize,
    key: u64,
}

/// A state as read, and the word it was read from (what a replacement expects).
#[derive(Clone, Copy)]
struct Loaded {
    stored: u64,
    state: u64,
}

impl Block {
    fn new() -> Self {
        Block(std::array::from_fn(|_| AtomicU64::new(EMPTY)))
    }
}

/// The blocks of `n` levels of `cap` cells.
fn blocks(n: usize, cap: usize) -> Box<[Block]> {
    (0..n * cap.div_ceil(BLOCK / 2))
        .map(|_| Block::new())
        .collect()
}

impl<'a> Level<'a> {
    fn cap(&self) -> usize {
        self.blocks.len() * (BLOCK / 2)
    }

    /// The cell after `i`, the first after the last.
    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.cap() { 0 } else { i + 1 }
    }

    /// The cell before `i`, the last before the first.
    fn prev(&self, i: usize) -> usize {
        if i == 0 { self.cap() - 1 } else { i - 1 }
    }

    /// How many cells on from `from` `to` is, going round.
    fn distance(&self, from: usize, to: usize) -> usize {
        (to + self.cap() - from) % self.cap()
    }

    fn key(&self, i: usize) -> &'a AtomicU64 {
        &self.blocks[i / (BLOCK / 2)].0[i % (BLOCK / 2)]
    }

    fn state(&self, i: usize) -> &'a AtomicU64 {
        &self.blocks[i / (BLOCK / 2)].0[BLOCK / 2 + i % (BLOCK / 2)]
    }

    /// The cell of `key` in this level: linear probing from its home to an empty cell.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let mut i = home(key, self.cap());
        for _ in 0..self.cap() {
            match self.key(i).load(Ordering::Acquire) {
                k if k == key => return Some(i),
                EMPTY => return None,
                _ => i = self.next(i),
            }
        }
        None
    }

    /// Where `key` would go: the first tombstone on its probe, else the empty cell that
    /// ends it (`true`: a cell not used before).
    fn vacancy(&self, key: u64) -> Option<(usize, bool)> {
        let mut i = home(key, self.cap());
        for _ in 0..self.cap() {
            match self.key(i).load(Ordering::Relaxed) {
                TOMB => return Some((i, false)),
                EMPTY => return Some((i, true)),
                _ => i = self.next(i),
            }
        }
        None
    }
}

impl Cell<'_> {
    /// The cell's state now, or `None` when the cell no longer holds its key (removed,
    /// or given to another key since it was found).
    #[inline]
    fn load(&self) -> Option<Loaded> {
        let stored = self.level.state(self.index).load(Ordering::Acquire);
        if stored == REMOVED || self.level.key(self.index).load(Ordering::Acquire) != self.key {
            return None;
        }
        Some(Loaded {
            stored,
            state: stored ^ self.key,
        })
    }

    /// Stores `next` if the cell still holds what `loaded` read.
    #[inline]
    fn replace(&self, loaded: Loaded, next: u64) -> bool {
        self.level
            .state(self.index)
            .compare_exchange(
                loaded.stored,
                next ^ self.key,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }
}

impl Levels {
    /// Cells for `shards` shards of at most `max` keys each: enough levels for twice that
    /// many, which leaves room for tombstones. The first is made now; the others when a
    /// key needs them.
    ///
    /// `max` is at most [`MAX_SHARD_KEYS`].
    pub(crate) fn new(shards: usize, max: usize) -> Self {
        let (mut levels, mut keys) = (1, room(FIRST));
        while levels < LEVELS && keys < 2 * max.max(1) {
            keys += room(CAPS[levels]);
            levels += 1;
        }
        // Shards a segment has: as many as SEGMENT_BYTES of the largest level hold, at
        // most SEGMENT and the shards, rounded down to a power of two (as the shards are).
        let largest = CAPS[levels - 1] * 2 * size_of::<u64>();
        let segment = (SEGMENT_BYTES / largest).clamp(1, SEGMENT.min(shards.max(1)));
        let shift = segment.ilog2();
        let segments = shards.div_ceil(1 << shift);
        Levels {
            used: (0..shards).map(|_| AtomicU8::new(1)).collect(),
            limit: levels,
            first: blocks(shards, FIRST),
            more: (0..(levels - 1) * segments)
                .map(|_| OnceLock::new())
                .collect(),
            segments,
            shift,
        }
    }

    /// Shard `shard`'s cells.
    #[inline]
    pub(crate) fn shard(&self, shard: usize) -> Cells<'_> {
        debug_assert!(
            shard < self.used.len(),
            "shard {shard} of {}",
            self.used.len()
        );
        Cells {
            levels: self,
            shard,
        }
    }

    /// Shards a segment has.
    fn segment_shards(&self) -> usize {
        1 << self.shift
    }

    /// What a shard's lock guards of its cells, for a shard with none yet.
    pub(crate) fn meta(&self) -> Meta {
        Meta {
            live: 0,
            used: vec![0; self.limit].into_boxed_slice(),
        }
    }
}

impl<'a> Cells<'a> {
    /// The cell of `key`, without a lock: its home cell in every level, then the levels
    /// probed newest (largest) first.
    #[inline(always)]
    fn find(self, key: u64) -> Option<Cell<'a>> {
        // A key has one cell at most. Its home cell in every level first: in the first
        // level (inlined in the caller); then the others', whose reads do not wait for
        // one another, so the processor fetches their lines together instead of one
        // miss after another. Most keys are found at home. (Relaxed loads and a fence
        // on a hit, so that no load waits for an acquire before it on processors where
        // one would.)
        let first = self.level(0)?;
        let index = home(key, FIRST);
        if first.key(index).load(Ordering::Relaxed) == key {
            fence(Ordering::Acquire);
            return Some(Cell {
                level: first,
                n: 0,
                index,
                key,
            });
        }
        self.find_away(key)
    }

    /// [`find`](Self::find) for a key not at home in the first level.
    #[inline(never)]
    fn find_away(self, key: u64) -> Option<Cell<'a>> {
        let cell = |n: usize, level, index| Cell {
            level,
            n,
            index,
            key,
        };
        let made = self.made();
        for n in (1..made).rev() {
            let level = self.level(n)?;
            let i = home(key, level.cap());
            if level.key(i).load(Ordering::Relaxed) == key {
                fence(Ordering::Acquire);
                return Some(cell(n, level, i));
            }
        }
        (0..made).rev().find_map(|n| {
            let level = self.level(n)?;
            let index = level.find(key)?;
            Some(cell(n, level, index))
        })
    }

    /// How many levels this shard uses (has or had keys in): fewer than its segments may
    /// have made.
    #[inline]
    fn made(self) -> usize {
        self.levels
            .used
            .get(self.shard)
            .map_or(1, |used| usize::from(used.load(Ordering::Acquire)))
    }

    /// Level `n`, if made: this shard's run of its cells.
    #[inline]
    fn level(self, n: usize) -> Option<Level<'a>> {
        let (all, at): (&'a [Block], usize) = if n == 0 {
            (&self.levels.first, self.shard)
        } else {
            let at = self.shard & (self.levels.segment_shards() - 1);
            (self.segment(n)?.get()?, at)
        };
        let per = CAPS.get(n)? / (BLOCK / 2);
        let blocks = all.get(at * per..(at + 1) * per)?;
        Some(Level { blocks })
    }

    /// The segment of level `n` that holds this shard's cells (`None` for the first,
    /// made with the store).
    #[inline]
    fn segment(self, n: usize) -> Option<&'a OnceLock<Box<[Block]>>> {
        let levels = self.levels;
        levels
            .more
            .get(n.checked_sub(1)? * levels.segments + (self.shard >> levels.shift))
    }

    /// The levels this shard has keys in (or had), with their places.
    fn levels(self) -> impl Iterator<Item = (usize, Level<'a>)> {
        (0..self.made()).map_while(move |n| Some((n, self.level(n)?)))
    }

    /// Runs `step` on the state of `key` and stores what it returns, without a lock;
    /// again on the new state if another thread stored first. `step` returns its answer
    /// and the state to store (`None`: store nothing).
    ///
    /// `None` when `key` has no cell, or its cell was removed or pinned meanwhile.
    #[inline]
    pub(crate) fn update<R>(
        self,
        key: u64,
        mut step: impl FnMut(u64) -> (R, Option<u64>),
    ) -> Option<R> {
        let cell = self.find(key)?;
        loop {
            let loaded = cell.load()?;
            match step(loaded.state) {
                (answer, Some(next)) if next != loaded.state => {
                    if cell.replace(loaded, next) {
                        return Some(answer);
                    }
                }
                (answer, _) => return Some(answer),
            }
        }
    }

    /// Pins the cell of `key` for the holder of the shard's lock (see the module docs):
    /// `None` when `key` has no cell.
    pub(crate) fn pin(self, _: &Meta, key: u64) -> Option<Pinned<'a>> {
        let cell = self.find(key)?;
        // Under the lock no removal is under way: a word that reads as `REMOVED` is a
        // state that happens to have its pattern.
        let stored = cell.level.state(cell.index).swap(REMOVED, Ordering::AcqRel);
        Some(Pinned {
            cell,
            stored,
            next: None,
        })
    }

    /// Whether `key`, which has no cell, would get one.
    ///
    /// If not at first, it empties every tombstone it can, and asks again. If still not,
    /// it moves keys back onto the tombstones on their probes, and asks once more (see
    /// [`compact`](Self::compact)).
    pub(crate) fn has_vacancy(self, meta: &mut Meta, key: u64) -> bool {
        self.spot(meta, key).is_some()
            || {
                self.clear_tombstones(meta);
                self.spot(meta, key).is_some()
            }
            || {
                self.compact(meta);
                self.spot(meta, key).is_some()
            }
    }

    /// Moves each key onto the first tombstone on its probe, if any. Then empties the
    /// tombstones that leaves at the ends of runs.
    ///
    /// Tombstones before a key that stays (its cell busy) fill a level otherwise. A key
    /// moves in four steps. First the old cell's state is swapped for `REMOVED`. Then
    /// the state's word is written to the new cell, then the key. Last, the old cell is
    /// marked a tombstone. A check that found the old cell fails, and comes to the lock.
    /// A check that probes meanwhile meets the new cell first. Pinned cells stay.
    fn compact(self, meta: &mut Meta) {
        for (n, level) in self.levels() {
            meta.used[n] -= compact(level);
        }
    }

    /// Gives `key`, which has no cell, a cell holding `state`. `false` when every level
    /// is full.
    pub(crate) fn insert(self, meta: &mut Meta, key: u64, state: u64) -> bool {
        let Some((n, i, fresh)) = self.spot(meta, key) else {
            return false;
        };
        if let Some(segment) = self.segment(n) {
            segment.get_or_init(|| blocks(self.levels.segment_shards(), CAPS[n]));
        }
        // `n < LEVELS`: it fits a byte.
        if n == self.made()
            && let (Some(used), Ok(made)) = (self.levels.used.get(self.shard), u8::try_from(n + 1))
        {
            used.store(made, Ordering::Release);
        }
        let Some(level) = self.level(n) else {
            return false;
        };
        level.state(i).store(state ^ key, Ordering::Release);
        level.key(i).store(key, Ordering::Release);
        meta.live += 1;
        if fresh {
            meta.used[n] += 1;
        }
        true
    }

    /// Where [`insert`](Self::insert) would put `key`: its level, its cell, and whether
    /// that cell was never used.
    fn spot(self, meta: &Meta, key: u64) -> Option<(usize, usize, bool)> {
        let mut spot = None;
        let made = self.made();
        for n in (0..made).rev() {
            let Some(level) = self.level(n) else { continue };
            match level.vacancy(key) {
                Some((i, false)) => {
                    spot = Some((n, i, false));
                    break;
                }
                Some((i, true)) if meta.used[n] < room(level.cap()) => {
                    spot = Some((n, i, true));
                    break;
                }
                _ => {}
            }
        }
        if spot.is_none() && made < self.levels.limit {
            // The next level.
            spot = Some((made, home(key, CAPS[made]), true));
        }
        spot
    }

    /// Takes `key`'s cell away, if it has one; a thread updating it meanwhile fails.
    pub(crate) fn remove(self, meta: &mut Meta, key: u64) {
        if let Some(cell) = self.find(key) {
            cell.level.state(cell.index).swap(REMOVED, Ordering::AcqRel);
            bury(meta, cell.level, cell.n, cell.index);
        }
    }

    /// Empties every tombstone no probe passes through, in every level.
    fn clear_tombstones(self, meta: &mut Meta) {
        for (n, level) in self.levels() {
            meta.used[n] -= clear_tombstones(level);
        }
    }

    /// Removes every key whose state is a fresh key's at `now` (from its
    /// [`word::expiry`] on; `origin`: the store's), empties the tombstones no probe
    /// passes through, and returns the earliest instant at which a remaining key becomes
    /// idle (`u64::MAX`: none).
    pub(crate) fn sweep(self, meta: &mut Meta, now: u64, origin: u64) -> u64 {
        let mut earliest = u64::MAX;
        for (n, level) in self.levels() {
            for i in 0..level.cap() {
                let key = level.key(i).load(Ordering::Relaxed);
                if key == EMPTY || key == TOMB {
                    continue;
                }
                let stored = level.state(i).load(Ordering::Acquire);
                // A pinned cell (or a state with `REMOVED`'s pattern) stays this time;
                // an update between the read and the swap keeps the key.
                if stored != REMOVED
                    && word::expiry(key, stored ^ key, origin) <= now
                    && level
                        .state(i)
                        .compare_exchange(stored, REMOVED, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                {
                    bury(meta, level, n, i);
                } else {
                    // A pinned cell's state is unknown here: soon, to be safe.
                    let stored = level.state(i).load(Ordering::Acquire);
                    let expiry = if stored == REMOVED {
                        now
                    } else {
                        word::expiry(key, stored ^ key, origin)
                    };
                    earliest = earliest.min(expiry.max(now + 1));
                }
            }
            meta.used[n] -= clear_tombstones(level);
        }
        earliest
    }

    /// Keys held.
    pub(crate) fn len(meta: &Meta) -> usize {
        meta.live
    }

    /// Cells a sweep walks: every level this shard uses.
    pub(crate) fn cap(self) -> usize {
        let made = self.made();
        CAPS[..made].iter().sum()
    }
}

/// A cell pinned by the holder of the shard's lock: dropping it stores the state to keep.
pub(crate) struct Pinned<'a> {
    cell: Cell<'a>,
    /// The word pinned.
    stored: u64,
    /// The state to leave, if another.
    next: Option<u64>,
}

impl Pinned<'_> {
    /// The state pinned.
    pub(crate) fn state(&self) -> u64 {
        self.stored ^ self.cell.key
    }

    /// Leaves `state` in the cell when the pin is dropped.
    pub(crate) fn set(&mut self, state: u64) {
        self.next = Some(state);
    }

    /// Takes the cell away from its key, which a check that found it meanwhile learns
    /// (its state stays `REMOVED`), as [`Cells::remove`] does.
    pub(crate) fn remove(mut self, meta: &mut Meta) {
        self.next = Some(REMOVED ^ self.cell.key);
        bury(meta, self.cell.level, self.cell.n, self.cell.index);
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        let word = self.next.map_or(self.stored, |state| state ^ self.cell.key);
        self.cell
            .level
            .state(self.cell.index)
            .store(word, Ordering::Release);
    }
}

/// Marks cell `i` of level `n`, whose state is `REMOVED` already, a tombstone: one key
/// fewer, and the tombstones at the end of its run emptied.
fn bury(meta: &mut Meta, level: Level<'_>, n: usize, i: usize) {
    level.key(i).store(TOMB, Ordering::Release);
    meta.live -= 1;
    meta.used[n] -= clear_run_end(level, i);
}

/// After the tombstone at `i`: if an empty cell follows it, no probe passes through it,
/// nor through the tombstones just before it; empties them and returns how many.
fn clear_run_end(level: Level<'_>, i: usize) -> usize {
    if level.key(level.next(i)).load(Ordering::Relaxed) != EMPTY {
        return 0;
    }
    let mut cleared = 0;
    let mut j = i;
    while cleared < level.cap() && level.key(j).load(Ordering::Relaxed) == TOMB {
        level.key(j).store(EMPTY, Ordering::Release);
        cleared += 1;
        j = level.prev(j);
    }
    cleared
}

/// [`Cells::compact`] in one level; returns how many tombstones it emptied.
fn compact(level: Level<'_>) -> usize {
    for j in 0..level.cap() {
        let key = level.key(j).load(Ordering::Relaxed);
        if key == EMPTY || key == TOMB || level.state(j).load(Ordering::Acquire) == REMOVED {
            continue;
        }
        let mut t = home(key, level.cap());
        while t != j && level.key(t).load(Ordering::Relaxed) != TOMB {
            t = level.next(t);
        }
        if t == j {
            continue;
        }
        let stored = level.state(j).swap(REMOVED, Ordering::AcqRel);
        level.state(t).store(stored, Ordering::Release);
        level.key(t).store(key, Ordering::Release);
        level.key(j).store(TOMB, Ordering::Release);
    }
    clear_tombstones(level)
}

/// Empties the tombstones no key's probe, from its home to its cell, passes through.
/// Returns how many.
///
/// Walks each run of used cells backwards from the empty cell that ends it. It keeps how
/// far back from that end the probes of the keys seen so far reach. A tombstone further
/// back than any of them is crossed by no probe: a key before it stops before it. So the
/// tombstone becomes an empty cell, which ends the run before it.
fn clear_tombstones(level: Level<'_>) -> usize {
    let cap = level.cap();
    let Some(start) = (0..cap).find(|&i| level.key(i).load(Ordering::Relaxed) == EMPTY) else {
        return 0;
    };
    let mut cleared = 0;
    // Steps back from the run's end, and the furthest back a probe seen reaches.
    let (mut back, mut reach) = (0, 0);
    for step in 1..cap {
        let i = (start + cap - step) % cap;
        match level.key(i).load(Ordering::Relaxed) {
            EMPTY => (back, reach) = (0, 0),
            TOMB if back + 1 > reach => {
                level.key(i).store(EMPTY, Ordering::Release);
                cleared += 1;
                (back, reach) = (0, 0);
            }
            TOMB => back += 1,
            key => {
                back += 1;
                let displaced = level.distance(home(key, cap), i);
                reach = reach.max(back + displaced);
            }
        }
    }
    cleared
}

#[cfg(all(test, not(tollway_loom)))]
mod tests;

#[cfg(all(test, tollway_loom))]
#[allow(clippy::unwrap_used)]
mod loom_tests;
