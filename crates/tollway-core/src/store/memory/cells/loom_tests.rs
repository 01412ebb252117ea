//! The transitions under every interleaving `loom` finds, for two and three threads on
//! one key: `RUSTFLAGS="--cfg tollway_loom" cargo test -p tollway-core --release --lib loom`.

use loom::sync::{Arc, Mutex};
use loom::thread;

use super::*;

/// A store of one shard: its cells, and their meta behind a lock. The tests keep to
/// the first level, made with the store: later levels are made behind a `OnceLock`,
/// which loom does not model.
fn shard() -> Arc<(Levels, Mutex<Meta>)> {
    let levels = Levels::new(1, 4);
    let meta = levels.meta();
    Arc::new((levels, Mutex::new(meta)))
}

/// A check as the store makes it: without the lock while the key has a cell, under
/// it to insert one. A state is a count of admissions; at most `limit` are admitted.
fn admit(shard: &(Levels, Mutex<Meta>), key: u64, limit: u64) -> bool {
    let step = |count: u64| {
        let ok = count < limit;
        (ok, ok.then_some(count + 1))
    };
    if let Some(ok) = shard.0.shard(0).update(key, step) {
        return ok;
    }
    let mut meta = shard.1.lock().unwrap();
    if let Some(ok) = shard.0.shard(0).update(key, step) {
        return ok;
    }
    let (ok, next) = step(0);
    if let Some(next) = next {
        assert!(shard.0.shard(0).insert(&mut meta, key, next));
    }
    ok
}

/// Runs `check` on `threads` threads at once: how many it admitted.
fn admissions(threads: u64, check: impl Fn() -> bool + Clone + Send + 'static) -> u64 {
    let handles: Vec<_> = (0..threads).map(|_| thread::spawn(check.clone())).collect();
    let admitted = handles.into_iter().map(|h| h.join().unwrap());
    admitted.filter(|&ok| ok).count() as u64
}

fn count(shard: &(Levels, Mutex<Meta>), key: u64) -> u64 {
    let meta = shard.1.lock().unwrap();
    shard
        .0
        .shard(0)
        .pin(&meta, key)
        .map_or(0, |pinned| pinned.state())
}

#[test]
fn racing_checks_on_one_key_lose_no_update_and_admit_no_more_than_the_limit() {
    for threads in [2, 3] {
        loom::model(move || {
            let shard = shard();
            {
                let mut meta = shard.1.lock().unwrap();
                assert!(shard.0.shard(0).insert(&mut meta, 9, 0));
            }
            let admitted = admissions(threads, {
                let shard = shard.clone();
                move || admit(&shard, 9, 2)
            });
            assert_eq!(admitted, 2.min(threads));
            assert_eq!(count(&shard, 9), admitted, "every admission recorded");
        });
    }
}

#[test]
fn racing_first_checks_insert_the_key_once() {
    loom::model(|| {
        let shard = shard();
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let shard = shard.clone();
                thread::spawn(move || admit(&shard, 9, 5))
            })
            .collect();
        for h in handles {
            assert!(h.join().unwrap());
        }
        assert_eq!(count(&shard, 9), 2);
        assert_eq!(Cells::len(&shard.1.lock().unwrap()), 1);
    });
}

// A sweep removing an idle key while checks admit on it: each admission is either
// in the cell the sweep left or in the cell a check inserted afterwards.
#[test]
fn a_sweep_beside_checks_loses_no_admission() {
    loom::model(|| {
        let shard = shard();
        {
            let mut meta = shard.1.lock().unwrap();
            assert!(shard.0.shard(0).insert(&mut meta, 9, 0));
        }
        let checks: Vec<_> = (0..2)
            .map(|_| {
                let shard = shard.clone();
                thread::spawn(move || admit(&shard, 9, 5))
            })
            .collect();
        let sweeper = {
            let shard = shard.clone();
            // State 0 is idle at instant 0.
            thread::spawn(move || {
                let mut meta = shard.1.lock().unwrap();
                shard.0.shard(0).sweep(&mut meta, 0, 0);
            })
        };
        for h in checks {
            assert!(h.join().unwrap());
        }
        sweeper.join().unwrap();
        assert_eq!(count(&shard, 9), 2);
    });
}

// A decision under the lock pins the cell it reads: a check without the lock in the
// meantime fails, waits for the lock and decides after; the pinned decision's write
// and the check's both count.
#[test]
fn a_pinned_cell_takes_no_other_update_until_let_go() {
    loom::model(|| {
        let shard = shard();
        {
            let mut meta = shard.1.lock().unwrap();
            assert!(shard.0.shard(0).insert(&mut meta, 9, 0));
        }
        let charge = {
            let shard = shard.clone();
            thread::spawn(move || {
                let meta = shard.1.lock().unwrap();
                let mut pinned = shard.0.shard(0).pin(&meta, 9).unwrap();
                let state = pinned.state();
                pinned.set(state + 3);
            })
        };
        let check = {
            let shard = shard.clone();
            thread::spawn(move || admit(&shard, 9, 10))
        };
        charge.join().unwrap();
        assert!(check.join().unwrap());
        assert_eq!(count(&shard, 9), 4);
    });
}

