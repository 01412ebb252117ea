//! The sliding window counter against the exact log on a long bursty trace.

use super::*;

/// splitmix64: a fixed-seed generator, so the trace (and the measurement) never changes.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (the modulo bias is irrelevant here).
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// Request times (µs) for a limit of 100 per second, in stretches of four kinds with idle
/// gaps (up to 3 s) between them: quiet traffic well under the limit (~30/s), bursts far
/// over it (~1000/s), traffic hovering around it (~100/s), and bursts straddling a window
/// boundary (starting up to 0.2 s before a whole second), the case the counter's weighting
/// of the previous window exists for.
pub(crate) fn bursty_trace(seed: u64, at_least: usize) -> Vec<u64> {
    const SECOND: u64 = 1_000_000;
    let mut rng = SplitMix64(seed);
    let mut now = 0;
    let mut times = Vec::with_capacity(at_least + 1_000);
    while times.len() < at_least {
        let (count, min_gap, max_gap) = match rng.between(0, 3) {
            0 => (rng.between(20, 200), 5_000, 60_000),
            1 => (rng.between(50, 500), 0, 2_000),
            2 => (rng.between(100, 600), 7_000, 13_000),
            _ => {
                now = (now / SECOND + 1) * SECOND - rng.between(0, 200_000);
                (rng.between(100, 250), 0, 3_000)
            }
        };
        for _ in 0..count {
            now += rng.between(min_gap, max_gap);
            times.push(now);
        }
        now += rng.between(0, 3 * SECOND);
    }
    times
}

pub(crate) fn percent(part: usize, whole: usize) -> f64 {
    100.0 * part as f64 / whole as f64
}

/// How often the sliding window counter decides differently from the exact log, on a
/// fixed bursty trace of 100,000 unit requests at 100 per second.
///
/// Measured: 5,268 of 100,114 requests (5.262%; the counter admitted 69,171, the log
/// 68,083), against 9,667 (9.656%) for the fixed window, which is the counter with its
/// previous-window term dropped. Broken counters measured on this same trace: weighting
/// the previous window by 3/4 of its share gives 6.638%, by half 7.849%. The bound, 6%,
/// leaves the correct counter about 15% headroom for harmless changes (rounding,
/// tie-breaking) and fails all of those. The trace is fixed, so the measurement is too;
/// the fixed window's share is asserted above the bound so that a change to the trace
/// that stops telling the algorithms apart fails as well.
#[test]
pub(crate) fn sliding_counter_error_against_the_exact_log() {
    const BOUND_PERCENT: f64 = 6.0;
    let q = Quota::per_second(100).unwrap();
    let times = bursty_trace(0x7011_6A7E, 100_000);
    assert!(times.len() >= 100_000);

    let mut log = sliding_log::Log::default();
    let mut counter = sliding_counter::State::default();
    let mut window = fixed_window::State::default();
    let (mut differ, mut window_differ) = (0, 0);
    let (mut by_counter, mut by_log) = (0, 0);
    for &now in &times {
        let exact = sliding_log::check(&mut log, now, &q, 1).is_allowed();
        let (d, next) = sliding_counter::check(counter, now, &q, 1);
        counter = next;
        let (w, next) = fixed_window::check(window, now, &q, 1);
        window = next;
        by_log += usize::from(exact);
        by_counter += usize::from(d.is_allowed());
        differ += usize::from(d.is_allowed() != exact);
        window_differ += usize::from(w.is_allowed() != exact);
    }
    let n = times.len();
    let (share, window_share) = (percent(differ, n), percent(window_differ, n));
    println!(
        "sliding window counter vs exact log: {differ} of {n} requests decided differently \
         ({share:.3}%); admitted: counter {by_counter}, log {by_log}"
    );
    println!(
        "(baseline) fixed window vs exact log: {window_differ} of {n} requests decided \
         differently ({window_share:.3}%)"
    );
    assert!(
        share < BOUND_PERCENT,
        "the counter strays too far from the log: {share:.3}%"
    );
    assert!(
        window_share > BOUND_PERCENT,
        "the trace no longer tells the algorithms apart"
    );
}
