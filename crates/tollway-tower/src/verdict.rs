//! A decision with the policy that made it, and which of a request's decisions to report.

use std::time::Duration;

use tollway_core::{Decision, Denial, Policy};

/// A decision, and the policy that made it.
#[derive(Clone, Copy, Debug)]
pub struct Verdict<'a> {
    /// The policy.
    pub policy: &'a Policy,
    /// Its decision.
    pub decision: Decision,
}

impl Verdict<'_> {
    /// `Retry-After` for this verdict: whole seconds rounded up, never 0; `None` when it
    /// allowed the request, or when waiting cannot help.
    #[must_use]
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.decision
            .retry_after()
            .map(|wait| wait.as_micros().div_ceil(1_000_000).max(1) as u64)
    }

    /// The sentence that explains a denial, in pieces: a wait's `digits` go in the middle.
    /// The JSON body of a 429 and the message of a gRPC status both say it.
    pub(crate) fn denial_message<'b>(&self, digits: &'b mut itoa::Buffer) -> [&'b str; 3] {
        match (self.retry_after_secs(), self.decision.denial()) {
            (Some(secs), _) => [
                "API rate limit exceeded. Please retry after ",
                digits.format(secs),
                " seconds.",
            ],
            (None, Some(Denial::StoreFull)) => [
                "The rate limiter is tracking too many callers to admit a new one. Please retry later.",
                "",
                "",
            ],
            (None, Some(Denial::CostExceedsCapacity)) => [
                "This request costs more than the rate limit allows at once; it cannot succeed.",
                "",
                "",
            ],
            // `Denial` may grow: a denial this crate does not know yet says no more than this.
            _ => ["API rate limit exceeded. Please retry later.", "", ""],
        }
    }
}

/// Of a request's verdicts, the position of the one its headers and its denial report.
///
/// That is a denial, the longest wait first. Else it is the fewest remaining: the soonest
/// to deny. Else it is the latest reset.
pub(crate) fn most_restrictive(verdicts: &[Verdict<'_>]) -> Option<usize> {
    (0..verdicts.len()).min_by_key(|&i| restriction(&verdicts[i]))
}

/// Orders verdicts from the most restrictive (see [`most_restrictive`]).
pub(crate) fn restriction(verdict: &Verdict<'_>) -> (bool, u64, u64, u64) {
    let d = &verdict.decision;
    (
        d.is_allowed(),
        u64::MAX - d.retry_after_micros(),
        d.remaining(),
        u64::MAX - d.reset_after_micros(),
    )
}

/// The longest shaping delay among `decisions`, if any: a request admitted by several
/// limits waits for the slowest.
pub(crate) fn max_delay<'d>(decisions: impl Iterator<Item = &'d Decision>) -> Option<Duration> {
    let delay_us = decisions.map(Decision::delay_micros).max();
    delay_us.filter(|&us| us > 0).map(Duration::from_micros)
}
