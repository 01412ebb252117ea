//! Reserve, then settle: a request reserves its cost from a policy when it is admitted,
//! and the policy is settled to what the call used once the response has ended.
//!
//! The work is done when the response body ends, or when the call stops short: the
//! service fails, the client goes away before the response, or the body is dropped
//! before its end. A [`Settlement`] does it, and it runs as a [`Finish`]: polled by the
//! body at its end, or done on drop.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use http::{Extensions, HeaderMap, StatusCode};
use tollway_core::{Checked, Operation, Store};

use crate::key::Key;
use crate::pipeline::Limiter;

/// Work left when a response ends: settling a reservation, say. The body polls it to
/// the end before it ends. Dropped before its end, it does what it can at once.
pub(crate) trait Finish: Send {
    /// Does the work; `Ready` once it is done.
    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<()>;
}

/// What a settled call reports it used, from its response's status, headers and
/// extensions; `None` when the response does not say.
pub(crate) type UsedFn =
    Arc<dyn Fn(StatusCode, &HeaderMap, &Extensions) -> Option<u32> + Send + Sync>;

/// Which policy a layer settles, how it learns what a call used, and what an unreported
/// call comes to.
pub(crate) struct Settle {
    /// The policy's index in the layer's limits.
    pub(crate) policy: usize,
    pub(crate) used: UsedFn,
    pub(crate) unsettled: Unsettled,
}

/// What a settled call's reservation comes to when nothing reported what it used.
///
/// That is when the service failed, when the client went away before the response, and
/// when neither the response nor the handler (through [`Usage`]) said.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unsettled {
    /// The reservation stands: the call is taken to have used its estimate. The
    /// default: a budget never counts less than it may have spent.
    #[default]
    Keep,
    /// The reservation is given back: the call is taken to have used nothing.
    Refund,
}

/// What a call used, as its handler reports it: the units the settled policy is
/// settled to when the response ends.
///
/// The layer puts one in the request's extensions when the request is admitted under
/// the settled policy (see
/// [`RateLimitLayerBuilder::settle`](crate::RateLimitLayerBuilder::settle)). A handler
/// that streams its answer reports as it goes, and the policy is settled to the total
/// when the body ends, or when the client drops it.
///
/// # Examples
///
/// ```
/// use tollway_tower::Usage;
///
/// let usage = Usage::new();
/// assert_eq!(usage.get(), None);
/// usage.add(120);
/// usage.add(30);
/// assert_eq!(usage.get(), Some(150));
/// usage.set(90);
/// assert_eq!(usage.get(), Some(90));
/// ```
#[derive(Clone)]
pub struct Usage(Arc<AtomicU64>);

/// No usage reported yet.
const UNREPORTED: u64 = u64::MAX;

impl Usage {
    /// Nothing reported yet.
    #[must_use]
    pub fn new() -> Self {
        Usage(Arc::new(AtomicU64::new(UNREPORTED)))
    }

