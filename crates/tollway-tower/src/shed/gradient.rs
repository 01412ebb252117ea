//! The adaptive limit's rule: a gradient of latency, one window at a time.
//!
//! Each window of calls gives a short latency, their median. A long baseline follows the
//! short one slowly: the lowest of the first ten windows, then an exponential moving
//! average. Their ratio is the gradient:
//!
//! ```text
//! gradient = clamp(tolerance × baseline / short, 0.5, 1)
//! new      = limit × gradient + (gradient == 1 ? √limit : 0)
//! limit    = limit × (1 − smoothing) + new × smoothing, within [floor, ceiling]
//! ```
//!
//! The median, not the average: a call's time includes its client's (a request body
//! sent slowly, a response read slowly). A few slow clients would move an average as far
//! as they like, and hold the limit at its floor. They cannot move the median; a service
//! that slows for most of its calls does.
//!
//! Latency within `tolerance` of the baseline lets the limit grow by its square root.
//! Latency above it shrinks the limit in proportion, at most by half a window before
//! smoothing. A window in which the calls in flight stayed under half the limit says
//! nothing about what the service can take: the limit stays.
//!
//! Plain arithmetic on the times it is given: no clock, no I/O.

/// Windows whose lowest latency starts the baseline.
const WARM_UP: u32 = 10;

/// The latencies a window keeps for its median: a uniform sample of them when it has
/// more (reservoir sampling), so that no stretch of the window can choose it.
const KEPT: usize = 512;

/// Settings of the rule, checked by the builder.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Settings {
    pub(super) initial: u32,
    pub(super) floor: u32,
    pub(super) ceiling: u32,
    pub(super) tolerance: f64,
    /// Of a window, in microseconds.
    pub(super) window: u64,
    /// Calls a window needs before it counts.
    pub(super) min_samples: u32,
    /// Windows the baseline averages over (an exponential moving average).
    pub(super) long_windows: u32,
    pub(super) smoothing: f64,
}

/// The limit and what it is learning from.
#[derive(Clone, Debug)]
pub(super) struct Gradient {
    limit: f64,
    /// When the current window started, in microseconds.
    started: u64,
    /// Latencies of the window's calls, in microseconds: [`KEPT`] of them at most.
    kept: Vec<u64>,
    count: u32,
    /// The most calls in flight at once in the window.
    peak: u32,
    /// The long latency, in microseconds; `None` before the first window.
    baseline: Option<f64>,
    /// Windows the baseline has seen, up to [`WARM_UP`].
    seen: u32,
}

impl Gradient {
    /// A limit at `initial`, whose first window starts at `now`.
    pub(super) fn new(initial: u32, now: u64) -> Self {
        Gradient {
            limit: f64::from(initial),
            started: now,
            kept: Vec::new(),
            count: 0,
            peak: 0,
            baseline: None,
            seen: 0,
        }
    }

    /// The limit, in whole calls.
    pub(super) fn limit(&self) -> u32 {
        // The limit stays within [floor, ceiling], both `u32`.
        self.limit as u32
    }

    /// The baseline latency in microseconds, once a window has ended.
    #[cfg(test)]
    pub(super) fn baseline(&self) -> Option<f64> {
        self.baseline
    }

    /// Notes `in_flight` calls at once.
    pub(super) fn in_flight(&mut self, in_flight: u32) {
        self.peak = self.peak.max(in_flight);
    }

    /// A call of `latency` microseconds ended at `now`, with `in_flight` calls left.
    /// Returns the new limit when this call closed a window.
    pub(super) fn sample(
        &mut self,
        settings: &Settings,
        now: u64,
        latency: u64,
        in_flight: u32,
    ) -> Option<u32> {
        if self.kept.len() < KEPT {
            self.kept.push(latency);
        } else {
            // Reservoir sampling: the n-th call replaces a kept one with chance KEPT / n.
            // Its index comes from a hash of the window and the call's number: the same
            // on every run, and no caller chooses it.
            let n = u64::from(self.count) + 1;
            let at = mix(self.started ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) % n;
            if let Ok(at) = usize::try_from(at)
                && at < KEPT
            {
                self.kept[at] = latency;
            }
        }
        self.count = self.count.saturating_add(1);
        if now.saturating_sub(self.started) < settings.window || self.count < settings.min_samples {
            return None;
        }
        let middle = self.kept.len() / 2;
        let (_, &mut median, _) = self.kept.select_nth_unstable(middle);
        // At least a microsecond: a manual clock may not move within a call.
        let short = (median as f64).max(1.0);
        let peak = self.peak;
        self.started = now;
        self.kept.clear();
        self.count = 0;
        self.peak = in_flight;
        let baseline = self.learn(settings, short);
        if f64::from(peak) < self.limit / 2.0 {
            return Some(self.limit());
        }
        let gradient = (settings.tolerance * baseline / short).clamp(0.5, 1.0);
        let queue = if gradient >= 1.0 {
            self.limit.sqrt()
        } else {
            0.0
        };
        let target = self.limit * gradient + queue;
        let smoothed = self.limit * (1.0 - settings.smoothing) + target * settings.smoothing;
        self.limit = smoothed.clamp(f64::from(settings.floor), f64::from(settings.ceiling));
        Some(self.limit())
    }

