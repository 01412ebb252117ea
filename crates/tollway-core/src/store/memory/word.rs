//! How a state is written in one 64-bit word of the memory store's lock-free cells.
//!
//! # GCRA and the leaky bucket shaper
//!
//! Their state is one instant, the theoretical arrival time. The word is that instant.
//! The state is a fresh key's from then on.
//!
//! # The token bucket and the fixed window
//!
//! The token bucket's state is two integers, and so is the fixed window's. The leaky
//! bucket meter's is the token bucket's. The first integer is an instant from which the
//! state is a fresh key's. The second is a small number, which [`Packs`] fits in `b`
//! bits:
//!
//! ```text
//! b (5 bits) | instant (59 − b bits) | small number (b bits)
//! ```
//!
//! The instant is written as microseconds from the store's *origin*. The origin is the
//! store's clock when it was made, whatever that clock counts from (zero, or the Unix
//! epoch). A fresh key's state, both integers 0, has a word of its own.
//!
//! The token bucket's instant is `full_at`, the microsecond it is full again. Its small
//! number is `frac`, the ticks of the microsecond before already refilled (`frac <
//! limit`; see [`token_bucket`]). A request takes `cost × period` ticks, and a
//! microsecond refills `limit`. So the states the algorithm makes have `frac` a multiple
//! of `g = gcd(limit, period)`. The exception is a debt capped at 2^52 ticks, which may
//! not be a multiple, and then goes to the table. The word holds `frac / g < limit / g`.
//! That takes no bits at all for the usual quotas, whose limit divides the period (100 a
//! minute, 10 a second).
//!
//! The fixed window's instant is the window's end. Its small number is the count, up to
//! the limit. So `b` is the bits of the limit (7 for 100 a minute).
//!
//! The word is exactly the state while the instant is less than `2^(59 − b)` µs after
//! the origin:
//!
//! | `b` | range |
//! |---|---|
//! | 0 | 18,000 years |
//! | up to 6 | at least 285 years |
//! | 7, a window of 100 a period | 143 years |
//! | 10, a window of 1,000 | 17.8 years |
//! | 17, a window of 100,000 | 51 days |
//! | 27, a window of 2^26, the most a quota allows | 1.2 hours, the worst |
//!
//! A state past that does not pack. Nor does a state before the origin (a clock set
//! back). The store keeps such a state under the shard's lock, in its table, as it keeps
//! the other algorithms' states. It stays exact, but is no longer lock-free. Once the
//! clock itself has passed the edge, a check under such a quota goes to the lock without
//! looking in the cells.
//!
//! # The sliding window counter
//!
//! Its state is an instant and two counts up to the limit, `l` bits each. The counts are
//! the previous window's and the current one's:
//!
//! ```text
//! 30 (5 bits) | l (4 bits) | s (6 bits) | instant in units (49 − 2l bits) | previous (l) | current (l)
//! ```
//!
//! Its instant is the end of a window or of the one after, so a multiple of the period.
//! It is written in units of `2^s` µs from the origin, rounded up. `2^s` is the largest
//! power of two up to the period, and at most `2^24` (16.8 s). So at most one multiple of
//! the period falls within a unit. The state's instant is then found again exactly from
//! its unit and the period. A sweep knows no period, so it takes the unit's end: up to a
//! unit late, never early.
//!
//! `l ≤ 15`, so the limit is at most 32,767. The word is exactly the state while the
//! instant is at most `2^(49 − 2l + s) − 2^s` µs after the origin:
//!
//! | quota | range |
//! |---|---|
//! | 100 a minute | 18,000 years |
//! | 1,000 a second | 8.9 years |
//! | 10,000 a minute | 407 days |
//! | 10,000 a second | 12.7 days |
//! | 32,767 a second | 76 hours |
//! | 16,384 per 16,384 µs | 2.4 hours, the worst |
//!
//! Past that, or for a larger limit, the state is kept under the lock as above.
//!
//! # Reading a word
//!
//! A packed word says its own `b`, and a counter's word its `l` and `s`. So a window's
//! count reads the same under whichever limit a reader holds. A split store's count
//! keeps its key while its share changes. A count that no longer fits the new limit's
//! bits moves to the table.
//!
//! A cell's key says which form its word has: its top bit tells an instant from a packed
//! word. So a sweep can read when any cell's state becomes a fresh key's, without knowing
//! its policy.

use crate::Quota;
use crate::algorithm::{SlotState, concurrency, fixed_window, sliding_counter, token_bucket};