// The memory store's token bucket, packed in its cell (see `word`): checks racing on
// one key at one instant take each token once, and the word left holds every one.
#[test]
fn racing_token_bucket_checks_take_each_token_once() {
    use super::word::Packs;
    use crate::Quota;
    use crate::algorithm::token_bucket::{self, State};
    for threads in [2, 3] {
        loom::model(move || {
            // 2 a second: a bucket of two tokens.
            let quota = Quota::per_second(2).unwrap();
            let shard = shard();
            {
                let mut meta = shard.1.lock().unwrap();
                assert!(shard.0.shard(0).insert(&mut meta, 9, 0));
            }
            let check = {
                let quota = quota.clone();
                move |word: u64| {
                    let state = State::unpack(word, &quota, 0);
                    let (decision, next) = token_bucket::check(state, 1_000, &quota, 1);
                    let ok = decision.is_allowed();
                    (ok, ok.then(|| next.pack(&quota, 0).unwrap()))
                }
            };
            let admitted = admissions(threads, {
                let shard = shard.clone();
                move || shard.0.shard(0).update(9, check.clone()).unwrap()
            });
            assert_eq!(admitted, 2);
            let left = State::unpack(count(&shard, 9), &quota, 0);
            let (decision, _) = token_bucket::check(left, 1_000, &quota, 0);
            assert_eq!(decision.remaining(), 0, "both tokens taken in the word");
        });
    }
}

// The store moves a token bucket out of its cell, under the lock, once its state no
// longer packs in one word: the cell pinned, its state read, the cell removed, the
// state kept elsewhere (here, beside the meta). A check without the lock racing the
// move either lands before the pin, and its admission moves with the state, or fails,
// takes the lock, and admits on the moved state.
#[test]
fn a_state_moved_out_of_its_cell_loses_no_admission() {
    loom::model(|| {
        let levels = Levels::new(1, 4);
        let meta = levels.meta();
        let shard = Arc::new((levels, Mutex::new((meta, None::<u64>))));
        {
            let mut locked = shard.1.lock().unwrap();
            assert!(shard.0.shard(0).insert(&mut locked.0, 9, 1));
        }
        let step = |count: u64| (true, Some(count + 1));
        let check = {
            let shard = shard.clone();
            thread::spawn(move || {
                if shard.0.shard(0).update(9, step).is_some() {
                    return;
                }
                let mut locked = shard.1.lock().unwrap();
                if shard.0.shard(0).update(9, step).is_none() {
                    let moved = locked.1.as_mut().unwrap();
                    *moved += 1;
                }
            })
        };
        let mover = {
            let shard = shard.clone();
            thread::spawn(move || {
                let mut locked = shard.1.lock().unwrap();
                let pinned = shard.0.shard(0).pin(&locked.0, 9).unwrap();
                let state = pinned.state();
                pinned.remove(&mut locked.0);
                locked.1 = Some(state);
            })
        };
        check.join().unwrap();
        mover.join().unwrap();
        let locked = shard.1.lock().unwrap();
        assert_eq!(
            locked.1,
            Some(2),
            "the check's admission moved or was made after"
        );
        assert!(
            shard.0.shard(0).pin(&locked.0, 9).is_none(),
            "the cell is gone"
        );
        assert_eq!(Cells::len(&locked.0), 0);
    });
}

// A check that found a key's cell, overtaken by the key's removal and another key's
// arrival in the same cell, writes nothing into that key's state.
#[test]
fn a_reused_cell_is_not_written_by_a_stale_check() {
    loom::model(|| {
        let shard = shard();
        {
            let mut meta = shard.1.lock().unwrap();
            assert!(shard.0.shard(0).insert(&mut meta, 2, 0));
        }
        let check = {
            let shard = shard.clone();
            thread::spawn(move || admit(&shard, 2, 5))
        };
        let churn = {
            let shard = shard.clone();
            thread::spawn(move || {
                let mut meta = shard.1.lock().unwrap();
                shard.0.shard(0).remove(&mut meta, 2);
                // 18 shares 2's home, and takes its cell.
                assert!(shard.0.shard(0).insert(&mut meta, 18, 3));
            })
        };
        assert!(check.join().unwrap());
        churn.join().unwrap();
        assert_eq!(count(&shard, 18), 3, "the other key's state is untouched");
        // Before the removal, the check's admission went with the key; after it, the
        // check inserted the key afresh.
        assert!(count(&shard, 2) <= 1);
    });
}