    /// Moves the baseline towards the window's `short` latency, and returns it.
    fn learn(&mut self, settings: &Settings, short: f64) -> f64 {
        let baseline = match self.baseline {
            None => short,
            // The first windows: the lowest latency seen, which a start under load
            // cannot raise.
            Some(long) if self.seen < WARM_UP => long.min(short),
            Some(long) => {
                let alpha = 2.0 / (f64::from(settings.long_windows) + 1.0);
                let long = long + alpha * (short - long);
                // Latency fell far below the baseline (a cold start, a fix): catch up.
                if long > 2.0 * short {
                    long * 0.95
                } else {
                    long
                }
            }
        };
        self.seen = (self.seen + 1).min(WARM_UP);
        self.baseline = Some(baseline);
        baseline
    }

    /// Takes `previous`'s limit (within `settings`) and what it learnt of latency, with
    /// a window starting at `now`: `previous` may have counted on another clock.
    pub(super) fn continue_from(&mut self, settings: &Settings, previous: &Gradient, now: u64) {
        let limit = previous
            .limit
            .clamp(f64::from(settings.floor), f64::from(settings.ceiling));
        *self = Gradient {
            limit,
            baseline: previous.baseline,
            seen: previous.seen,
            ..Gradient::new(settings.floor, now)
        };
    }
}

/// splitmix64's finaliser: a well-spread number from `z`.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            initial: 20,
            floor: 10,
            ceiling: 200,
            tolerance: 1.5,
            window: 1_000_000,
            min_samples: 10,
            long_windows: 600,
            smoothing: 0.2,
        }
    }

    /// Feeds one window of `calls` calls of `latency` µs with `in_flight` at once, from
    /// `*now`; returns the limit after it.
    fn window(g: &mut Gradient, now: &mut u64, calls: u32, latency: u64, in_flight: u32) -> u32 {
        let s = settings();
        let step = s.window / u64::from(calls);
        let mut limit = None;
        for _ in 0..calls {
            g.in_flight(in_flight);
            *now += step;
            limit = g.sample(&s, *now, latency, in_flight).or(limit);
        }
        limit.expect("the window closed")
    }

    #[test]
    fn latency_at_the_baseline_grows_a_busy_limit() {
        let (mut g, mut now) = (Gradient::new(20, 0), 0);
        let mut last = 20;
        for _ in 0..10 {
            let limit = window(&mut g, &mut now, 100, 10_000, last);
            assert!(limit >= last, "{limit} >= {last}");
            last = limit;
        }
        // √20 ≈ 4.5 a window before smoothing: 0.9 a window after it, at first.
        assert!((28..=40).contains(&last), "{last}");
    }

    #[test]
    fn latency_over_the_tolerance_shrinks_the_limit_to_the_floor() {
        let (mut g, mut now) = (Gradient::new(100, 0), 0);
        window(&mut g, &mut now, 100, 10_000, 40);
        let mut last = g.limit();
        for _ in 0..30 {
            let limit = window(&mut g, &mut now, 100, 40_000, last);
            assert!(limit <= last, "{limit} <= {last}");
            last = limit;
        }
        assert_eq!(last, 10, "the floor");
    }

    #[test]
    fn an_idle_service_keeps_its_limit() {
        let (mut g, mut now) = (Gradient::new(100, 0), 0);
        for _ in 0..5 {
            assert_eq!(window(&mut g, &mut now, 20, 10_000, 10), 100);
        }
        // Still idle but slow: nothing to learn about the limit either.
        assert_eq!(window(&mut g, &mut now, 20, 90_000, 10), 100);
    }

    #[test]
    fn a_window_needs_its_samples() {
        let s = settings();
        let mut g = Gradient::new(20, 0);
        for i in 1..s.min_samples {
            assert_eq!(g.sample(&s, 2_000_000 + u64::from(i), 5_000, 20), None);
        }
        assert!(g.sample(&s, 2_000_100, 5_000, 20).is_some());
    }

    // A slow client's call lasts as long as it likes. An average of one 10 s call among
    // a window's 10 ms ones took the limit to the floor; the median does not move.
    #[test]
    fn a_few_slow_calls_do_not_move_the_limit() {
        let s = settings();
        let (mut g, mut now) = (Gradient::new(100, 0), 0);
        window(&mut g, &mut now, 100, 10_000, 60);
        let before = g.limit();
        for _ in 0..20 {
            for i in 0..100 {
                now += 10_000;
                let latency = if i % 25 == 0 { 10_000_000 } else { 10_000 };
                g.in_flight(60);
                g.sample(&s, now, latency, 60);
            }
        }
        assert!(g.limit() >= before, "{} >= {before}", g.limit());
    }

    // 2,000 calls a window, the slow ones in the middle: the first 512 or the last 512
    // would be mostly fast, a sample of the whole is mostly slow.
    #[test]
    fn a_window_of_many_calls_is_sampled_whole() {
        let s = settings();
        let (mut g, mut now) = (Gradient::new(100, 0), 0);
        window(&mut g, &mut now, 100, 10_000, 60);
        let before = g.limit();
        for _ in 0..10 {
            for i in 0..2_000 {
                now += 500;
                let latency = if (300..1_700).contains(&i) {
                    40_000
                } else {
                    10_000
                };
                g.in_flight(60);
                g.sample(&s, now, latency, 60);
            }
        }
        assert!(g.limit() < before, "{} < {before}", g.limit());
    }

    #[test]
    fn the_baseline_catches_up_when_latency_falls() {
        let (mut g, mut now) = (Gradient::new(20, 0), 0);
        for _ in 0..20 {
            window(&mut g, &mut now, 50, 100_000, 20);
        }
        let high = g.baseline().unwrap();
        for _ in 0..20 {
            window(&mut g, &mut now, 50, 10_000, 20);
        }
        let low = g.baseline().unwrap();
        assert!(low < high / 2.0, "{low} < {high} / 2");
    }
}
