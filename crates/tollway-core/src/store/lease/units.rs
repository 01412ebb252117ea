//! A loan's units, and until when each may be spent.
//!
//! A unit taken from the shared state is spent later, here. It stays good only while
//! spending it now could not have been refused by the shared state then:
//!
//! - A bucket's or GCRA's unit `j` of a loan is good until the state would have refilled
//!   unit `j − 1` of it. Spent later, the refill would already be there for a request at
//!   the store, and the two together could pass the burst.
//! - A window's units are good until their window ends. Spent in the next window, they
//!   would not be in its count.
//!
//! So the units spent in any interval are at most what the algorithm admits in it. Time
//! here is this process's clock, counted from when the loan's call was sent. The store
//! read its time later, so every unit goes bad here no later than there.

use smallvec::SmallVec;

use crate::store::Grant;
use crate::{Algorithm, Decision, Decisions, Policy};

/// When one limit's units of a loan go bad, counted from the loan's origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Expiry {
    /// Unit `j` (from 1) is good while `elapsed × per_us ≤ lead + (j − 1) × spacing`.
    ///
    /// `lead` is how far the state stood from full before the loan, and `spacing` what
    /// a unit is worth, both in the algorithm's ticks: µs for GCRA; for a bucket, ticks
    /// of which a µs refills `per_us` (its limit) and a unit is `spacing` (its period).
    Slots {
        lead: u64,
        spacing: u64,
        per_us: u64,
    },
    /// Every unit is good while `elapsed < until` µs: until the window ends.
    Until(u64),
}

impl Expiry {
    /// When `policy`'s units of a grant of `units` go bad, from the grant's decision for
    /// it. `None` for the algorithms that do not lend.
    pub(super) fn of(policy: &Policy, decision: &Decision, units: u64) -> Option<Expiry> {
        let quota = policy.quota();
        let reset = decision.reset_after_micros();
        match policy.algorithm() {
            // The arrival time after the loan is `reset` ahead: `units` intervals past
            // where it stood.
            Algorithm::Gcra => {
                let spacing = quota.emission_micros();
                Some(Expiry::Slots {
                    lead: reset.saturating_sub(units.saturating_mul(spacing)),
                    spacing,
                    per_us: 1,
                })
            }
            // `reset` is the deficit after the loan in µs, rounded up: the deficit before
            // it was at least `(reset − 1) × limit + 1 − units × period` ticks. Taking
            // the least makes every unit go bad no later than it does in the store.
            Algorithm::TokenBucket | Algorithm::LeakyBucket => {
                let (limit, period) = (quota.limit(), quota.period_micros());
                let after = match reset {
                    0 => 0,
                    // Past u64 (no valid quota gets there): no lead, the units go bad soonest.
                    us => (us - 1).checked_mul(limit).map_or(0, |ticks| ticks + 1),
                };
                Some(Expiry::Slots {
                    lead: after.saturating_sub(units.saturating_mul(period)),
                    spacing: period,
                    per_us: limit,
                })
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => Some(Expiry::Until(
                crate::store::lend::window_end(policy, decision, 0),
            )),
            Algorithm::LeakyBucketShaper | Algorithm::SlidingWindowLog | Algorithm::Concurrency => {
                None
            }
        }
    }

    /// The first unit (from 1) still good `elapsed` µs after the origin; `u64::MAX` when
    /// none is.
    fn first_good(self, elapsed: u64) -> u64 {
        match self {
            Expiry::Slots {
                lead,
                spacing,
                per_us,
            } => {
                let at = u128::from(elapsed) * u128::from(per_us);
                let Some(past) = at.checked_sub(u128::from(lead)).filter(|&p| p > 0) else {
                    return 1;
                };
                let behind = past.div_ceil(u128::from(spacing.max(1)));
                u64::try_from(behind + 1).unwrap_or(u64::MAX)
            }
            Expiry::Until(until) if elapsed < until => 1,
            Expiry::Until(_) => u64::MAX,
        }
    }
}

/// One limit of a loan: when its units go bad, and what the store said of it.
#[derive(Clone, Copy, Debug)]
struct Held {
    expiry: Expiry,
    /// The grant's decision: the limit, and what remained in the store after it.
    decision: Decision,
    /// For a window, where it ends on the store's clock (0 for a bucket or GCRA): what a
    /// give-back names.
    end: u64,
}

/// Units taken from the store in one call, to be spent here in order.
#[derive(Clone, Debug)]
pub(super) struct Loan {
    /// When the call was sent, on this process's clock (µs).
    origin: u64,
    /// The next unit to spend, from 1.
    next: u64,
    /// The last unit.
    last: u64,
    limits: SmallVec<[Held; 2]>,
}

impl Loan {
    /// The units of `grant` past the first `spent` (the cost of the request it
    /// answered), lent for `policies` by a call sent at `origin`. `None` when there are
    /// none, or a policy does not lend.
    pub(super) fn new(
        origin: u64,
        policies: &[&Policy],
        grant: &Grant,
        spent: u64,
    ) -> Option<Loan> {
        let units = grant.units();
        if units <= spent || policies.len() != grant.decisions().len() {
            return None;
        }
        let limits = policies
            .iter()
            .zip(grant.decisions().iter())
            .map(|(policy, decision)| {
                let expiry = Expiry::of(policy, decision, units)?;
                let end = crate::store::lend::window_end(policy, decision, grant.at());
                Some(Held {
                    expiry,
                    decision: *decision,
                    end,
                })
            })
            .collect::<Option<SmallVec<[Held; 2]>>>()?;
        Some(Loan {
            origin,
            next: spent + 1,
            last: units,
            limits,
        })
    }

