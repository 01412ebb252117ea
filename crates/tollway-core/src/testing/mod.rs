//! Conformance suites (feature `testing`): prove a store decides like the memory store.
//!
//! A [`Store`] of your own passes when it gives the decisions the [`MemoryStore`] gives,
//! field by field. [`Conformance`] replays a seeded random trace through both. Both run
//! on one [`ManualClock`], which your store must read. There are three suites:
//!
//! - [`one_limit`](Conformance::one_limit): every algorithm, one limit a request, with
//!   uneven rates, bursts, costs of 0 and over the capacity, and long idle stretches.
//! - [`all_or_nothing`](Conformance::all_or_nothing): one to four limits of different
//!   algorithms a request. So a request refused by one limit must charge none of them.
//!   One event in four is an [`Operation`]: a peek, charge, refund, reset or drain.
//! - [`lending`](Conformance::lending): loans ([`Store::lend`]) of one or two limits,
//!   the units and decisions of each grant.
//!
//! Each suite panics at the first decision that differs, naming the event. It checks
//! that its trace is not vacuous: the trace admits, limits and refuses. A suite needs no
//! runtime of its own. Await it on the one your store runs on.
//!
//! # Examples
//!
//! The memory store proves itself, on a clock it reads:
//!
//! ```
//! use tollway_core::testing::Conformance;
//! use tollway_core::{ManualClock, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tollway_core::ConfigError> {
//! let clock = ManualClock::new();
//! let store = MemoryStore::builder().clock(clock.clone()).build()?;
//!
//! let report = Conformance::new(2_000).one_limit(&store, &clock).await;
//! assert_eq!(report.events(), 2_000 * 8); // every algorithm, and calls in flight
//! Conformance::new(2_000).all_or_nothing(&store, &clock).await;
//! # Ok(())
//! # }
//! ```
//!
//! A store with a local deny cache may answer a repeated refusal from memory. The limits
//! that did not refuse may then report fewer units than they have, never more. Say so,
//! and name the run in its messages:
//!
//! ```
//! use tollway_core::testing::Conformance;
//! use tollway_core::{ManualClock, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tollway_core::ConfigError> {
//! let clock = ManualClock::new();
//! let store = MemoryStore::builder().clock(clock.clone()).build()?;
//!
//! let suite = Conformance::new(1_000)
//!     .named("cached")
//!     .stale_remaining_when_refused();
//! let report = suite.all_or_nothing(&store, &clock).await;
//! // The keys and policies it used: a store can check what it kept for them.
//! assert!(report.used().count() > 0);
//! # Ok(())
//! # }
//! ```

use std::future::IntoFuture;
use std::time::Duration;

use crate::{Algorithm, Decision, Decisions, Denial, ManualClock, MemoryStore, Operation, Policy};
use crate::{Clock, MAX_UNITS, Quota, Store};

mod trace;

pub use trace::{Rng, cost};
use trace::{changed, gap, quotas};

/// A conformance run: how many events, from which seed, what the store may answer
/// differently. See the [module docs](self).
#[derive(Clone, Debug)]
#[must_use]
pub struct Conformance {
    events: usize,
    seed: Option<u64>,
    name: String,
    stale_remaining: bool,
}

/// What a conformance run did: how many events, and which keys under which policies.
#[derive(Debug)]
pub struct Report {
    events: usize,
    used: Vec<(Vec<u8>, Policy)>,
}

impl Report {
    /// The events replayed: requests and operations.
    #[must_use]
    pub fn events(&self) -> usize {
        self.events
    }

    /// Each key and policy the run used, once.
    pub fn used(&self) -> impl Iterator<Item = (&[u8], &Policy)> {
        self.used
            .iter()
            .map(|(key, policy)| (key.as_slice(), policy))
    }

    fn record(&mut self, key: &str, policy: &Policy) {
        let seen = self
            .used
            .iter()
            .any(|(k, p)| k.as_slice() == key.as_bytes() && p == policy);
        if !seen {
            self.used.push((key.as_bytes().to_vec(), policy.clone()));
        }
    }
}

impl Conformance {
    /// A run of `events` events (in [`one_limit`](Self::one_limit), for each algorithm).
    pub fn new(events: usize) -> Self {
        Conformance {
            events,
            seed: None,
            name: "store".to_owned(),
            stale_remaining: false,
        }
    }

