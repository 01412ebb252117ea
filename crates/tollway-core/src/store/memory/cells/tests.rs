//! The cells' unit tests (the loom models are in `loom_tests.rs`).

use super::*;

#[test]
fn keys_are_found_updated_removed_and_their_cells_reused() {
    // Small numbers all have home 0 (the worst case), spread ones homes all over.
    for key in [|k: u64| k, spread] {
        let levels = Levels::new(1, 100);
        let (cells, mut meta) = (levels.shard(0), levels.meta());
        for k in 2..202u64 {
            assert!(cells.find(key(k)).is_none());
            assert!(cells.insert(&mut meta, key(k), k * 10));
        }
        assert_eq!(Cells::len(&meta), 200);
        for k in 2..202u64 {
            assert_eq!(cells.update(key(k), |s| (s, Some(s + 1))), Some(k * 10));
            assert_eq!(
                cells.find(key(k)).and_then(|c| c.load()).map(|l| l.state),
                Some(k * 10 + 1)
            );
        }
        cells.remove(&mut meta, key(7));
        assert!(cells.find(key(7)).is_none());
        assert_eq!(cells.update(key(7), |s| (s, None)), None);
        assert!(cells.insert(&mut meta, key(7), 5));
        assert_eq!(cells.update(key(7), |s| (s, None)), Some(5));
        assert_eq!(Cells::len(&meta), 200);
    }
}

// The shards of a store share each level's allocations (a segment of 64 shards) but
// not a cell: keys in one shard are not found in another, a shard's levels are the
// ones its keys needed (not its segment's), and a sweep of one leaves the others.
#[test]
fn shards_share_levels_but_not_cells() {
    let levels = Levels::new(128, 1_000);
    // 5 and 6 share a segment; 70 is in the next.
    let (a, b, c, d) = (
        levels.shard(5),
        levels.shard(6),
        levels.shard(70),
        levels.shard(7),
    );
    let (mut ma, mut mb, mut mc, mut md) =
        (levels.meta(), levels.meta(), levels.meta(), levels.meta());
    for k in 0..600u64 {
        assert!(a.insert(&mut ma, spread(k), 500));
        assert!(b.insert(&mut mb, spread(k + 1_000), 600));
        assert!(c.insert(&mut mc, spread(k), 50));
    }
    assert!(d.insert(&mut md, spread(0), 7));
    assert!(a.made() > 4, "shard 5 grew: {} levels", a.made());
    assert_eq!(d.made(), 1, "shard 7 did not");
    for k in 0..600u64 {
        let read = |cells: Cells<'_>, k| cells.update(spread(k), |s| (s, None));
        assert_eq!(read(a, k), Some(500), "key {k}");
        assert_eq!(read(b, k + 1_000), Some(600), "key {k}");
        assert_eq!(read(c, k), Some(50), "key {k}");
        assert_eq!((read(a, k + 1_000), read(b, k)), (None, None), "key {k}");
        assert_eq!(read(d, k), (k == 0).then_some(7), "key {k} in shard 7");
    }
    assert_eq!(c.sweep(&mut mc, 100, 0), u64::MAX);
    assert_eq!((Cells::len(&ma), Cells::len(&mc)), (600, 0));
    assert_eq!(a.update(spread(599), |s| (s, None)), Some(500));
    assert_eq!(d.update(spread(0), |s| (s, None)), Some(7));
}

// A segment of a level is made by one check, holding its shard's lock: at most 64
// shards, and at most SEGMENT_BYTES for the largest level their bound allows.
#[test]
fn segments_stay_within_their_bytes() {
    for (shards, max, segment) in [(1_024, 1_024, 64), (1_024, 4_096, 64), (8, 1_024, 8)] {
        assert_eq!(
            Levels::new(shards, max).segment_shards(),
            segment,
            "{shards} x {max}"
        );
    }
    for (shards, max) in [(64, MAX_SHARD_KEYS), (1_024, 65_536), (1, MAX_SHARD_KEYS)] {
        let levels = Levels::new(shards, max);
        let largest = CAPS[levels.limit - 1] * 16 * levels.segment_shards();
        assert!(
            largest <= SEGMENT_BYTES || levels.segment_shards() == 1,
            "{shards} x {max}"
        );
        assert_eq!(levels.segments * levels.segment_shards(), shards);
    }
    assert_eq!(Levels::new(64, MAX_SHARD_KEYS).segment_shards(), 1);
}