    /// The first unit still good at `now` under every limit, if it is not spent.
    fn first_good(&self, now: u64) -> u64 {
        let elapsed = now.saturating_sub(self.origin);
        self.limits
            .iter()
            .map(|held| held.expiry.first_good(elapsed))
            .fold(self.next, u64::max)
    }

    /// How many of its units are good at `now`.
    pub(super) fn good(&self, now: u64) -> u64 {
        (self.last + 1).saturating_sub(self.first_good(now))
    }

    /// Whether it holds a window's units, which the store can take back.
    pub(super) fn windowed(&self) -> bool {
        self.limits.iter().any(|held| held.end > 0)
    }

    /// Each limit's window end on the store's clock (0 for a bucket or GCRA).
    pub(super) fn ends(&self) -> SmallVec<[u64; 2]> {
        self.limits.iter().map(|held| held.end).collect()
    }

    /// How many of its units were not spent (gone bad, or still good).
    pub(super) fn unspent(&self) -> u64 {
        (self.last + 1).saturating_sub(self.next)
    }

    /// Spends `cost` units at `now`, if as many are good: the decisions of the request.
    ///
    /// Each limit tells the store's answer to the loan, moved on: the units that
    /// remained in the store plus those still good here, and the reset counted down.
    pub(super) fn spend(&mut self, now: u64, cost: u64) -> Option<Decisions> {
        let first = self.first_good(now);
        let end = first.checked_add(cost)?;
        if end > self.last + 1 {
            return None;
        }
        self.next = end;
        let good = self.last + 1 - end;
        let elapsed = now.saturating_sub(self.origin);
        Some(
            self.limits
                .iter()
                .map(|held| {
                    let d = held.decision;
                    let remaining = d.remaining().saturating_add(good).min(d.limit());
                    let reset = d.reset_after_micros().saturating_sub(elapsed);
                    Decision::allow(d.limit(), remaining, reset, 0)
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Quota;

    fn grant(policy: &Policy, decision: Decision, units: u64) -> Grant {
        let _ = policy;
        Grant::new(units, Decisions::from(decision), 0)
    }

    // A GCRA loan from a full bucket: the state would refill unit j − 1 of it
    // (j − 1) intervals later, so the loan's units go bad one an interval.
    #[test]
    fn a_gcra_loan_from_a_full_state_loses_a_unit_an_interval() {
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(10).unwrap()).unwrap();
        // 5 units from a full state: the arrival time is 5 intervals (500 ms) ahead.
        let d = Decision::allow(10, 5, 500_000, 0);
        let mut loan = Loan::new(0, &[&policy], &grant(&policy, d, 5), 1).unwrap();
        assert_eq!(loan.good(0), 4);
        // Unit 2 is good until 100 ms, unit 5 until 400 ms.
        assert_eq!(loan.good(100_000), 4);
        assert_eq!(loan.good(100_001), 3);
        assert_eq!(loan.good(400_000), 1);
        assert_eq!(loan.good(400_001), 0);
        assert!(loan.spend(250_000, 2).is_some());
        assert_eq!(
            loan.good(250_000),
            0,
            "units 4 and 5 were spent; 2 and 3 went bad"
        );
        assert!(loan.spend(250_000, 1).is_none());
    }

    // A loan taken while the state was already 300 ms ahead lives 300 ms longer.
    #[test]
    fn a_gcra_loan_behind_others_lives_longer() {
        let policy = Policy::new("p", Algorithm::Gcra, Quota::per_second(10).unwrap()).unwrap();
        let d = Decision::allow(10, 2, 800_000, 0);
        let loan = Loan::new(0, &[&policy], &grant(&policy, d, 5), 0).unwrap();
        assert_eq!(loan.good(300_000), 5);
        assert_eq!(loan.good(300_001), 4);
    }

    // The token bucket counts in ticks; its lead is rounded down so that no unit lives
    // longer here than in the store.
    #[test]
    fn a_token_bucket_loan_goes_bad_no_later_than_its_refill() {
        // 3 a second: a unit is 1,000,000 ticks, a µs refills 3.
        let policy =
            Policy::new("p", Algorithm::TokenBucket, Quota::per_second(3).unwrap()).unwrap();
        // From full, 3 units: the deficit is 3,000,000 ticks, 1,000,000 µs to refill.
        let d = Decision::allow(3, 0, 1_000_000, 0);
        let loan = Loan::new(0, &[&policy], &grant(&policy, d, 3), 0).unwrap();
        // Unit j is good while 3 × elapsed ≤ lead + (j − 1) × 1,000,000, lead = 0.
        assert_eq!(loan.good(0), 3);
        assert_eq!(loan.good(1), 2);
        assert_eq!(loan.good(333_333), 2);
        assert_eq!(loan.good(333_334), 1);
        assert_eq!(loan.good(666_667), 0);
    }

    #[test]
    fn a_window_loan_is_good_until_the_window_ends() {
        let quota = Quota::per_minute(100).unwrap();
        let fixed = Policy::new("f", Algorithm::FixedWindow, quota.clone()).unwrap();
        let sliding = Policy::new("s", Algorithm::SlidingWindowCounter, quota).unwrap();
        // 20 s left in the fixed window; the sliding one's reset is its end + a period.
        let decisions: Decisions = [
            Decision::allow(100, 50, 20_000_000, 0),
            Decision::allow(100, 50, 70_000_000, 0),
        ]
        .into_iter()
        .collect();
        let grant = Grant::new(10, decisions, 40_000_000);
        let mut loan = Loan::new(0, &[&fixed, &sliding], &grant, 1).unwrap();
        assert!(loan.windowed());
        assert_eq!(loan.ends()[..], [60_000_000, 50_000_000]);
        assert_eq!(loan.good(9_999_999), 9);
        assert_eq!(loan.good(10_000_000), 0, "the sliding window ends first");
        let told = loan.spend(5_000_000, 9).unwrap();
        assert_eq!(told[0].remaining(), 50);
        assert_eq!(told[0].reset_after_micros(), 15_000_000);
        assert_eq!(loan.unspent(), 0);
    }

    #[test]
    fn no_loan_for_a_refusal_or_an_algorithm_that_does_not_lend() {
        let quota = Quota::per_second(10).unwrap();
        let log = Policy::new("l", Algorithm::SlidingWindowLog, quota.clone()).unwrap();
        let d = Decision::allow(10, 5, 500_000, 0);
        assert!(Loan::new(0, &[&log], &grant(&log, d, 5), 1).is_none());
        let gcra = Policy::new("g", Algorithm::Gcra, quota.clone()).unwrap();
        assert!(Loan::new(0, &[&gcra], &grant(&gcra, d, 1), 1).is_none());
        let refused = Decision::limited(10, 0, 1_000_000, 100_000);
        assert!(Loan::new(0, &[&gcra], &grant(&gcra, refused, 5), 0).is_none());
    }
}