    /// The trace's seed: each seed is another trace. Each suite has a default.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// What the messages call the store.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Accepts a refusal answered from a local deny cache: a limit that did not refuse
    /// may report fewer remaining units than it has (never more), with the same reset.
    /// Who is refused, and why, must still be exact.
    pub fn stale_remaining_when_refused(mut self) -> Self {
        self.stale_remaining = true;
        self
    }

    /// Replays the trace one limit a request, for every [`Algorithm`], through `store`
    /// and a memory store on `clock`; a new policy (so new keys) every fifth of the
    /// trace. Each policy's quota changes three times in its fifth: raised, cut, and its
    /// burst changed, so callers' usage is carried across each change. `store` must read
    /// `clock`, which the suite moves forward.
    ///
    /// # Panics
    ///
    /// At the first decision that differs from the memory store's, or that `store`
    /// fails; or when the trace admits, limits or refuses under 1% of its events (too
    /// few events to mean anything).
    pub async fn one_limit<S: Store>(&self, store: &S, clock: &ManualClock) -> Report {
        const CALLERS: u64 = 6;
        let memory = twin(clock);
        let mut rng = Rng(self.seed.unwrap_or(0x7011_6a7e));
        let segment = self.events.div_ceil(5);
        let mut report = Report {
            events: 0,
            used: Vec::new(),
        };
        for algorithm in Algorithm::ALL {
            let quotas = quotas(algorithm);
            let mut counts = [0usize; 3];
            for i in 0..self.events {
                let base = &quotas[(i / segment) % quotas.len()];
                let quota = changed(algorithm, base, (i % segment * 4 / segment) as u64);
                let name = format!("conf{}", i / segment);
                let policy = Policy::new(name, algorithm, quota.clone()).expect("a valid policy");
                let now = clock.now_micros();
                clock.set_micros(now + gap(&mut rng, now, &quota));
                let cost = cost(&mut rng, &quota, algorithm);
                let caller = format!("caller-{}", rng.below(CALLERS));
                let expected = memory.check_sync(caller.as_bytes(), &policy, cost);
                let context = || {
                    format!(
                        "{}: {algorithm:?} event {i} {caller} at {} cost {cost} quota {quota:?}",
                        self.name,
                        clock.now_micros()
                    )
                };
                let got = answer(store.check(caller.as_bytes(), &[&policy], cost), &context).await;
                assert_eq!(got.len(), 1, "{}", context());
                assert_eq!(got[0], expected, "{}", context());
                counts[outcome(&expected)] += 1;
                report.events += 1;
                report.record(&caller, &policy);
            }
            // The trace is not vacuous: it admits, limits and refuses (each at least 1%).
            assert!(
                counts.iter().all(|&n| n >= self.events / 100),
                "{}: {algorithm:?} (admitted, limited, refused): {counts:?}",
                self.name
            );
        }
        report
    }