// A thread that found a key's cell and is then overtaken by the key's removal and
// another key's arrival in the same cell must not write that key's state.
#[test]
fn a_cell_given_to_another_key_is_not_written_by_a_stale_reader() {
    let levels = Levels::new(1, 4);
    let (cells, mut meta) = (levels.shard(0), levels.meta());
    // 2 and 18 share a home, 0 (as does every key below 2^28 in a level of 16 cells).
    assert!(cells.insert(&mut meta, 2, 100));
    let stale = cells.find(2).unwrap();
    let before = stale.load().unwrap();
    cells.remove(&mut meta, 2);
    assert!(stale.load().is_none(), "removed");
    assert!(!stale.replace(before, 1), "removed: the swap fails");
    assert!(cells.insert(&mut meta, 18, 100));
    let other = cells.find(18).unwrap();
    assert_eq!(other.index, stale.index, "the cell is reused");
    assert!(stale.load().is_none(), "another key's cell");
    assert!(!stale.replace(before, 1), "another key's word");
    assert_eq!(other.load().unwrap().state, 100);
}

/// Key `k` of a test, spread over the homes as hashed keys are.
fn spread(k: u64) -> u64 {
    word::instant_key(k.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

#[test]
fn a_sweep_removes_idle_keys_and_clears_the_tombstones_it_can() {
    let levels = Levels::new(1, 1_000);
    let (cells, mut meta) = (levels.shard(0), levels.meta());
    for k in 0..1_000u64 {
        assert!(cells.insert(&mut meta, spread(k), if k % 2 == 0 { 50 } else { 500 }));
    }
    let used: usize = meta.used.iter().sum();
    assert_eq!(used, 1_000);
    assert_eq!(cells.sweep(&mut meta, 100, 0), 500);
    assert_eq!(Cells::len(&meta), 500);
    for k in 0..1_000u64 {
        assert_eq!(cells.find(spread(k)).is_some(), k % 2 == 1, "key {k}");
    }
    let left: usize = meta.used.iter().sum();
    assert!(
        left < used,
        "some tombstones end their runs: {left} of {used} used"
    );
    assert_eq!(cells.sweep(&mut meta, 500, 0), u64::MAX);
    assert_eq!(Cells::len(&meta), 0);
    assert_eq!(
        meta.used.iter().sum::<usize>(),
        0,
        "every tombstone ends a run"
    );
}

// Long-lived keys with others coming and going around them: the tombstones the
// others leave behind the long-lived ones would fill the level; moving keys back
// onto them (or emptying them) keeps room for every new key.
#[test]
fn churn_around_long_lived_keys_keeps_room() {
    let levels = Levels::new(1, 4);
    let (cells, mut meta) = (levels.shard(0), levels.meta());
    for k in 0..3 {
        assert!(cells.insert(&mut meta, spread(k), 1));
    }
    for k in 3..100_000u64 {
        let key = spread(k);
        assert!(cells.has_vacancy(&mut meta, key), "new key {k}");
        assert!(cells.insert(&mut meta, key, 1));
        cells.remove(&mut meta, key);
    }
    for k in 0..3 {
        assert!(cells.find(spread(k)).is_some(), "long-lived key {k}");
    }
    assert_eq!(Cells::len(&meta), 3);
}

// Keys that come and go forever reuse the cells they left: the levels stop growing.
#[test]
fn churning_keys_reuse_their_cells() {
    let levels = Levels::new(1, 64);
    let (cells, mut meta) = (levels.shard(0), levels.meta());
    let mut key = 0;
    for round in 0..1_000u64 {
        for _ in 0..64 {
            assert!(cells.insert(&mut meta, spread(key), round), "round {round}");
            key += 1;
        }
        cells.sweep(&mut meta, round, 0);
        assert_eq!(Cells::len(&meta), 0);
    }
    let made = cells.levels().count();
    assert!(made <= 4, "{made} levels for 64 keys");
}

#[test]
fn a_full_shard_says_so() {
    let levels = Levels::new(1, 1);
    let (cells, mut meta) = (levels.shard(0), levels.meta());
    let mut n = 0;
    while cells.insert(&mut meta, 2 + n, 1) {
        n += 1;
    }
    // Three quarters of the first level's 16 cells: room for twice the shard's keys,
    // and more.
    assert_eq!(n, 12);
}

// A lookup reads a key's home cell in every level and then probes the levels on from
// there: keys pushed past their home's line of keys, and across a tombstone, in two
// levels, are found; keys in none are not.
#[test]
fn keys_pushed_past_their_home_line_are_found() {
    let levels = Levels::new(1, 64);
    let (cells, mut meta) = (levels.shard(0), levels.meta());
    // Every key below 2^27 has its home at cell 0 in the first two levels (16 and
    // 24 cells): 12 keys fill the first level's cells 0-11, 18 the second's 0-17.
    for k in 2..32 {
        assert!(cells.insert(&mut meta, k, k + 100));
    }
    assert_eq!(cells.levels().count(), 2);
    cells.remove(&mut meta, 3);
    cells.remove(&mut meta, 16);
    for k in (2..32).filter(|&k| k != 3 && k != 16) {
        let state = cells.find(k).and_then(|c| c.load()).map(|l| l.state);
        assert_eq!(state, Some(k + 100), "key {k}");
    }
    for k in [3, 16, 32, 1 << 40] {
        assert!(cells.find(k).is_none(), "key {k}");
    }
}
