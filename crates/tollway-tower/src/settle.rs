//! What a call leaves to do once its response has ended: settle what it reserved, and
//! give back the slots it held.
//!
//! Reserve, then settle: a request reserves its cost from a policy when it is admitted,
//! and the policy is settled to what the call used once the response has ended. A
//! request under a limit on calls in flight ([`Algorithm::Concurrency`]) holds its slots
//! from admission to the end of its response, renewed meanwhile ([`Renewals`]).
//!
//! The work is done when the response body ends, or when the call stops short: the
//! service fails, the client goes away before the response, or the body is dropped
//! before its end. A [`Settlement`] does it, and it runs as a [`Finish`]: polled by the
//! body at its end, or done on drop.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{Extensions, HeaderMap, StatusCode};
use parking_lot::Mutex;
use smallvec::SmallVec;
use tollway_core::{Algorithm, Checked, Operation, Policy, Store};

use crate::body::Finish;
use crate::key::Key;
use crate::report::Failures;

/// What settles calls after their responses: the store, the layer's policies, how its
/// settled policy is settled, the slots held, and how failed settlements are told.
///
/// The limiter holds one, and so does each settlement: a settlement never holds the
/// limiter.
pub(crate) struct Ledger<St> {
    pub(crate) store: St,
    /// The layer's policies, by the index the limits give them.
    policies: Arc<[Policy]>,
    pub(crate) settle: Option<Settle>,
    /// The slots of calls in flight, renewed until their calls end.
    pub(crate) renewals: Renewals,
    /// Failures of settlements and renewals (apart from the decisions': those may go on
    /// from a fallback while settlements fail).
    failures: Failures,
}

impl<St> Ledger<St> {
    /// The ledger of a layer deciding with `store` over `policies`.
    pub(crate) fn new(
        store: St,
        policies: Arc<[Policy]>,
        settle: Option<Settle>,
        failures: Failures,
    ) -> Self {
        Ledger {
            renewals: Renewals::new(&policies),
            store,
            policies,
            settle,
            failures,
        }
    }

    /// The policy at `index` in the layer's limits.
    fn policy(&self, index: usize) -> &Policy {
        &self.policies[index]
    }

    /// Whether calls leave anything for after their responses: a settled policy, or a
    /// limit on calls in flight.
    pub(crate) fn keeps_books(&self) -> bool {
        self.settle.is_some() || self.renewals.any()
    }

    /// Tells a failed settlement or renewal the way a failed decision is told.
    fn charged(&self, answer: Result<tollway_core::Decisions, tollway_core::StoreError>) {
        match answer {
            Ok(_) => self.failures.succeeded(),
            Err(error) => self
                .failures
                .failed(&error, "responses go unsettled for what they used"),
        }
    }
}

/// The operation that settles a call that reserved `reserved` units and used `used`:
/// the difference charged or refunded, or `None` when they are the same. The one rule of
/// the layer's settlements and the outbound layer's.
pub(crate) fn difference(used: u64, reserved: u64) -> Option<Operation> {
    match used.cmp(&reserved) {
        std::cmp::Ordering::Greater => Some(Operation::Charge(used - reserved)),
        std::cmp::Ordering::Less => Some(Operation::Refund(reserved - used)),
        std::cmp::Ordering::Equal => None,
    }
}

/// What a settled call reports it used, from its response's status, headers and
/// extensions; `None` when the response does not say.
pub(crate) type UsedFn =
    Arc<dyn Fn(StatusCode, &HeaderMap, &Extensions) -> Option<u64> + Send + Sync>;

/// Which policy a layer settles, how it learns what a call used, and what an unreported
/// call comes to.
pub(crate) struct Settle {
    /// The policy's index in the layer's limits.
    pub(crate) policy: usize,
    pub(crate) used: UsedFn,
    pub(crate) unsettled: Unsettled,
}

/// What a settled call's reservation comes to when nothing reported what it used:
/// neither the response nor the handler (through [`Usage`]) said.
///
/// What was reported is charged either way, however the call ended: a stream cut by
/// its client is charged what its handler reported so far.
///
/// | the call | [`Keep`](Self::Keep) | [`Refund`](Self::Refund) |
/// |---|---|---|
/// | reported what it used | charged that | charged that |
/// | answered (status below 400), then nothing reported | the reservation | the reservation |
/// | failed: the service's error, or a status of 400 or more | the reservation | given back |
/// | never answered (the client left before the response) | the reservation | given back |
///
/// A response that started is never refunded because the client went away, nor because
/// its body broke off. A client that read a whole stream and hung up before its usage
/// event would otherwise get its reservation back, call after call. A refund is for a
/// service that failed, not for a client that left.
///
/// A client can still make a call fail on purpose (a malformed request answered 400) or
/// leave before the response's head. Under `Refund` those give the reservation back. An
/// upstream that does its work before it answers (not streaming) was paid for all the
/// same: take `Keep` there, or report what it used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unsettled {
    /// The reservation stands: the call is taken to have used its estimate. The
    /// default: a budget never counts less than it may have spent.
    #[default]
    Keep,
    /// The reservation of a call that failed or was never answered is given back: the
    /// call is taken to have used nothing.
    Refund,
}