/// The key bit of a cell holding a packed pair.
const PACKED: u64 = 1 << 63;
/// Where a packed word's `b` starts.
const BITS_AT: u32 = 59;
/// The most bits a quota's small number needs: every quota has `limit ≤ 2^26` (`limit ≤
/// period` and `limit × period ≤ 2^52`), and a count up to the limit takes 27.
const MOST_BITS: u32 = 27;

/// The cell key of a state of one instant kept under `hash`: never `EMPTY` or `TOMB`.
#[inline]
pub(crate) fn instant_key(hash: u64) -> u64 {
    (hash & !PACKED).max(2)
}

/// The cell key of a packed pair kept under `hash`.
#[inline]
pub(crate) fn packed_key(hash: u64) -> u64 {
    hash | PACKED
}

/// The first instant at which the state `word` in the cell of `key` is a fresh key's
/// (`origin`: the store's, see [`Packs`]).
pub(crate) fn expiry(key: u64, word: u64, origin: u64) -> u64 {
    if key & PACKED == 0 {
        word
    } else if word >> BITS_AT == COUNTER {
        // The end of its unit: up to a period late, never early.
        counter_fields(word, origin).0
    } else {
        unpack_pair(word, origin).0
    }
}

/// The word of a fresh key's state, both integers 0, which an instant from the origin
/// cannot say: a `b` too large for any quota.
const FRESH: u64 = 31 << BITS_AT;

/// `instant` (from `origin`) and `small` in one word, `small` in `bits` bits, if they
/// fit.
#[inline]
fn pack_pair(instant: u64, small: u64, bits: u32, origin: u64) -> Option<u64> {
    if (instant, small) == (0, 0) {
        return Some(FRESH);
    }
    let instant = instant.checked_sub(origin)?;
    if bits > MOST_BITS || small >> bits != 0 || instant >> (BITS_AT - bits) != 0 {
        return None;
    }
    Some((u64::from(bits) << BITS_AT) | (instant << bits) | small)
}

/// The instant and small number of a word from [`pack_pair`] with the same `origin`, as
/// many bits as the word says. That is the word's own `b`, not its quota's. A split
/// store's count keeps one key while its limit changes.
#[inline]
fn unpack_pair(word: u64, origin: u64) -> (u64, u64) {
    if word == FRESH {
        return (0, 0);
    }
    let (body, bits) = (word & ((1 << BITS_AT) - 1), word >> BITS_AT);
    (
        (body >> bits).saturating_add(origin),
        body & ((1 << bits) - 1),
    )
}

/// A state of two integers kept in a cell's word while it fits one (see the module
/// docs). Its instant is written as microseconds from `origin`, the store's clock when
/// the store was made.
pub(crate) trait Packs: SlotState {
    /// Whether a check at `now` under `quota` looks for its state in the cells.
    ///
    /// Not once `now` is past the quota's edge after the origin. A state that is not a
    /// fresh key's has its instant later than `now`, so then no such state packs. Nor
    /// before the origin (a clock set back). Then the lock finds any state that packs.
    fn may_pack(now: u64, quota: &Quota, origin: u64) -> bool;
    /// The state as one word under `quota`, if it fits.
    fn pack(self, quota: &Quota, origin: u64) -> Option<u64>;
    /// The state a word from [`pack`](Self::pack) holds under the same `quota` and
    /// `origin`.
    fn unpack(word: u64, quota: &Quota, origin: u64) -> Self;
}

/// Whether an instant `now` is within the range of pairs whose small number takes
/// `bits` (see [`Packs::may_pack`]).
#[inline]
fn pair_may_pack(now: u64, bits: u32, origin: u64) -> bool {
    bits <= MOST_BITS && now.wrapping_sub(origin) >> (BITS_AT - bits) == 0
}

impl Packs for token_bucket::State {
    #[inline]
    fn may_pack(now: u64, quota: &Quota, origin: u64) -> bool {
        pair_may_pack(now, quota.common_bits(), origin)
    }

    #[inline]
    fn pack(self, quota: &Quota, origin: u64) -> Option<u64> {
        match quota.per_common(self.frac) {
            (frac, 0) => pack_pair(self.full_at, frac, quota.common_bits(), origin),
            _ => None,
        }
    }

    #[inline]
    fn unpack(word: u64, quota: &Quota, origin: u64) -> Self {
        let (full_at, frac) = unpack_pair(word, origin);
        token_bucket::State {
            full_at,
            frac: frac * quota.common(),
        }
    }
}