    /// Adds `units` to what the call used.
    pub fn add(&self, units: u32) {
        // Saturates at u32::MAX, far from UNREPORTED.
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                let base = if now == UNREPORTED { 0 } else { now };
                Some((base + u64::from(units)).min(u64::from(u32::MAX)))
            });
    }

    /// Says the call used `units` in all.
    pub fn set(&self, units: u32) {
        self.0.store(u64::from(units), Ordering::Release);
    }

    /// What the call used, if anything reported it.
    #[must_use]
    pub fn get(&self) -> Option<u32> {
        match self.0.load(Ordering::Acquire) {
            UNREPORTED => None,
            // At most u32::MAX: `add` saturates there.
            used => Some(u32::try_from(used).unwrap_or(u32::MAX)),
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

/// A reservation to settle: the caller's key, what its request reserved from the
/// settled policy, and what the call reports using.
#[derive(Debug)]
pub(crate) struct Reservation {
    pub(crate) key: Key,
    pub(crate) reserved: u32,
    pub(crate) usage: Usage,
}

/// The settling of one admitted call's reservation.
pub(crate) struct Settlement<St: Store> {
    limiter: Arc<Limiter<St>>,
    reservation: Reservation,
    state: State<St::Future>,
}

enum State<F> {
    /// Not started.
    Open,
    /// The store is settling (boxed: a store that answers later does I/O anyway).
    Sent(Pin<Box<F>>),
    /// Settled, or nothing to settle.
    Done,
}

impl<St: Store> Settlement<St> {
    pub(crate) fn new(limiter: &Arc<Limiter<St>>, reservation: Reservation) -> Self {
        Settlement {
            limiter: Arc::clone(limiter),
            reservation,
            state: State::Open,
        }
    }

    /// What the handler reports it used, for it to report into.
    pub(crate) fn usage(&self) -> &Usage {
        &self.reservation.usage
    }

    /// Reads what the response says the call used, if it says.
    pub(crate) fn read<R>(&self, response: &http::Response<R>) {
        let Some(settle) = &self.limiter.settle else {
            return;
        };
        let (status, headers) = (response.status(), response.headers());
        if let Some(used) = (settle.used)(status, headers, response.extensions()) {
            self.reservation.usage.set(used);
        }
    }

    /// The operation that settles the reservation: the difference between what the
    /// call used and what it reserved, or the rule's answer when nothing reported.
    fn operation(&self) -> Option<Operation> {
        let reserved = self.reservation.reserved;
        let used = match self.reservation.usage.get() {
            Some(used) => used,
            None => match self.limiter.settle.as_ref()?.unsettled {
                Unsettled::Keep => return None,
                Unsettled::Refund => 0,
            },
        };
        match used.cmp(&reserved) {
            std::cmp::Ordering::Greater => Some(Operation::Charge(used - reserved)),
            std::cmp::Ordering::Less => Some(Operation::Refund(reserved - used)),
            std::cmp::Ordering::Equal => None,
        }
    }

    /// Sends the settling operation: done at once, or the store's future.
    fn send(&mut self) -> Option<St::Future> {
        let operation = self.operation()?;
        let settle = self.limiter.settle.as_ref()?;
        let policy = self.limiter.limits.policy(settle.policy);
        let key = self.reservation.key.as_bytes();
        match self.limiter.store.operate(key, &[policy], operation) {
            Checked::Ready(answer) => {
                self.limiter.charged(answer);
                None
            }
            Checked::Pending(future) => Some(future),
        }
    }
}

impl<St: Store> Finish for Settlement<St> {
    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            match &mut self.state {
                State::Open => {
                    self.state = match self.send() {
                        Some(future) => State::Sent(Box::pin(future)),
                        None => State::Done,
                    }
                }
                State::Sent(future) => {
                    let answer = ready!(future.as_mut().poll(cx));
                    self.limiter.charged(answer);
                    self.state = State::Done;
                }
                State::Done => return Poll::Ready(()),
            }
        }
    }
}

impl<St: Store> Drop for Settlement<St> {
    /// The call stopped short, or its body was dropped: settles now, and lets a store
    /// that answers later finish on its own task.
    fn drop(&mut self) {
        let future = match std::mem::replace(&mut self.state, State::Done) {
            State::Done => return,
            State::Open => match self.send() {
                Some(future) => Box::pin(future),
                None => return,
            },
            State::Sent(future) => future,
        };
        let limiter = Arc::clone(&self.limiter);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let answer = future.await;
                    limiter.charged(answer);
                });
            }
            // No runtime to finish on: the operation is dropped, and told as failed.
            Err(_) => limiter.charged(Err(tollway_core::StoreError::new(
                tollway_core::StoreErrorKind::Other,
                "a response ended outside a tokio runtime: its settlement was dropped",
            ))),
        }
    }
}

#[cfg(test)]
mod tests;