/// What a call used, as its handler reports it: the units the settled policy is
/// settled to when the response ends.
///
/// The layer puts one in the request's extensions when the request is admitted under
/// the settled policy (see
/// [`RateLimitLayerBuilder::settle`](crate::RateLimitLayerBuilder::settle)). A handler
/// that streams its answer reports as it goes: one [`add`](Self::add) per token or
/// event it hands on. The policy is settled to the total when the body ends, or when
/// the client drops it. So a stream its client cuts short is charged what it delivered.
/// A handler that reports only at the end (a model's final usage event) reports nothing
/// for a stream cut before it: see [`Unsettled`] for what such a call is charged.
///
/// # Examples
///
/// ```
/// use tollway_tower::Usage;
///
/// let usage = Usage::new();
/// assert_eq!(usage.get(), None);
/// // A token streamed, then another.
/// usage.add(1);
/// usage.add(1);
/// assert_eq!(usage.get(), Some(2));
/// // The model's usage event says 150 (its prompt's tokens too).
/// usage.at_least(150);
/// assert_eq!(usage.get(), Some(150));
/// usage.at_least(90);
/// assert_eq!(usage.get(), Some(150));
/// usage.set(90);
/// assert_eq!(usage.get(), Some(90));
/// ```
#[derive(Clone)]
pub struct Usage(Arc<AtomicU64>);

/// No usage reported yet.
const UNREPORTED: u64 = u64::MAX;

/// The most usage kept: more saturates here (past every capacity), short of
/// [`UNREPORTED`].
const MOST: u64 = u64::MAX - 1;

impl Usage {
    /// Nothing reported yet.
    #[must_use]
    pub fn new() -> Self {
        Usage(Arc::new(AtomicU64::new(UNREPORTED)))
    }

    /// Adds `units` to what the call used.
    pub fn add(&self, units: u64) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                let base = if now == UNREPORTED { 0 } else { now };
                Some(base.saturating_add(units).min(MOST))
            });
    }

    /// Says the call used `units` in all.
    pub fn set(&self, units: u64) {
        self.0.store(units.min(MOST), Ordering::Release);
    }

    /// Says the call used at least `units`: what was reported so far stands if it is
    /// more. For a total reported at the end of a stream whose parts were counted.
    pub fn at_least(&self, units: u64) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                let base = if now == UNREPORTED { 0 } else { now };
                Some(base.max(units.min(MOST)))
            });
    }

    /// What the call used, if anything reported it.
    #[must_use]
    pub fn get(&self) -> Option<u64> {
        match self.0.load(Ordering::Acquire) {
            UNREPORTED => None,
            used => Some(used),
        }
    }
}

impl Default for Usage {
    fn default() -> Self {
        Usage::new()
    }
}

impl fmt::Debug for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Usage").field(&self.get()).finish()
    }
}

/// What an admitted call leaves to do after its response: the caller's key, what its
/// request reserved from the settled policy (if that is one of its), the slots it
/// holds, and what the call reports using.
#[derive(Debug)]
pub(crate) struct Reservation {
    pub(crate) key: Key,
    pub(crate) reserved: Option<u64>,
    /// Each limit on calls in flight of the request: its index in the layer's limits,
    /// and the slots it took.
    pub(crate) slots: SmallVec<[(usize, u64); 1]>,
    /// The caller's own policy (a plan's quota) in place of the layer's at this index.
    pub(crate) own: Option<(usize, Arc<Policy>)>,
    pub(crate) usage: Usage,
}

impl Reservation {
    /// The policy at `index` for this caller: its own, or the layer's.
    fn policy<'a, St>(&'a self, ledger: &'a Ledger<St>, index: usize) -> &'a Policy {
        match &self.own {
            Some((at, own)) if *at == index => own,
            _ => ledger.policy(index),
        }
    }
}

/// The settling of one admitted call's reservation, and the giving back of its slots.
pub(crate) struct Settlement<St: Store> {
    ledger: Arc<Ledger<St>>,
    reservation: Reservation,
    /// The status the service answered with, once it answered.
    answered: Option<StatusCode>,
    state: State<St::Future>,
}

enum State<F> {
    /// Not started.
    Open,
    /// Operations to send, in order; the store is answering the one before, if any
    /// (boxed: a store that answers later does I/O anyway).
    Sending(SmallVec<[(usize, Operation); 2]>, Option<Pin<Box<F>>>),
    /// Done, or nothing to do.
    Done,
}