/// The bits of a count up to `quota`'s limit.
fn count_bits(quota: &Quota) -> u32 {
    u64::BITS - quota.limit().leading_zeros()
}

/// `Packs` for a state of an instant (`end`) and a count up to the limit: the fixed
/// window's, and the slots of calls in flight.
macro_rules! packs_end_and_count {
    ($($state:ty),+) => {$(
        impl Packs for $state {
            #[inline]
            fn may_pack(now: u64, quota: &Quota, origin: u64) -> bool {
                pair_may_pack(now, count_bits(quota), origin)
            }

            #[inline]
            fn pack(self, quota: &Quota, origin: u64) -> Option<u64> {
                pack_pair(self.end, self.count, count_bits(quota), origin)
            }

            #[inline]
            fn unpack(word: u64, _: &Quota, origin: u64) -> Self {
                let (end, count) = unpack_pair(word, origin);
                Self { end, count }
            }
        }
    )+};
}

packs_end_and_count!(fixed_window::State, concurrency::State);

/// The `b` of a sliding window counter's word, whose form is its own (see the module
/// docs): no pair's (`b ≤ 27`) nor [`FRESH`]'s.
const COUNTER: u64 = 30;
/// Where a counter word's `l` (4 bits) and `s` (6 bits) start; its units' instant and
/// two counts take the 49 bits below.
const COUNTER_L_AT: u32 = 55;
const COUNTER_S_AT: u32 = 49;
/// The most bits a counter word's counts may take each (`l` has 4 bits).
const COUNTER_MOST_BITS: u32 = 15;

/// The largest unit of a counter word, `2^24` µs (16.8 s): a sweep takes a counter for
/// fresh up to a unit late.
const COUNTER_MOST_SHIFT: u32 = 24;

/// A counter word's unit, `2^s` µs: the largest power of two up to the period (so that
/// one multiple of the period at most falls within a unit) and up to `2^24`.
#[inline]
fn unit_shift(quota: &Quota) -> u32 {
    quota.period_micros().ilog2().min(COUNTER_MOST_SHIFT)
}

/// A counter word's fields: the end of its last unit (the instant from the origin at
/// which the state is a fresh key's, rounded up to a unit), `l`, and the two counts.
#[inline]
fn counter_fields(word: u64, origin: u64) -> (u64, u32, u64, u64) {
    let l = ((word >> COUNTER_L_AT) & 0xf) as u32;
    let s = ((word >> COUNTER_S_AT) & 0x3f) as u32;
    let body = word & ((1 << COUNTER_S_AT) - 1);
    let mask = (1 << l) - 1;
    let end = (body >> (2 * l)) << s;
    (
        end.saturating_add(origin),
        l,
        (body >> l) & mask,
        body & mask,
    )
}

impl Packs for sliding_counter::State {
    #[inline]
    fn may_pack(now: u64, quota: &Quota, origin: u64) -> bool {
        let l = count_bits(quota);
        l <= COUNTER_MOST_BITS
            && now >= origin
            && ((now - origin) >> unit_shift(quota)) >> (COUNTER_S_AT - 2 * l) == 0
    }

    #[inline]
    fn pack(self, quota: &Quota, origin: u64) -> Option<u64> {
        if self == Self::default() {
            return Some(FRESH);
        }
        let (l, s) = (count_bits(quota), unit_shift(quota));
        let (prev, curr) = (u64::from(self.prev), u64::from(self.curr));
        // The instant is a window's end, a multiple of the period (which the unpacking
        // finds again from the unit it falls in).
        let units = self.expires_at.checked_sub(origin)?.div_ceil(1 << s);
        if l > COUNTER_MOST_BITS
            || prev >> l != 0
            || curr >> l != 0
            || units >> (COUNTER_S_AT - 2 * l) != 0
            || units > u64::MAX >> s
            || quota.rem_period(self.expires_at) != 0
        {
            return None;
        }
        Some(
            (COUNTER << BITS_AT)
                | (u64::from(l) << COUNTER_L_AT)
                | (u64::from(s) << COUNTER_S_AT)
                | (units << (2 * l))
                | (prev << l)
                | curr,
        )
    }