    /// Replays the trace of requests against one to four limits of different
    /// algorithms (chosen afresh each request, so their states interleave) through
    /// `store` and a memory store on `clock`. One request in three under several limits
    /// costs each its own ([`Store::check_each`]). Every decision of every limit must match,
    /// and so must the all-or-nothing rule: a refused request charges no limit. One
    /// event in four is an [`Operation`] instead, whose answers must match too. The
    /// policies' limits change three times over the trace (raised, cut, the burst). `store`
    /// must read `clock`, which the suite moves forward.
    ///
    /// # Panics
    ///
    /// At the first answer that differs from the memory store's, or that `store` fails.
    /// Also when the trace is vacuous. It is vacuous when under a tenth of its requests
    /// are admitted, or under a twenty-fifth are refused by one limit while another had
    /// room. It is also vacuous when operations are under 1% of it.
    pub async fn all_or_nothing<S: Store>(&self, store: &S, clock: &ManualClock) -> Report {
        const CALLERS: u64 = 3;
        let memory = twin(clock);
        let mut rng = Rng(self.seed.unwrap_or(0x0a11_0f0e));
        // The policies' quotas change three times over the trace, as in `one_limit`.
        let pools: Vec<Vec<Policy>> = (0..4)
            .map(|phase| {
                Algorithm::ALL
                    .iter()
                    .enumerate()
                    .map(|(i, &algorithm)| {
                        let quota = changed(algorithm, &quotas(algorithm)[i % 3], phase);
                        Policy::new(format!("multi{i}"), algorithm, quota).expect("a valid policy")
                    })
                    .collect()
            })
            .collect();
        let mut report = Report {
            events: 0,
            used: Vec::new(),
        };
        let (mut admitted, mut refused_with_room, mut multi) = (0, 0, 0);
        let mut operations = [0usize; 5];
        for i in 0..self.events {
            let n = 1 + rng.below(4) as usize;
            let chosen = choose(&mut rng, &pools[i * 4 / self.events.max(1)], n);
            let now = clock.now_micros();
            clock.set_micros(now + gap(&mut rng, now, chosen[0].quota()));
            let cost = cost(&mut rng, chosen[0].quota(), chosen[0].algorithm()).min(3);
            let caller = format!("caller-{}", rng.below(CALLERS));
            let names: Vec<&str> = chosen.iter().map(|p| p.name()).collect();
            report.events += 1;
            for p in &chosen {
                report.record(&caller, p);
            }
            // One event in four looks at or corrects the state instead of checking.
            let operation = match rng.below(20) {
                0 => Some((0, Operation::Peek(cost))),
                1 => Some((1, Operation::Charge(units(&mut rng)))),
                2 => Some((2, Operation::Refund(units(&mut rng)))),
                3 => Some((3, Operation::Reset)),
                4 => Some((4, Operation::Drain(rng.below(12)))),
                _ => None,
            };
            if let Some((kind, operation)) = operation {
                let expected = memory.apply(caller.as_bytes(), &chosen, operation);
                let context = || {
                    format!(
                        "{}: event {i} {caller} at {} {operation:?} limits {names:?}",
                        self.name,
                        clock.now_micros()
                    )
                };
                let got = answer(
                    store.operate(caller.as_bytes(), &chosen, operation),
                    &context,
                );
                assert_eq!(got.await, expected, "{}", context());
                operations[kind] += 1;
                continue;
            }
            // One request in three under several limits costs each its own.
            let each: Option<Vec<u64>> = (chosen.len() > 1 && rng.below(3) == 0).then(|| {
                let mut each: Vec<u64> = chosen
                    .iter()
                    .map(|p| trace::cost(&mut rng, p.quota(), p.algorithm()).min(3))
                    .collect();
                each[0] = cost;
                each
            });
            let context = || {
                format!(
                    "{}: event {i} {caller} at {} cost {cost} (each {each:?}) limits {names:?}",
                    self.name,
                    clock.now_micros()
                )
            };
            let (expected, got) = match &each {
                Some(costs) => {
                    multi += 1;
                    let expected = memory.decide_each(caller.as_bytes(), &chosen, costs);
                    let got = store.check_each(caller.as_bytes(), &chosen, costs);
                    (expected, answer(got, &context).await)
                }
                None => {
                    let expected = memory.decide(caller.as_bytes(), &chosen, cost);
                    let got = store.check(caller.as_bytes(), &chosen, cost);
                    (expected, answer(got, &context).await)
                }
            };
            self.compare(&got, &expected, &context);
            if expected.is_allowed() {
                admitted += 1;
            } else if expected.iter().any(Decision::is_allowed) {
                refused_with_room += 1;
            }
        }
        // The trace is not vacuous: requests pass, and requests are refused by one limit
        // while another had room (the case all-or-nothing is about).
        let name = &self.name;
        assert!(admitted >= self.events / 10, "{name}: {admitted} admitted");
        assert!(
            multi >= self.events / 20,
            "{name}: {multi} requests of a cost a limit"
        );
        assert!(
            operations.iter().all(|&n| n >= self.events / 100),
            "{name}: operations (peek, charge, refund, reset, drain): {operations:?}"
        );
        assert!(
            refused_with_room >= self.events / 25,
            "{name}: {refused_with_room} refused with room"
        );
        report
    }

