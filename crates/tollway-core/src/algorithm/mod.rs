//! The rate-limiting algorithms, and the limit on calls in flight, as pure functions.
//!
//! Each algorithm is plain integer arithmetic with the shape
//! `(state, now, quota, cost) -> (decision, new state)`: no I/O, no clock, no floats.
//! `now` is whole microseconds, supplied by the caller. The memory store runs these
//! functions. The Redis store runs their Lua twins in `lua/`, which must decide
//! identically.
//!
//! | algorithm | burst | state per key | boundary accuracy | limits it serves |
//! |---|---|---|---|---|
//! | [token bucket](token_bucket) | up to `burst` at once | 2 integers | exact rate | any |
//! | [leaky bucket](leaky_bucket) meter | up to `burst` at once | 2 integers | exact rate | any |
//! | [leaky bucket](leaky_bucket) shaper | none: queued, then delayed | 1 integer | steady output | any |
//! | [fixed window](fixed_window) | up to 2× limit across a boundary | 2 integers | weak at boundaries | any |
//! | [sliding window log](sliding_log) | limit in any window | 1 entry per unit | exact | up to 10,000 a period |
//! | [sliding window counter](sliding_counter) | approximates the log | 2 counters + time | estimate | any |
//! | [GCRA](gcra) | up to `burst` at once | 1 integer | rate rounded up to 1 µs | any |
//! | [`concurrency`] | `limit` calls in flight | 2 integers (Redis: a gateway) | exact | any |
//!
//! "Any" is any quota [`Quota`](crate::Quota) accepts: limit × period and burst ×
//! period within 2^52 microseconds. A decision costs the same at any limit, in memory
//! and in Redis. (The log's commands are O(log n) in its entries.) The log's memory
//! grows with its limit, which [`Policy`](crate::Policy) caps.
//!
//! `cargo run --example compare` measures these claims on the same traffic.

pub mod concurrency;
pub mod fixed_window;
pub mod gcra;
pub mod leaky_bucket;
pub mod sliding_counter;
pub mod sliding_log;
pub mod token_bucket;

/// Defines [`Algorithm`] and [`Algorithm::ALL`] from one list, so `ALL` names every
/// variant: a new one is in `ALL` at once, and the compiler names each `match` that
/// must handle it.
macro_rules! algorithms {
    ($($(#[$doc:meta])* $variant:ident,)+) => {
        /// Which algorithm a policy uses.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Algorithm {
            $($(#[$doc])* $variant,)+
        }

        impl Algorithm {
            /// Every algorithm, in the order of the table above.
            pub const ALL: [Algorithm; [$(Algorithm::$variant),+].len()] =
                [$(Algorithm::$variant),+];
        }
    };
}

algorithms! {
    /// [`token_bucket`]: bursts up to capacity, exact refill.
    TokenBucket,
    /// [`leaky_bucket::meter`]: rejects what overflows the bucket.
    LeakyBucket,
    /// [`leaky_bucket::shape`]: delays requests to a steady rate, rejects beyond the queue.
    LeakyBucketShaper,
    /// [`fixed_window`]: a counter per aligned window.
    FixedWindow,
    /// [`sliding_log`]: every admission remembered for one period; exact.
    SlidingWindowLog,
    /// [`sliding_counter`]: this window's count plus a weighted share of the last.
    SlidingWindowCounter,
    /// [`gcra`]: a token bucket kept as one timestamp.
    Gcra,
    /// [`concurrency`]: at most `limit` calls in flight, each holding its slots until it
    /// ends; the quota's period is how long slots live unrenewed.
    Concurrency,
}

impl Algorithm {
    /// A short stable name: `token_bucket`, `leaky_bucket`, `leaky_bucket_shaper`,
    /// `fixed_window`, `sliding_window_log`, `sliding_window_counter`, `gcra`,
    /// `concurrency`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::LeakyBucketShaper => "leaky_bucket_shaper",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindowLog => "sliding_window_log",
            Algorithm::SlidingWindowCounter => "sliding_window_counter",
            Algorithm::Gcra => "gcra",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// Whether a store may lend this algorithm's units in batches, to be spent later
    /// by [`Leased`](crate::Leased) (see its docs for why each may or may not).
    ///
    /// The token bucket, the leaky bucket meter, GCRA and both windows lend. The sliding
    /// window log and the shaper decide each request where its state lives: the log
    /// remembers each admission's own instant, and the shaper gives each its own slot.
    /// A slot of [`Concurrency`](Algorithm::Concurrency) is held by one call, not spent.
    #[must_use]
    pub const fn lends(self) -> bool {
        match self {
            Algorithm::TokenBucket
            | Algorithm::LeakyBucket
            | Algorithm::FixedWindow
            | Algorithm::SlidingWindowCounter
            | Algorithm::Gcra => true,
            Algorithm::LeakyBucketShaper | Algorithm::SlidingWindowLog | Algorithm::Concurrency => {
                false
            }
        }
    }

    /// Whether a charge that does not fit ([`Operation::Charge`](crate::Operation::Charge))
    /// is kept as a debt, waited out before anything fits again.
    ///
    /// The token bucket, both leaky buckets and GCRA keep it. The windows forget it when
    /// their window ends, and a slot of [`Concurrency`](Algorithm::Concurrency) is not
    /// spent. A budget settled after responses needs one that keeps it.
    #[must_use]
    pub const fn keeps_debt(self) -> bool {
        match self {
            Algorithm::TokenBucket
            | Algorithm::LeakyBucket
            | Algorithm::LeakyBucketShaper
            | Algorithm::Gcra => true,
            Algorithm::FixedWindow
            | Algorithm::SlidingWindowLog
            | Algorithm::SlidingWindowCounter
            | Algorithm::Concurrency => false,
        }
    }

    /// Whether the algorithm uses the quota's burst as its capacity. The window
    /// algorithms count `limit` per window and have no separate burst; concurrency
    /// holds `limit` slots.
    #[must_use]
    pub const fn uses_burst(self) -> bool {
        !matches!(
            self,
            Algorithm::FixedWindow
                | Algorithm::SlidingWindowLog
                | Algorithm::SlidingWindowCounter
                | Algorithm::Concurrency
        )
    }
}

/// A fixed-size state packed into two integers. The first is always the instant after
/// which the state is equivalent to a fresh key, so a store can drop idle keys without
/// knowing which algorithm wrote them.
pub(crate) type Slot = [u64; 2];

/// The fixed-size states, packed for the memory store. `from_slot([0, 0])` is fresh.
pub(crate) trait SlotState: Copy {
    fn to_slot(self) -> Slot;
    fn from_slot(slot: Slot) -> Self;
}

#[cfg(test)]
pub(crate) mod testing {
    use crate::{Decision, Quota};

    /// Replays `(now, cost)` events through one algorithm from a fresh state.
    pub(crate) fn run<S: Default + Copy>(
        f: fn(S, u64, &Quota, u64) -> (Decision, S),
        quota: &Quota,
        trace: &[(u64, u64)],
    ) -> Vec<Decision> {
        let mut state = S::default();
        trace
            .iter()
            .map(|&(now, cost)| {
                let (d, next) = f(state, now, quota, cost);
                state = next;
                d
            })
            .collect()
    }
}