impl<St: Store> Settlement<St> {
    /// The work after the response to a call admitted with `reservation`; its slots are
    /// renewed until then.
    pub(crate) fn new(ledger: &Arc<Ledger<St>>, reservation: Reservation) -> Self {
        if !reservation.slots.is_empty() {
            ledger
                .renewals
                .hold(ledger, &reservation.key, &reservation.slots, 1);
        }
        Settlement {
            ledger: Arc::clone(ledger),
            reservation,
            answered: None,
            state: State::Open,
        }
    }

    /// What the handler reports it used, for it to report into: only for a call that
    /// is settled.
    pub(crate) fn usage(&self) -> Option<&Usage> {
        self.reservation.reserved.map(|_| &self.reservation.usage)
    }

    /// Notes that the service answered with `response`, and reads what it says the call
    /// used, if it says.
    pub(crate) fn read<R>(&mut self, response: &http::Response<R>) {
        let (status, headers) = (response.status(), response.headers());
        self.answered = Some(status);
        let Some(settle) = &self.ledger.settle else {
            return;
        };
        if let Some(used) = (settle.used)(status, headers, response.extensions()) {
            self.reservation.usage.set(used);
        }
    }

    /// The operation that settles the reservation: the difference between what the
    /// call used and what it reserved, or the rule's answer when nothing reported.
    fn settling(&self) -> Option<(usize, Operation)> {
        let reserved = self.reservation.reserved?;
        let settle = self.ledger.settle.as_ref()?;
        // A call that failed, or that was never answered (its client left first).
        let failed = self
            .answered
            .is_none_or(|status| status.is_client_error() || status.is_server_error());
        let (used, how) = match (self.reservation.usage.get(), settle.unsettled) {
            (Some(used), _) => (used, None),
            (None, Unsettled::Refund) if failed => (0, Some("given_back")),
            (None, Unsettled::Keep | Unsettled::Refund) => (reserved, Some("kept")),
        };
        let operation = difference(used, reserved);
        let settled = match operation {
            Some(Operation::Charge(_)) => "charged",
            Some(_) => "refunded",
            None => "exact",
        };
        #[cfg(feature = "metrics")]
        metrics::counter!(
            tollway_core::metric::SETTLEMENTS.name,
            "policy" => self.ledger.policy(settle.policy).name().to_owned(),
            "settled" => how.unwrap_or(settled),
        )
        .increment(1);
        let _ = (how, settled);
        Some((settle.policy, operation?))
    }

    /// Everything to send: the settlement, then the slots given back. The slots are no
    /// longer renewed from here on.
    fn operations(&self) -> SmallVec<[(usize, Operation); 2]> {
        let slots = &self.reservation.slots;
        if !slots.is_empty() {
            let ledger = &self.ledger;
            ledger
                .renewals
                .hold(ledger, &self.reservation.key, slots, -1);
        }
        let mut operations: SmallVec<[(usize, Operation); 2]> =
            self.settling().into_iter().collect();
        operations.extend(slots.iter().map(|&(i, cost)| (i, Operation::Refund(cost))));
        operations
    }

    /// Sends the operations left, in order, until one waits: `None` once all are done.
    fn send(&self, operations: &mut SmallVec<[(usize, Operation); 2]>) -> Option<St::Future> {
        while !operations.is_empty() {
            let (policy, operation) = operations.remove(0);
            let policy = self.reservation.policy(&self.ledger, policy);
            let key = self.reservation.key.as_bytes();
            match self.ledger.store.operate(key, &[policy], operation) {
                Checked::Ready(answer) => self.ledger.charged(answer),
                Checked::Pending(future) => return Some(future),
            }
        }
        None
    }
}

impl<St: Store> Finish for Settlement<St> {
    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            match &mut self.state {
                State::Open => self.state = State::Sending(self.operations(), None),
                State::Sending(operations, waiting) => {
                    if let Some(future) = waiting {
                        let answer = ready!(future.as_mut().poll(cx));
                        self.ledger.charged(answer);
                    }
                    let mut operations = std::mem::take(operations);
                    self.state = match self.send(&mut operations) {
                        Some(future) => State::Sending(operations, Some(Box::pin(future))),
                        None => State::Done,
                    };
                }
                State::Done => return Poll::Ready(()),
            }
        }
    }
}