    /// Replays a trace of loans ([`Store::lend`]) through `store` and a memory store on
    /// `clock`: one or two limits of the algorithms that [lend](Algorithm::lends), a
    /// cost from 0 to past the capacity, and up to twice the capacity asked. One event
    /// in four is a request instead, so that loans meet states requests left. One loan
    /// in three gives units back ([`Store::give_back`]), at once or a period later. Every
    /// grant must match, units and decisions, and so must the states after a give-back. `store` must read `clock`, which the
    /// suite moves forward.
    ///
    /// # Panics
    ///
    /// At the first answer that differs from the memory store's, or when `store` fails
    /// or lends nothing for a policy that lends. Also when the trace is vacuous: under a
    /// tenth of its loans lend more than their cost, or under a twentieth are refused.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_core::testing::Conformance;
    /// use tollway_core::{ManualClock, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tollway_core::ConfigError> {
    /// let clock = ManualClock::new();
    /// let store = MemoryStore::builder().clock(clock.clone()).build()?;
    /// Conformance::new(2_000).lending(&store, &clock).await;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lending<S: Store>(&self, store: &S, clock: &ManualClock) -> Report {
        const CALLERS: u64 = 3;
        let memory = twin(clock);
        let mut rng = Rng(self.seed.unwrap_or(0x1e4d_5eed));
        let pool: Vec<Policy> = Algorithm::ALL
            .iter()
            .filter(|a| a.lends())
            .enumerate()
            .flat_map(|(i, &algorithm)| {
                let quotas = quotas(algorithm);
                [i, i + 2].map(|q| {
                    Policy::new(
                        format!("lend{i}-{q}"),
                        algorithm,
                        quotas[q % quotas.len()].clone(),
                    )
                    .expect("a valid policy")
                })
            })
            .collect();
        let mut report = Report {
            events: 0,
            used: Vec::new(),
        };
        let (mut lent, mut refused, mut loans, mut given, mut freed) = (0, 0, 0, 0, 0);
        for i in 0..self.events {
            let n = 1 + rng.below(2) as usize;
            let chosen = choose(&mut rng, &pool, n);
            let now = clock.now_micros();
            clock.set_micros(now + gap(&mut rng, now, chosen[0].quota()));
            let (first, algorithm) = (chosen[0].quota(), chosen[0].algorithm());
            let cost = cost(&mut rng, first, algorithm);
            let capacity = if algorithm.uses_burst() {
                first.burst()
            } else {
                first.limit()
            };
            let ask = rng.below(2 * capacity + 1);
            let caller = format!("caller-{}", rng.below(CALLERS));
            let names: Vec<&str> = chosen.iter().map(|p| p.name()).collect();
            report.events += 1;
            for p in &chosen {
                report.record(&caller, p);
            }
            let context = || {
                format!(
                    "{}: event {i} {caller} at {} cost {cost} ask {ask} limits {names:?}",
                    self.name,
                    clock.now_micros()
                )
            };
            if rng.below(4) == 0 {
                let expected = memory.decide(caller.as_bytes(), &chosen, cost);
                let got = answer(store.check(caller.as_bytes(), &chosen, cost), &context).await;
                assert_eq!(got, expected, "{}", context());
                continue;
            }
            let expected = memory
                .lend(caller.as_bytes(), &chosen, cost, ask)
                .expect("the memory store lends every lending policy")
                .await
                .unwrap_or_else(|e| panic!("{}: the memory store failed: {e}", context()));
            let got = store
                .lend(caller.as_bytes(), &chosen, cost, ask)
                .unwrap_or_else(|| panic!("{}: the store lends nothing", context()))
                .await
                .unwrap_or_else(|e| panic!("{}: the store failed: {e}", context()));
            assert_eq!(got, expected, "{}", context());
            loans += 1;
            if expected.units() > cost {
                lent += 1;
                // One loan in three gives some of its units back at once, or a window
                // later (to a window that has ended, or a later one): both stores take
                // them off the same counts, or keep their state alike.
                if rng.below(3) == 0 {
                    let units = 1 + rng.below(expected.units() - cost);
                    let ends: Vec<u64> = chosen
                        .iter()
                        .zip(expected.decisions().iter())
                        .map(|(p, d)| crate::store::lend::window_end(p, d, expected.at()))
                        .collect();
                    if rng.below(2) == 0 {
                        let now = clock.now_micros();
                        clock.set_micros(now + chosen[0].quota().period_micros());
                    }
                    let context = || format!("{}: giving back {units} of {ends:?}", context());
                    let peek = Operation::Peek(0);
                    let before = memory.apply(caller.as_bytes(), &chosen, peek);
                    memory
                        .give_back(caller.as_bytes(), &chosen, units, &ends)
                        .expect("the memory store takes units back")
                        .await
                        .unwrap_or_else(|e| panic!("{}: the memory store failed: {e}", context()));
                    store
                        .give_back(caller.as_bytes(), &chosen, units, &ends)
                        .unwrap_or_else(|| panic!("{}: the store takes nothing back", context()))
                        .await
                        .unwrap_or_else(|e| panic!("{}: the store failed: {e}", context()));
                    let expected = memory.apply(caller.as_bytes(), &chosen, peek);
                    let got = answer(store.operate(caller.as_bytes(), &chosen, peek), &context);
                    assert_eq!(got.await, expected, "{}", context());
                    given += 1;
                    freed += usize::from(before != expected);
                }
            }
            if !expected.decisions().is_allowed() {
                refused += 1;
            }
        }
        let name = &self.name;
        assert!(lent >= loans / 10, "{name}: {lent} of {loans} loans lent");
        assert!(
            refused >= loans / 20,
            "{name}: {refused} of {loans} loans refused"
        );
        assert!(
            given >= loans / 40,
            "{name}: {given} of {loans} loans gave units back"
        );
        assert!(
            freed >= given / 10,
            "{name}: {freed} of {given} give-backs freed units"
        );
        report
    }

    /// `got` against `expected`, with the allowance of
    /// [`stale_remaining_when_refused`](Self::stale_remaining_when_refused).
    fn compare(&self, got: &Decisions, expected: &Decisions, context: &impl Fn() -> String) {
        if !self.stale_remaining || expected.is_allowed() {
            assert_eq!(got, expected, "{}", context());
            return;
        }
        assert_eq!(got.len(), expected.len(), "{}", context());
        for (g, e) in got.iter().zip(expected.iter()) {
            if e.is_allowed() {
                assert!(
                    g.is_allowed() && g.remaining() <= e.remaining(),
                    "{}: {g:?} reports more than {e:?}",
                    context()
                );
                assert_eq!(g.reset_after(), e.reset_after(), "{}", context());
            } else {
                assert_eq!(g, e, "{}", context());
            }
        }
    }
}