    #[inline]
    fn unpack(word: u64, quota: &Quota, origin: u64) -> Self {
        if word == FRESH {
            return Self::default();
        }
        let (end, _, prev, curr) = counter_fields(word, origin);
        // The one multiple of the period in the unit that ends at `end`.
        sliding_counter::State {
            expires_at: end - quota.rem_period(end),
            prev: prev as u32,
            curr: curr as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::algorithm::token_bucket::{State, charge, check, refund};

    /// The store's clock when it was made: here, an epoch clock's in 2026.
    const ORIGIN: u64 = 1_780_000_000_000_000;

    fn pack(state: State, quota: &Quota) -> Option<u64> {
        state.pack(quota, ORIGIN)
    }

    fn unpack(word: u64, quota: &Quota) -> State {
        State::unpack(word, quota, ORIGIN)
    }

    fn quota(limit: u32, period_us: u64, burst: u32) -> Quota {
        Quota::with_period(limit.into(), Duration::from_micros(period_us))
            .and_then(|q| q.with_burst(burst.into()))
            .unwrap()
    }

    /// Every state a run of checks, refunds and charges makes packs and unpacks to
    /// itself, and says when it is full again. A state before the origin, or past the
    /// range after it, does not pack.
    #[test]
    fn token_bucket_states_pack_exactly() {
        let quotas = [
            // limit / g: 1 (the usual case), 3, 7, 999_983 (a prime limit), 2^26 - 1
            // (the most bits).
            quota(100, 60_000_000, 100),
            quota(3, 1_000_000, 5),
            quota(7, 1_000_000, 1),
            quota(999_983, 1_000_000, 1_000),
            quota((1 << 26) - 1, 1 << 26, 1),
        ];
        for q in &quotas {
            let bits = q.common_bits();
            let mut state = State::default();
            let mut now = ORIGIN + 1_000;
            for step in 0u64..2_000 {
                now += step * 7_919 % 1_013;
                let cost = step % 4;
                state = match step % 5 {
                    3 => refund(state, now, q, cost),
                    4 => charge(state, now, q, cost),
                    _ => check(state, now, q, cost).1,
                };
                let word = pack(state, q).unwrap();
                assert_eq!(unpack(word, q), state, "{q:?} at {now}");
                assert_eq!(expiry(packed_key(step), word, ORIGIN), state.full_at);
            }
            let before = State {
                full_at: ORIGIN - 1,
                frac: 0,
            };
            assert_eq!(pack(before, q), None);
            let last = ORIGIN + (1 << (BITS_AT - bits)) - 1;
            let at_last = State {
                full_at: last,
                frac: 0,
            };
            assert_eq!(unpack(pack(at_last, q).unwrap(), q), at_last);
            let past = State {
                full_at: last + 1,
                frac: 0,
            };
            assert_eq!(pack(past, q), None, "{q:?}");
        }
        let fresh = pack(State::default(), &quotas[3]).unwrap();
        assert_eq!(unpack(fresh, &quotas[3]), State::default());
        assert_eq!(expiry(packed_key(1), fresh, ORIGIN), 0);
    }

    /// Every fixed window state a run of checks and refunds makes packs and unpacks to
    /// itself, a full window's included, and says when its window ends.
    #[test]
    fn fixed_window_states_pack_exactly() {
        use crate::algorithm::fixed_window;
        // Counts of 1 bit, 7, and 27 (a limit of 2^26, the most a quota allows).
        for q in [
            quota(1, 1_000_000, 1),
            quota(100, 60_000_000, 100),
            quota(1 << 26, 1 << 26, 1 << 26),
        ] {
            let mut state = fixed_window::State::default();
            let mut now = ORIGIN + 5;
            for step in 0u64..2_000 {
                now += step * 7_919 % 1_000_003;
                let cost = step % 4;
                state = match step % 5 {
                    4 => fixed_window::refund(state, now, &q, cost),
                    _ => fixed_window::check(state, now, &q, cost).1,
                };
                let word = state.pack(&q, ORIGIN).unwrap();
                let unpacked = fixed_window::State::unpack(word, &q, ORIGIN);
                assert_eq!(unpacked, state, "{q:?}");
                // Under another limit too: the word says how many bits its count has.
                let other = quota(3, 1_000_000, 3);
                assert_eq!(fixed_window::State::unpack(word, &other, ORIGIN), state);
                assert_eq!(expiry(packed_key(step), word, ORIGIN), state.end);
            }
            let full = fixed_window::State {
                end: ORIGIN + q.period_micros(),
                count: q.limit(),
            };
            let word = full.pack(&q, ORIGIN).unwrap();
            assert_eq!(fixed_window::State::unpack(word, &q, ORIGIN), full);
        }
    }

    /// Every sliding window counter state a run of checks and refunds makes packs and
    /// unpacks to itself. It says it is fresh again at the end of the unit its instant
    /// falls in, up to a period late. It does not pack past the range, before the
    /// origin, or with counts of more than 15 bits.
    #[test]
    fn sliding_counter_states_pack_exactly() {
        use crate::algorithm::sliding_counter::{self, State};
        // Counts of 1 bit, 7, 2, 13 and 15 (the most); periods a power of two and not, a
        // millisecond to an hour (whose unit is 2^24 µs, less than the period).
        for q in [
            quota(1, 1_000_000, 1),
            quota(100, 60_000_000, 100),
            quota(3, 1_000, 3),
            quota(8_191, 1 << 20, 8_191),
            quota(32_767, 1_000_000, 32_767),
            quota(100, 3_600_000_000, 100),
        ] {
            let period = q.period_micros();
            let unit = 1 << period.ilog2().min(24);
            let mut state = State::default();
            let mut now = ORIGIN + 5;
            for step in 0u64..2_000 {
                now += step * 7_919 % (2 * period + 3);
                // Now and then a third of the limit, so that counts take all their bits.
                let cost = if step % 9 == 8 {
                    q.limit() / 3
                } else {
                    step % 4
                };
                state = match step % 5 {
                    4 => sliding_counter::refund(state, now, &q, cost),
                    _ => sliding_counter::check(state, now, &q, cost).1,
                };
                assert!(State::may_pack(now, &q, ORIGIN), "{q:?} at {now}");
                let word = state.pack(&q, ORIGIN).unwrap();
                assert_eq!(State::unpack(word, &q, ORIGIN), state, "{q:?} at {now}");
                // The end of the unit the instant falls in (a fresh state's: 0).
                let fresh = expiry(packed_key(step), word, ORIGIN);
                let end = match state.expires_at {
                    0 => 0,
                    at => ORIGIN + (at - ORIGIN).div_ceil(unit) * unit,
                };
                assert_eq!(fresh, end, "{q:?}: {state:?}");
                assert!(fresh < state.expires_at.max(ORIGIN) + period.min(unit));
            }
        }
        // 32,767 a second: 2^19 units of 2^19 µs from the origin.
        let q = quota(32_767, 1_000_000, 32_767);
        let last = State {
            expires_at: ORIGIN + (1 << 38) - (1 << 19),
            prev: 32_767,
            curr: 32_767,
        };
        let last = State {
            expires_at: last.expires_at - q.rem_period(last.expires_at),
            ..last
        };
        assert_eq!(
            State::unpack(last.pack(&q, ORIGIN).unwrap(), &q, ORIGIN),
            last
        );
        let past = State {
            expires_at: last.expires_at + 1_000_000,
            ..last
        };
        assert_eq!(past.pack(&q, ORIGIN), None);
        assert!(State::may_pack(ORIGIN + (1 << 38) - 1, &q, ORIGIN));
        assert!(!State::may_pack(ORIGIN + (1 << 38), &q, ORIGIN));
        let before = State {
            expires_at: ORIGIN - 1_000_000 - q.rem_period(ORIGIN),
            ..last
        };
        assert_eq!(before.pack(&q, ORIGIN), None);
        assert!(!State::may_pack(ORIGIN - 1, &q, ORIGIN));
        // A limit of one a second has a range past any clock, but not before the origin.
        let one = quota(1, 1_000_000, 1);
        assert!(State::may_pack(u64::MAX, &one, ORIGIN));
        assert!(!State::may_pack(ORIGIN - 1, &one, ORIGIN));
        // Counts of 16 bits are kept under the lock.
        let wide = quota(32_768, 1_000_000, 32_768);
        assert!(!State::may_pack(ORIGIN, &wide, ORIGIN));
        let one = sliding_counter::check(State::default(), ORIGIN, &wide, 1).1;
        assert_eq!(one.pack(&wide, ORIGIN), None);
        assert_eq!(State::default().pack(&q, ORIGIN), Some(FRESH));
        assert_eq!(State::unpack(FRESH, &q, ORIGIN), State::default());
    }

    #[test]
    fn a_key_says_which_form_its_cell_holds() {
        let hash = 0x8000_0000_0000_0001;
        assert_eq!(expiry(instant_key(hash), 12_345, ORIGIN), 12_345);
        assert_eq!(instant_key(0), 2);
        assert_eq!(instant_key(PACKED | 1), 2);
        assert_ne!(packed_key(hash) & PACKED, 0);
    }
}