impl<St: Store> Drop for Settlement<St> {
    /// The call stopped short, or its body was dropped: settles and frees now what
    /// answers at once, and lets a store that answers later finish on its own task.
    fn drop(&mut self) {
        let state = match std::mem::replace(&mut self.state, State::Done) {
            State::Done => return,
            State::Open => State::Sending(self.operations(), None),
            sending => sending,
        };
        // The same work, moved out of `self` (its slots already counted as given back).
        let mut rest = Settlement {
            ledger: Arc::clone(&self.ledger),
            reservation: Reservation {
                key: self.reservation.key.clone(),
                reserved: None,
                slots: SmallVec::new(),
                own: self.reservation.own.clone(),
                usage: Usage::new(),
            },
            answered: self.answered,
            state,
        };
        let mut at_once = Context::from_waker(std::task::Waker::noop());
        if rest.poll_finish(&mut at_once).is_ready() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(Orphan(rest));
            }
            // No runtime to finish on: what is left is dropped, and told as failed.
            Err(_) => rest.abandon("a response ended outside a tokio runtime"),
        }
    }
}

impl<St: Store> Settlement<St> {
    /// Drops what is left to send, told as failed: `why`.
    fn abandon(&mut self, why: &str) {
        self.state = State::Done;
        self.ledger.charged(Err(tollway_core::StoreError::new(
            tollway_core::StoreErrorKind::Other,
            format!("{why}: its settlement was dropped"),
        )));
    }
}

/// The rest of a settlement, finishing on a task of its own. Dropped before it is done
/// (its runtime shutting down), it is abandoned, not handed to yet another task: a
/// runtime that is shutting down drops a task as it is spawned.
struct Orphan<St: Store>(Settlement<St>);

impl<St: Store> Future for Orphan<St> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.poll_finish(cx)
    }
}

impl<St: Store> Drop for Orphan<St> {
    fn drop(&mut self) {
        if !matches!(self.0.state, State::Done) {
            self.0.abandon("a settlement's task ended before it did");
        }
    }
}

/// The slots of the calls in flight, renewed in the background until their calls end,
/// so that a long call keeps them. One task a layer's limits, started by the first
/// slot held; it stops with the limits.
pub(crate) struct Renewals {
    /// Slots held, by key and policy index.
    held: Mutex<HashMap<(Key, usize), u64>>,
    /// How often the slots are renewed: a third of the shortest lease, or `None` when
    /// no policy limits calls in flight.
    every: Option<Duration>,
    started: AtomicBool,
}

impl Renewals {
    /// The renewals of `policies`' slots.
    fn new(policies: &[Policy]) -> Self {
        let every = policies
            .iter()
            .filter(|p| p.algorithm() == Algorithm::Concurrency)
            .map(|p| p.quota().period() / 3)
            .min()
            .map(|d| d.max(Duration::from_millis(1)));
        Renewals {
            held: Mutex::new(HashMap::new()),
            every,
            started: AtomicBool::new(false),
        }
    }

    /// Whether any policy limits calls in flight.
    fn any(&self) -> bool {
        self.every.is_some()
    }

    /// Counts `slots` of `key` as held (`by` 1) or given back (`by` −1).
    fn hold<St: Store>(&self, ledger: &Arc<Ledger<St>>, key: &Key, slots: &[(usize, u64)], by: i8) {
        #[cfg(feature = "metrics")]
        for &(policy, cost) in slots {
            let name = ledger.policy(policy).name().to_owned();
            let gauge = metrics::gauge!(tollway_core::metric::IN_FLIGHT.name, "policy" => name);
            if by > 0 {
                gauge.increment(cost as f64);
            } else {
                gauge.decrement(cost as f64);
            }
        }
        {
            let mut held = self.held.lock();
            for &(policy, _) in slots {
                let entry = (key.clone(), policy);
                if by > 0 {
                    *held.entry(entry).or_insert(0) += 1;
                } else if let Some(count) = held.get_mut(&entry) {
                    *count -= 1;
                    if *count == 0 {
                        held.remove(&entry);
                    }
                }
            }
        }
        if by > 0 && !self.started.swap(true, Ordering::AcqRel) {
            self.start(Arc::downgrade(ledger));
        }
    }

    /// Renews every slot held, every `every`, while the limits live.
    fn start<St: Store>(&self, ledger: Weak<Ledger<St>>) {
        let (Some(every), Ok(runtime)) = (self.every, tokio::runtime::Handle::try_current()) else {
            return;
        };
        runtime.spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let Some(ledger) = ledger.upgrade() else {
                    return;
                };
                let held: Vec<(Key, usize)> = ledger.renewals.held.lock().keys().cloned().collect();
                for (key, policy) in held {
                    let policy = ledger.policy(policy);
                    let renewal =
                        ledger
                            .store
                            .operate(key.as_bytes(), &[policy], Operation::Charge(0));
                    ledger.charged(renewal.await);
                }
            }
        });
    }
}

#[cfg(test)]
mod in_flight;
#[cfg(test)]
mod tests;