/// The units of a charge or refund: mostly a few, sometimes many capacities (a debt
/// kept), sometimes the most there is (a debt at its bound).
fn units(rng: &mut Rng) -> u64 {
    match rng.below(8) {
        0 => [u64::MAX, MAX_UNITS, u64::from(u32::MAX)][rng.below(3) as usize],
        1 => 1 + rng.below(5_000),
        _ => 1 + rng.below(12),
    }
}

/// `n` different policies of `pool`, at random.
fn choose<'p>(rng: &mut Rng, pool: &'p [Policy], n: usize) -> Vec<&'p Policy> {
    let mut chosen: Vec<&Policy> = Vec::new();
    while chosen.len() < n {
        let p = &pool[rng.below(pool.len() as u64) as usize];
        if !chosen.iter().any(|c| c.name() == p.name()) {
            chosen.push(p);
        }
    }
    chosen
}

/// The memory store the suites compare with, on the store's clock.
fn twin(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::builder()
        .clock(clock.clone())
        .build()
        .expect("a memory store with no bounds builds")
}

/// The store's answer, or a panic naming the event it failed.
async fn answer(
    checked: impl IntoFuture<Output = Result<Decisions, crate::StoreError>>,
    context: &impl Fn() -> String,
) -> Decisions {
    checked
        .await
        .unwrap_or_else(|e| panic!("{}: the store failed: {e}", context()))
}

/// Which of admitted (0), limited (1) and refused otherwise (2) a decision is, to show
/// a trace exercises all three.
fn outcome(decision: &Decision) -> usize {
    match decision.denial() {
        None => 0,
        Some(Denial::Limited) => 1,
        Some(_) => 2,
    }
}

/// A quota of `limit` a `period`, with `burst` where the algorithm has one.
fn quota(algorithm: Algorithm, limit: u32, period: Duration, burst: u32) -> Quota {
    let q = Quota::with_period(limit.into(), period).expect("a valid quota");
    if algorithm.uses_burst() {
        q.with_burst(burst.into()).expect("a valid burst")
    } else {
        q
    }
}
